"""Audit of standalone work and of submits inside the caller's own transaction.

``enqueue`` / ``enqueue_tx`` / ``enqueue_many``, ``submit_tx`` / ``submit_once_tx``, unique keys
(held, freed, raced by two transactions), ``scheduled_at`` (past, far future, naive, across a
pause), priorities in one queue, sequence keys across a pause, transactional steps, and the
async client's equivalents.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import IsolationLevel

from cyclone_dsl import (
    AsyncClient,
    Client,
    InvalidArgument,
    InvalidTransition,
    RunState,
    StepContext,
    StepState,
    Worker,
    action,
    step,
    workflow,
)
from cyclone_dsl.db.tx import ConnectionTx
from cyclone_dsl.engine import Engine
from tests.waiting import wait_until

StartWorker = Callable[..., Worker]

#: What the recording handlers saw, in the order they ran: (label, value).
seen: list[tuple[str, object]] = []
seen_lock = threading.Lock()


def note(label: str, value: object) -> None:
    with seen_lock:
        seen.append((label, value))


def seen_for(label: str) -> list[object]:
    with seen_lock:
        return [v for k, v in seen if k == label]


@pytest.fixture(autouse=True)
def _clear_seen() -> None:
    with seen_lock:
        seen.clear()


@step(name="sta_echo")
def echo(x: object) -> object:
    return x


@action(name="sta_record", queue="sta_order")
def record(x: object) -> None:
    note("record", x)


@action(name="sta_seq")
def seq(x: object) -> None:
    note("seq", x)


@step(name="sta_fail", max_attempts=1)
def always_fails(x: object) -> object:
    raise RuntimeError(f"sta_fail {x}")


@step(name="sta_block")
def block(x: object, ctx: StepContext) -> object:
    # Holds its slot until the run is cancelled (or 10 s pass).
    ctx.wait_cancelled(10)
    return x


@workflow(name="sta_wf")
def wf(x):  # type: ignore[no-untyped-def]
    return echo(x)


@step(name="sta_tx_flaky", transactional=True, max_attempts=3)
def tx_flaky(x: int, *, ctx: StepContext) -> int:
    row = ctx.connection.execute("SELECT count(*) FROM sta_ledger").fetchone()
    assert row is not None
    note("tx_flaky_saw", int(row[0]))
    ctx.connection.execute("INSERT INTO sta_ledger (note) VALUES (%s)", (f"attempt {ctx.attempt}",))
    if ctx.attempt == 1:
        raise RuntimeError("first attempt fails after its write")
    return x


@step(name="sta_tx_raises", transactional=True, max_attempts=1)
def tx_raises(x: int, *, ctx: StepContext) -> int:
    ctx.connection.execute("INSERT INTO sta_ledger (note) VALUES ('doomed')")
    raise RuntimeError("no")


#: The client the outbox handler enqueues with (set by the test that uses it).
outbox_client: list[Client] = []


@step(name="sta_tx_outbox", transactional=True, max_attempts=2)
def tx_outbox(x: int, *, ctx: StepContext) -> int:
    (client,) = outbox_client
    client.enqueue_tx(ctx.connection, echo, {"from": ctx.attempt}, unique_key=f"outbox-{x}")
    ctx.connection.execute("INSERT INTO sta_ledger (note) VALUES (%s)", (f"attempt {ctx.attempt}",))
    if ctx.attempt == 1:
        raise RuntimeError("first attempt fails after enqueueing")
    return x


@pytest.fixture
def ledger(cyclone_dsn: str) -> Callable[[], list[str]]:
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE sta_ledger (id serial PRIMARY KEY, note text)")

    def rows() -> list[str]:
        with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
            return [str(r[0]) for r in conn.execute("SELECT note FROM sta_ledger ORDER BY id")]

    return rows


def counts(dsn: str) -> tuple[int, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM cyclone_runs), (SELECT count(*) FROM cyclone_steps)"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def backend_waits_on_lock(dsn: str, pid: int) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
    return row is not None and row[0] == "Lock"


class Racer(threading.Thread):
    """Runs ``call`` on its own thread; keeps the result or the exception."""

    def __init__(self, call: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.call = call
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.call()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def outcome(self, timeout: float = 10) -> Any:
        self.join(timeout)
        assert not self.is_alive(), "the racer is still blocked"
        if self.error is not None:
            raise self.error
        return self.result


# -- the caller's transaction ---------------------------------------------------------


def test_enqueue_tx_exists_iff_the_caller_commits(client: Client, cyclone_dsn: str, ledger) -> None:  # type: ignore[no-untyped-def]
    with psycopg.connect(cyclone_dsn) as conn:
        conn.execute("INSERT INTO sta_ledger (note) VALUES ('rolled back')")
        client.enqueue_tx(conn, echo, 1, unique_key="u1", sequence_key="s1")
        conn.rollback()
        assert counts(cyclone_dsn) == (0, 0)
        assert ledger() == []
        conn.execute("INSERT INTO sta_ledger (note) VALUES ('kept')")
        handle = client.enqueue_tx(conn, echo, 2, unique_key="u1", sequence_key="s1")
        assert handle.created
        assert counts(cyclone_dsn) == (0, 0), "visible before the caller's commit"
        conn.commit()
    assert ledger() == ["kept"]
    run = client.get_run(handle.id)
    assert run.workflow == "sta_echo"
    assert [s.state for s in run.steps] == [StepState.AVAILABLE]


def test_a_rolled_back_savepoint_leaves_nothing_and_the_outer_commit_keeps_the_rest(
    client: Client, cyclone_dsn: str, ledger
) -> None:  # type: ignore[no-untyped-def]
    with psycopg.connect(cyclone_dsn) as conn:
        conn.execute("INSERT INTO sta_ledger (note) VALUES ('outer')")
        with conn.transaction():  # a savepoint, rolled back by psycopg.Rollback
            client.enqueue_tx(conn, echo, 1, unique_key="sp")
            client.submit_once_tx(conn, wf, 1, key="sp-once")
            client.submit_tx(conn, wf, 1)
            raise psycopg.Rollback
        # The key and the once-key are free again inside the same transaction.
        again = client.enqueue_tx(conn, echo, 2, unique_key="sp")
        once = client.submit_once_tx(conn, wf, 2, key="sp-once")
        assert again.created and once.created
        conn.commit()
    assert ledger() == ["outer"]
    assert counts(cyclone_dsn) == (2, 2)
    assert client.get_run(again.id).steps[0].input == 2
    assert client.get_run(once.id).input == 2


def test_enqueue_tx_on_an_autocommit_connection_commits_on_its_own(
    client: Client, cyclone_dsn: str
) -> None:
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        handle = client.enqueue_tx(conn, echo, 5, unique_key="auto")
        assert counts(cyclone_dsn) == (1, 1)
        assert client.enqueue_tx(conn, echo, 6, unique_key="auto").id == handle.id
    assert counts(cyclone_dsn) == (1, 1)


def test_a_refused_enqueue_tx_leaves_the_callers_transaction_usable(
    client: Client, cyclone_dsn: str, ledger
) -> None:  # type: ignore[no-untyped-def]
    with psycopg.connect(cyclone_dsn) as conn:
        conn.execute("INSERT INTO sta_ledger (note) VALUES ('mine')")
        with pytest.raises(InvalidArgument):
            client.enqueue_tx(conn, echo, 1, scheduled_at=datetime(2030, 1, 1))  # naive
        with pytest.raises(InvalidArgument):
            client.enqueue_tx(conn, echo, float("nan"))
        with pytest.raises(InvalidArgument):
            client.enqueue_tx(conn, echo, 1, unique_key="")
        handle = client.enqueue_tx(conn, echo, 1)
        conn.commit()
    assert ledger() == ["mine"]
    assert counts(cyclone_dsn) == (1, 1)
    assert client.get_run(handle.id).state is RunState.RUNNING


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_two_transactions_racing_one_unique_key_make_one_holder(
    client: Client, cyclone_dsn: str, outcome: str
) -> None:
    with (
        psycopg.connect(cyclone_dsn) as first,
        psycopg.connect(cyclone_dsn) as second,
    ):
        held = client.enqueue_tx(first, echo, "first", unique_key="race")
        second.execute("SELECT 1")
        pid = second.info.backend_pid
        racer = Racer(lambda: client.enqueue_tx(second, echo, "second", unique_key="race"))
        racer.start()
        wait_until(
            lambda: backend_waits_on_lock(cyclone_dsn, pid), timeout=5, what="second blocked"
        )
        if outcome == "commit":
            first.commit()
        else:
            first.rollback()
        got = racer.outcome()
        second.commit()
    if outcome == "commit":
        assert got.id == held.id and not got.created
        assert counts(cyclone_dsn) == (1, 1)
    else:
        assert got.created and got.id != held.id
        assert client.get_run(got.id).steps[0].input == "second"
        assert counts(cyclone_dsn) == (1, 1)


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_two_transactions_racing_one_once_key_make_one_run(
    client: Client, cyclone_dsn: str, outcome: str
) -> None:
    with (
        psycopg.connect(cyclone_dsn) as first,
        psycopg.connect(cyclone_dsn) as second,
    ):
        held = client.submit_once_tx(first, wf, "first", key="once-race")
        second.execute("SELECT 1")
        pid = second.info.backend_pid
        racer = Racer(lambda: client.submit_once_tx(second, wf, "second", key="once-race"))
        racer.start()
        wait_until(
            lambda: backend_waits_on_lock(cyclone_dsn, pid), timeout=5, what="second blocked"
        )
        if outcome == "commit":
            first.commit()
        else:
            first.rollback()
        got = racer.outcome()
        second.commit()
    assert counts(cyclone_dsn) == (1, 1)
    if outcome == "commit":
        assert got.id == held.id and not got.created
    else:
        assert got.created and client.get_run(got.id).input == "second"


def test_submit_once_tx_from_eight_threads_makes_one_run(client: Client, cyclone_dsn: str) -> None:
    barrier = threading.Barrier(8)

    def one() -> tuple[int, bool]:
        with psycopg.connect(cyclone_dsn) as conn:
            barrier.wait()
            handle = client.submit_once_tx(conn, wf, 1, key="eight")
            time.sleep(0.05)  # hold the transaction open a little
            conn.commit()
            return handle.id, handle.created

    racers = [Racer(one) for _ in range(8)]
    for r in racers:
        r.start()
    results = [r.outcome(timeout=15) for r in racers]
    assert len({run_id for run_id, _ in results}) == 1
    assert sum(created for _, created in results) == 1
    assert counts(cyclone_dsn) == (1, 1)


@pytest.mark.parametrize(
    "level",
    [IsolationLevel.REPEATABLE_READ, IsolationLevel.SERIALIZABLE],
    ids=["repeatable_read", "serializable"],
)
def test_enqueue_tx_in_a_repeatable_read_or_serializable_transaction(
    client: Client, cyclone_dsn: str, level: IsolationLevel
) -> None:
    with psycopg.connect(cyclone_dsn) as conn:
        conn.isolation_level = level
        first = client.enqueue_tx(conn, echo, 1, unique_key="iso")
        again = client.enqueue_tx(conn, echo, 2, unique_key="iso")
        once = client.submit_once_tx(conn, wf, 1, key="iso")
        once_again = client.submit_once_tx(conn, wf, 2, key="iso")
        conn.commit()
    assert first.created and again.id == first.id and not again.created
    assert once.created and once_again.id == once.id and not once_again.created
    assert counts(cyclone_dsn) == (2, 2)


@pytest.mark.parametrize("method", ["enqueue_tx", "submit_once_tx"])
@pytest.mark.parametrize(
    "level",
    [IsolationLevel.REPEATABLE_READ, IsolationLevel.SERIALIZABLE],
    ids=["repeatable_read", "serializable"],
)
def test_a_snapshot_caller_losing_a_key_race_gets_a_serialization_failure(
    client: Client, cyclone_dsn: str, method: str, level: IsolationLevel
) -> None:
    def call(conn: psycopg.Connection[Any], value: str) -> Any:
        if method == "enqueue_tx":
            return client.enqueue_tx(conn, echo, value, unique_key="rr")
        return client.submit_once_tx(conn, wf, value, key="rr")

    with (
        psycopg.connect(cyclone_dsn) as first,
        psycopg.connect(cyclone_dsn) as second,
    ):
        second.isolation_level = level
        held = call(first, "first")
        second.execute("SELECT 1")  # the snapshot is taken now, before the holder commits
        pid = second.info.backend_pid
        racer = Racer(lambda: call(second, "second"))
        racer.start()
        wait_until(
            lambda: backend_waits_on_lock(cyclone_dsn, pid), timeout=5, what="second blocked"
        )
        first.commit()
        racer.join(10)
        assert not racer.is_alive()
        second.rollback()
    assert counts(cyclone_dsn) == (1, 1)
    assert held.created
    # The caller's retry loop keys on SQLSTATE 40001, as for any conflict at this level.
    assert getattr(racer.error, "sqlstate", None) == "40001", repr(racer.error)


# -- unique keys: held while active, freed when the holder ends -----------------------


@pytest.mark.parametrize("ending", ["completed", "failed", "cancelled"])
def test_a_unique_key_is_free_again_once_its_holder_ended(
    client: Client, start_worker: StartWorker, ending: str
) -> None:
    target = {"completed": echo, "failed": always_fails, "cancelled": echo}[ending]
    first = client.enqueue(target, 1, unique_key="free")
    assert first.created
    assert client.enqueue(target, 2, unique_key="free").id == first.id
    worker = None
    if ending == "cancelled":
        client.cancel(first.id)
    else:
        worker = start_worker(target)
    expected = {"completed": RunState.COMPLETED, "failed": RunState.FAILED}.get(
        ending, RunState.CANCELLED
    )
    wait_until(lambda: client.get_run(first.id).state is expected, timeout=10, what=ending)
    if worker is not None:
        worker.stop()  # else it could end the second holder before the last enqueue
    second = client.enqueue(target, 3, unique_key="free")
    assert second.created and second.id != first.id
    assert client.enqueue(target, 4, unique_key="free").id == second.id


def test_a_paused_holder_keeps_its_unique_key(client: Client) -> None:
    first = client.enqueue(echo, 1, unique_key="paused")
    client.pause(first.id)
    again = client.enqueue(echo, 2, unique_key="paused")
    assert again.id == first.id and not again.created
    client.resume(first.id)
    assert client.enqueue(echo, 3, unique_key="paused").id == first.id


def test_retrying_a_failed_holder_is_refused_while_another_holds_its_key(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(always_fails)
    first = client.enqueue(always_fails, 1, unique_key="retry")
    wait_until(lambda: client.get_run(first.id).state is RunState.FAILED, timeout=10, what="fail")
    second = client.enqueue(always_fails, 2, unique_key="retry", scheduled_at=far_future())
    assert second.created
    with pytest.raises(InvalidTransition):
        client.retry(first.id, "sta_fail")
    assert client.get_run(first.id).state is RunState.FAILED
    assert [s.state for s in client.get_run(first.id).steps] == [StepState.DISCARDED]
    client.cancel(second.id)
    client.retry(first.id, "sta_fail")  # the key is free now
    assert client.enqueue(always_fails, 3, unique_key="retry").id == first.id


def test_unique_keys_are_per_kind(client: Client) -> None:
    a = client.enqueue(echo, 1, unique_key="kind")
    b = client.enqueue(always_fails, 1, unique_key="kind", scheduled_at=far_future())
    assert a.created and b.created and a.id != b.id


# -- scheduled_at ------------------------------------------------------------------------


def far_future() -> datetime:
    return datetime.now(UTC) + timedelta(days=3650)


def test_scheduled_at_must_be_timezone_aware_everywhere(client: Client, cyclone_dsn: str) -> None:
    naive = datetime(2030, 1, 1)
    with pytest.raises(InvalidArgument):
        client.enqueue(echo, 1, scheduled_at=naive)
    with pytest.raises(InvalidArgument):
        client.enqueue_many(echo, [1, 2], scheduled_at=naive)

    async def scenario() -> None:
        async with AsyncClient(cyclone_dsn) as aclient:
            with pytest.raises(InvalidArgument):
                await aclient.enqueue(echo, 1, scheduled_at=naive)
            with pytest.raises(InvalidArgument):
                await aclient.enqueue_many(echo, [1], scheduled_at=naive)
            async with await psycopg.AsyncConnection.connect(cyclone_dsn) as conn:
                with pytest.raises(InvalidArgument):
                    await aclient.enqueue_tx(conn, echo, 1, scheduled_at=naive)
                await conn.commit()

    asyncio.run(scenario())
    assert counts(cyclone_dsn) == (0, 0)


def test_scheduled_at_in_the_past_runs_at_once_and_in_the_far_future_waits(
    client: Client, start_worker: StartWorker
) -> None:
    far = datetime(9999, 12, 31, 23, 0, tzinfo=UTC)
    later = client.enqueue(echo, "far", scheduled_at=far)
    past = client.enqueue(echo, "past", scheduled_at=datetime(2000, 1, 1, tzinfo=UTC))
    other_zone = client.enqueue(
        echo, "zone", scheduled_at=datetime.now(UTC).astimezone() - timedelta(seconds=1)
    )
    start_worker(echo)
    assert past.result(timeout=10) == "past"
    assert other_zone.result(timeout=10) == "zone"
    (s,) = client.get_run(later.id).steps
    assert s.state is StepState.AVAILABLE and s.scheduled_at == far


def test_enqueue_many_takes_scheduled_at_and_priority(
    client: Client, start_worker: StartWorker
) -> None:
    when = datetime.now(UTC) + timedelta(seconds=1)
    handles = client.enqueue_many(echo, [1, 2, 3], scheduled_at=when, priority=7)
    for h in handles:
        (s,) = client.get_run(h.id).steps
        assert s.priority == 7 and s.scheduled_at == when
    start_worker(echo)
    assert [h.result(timeout=10) for h in handles] == [1, 2, 3]
    assert all(
        client.get_run(h.id).steps[0].started_at >= when  # type: ignore[operator]
        for h in handles
    )


def test_a_delayed_start_survives_a_pause_and_resume(
    client: Client, start_worker: StartWorker
) -> None:
    when = datetime.now(UTC) + timedelta(seconds=1.5)
    handle = client.enqueue(echo, 1, scheduled_at=when)
    client.pause(handle.id)
    client.resume(handle.id)
    start_worker(echo)
    assert handle.result(timeout=10) == 1
    (s,) = client.get_run(handle.id).steps
    assert s.started_at is not None and s.started_at >= when


# -- priority and sequence keys ------------------------------------------------------------


def test_higher_priority_runs_first_within_one_queue(
    client: Client, start_worker: StartWorker
) -> None:
    for n in range(3):
        client.enqueue(record, f"low{n}", priority=-5)
    for n in range(3):
        client.enqueue(record, f"mid{n}")
    for n in range(3):
        client.enqueue(record, f"high{n}", priority=5)
    start_worker(record, queues=["sta_order"], concurrency=1)
    wait_until(lambda: len(seen_for("record")) == 9, timeout=10, what="all nine ran")
    got = [str(v)[:-1] for v in seen_for("record")]
    assert got == ["high"] * 3 + ["mid"] * 3 + ["low"] * 3


def test_a_step_of_a_sequence_keeps_its_place_across_a_pause_while_paused(
    client: Client, start_worker: StartWorker
) -> None:
    first = client.enqueue(seq, "first", sequence_key="pz")
    client.enqueue(seq, "second", sequence_key="pz")
    client.pause(first.id)
    start_worker(seq)
    time.sleep(0.8)
    assert seen_for("seq") == [], "a paused step holds back the steps after it"
    client.resume(first.id)
    wait_until(lambda: len(seen_for("seq")) == 2, timeout=10, what="both ran")


def test_a_resumed_step_runs_before_the_steps_of_its_sequence_enqueued_after_it(
    client: Client, start_worker: StartWorker
) -> None:
    first = client.enqueue(seq, "first", sequence_key="order")
    client.enqueue(seq, "second", sequence_key="order")
    client.pause(first.id)
    client.resume(first.id)
    start_worker(seq, concurrency=1)
    wait_until(lambda: len(seen_for("seq")) == 2, timeout=10, what="both ran")
    assert seen_for("seq") == ["first", "second"]


def _claim_first_of_sequence(cyclone_dsn: str) -> tuple[Engine, psycopg.Connection[Any], Any]:
    conn = psycopg.connect(cyclone_dsn, autocommit=True)
    engine = Engine()
    with conn.transaction():
        (claimed,) = engine.claim(
            ConnectionTx(conn),
            owner="gone",
            queues=["default"],
            kinds=["sta_seq"],
            versions=[("sta_seq", "standalone")],
            limit=1,
            lease=timedelta(seconds=1),
        )
    return engine, conn, claimed


@pytest.mark.parametrize("how", ["reclaimed", "released"])
def test_a_step_given_back_keeps_its_place_in_its_sequence(
    client: Client, start_worker: StartWorker, cyclone_dsn: str, how: str
) -> None:
    """A step whose worker died (its lease reclaimed) or shut down before starting it (its
    lease released) runs again before the steps of its key enqueued after it; it was given
    a start of now, behind them."""
    client.enqueue(seq, "first", sequence_key="given")
    client.enqueue(seq, "second", sequence_key="given")
    engine, conn, claimed = _claim_first_of_sequence(cyclone_dsn)
    with conn, conn.transaction():
        if how == "released":
            engine.release(ConnectionTx(conn), [(claimed.id, claimed.generation)])
        else:  # a scanner's pass after the lease expired (a later clock)
            engine.reclaim_expired_leases(
                ConnectionTx(conn, timedelta(seconds=30)),
                after_id=0,
                limit=10,
                max_reclaims={},
                default_max_reclaims=5,
            )
    start_worker(seq, concurrency=1)
    wait_until(lambda: len(seen_for("seq")) == 2, timeout=10, what="both ran")
    assert seen_for("seq") == ["first", "second"]


# -- callers' connections configured their own way ---------------------------------------


@pytest.mark.parametrize("factory", ["namedtuple_row", "client_cursor"])
def test_enqueue_tx_on_a_connection_with_its_own_row_or_cursor_factory(
    client: Client, cyclone_dsn: str, factory: str
) -> None:
    options: dict[str, Any] = (
        {"row_factory": psycopg.rows.namedtuple_row}
        if factory == "namedtuple_row"
        else {"cursor_factory": psycopg.ClientCursor}
    )
    with psycopg.connect(cyclone_dsn, **options) as conn:
        a = client.enqueue_tx(conn, echo, 1, unique_key="f", sequence_key="f")
        b = client.enqueue_tx(conn, echo, 2, unique_key="f")
        c = client.submit_once_tx(conn, wf, 3, key="f")
        d = client.submit_tx(conn, wf, 4)
        conn.commit()
    assert a.created and b.id == a.id and c.created and d.id != c.id
    assert counts(cyclone_dsn) == (3, 3)


# -- transactional steps -----------------------------------------------------------------


def test_a_transactional_retry_sees_none_of_the_failed_attempts_writes(
    client: Client, start_worker: StartWorker, ledger
) -> None:  # type: ignore[no-untyped-def]
    start_worker(tx_flaky)
    handle = client.enqueue(tx_flaky, 7, unique_key="txu")
    assert handle.result(timeout=15) == 7
    assert seen_for("tx_flaky_saw") == [0, 0]
    assert ledger() == ["attempt 2"]
    # The completion, committed with the handler's writes, freed the unique key.
    again = client.enqueue(tx_flaky, 8, unique_key="txu")
    assert again.created


def test_a_transactional_handler_that_raises_leaves_no_writes(
    client: Client, start_worker: StartWorker, ledger
) -> None:  # type: ignore[no-untyped-def]
    start_worker(tx_raises)
    handle = client.enqueue(tx_raises, 1)
    wait_until(lambda: client.get_run(handle.id).state is RunState.FAILED, timeout=10, what="fail")
    assert ledger() == []


def test_work_enqueued_inside_a_transactional_step_exists_iff_the_step_completes(
    client: Client, start_worker: StartWorker, ledger
) -> None:  # type: ignore[no-untyped-def]
    outbox_client[:] = [client]
    try:
        start_worker(tx_outbox)
        handle = client.enqueue(tx_outbox, 1)
        assert handle.result(timeout=15) == 1
    finally:
        outbox_client.clear()
    assert ledger() == ["attempt 2"]
    enqueued = list(client.list_runs(workflow="sta_echo"))
    assert len(enqueued) == 1
    assert client.get_run(enqueued[0].id).steps[0].input == {"from": 2}


# -- the async client ----------------------------------------------------------------------


def test_async_enqueue_tx_commit_rollback_and_savepoint(client: Client, cyclone_dsn: str) -> None:
    async def scenario() -> list[int]:
        async with (
            AsyncClient(cyclone_dsn) as aclient,
            await psycopg.AsyncConnection.connect(cyclone_dsn) as conn,
        ):
            await aclient.enqueue_tx(conn, echo, 1, unique_key="a")
            await conn.rollback()
            assert counts(cyclone_dsn) == (0, 0)
            await conn.execute("SELECT 1")  # in a transaction: the block below is a savepoint
            async with conn.transaction():  # a savepoint, rolled back by psycopg.Rollback
                await aclient.enqueue_tx(conn, echo, 2, unique_key="a")
                await aclient.submit_once_tx(conn, wf, 2, key="a")
                raise psycopg.Rollback
            kept = await aclient.enqueue_tx(conn, echo, 3, unique_key="a")
            dup = await aclient.enqueue_tx(conn, echo, 4, unique_key="a")
            once = await aclient.submit_once_tx(conn, wf, 3, key="a")
            assert counts(cyclone_dsn) == (0, 0)
            await conn.commit()
            assert kept.created and dup.id == kept.id and not dup.created
            return [kept.id, once.id]

    kept_id, once_id = asyncio.run(scenario())
    assert counts(cyclone_dsn) == (2, 2)
    assert client.get_run(kept_id).steps[0].input == 3
    assert client.get_run(once_id).input == 3


def test_async_enqueue_respects_unique_keys_and_priority(client: Client, cyclone_dsn: str) -> None:
    async def scenario() -> list[Any]:
        async with AsyncClient(cyclone_dsn) as aclient:
            handles = await asyncio.gather(
                *(aclient.enqueue(echo, n, unique_key="au", priority=3) for n in range(6))
            )
            return list(handles)

    handles = asyncio.run(scenario())
    assert len({h.id for h in handles}) == 1
    assert sum(h.created for h in handles) == 1
    assert client.get_run(handles[0].id).steps[0].priority == 3


def test_an_async_once_key_race_with_a_sync_transaction(client: Client, cyclone_dsn: str) -> None:
    with psycopg.connect(cyclone_dsn) as first:
        held = client.submit_once_tx(first, wf, "sync", key="mixed")

        async def scenario() -> Any:
            async with (
                AsyncClient(cyclone_dsn) as aclient,
                await psycopg.AsyncConnection.connect(cyclone_dsn) as conn,
            ):
                pid = conn.info.backend_pid
                task = asyncio.create_task(aclient.submit_once_tx(conn, wf, "async", key="mixed"))
                deadline = time.monotonic() + 5
                while not await asyncio.to_thread(backend_waits_on_lock, cyclone_dsn, pid):
                    assert time.monotonic() < deadline, "the async caller never blocked"
                    await asyncio.sleep(0.02)
                await asyncio.to_thread(first.commit)
                got = await task
                await conn.commit()
                return got

        got = asyncio.run(scenario())
    assert got.id == held.id and not got.created
    assert counts(cyclone_dsn) == (1, 1)
