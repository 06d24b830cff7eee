"""Transactional steps: the handler's writes on ``ctx.connection`` commit with its step's
completion, or not at all.

Every test counts the rows the handlers wrote in an application table next to Cyclone's:
exactly one per completed step, none for an attempt that did not complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from cyclone_dsl import Client, InvalidArgument, StepContext, Worker, action, step, workflow
from cyclone_dsl.client.model import Step
from cyclone_dsl.dsl.step import StepDef
from cyclone_dsl.engine import RUN_DONE_CHANNEL, run_ids_of
from cyclone_dsl.states import RunState
from tests.waiting import wait_until

StartWorker = Callable[..., Worker]


@pytest.fixture
def ledger(cyclone_dsn: str) -> Callable[[], list[tuple[Any, ...]]]:
    """An application table in the test's schema; returns a reader of its rows."""
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE ledger (run_id bigint, node text, attempt int, note text,"
            " UNIQUE (run_id, node))"
        )

    def rows() -> list[tuple[Any, ...]]:
        with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
            return sorted(conn.execute("SELECT run_id, node, attempt, note FROM ledger"))

    return rows


def write(ctx: StepContext, note: str = "") -> None:
    ctx.connection.execute(
        "INSERT INTO ledger VALUES (%s, %s, %s, %s)", (ctx.run_id, ctx.node, ctx.attempt, note)
    )


@step(name="tx_pay", transactional=True)
def pay(amount: int, *, ctx: StepContext) -> int:
    write(ctx, f"paid {amount}")
    return amount * 2


@step(name="tx_flaky", transactional=True, max_attempts=3)
def flaky(n: int, *, ctx: StepContext) -> int:
    write(ctx)
    if ctx.attempt == 1:
        raise RuntimeError("first attempt fails after its write")
    return n


@step(name="tx_slow", transactional=True, max_attempts=2, timeout=1.0)
def slow(n: int, *, ctx: StepContext) -> int:
    write(ctx)
    if ctx.attempt == 1:
        ctx.connection.execute("SELECT pg_sleep(30)")  # interrupted at the timeout
    return n


@step(name="tx_bad_output", transactional=True)
def bad_output(n: int, *, ctx: StepContext) -> object:
    write(ctx)
    return {1, 2}  # not JSON: the step fails for good, the write rolls back


@step(name="tx_swallows", transactional=True, max_attempts=2)
def swallows(n: int, *, ctx: StepContext) -> int:
    write(ctx)
    if ctx.attempt == 1:
        # Swallowed: the transaction is aborted now, and the completion cannot commit.
        with contextlib.suppress(psycopg.errors.DivisionByZero):
            ctx.connection.execute("SELECT 1 / 0")
    return n


@step(name="tx_isolation", transactional=True, isolation="serializable")
def isolation(n: int, *, ctx: StepContext) -> str:
    row = ctx.connection.execute("SHOW transaction_isolation").fetchone()
    return str(row[0])


@step(name="tx_default_isolation", transactional=True)
def default_isolation(n: int, *, ctx: StepContext) -> str:
    row = ctx.connection.execute("SHOW transaction_isolation").fetchone()
    return str(row[0])


@action(name="tx_async", transactional=True)
async def async_write(n: int, *, ctx: StepContext) -> None:
    await ctx.connection.execute(
        "INSERT INTO ledger VALUES (%s, %s, %s, %s)", (ctx.run_id, ctx.node, ctx.attempt, "async")
    )
    await asyncio.sleep(0)


@step(name="tx_async_slow", transactional=True, max_attempts=2, timeout=1.0)
async def async_slow(n: int, *, ctx: StepContext) -> int:
    await ctx.connection.execute(
        "INSERT INTO ledger VALUES (%s, %s, %s, %s)", (ctx.run_id, ctx.node, ctx.attempt, "")
    )
    if ctx.attempt == 1:
        await asyncio.sleep(30)
    return n


