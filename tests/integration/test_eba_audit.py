"""Audit of events written in batches (EventBatcher, record_events): every event a handler
emitted is stored once, committed before its call returns, numbered 1..N per run in each
step's order, capped per step, fenced when its execution no longer holds the lease.

One finding, fixed before release: events queued in the batcher when the worker's stop
closed the events pool raised ClientClosed and were lost; such a batch is now written on
a connection of its own (fenced: the stop released the leases).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from cyclone_dsl import (
    Client,
    EventLimitExceeded,
    RunState,
    StepContext,
    Worker,
    for_each,
    step,
    workflow,
)
from cyclone_dsl.worker import emitter
from tests.waiting import wait_until

StartWorker = Callable[..., Worker]
SEEN: dict[str, list[Any]] = {}
GATES: dict[str, threading.Event] = {}
LOCK = threading.Lock()


def gate(name: str) -> threading.Event:
    with LOCK:
        return GATES.setdefault(name, threading.Event())


def seen(key: str, value: Any) -> None:
    with LOCK:
        SEEN.setdefault(key, []).append(value)


@pytest.fixture(autouse=True)
def _reset() -> None:
    SEEN.clear()
    GATES.clear()


def in_threads(n: int, work: Callable[[int], None]) -> None:
    threads = [threading.Thread(target=work, args=(t,)) for t in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)


# -- committed before the call returns ---------------------------------------------------

EBA_DSN: list[str] = []


@step(name="eba_visible")
def eba_visible(n: int, ctx: StepContext) -> int:
    missing: list[Any] = []

    def work(t: int) -> None:
        with psycopg.connect(EBA_DSN[0], autocommit=True) as conn:
            for k in range(n):
                ctx.emit([t, k])
                row = conn.execute(
                    "SELECT count(*) FROM cyclone_ext_events WHERE run_id = %s"
                    " AND payload = %s::jsonb",
                    (ctx.run_id, f"[{t}, {k}]"),
                ).fetchone()
                if row != (1,):
                    missing.append((t, k, row))

    in_threads(6, work)
    seen("missing", missing)
    return n


def test_each_emit_is_committed_when_it_returns_even_in_a_batch(
    client: Client, start_worker: StartWorker, cyclone_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six threads of one step emit at once (batches of 3): right after each call
    returns, another connection sees its row, once."""
    monkeypatch.setattr(emitter, "MAX_BATCH_EVENTS", 3)
    EBA_DSN[:] = [cyclone_dsn]
    start_worker(eba_visible)
    handle = client.enqueue(eba_visible, 10)
    assert handle.result(timeout=30) == 10
    assert SEEN["missing"] == [[]]
    events = client.events_of(handle.id)
    assert [e.seq for e in events] == list(range(1, 61))
    for t in range(6):
        assert [e.data for e in events if e.data[0] == t] == [[t, k] for k in range(10)]


# -- the cap, with threads and a retry -----------------------------------------------------


@step(name="eba_threads_capped", max_attempts=2)
def eba_threads_capped(n: int, ctx: StepContext) -> int:
    stored = [0]

    def work(t: int) -> None:
        for k in range(n):
            try:
                ctx.emit([ctx.attempt, t, k])
            except EventLimitExceeded as exc:
                seen("refused", (ctx.attempt, exc.node, exc.cap))
            else:
                with LOCK:
                    stored[0] += 1

    in_threads(5, work)
    seen("stored", (ctx.attempt, stored[0]))
    if ctx.attempt == 1:
        raise RuntimeError("the first attempt fails after its events")
    return stored[0]


