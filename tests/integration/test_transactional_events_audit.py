"""Audit of transactional steps (``@step(transactional=True)``, ``ctx.connection``) and
progress events (``ctx.emit``, ``ctx.progress``, ``RunHandle.events()``).

Handlers write rows to an application table (``ledger``) on ``ctx.connection``; each test
checks that exactly the writes of the executions that completed were kept, that every step
got an outcome, and that the pooled connection the next handler borrows is clean. The
events tests check numbering, fencing, caps, typed errors and following a run to its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from cyclone_dsl import (
    Client,
    EventLimitExceeded,
    InvalidArgument,
    RunState,
    StepContext,
    Worker,
    step,
    workflow,
)
from cyclone_dsl.client.model import Step
from tests.waiting import PROMPT, wait_until

StartWorker = Callable[..., Worker]
Rows = Callable[[], list[tuple[Any, ...]]]
Clock = Callable[[datetime], None]

GATES: dict[str, threading.Event] = {}
SEEN: dict[str, list[object]] = {}
BARRIERS: dict[str, threading.Barrier] = {}


def gate(name: str) -> threading.Event:
    return GATES.setdefault(name, threading.Event())


@pytest.fixture(autouse=True)
def _reset() -> None:
    GATES.clear()
    SEEN.clear()
    BARRIERS.clear()


@pytest.fixture
def ledger(cyclone_dsn: str) -> Rows:
    """An application table in the test's schema; returns a reader of its rows."""
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE ledger (run_id bigint, node text, attempt int, note text)")

    def rows() -> list[tuple[Any, ...]]:
        with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
            return sorted(conn.execute("SELECT run_id, node, attempt, note FROM ledger"))

    return rows


def write(ctx: StepContext, note: str = "") -> None:
    ctx.connection.execute(
        "INSERT INTO ledger VALUES (%s, %s, %s, %s)", (ctx.run_id, ctx.node, ctx.attempt, note)
    )


async def write_async(ctx: StepContext, note: str = "") -> None:
    await ctx.connection.execute(
        "INSERT INTO ledger VALUES (%s, %s, %s, %s)", (ctx.run_id, ctx.node, ctx.attempt, note)
    )


def only_step(client: Client, run_id: int) -> Step:
    (only,) = client.get_run(run_id).steps
    return only


def ended(client: Client, run_id: int, timeout: float = 15) -> RunState:
    return wait_until(
        lambda: (state := client.get_run(run_id).state).is_terminal and state,
        timeout=timeout,
        what=f"run {run_id} to end",
    )


def statement_running(dsn: str, text: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE query = %s AND state = 'active'",
            (text,),
        ).fetchone()
        return bool(row and row[0])


SLEEP = "SELECT pg_sleep($1)"


# -- transactional handlers -------------------------------------------------------------


@step(name="tsa_write", transactional=True, max_attempts=1)
def tsa_write(note: str, ctx: StepContext) -> str:
    write(ctx, note)
    return note


@step(name="tsa_async_write", transactional=True, max_attempts=1)
async def tsa_async_write(note: str, ctx: StepContext) -> str:
    await write_async(ctx, note)
    return note


@step(name="tsa_misuse", transactional=True, max_attempts=1)
def tsa_misuse(how: str, ctx: StepContext) -> str:
    """Writes, then does what the guide says not to do with its connection."""
    write(ctx, how)
    conn = ctx.connection
    if how == "commit":
        conn.commit()
    elif how == "rollback":
        conn.rollback()
    elif how == "autocommit":
        conn.autocommit = False
    elif how == "isolation":
        conn.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
    elif how in ("close", "close-return"):
        conn.close()
    elif how == "sql-rollback":
        conn.execute("ROLLBACK")
    if how == "close-return":
        return how  # its completion cannot be written on a closed connection
    raise RuntimeError(f"fails after {how}")


@step(name="tsa_async_misuse", transactional=True, max_attempts=1)
async def tsa_async_misuse(how: str, ctx: StepContext) -> str:
    await write_async(ctx, how)
    if how == "commit":
        await ctx.connection.commit()
    elif how in ("close", "close-return"):
        await ctx.connection.close()
    if how == "close-return":
        return how
    raise RuntimeError(f"fails after {how}")