@step(name="tx_async_slow_statement", transactional=True, max_attempts=2, timeout=1.0)
async def async_slow_statement(n: int, *, ctx: StepContext) -> int:
    await ctx.connection.execute(
        "INSERT INTO ledger VALUES (%s, %s, %s, %s)", (ctx.run_id, ctx.node, ctx.attempt, "")
    )
    if ctx.attempt == 1:
        await ctx.connection.execute("SELECT pg_sleep(30)")  # cancelled at the timeout
    return n


@step(name="tx_just_late", transactional=True, max_attempts=1, timeout=0.3)
def just_late(n: int, *, ctx: StepContext) -> int:
    write(ctx)
    time.sleep(0.32)  # past the timeout, before the heartbeat loop looks (every 0.1 s)
    return n


@step(name="tx_plain", max_attempts=1)
def plain(n: int, *, ctx: StepContext) -> int:
    ctx.connection  # noqa: B018 - raises: the step is not transactional
    return n


@workflow(name="tx_order")
def order(amount):  # type: ignore[no-untyped-def]
    return pay.named("second")(pay(amount))


def only_step(client: Client, run_id: int) -> Step:
    (only,) = client.get_run(run_id).steps
    return only


def state_of(client: Client, run_id: int) -> RunState:
    return client.get_run(run_id).state


def test_writes_commit_with_the_steps_completion(
    client: Client, start_worker: StartWorker, ledger: Callable[[], list[tuple[Any, ...]]]
) -> None:
    start_worker(order)
    run = client.submit(order, 5)
    assert run.result(timeout=20) == 20
    assert ledger() == [(run.id, "second", 1, "paid 10"), (run.id, "tx_pay", 1, "paid 5")]


def test_a_failed_attempt_leaves_no_write(
    client: Client, start_worker: StartWorker, ledger: Callable[[], list[tuple[Any, ...]]]
) -> None:
    start_worker(flaky)
    handle = client.enqueue(flaky, 3)
    assert handle.result(timeout=20) == 3
    assert [row[2] for row in ledger()] == [2]  # the first attempt's write rolled back
    done = only_step(client, handle.id)
    assert (done.attempt, [a.number for a in done.attempts]) == (1, [1])  # attempt: retries so far


def test_a_timeout_interrupts_the_statement_and_rolls_back(
    client: Client, start_worker: StartWorker, ledger: Callable[[], list[tuple[Any, ...]]]
) -> None:
    start_worker(slow)
    started = time.monotonic()
    handle = client.enqueue(slow, 4)
    assert handle.result(timeout=20) == 4
    assert time.monotonic() - started < 10, "the sleeping statement was not interrupted"
    assert [row[2] for row in ledger()] == [2]
    (first,) = only_step(client, handle.id).attempts
    assert first.error_kind == "timeout"


def test_an_output_that_cannot_be_stored_rolls_back(
    client: Client, start_worker: StartWorker, ledger: Callable[[], list[tuple[Any, ...]]]
) -> None:
    start_worker(bad_output)
    handle = client.enqueue(bad_output, 1)
    wait_until(
        lambda: state_of(client, handle.id) == RunState.FAILED, timeout=20, what="the run to fail"
    )
    assert only_step(client, handle.id).error_kind == "invalid_output"
    assert ledger() == []


def test_a_completion_that_cannot_commit_fails_the_attempt(
    client: Client, start_worker: StartWorker, ledger: Callable[[], list[tuple[Any, ...]]]
) -> None:
    start_worker(swallows)
    handle = client.enqueue(swallows, 7)
    assert handle.result(timeout=20) == 7
    assert [row[2] for row in ledger()] == [2]
    (first,) = only_step(client, handle.id).attempts
    assert "aborted" in (first.error or "")


