"""Audit: transactional steps crossed with retries, Permanent, cancels, pauses,
fan-out, child runs, submit_tx from inside, session-level isolation changes."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from cyclone_dsl import (
    AsyncClient,
    Client,
    Concurrency,
    Permanent,
    RunState,
    StepContext,
    StepState,
    Worker,
    child,
    for_each,
    step,
    workflow,
)
from tests.waiting import wait_until

StartWorker = Callable[..., Worker]
SHARED: dict[str, Any] = {}


@pytest.fixture
def ledger(cyclone_dsn: str) -> Callable[[], list[tuple[Any, ...]]]:
    SHARED["dsn"] = cyclone_dsn
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE xledger (run_id bigint, node text, attempt int, note text,"
            " UNIQUE (run_id, node, attempt))"
        )

    def rows() -> list[tuple[Any, ...]]:
        with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
            return sorted(conn.execute("SELECT run_id, node, attempt, note FROM xledger"))

    return rows


def write(ctx: StepContext, note: str = "") -> None:
    ctx.connection.execute(
        "INSERT INTO xledger VALUES (%s, %s, %s, %s)", (ctx.run_id, ctx.node, ctx.attempt, note)
    )


def runs_of(dsn: str, wf: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [
            int(r[0])
            for r in conn.execute("SELECT id FROM cyclone_runs WHERE workflow = %s", (wf,))
        ]


# -- submit_tx from inside a transactional step ------------------------------------------


@step(name="xt_target_step")
def target_step(x: Any) -> Any:
    return x


@workflow(name="xt_target")
def target(x):  # type: ignore[no-untyped-def]
    return target_step(x)


@step(name="xt_submits", transactional=True, max_attempts=3)
def submits(n: int, *, ctx: StepContext) -> int:
    client: Client = SHARED["client"]
    client.submit_tx(ctx.connection, target, {"attempt": ctx.attempt})
    write(ctx)
    if ctx.attempt == 1:
        raise RuntimeError("fails after submitting")
    return n


@step(name="xt_submits_once", transactional=True, max_attempts=3)
def submits_once(n: int, *, ctx: StepContext) -> int:
    client: Client = SHARED["client"]
    client.submit_once_tx(ctx.connection, target, {"attempt": ctx.attempt}, key=f"k-{n}")
    write(ctx)
    if ctx.attempt == 1:
        raise RuntimeError("fails after submitting")
    return n


@step(name="xt_async_submits", transactional=True, max_attempts=3)
async def async_submits(n: int, *, ctx: StepContext) -> int:
    async with AsyncClient(SHARED["dsn"]) as aclient:
        await aclient.submit_tx(ctx.connection, target, {"attempt": ctx.attempt})
    await ctx.connection.execute(
        "INSERT INTO xledger VALUES (%s, %s, %s, %s)", (ctx.run_id, ctx.node, ctx.attempt, "")
    )
    if ctx.attempt == 1:
        raise RuntimeError("fails after submitting")
    return n


@pytest.mark.parametrize(
    "submitting",
    [submits, submits_once, async_submits],
    ids=["submit_tx", "submit_once_tx", "async_submit_tx"],
)
def test_a_submit_inside_a_flaky_transactional_step_creates_one_run(
    client: Client,
    start_worker: StartWorker,
    ledger: Callable[[], list[tuple[Any, ...]]],
    cyclone_dsn: str,
    submitting: Any,
) -> None:
    """The first attempt submits, writes, then fails: only the second's run and row stay."""
    SHARED["client"] = client
    start_worker(submitting, target, target_step)
    handle = client.enqueue(submitting, 1)
    assert handle.result(timeout=20) == 1
    (run_id,) = runs_of(cyclone_dsn, "xt_target")
    assert client.get_run(run_id).state is not RunState.FAILED
    wait_until(
        lambda: client.get_run(run_id).state is RunState.COMPLETED,
        timeout=20,
        what="the submitted run to complete",
    )
    assert client.handle(run_id).result(timeout=20) == {"attempt": 2}
    assert [r[2] for r in ledger()] == [2]


# -- Permanent and BaseException after writes ---------------------------------------------


@step(name="xt_permanent", transactional=True, max_attempts=5)
def permanent(n: int, *, ctx: StepContext) -> int:
    write(ctx)
    raise Permanent("no point retrying")


@step(name="xt_async_permanent", transactional=True, max_attempts=5)
async def async_permanent(n: int, *, ctx: StepContext) -> int:
    await ctx.connection.execute(
        "INSERT INTO xledger VALUES (%s, %s, %s, %s)", (ctx.run_id, ctx.node, ctx.attempt, "")
    )
    raise Permanent("no point retrying")


class Fatal(BaseException):
    pass


@step(name="xt_fatal", transactional=True, max_attempts=2)
def fatal(n: int, *, ctx: StepContext) -> int:
    write(ctx)
    if ctx.attempt == 1:
        raise Fatal("base exception")
    return n