@step(name="tsa_savepoints", transactional=True, max_attempts=1)
def tsa_savepoints(fail_at_end: bool, ctx: StepContext) -> str:
    write(ctx, "outer-1")
    with contextlib.suppress(ValueError), ctx.connection.transaction():
        write(ctx, "inner-rolled-back")
        raise ValueError("only the savepoint rolls back")
    with ctx.connection.transaction():
        write(ctx, "inner-kept")
    with contextlib.suppress(psycopg.ProgrammingError):
        ctx.connection.commit()  # refused by psycopg: the transaction goes on
    write(ctx, "outer-2")
    if fail_at_end:
        raise RuntimeError("fails after its savepoints")
    return "done"


@step(name="tsa_session_isolation", transactional=True, max_attempts=1)
def tsa_session_isolation(level: str, ctx: StepContext) -> str:
    ctx.connection.execute(f"SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL {level}")
    return level


@step(name="tsa_default_isolation", transactional=True, max_attempts=1)
def tsa_default_isolation(x: int, ctx: StepContext) -> str:
    # A statement that takes the snapshot, then a renewal of the lease (an update of the
    # step's row, from the worker's own connection): harmless at read committed.
    row = ctx.connection.execute("SELECT current_setting('transaction_isolation')").fetchone()
    assert ctx.heartbeat()
    return str(row[0])


@step(name="tsa_temp_table", transactional=True, max_attempts=1)
def tsa_temp_table(n: int, ctx: StepContext) -> int:
    ctx.connection.execute("CREATE TEMP TABLE tsa_scratch (x int)")
    ctx.connection.execute("INSERT INTO tsa_scratch SELECT generate_series(1, %s)", (n,))
    row = ctx.connection.execute("SELECT count(*) FROM tsa_scratch").fetchone()
    return int(row[0])


@step(name="tsa_async_temp_table", transactional=True, max_attempts=1)
async def tsa_async_temp_table(n: int, ctx: StepContext) -> int:
    await ctx.connection.execute("CREATE TEMP TABLE tsa_scratch (x int)")
    await ctx.connection.execute("INSERT INTO tsa_scratch SELECT generate_series(1, %s)", (n,))
    cur = await ctx.connection.execute("SELECT count(*) FROM tsa_scratch")
    row = await cur.fetchone()
    return int(row[0])


@step(name="tsa_search_path", transactional=True, max_attempts=1)
def tsa_search_path(how: str, ctx: StepContext) -> str:
    write(ctx, how)
    ctx.connection.execute(f"SET {how} search_path TO pg_catalog")
    return how


@step(name="tsa_async_search_path", transactional=True, max_attempts=1)
async def tsa_async_search_path(how: str, ctx: StepContext) -> str:
    await write_async(ctx, how)
    await ctx.connection.execute(f"SET {how} search_path TO pg_catalog")
    return how


@step(name="tsa_big_output", transactional=True, max_attempts=2)
def tsa_big_output(n: int, ctx: StepContext) -> str:
    write(ctx)
    return "x" * n


@step(name="tsa_async_bad_output", transactional=True, max_attempts=2)
async def tsa_async_bad_output(kind: str, ctx: StepContext) -> object:
    await write_async(ctx, kind)
    return "y" * 5000 if kind == "big" else {1, 2}


@step(name="tsa_skew", transactional=True, isolation="serializable", max_attempts=4)
def tsa_skew(key: str, ctx: StepContext) -> int:
    """Write skew: both read the ledger, then both insert. One of them cannot commit."""
    row = ctx.connection.execute("SELECT count(*) FROM ledger").fetchone()
    if ctx.attempt == 1:
        with contextlib.suppress(threading.BrokenBarrierError):
            BARRIERS[key].wait(5)
    write(ctx, f"saw {row[0]}")
    return int(row[0])