def test_cancelling_the_run_rolls_back_the_running_handler(
    client: Client,
    start_worker: StartWorker,
    ledger: Callable[[], list[tuple[Any, ...]]],
    cyclone_dsn: str,
) -> None:
    start_worker(slow)
    handle = client.enqueue(slow, 1)
    wait_until(lambda: _sleeping(cyclone_dsn), timeout=20, what="the handler's statement to run")
    client.cancel(handle.id)
    wait_until(
        lambda: not _sleeping(cyclone_dsn), timeout=10, what="the statement to be interrupted"
    )
    assert state_of(client, handle.id) == RunState.CANCELLED
    assert ledger() == []


def _sleeping(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(30)'"
            " AND state = 'active'"
        ).fetchone()
        return bool(row and row[0])


def test_the_handler_runs_at_its_isolation_level(client: Client, start_worker: StartWorker) -> None:
    start_worker(isolation, default_isolation)
    assert client.enqueue(isolation, 1).result(timeout=20) == "serializable"
    assert client.enqueue(default_isolation, 1).result(timeout=20) == "read committed"


def test_an_async_handler_writes_on_an_async_connection(
    client: Client, start_worker: StartWorker, ledger: Callable[[], list[tuple[Any, ...]]]
) -> None:
    start_worker(async_write, async_slow)
    first = client.enqueue(async_write, 1)
    second = client.enqueue(async_slow, 2)
    assert first.wait(timeout=20).state == RunState.COMPLETED
    assert second.result(timeout=20) == 2
    assert sorted((row[0], row[2], row[3]) for row in ledger()) == [
        (first.id, 1, "async"),
        (second.id, 2, ""),
    ]


ASYNC_TIMEOUT_SEEN: list[bool] = []
LATE_WRITE_DONE = threading.Event()


@step(name="tx_async_polite", transactional=True, max_attempts=1, timeout=0.3)
async def async_polite(n: int, *, ctx: StepContext) -> int:
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        ASYNC_TIMEOUT_SEEN.append(ctx.cancelled)
        raise
    return n


@step(name="tx_async_stubborn", transactional=True, max_attempts=1, timeout=0.3)
async def async_stubborn(n: int, *, ctx: StepContext) -> int:
    connection = ctx.connection
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:  # the mistake: carry on regardless
        await asyncio.sleep(0.5)
        with contextlib.suppress(Exception):
            await connection.execute(
                "INSERT INTO ledger VALUES (%s, %s, %s, 'late')", (ctx.run_id, ctx.node, 1)
            )
        LATE_WRITE_DONE.set()
    return n


def test_an_async_transactional_handler_sees_cancelled_at_its_timeout(
    client: Client, start_worker: StartWorker
) -> None:
    """ctx.cancelled is true once the timeout passed, also when the handler learns of it
    by the CancelledError the timeout raises in it."""
    ASYNC_TIMEOUT_SEEN.clear()
    start_worker(async_polite)
    handle = client.enqueue(async_polite, 1)
    assert handle.wait(timeout=20).state is RunState.FAILED
    assert only_step(client, handle.id).error_kind == "timeout"
    assert ASYNC_TIMEOUT_SEEN == [True]


def test_an_async_transactional_handler_that_swallows_its_timeout_commits_nothing(
    client: Client, start_worker: StartWorker, ledger: Callable[[], list[tuple[Any, ...]]]
) -> None:
    """A handler that catches the timeout's cancellation and writes afterwards still runs
    in its own transaction, which rolls back: the write never lands (not on a connection
    given back to the pool, in another step's transaction). Until it returns it keeps its
    slot: with one slot, nothing else starts meanwhile."""
    LATE_WRITE_DONE.clear()
    start_worker(async_stubborn, async_write, concurrency=1)
    handle = client.enqueue(async_stubborn, 1)
    assert handle.wait(timeout=20).state is RunState.FAILED
    others = [client.enqueue(async_write, i) for i in range(5)]
    first = others[0].wait(timeout=20)
    assert LATE_WRITE_DONE.is_set(), "a step started while the stubborn handler still ran"
    assert first.state is RunState.COMPLETED
    for other in others:
        assert other.wait(timeout=20).state is RunState.COMPLETED
    assert [row[3] for row in ledger()] == ["async"] * 5
    assert only_step(client, handle.id).error_kind == "timeout"


