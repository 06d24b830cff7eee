"""Audit: resources under pressure (connections, handler slots, waits), as production users
hit them.

The test server is shared by every test process, so "a server near ``max_connections``"
is made with a login role of its own with a ``CONNECTION LIMIT``: the server refuses that
role's next session with the same SQLSTATE (53300, ``too many connections``) as a full
server, without taking a slot from anybody else. Every raw connection is closed in a
``finally``, every role's sessions are ended and the role dropped at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest

from cyclone_dsl import (
    AsyncClient,
    Client,
    ClientClosed,
    DatabaseUnavailable,
    RunState,
    StepContext,
    Worker,
    step,
    wait_signal,
    workflow,
)
from cyclone_dsl.testing.schemas import with_search_path
from tests.roles import application_role
from tests.waiting import wait_until

StartWorker = Callable[..., Worker]

GATES: dict[str, threading.Event] = {}
#: The client handlers use (set by the test that needs it).
HANDLER_CLIENT: dict[str, Client] = {}
#: What handlers saw, by tag.
SEEN: dict[str, list[Any]] = {}
_lock = threading.Lock()


def gate(name: str) -> threading.Event:
    with _lock:
        return GATES.setdefault(name, threading.Event())


def seen(tag: str, value: object) -> None:
    with _lock:
        SEEN.setdefault(tag, []).append(value)


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    GATES.clear()
    HANDLER_CLIENT.clear()
    SEEN.clear()
    yield
    for event in list(GATES.values()):
        event.set()
    HANDLER_CLIENT.clear()


# -- roles and raw connections ----------------------------------------------------------------


def limited_role(
    admin_dsn: str, schema: str, limit: int
) -> contextlib.AbstractContextManager[tuple[str, str]]:
    """(its DSN, its name): an application's role with at most ``limit`` sessions."""
    return application_role(admin_dsn, schema, connection_limit=limit, prefix="rsc")


def sessions_of(admin_dsn: str, role: str, app_prefix: str = "") -> int:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = %s "
            "AND coalesce(application_name, '') LIKE %s",
            (role, app_prefix + "%"),
        ).fetchone()
    assert row is not None
    return int(row[0])


@contextlib.contextmanager
def taking_every_slot(dsn: str, role: str, admin_dsn: str, limit: int) -> Iterator[list[Any]]:
    """Open raw sessions as ``role`` until it has ``limit`` (none left); close them at the
    end."""
    held: list[Any] = []
    try:
        while sessions_of(admin_dsn, role) < limit:
            held.append(psycopg.connect(dsn, autocommit=True, application_name="rsc-hog"))
        yield held
    finally:
        for conn in held:
            with contextlib.suppress(Exception):
                conn.close()