@step(name="tsa_emit_serializable", transactional=True, isolation="serializable", max_attempts=3)
def tsa_emit_serializable(n: int, ctx: StepContext) -> int:
    write(ctx)
    for i in range(n):
        ctx.progress(i + 1, n)
    return n


@step(name="tsa_sleeper", transactional=True, max_attempts=1)
def tsa_sleeper(seconds: float, ctx: StepContext) -> float:
    write(ctx)
    ctx.connection.execute("SELECT pg_sleep(%s)", (seconds,))
    return seconds


@workflow(name="tsa_deadline_flow")
def tsa_deadline_flow(seconds):  # type: ignore[no-untyped-def]
    return tsa_sleeper(seconds)


@step(name="tsa_async_sleeper", transactional=True, max_attempts=1)
async def tsa_async_sleeper(seconds: float, ctx: StepContext) -> float:
    await write_async(ctx)
    await ctx.connection.execute("SELECT pg_sleep(%s)", (seconds,))
    return seconds


@step(name="tsa_gated", transactional=True, max_attempts=1)
def tsa_gated(tag: str, ctx: StepContext) -> str:
    write(ctx, tag)
    gate(f"{tag}-started").set()
    assert gate(f"{tag}-release").wait(10)
    return tag


@workflow(name="tsa_pause_flow")
def tsa_pause_flow(tag):  # type: ignore[no-untyped-def]
    return tsa_write.named("after")(tsa_gated(tag))


# An hour-long timeout, which the test makes pass once the lock is held and waited for
# (see time_out_now): a short one could pass before the handler took the lock.
@step(name="tsa_locker", transactional=True, max_attempts=1, timeout=3600)
def tsa_locker(x: int, ctx: StepContext) -> int:
    ctx.connection.execute("UPDATE counter SET v = v + 100")
    gate("locked").set()
    ctx.wait_cancelled(10)  # its timeout passes while it holds the row lock
    return x


BUMP = "UPDATE counter SET v = v + 1"


@step(name="tsa_bumper", transactional=True, max_attempts=1, timeout=10)
def tsa_bumper(x: int, ctx: StepContext) -> int:
    ctx.connection.execute(BUMP)
    return x


def waiting_for_a_lock(dsn: str, text: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE query = %s AND wait_event_type = 'Lock'",
            (text,),
        ).fetchone()
        return bool(row and row[0])


def time_out_now(worker: Worker, run_id: int) -> None:
    """Make the timeout of the handler running in ``run_id`` pass now: its worker's own
    timeout (the heartbeat loop's look, every 0.1 s) fails the step and stops the handler,
    as when its monotonic deadline passes."""
    with worker._inflight_lock:
        (entry,) = [e for e in worker._running.values() if e.step.run_id == run_id]
        entry.deadline = time.monotonic()


WAIT_S = 0.4


@step(name="tsa_outlives_deadline", transactional=True, max_attempts=1)
def tsa_outlives_deadline(x: int, ctx: StepContext) -> int:
    write(ctx)
    ctx.wait_cancelled(WAIT_S)  # not cancelled when no scanner ends the run at its deadline
    return x


PAST_DEADLINE = {"sync": threading.Event(), "async": threading.Event()}
HANDLER_WAITS = {"sync": threading.Event(), "async": threading.Event()}


@step(name="tsa_waits_past_deadline", transactional=True, max_attempts=1)
def tsa_waits_past_deadline(x: int, ctx: StepContext) -> int:
    write(ctx)
    HANDLER_WAITS["sync"].set()
    PAST_DEADLINE["sync"].wait(15)  # the test moves the clock past the run's deadline
    return x


@step(name="tsa_async_waits_past_deadline", transactional=True, max_attempts=1)
async def tsa_async_waits_past_deadline(x: int, ctx: StepContext) -> int:
    await write_async(ctx)
    HANDLER_WAITS["async"].set()
    await asyncio.to_thread(PAST_DEADLINE["async"].wait, 15)
    return x


@workflow(name="tsa_waits_deadline_tx")
def tsa_waits_deadline_tx(x):  # type: ignore[no-untyped-def]
    return tsa_waits_past_deadline(x)