def test_an_async_handlers_statement_is_cancelled_at_its_timeout(
    client: Client, start_worker: StartWorker, ledger: Callable[[], list[tuple[Any, ...]]]
) -> None:
    """The timeout cancels an async handler's task while its statement runs on the
    server: the statement must be cancelled there too, the transaction rolled back and
    the connection given back clean, for the retry to complete."""
    start_worker(async_slow_statement)
    started = time.monotonic()
    handle = client.enqueue(async_slow_statement, 5)
    assert handle.result(timeout=20) == 5
    assert time.monotonic() - started < 10, "the sleeping statement was not cancelled"
    assert [row[2] for row in ledger()] == [2]
    (first,) = only_step(client, handle.id).attempts
    assert first.error_kind == "timeout"


def test_a_result_returned_just_past_the_timeout_is_rolled_back(
    client: Client, start_worker: StartWorker, ledger: Callable[[], list[tuple[Any, ...]]]
) -> None:
    """A handler that returns past its timeout fails with timeout, and its writes roll
    back: its transaction must not commit the late result."""
    start_worker(just_late, concurrency=6)
    handles = [client.enqueue(just_late, n) for n in range(6)]
    for handle in handles:
        assert handle.wait(timeout=20).state == RunState.FAILED
        assert only_step(client, handle.id).error_kind == "timeout"
    assert ledger() == []


def test_many_transactional_steps_each_write_once(
    client: Client, start_worker: StartWorker, ledger: Callable[[], list[tuple[Any, ...]]]
) -> None:
    start_worker(order, concurrency=8)
    runs = client.submit_many(order, list(range(100)))
    for run in runs:
        run.wait(timeout=60)
    assert len(ledger()) == 200
    assert client.run_counts() == {RunState.COMPLETED.value: 100}


def test_the_connection_of_a_plain_step_is_refused(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(plain)
    handle = client.enqueue(plain, 1)
    wait_until(
        lambda: state_of(client, handle.id) == RunState.FAILED, timeout=30, what="the run to fail"
    )
    assert "not transactional" in (only_step(client, handle.id).error or "")


def test_the_worker_releases_the_transaction_at_a_lost_lease(
    client: Client,
    start_worker: StartWorker,
    ledger: Callable[[], list[tuple[Any, ...]]],
    cyclone_dsn: str,
) -> None:
    """The run is cancelled from another connection while the handler computes (no
    statement running): its transaction rolls back when it returns."""
    release = threading.Event()

    @step(name="tx_waits", transactional=True)
    def waits(n: int, *, ctx: StepContext) -> int:
        write(ctx)
        release.wait(20)
        return n

    start_worker(waits)
    handle = client.enqueue(waits, 1)
    wait_until(
        lambda: only_step(client, handle.id).state == "running", timeout=20, what="the step to run"
    )
    client.cancel(handle.id)
    time.sleep(0.5)
    release.set()
    wait_until(
        lambda: not _idle_in_transaction(cyclone_dsn),
        timeout=10,
        what="the handler's transaction to end",
    )
    assert ledger() == []


def _idle_in_transaction(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE state LIKE 'idle in transaction%%'"
            " AND application_name = %s",
            (f"cyclone-handler-{os.getpid()}",),  # not another test process's handlers
        ).fetchone()
        return bool(row and row[0])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"transactional": True, "isolation": "snapshot"}, "isolation must be one of"),
        ({"isolation": "serializable"}, "add transactional=True"),
        ({"transactional": "yes"}, "transactional must be a bool"),
    ],
)
def test_bad_options_are_refused_at_definition(options: dict[str, Any], message: str) -> None:
    def handler(n: int, *, ctx: StepContext) -> int:
        return n

    with pytest.raises(InvalidArgument, match=message):
        step(name="tx_bad", **options)(handler)


