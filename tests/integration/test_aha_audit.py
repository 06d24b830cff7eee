"""An audit of ``async def`` handlers that misbehave: they block the event loop, outlive
their timeout, swallow their cancellation, raise BaseExceptions from helper tasks, run by
the thousand, mix with sync handlers in one run, are in flight when their worker stops, and
use their StepContext. Each runs on a real worker; the tests check the end state, the error
text and the executions (never twice at once, never a value kept that should not be)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable

import psycopg
import pytest

from cyclone_dsl import (
    Client,
    InvalidArgument,
    InvalidPayload,
    NodeRef,
    Ref,
    RunFailed,
    RunState,
    StepContext,
    StepState,
    Worker,
    WorkerCrashed,
    action,
    for_each,
    step,
    workflow,
)
from tests.waiting import wait_until

# -- bookkeeping shared by the handlers -----------------------------------------------------

_lock = threading.Lock()
started: Counter[str] = Counter()  # executions begun, by tag
running: Counter[str] = Counter()  # executions in progress now, by tag
peak: Counter[str] = Counter()  # the most executions of a tag in progress at once
notes: dict[str, list[object]] = {}  # what handlers saw, by tag
release = threading.Event()  # lets held handlers go on
finished = threading.Event()  # a blocking handler is done blocking


def _enter(tag: str) -> int:
    with _lock:
        started[tag] += 1
        running[tag] += 1
        peak[tag] = max(peak[tag], running[tag])
        return started[tag]


def _leave(tag: str) -> None:
    with _lock:
        running[tag] -= 1


def _note(tag: str, value: object) -> None:
    with _lock:
        notes.setdefault(tag, []).append(value)


@pytest.fixture(autouse=True)
def _fresh_bookkeeping() -> None:
    with _lock:
        started.clear()
        running.clear()
        peak.clear()
        notes.clear()
    release.clear()
    finished.clear()


def _step_row(client: Client, run_id: int, node: str) -> tuple[StepState, int, str | None]:
    row = client.get_run(run_id).step(node)
    return row.state, row.attempt, row.error_kind


# -- a handler that blocks the event loop ------------------------------------------------


@step(name="aha_blocker", max_attempts=1)
async def blocker(seconds: float) -> str:
    _enter("blocker")
    try:
        time.sleep(seconds)  # noqa: ASYNC251 - the mistake under test: it blocks the loop
    finally:
        _leave("blocker")
        finished.set()
    return "blocked"


def test_aha_a_handler_blocking_the_loop_past_its_lease_keeps_its_lease(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """deploy.md: leases are renewed by heartbeats while the handler runs, on their own
    connection: a loop blocked 3 s with a 0.6 s lease must not let a second worker (whose
    scanner reclaims expired leases every 0.5 s) run the step again."""
    first = start_worker(blocker, lease=0.6)
    second = start_worker(blocker, lease=0.6)
    handle = client.enqueue(blocker, 3.0)
    run = handle.wait(timeout=30)
    assert run.state is RunState.COMPLETED
    row = run.step("aha_blocker")
    assert (row.state, row.attempt, row.reclaims, row.output) == (
        StepState.COMPLETED,
        0,
        0,
        "blocked",
    )
    assert row.attempts == ()
    assert started["blocker"] == 1, "the step ran again while its first execution held it"
    assert peak["blocker"] == 1
    assert first.error is None and second.error is None


def test_aha_a_handler_blocking_the_loop_past_its_timeout_fails_at_once(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """runs-and-steps.md: "When it passes, the step fails at once with
    error_kind="timeout"": the worker's timeout does not wait for the blocked loop."""
    start_worker(blocker)
    handle = client.enqueue(blocker, 3.0, timeout=0.5)
    with pytest.raises(RunFailed):
        handle.result(timeout=20)
    still_blocking = not finished.is_set()
    row = handle.get().step("aha_blocker")
    assert (row.state, row.error_kind) == (StepState.DISCARDED, "timeout")
    assert row.error == "the step ran longer than its timeout of 0.5s"
    assert row.output is None
    assert still_blocking, "the timeout was only applied once the loop was free again"
    assert finished.wait(20)