@workflow(name="tsa_async_waits_deadline_tx")
def tsa_async_waits_deadline_tx(x):  # type: ignore[no-untyped-def]
    return tsa_async_waits_past_deadline(x)


WAITING_PAST_DEADLINE = {
    "sync": (tsa_waits_past_deadline, tsa_waits_deadline_tx),
    "async": (tsa_async_waits_past_deadline, tsa_async_waits_deadline_tx),
}


@step(name="tsa_async_outlives_deadline", transactional=True, max_attempts=1)
async def tsa_async_outlives_deadline(x: int, ctx: StepContext) -> int:
    await write_async(ctx)
    await asyncio.sleep(WAIT_S)
    return x


@workflow(name="tsa_deadline_tx")
def tsa_deadline_tx(x):  # type: ignore[no-untyped-def]
    return tsa_outlives_deadline(x)


@workflow(name="tsa_async_deadline_tx")
def tsa_async_deadline_tx(x):  # type: ignore[no-untyped-def]
    return tsa_async_outlives_deadline(x)


OUTLIVING = {
    "sync": (tsa_outlives_deadline, tsa_deadline_tx),
    "async": (tsa_async_outlives_deadline, tsa_async_deadline_tx),
}


# -- transactional: the handler's use of its connection ----------------------------------


def test_a_handler_that_misuses_its_connection_keeps_no_write_and_leaves_a_clean_pool(
    client: Client, start_worker: StartWorker, ledger: Rows
) -> None:
    """commit()/rollback()/autocommit/isolation_level are refused inside the worker's
    transaction; a closed connection fails the attempt; a ROLLBACK in SQL ended the
    worker's transaction, which fails the step for good (permanent: the worker cannot
    tell it from a COMMIT, whose writes a retry would repeat). Each step fails, none
    keeps its write, and the next handler (one connection: concurrency=1) gets a working
    connection."""
    start_worker(tsa_misuse, tsa_write, concurrency=1)
    cases = ["commit", "rollback", "autocommit", "isolation", "close", "close-return"]
    cases.append("sql-rollback")
    handles = {how: client.enqueue(tsa_misuse, how) for how in cases}
    for how, handle in handles.items():
        assert ended(client, handle.id) == RunState.FAILED, how
        failed = only_step(client, handle.id)
        kind = "permanent" if how == "sql-rollback" else "error"
        assert failed.error_kind == kind and failed.attempts, how
    refused = {how: only_step(client, handles[how].id).error or "" for how in cases[:4]}
    assert all("ProgrammingError" in error for error in refused.values()), refused
    assert ledger() == []
    after = client.enqueue(tsa_write, "next")
    assert after.result(timeout=15) == "next"
    assert ledger() == [(after.id, "tsa_write", 1, "next")]


def test_an_async_handler_that_misuses_its_connection_keeps_no_write(
    client: Client, start_worker: StartWorker, ledger: Rows
) -> None:
    start_worker(tsa_async_misuse, tsa_async_write, concurrency=1)
    handles = [client.enqueue(tsa_async_misuse, how) for how in ("commit", "close", "close-return")]
    for handle in handles:
        assert ended(client, handle.id) == RunState.FAILED
    assert ledger() == []
    after = client.enqueue(tsa_async_write, "next")
    assert after.result(timeout=15) == "next"
    assert ledger() == [(after.id, "tsa_async_write", 1, "next")]


def test_savepoints_roll_back_their_block_and_a_late_failure_rolls_back_everything(
    client: Client, start_worker: StartWorker, ledger: Rows
) -> None:
    start_worker(tsa_savepoints)
    kept = client.enqueue(tsa_savepoints, False)
    lost = client.enqueue(tsa_savepoints, True)
    assert kept.result(timeout=15) == "done"
    assert ended(client, lost.id) == RunState.FAILED
    assert [(row[0], row[3]) for row in ledger()] == [
        (kept.id, "inner-kept"),
        (kept.id, "outer-1"),
        (kept.id, "outer-2"),
    ]


