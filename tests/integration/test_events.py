"""Live events from running steps: ctx.emit / ctx.progress, stored in order per run, followed
with RunHandle.events() (sync and async), capped per step, marked fenced when their
execution lost its lease, and purged with their run."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from cyclone_dsl import (
    AsyncClient,
    Client,
    EventLimitExceeded,
    InvalidArgument,
    InvalidPayload,
    PayloadTooLarge,
    RunHandle,
    RunNotFound,
    RunState,
    StepContext,
    StepEvent,
    Worker,
    for_each,
    step,
    workflow,
)
from cyclone_dsl.testing import shifted_clock
from tests.waiting import wait_until

# -- handlers ---------------------------------------------------------------------------

COUNT = 200


@step(name="ev_many")
def many(n: int, ctx: StepContext) -> int:
    for i in range(n):
        ctx.emit({"i": i})
    ctx.progress(n, n, "all sent")
    return n


@step(name="ev_async")
async def many_async(n: int, ctx: StepContext) -> int:
    for i in range(n):
        await ctx.emit_async(i)
    await ctx.progress_async(1, 2)
    ctx.progress(2, 2, "sync call from an async handler")
    return n


@step(name="ev_first")
def first(x: int, ctx: StepContext) -> int:
    ctx.emit("first")
    return x + 1


@step(name="ev_second")
def second(x: int, ctx: StepContext) -> int:
    ctx.progress(1, 1)
    return x * 2


@workflow(name="ev_two_steps")
def two_steps(x: int) -> Any:
    return second(first(x))


ITEMS = 8
PER_ITEM = 40


@step(name="ev_item")
def item(i: int, ctx: StepContext) -> int:
    for k in range(PER_ITEM):
        ctx.emit([i, k])
    return i


@workflow(name="ev_fan")
def fan(items: list[int]) -> Any:
    return for_each(item, over=items)


capped_outcomes: list[object] = []


@step(name="ev_capped")
def capped(n: int, ctx: StepContext) -> int:
    stored = 0
    try:
        for i in range(n):
            if i % 2:
                ctx.progress(i, n)
            else:
                ctx.emit(i)
            stored += 1
    except EventLimitExceeded as exc:
        capped_outcomes.append(exc)
    return stored


@step(name="ev_bad_values")
def bad_values(x: None, ctx: StepContext) -> list[str]:
    refused = []
    attempts: list[Callable[[], None]] = [
        lambda: ctx.progress(-1, 3),
        lambda: ctx.progress(4, 3),
        lambda: ctx.progress(1, -1),
        lambda: ctx.progress(True, 3),
        lambda: ctx.progress(1.5, 3),  # type: ignore[arg-type]
        lambda: ctx.progress(1, 3, 42),  # type: ignore[arg-type]
        lambda: ctx.emit(float("nan")),
        lambda: ctx.emit({"set": {1, 2}}),
        lambda: ctx.emit("a\u0000b"),
        lambda: ctx.emit("x" * 70_000),
    ]
    for attempt in attempts:
        try:
            attempt()
        except (InvalidArgument, EventLimitExceeded) as exc:
            refused.append(type(exc).__name__)
    ctx.progress(0, 0)
    ctx.emit(None)
    return refused


# -- following ------------------------------------------------------------------------


def collect_sync(handle_events: Any, into: list[StepEvent]) -> threading.Thread:
    def run() -> None:
        into.extend(handle_events)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_events_reach_a_sync_and_an_async_follower_in_order(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    handle = client.enqueue(many, COUNT)
    seen_sync: list[StepEvent] = []
    follower = collect_sync(handle.events(timeout=60), seen_sync)  # before the step runs

    async def follow_async() -> list[StepEvent]:
        async with AsyncClient(cyclone_dsn) as aclient:
            return [e async for e in aclient.handle(handle.id).events(timeout=60)]

    start_worker(many)
    seen_async = asyncio.run(follow_async())
    follower.join(60)
    assert handle.wait(timeout=10).state is RunState.COMPLETED
    for seen in (seen_sync, seen_async):
        assert [e.seq for e in seen] == list(range(1, COUNT + 2))
        assert [e.data for e in seen[:-1]] == [{"i": i} for i in range(COUNT)]
        assert seen[-1].kind == "progress"
        assert seen[-1].data == {"done": COUNT, "total": COUNT, "message": "all sent"}
        assert {(e.run_id, e.node, e.attempt, e.fenced) for e in seen} == {
            (handle.id, "ev_many", 1, False)
        }
    assert seen_sync == seen_async == client.events_of(handle.id, limit=1000)


def test_steps_emitting_at_once_get_one_gapless_sequence(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Items of a fan-out emit concurrently: a live follower still sees seq 1..N, each
    once, and each item's events in the order it emitted them."""
    handle = client.submit(fan, list(range(ITEMS)))
    seen: list[StepEvent] = []
    follower = collect_sync(handle.events(timeout=60), seen)
    start_worker(item, concurrency=ITEMS)
    follower.join(60)
    assert handle.wait(timeout=10).state is RunState.COMPLETED
    assert [e.seq for e in seen] == list(range(1, ITEMS * PER_ITEM + 1))
    for i in range(ITEMS):
        mine = [e for e in seen if e.node == f"ev_item[{i}]"]
        assert [e.data for e in mine] == [[i, k] for k in range(PER_ITEM)]
    assert len({e.step_id for e in seen}) == ITEMS