def ledger_table(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE rsc_ledger (n int NOT NULL, tag text NOT NULL)")


def ledger(dsn: str) -> list[tuple[int, str]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [(int(r[0]), str(r[1])) for r in conn.execute("SELECT n, tag FROM rsc_ledger")]


# -- steps and workflows ------------------------------------------------------------------------


@step(name="rsc_echo")
def rsc_echo(value: object) -> object:
    return value


@step(name="rsc_tx_write", transactional=True, max_attempts=1)
def rsc_tx_write(n: int, ctx: StepContext) -> int:
    ctx.connection.execute("INSERT INTO rsc_ledger VALUES (%s, 'tx')", (n,))
    time.sleep(0.25)  # short database work that keeps its connection a while
    return n


@step(name="rsc_tx_slow", transactional=True, max_attempts=1)
def rsc_tx_slow(n: int, ctx: StepContext) -> int:
    seen("slow", n)
    ctx.connection.execute("SELECT pg_sleep(1.5)")  # active, not idle: no server timeout
    ctx.connection.execute("INSERT INTO rsc_ledger VALUES (%s, 'slow')", (n,))
    return n


@step(name="rsc_tx_locked", transactional=True, max_attempts=1, timeout=1.0)
def rsc_tx_locked(n: int, ctx: StepContext) -> int:
    seen("locked", ctx.attempt)
    ctx.connection.execute("INSERT INTO rsc_ledger VALUES (%s, 'locked')", (n,))
    return n


@step(
    name="rsc_tx_locked_ser",
    transactional=True,
    max_attempts=1,
    timeout=2.5,
    isolation="serializable",
)
def rsc_tx_locked_ser(n: int, ctx: StepContext) -> int:
    seen("locked", ctx.attempt)
    ctx.connection.execute("INSERT INTO rsc_ledger VALUES (%s, 'locked')", (n,))
    return n


@step(name="rsc_tx_late", transactional=True, max_attempts=1, timeout=1.0)
def rsc_tx_late(n: int, ctx: StepContext) -> int:
    seen("late", ctx.attempt)
    ctx.connection.execute("INSERT INTO rsc_ledger VALUES (%s, 'late')", (n,))
    return n


@step(name="rsc_parent", max_attempts=1)
def rsc_parent(n: int) -> object:
    """Submits a child run and waits for its result, with a shared module-level client."""
    shared = HANDLER_CLIENT["shared"]
    return {"child": shared.enqueue(rsc_echo, n).result(timeout=20)}


@step(name="rsc_parent_own_client", max_attempts=1)
def rsc_parent_own_client(n: int) -> object:
    """Makes a client of its own for the call (and closes it)."""
    with Client(HANDLER_CLIENT["shared"].dsn, pool_size=1) as own:
        return {"child": own.enqueue(rsc_echo, n).result(timeout=20)}


@step(name="rsc_parent_short_wait", max_attempts=1)
def rsc_parent_short_wait(n: int) -> object:
    handle = HANDLER_CLIENT["shared"].enqueue(rsc_echo, n)
    seen("child", handle.id)
    return handle.result(timeout=1.5)


@step(name="rsc_parent_no_wait_limit", max_attempts=1, timeout=1.0)
def rsc_parent_no_wait_limit(n: int) -> object:
    handle = HANDLER_CLIENT["shared"].enqueue(rsc_echo, n)
    seen("child", handle.id)
    try:
        return handle.result()  # no timeout: the child needs this very slot
    except BaseException as exc:
        seen("parent_raised", type(exc).__name__)
        raise


@workflow(name="rsc_signalled")
def rsc_signalled(x):  # type: ignore[no-untyped-def]
    return rsc_echo(wait_signal("rsc_go"))


# -- tests ------------------------------------------------------------------------------------


def test_rsc_transactional_handlers_beyond_the_connections_the_server_allows(
    cyclone_dsn: str, cyclone_admin_dsn: str, cyclone_schema: str, client: Client
) -> None:
    """A worker with 12 sync slots of transactional steps whose role may open only 10
    sessions: its own few, and about 3 for handlers. Steps wait for a handler connection
    in turn; they all complete, each write once, with leases (1.5 s, shorter than the
    whole batch) kept by heartbeats: nothing reclaimed, nothing failed."""
    ledger_table(cyclone_dsn)
    with limited_role(cyclone_admin_dsn, cyclone_schema, 10) as (
        role_dsn,
        role,
    ):
        worker = Worker(
            role_dsn,
            [rsc_tx_write],
            concurrency=12,
            lease=1.5,
            poll_interval=0.5,
            scan_interval=0.5,
            grace=5.0,
        )
        worker.start()
        try:
            handles = client.enqueue_many(rsc_tx_write, list(range(30)))
            most = 0
            for handle in handles:
                assert handle.wait(timeout=60).state is RunState.COMPLETED
                most = max(most, sessions_of(cyclone_admin_dsn, role))
            assert most <= 10
        finally:
            worker.stop()
    assert sorted(ledger(cyclone_dsn)) == [(n, "tx") for n in range(30)]
    for handle in handles:
        only = client.get_run(handle.id).steps[0]
        assert (only.attempt, only.reclaims, only.error, only.attempts) == (0, 0, None, ())


def test_rsc_transactional_handlers_taking_the_last_sessions_do_not_cost_the_leases(
    cyclone_dsn: str, cyclone_admin_dsn: str, cyclone_schema: str, client: Client
) -> None:
    """Transactional handlers running 1.5 s each with a 0.9 s lease, 8 at once, while the
    role may open 9 sessions: the handlers' pool takes what the worker's own threads have
    not opened yet. The worker's leases must still be kept (by heartbeats): no step is
    reclaimed from a live worker that is running it, none runs twice."""
    ledger_table(cyclone_dsn)
    with limited_role(cyclone_admin_dsn, cyclone_schema, 9) as (
        role_dsn,
        _role,
    ):
        worker = Worker(
            role_dsn,
            [rsc_tx_slow],
            concurrency=8,
            lease=0.9,
            max_reclaims=1,  # a lost lease shows sooner
            poll_interval=0.5,
            scan_interval=0.5,
            grace=5.0,
        )
        worker.start()
        try:
            handles = client.enqueue_many(rsc_tx_slow, list(range(8)))
            ended = [h.wait(timeout=60) for h in handles]
        finally:
            worker.stop()
    rows = [(run.state.value, run.steps[0].reclaims, run.steps[0].error) for run in ended]
    assert rows == [("completed", 0, None)] * 8
    assert sorted(ledger(cyclone_dsn)) == [(n, "slow") for n in range(8)]
    assert sorted(SEEN["slow"]) == list(range(8)), "a step ran again while its worker held it"


def test_rsc_no_connection_slot_left_gives_typed_errors_then_recovers(
    cyclone_admin_dsn: str, cyclone_schema: str
) -> None:
    """Every session the role may open is taken: a new Client and a worker's start raise
    DatabaseUnavailable (cause too_many_connections) at once, not a hang nor psycopg's
    error; once the sessions are released, both work, the same Worker started again."""
    with limited_role(cyclone_admin_dsn, cyclone_schema, 3) as (
        role_dsn,
        role,
    ):
        worker = Worker(role_dsn, [rsc_echo], poll_interval=0.5, scan_interval=0.5, grace=5.0)
        with taking_every_slot(role_dsn, role, cyclone_admin_dsn, 3):
            with pytest.raises(DatabaseUnavailable) as refused:
                Client(role_dsn)
            assert refused.value.cause == "too_many_connections"
            with pytest.raises(DatabaseUnavailable) as not_started:
                worker.start()
            assert not_started.value.cause == "too_many_connections"
        # Released: the role has its sessions again (the limit stays 3: pool_size=1).
        with Client(role_dsn, pool_size=1) as recovered:
            handle = recovered.enqueue(rsc_echo, "ok")
            assert recovered.get_run(handle.id).state is RunState.RUNNING
        worker.start()
        try:
            with Client(with_search_path(cyclone_admin_dsn, cyclone_schema)) as admin:
                assert admin.result(handle.id, timeout=30) == "ok"
        finally:
            worker.stop()


def test_rsc_a_client_whose_pool_cannot_grow_serves_concurrent_calls_on_what_it_has(
    cyclone_admin_dsn: str, cyclone_schema: str
) -> None:
    """A client opened while the role had room (its first connection), then every other
    session of the role taken: 20 threads calling at once share the one connection, and
    all their calls succeed."""
    with (
        limited_role(cyclone_admin_dsn, cyclone_schema, 3) as (
            role_dsn,
            role,
        ),
        Client(role_dsn, pool_size=4) as limited,
    ):
        with taking_every_slot(role_dsn, role, cyclone_admin_dsn, 3):

            def call(i: int) -> object:
                handle = limited.enqueue(rsc_echo, i)
                return limited.get_run(handle.id).input

            with ThreadPoolExecutor(20) as pool:
                inputs = list(pool.map(call, range(40)))
        assert inputs == list(range(40))


def test_rsc_a_lost_connection_with_no_slot_left_is_typed_and_recovers(
    cyclone_admin_dsn: str, cyclone_schema: str
) -> None:
    """The client's only session is ended by the server while the role has no slot left:
    each call raises DatabaseUnavailable (connection_lost, then too_many_connections),
    never hangs for the pool's timeout; once a slot frees, the next call works."""
    with (
        limited_role(cyclone_admin_dsn, cyclone_schema, 3) as (
            role_dsn,
            role,
        ),
        Client(role_dsn, pool_size=1) as limited,
    ):
        handle = limited.enqueue(rsc_echo, "before")
        with taking_every_slot(role_dsn, role, cyclone_admin_dsn, 3) as held:
            with psycopg.connect(cyclone_admin_dsn, autocommit=True) as admin:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE usename = %s AND application_name LIKE 'cyclone-client%%'",
                    (role,),
                )
            wait_until(
                lambda: sessions_of(cyclone_admin_dsn, role) == 2,
                what="the client's session to end",
            )
            held.append(psycopg.connect(role_dsn, autocommit=True))  # its slot, taken
            causes = []
            for _ in range(3):
                with pytest.raises(DatabaseUnavailable) as failed:
                    limited.get_run(handle.id)
                causes.append(failed.value.cause)
            assert set(causes) <= {"connection_lost", "too_many_connections"}
            assert causes[-1] == "too_many_connections"
        assert limited.get_run(handle.id).input == "before"


def test_rsc_waits_with_no_slot_for_the_wait_connection_time_out_typed_then_recover(
    cyclone_admin_dsn: str, cyclone_schema: str, start_worker: StartWorker
) -> None:
    """A client whose waits' connection cannot be opened (no session left for its role):
    a wait with a timeout ends with TimeoutError, one without it keeps retrying, and
    returns once a slot frees."""
    admin_dsn = with_search_path(cyclone_admin_dsn, cyclone_schema)
    start_worker(rsc_echo)
    with (
        limited_role(cyclone_admin_dsn, cyclone_schema, 3) as (
            role_dsn,
            role,
        ),
        Client(role_dsn, pool_size=1) as limited,
    ):
        handle = limited.enqueue(rsc_echo, "waited")
        with Client(admin_dsn) as admin:
            assert admin.result(handle.id, timeout=30) == "waited"
        pool = ThreadPoolExecutor(1)
        try:
            with taking_every_slot(role_dsn, role, cyclone_admin_dsn, 3):
                with pytest.raises((TimeoutError, DatabaseUnavailable)):
                    limited.result(handle.id, timeout=1.0)
                later = pool.submit(limited.result, handle.id)
                time.sleep(0.5)
                assert not later.done()
            assert later.result(timeout=30) == "waited"
        finally:
            pool.shutdown(wait=False, cancel_futures=True)


def test_rsc_one_client_shared_by_50_threads_submit_signal_and_wait(
    client: Client, start_worker: StartWorker
) -> None:
    """50 threads share one client (pool_size 4): each submits a run waiting for a signal,
    signals it and waits for its result; every run gets its own payload."""
    start_worker(rsc_echo, rsc_signalled)

    def one(i: int) -> object:
        handle = client.submit(rsc_signalled, i)
        delivery = client.signal(handle.id, "rsc_go", {"i": i})
        assert delivery is not None
        return handle.result(timeout=60)

    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(one, range(50)))
    assert results == [{"i": i} for i in range(50)]