def test_a_transactional_handler_must_take_ctx() -> None:
    def no_ctx(n: int) -> int:
        return n

    with pytest.raises(InvalidArgument, match="takes a ctx parameter"):
        step(name="tx_no_ctx", transactional=True)(no_ctx)


def test_a_completion_fenced_out_rolls_back_the_handlers_writes(
    client: Client,
    start_worker: StartWorker,
    ledger: Callable[[], list[tuple[Any, ...]]],
    cyclone_dsn: str,
) -> None:
    """While the handler runs, its step is claimed again elsewhere (as after a reclaim:
    the generation moves on). The worker still believes it holds the lease, so only the
    fenced completion inside the handler's transaction keeps its writes out."""

    @step(name="tx_overtaken", transactional=True)
    def overtaken(n: int, *, ctx: StepContext) -> int:
        write(ctx)
        with psycopg.connect(cyclone_dsn, autocommit=True) as other:
            other.execute(
                "UPDATE cyclone_steps SET lease_generation = lease_generation + 1 WHERE id = %s",
                (ctx.step_id,),
            )
        return n

    start_worker(overtaken)
    handle = client.enqueue(overtaken, 1)
    wait_until(
        lambda: not _idle_in_transaction(cyclone_dsn) and _generation(cyclone_dsn) == 2,
        timeout=20,
        what="the handler to end",
    )
    time.sleep(0.3)
    assert ledger() == []
    assert only_step(client, handle.id).state == "running"  # the other execution's