def test_threads_of_one_step_fill_the_cap_exactly_across_a_retry(
    client: Client,
    start_worker: StartWorker,
    monkeypatch: pytest.MonkeyPatch,
    clock: Callable[[Any], None],
) -> None:
    """Cap 13; 5 threads x 4 events per attempt, batches of 3: attempt 1 stores 13 and is
    refused 7; attempt 2 is refused all 20; seqs 1..13, each thread's events in order."""
    from datetime import UTC, datetime, timedelta

    monkeypatch.setattr(emitter, "MAX_BATCH_EVENTS", 3)
    start_worker(eba_threads_capped, max_events_per_step=13)
    handle = client.enqueue(eba_threads_capped, 4)
    wait_until(lambda: SEEN.get("stored"), timeout=15, what="attempt 1")
    clock(datetime.now(UTC) + timedelta(seconds=5))  # past the retry's backoff
    assert handle.result(timeout=15) == 0
    assert SEEN["stored"] == [(1, 13), (2, 0)]
    assert (
        sorted(SEEN["refused"])
        == [(1, "eba_threads_capped", 13)] * 7 + [(2, "eba_threads_capped", 13)] * 20
    )
    events = client.events_of(handle.id)
    assert [e.seq for e in events] == list(range(1, 14))
    for t in range(5):
        mine = [e.data[2] for e in events if e.data[1] == t]
        assert mine == list(range(len(mine)))


# -- one handler's cap or error does not reach another in its batch ----------------------


@step(name="eba_noisy")
def eba_noisy(n: int, ctx: StepContext) -> int:
    refused = [0]

    def work(t: int) -> None:
        for k in range(n):
            try:
                ctx.emit({"noisy": t, "k": k})
            except EventLimitExceeded:
                with LOCK:
                    refused[0] += 1

    in_threads(4, work)
    return refused[0]


@step(name="eba_quiet")
def eba_quiet(n: int, ctx: StepContext) -> str:
    errors: list[str] = []

    def work(t: int) -> None:
        for k in range(n):
            try:
                if k % 2:
                    ctx.progress(k, n)
                else:
                    ctx.emit({"quiet": t, "k": k})
            except Exception as exc:
                errors.append(type(exc).__name__)

    in_threads(3, work)
    try:
        ctx.emit({"too": "x" * 70_000})
    except Exception as exc:
        errors.append(type(exc).__name__)
    return ",".join(errors) or "clean"


@step(name="eba_pair")
def eba_pair(a: int, b: str) -> list[Any]:
    return [a, b]


@workflow(name="eba_noisy_and_quiet")
def eba_noisy_and_quiet(n):  # type: ignore[no-untyped-def]
    return eba_pair(eba_noisy(n), eba_quiet(4))


