"""A worker slot is free only when its handler has returned; cancels reach handlers at once;
no internal thread dies silently."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import pytest

from cyclone_dsl import (
    Client,
    InvalidArgument,
    StepContext,
    StepState,
    Worker,
    for_each,
    step,
    workflow,
)
from cyclone_dsl.errors import SchemaVersionMismatch, WorkerCrashed
from cyclone_dsl.failpoints import arm, disarm
from cyclone_dsl.testing.schemas import create_schema, drop_schema, with_search_path

release = threading.Event()


@step(name="ws_stuck", timeout=0.3, max_attempts=1)
def stuck(x: int) -> int:
    release.wait(30)  # ignores its timeout: a sync handler cannot be interrupted
    return x


@step(name="ws_quick", timeout=2.0, max_attempts=1)
def quick(x: int) -> int:
    return x


def test_a_hung_sync_handler_keeps_its_slot_until_it_returns(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Before: the slot was freed at the timeout, the next steps were claimed, waited behind
    the hung thread and were discarded as `timeout` without ever running."""
    release.clear()
    start_worker(stuck, quick, concurrency=1)
    hung = client.enqueue(stuck, 0)
    deadline = time.monotonic() + 20
    while client.get_run(hung.id).steps[0].state is not StepState.DISCARDED:
        assert time.monotonic() < deadline, "the stuck step was never failed for its timeout"
        time.sleep(0.05)
    assert client.get_run(hung.id).steps[0].error_kind == "timeout"
    waiting = [client.enqueue(quick, i) for i in range(3)]
    try:
        # For 1.5 s the hung handler holds the only slot: nothing is claimed behind it (its
        # timeout would then run out while it waits; 2 s, for a loaded machine's sake).
        hung_until = time.monotonic() + 1.5
        while time.monotonic() < hung_until:
            states = [client.get_run(h.id).steps[0].state for h in waiting]
            assert states == [StepState.AVAILABLE] * 3, f"claimed behind the hung one: {states}"
            time.sleep(0.05)
        release.set()  # the hung handler returns
        for number, handle in enumerate(waiting):
            assert handle.result(timeout=20) == number
    finally:
        release.set()
    for handle in waiting:
        row = client.get_run(handle.id).steps[0]
        assert (row.state, row.attempt, row.error_kind) == (StepState.COMPLETED, 0, None)


cancel_seen: dict[str, float] = {}
started = threading.Event()


@step(name="ws_polls", max_attempts=1)
def polls(x: int, *, ctx: StepContext) -> int:
    started.set()
    if ctx.wait_cancelled(30):
        cancel_seen["sync"] = time.monotonic()
    return x


@step(name="ws_awaits", max_attempts=1)
async def awaits(x: int) -> int:
    started.set()
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        cancel_seen["async"] = time.monotonic()
        raise
    return x


@workflow(name="ws_cancel_me")
def cancel_me(x):  # type: ignore[no-untyped-def]
    polls(x)
    awaits(x)


def test_a_cancel_reaches_running_handlers_at_once(
    client: Client,
    start_worker: Callable[..., Worker],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: ctx.cancelled was set at the next heartbeat (lease/3 = 10 s here), an async
    handler got no CancelledError, and the cancel was logged as a lost lease."""
    cancel_seen.clear()
    started.clear()
    worker = start_worker(cancel_me, lease=30.0)
    handle = client.submit(cancel_me, 1)
    deadline = time.monotonic() + 20
    while not all(s.state is StepState.RUNNING for s in client.get_run(handle.id).steps):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    caplog.set_level(logging.INFO, logger="cyclone.worker")
    cancelled_at = time.monotonic()
    client.cancel(handle.id)
    while len(cancel_seen) < 2:
        assert time.monotonic() - cancelled_at < 5, f"cancel not seen in 5 s: {cancel_seen}"
        time.sleep(0.01)
    assert max(cancel_seen.values()) - cancelled_at < 5  # measured here: a few ms
    assert not any("lease lost" in r.getMessage() for r in caplog.records)
    assert any("was cancelled" in r.getMessage() for r in caplog.records)
    deadline = time.monotonic() + 10
    while worker._running:  # both handlers returned: their slots are free
        assert time.monotonic() < deadline
        time.sleep(0.01)


gate = threading.Event()


@step(name="ws_item", max_attempts=1)
def item(x: int, *, ctx: StepContext) -> int:
    if x == 0:
        gate.wait(10)
        raise RuntimeError("item 0 fails")
    gate.set()
    if ctx.wait_cancelled(30):
        cancel_seen[f"item{x}"] = time.monotonic()
    return x


@step(name="ws_items")
def items() -> list[int]:
    return [0, 1]


@workflow(name="ws_fan_out")
def fan_out():  # type: ignore[no-untyped-def]
    return for_each(item, over=items())


def test_a_failed_item_stops_its_running_siblings_at_once(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    cancel_seen.clear()
    gate.clear()
    start_worker(fan_out, lease=30.0, concurrency=4)
    handle = client.submit(fan_out)
    run = handle.wait(timeout=20)
    assert run.state == "failed"
    deadline = time.monotonic() + 5
    while "item1" not in cancel_seen:
        assert time.monotonic() < deadline, "the sibling never saw its cancel"
        time.sleep(0.01)


def test_an_internal_thread_that_fails_stops_the_worker_loudly(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Before: a completer (or fetch) thread that raised died alone; the worker ran on
    and completed nothing."""

    def explode() -> None:
        raise RuntimeError("boom in the completer")

    worker = start_worker(quick)
    arm("complete.before_commit", explode)
    try:
        client.enqueue(quick, 1)
        deadline = time.monotonic() + 20
        while worker.error is None:
            assert time.monotonic() < deadline, "the worker did not notice its dead thread"
            time.sleep(0.02)
    finally:
        disarm("complete.before_commit")
    with pytest.raises(WorkerCrashed, match="boom in the completer"):
        worker.stop()


def test_a_worker_without_handlers_is_refused(cyclone_dsn: str) -> None:
    with pytest.raises(InvalidArgument, match="no handlers"):
        Worker(cyclone_dsn, [])


def test_a_worker_on_an_unmigrated_database_says_so(cyclone_admin_dsn: str) -> None:
    """Before: the fetch thread died on UndefinedTable and the worker ran on, claiming
    nothing, even after a migrate."""
    name = create_schema(cyclone_admin_dsn, migrated=False)
    try:
        worker = Worker(with_search_path(cyclone_admin_dsn, name), [quick])
        with pytest.raises(SchemaVersionMismatch, match=r"version 0 .*run `cyclone migrate`"):
            worker.start()
    finally:
        drop_schema(cyclone_admin_dsn, name)