def test_rsc_a_thousand_waits_on_one_client_hold_one_session(
    client: Client, cyclone_admin_dsn: str, cyclone_schema: str, start_worker: StartWorker
) -> None:
    """1000 waits in flight at once on one AsyncClient whose role may open 6 sessions
    (its pool of 4 and the waits' one): they all return their run's result."""
    handles = client.enqueue_many(rsc_echo, list(range(1000)))
    with limited_role(cyclone_admin_dsn, cyclone_schema, 6) as (
        role_dsn,
        role,
    ):

        async def all_waits() -> list[object]:
            async with AsyncClient(role_dsn) as aclient:
                waits = [asyncio.ensure_future(aclient.result(h.id, timeout=60)) for h in handles]
                await asyncio.sleep(0.3)
                assert not any(w.done() for w in waits)
                assert sessions_of(cyclone_admin_dsn, role, "cyclone-wait") == 1
                worker = await asyncio.to_thread(start_worker, rsc_echo)
                try:
                    return list(await asyncio.gather(*waits))
                finally:
                    await asyncio.to_thread(worker.stop)

        assert asyncio.run(all_waits()) == list(range(1000))


def test_rsc_handlers_wait_for_child_runs_with_a_shared_and_an_own_client(
    client: Client, cyclone_dsn: str, start_worker: StartWorker
) -> None:
    """Handlers (8 slots) that submit a child run and wait for its result, from one
    module-level client shared by their threads or from a client of their own each: the
    children run in the free slots and every parent gets its child's result."""
    HANDLER_CLIENT["shared"] = client
    start_worker(rsc_parent, rsc_parent_own_client, rsc_echo, concurrency=8)
    shared = [client.enqueue(rsc_parent, i) for i in range(3)]
    own = [client.enqueue(rsc_parent_own_client, i) for i in range(3, 6)]
    results = [h.result(timeout=60) for h in shared + own]
    assert results == [{"child": i} for i in range(6)]


