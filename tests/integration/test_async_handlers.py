"""Async handlers have slots of their own: a worker holds a thousand of them in flight on
its event loop with no thread each, while sync handlers stay limited by their threads;
a stop with many in flight releases their leases and loses nothing."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable

import psycopg
import pytest

from cyclone_dsl import Client, InvalidArgument, StepState, Worker, step
from tests.waiting import wait_until


class Gate:
    """What held handlers wait on until the test opens it (on any worker's loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._opened = False
        self._events: dict[asyncio.AbstractEventLoop, asyncio.Event] = {}

    async def wait(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._opened:
                return
            event = self._events.setdefault(loop, asyncio.Event())
        await event.wait()

    def open(self) -> None:
        with self._lock:
            self._opened = True
            for loop, event in self._events.items():
                if not loop.is_closed():
                    loop.call_soon_threadsafe(event.set)

    def close(self) -> None:
        with self._lock:
            self._opened = False
            self._events.clear()


gate = Gate()
sync_gate = threading.Event()
returned: Counter[int] = Counter()  # async handlers that returned, by input
returned_lock = threading.Lock()


@step(name="ah_held")
async def held(x: int) -> int:
    await gate.wait()
    with returned_lock:
        returned[x] += 1
    return x


@step(name="ah_sync_held")
def sync_held(x: int) -> int:
    sync_gate.wait(60)
    return x


@step(name="ah_bad_output", max_attempts=3)
async def bad_output(x: int) -> object:
    return {x}


def _states(dsn: str, kind: str) -> dict[tuple[str, int], int]:
    """How many steps of ``kind`` are in each (state, attempt)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT state, attempt, count(*) FROM cyclone_steps WHERE kind = %s GROUP BY 1, 2",
            (kind,),
        ).fetchall()
    return {(state, attempt): count for state, attempt, count in rows}


@pytest.fixture(autouse=True)
def _fresh_gates() -> None:
    gate.close()
    sync_gate.clear()
    returned.clear()


def test_a_thousand_async_handlers_wait_at_once_on_a_few_threads(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    total = 1000
    client.enqueue_many(held, list(range(total)))
    before = threading.active_count()
    worker = start_worker(held)  # no tuning option
    try:
        wait_until(
            lambda: worker.settings().async_in_use >= total,
            timeout=60,
            what=f"{total} async handlers in flight",
        )
        settings = worker.settings()
        assert settings.slots_in_use == total
        assert settings.threads == 0, "an async handler started a handler thread"
        # The worker's own threads: fetch, loop, completers, heartbeat, listener, ...
        assert threading.active_count() - before < 30
        assert _states(cyclone_dsn, "ah_held") == {("running", 0): total}
    finally:
        gate.open()
    wait_until(
        lambda: _states(cyclone_dsn, "ah_held") == {("completed", 0): total},
        timeout=60,
        what="every step completed",
    )
    assert sorted(returned) == list(range(total))
    assert set(returned.values()) == {1}, "a step ran twice"


def test_sync_handlers_keep_their_limit_beside_many_async_ones(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    client.enqueue_many(sync_held, list(range(20)))
    client.enqueue_many(held, list(range(300)))
    worker = start_worker(held, sync_held, concurrency=4)
    try:
        wait_until(
            lambda: worker.settings().async_in_use == 300 and worker.settings().slots_in_use == 304,
            timeout=60,
            what="4 sync and 300 async handlers in flight",
        )
        settings = worker.settings()
        assert (settings.adaptive, settings.concurrency, settings.threads) == (False, 4, 4)
        assert _states(cyclone_dsn, "ah_sync_held") == {("running", 0): 4, ("available", 0): 16}
    finally:
        sync_gate.set()
        gate.open()
    wait_until(
        lambda: (
            _states(cyclone_dsn, "ah_sync_held") == {("completed", 0): 20}
            and _states(cyclone_dsn, "ah_held") == {("completed", 0): 300}
        ),
        timeout=60,
        what="every step completed",
    )
    assert worker.settings().threads == 4


def test_a_stop_with_many_async_handlers_in_flight_loses_nothing(
    client: Client, cyclone_dsn: str
) -> None:
    total = 500
    client.enqueue_many(held, list(range(total)))
    first = Worker(cyclone_dsn, [held], grace=0.2, poll_interval=0.1).start()
    try:
        wait_until(
            lambda: first.settings().async_in_use == total,
            timeout=60,
            what=f"{total} async handlers in flight",
        )
    finally:
        first.stop()
    # Cancelled after the grace period: every lease released, no attempt spent.
    assert _states(cyclone_dsn, "ah_held") == {("available", 0): total}
    assert not returned
    gate.open()
    with Worker(cyclone_dsn, [held], poll_interval=0.1):
        wait_until(
            lambda: _states(cyclone_dsn, "ah_held") == {("completed", 0): total},
            timeout=60,
            what="the second worker to complete every step",
        )
    assert sorted(returned) == list(range(total))
    assert set(returned.values()) == {1}


def test_an_async_output_that_is_not_json_fails_at_once(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(bad_output)
    handle = client.enqueue(bad_output, 1)
    run = handle.wait(timeout=20)
    row = run.step("ah_bad_output")
    assert (row.state, row.error_kind, row.attempt) == (StepState.DISCARDED, "invalid_output", 1)
    assert "set is not JSON" in (row.error or "")


def test_max_async_is_checked(cyclone_dsn: str) -> None:
    for bad in (0, -1, True, 2.5, "100"):
        with pytest.raises(InvalidArgument, match="max_async"):
            Worker(cyclone_dsn, [held], max_async=bad)  # type: ignore[arg-type]
    worker = Worker(cyclone_dsn, [held, sync_held], max_async=50, max_concurrency=8)
    settings = worker.settings()
    assert (settings.max_async, settings.async_concurrency) == (50, 50)
    assert (settings.max_concurrency, settings.concurrency) == (8, 8)