def test_a_session_isolation_set_by_a_handler_does_not_leak_into_the_next(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(tsa_session_isolation, tsa_default_isolation, concurrency=1)
    first = client.enqueue(tsa_session_isolation, "REPEATABLE READ")
    assert first.result(timeout=15) == "REPEATABLE READ"
    second = client.enqueue(tsa_default_isolation, 1)
    assert ended(client, second.id) == RunState.COMPLETED, only_step(client, second.id).error
    assert second.result(timeout=15) == "read committed"


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_temp_table_of_one_handler_is_not_left_to_the_next(
    client: Client, start_worker: StartWorker, flavour: str
) -> None:
    """It was: the same step run again failed with DuplicateTable."""
    handler = tsa_temp_table if flavour == "sync" else tsa_async_temp_table
    start_worker(handler, concurrency=1)
    assert client.enqueue(handler, 2).result(timeout=15) == 2
    second = client.enqueue(handler, 3)
    assert ended(client, second.id) == RunState.COMPLETED, only_step(client, second.id).error
    assert second.result(timeout=15) == 3


# -- transactional: outputs, isolation, time ---------------------------------------------


def test_an_output_that_cannot_be_stored_fails_for_good_and_rolls_back(
    client: Client, start_worker: StartWorker, ledger: Rows
) -> None:
    start_worker(tsa_big_output, tsa_async_bad_output, max_output_bytes=1000)
    cases = [
        (client.enqueue(tsa_big_output, 2000), "output_limit"),
        (client.enqueue(tsa_async_bad_output, "set"), "invalid_output"),
        (client.enqueue(tsa_async_bad_output, "big"), "output_limit"),
    ]
    for handle, kind in cases:
        assert ended(client, handle.id) == RunState.FAILED
        only = only_step(client, handle.id)
        assert (only.error_kind, [a.number for a in only.attempts]) == (kind, [1])  # no retry
    assert ledger() == []


def test_a_serialization_failure_is_retried_and_each_write_lands_once(
    client: Client, start_worker: StartWorker, ledger: Rows, clock: Clock
) -> None:
    BARRIERS["skew"] = threading.Barrier(2)
    start_worker(tsa_skew, concurrency=2)
    first = client.enqueue(tsa_skew, "skew")
    second = client.enqueue(tsa_skew, "skew")
    wait_until(
        lambda: any(only_step(client, h.id).attempts for h in (first, second)),
        timeout=15,
        what="a serialization failure",
    )
    clock(datetime.now(UTC) + timedelta(seconds=5))  # past the retry's backoff
    assert sorted([first.result(timeout=15), second.result(timeout=15)]) == [0, 1]
    assert sorted(row[3] for row in ledger()) == ["saw 0", "saw 1"]
    errors = [a.error or "" for h in (first, second) for a in only_step(client, h.id).attempts]
    assert len(errors) == 1 and "SerializationFailure" in errors[0], errors


def test_a_serializable_step_that_emits_completes_on_its_first_attempt(
    client: Client, start_worker: StartWorker, ledger: Rows
) -> None:
    """Events are written FOR SHARE of the step's row from another connection: that must
    not make the serializable completion's update of the row a conflict."""
    start_worker(tsa_emit_serializable)
    handle = client.enqueue(tsa_emit_serializable, 3)
    assert handle.result(timeout=15) == 3
    only = only_step(client, handle.id)
    assert (only.attempt_number, only.attempts) == (1, ())
    assert [(e.seq, e.fenced) for e in client.events_of(handle.id)] == [
        (1, False),
        (2, False),
        (3, False),
    ]
    assert len(ledger()) == 1


def test_a_deadline_that_passes_mid_statement_ends_the_run_and_rolls_back(
    client: Client, start_worker: StartWorker, ledger: Rows, cyclone_dsn: str, clock: Clock
) -> None:
    start_worker(tsa_sleeper, tsa_deadline_flow)
    # A deadline the claim cannot miss on a loaded machine (nothing starts in a run past
    # its deadline), passed by moving the clock once the statement runs.
    run = client.submit(tsa_deadline_flow, 30, deadline=timedelta(hours=1))
    wait_until(lambda: statement_running(cyclone_dsn, SLEEP), timeout=10, what="the statement")
    clock(datetime.now(UTC) + timedelta(hours=2))
    assert ended(client, run.id, timeout=PROMPT) == RunState.FAILED
    wait_until(
        lambda: not statement_running(cyclone_dsn, SLEEP),
        timeout=PROMPT,
        what="the statement to be interrupted",
    )
    assert run.get().step("tsa_sleeper").error_kind == "deadline"
    assert ledger() == []


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_transactional_step_that_returns_past_the_deadline_fails_the_run(
    client: Client, start_worker: StartWorker, ledger: Rows, flavour: str, clock: Clock
) -> None:
    """docs/concepts/waits.md: a deadline that passed first wins even when the scanner is
    late; a step that completes after it fails the run, its result ignored. It completed the
    run and committed its write: the completion read the time as now(), the start of the
    handler's transaction."""
    handler, flow = WAITING_PAST_DEADLINE[flavour]
    PAST_DEADLINE[flavour].clear()
    HANDLER_WAITS[flavour].clear()
    start_worker(handler, flow, scanners=False)
    # A deadline the claim cannot miss on a loaded machine (nothing starts in a run past
    # its deadline), passed by moving the clock while the handler runs.
    run = client.submit(flow, 1, deadline=timedelta(hours=1))
    assert HANDLER_WAITS[flavour].wait(15), "the handler did not start"
    clock(datetime.now(UTC) + timedelta(hours=2))
    PAST_DEADLINE[flavour].set()
    assert (ended(client, run.id), ledger()) == (RunState.FAILED, [])
    assert run.get().step(handler.name).error_kind == "deadline"


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_transactional_step_records_when_it_completed(
    client: Client, start_worker: StartWorker, ledger: Rows, flavour: str
) -> None:
    """Its completed_at was when its handler started (now() of its transaction)."""
    handler, _ = OUTLIVING[flavour]
    start_worker(handler)
    handle = client.enqueue(handler, 1)
    assert handle.result(timeout=15) == 1
    only = only_step(client, handle.id)
    assert only.started_at is not None and only.completed_at is not None
    assert only.completed_at - only.started_at >= timedelta(seconds=WAIT_S)


# -- transactional: cancel, pause, locks ---------------------------------------------------


def test_cancelling_an_async_handlers_statement_rolls_back_and_frees_the_connection(
    client: Client, start_worker: StartWorker, ledger: Rows, cyclone_dsn: str
) -> None:
    start_worker(tsa_async_sleeper, tsa_async_write, concurrency=1)
    handle = client.enqueue(tsa_async_sleeper, 30)
    wait_until(lambda: statement_running(cyclone_dsn, SLEEP), timeout=10, what="the statement")
    client.cancel(handle.id)
    wait_until(
        lambda: not statement_running(cyclone_dsn, SLEEP),
        timeout=5,
        what="the statement to be cancelled",
    )
    assert client.get_run(handle.id).state == RunState.CANCELLED
    after = client.enqueue(tsa_async_write, "next")
    assert after.result(timeout=15) == "next"
    assert ledger() == [(after.id, "tsa_async_write", 1, "next")]


def test_a_step_that_completes_while_its_run_is_paused_keeps_its_write_once(
    client: Client, start_worker: StartWorker, ledger: Rows
) -> None:
    start_worker(tsa_gated, tsa_write, tsa_pause_flow, concurrency=2)
    run = client.submit(tsa_pause_flow, "p")
    assert gate("p-started").wait(10)
    client.pause(run.id)
    gate("p-release").set()
    wait_until(
        lambda: run.get().step("tsa_gated").state == "completed",
        timeout=10,
        what="the running step to complete",
    )
    assert run.get().state == RunState.PAUSED
    assert [row[1] for row in ledger()] == ["tsa_gated"]  # the next step waits
    client.resume(run.id)
    assert run.result(timeout=15) == "p"
    assert sorted(row[1] for row in ledger()) == ["after", "tsa_gated"]


def test_a_timed_out_handler_that_holds_a_lock_releases_it_for_the_next_step(
    client: Client, start_worker: StartWorker, cyclone_dsn: str
) -> None:
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE counter (v int)")
        conn.execute("INSERT INTO counter VALUES (0)")
    worker = start_worker(tsa_locker, tsa_bumper, concurrency=2)
    locker = client.enqueue(tsa_locker, 1)
    assert gate("locked").wait(10)
    bumper = client.enqueue(tsa_bumper, 2)
    wait_until(
        lambda: waiting_for_a_lock(cyclone_dsn, BUMP),
        timeout=PROMPT,
        what="the next step to wait for the locker's row lock",
    )
    time_out_now(worker, locker.id)
    assert bumper.result(timeout=PROMPT) == 2
    assert ended(client, locker.id) == RunState.FAILED
    assert only_step(client, locker.id).error_kind == "timeout"
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT v FROM counter").fetchone() == (1,)


# -- events -------------------------------------------------------------------------------


@step(name="tsa_capped", max_attempts=2)
def tsa_capped(n: int, ctx: StepContext) -> int:
    stored = 0
    try:
        for i in range(n):
            ctx.emit([ctx.attempt, i])
            stored += 1
    except EventLimitExceeded as exc:
        SEEN.setdefault("cap", []).append((exc.run_id, exc.node, exc.cap))
    if ctx.attempt == 1:
        raise RuntimeError("the first attempt fails after its events")
    return stored


# A timeout long enough for the write and the first event on a loaded machine.
@step(name="tsa_late_emitter", transactional=True, max_attempts=1, timeout=2.0)
def tsa_late_emitter(x: int, ctx: StepContext) -> int:
    write(ctx)
    ctx.emit("before")
    ctx.wait_cancelled(5)
    ctx.emit("after")
    gate("late-emitted").set()
    return x


@step(name="tsa_cancel_emitter", max_attempts=1)
def tsa_cancel_emitter(x: int, ctx: StepContext) -> int:
    ctx.emit("started")
    ctx.wait_cancelled(10)
    ctx.emit("after cancel")
    gate("cancel-emitted").set()
    return x


@step(name="tsa_many")
def tsa_many(n: int, ctx: StepContext) -> int:
    for i in range(n):
        ctx.emit(i)
    return n


@step(name="tsa_numbers")
def tsa_numbers(x: None, ctx: StepContext) -> None:
    ctx.emit({"big": 1e20, "small": 1.5e-7, "int": 2**62})


@step(name="tsa_bad_events")
def tsa_bad_events(x: None, ctx: StepContext) -> list[str]:
    deep: list[object] = []
    for _ in range(300):
        deep = [deep]
    attempts: list[Callable[[], None]] = [
        lambda: ctx.emit({1: "a"}),
        lambda: ctx.emit(2**64),
        lambda: ctx.emit(deep),
        lambda: ctx.emit("\ud800"),
        lambda: ctx.emit({"\ud800": 1}),
        lambda: ctx.emit(b"bytes"),
        lambda: ctx.emit(object()),
        lambda: ctx.progress(2**64, 2**64),
        lambda: ctx.progress(0, 1, "a\x00b"),
        lambda: ctx.progress(1, 1, "\udc00"),
    ]
    refused = []
    for attempt in attempts:
        try:
            attempt()
            refused.append("stored")
        except InvalidArgument as exc:
            refused.append(type(exc).__name__)
        except Exception as exc:
            refused.append(f"raw {type(exc).__name__}")
    ctx.emit("ok")
    return refused


def test_the_event_cap_counts_every_attempt(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    start_worker(tsa_capped, max_events_per_step=3)
    handle = client.enqueue(tsa_capped, 2)
    wait_until(lambda: only_step(client, handle.id).attempts, timeout=10, what="attempt 1")
    clock(datetime.now(UTC) + timedelta(seconds=5))  # past the retry's backoff
    assert handle.result(timeout=10) == 1
    assert SEEN["cap"] == [(handle.id, "tsa_capped", 3)]
    assert [(e.seq, e.data, e.attempt, e.fenced) for e in client.events_of(handle.id)] == [
        (1, [1, 0], 1, False),
        (2, [1, 1], 1, False),
        (3, [2, 0], 2, False),
    ]


def test_events_after_a_transactional_timeout_are_fenced_and_the_write_rolled_back(
    client: Client, start_worker: StartWorker, ledger: Rows
) -> None:
    start_worker(tsa_late_emitter)
    handle = client.enqueue(tsa_late_emitter, 1)
    assert ended(client, handle.id) == RunState.FAILED
    assert gate("late-emitted").wait(10)
    assert only_step(client, handle.id).error_kind == "timeout"
    assert [(e.data, e.fenced) for e in client.events_of(handle.id)] == [
        ("before", False),  # rolled back with the write, but kept: events are not in it
        ("after", True),
    ]
    assert ledger() == []


def test_a_follower_of_a_run_cancelled_mid_step_ends(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(tsa_cancel_emitter)
    handle = client.enqueue(tsa_cancel_emitter, 1)
    live = handle.events(timeout=15)
    followed = [next(live).data]
    client.cancel(handle.id)
    followed.extend(e.data for e in live)  # ends: the run is cancelled
    assert followed[0] == "started"
    assert gate("cancel-emitted").wait(10)
    assert [(e.data, e.fenced) for e in client.events_of(handle.id)] == [
        ("started", False),
        ("after cancel", True),
    ]


def test_a_follower_pages_past_one_read_live_and_after_the_end(
    client: Client, start_worker: StartWorker
) -> None:
    handle = client.enqueue(tsa_many, 520)  # more than one page of 500
    seen: list[int] = []
    follower = threading.Thread(
        target=lambda: seen.extend(e.seq for e in handle.events(timeout=30))
    )
    follower.start()
    start_worker(tsa_many)
    follower.join(30)
    assert seen == list(range(1, 521))
    assert [e.seq for e in handle.events(after=499)] == list(range(500, 521))
    assert [e.data for e in handle.events()] == list(range(520))


def test_a_follower_and_a_read_give_the_same_event_data(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(tsa_numbers)
    handle = client.enqueue(tsa_numbers, None)
    followed = [e.data for e in handle.events(timeout=15)]
    read = [e.data for e in client.events_of(handle.id)]
    assert read == [{"big": 1e20, "small": 1.5e-7, "int": 2**62}]
    assert isinstance(read[0]["big"], float)  # type: ignore[index]
    assert followed == read
    assert isinstance(followed[0]["big"], float)  # type: ignore[index]


def test_bad_event_values_get_typed_errors_and_store_nothing(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(tsa_bad_events)
    handle = client.enqueue(tsa_bad_events, None)
    assert handle.result(timeout=15) == ["InvalidPayload"] * 10
    assert [e.data for e in client.events_of(handle.id)] == ["ok"]


def test_bad_follow_arguments_get_typed_errors(client: Client) -> None:
    handle = client.enqueue(tsa_many, 1)
    for wrong in (-1, float("nan"), "1", True):
        with pytest.raises(InvalidArgument, match="timeout"):
            list(handle.events(timeout=wrong))  # type: ignore[arg-type]
    for limit in (True, 0, 2**63):
        with pytest.raises(InvalidArgument, match="limit"):
            client.events_of(handle.id, limit=limit)
    assert client.events_of(handle.id, after=2**63 - 1) == []
    assert client.events_of(handle.id, after=2**64) == []


@pytest.mark.parametrize("how", ["LOCAL", "SESSION"])
@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_handler_that_changes_its_search_path_still_completes(
    client: Client, start_worker: StartWorker, ledger: Rows, flavour: str, how: str
) -> None:
    """Its completion, in the same transaction after it, could not find Cyclone's tables:
    the step failed for good and its write rolled back. The completion reads them through
    the session's own search_path, and the next handler gets it too."""
    handler = tsa_search_path if flavour == "sync" else tsa_async_search_path
    start_worker(handler, concurrency=1)
    first = client.enqueue(handler, how)
    assert first.result(timeout=15) == how
    assert client.enqueue(handler, how).result(timeout=15) == how
    assert [row[3] for row in ledger()] == [how, how]