@pytest.mark.parametrize("handler", [permanent, async_permanent], ids=["sync", "async"])
def test_permanent_after_a_write_rolls_back_and_is_not_retried(
    client: Client,
    start_worker: StartWorker,
    ledger: Callable[[], list[tuple[Any, ...]]],
    handler: Any,
) -> None:
    start_worker(handler)
    handle = client.enqueue(handler, 1)
    assert handle.wait(timeout=20).state is RunState.FAILED
    (only,) = client.get_run(handle.id).steps
    assert only.error_kind == "permanent"
    assert only.attempt_number == 1
    assert ledger() == []


def test_a_base_exception_after_a_write_rolls_back_and_does_not_hang(
    client: Client,
    start_worker: StartWorker,
    ledger: Callable[[], list[tuple[Any, ...]]],
) -> None:
    start_worker(fatal)
    handle = client.enqueue(fatal, 3)
    run = handle.wait(timeout=20)
    assert run.state in (RunState.FAILED, RunState.COMPLETED)
    rows = ledger()
    if run.state is RunState.COMPLETED:
        assert [r[2] for r in rows] == [2]
    else:
        assert rows == []


# -- fan-out items and child runs ----------------------------------------------------------


@step(name="xt_items_src")
def items_src(n: int) -> list[int]:
    return list(range(n))


@step(name="xt_item", transactional=True, max_attempts=3)
def item(x: int, *, ctx: StepContext) -> int:
    write(ctx, str(x))
    if ctx.attempt == 1 and x % 2 == 0:
        raise RuntimeError("even items fail once")
    return x * 10


@workflow(name="xt_fan")
def fan(n):  # type: ignore[no-untyped-def]
    return for_each(item, over=items_src(n), max_parallel=3)


def test_transactional_fan_out_items_each_write_once(
    client: Client,
    start_worker: StartWorker,
    ledger: Callable[[], list[tuple[Any, ...]]],
) -> None:
    start_worker(fan, items_src, item, concurrency=4)
    handle = client.submit(fan, 8)
    assert handle.result(timeout=30) == [x * 10 for x in range(8)]
    rows = ledger()
    assert len(rows) == 8
    assert sorted(int(r[3]) for r in rows) == list(range(8))
    assert all(r[2] == (2 if int(r[3]) % 2 == 0 else 1) for r in rows)


@step(name="xt_child_sleeps", transactional=True, max_attempts=2)
def child_sleeps(n: int, *, ctx: StepContext) -> int:
    write(ctx)
    ctx.connection.execute("SELECT pg_sleep(30)")
    return n


@workflow(name="xt_child")
def child_wf(n):  # type: ignore[no-untyped-def]
    return child_sleeps(n)


@workflow(name="xt_parent")
def parent_wf(n):  # type: ignore[no-untyped-def]
    return child(child_wf, n)


def _sleeping(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(30)'"
            " AND state = 'active' AND application_name = %s",
            (f"cyclone-handler-{os.getpid()}",),
        ).fetchone()
        return bool(row and row[0])


def test_cancelling_the_parent_rolls_back_a_childs_transactional_step(
    client: Client,
    start_worker: StartWorker,
    ledger: Callable[[], list[tuple[Any, ...]]],
    cyclone_dsn: str,
) -> None:
    start_worker(parent_wf, child_wf, child_sleeps)
    handle = client.submit(parent_wf, 1)
    wait_until(lambda: _sleeping(cyclone_dsn), timeout=20, what="the child's statement to run")
    client.cancel(handle.id)
    wait_until(
        lambda: not _sleeping(cyclone_dsn), timeout=15, what="the statement to be interrupted"
    )
    assert client.get_run(handle.id).state is RunState.CANCELLED
    (child_id,) = runs_of(cyclone_dsn, "xt_child")
    wait_until(
        lambda: client.get_run(child_id).state is RunState.CANCELLED,
        timeout=10,
        what="the child run to be cancelled",
    )
    assert ledger() == []


# -- concurrency-limited transactional step with timeouts ---------------------------------


@step(
    name="xt_gated",
    transactional=True,
    max_attempts=2,
    timeout=1.0,
    concurrency=Concurrency(limit=1),
)
def gated(n: int, *, ctx: StepContext) -> int:
    write(ctx, str(n))
    if ctx.attempt == 1 and n == 0:
        ctx.connection.execute("SELECT pg_sleep(30)")  # interrupted at the timeout
    return n


def test_a_gated_transactional_step_that_times_out_frees_its_slot(
    client: Client,
    start_worker: StartWorker,
    ledger: Callable[[], list[tuple[Any, ...]]],
) -> None:
    start_worker(gated, concurrency=4)
    handles = [client.enqueue(gated, n) for n in range(4)]
    for n, handle in enumerate(handles):
        assert handle.result(timeout=30) == n
    rows = ledger()
    assert sorted(int(r[3]) for r in rows) == [0, 1, 2, 3]


# -- pause while the handler is inside its transaction, then it fails ---------------------

PAUSE_GO = threading.Event()
PAUSE_IN = threading.Event()


@step(name="xt_paused_fails", transactional=True, max_attempts=3)
def paused_fails(n: int, *, ctx: StepContext) -> int:
    write(ctx)
    if ctx.attempt == 1:
        PAUSE_IN.set()
        PAUSE_GO.wait(20)
        raise RuntimeError("fails while its run is paused")
    return n


