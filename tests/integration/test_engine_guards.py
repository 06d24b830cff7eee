"""Engine behaviours that each have a test failing when the behaviour is removed.

Claims in priority order, the registered-kinds filter of the claim, the reset of
``reclaims`` by an operator retry, resume moving signal-wait timeouts, the
``max_items`` guard of a fan-out, and ``has_fan_out`` sparing runs without fan-out.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, LiteralString

import psycopg
import pytest

from cyclone_dsl import Client, RunFilter, Worker, for_each, step, wait_signal, wait_timer, workflow
from cyclone_dsl.db.tx import ConnectionTx, Row, in_transaction
from cyclone_dsl.dsl.runs import child_compiler, compile_workflow
from cyclone_dsl.engine import Engine, Failure, Success
from cyclone_dsl.sql import Q
from cyclone_dsl.states import RunState, StepState
from cyclone_dsl.testing import shifted_clock
from tests.waiting import wait_until

# -- claims: priority within a queue, and only the kinds a worker has ---------------------

ran: list[int] = []
ran_lock = threading.Lock()


@step(name="eg_prioritised", queue="eg_prio")
def prioritised(x: int) -> int:
    with ran_lock:
        ran.append(x)
    return x


def test_a_queue_is_claimed_in_priority_order(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    ran.clear()
    for priority in (0, 5, 10, -3, 7):
        client.enqueue(prioritised, priority, priority=priority)
    start_worker(prioritised, queues=["eg_prio"], concurrency=1, batch_size=1)
    for run in client.list_runs():
        client.handle(run.id).wait(timeout=20)
    assert ran == [10, 7, 5, 0, -3]


@step(name="eg_served")
def served(x: int) -> int:
    return x + 1


@step(name="eg_not_served")
def not_served(x: int) -> int:
    return x + 2


@workflow(name="eg_two_kinds")
def two_kinds(x):  # type: ignore[no-untyped-def]
    served(x)
    not_served(x)


def test_a_worker_claims_only_the_kinds_it_has(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """The worker serves the workflow (it was given one of its steps) but has no handler
    for ``eg_not_served``: that step is left available for a worker that has it. Both
    steps are roots, so a claim without the kinds filter takes both at once."""
    handle = client.submit(two_kinds, 1)
    worker = start_worker(served)
    deadline = time.monotonic() + 20
    while handle.get().step("eg_served").state is not StepState.COMPLETED:
        assert time.monotonic() < deadline, "the served step did not complete"
        time.sleep(0.05)
    run = handle.get()
    assert run.state is RunState.RUNNING
    assert run.step("eg_not_served").state is StepState.AVAILABLE
    assert run.step("eg_not_served").attempt == 0
    assert worker.error is None
    start_worker(not_served)
    assert handle.wait(timeout=20).state is RunState.COMPLETED


# -- operator retry resets reclaims ------------------------------------------------------


@step(name="eg_flaky", max_reclaims=5)
def flaky(x: int) -> int:
    return x


def test_an_operator_retry_resets_reclaims_and_attempts(client: Client, cyclone_dsn: str) -> None:
    handle = client.enqueue(flaky, 1, max_attempts=1)
    engine = Engine()
    versions = [("eg_flaky", "standalone")]
    pool_conn = psycopg.connect(cyclone_dsn, autocommit=True)
    try:

        def claim(shift: timedelta) -> Any:
            with pool_conn.transaction():
                return engine.claim(
                    ConnectionTx(pool_conn, shift),
                    owner="crashy",
                    queues=["default"],
                    kinds=["eg_flaky"],
                    versions=versions,
                    limit=1,
                    lease=timedelta(seconds=1),
                )

        for round_ in range(2):  # claimed, then its lease expires and it is reclaimed
            shift = timedelta(minutes=10 * (round_ + 1))
            assert len(claim(shift)) == 1
            with pool_conn.transaction():
                engine.reclaim_expired_leases(
                    ConnectionTx(pool_conn, shift + timedelta(seconds=5)),
                    after_id=0,
                    limit=10,
                    max_reclaims={"eg_flaky": 5},
                    default_max_reclaims=5,
                )
        (last,) = claim(timedelta(minutes=30))
        with pool_conn.transaction():
            engine.fail(
                ConnectionTx(pool_conn, timedelta(minutes=30)),
                [Failure(last.id, last.generation, "boom", "error")],
            )
    finally:
        pool_conn.close()
    failed = handle.get().step("eg_flaky")
    assert failed.state is StepState.DISCARDED
    assert (failed.reclaims, failed.attempt) == (2, 1)
    client.retry(handle.id, "eg_flaky")
    again = handle.get().step("eg_flaky")
    assert again.state is StepState.AVAILABLE
    assert (again.reclaims, again.attempt) == (0, 0)


# -- resume moves signal-wait timeouts ------------------------------------------------------


@step(name="eg_after_signal")
def after_signal(x: object) -> object:
    return x


@workflow(name="eg_timed_wait")
def timed_wait(x):  # type: ignore[no-untyped-def]
    return after_signal(wait_signal("go", timeout=timedelta(hours=1)))


def test_resume_moves_a_signal_wait_timeout_by_the_pause(client: Client) -> None:
    handle = client.submit(timed_wait, 1)
    wait = handle.get().step("go")
    assert wait.state is StepState.WAITING_SIGNAL
    client.pause(handle.id)
    with shifted_clock(timedelta(minutes=40)):  # the pause lasts 40 minutes
        client.resume(handle.id)
    resumed = handle.get().step("go")
    assert resumed.state is StepState.WAITING_SIGNAL
    moved = resumed.scheduled_at - wait.scheduled_at
    assert timedelta(minutes=40) <= moved < timedelta(minutes=41)
    engine = Engine()
    with psycopg.connect(client.dsn, autocommit=True) as conn:
        for minutes, timed_out in ((70, 0), (101, 1)):  # past the old timeout, then the new
            with conn.transaction():
                changed, _ = engine.time_out_signal_waits(
                    ConnectionTx(conn, timedelta(minutes=minutes)), after_id=0, limit=10
                )
            assert changed == timed_out, f"at +{minutes} min"
    assert handle.get().step("go").error_kind == "signal_timeout"


# -- the max_items guard of a fan-out ---------------------------------------------------------

item_calls: list[object] = []


@step(name="eg_source")
def source(n: int) -> list[int]:
    return list(range(n))


@step(name="eg_item")
def item(x: int) -> int:
    item_calls.append(x)
    return x * 10


@workflow(name="eg_guarded")
def guarded(n):  # type: ignore[no-untyped-def]
    return for_each(item, over=source(n), max_items=3)


@workflow(name="eg_guarded_literal")
def guarded_literal(items):  # type: ignore[no-untyped-def]
    return for_each(item, over=items, max_items=2)


@pytest.fixture
def item_worker(start_worker: Callable[..., Worker]) -> None:
    item_calls.clear()
    start_worker(guarded, guarded_literal)


@pytest.mark.usefixtures("item_worker")
def test_a_fan_out_over_its_max_items_fails_and_expands_nothing(client: Client) -> None:
    over = client.submit(guarded, 5)
    run = over.wait(timeout=20)
    assert run.state is RunState.FAILED
    fan_out = run.step("eg_item")
    assert fan_out.state is StepState.DISCARDED
    assert fan_out.error_kind == "item_limit"
    assert "got 5 items" in (fan_out.error or "")
    assert "over its max_items of 3" in (fan_out.error or "")
    assert [s.node for s in run.steps if s.item_of is not None] == []
    within = client.submit(guarded, 3)
    assert within.result(timeout=20) == [0, 10, 20]
    assert sorted(item_calls) == [0, 1, 2]


@pytest.mark.usefixtures("item_worker")
def test_max_items_holds_for_roots_bulk_submits_and_retries(client: Client) -> None:
    """A fan-out over the run input is a root (expanded in the submit transaction); bulk
    submits record the guard for every run; a retry expands under the same guard."""
    root = client.submit(guarded_literal, [1, 2, 3])
    assert root.get().step("eg_item").error_kind == "item_limit"
    many = client.submit_many(guarded_literal, [[1], [1, 2, 3, 4]])
    assert many[0].result(timeout=20) == [10]
    assert many[1].wait(timeout=20).step("eg_item").error_kind == "item_limit"
    client.retry(root.id, "eg_item")
    again = root.wait(timeout=20)
    assert again.state is RunState.FAILED
    assert again.step("eg_item").error_kind == "item_limit"
    assert item_calls == [1]


# -- has_fan_out spares runs without fan-out ----------------------------------------------


class RecordingTx(ConnectionTx):
    """A transaction that remembers the named queries it ran."""

    __slots__ = ("ran",)

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        super().__init__(conn)
        self.ran: list[str] = []

    def rows(self, query: LiteralString, **params: object) -> list[Row]:
        self.ran.append(query)
        return super().rows(query, **params)


@step(name="eg_plain")
def plain(x: int) -> int:
    return x


@workflow(name="eg_no_fan_out")
def no_fan_out(x):  # type: ignore[no-untyped-def]
    return plain(x)


@workflow(name="eg_with_fan_out")
def with_fan_out(items):  # type: ignore[no-untyped-def]
    return for_each(plain, over=items)


def test_resuming_a_run_without_fan_out_looks_for_no_fan_out(
    client: Client, cyclone_dsn: str
) -> None:
    engine = Engine(compile_child=child_compiler(client.registry))
    lookups: dict[str, int] = {}
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        for wf, run_input in ((no_fan_out, 1), (with_fan_out, [1, 2])):
            compiled = compile_workflow(client.registry, wf, run_input)
            with conn.transaction():
                run_id = engine.submit(ConnectionTx(conn), compiled)
            client.pause(run_id)
            tx = RecordingTx(conn)
            with conn.transaction():
                engine.resume(tx, run_id)
            lookups[wf.name] = tx.ran.count(Q.fan_out_nodes_of_run)
    assert lookups == {"eg_no_fan_out": 0, "eg_with_fan_out": 1}


def test_the_has_fan_out_flag_is_recorded(client: Client, cyclone_dsn: str) -> None:
    plain_run = client.submit(no_fan_out, 1)
    fan_run = client.submit(with_fan_out, [1])
    flags = in_transaction_rows(
        cyclone_dsn,
        Q.lock_runs,
        run_ids=[plain_run.id, fan_run.id],
    )
    assert {r["id"]: r["has_fan_out"] for r in flags} == {plain_run.id: False, fan_run.id: True}


def in_transaction_rows(dsn: str, query: LiteralString, **params: object) -> list[Row]:
    from cyclone_dsl.db.connect import make_pool

    pool = make_pool(dsn, name="test-read")
    try:
        return in_transaction(pool, lambda tx: tx.rows(query, **params))
    finally:
        pool.close()


@step(name="eg_echo")
def eg_echo(value: object) -> object:
    return value


@workflow(name="eg_race_wait")
def race_wait(x):  # type: ignore[no-untyped-def]
    return eg_echo(wait_signal("eg_race", timeout=timedelta(hours=1)))


@workflow(name="eg_race_timer")
def race_timer(x):  # type: ignore[no-untyped-def]
    return eg_echo(x, after=[wait_timer(timedelta(hours=1))])


@pytest.mark.parametrize("kind", ["signal_timeout", "timer"])
def test_a_scanner_pass_racing_a_pause_fires_nothing_in_the_paused_run(
    client: Client, kind: str
) -> None:
    """The timer and signal-timeout passes read their page before they lock the runs, and
    their updates guarded only the step's state: a pause that committed in between was not
    seen, and the timer fired (or the wait failed the run) in the paused run. Reproduced
    here: the pause holds the run lock, uncommitted, while the pass (the clock 2 h ahead,
    so the wait is due) reads its page and waits for the lock; then the pause commits."""
    handle = client.submit(race_wait if kind == "signal_timeout" else race_timer, 1)
    node = "eg_race" if kind == "signal_timeout" else "timer"
    engine = Engine()
    result: dict[str, object] = {}
    with (
        psycopg.connect(client.dsn, autocommit=True) as pauser,
        psycopg.connect(client.dsn, autocommit=True) as scanner,
        psycopg.connect(client.dsn, autocommit=True) as probe,
    ):
        scanner_pid = scanner.info.backend_pid
        pauser.execute("BEGIN")
        engine.pause(ConnectionTx(pauser), handle.id)  # holds the run lock, uncommitted

        def scan() -> None:
            with scanner.transaction():
                tx = ConnectionTx(scanner, timedelta(hours=2))  # the wait is due
                if kind == "signal_timeout":
                    result["changed"] = engine.time_out_signal_waits(tx, after_id=0, limit=10)[0]
                else:
                    result["changed"] = engine.fire_timers(tx, after_id=0, limit=10)[0]

        thread = threading.Thread(target=scan)
        thread.start()
        try:
            wait_until(
                lambda: (
                    probe.execute(
                        "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s",
                        (scanner_pid,),
                    ).fetchone()
                    == (True,)
                ),
                timeout=10,
                what="the scanner pass to wait for the run lock the pause holds",
            )
        finally:
            pauser.execute("COMMIT")
            thread.join(10)
    assert not thread.is_alive()
    run = handle.get()
    assert result["changed"] == 0
    assert run.state is RunState.PAUSED
    assert run.step(node).state in (StepState.WAITING_SIGNAL, StepState.WAITING_TIMER)


# -- a pause keeps a step's own start time --------------------------------------------------


@step(name="eg_backoff")
def backing_off(x: int) -> int:
    return x


def fail_with_an_hour_of_backoff(cyclone_dsn: str) -> None:
    """Claim the one ``eg_backoff`` step and fail it, to be retried an hour later."""
    engine = Engine()
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        with conn.transaction():
            (claimed,) = engine.claim(
                ConnectionTx(conn),
                owner="test",
                queues=["default"],
                kinds=["eg_backoff"],
                versions=[("eg_backoff", "standalone")],
                limit=1,
                lease=timedelta(seconds=30),
            )
        with conn.transaction():
            engine.fail(
                ConnectionTx(conn),
                [Failure(claimed.id, claimed.generation, "boom", "error", delay_s=3600)],
            )


def test_resume_keeps_a_retry_backoff_pending_at_the_pause(
    client: Client, cyclone_dsn: str
) -> None:
    """A resume made every paused step ready at once: a step waiting out its retry
    backoff when the run was paused was retried as soon as the run resumed."""
    handle = client.enqueue(backing_off, 1)
    fail_with_an_hour_of_backoff(cyclone_dsn)
    backing = handle.get().step("eg_backoff")
    assert backing.state is StepState.AVAILABLE
    client.pause(handle.id)
    with shifted_clock(timedelta(minutes=10)):  # the pause lasts 10 minutes
        client.resume(handle.id)
    resumed = handle.get().step("eg_backoff")
    assert resumed.state is StepState.AVAILABLE
    assert resumed.scheduled_at >= backing.scheduled_at, "the backoff was cut short"


@workflow(name="eg_backoff_items")
def backoff_items(n):  # type: ignore[no-untyped-def]
    return for_each(backing_off, over=source(n), max_parallel=1)


def test_resume_keeps_a_fan_out_items_retry_backoff(client: Client, cyclone_dsn: str) -> None:
    """The same for an item of a fan-out with max_parallel, made ready by the fan-out."""
    handle = client.submit(backoff_items, 2)
    engine = Engine()
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:

        def claim(kind: str) -> Any:
            with conn.transaction():
                (claimed,) = engine.claim(
                    ConnectionTx(conn),
                    owner="test",
                    queues=["default"],
                    kinds=[kind],
                    versions=[("eg_backoff_items", handle.get().def_version)],
                    limit=1,
                    lease=timedelta(seconds=30),
                )
            return claimed

        first = claim("eg_source")
        with conn.transaction():
            engine.complete(ConnectionTx(conn), [Success(first.id, first.generation, "[0, 1]")])
        item_ = claim("eg_backoff")
        with conn.transaction():
            engine.fail(
                ConnectionTx(conn),
                [Failure(item_.id, item_.generation, "boom", "error", delay_s=3600)],
            )
    (backing,) = [s for s in handle.get().steps if s.id == item_.id]
    assert backing.state is StepState.AVAILABLE
    client.pause(handle.id)
    client.resume(handle.id)
    (resumed,) = [s for s in handle.get().steps if s.id == item_.id]
    assert resumed.state is StepState.AVAILABLE
    assert resumed.scheduled_at >= backing.scheduled_at, "the backoff was cut short"


def test_resume_keeps_a_delayed_steps_start(client: Client) -> None:
    """The same for a step enqueued to start later: the resume started it at once."""
    start_at = datetime.now(UTC) + timedelta(hours=2)
    handle = client.enqueue(backing_off, 1, scheduled_at=start_at)
    client.pause(handle.id)
    client.resume(handle.id)
    resumed = handle.get().step("eg_backoff")
    assert resumed.state is StepState.AVAILABLE
    assert resumed.scheduled_at >= start_at, "the delayed start was lost"


def test_an_operator_retry_keeps_a_delayed_start_the_step_never_reached(client: Client) -> None:
    """A step enqueued to start later and cancelled before it started: ``retry`` and
    ``retry_many`` started it at once."""
    start_at = datetime.now(UTC) + timedelta(hours=2)
    first = client.enqueue(backing_off, 1, scheduled_at=start_at)
    second = client.enqueue(backing_off, 2, scheduled_at=start_at)
    for handle in (first, second):
        client.cancel(handle.id)
    client.retry(first.id, "eg_backoff")
    assert client.retry_many(RunFilter(states=["cancelled"])).acted == 1
    for handle in (first, second):
        retried = handle.get().step("eg_backoff")
        assert retried.state is StepState.AVAILABLE
        assert retried.scheduled_at >= start_at, "the delayed start was lost"


def test_an_operator_retry_does_not_wait_out_a_backoff(client: Client, cyclone_dsn: str) -> None:
    """A retry gives a fresh attempt budget: a step cancelled in a retry backoff starts at
    once (the delayed start above is kept only for a step that never started)."""
    handle = client.enqueue(backing_off, 1)
    fail_with_an_hour_of_backoff(cyclone_dsn)
    client.cancel(handle.id)
    client.retry(handle.id, "eg_backoff")
    retried = handle.get().step("eg_backoff")
    assert retried.state is StepState.AVAILABLE
    assert retried.scheduled_at < datetime.now(UTC) + timedelta(minutes=1)