# -- a handler that swallows its cancellation ----------------------------------------------


@step(name="aha_stubborn", max_attempts=1)
async def stubborn(n: int, *, ctx: StepContext) -> str:
    _enter("stubborn")
    swallowed = 0
    try:
        while not release.is_set():
            try:
                await asyncio.sleep(0.02)
            except asyncio.CancelledError:  # the mistake: carry on regardless
                swallowed += 1
        _note("stubborn-swallowed", swallowed)
        _note("stubborn-cancelled", ctx.cancelled)
        _note("stubborn-heartbeat", ctx.heartbeat())
        return f"late {n}"
    finally:
        _leave("stubborn")


@step(name="aha_quick")
async def quick(n: int) -> int:
    await asyncio.sleep(0.01)
    return n * 2


def test_aha_a_handler_that_swallows_its_timeout_fails_and_its_late_value_is_dropped(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker(stubborn, quick)
    handle = client.enqueue(stubborn, 7, timeout=0.5)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=20)
    assert failed.value.error_kind == "timeout"
    assert running["stubborn"] == 1  # still going: its late value must not be kept
    others = [client.enqueue(quick, i) for i in range(20)]
    assert [h.result(timeout=20) for h in others] == [i * 2 for i in range(20)]
    release.set()
    wait_until(lambda: "stubborn-heartbeat" in notes, what="the stubborn handler to return")
    assert notes["stubborn-heartbeat"] == [False], "ctx.heartbeat() said a lost lease was held"
    assert notes["stubborn-cancelled"] == [True]
    swallowed = notes["stubborn-swallowed"][0]
    assert isinstance(swallowed, int) and swallowed >= 1
    run = handle.get()
    row = run.step("aha_stubborn")
    assert run.state is RunState.FAILED
    assert (row.state, row.error_kind, row.output, row.attempt) == (
        StepState.DISCARDED,
        "timeout",
        None,
        1,
    )
    assert started["stubborn"] == 1
    assert worker.error is None