def test_a_capped_step_does_not_spill_its_refusals_onto_its_batch_mates(
    client: Client, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step over its cap (cap 12) and another well below it emit together in batches
    of 5: only the capped step gets EventLimitExceeded; the other stores all of its
    events (and only its oversized one is refused, with PayloadTooLarge)."""
    monkeypatch.setattr(emitter, "MAX_BATCH_EVENTS", 5)
    start_worker(eba_noisy, eba_quiet, eba_pair, max_events_per_step=12, concurrency=4)
    handle = client.submit(eba_noisy_and_quiet, 8)
    assert handle.result(timeout=30) == [32 - 12, "PayloadTooLarge"]
    events = client.events_of(handle.id)
    assert [e.seq for e in events] == list(range(1, 12 + 12 + 1))
    assert len([e for e in events if e.node == "eba_noisy"]) == 12
    assert len([e for e in events if e.node == "eba_quiet"]) == 12


# -- two workers, small batches, async handlers ------------------------------------------


@step(name="eba_async_item")
async def eba_async_item(i: int, ctx: StepContext) -> int:
    async def one(t: int) -> None:
        for k in range(3):
            if k == 1:
                await ctx.progress_async(k, 3, f"{i}/{t}")
            else:
                await ctx.emit_async([i, t, k])

    await asyncio.gather(*(one(t) for t in range(4)))
    return i


@workflow(name="eba_async_fan")
def eba_async_fan(items):  # type: ignore[no-untyped-def]
    return for_each(eba_async_item, over=items)


def test_two_workers_of_async_emitters_store_every_event_once_in_batches_of_three(
    client: Client, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(emitter, "MAX_BATCH_EVENTS", 3)
    handles = [client.submit(eba_async_fan, list(range(8))) for _ in range(2)]
    start_worker(eba_async_item, concurrency=8)
    start_worker(eba_async_item, concurrency=8)
    for handle in handles:
        assert handle.result(timeout=30) == list(range(8))
        events = client.events_of(handle.id)
        assert [e.seq for e in events] == list(range(1, 8 * 12 + 1))
        assert not any(e.fenced for e in events)
        for i in range(8):
            mine = [e for e in events if e.node == f"eba_async_item[{i}]"]
            assert len(mine) == 12
            for t in range(4):
                order = [
                    e.data[2] if e.kind == "event" else e.data["done"]
                    for e in mine
                    if (e.kind == "event" and e.data[1] == t)
                    or (e.kind == "progress" and e.data["message"] == f"{i}/{t}")
                ]
                assert order == [0, 1, 2]


# -- a cancelled run while its handler's threads emit --------------------------------------


@step(name="eba_cancelled", max_attempts=1)
def eba_cancelled(x: int, ctx: StepContext) -> int:
    stored: list[int] = []
    failures: list[str] = []

    def work(t: int) -> None:
        after = 0  # emits after the handler saw the cancel (stored fenced)
        for k in range(20_000):
            try:
                ctx.emit([t, k])
            except Exception as exc:
                failures.append(type(exc).__name__)
                return
            with LOCK:
                stored.append(1)
            if t == 0 and k == 5:
                gate("emitting").set()
            if ctx.cancelled:
                after += 1
                if after > 2:
                    return

    in_threads(4, work)
    seen("stored", len(stored))
    seen("failures", failures)
    gate("done").set()
    return x


def test_cancelling_a_run_while_its_threads_emit_hangs_nothing_and_keeps_each_event(
    client: Client, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(emitter, "MAX_BATCH_EVENTS", 3)
    start_worker(eba_cancelled)
    handle = client.enqueue(eba_cancelled, 1)
    assert gate("emitting").wait(15)
    client.cancel(handle.id)
    assert handle.wait(timeout=15).state is RunState.CANCELLED
    assert gate("done").wait(20)
    assert SEEN["failures"] == [[]]
    events = client.events_of(handle.id, limit=100_000)
    assert [e.seq for e in events] == list(range(1, SEEN["stored"][0] + 1))
    assert len({tuple(e.data) for e in events}) == len(events)
    fences = [e.fenced for e in events]
    assert fences[-1] is True  # the last ones came after the cancel
    assert fences == sorted(fences)  # none live after a fenced one


# -- a handler whose worker stops while its threads emit ----------------------------------


@step(name="eba_outlives")
def eba_outlives(x: int, ctx: StepContext) -> int:
    stored = [0]
    failures: list[str] = []

    def work(t: int) -> None:
        after = 0  # emits after the worker's stop returned
        for k in range(100_000):
            if gate("stopped").is_set():
                after += 1
                if after > 3:
                    return
            try:
                ctx.emit([t, k])
            except Exception as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
                continue
            with LOCK:
                stored[0] += 1
            if t == 0 and k == 3:
                gate("emitting").set()

    in_threads(6, work)
    seen("stored", stored[0])
    seen("failures", failures)
    gate("done").set()
    return x


def test_a_worker_stopping_while_its_handler_emits_in_batches_keeps_every_event(
    client: Client, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(emitter, "MAX_BATCH_EVENTS", 2)
    worker = start_worker(eba_outlives, grace=0.1)
    handle = client.enqueue(eba_outlives, 1)
    assert gate("emitting").wait(15)
    worker.stop()
    gate("stopped").set()
    assert gate("done").wait(30)
    assert SEEN["failures"] == [[]]
    events = client.events_of(handle.id, limit=100_000)
    assert [e.seq for e in events] == list(range(1, SEEN["stored"][0] + 1))
    assert events[-1].fenced


# -- fenced and live executions in the same batches ----------------------------------------


def emit_from_threads(ctx: StepContext, tag: str, n: int) -> None:
    def work(t: int) -> None:
        for k in range(n):
            ctx.emit([tag, t, k])

    in_threads(4, work)


@step(name="eba_stale")
def eba_stale(x: int, ctx: StepContext) -> str:
    with LOCK:
        SEEN.setdefault("stale_calls", []).append(ctx.attempt)
        first = len(SEEN["stale_calls"]) == 1
    if not first:
        ctx.emit("fresh")
        return "fresh"
    gate("stale-started").set()
    assert gate("go").wait(30)  # a frozen worker: its lease is reclaimed meanwhile
    emit_from_threads(ctx, "stale", 6)
    gate("stale-done").set()
    return "stale"


@step(name="eba_live")
def eba_live(x: int, ctx: StepContext) -> str:
    gate("live-started").set()
    assert gate("go").wait(30)
    emit_from_threads(ctx, "live", 6)
    return "live"


def test_fenced_and_live_executions_emitting_together_keep_their_own_fence(
    client: Client, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    from datetime import timedelta

    from cyclone_dsl.testing import shifted_clock

    monkeypatch.setattr(emitter, "MAX_BATCH_EVENTS", 4)
    start_worker(eba_stale, eba_live, lease=300, scanners=False, concurrency=4)
    stale = client.enqueue(eba_stale, 1)
    assert gate("stale-started").wait(20)
    with shifted_clock(timedelta(minutes=10)):  # its lease expired long ago
        start_worker(eba_stale, scan_interval=0.05)  # its scanner reclaims the step
        assert stale.result(timeout=20) == "fresh"
    live = client.enqueue(eba_live, 1)
    assert gate("live-started").wait(20)
    gate("go").set()
    assert live.result(timeout=20) == "live"
    assert gate("stale-done").wait(20)
    stale_events = client.events_of(stale.id)
    assert [e.seq for e in stale_events] == list(range(1, 26))
    assert [(e.data, e.fenced) for e in stale_events if e.data == "fresh"] == [("fresh", False)]
    assert all(e.fenced for e in stale_events if e.data != "fresh")
    live_events = client.events_of(live.id)
    assert [e.seq for e in live_events] == list(range(1, 25))
    assert not any(e.fenced for e in live_events)


# -- a payload near the limit, and a transactional step that rolls back ------------------


@step(name="eba_big")
def eba_big(x: int, ctx: StepContext) -> int:
    def work(t: int) -> None:
        for k in range(5):
            if t == 0 and k == 2:
                ctx.emit("b" * 65_000)
            else:
                ctx.emit([t, k])

    in_threads(4, work)
    return x


@step(name="eba_tx", transactional=True, max_attempts=2)
def eba_tx(x: int, ctx: StepContext) -> int:
    ctx.connection.execute("SELECT 1")
    emit_from_threads(ctx, f"tx{ctx.attempt}", 3)
    if ctx.attempt == 1:
        raise RuntimeError("its transaction rolls back")
    return x


@workflow(name="eba_big_and_tx")
def eba_big_and_tx(x):  # type: ignore[no-untyped-def]
    return eba_pair(eba_big(x), eba_tx_str(eba_tx(x)))


@step(name="eba_tx_str")
def eba_tx_str(x: int) -> str:
    return str(x)


def test_a_big_payload_and_a_rolled_back_transactional_step_in_small_batches(
    client: Client,
    start_worker: StartWorker,
    monkeypatch: pytest.MonkeyPatch,
    clock: Callable[[Any], None],
) -> None:
    """A 65,000-character event among small ones, and a transactional step whose first
    attempt rolls back, all emitting from threads in batches of 3: every event stored
    once, in each thread's order, none fenced (a rolled-back attempt keeps its events)."""
    from datetime import UTC, datetime, timedelta

    monkeypatch.setattr(emitter, "MAX_BATCH_EVENTS", 3)
    start_worker(eba_big, eba_tx, eba_tx_str, eba_pair, concurrency=4)
    handle = client.submit(eba_big_and_tx, 7)
    wait_until(
        lambda: len([e for e in client.events_of(handle.id) if e.data[0] == "tx1"]) == 12,
        timeout=15,
        what="attempt 1's events",
    )
    clock(datetime.now(UTC) + timedelta(seconds=5))  # past the retry's backoff
    assert handle.result(timeout=20) == [7, "7"]
    events = client.events_of(handle.id)
    assert [e.seq for e in events] == list(range(1, 20 + 24 + 1))
    assert not any(e.fenced for e in events)
    big = [e.data for e in events if e.node == "eba_big"]
    assert big.count("b" * 65_000) == 1
    for t in range(4):
        assert [d for d in big if d != "b" * 65_000 and d[0] == t] == [
            [t, k] for k in range(5) if (t, k) != (0, 2)
        ]
        for attempt in (1, 2):
            mine = [e for e in events if e.data[0] == f"tx{attempt}" and e.data[1] == t]
            assert [e.data[2] for e in mine] == [0, 1, 2]
            assert {e.attempt for e in mine} == {attempt}


# -- sync and async calls on one event loop; a thread that outlives its handler ----------


@step(name="eba_mixed")
async def eba_mixed(i: int, ctx: StepContext) -> int:
    for k in range(6):
        if (i + k) % 2:
            ctx.emit([i, k])  # blocks the loop while the others' batch is written
        else:
            await ctx.emit_async([i, k])
    return i


@workflow(name="eba_mixed_fan")
def eba_mixed_fan(items):  # type: ignore[no-untyped-def]
    return for_each(eba_mixed, over=items)


def test_sync_and_async_emits_of_handlers_on_one_loop_do_not_wait_on_each_other(
    client: Client, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(emitter, "MAX_BATCH_EVENTS", 3)
    start_worker(eba_mixed, concurrency=10)
    handle = client.submit(eba_mixed_fan, list(range(10)))
    assert handle.result(timeout=20) == list(range(10))
    events = client.events_of(handle.id)
    assert [e.seq for e in events] == list(range(1, 61))
    for i in range(10):
        assert [e.data for e in events if e.node == f"eba_mixed[{i}]"] == [[i, k] for k in range(6)]


@step(name="eba_leaves_threads")
def eba_leaves_threads(x: int, ctx: StepContext) -> int:
    def late(t: int) -> None:
        assert gate("completed").wait(30)
        try:
            for k in range(4):
                ctx.emit(["late", t, k])
        except Exception as exc:
            seen("late_failures", type(exc).__name__)
        seen("late_done", t)

    for t in range(3):
        threading.Thread(target=late, args=(t,), daemon=True).start()
    ctx.emit("returned")
    return x


def test_threads_that_emit_after_their_handler_returned_store_fenced_events(
    client: Client, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(emitter, "MAX_BATCH_EVENTS", 3)
    start_worker(eba_leaves_threads)
    handle = client.enqueue(eba_leaves_threads, 3)
    assert handle.result(timeout=20) == 3
    gate("completed").set()
    wait_until(lambda: len(SEEN.get("late_done", [])) == 3, timeout=15, what="late threads")
    assert "late_failures" not in SEEN
    events = client.events_of(handle.id)
    assert [e.seq for e in events] == list(range(1, 14))
    assert [(e.data, e.fenced) for e in events[:1]] == [("returned", False)]
    assert all(e.fenced for e in events[1:])
    for t in range(3):
        assert [e.data[2] for e in events[1:] if e.data[1] == t] == [0, 1, 2, 3]