def test_an_offset_resumes_and_a_finished_run_ends_at_once(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(many)
    handle = client.enqueue(many, 5)
    assert handle.wait(timeout=20).state is RunState.COMPLETED
    assert [e.seq for e in handle.events()] == [1, 2, 3, 4, 5, 6]
    assert [e.data for e in handle.events(after=3)] == [
        {"i": 3},
        {"i": 4},
        {"done": 5, "total": 5, "message": "all sent"},
    ]
    assert list(handle.events(after=6)) == []
    assert [e.seq for e in client.events_of(handle.id, after=2, limit=2)] == [3, 4]


def test_events_of_several_steps_and_async_handlers(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(first, second, many_async)
    run = client.submit(two_steps, 1)
    events = list(run.events(timeout=30))
    assert [(e.seq, e.node, e.kind, e.data) for e in events] == [
        (1, "ev_first", "event", "first"),
        (2, "ev_second", "progress", {"done": 1, "total": 1, "message": None}),
    ]
    assert events[0].step_id != events[1].step_id
    assert events[0].at <= events[1].at

    async def follow() -> list[StepEvent]:
        async with AsyncClient(client.dsn) as aclient:
            handle = await aclient.enqueue(many_async, 3)
            return [e async for e in handle.events(timeout=30)]

    events = asyncio.run(follow())
    assert [e.data for e in events] == [
        0,
        1,
        2,
        {"done": 1, "total": 2, "message": None},
        {"done": 2, "total": 2, "message": "sync call from an async handler"},
    ]


def test_a_run_that_ends_without_events_ends_the_follower(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(many)
    handle = client.enqueue(many, 0)
    assert [e.data for e in handle.events(timeout=30)] == [
        {"done": 0, "total": 0, "message": "all sent"}
    ]


def test_bad_arguments_and_unknown_runs(client: Client) -> None:
    handle = client.enqueue(many, 1)
    for wrong in (-1, True, 1.5, "1"):
        with pytest.raises(InvalidArgument, match="after"):
            handle.events(after=wrong)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="limit"):
        client.events_of(handle.id, limit=0)
    with pytest.raises(RunNotFound):
        client.events_of(handle.id + 1000)
    with pytest.raises(RunNotFound):
        list(client.events(handle.id + 1000))
    with pytest.raises(TimeoutError):
        list(handle.events(timeout=0.3))  # nobody runs it


# -- limits and validation ------------------------------------------------------------


def test_events_beyond_the_cap_get_a_typed_error(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    capped_outcomes.clear()
    start_worker(capped, max_events_per_step=7)
    handle = client.enqueue(capped, 20)
    assert handle.result(timeout=20) == 7
    (error,) = capped_outcomes
    assert isinstance(error, EventLimitExceeded)
    assert (error.run_id, error.node, error.cap) == (handle.id, "ev_capped", 7)
    events = client.events_of(handle.id)
    assert [e.seq for e in events] == list(range(1, 8))
    assert [e.kind for e in events] == ["event", "progress"] * 3 + ["event"]


def test_the_cap_option_is_checked() -> None:
    for wrong in (0, -1, True, 2.0):
        with pytest.raises(InvalidArgument, match="max_events_per_step"):
            Worker("postgresql://unused", [capped], max_events_per_step=wrong)  # type: ignore[arg-type]


def test_bad_progress_and_non_json_events_get_typed_errors_and_store_nothing(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(bad_values)
    handle = client.enqueue(bad_values, None)
    assert handle.result(timeout=20) == [
        "InvalidArgument",
        "InvalidArgument",
        "InvalidArgument",
        "InvalidArgument",
        "InvalidArgument",
        "InvalidArgument",
        "InvalidPayload",
        "InvalidPayload",
        "InvalidPayload",
        "PayloadTooLarge",
    ]
    assert [(e.kind, e.data) for e in client.events_of(handle.id)] == [
        ("progress", {"done": 0, "total": 0, "message": None}),
        ("event", None),
    ]


def test_a_context_made_by_hand_checks_values_and_stores_nothing() -> None:
    ctx = StepContext(
        run_id=1,
        node="n",
        step_id=1,
        attempt=1,
        max_attempts=1,
        kind="k",
        item_index=None,
        workflow="w",
        def_version="v",
    )
    ctx.emit({"fine": [1, 2]})
    ctx.progress(1, 2, "half")
    with pytest.raises(InvalidPayload, match=r"\$\.x"):
        ctx.emit({"x": float("inf")})
    with pytest.raises(PayloadTooLarge):
        ctx.emit("y" * 100_000)
    with pytest.raises(InvalidArgument, match="more than total"):
        ctx.progress(3, 2)


@step(name="ev_tx", transactional=True, max_attempts=2)
def transactional(x: int, ctx: StepContext) -> int:
    ctx.emit(f"attempt {ctx.attempt}")
    if ctx.attempt == 1:
        raise RuntimeError("its transaction rolls back")
    return x


def test_a_transactional_steps_rollback_keeps_its_events(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(transactional)
    handle = client.enqueue(transactional, 5)
    assert handle.result(timeout=30) == 5
    assert [(e.data, e.attempt, e.fenced) for e in client.events_of(handle.id)] == [
        ("attempt 1", 1, False),  # a failed attempt is not fenced: its outcome was recorded
        ("attempt 2", 2, False),
    ]


# -- fencing --------------------------------------------------------------------------

fence_calls: list[int] = []
fence_started = threading.Event()
fence_gate = threading.Event()
fence_returned = threading.Event()


@step(name="ev_fenced")
def fenced(x: int, ctx: StepContext) -> str:
    fence_calls.append(ctx.attempt)
    if len(fence_calls) == 1:
        ctx.emit("first-1")
        ctx.progress(1, 2)
        fence_started.set()
        fence_gate.wait(30)  # a frozen worker: its lease is reclaimed meanwhile
        ctx.emit("late")  # after its lease was lost
        fence_returned.set()
        return "stale"
    ctx.emit("second")
    return "fresh"


def test_events_of_an_execution_that_lost_its_lease_are_marked_fenced(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    fence_calls.clear()
    for flag in (fence_started, fence_gate, fence_returned):
        flag.clear()
    # A long lease: this worker's heartbeat does not come during the test.
    start_worker(fenced, lease=300, scanners=False, concurrency=2)
    handle = client.enqueue(fenced, 1)
    assert fence_started.wait(20)
    with shifted_clock(timedelta(minutes=10)):  # its lease expired long ago
        start_worker(fenced, scan_interval=0.05)  # its scanner reclaims the step
        assert handle.result(timeout=20) == "fresh"
    fence_gate.set()
    assert fence_returned.wait(20)
    events = client.events_of(handle.id)
    assert [(e.seq, e.data, e.attempt, e.fenced) for e in events] == [
        (1, "first-1", 1, True),
        (2, {"done": 1, "total": 2, "message": None}, 1, True),
        (3, "second", 1, False),
        (4, "late", 1, True),
    ]
    assert fence_calls == [1, 1]  # a reclaim runs the same attempt again
    assert handle.get().step("ev_fenced").reclaims == 1


# -- retention ------------------------------------------------------------------------


def test_events_go_with_their_run(client: Client, start_worker: Callable[..., Worker]) -> None:
    start_worker(many, first)  # nobody serves ev_second: the other run stays running
    ended = client.enqueue(many, 3)
    running = client.submit(two_steps, 1)
    assert ended.wait(timeout=20).state is RunState.COMPLETED
    live = running.events(timeout=20)
    assert next(live).data == "first"  # the run goes on: stop following it
    live.close()  # type: ignore[attr-defined]
    assert len(client.events_of(ended.id)) == 4
    assert client.purge() == 1
    with pytest.raises(RunNotFound):
        client.events_of(ended.id)
    assert [e.data for e in client.events_of(running.id)] == ["first"]


# -- a handler that outlives its worker's stop ------------------------------------------

late_started = threading.Event()
late_gate = threading.Event()
late_outcome: list[object] = []


@step(name="ev_late_emitter")
def late_emitter(x: int, ctx: StepContext) -> str:
    """Emits "first", then waits for late_gate (a sync handler that does not check
    ctx.cancelled: its lease may end meanwhile), then emits "late"."""
    ctx.emit("first")
    late_started.set()
    late_gate.wait(30)
    try:
        ctx.emit("late")
        late_outcome.append("stored")
    except Exception as exc:
        late_outcome.append(exc)
    return "late"


def _late_emitter_started(
    client: Client, start_worker: Callable[..., Worker]
) -> tuple[RunHandle, Worker]:
    """A run of late_emitter whose handler emitted "first" and waits for late_gate."""
    for flag in (late_started, late_gate):
        flag.clear()
    late_outcome.clear()
    worker = start_worker(late_emitter, grace=0.2)
    handle = client.enqueue(late_emitter, 1)
    assert late_started.wait(20)
    return handle, worker


def _late_emit_stored() -> None:
    late_gate.set()
    wait_until(lambda: late_outcome, timeout=10, what="the handler's late emit")
    assert late_outcome == ["stored"]


def test_events_of_a_handler_that_outlives_its_workers_stop_are_kept(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A handler that outlived its worker's stop (past the grace period) and then emitted
    got ClientClosed: the stop had closed the events pool, and the event was lost. The docs
    keep such events, fenced."""
    handle, worker = _late_emitter_started(client, start_worker)
    worker.stop()  # releases the lease after the grace period; the handler goes on
    _late_emit_stored()
    assert [(e.data, e.fenced) for e in client.events_of(handle.id)] == [
        ("first", True),
        ("late", True),
    ]


def test_events_stored_after_the_run_ended_are_read_with_after(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A follower ends with the run; an event its handler stores later (fenced) is read by
    events(after=the last seq seen), as the docs say."""
    handle, _ = _late_emitter_started(client, start_worker)
    client.cancel(handle.id)
    followed = list(handle.events(timeout=10))
    assert [(e.seq, e.data) for e in followed] == [(1, "first")]
    _late_emit_stored()
    late = list(handle.events(after=followed[-1].seq, timeout=10))
    assert [(e.seq, e.data, e.fenced) for e in late] == [(2, "late", True)]