def test_rsc_a_handler_waiting_on_its_child_in_the_only_slot_times_out_then_the_child_runs(
    client: Client, start_worker: StartWorker
) -> None:
    """One slot, taken by a handler that waits (1.5 s) for a child run that needs that
    slot: the wait raises TimeoutError, the parent fails, and the child then runs."""
    HANDLER_CLIENT["shared"] = client
    start_worker(rsc_parent_short_wait, rsc_echo, concurrency=1)
    parent = client.enqueue(rsc_parent_short_wait, 7)
    ended = parent.wait(timeout=30)
    assert ended.state is RunState.FAILED
    assert "TimeoutError" in (ended.steps[0].error or "")
    [child_id] = SEEN["child"]
    assert client.result(int(child_id), timeout=30) == 7


def test_rsc_a_handler_waiting_forever_on_its_child_in_the_only_slot(
    cyclone_dsn: str, client: Client, start_worker: StartWorker
) -> None:
    """Same, the wait without a timeout but the step with one (1 s): the step fails by its
    timeout, its thread keeps the slot (as documented for sync handlers), so the child
    does not run; closing the handlers' client ends their wait (ClientClosed), which frees
    the slot, and the child runs."""
    shared = Client(cyclone_dsn)
    HANDLER_CLIENT["shared"] = shared
    try:
        worker = start_worker(rsc_parent_no_wait_limit, rsc_echo, concurrency=1)
        parent = client.enqueue(rsc_parent_no_wait_limit, 9)
        ended = parent.wait(timeout=30)
        assert ended.state is RunState.FAILED
        assert ended.steps[0].error_kind == "timeout"
        [child_id] = SEEN["child"]
        assert worker.slots_in_use == 1
        assert client.get_run(int(child_id)).state is RunState.RUNNING
    finally:
        shared.close()
    wait_until(lambda: SEEN.get("parent_raised"), what="the parent's wait to end")
    assert SEEN["parent_raised"] == [ClientClosed.__name__]
    assert client.result(int(child_id), timeout=30) == 9


