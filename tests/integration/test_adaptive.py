"""A worker started without ``concurrency`` adapts its slot limit to the work: it grows
under sleeping handlers with a backlog, never past ``max_concurrency``, shrinks under
CPU-bound handlers; ``concurrency=`` fixes it. Nothing is lost or run twice meanwhile."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest

from cyclone_dsl import Client, InvalidArgument, StepState, Worker, step
from tests.waiting import wait_until

runs: Counter[int] = Counter()
runs_lock = threading.Lock()
release = threading.Event()


@step(name="ad_sleep")
def sleepy(x: int) -> int:
    with runs_lock:
        runs[x] += 1
    time.sleep(0.01)
    return x


@step(name="ad_held")
def held(x: int) -> int:
    release.wait(30)
    return x


@step(name="ad_burn")
def burn(x: int) -> int:
    deadline = time.thread_time() + 0.02
    while time.thread_time() < deadline:
        pass
    return x


def _limits(worker: Worker, seconds: float, until: Callable[[], bool]) -> list[int]:
    """The worker's slot limit, sampled until ``until()`` (or ``seconds`` pass)."""
    seen = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not until():
        seen.append(worker.settings().concurrency)
        time.sleep(0.02)
    seen.append(worker.settings().concurrency)
    return seen


def test_sleeping_handlers_with_a_backlog_grow_the_limit_and_every_step_runs_once(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    runs.clear()
    total = 3000
    client.enqueue_many(sleepy, list(range(total)))
    worker = start_worker(sleepy, max_concurrency=40)
    assert worker.settings().adaptive
    seen = _limits(worker, 60, lambda: worker.settings().concurrency > 20)
    assert seen[0] <= 10 < 20 < seen[-1], seen
    seen += _limits(worker, 120, lambda: worker.completed_count >= total)
    assert worker.completed_count >= total, "the backlog was not drained"
    assert max(seen) <= 40
    assert worker.settings().threads <= 40
    assert sorted(runs) == list(range(total))
    assert set(runs.values()) == {1}, "a step ran twice"


def test_the_limit_is_fixed_when_concurrency_is_given(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    release.clear()
    client.enqueue_many(held, list(range(20)))
    worker = start_worker(held, concurrency=4)
    try:
        wait_until(lambda: worker.slots_in_use == 4, timeout=20, what="4 held handlers")
        # Every slot waits on held handlers with a backlog behind them: an adaptive worker
        # grows within a few 0.1 s intervals here; a fixed one never does. (Something not
        # happening can only be watched for a while.)
        time.sleep(1.5)
        settings = worker.settings()
        assert (settings.adaptive, settings.concurrency, settings.max_concurrency) == (
            False,
            4,
            4,
        )
        assert worker.slots_in_use == 4
        assert settings.threads == 4
    finally:
        release.set()


def test_cpu_bound_handlers_shrink_the_limit(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    # 20 ms of CPU each: the controller looks after 20 returns (adaptive.MIN_RETURNS), so
    # 160 steps give it several intervals of a backlog to halve the limit in; 400 made the
    # test wait 8 s of CPU for the last ones.
    total = 160
    handles = client.enqueue_many(burn, list(range(total)))
    worker = start_worker(burn)
    assert worker.settings().concurrency == 10
    floor = max(2, os.cpu_count() or 2)
    seen = _limits(worker, 60, lambda: worker.settings().concurrency < 10)
    assert seen[-1] < 10, seen
    assert min(seen) >= min(10, floor)
    assert max(seen) == 10, "CPU-bound handlers grew the limit"
    for handle in handles[-5:]:
        assert handle.result(timeout=120) in range(total)
    assert all(client.get_run(h.id).steps[0].state is StepState.COMPLETED for h in handles[:5])


def test_bad_settings_are_refused(cyclone_dsn: str) -> None:
    with pytest.raises(InvalidArgument, match="max_concurrency"):
        Worker(cyclone_dsn, [sleepy], concurrency=4, max_concurrency=8)
    with pytest.raises(InvalidArgument, match="concurrency"):
        Worker(cyclone_dsn, [sleepy], concurrency=0)
    with pytest.raises(InvalidArgument, match="max_concurrency"):
        Worker(cyclone_dsn, [sleepy], max_concurrency=0)
