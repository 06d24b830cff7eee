"""Events that handlers emit at the same moment are stored in batches (one statement for
many), with each event's own outcome: its seq, the cap it hit, its fence.

The batch statement keeps the rules of one event: a run's seqs are 1..N with no gap, a
step's events keep the order it emitted them in, a step stores at most its cap, and the
events of an execution that lost its lease are fenced.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence

import pytest

from cyclone_dsl import Client, EventLimitExceeded, StepContext, Worker, for_each, step, workflow
from cyclone_dsl.engine import NewEvent, Outcome
from cyclone_dsl.worker import emitter
from cyclone_dsl.worker.emitter import EventBatcher

CAP = 20
TASKS = 60


@step(name="eb_gathered")
async def gathered(n: int, ctx: StepContext) -> list[int]:
    """Emits ``n`` events from as many tasks at once (each on its own thread, so they
    queue together); the number stored and the number refused by the cap."""

    async def one(i: int) -> bool:
        try:
            await ctx.emit_async(i)
        except EventLimitExceeded:
            return False
        return True

    stored = await asyncio.gather(*(one(i) for i in range(n)))
    return [sum(stored), len(stored) - sum(stored)]


@step(name="eb_item")
def item(i: int, ctx: StepContext) -> int:
    for k in range(15):
        ctx.emit([i, k])
    return i


@workflow(name="eb_fan")
def fan(items):  # type: ignore[no-untyped-def]
    return for_each(item, over=items)


def test_events_emitted_at_once_past_the_cap_store_exactly_the_cap(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """60 tasks of one step emit at once with a cap of 20: 20 are stored (seqs 1..20),
    each of the other 40 raises EventLimitExceeded, and nothing else is stored."""
    start_worker(gathered, max_events_per_step=CAP)
    handle = client.enqueue(gathered, TASKS)
    assert handle.result(timeout=30) == [CAP, TASKS - CAP]
    events = client.events_of(handle.id)
    assert [e.seq for e in events] == list(range(1, CAP + 1))
    assert len({e.data for e in events}) == CAP


def test_batches_keep_each_steps_order_and_one_gapless_sequence_per_run(
    client: Client, start_worker: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three runs of 24 items, each emitting 15 events, on two workers of 24 handlers:
    every run has seqs 1..360, each item's events in its order; batches of at most 7
    events (a small limit, so that many batches hold events of several runs)."""
    monkeypatch.setattr(emitter, "MAX_BATCH_EVENTS", 7)
    handles = [client.submit(fan, list(range(24))) for _ in range(3)]
    start_worker(item, concurrency=24)
    start_worker(item, concurrency=24)
    for handle in handles:
        assert handle.result(timeout=60) == list(range(24))
        events = client.events_of(handle.id, limit=1000)
        assert [e.seq for e in events] == list(range(1, 24 * 15 + 1))
        for i in range(24):
            mine = [e.data for e in events if e.node == f"eb_item[{i}]"]
            assert mine == [[i, k] for k in range(15)]


def test_a_failed_batch_fails_each_of_its_events_with_its_own_error() -> None:
    """A batch whose write fails: every caller in it raises the error (an object of its
    own, caused by the write's), and the next events are written again."""
    release = threading.Event()
    calls: list[int] = []

    def write(batch: Sequence[NewEvent]) -> list[Outcome]:
        calls.append(len(batch))
        if len(calls) == 1:
            release.wait(10)  # the others queue meanwhile: they make the second batch
            return [None]
        if len(calls) == 2:
            raise RuntimeError("the write failed")
        return [None] * len(batch)

    batcher = EventBatcher(write)
    event = NewEvent(step_id=1, generation=1, attempt=1, kind="event", payload_text="1")
    errors: list[BaseException | None] = []
    lock = threading.Lock()

    def emit() -> None:
        try:
            batcher.record(event)
            outcome = None
        except RuntimeError as exc:
            outcome = exc
        with lock:
            errors.append(outcome)

    first = threading.Thread(target=emit)
    first.start()
    while not calls:
        threading.Event().wait(0.01)
    others = [threading.Thread(target=emit) for _ in range(5)]
    for thread in others:
        thread.start()
    while len(batcher._queue) < 5:
        threading.Event().wait(0.01)
    release.set()
    for thread in [first, *others]:
        thread.join(10)
    failed = [e for e in errors if e is not None]
    assert calls == [1, 5]
    assert len(failed) == 5
    assert len({id(e) for e in failed}) == 5
    assert {str(e) for e in failed} == {"the write failed"}
    assert all(isinstance(e.__cause__, RuntimeError) for e in failed)
    batcher.record(event)
    assert calls == [1, 5, 1]