def _generation(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT max(lease_generation) FROM cyclone_steps").fetchone()
        return int(row[0]) if row and row[0] is not None else 0


@pytest.mark.parametrize("handler", [pay, async_write], ids=["sync", "async"])
def test_listeners_hear_of_the_end_after_the_commit(
    handler: StepDef[Any, Any],
    client: Client,
    start_worker: StartWorker,
    cyclone_dsn: str,
    ledger: Callable[[], list[tuple[Any, ...]]],
) -> None:
    """The notifications of a transactional completion are sent after its commit (not in
    it, where NOTIFY would serialize the commits): they still arrive."""
    with psycopg.connect(cyclone_dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {RUN_DONE_CHANNEL}")
        # The channel is shared by every schema of the database (tests run side by side):
        # give this run an id no other test's run has.
        listener.execute(
            "SELECT setval(pg_get_serial_sequence('cyclone_runs', 'id'), %s)",
            (random.randrange(10**12, 10**13),),
        )
        start_worker(handler)
        handle = client.enqueue(handler, 2)
        heard: set[int] = set()
        deadline = time.monotonic() + 20
        while handle.id not in heard and time.monotonic() < deadline:
            for note in listener.notifies(timeout=1.0, stop_after=1):
                heard |= run_ids_of(note.payload)
        assert handle.id in heard
        assert client.get_run(handle.id).state == RunState.COMPLETED


# -- repeatable read and serializable: the snapshot is older than the completion ----------

siblings = {"dsn": ""}


def _sibling_state(run_id: int) -> str | None:
    with psycopg.connect(siblings["dsn"], autocommit=True) as conn:
        row = conn.execute(
            "SELECT state FROM cyclone_steps WHERE run_id = %s AND node = 'tx_sibling'",
            (run_id,),
        ).fetchone()
    return None if row is None else str(row[0])


def _after_the_sibling(x: int, ctx: StepContext) -> int:
    ctx.connection.execute("SELECT 1")  # the transaction's snapshot is taken here
    deadline = time.monotonic() + 10
    while _sibling_state(ctx.run_id) != "completed" and time.monotonic() < deadline:
        time.sleep(0.05)  # the other branch completes (and commits) meanwhile
    return x + 1


@step(name="tx_sibling")
def sibling(x: int) -> int:
    return x + 2


@step(name="tx_sum")
def total(a: int, b: int) -> int:
    return a + b


@step(name="tx_repeatable_read", transactional=True, isolation="repeatable read", max_attempts=5)
def repeatable_read(x: int, ctx: StepContext) -> int:
    return _after_the_sibling(x, ctx)


@step(name="tx_serializable", transactional=True, isolation="serializable", max_attempts=5)
def serializable(x: int, ctx: StepContext) -> int:
    return _after_the_sibling(x, ctx)


@workflow(name="tx_diamond_repeatable_read")
def diamond_repeatable_read(x):  # type: ignore[no-untyped-def]
    return total(repeatable_read(x), sibling(x))


@workflow(name="tx_diamond_serializable")
def diamond_serializable(x):  # type: ignore[no-untyped-def]
    return total(serializable(x), sibling(x))


ISOLATED = {
    "repeatable read": (repeatable_read, diamond_repeatable_read),
    "serializable": (serializable, diamond_serializable),
}


@pytest.mark.parametrize("level", list(ISOLATED))
def test_an_isolated_branch_that_completes_after_its_sibling_activates_the_join(
    client: Client, start_worker: Callable[..., Worker], cyclone_dsn: str, level: str
) -> None:
    """The completion ran in the handler's snapshot, taken before the sibling branch
    completed: its activation saw the sibling still running, as the sibling's had seen this
    step, and the join was never activated. The run waited for ever."""
    siblings["dsn"] = cyclone_dsn
    isolated, diamond = ISOLATED[level]
    start_worker(isolated, sibling, total, diamond, concurrency=4)
    assert client.submit(diamond, 1).result(timeout=20) == 5


# -- repeatable read and serializable: the lease is held while the snapshot is open -------


@step(name="tx_rr_heartbeat", transactional=True, isolation="repeatable read", max_attempts=3)
def rr_heartbeat(n: int, ctx: StepContext) -> int:
    write(ctx)
    assert ctx.heartbeat(), "the step's lease is held"
    return n


@step(name="tx_serializable_long", transactional=True, isolation="serializable", max_attempts=3)
def serializable_long(n: int, ctx: StepContext) -> int:
    write(ctx)
    # Past the lease (busy, not idle in transaction): two heartbeats and the expiry passed.
    ctx.connection.execute("SELECT pg_sleep(2.5)")
    return n


@step(name="tx_async_rr_long", transactional=True, isolation="repeatable read", max_attempts=3)
async def async_rr_long(n: int, ctx: StepContext) -> int:
    await ctx.connection.execute(
        "INSERT INTO ledger VALUES (%s, %s, %s, %s)", (ctx.run_id, ctx.node, ctx.attempt, "")
    )
    await ctx.connection.execute("SELECT pg_sleep(2.5)")
    return n


@pytest.mark.parametrize("handler", [rr_heartbeat, serializable_long, async_rr_long])
def test_an_isolated_step_keeps_its_lease_without_conflicting_with_it(
    client: Client,
    start_worker: StartWorker,
    ledger: Callable[[], list[tuple[Any, ...]]],
    handler: StepDef,
) -> None:
    """The worker renewed the lease of a step whose handler ran at repeatable read or
    serializable by updating the step's row. The completion, written in the handler's
    older snapshot, then conflicted with that update: a serialization failure on every
    attempt that ran past a third of the lease or called ``ctx.heartbeat()``. Past the
    lease itself, the scanner reclaimed the step under its running handler."""
    start_worker(handler, lease=1.0)
    handle = client.enqueue(handler, 7)
    assert handle.result(timeout=30) == 7
    only = only_step(client, handle.id)
    assert (only.attempt_number, only.attempts, only.error) == (1, (), None)  # no reclaim
    assert ledger() == [(handle.id, handler.name, 1, "")]