@pytest.mark.parametrize("isolation", ["read_committed", "serializable"])
def test_rsc_a_user_table_lock_holds_a_transactional_step_past_its_timeout(
    cyclone_dsn: str, client: Client, start_worker: StartWorker, isolation: str
) -> None:
    """A lock on the application's table, held by another session, blocks the step's
    INSERT: at its timeout the statement is interrupted and the step fails (timeout),
    its lease not reclaimed meanwhile (1 s lease: heartbeats, or at serializable the
    transaction's lock, hold it); released, an operator retry writes once."""
    ledger_table(cyclone_dsn)
    kind = rsc_tx_locked if isolation == "read_committed" else rsc_tx_locked_ser
    worker = start_worker(kind, concurrency=2, lease=1.0)
    locker = psycopg.connect(cyclone_dsn)
    try:
        locker.execute("LOCK TABLE rsc_ledger IN ACCESS EXCLUSIVE MODE")
        handle = client.enqueue(kind, 5)
        ended = handle.wait(timeout=30)
        assert ended.state is RunState.FAILED
        failed = ended.steps[0]
        assert (failed.error_kind, failed.reclaims) == ("timeout", 0)
        wait_until(lambda: worker.slots_in_use == 0, what="the interrupted handler to return")
    finally:
        locker.rollback()
        locker.close()
    client.retry(handle.id, failed.node)
    assert handle.result(timeout=30) == 5
    assert ledger(cyclone_dsn) == [(5, "locked")]
    assert len(SEEN["locked"]) == 2  # the timed-out attempt, then the retry


def test_rsc_a_transactional_step_that_cannot_get_a_connection_fails_by_its_timeout(
    cyclone_admin_dsn: str, cyclone_schema: str, client: Client
) -> None:
    """A running worker whose role has no session left when a transactional step comes:
    the step fails by its timeout (1 s) rather than waiting for the pool's 30 s; its
    handler is not called once a session frees (it was, for a step already failed: its
    writes rolled back, its other effects not); a retry then writes once."""
    dsn = with_search_path(cyclone_admin_dsn, cyclone_schema)
    ledger_table(dsn)
    with limited_role(cyclone_admin_dsn, cyclone_schema, 9) as (
        role_dsn,
        role,
    ):
        worker = Worker(
            role_dsn, [rsc_tx_late], concurrency=1, poll_interval=0.5, scan_interval=0.5, grace=5
        )
        worker.start()
        try:
            with taking_every_slot(role_dsn, role, cyclone_admin_dsn, 9):
                handle = client.enqueue(rsc_tx_late, 3)
                ended = handle.wait(timeout=30)
                assert ended.state is RunState.FAILED
                assert ended.steps[0].error_kind == "timeout"
            wait_until(lambda: worker.slots_in_use == 0, what="the late handler to return")
            assert SEEN.get("late") is None, "the handler of a step that timed out was called"
            client.retry(handle.id, ended.steps[0].node)
            assert handle.result(timeout=30) == 3
        finally:
            worker.stop()
    assert ledger(dsn) == [(3, "late")]
    assert SEEN["late"] == [1]