def test_a_step_failing_while_its_run_is_paused_retries_after_resume_once(
    client: Client,
    start_worker: StartWorker,
    ledger: Callable[[], list[tuple[Any, ...]]],
) -> None:
    PAUSE_GO.clear()
    PAUSE_IN.clear()
    start_worker(paused_fails)
    handle = client.enqueue(paused_fails, 4)
    assert PAUSE_IN.wait(20)
    client.pause(handle.id)
    PAUSE_GO.set()
    wait_until(
        lambda: client.get_run(handle.id).steps[0].attempts != (),
        timeout=20,
        what="the first attempt's failure to be recorded",
    )
    assert ledger() == []
    assert client.get_run(handle.id).state is RunState.PAUSED
    client.resume(handle.id)
    assert handle.result(timeout=20) == 4
    assert [r[2] for r in ledger()] == [2]


# -- SET TRANSACTION ISOLATION in a default (read committed) step -------------------------


def _sibling_state(run_id: int) -> str | None:
    with psycopg.connect(SHARED["dsn"], autocommit=True) as conn:
        row = conn.execute(
            "SELECT state FROM cyclone_steps WHERE run_id = %s AND node = 'xt_sib'", (run_id,)
        ).fetchone()
        return str(row[0]) if row else None


@step(name="xt_set_rr", transactional=True, max_attempts=5)
def set_rr(x: int, ctx: StepContext) -> int:
    ctx.connection.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    ctx.connection.execute("SELECT 1")  # the snapshot is taken here
    SNAPSHOT_TAKEN.set()
    deadline = time.monotonic() + 10
    while _sibling_state(ctx.run_id) != "completed" and time.monotonic() < deadline:
        time.sleep(0.05)
    return x + 1


SNAPSHOT_TAKEN = threading.Event()


@step(name="xt_sib")
def sib(x: int) -> int:
    SNAPSHOT_TAKEN.wait(10)  # complete after the other branch's snapshot
    return x + 2


@step(name="xt_total")
def xtotal(a: int, b: int) -> int:
    return a + b


@workflow(name="xt_diamond")
def diamond(x):  # type: ignore[no-untyped-def]
    return xtotal(set_rr(x), sib(x))


def test_a_handler_that_changes_its_isolation_fails_for_good_instead_of_hanging_its_run(
    client: Client,
    start_worker: StartWorker,
    ledger: Callable[[], list[tuple[Any, ...]]],
) -> None:
    """A read committed step whose handler set REPEATABLE READ itself completed on its old
    snapshot as if at read committed: the join saw its sibling still running and was never
    activated, and the run never ended. Its attempt now fails for good, saying to declare
    the level (which holds the lease and checks the siblings at the completion)."""
    SNAPSHOT_TAKEN.clear()
    start_worker(set_rr, sib, xtotal, diamond, concurrency=4)
    handle = client.submit(diamond, 1)
    run = handle.wait(timeout=20)
    assert run.state is RunState.FAILED
    failed = run.step("xt_set_rr")
    assert failed.state is StepState.DISCARDED and failed.attempt_number == 1
    assert failed.error is not None and "isolation='repeatable read'" in failed.error
    assert ledger() == []


# -- a caught constraint violation (no savepoint) then a normal return --------------------


@step(name="xt_caught_violation", transactional=True, max_attempts=2)
def caught_violation(n: int, *, ctx: StepContext) -> int:
    write(ctx, "first")
    with contextlib.suppress(psycopg.errors.UniqueViolation):  # caught, no savepoint
        write(ctx, "duplicate")  # same (run, node, attempt): unique violation
    return n


def test_a_caught_violation_without_savepoint_keeps_nothing(
    client: Client,
    start_worker: StartWorker,
    ledger: Callable[[], list[tuple[Any, ...]]],
) -> None:
    start_worker(caught_violation)
    handle = client.enqueue(caught_violation, 1)
    assert handle.wait(timeout=20).state is RunState.FAILED
    assert ledger() == []
    (only,) = client.get_run(handle.id).steps
    assert only.attempt_number == 2


# -- the run's deadline passing while an async handler sleeps in Python -------------------


@step(name="xt_async_late", transactional=True, max_attempts=3)
async def async_late(n: int, *, ctx: StepContext) -> int:
    import asyncio

    await ctx.connection.execute(
        "INSERT INTO xledger VALUES (%s, %s, %s, %s)", (ctx.run_id, ctx.node, ctx.attempt, "")
    )
    await asyncio.sleep(2.0)
    return n


@workflow(name="xt_async_late_wf")
def async_late_wf(n):  # type: ignore[no-untyped-def]
    return async_late(n)


def test_an_async_handler_returning_past_the_runs_deadline_keeps_nothing(
    client: Client,
    start_worker: StartWorker,
    ledger: Callable[[], list[tuple[Any, ...]]],
) -> None:
    start_worker(async_late, async_late_wf)
    handle = client.submit(async_late_wf, 1, deadline=timedelta(seconds=1))
    assert handle.wait(timeout=20).state is RunState.FAILED
    time.sleep(0.5)
    assert ledger() == []