def test_aha_handlers_that_swallow_their_timeout_keep_their_slot_under_max_async(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """deploy.md / cli.md: ``--max-async N``: "the most async handlers at once"; for a
    hung sync handler runs-and-steps.md says its slot stays busy until it returns."""
    worker = start_worker(stubborn, max_async=1)
    handles = [client.enqueue(stubborn, i, timeout=0.3) for i in range(3)]
    try:
        wait_until(
            lambda: any(
                _step_row(client, h.id, "aha_stubborn")[0] is StepState.DISCARDED for h in handles
            ),
            what="the first handler's timeout",
        )
        time.sleep(1.0)  # the poll interval is 0.5 s: a freed slot would be claimed by now
        assert started["stubborn"] == 1, "a second handler started beside the first"
        assert worker.settings().async_in_use == 1
    finally:
        release.set()
    # Once the stubborn handler returns, its slot serves the next steps, one at a time
    # (released, they return at once, well inside their timeout).
    ends = sorted(h.wait(timeout=30).state.value for h in handles)
    assert ends == ["completed", "completed", "failed"], ends
    assert peak["stubborn"] == 1, f"{peak['stubborn']} handlers ran with max_async=1"


def test_aha_a_stop_with_a_handler_that_ignores_cancellation_returns_and_releases(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """deploy.md: running handlers get the grace period; leases still held are then
    released, so another worker starts those steps at once. A handler that never stops
    must not hold up the stop."""
    handle = client.enqueue(stubborn, 3)
    first = Worker(cyclone_dsn, [stubborn], grace=0.3, poll_interval=0.1).start()
    try:
        wait_until(lambda: running["stubborn"] == 1, what="the stubborn handler to run")
    finally:
        began = time.monotonic()
        first.stop(timeout=20)
        took = time.monotonic() - began
    assert took < 10, f"stop() took {took:.1f}s with a grace of 0.3s"
    assert _step_row(client, handle.id, "aha_stubborn") == (StepState.AVAILABLE, 0, None)
    release.set()
    start_worker(stubborn)
    assert handle.result(timeout=20) == "late 3"
    assert started["stubborn"] == 2


@step(name="aha_polite", max_attempts=1)
async def polite(n: int, *, ctx: StepContext) -> int:
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        _note("polite-cancelled", ctx.cancelled)  # asked to stop by the worker, or not?
        raise
    return n


def test_aha_ctx_cancelled_is_set_when_the_timeout_cancels_an_async_handler(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """context.py: ``cancelled`` is "True once the step should stop: ... its timeout
    passed"; runs-and-steps.md tells a handler that catches CancelledError apart from one a
    library raised by whether the worker asked it to stop."""
    start_worker(polite)
    handle = client.enqueue(polite, 1, timeout=0.3)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=20)
    assert failed.value.error_kind == "timeout"
    assert notes["polite-cancelled"] == [True]


@step(name="aha_waits_forever", max_attempts=1)
async def waits_forever(n: int, *, ctx: StepContext) -> int:
    _enter("forever")
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        _note("forever-cancelled", ctx.cancelled)
        raise
    finally:
        _leave("forever")
    return n


def test_aha_a_run_cancel_stops_an_awaiting_handler_and_frees_its_slot(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """runs-and-steps.md: when the step's run is cancelled the worker "stops the handler
    within milliseconds" (CancelledError at its next await)."""
    worker = start_worker(waits_forever)
    handle = client.enqueue(waits_forever, 1)
    wait_until(lambda: running["forever"] == 1, what="the handler to start")
    client.cancel(handle.id)
    assert handle.wait(timeout=20).state is RunState.CANCELLED
    wait_until(lambda: running["forever"] == 0, timeout=10, what="the handler to be cancelled")
    wait_until(lambda: worker.settings().async_in_use == 0, timeout=10, what="its slot")
    assert notes["forever-cancelled"] == [True]
    assert handle.get().step("aha_waits_forever").state is StepState.CANCELLED


# -- BaseExceptions --------------------------------------------------------------------------


async def _raise_base(which: str) -> None:
    await asyncio.sleep(0)
    if which == "keyboard_interrupt":
        raise KeyboardInterrupt("from a helper task")
    raise SystemExit("from a helper task")


@step(name="aha_helper_task_exits", max_attempts=2)
async def helper_task_exits(which: str) -> int:
    _enter(f"helper-{which}")
    try:
        await asyncio.gather(_raise_base(which))  # gather runs it as a task of its own
    finally:
        _leave(f"helper-{which}")
    return 0


@step(name="aha_cancel_turns_fatal", max_attempts=2)
async def cancel_turns_fatal(which: str) -> int:
    _enter(f"fatal-{which}")
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        if which == "keyboard_interrupt":
            raise KeyboardInterrupt("while cancelled") from None
        raise SystemExit("while cancelled") from None
    finally:
        _leave(f"fatal-{which}")
    return 0


@pytest.mark.parametrize("which", ["system_exit", "keyboard_interrupt"])
def test_aha_a_handler_that_raises_exit_when_cancelled_times_out_and_the_worker_goes_on(
    client: Client, start_worker: Callable[..., Worker], which: str
) -> None:
    worker = start_worker(cancel_turns_fatal, quick)
    handle = client.enqueue(cancel_turns_fatal, which, timeout=0.3)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=20)
    assert failed.value.error_kind == "timeout"
    assert started[f"fatal-{which}"] == 2
    assert client.enqueue(quick, 4).result(timeout=20) == 8
    assert worker.error is None


@pytest.mark.parametrize("which", ["system_exit", "keyboard_interrupt"])
def test_aha_an_exit_raised_in_a_helper_task_fails_the_attempt_not_the_worker(
    client: Client, cyclone_dsn: str, which: str
) -> None:
    """runs-and-steps.md: a SystemExit or KeyboardInterrupt a handler raises (sync or
    async) "fails the attempt, not the worker". Here the handler awaits ``asyncio.gather``
    of a helper that raises it: the handler raises it too."""
    worker = Worker(
        cyclone_dsn, [helper_task_exits, quick], poll_interval=0.2, scan_interval=0.2, grace=1
    ).start()
    handle = client.enqueue(helper_task_exits, which)
    try:
        wait_until(
            lambda: worker.error is not None or handle.get().state is not RunState.RUNNING,
            timeout=15,
            what="the run to end (or the worker to crash)",
        )
        assert worker.error is None, f"the worker crashed: {worker.error!r}"
        row = handle.get().step("aha_helper_task_exits")
        assert (row.state, row.error_kind, row.attempt) == (StepState.DISCARDED, "error", 2)
        assert (row.error or "").startswith(
            "SystemExit" if which == "system_exit" else "KeyboardInterrupt"
        )
        assert client.enqueue(quick, 5).result(timeout=15) == 10
    finally:
        # A crashed worker's stop() waits grace + 30 s for a shutdown that itself failed
        # ("Event loop is closed"): wait only a few seconds.
        with contextlib.suppress(WorkerCrashed):
            worker.stop(timeout=3)


# -- many at once --------------------------------------------------------------------------


@step(name="aha_nap")
async def nap(n: int) -> int:
    _enter("nap")
    try:
        await asyncio.sleep(0.5)
    finally:
        _leave("nap")
    return n


def test_aha_two_thousand_sleeping_handlers_finish_in_bounded_time_with_no_thread_each(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    total = 2000
    client.enqueue_many(nap, list(range(total)))
    before = threading.active_count()
    most_threads = 0

    def all_done() -> bool:
        nonlocal most_threads
        most_threads = max(most_threads, threading.active_count())
        with psycopg.connect(cyclone_dsn) as conn:
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE state = 'completed'), count(*) "
                "FROM cyclone_steps WHERE kind = 'aha_nap'"
            ).fetchone()
        assert row is not None
        return bool(row[0] == row[1] == total)

    began = time.monotonic()
    worker = start_worker(nap)
    wait_until(all_done, timeout=40, interval=0.1, what=f"{total} naps to complete")
    took = time.monotonic() - began
    settings = worker.settings()
    assert settings.threads == 0, "async handlers started handler threads"
    assert most_threads - before < 30, f"{most_threads - before} threads for async handlers"
    assert started["nap"] == total and peak["nap"] > 100, "the async limit never grew"
    # 2,000 half-second naps: 10 s at the starting limit of 100; it grows with the backlog.
    assert took < 30, f"{total} naps of 0.5 s took {took:.1f}s"


# -- async and sync in one run ---------------------------------------------------------------


@step(name="aha_fetch")
async def fetch(order: str) -> dict[str, object]:
    await asyncio.sleep(0.01)
    return {"order": order, "lines": [1, 2, 3]}


@step(name="aha_price_sync")
def price_sync(data: dict[str, object]) -> int:
    lines = data["lines"]
    assert isinstance(lines, list)
    return sum(10 * int(x) for x in lines)


@step(name="aha_tax_async")
async def tax_async(data: dict[str, object]) -> int:
    await asyncio.sleep(0.01)
    lines = data["lines"]
    assert isinstance(lines, list)
    return len(lines)


@step(name="aha_lines_sync")
def lines_sync(data: dict[str, object]) -> list[int]:
    lines = data["lines"]
    assert isinstance(lines, list)
    return [int(x) for x in lines]


@step(name="aha_ship_async")
async def ship_async(line: int) -> str:
    await asyncio.sleep(0.01)
    return f"shipped {line}"


@step(name="aha_join_sync")
def join_sync(price: int, tax: int, shipped: list[str]) -> dict[str, object]:
    return {"total": price + tax, "shipped": shipped}


@action(name="aha_notify_async")
async def notify_async(summary: dict[str, object]) -> None:
    _note("notified", summary)


@step(name="aha_final_async")
async def final_async(parts: list[object]) -> list[object]:
    await asyncio.sleep(0)
    return parts


@workflow(name="aha_mixed")
def mixed(order: Ref[str]) -> NodeRef[list[object]]:
    data = fetch(order)
    price = price_sync(data)
    tax = tax_async(data)
    shipped = for_each(ship_async, over=lines_sync(data), max_parallel=2)
    summary = join_sync(price, tax, shipped)
    done = notify_async(summary)
    return final_async([summary, price], after=[done])


def test_aha_async_and_sync_handlers_pass_outputs_through_joins_and_fan_out(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(mixed, concurrency=2)
    handle = client.submit(mixed, "o-1")
    summary = {"total": 63, "shipped": ["shipped 1", "shipped 2", "shipped 3"]}
    assert handle.result(timeout=30) == [summary, 60]
    run = handle.get()
    assert {s.node: s.state for s in run.steps if s.state is not StepState.COMPLETED} == {}
    assert run.step("aha_notify_async").output is None
    assert notes["notified"] == [summary]


# -- a stop while async handlers are in flight ----------------------------------------------


def test_aha_a_stop_lets_async_handlers_finish_within_the_grace(
    client: Client, cyclone_dsn: str
) -> None:
    """deploy.md: on a stop, "running handlers get --grace seconds": naps of 0.5 s finish
    and complete under a 20 s grace, and the stop returns once they have, not at its end."""
    handles = [client.enqueue(nap, i) for i in range(50)]
    worker = Worker(cyclone_dsn, [nap], grace=20, poll_interval=0.1).start()
    try:
        wait_until(lambda: started["nap"] == 50, what="50 naps to start")
    finally:
        began = time.monotonic()
        worker.stop()
        took = time.monotonic() - began
    assert took < 10, f"stop() took {took:.1f}s for naps of 0.5 s"
    states = {_step_row(client, h.id, "aha_nap") for h in handles}
    assert states == {(StepState.COMPLETED, 0, None)}
    assert [h.result(timeout=5) for h in handles] == list(range(50))
    assert started["nap"] == 50


# -- StepContext from an async handler ---------------------------------------------------


@step(name="aha_with_ctx", max_attempts=2)
async def with_ctx(n: int, *, ctx: StepContext) -> dict[str, object]:
    seen: dict[str, object] = {
        "run_id": ctx.run_id,
        "node": ctx.node,
        "attempt": ctx.attempt,
        "key": ctx.idempotency_key,
        "cancelled": ctx.cancelled,
        "heartbeat": ctx.heartbeat(),
    }
    await ctx.progress_async(ctx.attempt, 2, f"attempt {ctx.attempt}")
    await ctx.emit_async({"n": n, "attempt": ctx.attempt})
    try:
        await ctx.emit_async("nul" + chr(0))
    except InvalidPayload as exc:
        seen["nul"] = type(exc).__name__
    try:
        ctx.connection  # noqa: B018 - the property raises for a step that is not transactional
    except InvalidArgument:
        seen["connection"] = "refused"
    _note("ctx", seen)
    if ctx.attempt == 1:
        raise RuntimeError("first attempt fails")
    return seen


def test_aha_an_async_handler_uses_its_context(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(with_ctx)
    handle = client.enqueue(with_ctx, 9)
    result = handle.result(timeout=30)
    common = {
        "run_id": handle.id,
        "node": "aha_with_ctx",
        "key": f"{handle.id}:aha_with_ctx",
        "cancelled": False,
        "heartbeat": True,
        "nul": "InvalidPayload",
        "connection": "refused",
    }
    assert notes["ctx"] == [{**common, "attempt": 1}, {**common, "attempt": 2}]
    assert result == {**common, "attempt": 2}
    events = [(e.kind, e.data, e.attempt) for e in handle.events(timeout=10)]
    assert events == [
        ("progress", {"done": 1, "total": 2, "message": "attempt 1"}, 1),
        ("event", {"n": 9, "attempt": 1}, 1),
        ("progress", {"done": 2, "total": 2, "message": "attempt 2"}, 2),
        ("event", {"n": 9, "attempt": 2}, 2),
    ]
