"""Audit of wake-ups: every transition that makes work claimable reaches an idle worker.

"New available work sends ``NOTIFY cyclone_work`` with the queue name as the only payload;
idle workers wake at once. Polling (``poll_interval``) is only the fallback."
(docs/concepts/runs-and-steps.md, "Wake-ups"). Each worker here polls once a minute
(``LONG_POLL``): a step that starts within a few seconds of the transition (or of its due
time) was woken, not polled. Every step that is timed has a queue of its own, named after
it, so no other test's wake-up of another queue can wake the worker under test.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from cyclone_dsl import (
    Client,
    Concurrency,
    Debounce,
    RunState,
    Worker,
    child,
    for_each,
    step,
    wait_any,
    wait_n,
    wait_signal,
    wait_timer,
    workflow,
)
from tests.waiting import LONG_POLL, PROMPT, wait_idle, wait_until

#: How long a woken step may take to start (a missed wake-up waits for the 60 s poll).
STALL = 6.0
#: How long after its due time a time-based step may start.
LATE = 5.0
#: The small real delay of the time-based transitions.
DELAY = 1.0

RUNNER_Q = "wka_runner"  # held steps that end a child run or a fan-out, on another worker

starts: dict[str, list[float]] = {}
failing: set[str] = set()
release = threading.Event()


@pytest.fixture(autouse=True)
def _fresh(start_worker: Callable[..., Worker]) -> Iterator[None]:
    """Torn down before the workers stop (it needs start_worker): held handlers return
    first, instead of holding each stop for its grace."""
    starts.clear()
    failing.clear()
    release.clear()
    yield
    release.set()  # before the workers stop: a held handler returns


def _note(name: str) -> None:
    starts.setdefault(name, []).append(time.monotonic())


def _target(name: str, **options: Any) -> Any:
    """A step on a queue of its own that notes when it starts (and fails while ``failing``
    names it)."""

    def handler(x: object = None) -> object:
        _note(name)
        if name in failing:
            failing.discard(name)
            raise RuntimeError("fails once")
        return x

    handler.__name__ = name
    return step(name=name, queue=name, **options)(handler)


@step(name="wka_gate", queue=RUNNER_Q)
def wka_gate(x: object) -> object:
    _note("wka_gate")
    release.wait(timeout=60)
    return x


@step(name="wka_first", queue=RUNNER_Q)
def wka_first(x: object) -> object:
    return x


wka_after_signal = _target("wka_after_signal")
wka_after_any = _target("wka_after_any")
wka_after_n = _target("wka_after_n")
wka_after_child = _target("wka_after_child")
wka_join = _target("wka_join")
wka_resumed = _target("wka_resumed")
wka_retried = _target("wka_retried", max_attempts=1)
wka_limited = _target("wka_limited")
wka_second = _target("wka_second")
wka_delayed = _target("wka_delayed")
wka_backoff = _target("wka_backoff", max_attempts=2)
wka_after_timer = _target("wka_after_timer")
wka_debounced = _target("wka_debounced")
wka_scheduled = _target("wka_scheduled")


@workflow(name="wka_signal_wf")
def wka_signal_wf(x):  # type: ignore[no-untyped-def]
    return wka_after_signal(wait_signal("go"))


@workflow(name="wka_any_wf")
def wka_any_wf(x):  # type: ignore[no-untyped-def]
    return wka_after_any(wait_any(["yes", "no"]))


@workflow(name="wka_n_wf")
def wka_n_wf(x):  # type: ignore[no-untyped-def]
    return wka_after_n(wait_n("vote", 2))


@workflow(name="wka_child_wf")
def wka_child_wf(x):  # type: ignore[no-untyped-def]
    return wka_gate(x)


@workflow(name="wka_parent_wf")
def wka_parent_wf(x):  # type: ignore[no-untyped-def]
    return wka_after_child(child(wka_child_wf, x))


@workflow(name="wka_fan_wf")
def wka_fan_wf(xs):  # type: ignore[no-untyped-def]
    return wka_join(for_each(wka_gate, over=xs))


@workflow(name="wka_resume_wf")
def wka_resume_wf(x):  # type: ignore[no-untyped-def]
    return wka_resumed(x)


@workflow(name="wka_retry_wf")
def wka_retry_wf(x):  # type: ignore[no-untyped-def]
    return wka_retried(x)


@workflow(name="wka_limited_wf", concurrency=Concurrency(limit=1))
def wka_limited_wf(x):  # type: ignore[no-untyped-def]
    first = wka_limited(x)
    return wka_first(wait_signal("never", after=[first]))


@workflow(name="wka_timer_wf")
def wka_timer_wf(x):  # type: ignore[no-untyped-def]
    return wka_after_timer(x, after=[wait_timer(DELAY)])


@workflow(name="wka_debounce_wf")
def wka_debounce_wf(job):  # type: ignore[no-untyped-def]
    return wka_debounced(job)


def _started_within(name: str, since: float, limit: float, *, nth: int = 1) -> float:
    """Seconds from ``since`` to the ``nth`` start of ``name``; fails past ``limit``."""
    try:
        wait_until(
            lambda: len(starts.get(name, [])) >= nth,
            timeout=max(0.1, since + limit - time.monotonic()),
            what=f"{name} to start (a wake-up; the next poll is {LONG_POLL:g}s away)",
        )
    except AssertionError:
        raise AssertionError(f"{name} did not start within {limit:g}s") from None
    took = starts[name][nth - 1] - since
    assert took <= limit, f"{name} started {took:.1f}s after"
    return took


# -- transitions made by a call or by another worker's completion --------------------------


@pytest.mark.parametrize(
    ("wf", "target", "signals"),
    [
        (wka_signal_wf, "wka_after_signal", [("go", 1)]),
        (wka_any_wf, "wka_after_any", [("no", 1)]),
        (wka_n_wf, "wka_after_n", [("vote", 1), ("vote", 2)]),
    ],
    ids=["wait_signal", "wait_any", "wait_n"],
)
def test_a_signal_that_completes_a_wait_wakes_the_next_step(
    client: Client,
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    wf: Any,
    target: str,
    signals: list[tuple[str, int]],
) -> None:
    worker = start_worker(wf, queues=[target], poll_interval=LONG_POLL)
    run = client.submit(wf, 0)
    *before, last = signals
    for name, payload in before:  # wait_n: all but the n-th
        client.signal(run.id, name, payload)
    wait_idle(cyclone_dsn, worker, listeners=1)
    since = time.monotonic()
    client.signal(run.id, *last)
    _started_within(target, since, STALL)
    assert run.result(timeout=PROMPT) is not None


def test_a_child_run_ending_on_another_worker_wakes_the_parent_s_next_step(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    start_worker(wka_parent_wf, queues=[RUNNER_Q], poll_interval=LONG_POLL)
    run = client.submit(wka_parent_wf, 7)
    idle = start_worker(wka_parent_wf, queues=["wka_after_child"], poll_interval=LONG_POLL)
    wait_until(lambda: "wka_gate" in starts, timeout=PROMPT, what="the child's step to run")
    wait_idle(cyclone_dsn, idle, listeners=2)
    since = time.monotonic()
    release.set()
    _started_within("wka_after_child", since, STALL)
    assert run.result(timeout=PROMPT) == 7


def test_a_fan_out_s_last_item_ending_on_another_worker_wakes_the_join(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    start_worker(wka_fan_wf, queues=[RUNNER_Q], poll_interval=LONG_POLL, concurrency=4)
    run = client.submit(wka_fan_wf, [1, 2, 3])
    idle = start_worker(wka_fan_wf, queues=["wka_join"], poll_interval=LONG_POLL)
    wait_until(
        lambda: len(starts.get("wka_gate", [])) == 3, timeout=PROMPT, what="the items to run"
    )
    wait_idle(cyclone_dsn, idle, listeners=2)
    since = time.monotonic()
    release.set()
    _started_within("wka_join", since, STALL)
    assert run.result(timeout=PROMPT) == [1, 2, 3]


def test_resume_of_a_paused_run_wakes_its_due_step(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    run = client.submit(wka_resume_wf, 3)  # no worker serves its queue yet
    client.pause(run.id)
    worker = start_worker(wka_resume_wf, queues=["wka_resumed"], poll_interval=LONG_POLL)
    wait_idle(cyclone_dsn, worker, listeners=1)
    assert "wka_resumed" not in starts
    since = time.monotonic()
    client.resume(run.id)
    _started_within("wka_resumed", since, STALL)
    assert run.result(timeout=PROMPT) == 3


def test_an_operator_retry_of_a_failed_run_wakes_the_retried_step(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    failing.add("wka_retried")
    worker = start_worker(wka_retry_wf, queues=["wka_retried"], poll_interval=LONG_POLL)
    run = client.submit(wka_retry_wf, 4)
    wait_until(lambda: run.get().state is RunState.FAILED, timeout=PROMPT, what="the failure")
    wait_idle(cyclone_dsn, worker, listeners=1)
    since = time.monotonic()
    client.retry(run.id, "wka_retried")
    _started_within("wka_retried", since, STALL, nth=2)
    assert run.result(timeout=PROMPT) == 4


def test_cancelling_the_run_that_holds_a_workflow_slot_wakes_the_queued_run(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker(wka_limited_wf, queues=["wka_limited"], poll_interval=LONG_POLL)
    holder = client.submit(wka_limited_wf, 1)
    wait_until(lambda: "wka_limited" in starts, timeout=PROMPT, what="the holder's step")
    queued = client.submit(wka_limited_wf, 2)
    wait_until(
        lambda: "run slot" in " ".join(client.why_waiting(queued.id).values()),
        timeout=PROMPT,
        what="the second run to wait for the run slot",
    )
    wait_idle(cyclone_dsn, worker, listeners=1)
    since = time.monotonic()
    client.cancel(holder.id)
    _started_within("wka_limited", since, STALL, nth=2)


def test_enqueue_into_the_second_queue_a_worker_serves_wakes_it(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker(
        wka_second, queues=["wka_second_a", "wka_second"], poll_interval=LONG_POLL
    )
    wait_idle(cyclone_dsn, worker, listeners=1)
    since = time.monotonic()
    handle = client.enqueue(wka_second, 5, queue="wka_second")
    _started_within("wka_second", since, STALL)
    assert handle.result(timeout=PROMPT) == 5


# -- time-based: the step comes due with no call that could send a wake-up ------------------


def _due_in(seconds: float) -> tuple[datetime, float]:
    return datetime.now(UTC) + timedelta(seconds=seconds), time.monotonic() + seconds


def test_a_step_enqueued_to_start_later_starts_at_its_time(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker(wka_delayed, queues=["wka_delayed"], poll_interval=LONG_POLL)
    wait_idle(cyclone_dsn, worker, listeners=1)
    at, due = _due_in(DELAY)
    handle = client.enqueue(wka_delayed, 6, scheduled_at=at)
    _started_within("wka_delayed", due, LATE)
    assert handle.result(timeout=PROMPT) == 6


def test_a_retry_starts_when_its_short_backoff_ends(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    failing.add("wka_backoff")
    worker = start_worker(wka_backoff, queues=["wka_backoff"], poll_interval=LONG_POLL)
    wait_idle(cyclone_dsn, worker, listeners=1)
    handle = client.enqueue(wka_backoff, 8)
    wait_until(lambda: "wka_backoff" in starts, timeout=PROMPT, what="the first attempt")
    due = starts["wka_backoff"][0] + 1.0  # the first retry's backoff: 0.5 to 1 s
    _started_within("wka_backoff", due, LATE, nth=2)
    assert handle.result(timeout=PROMPT) == 8


def test_a_timer_that_comes_due_wakes_the_next_step(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker(wka_timer_wf, queues=["wka_after_timer"], poll_interval=LONG_POLL)
    wait_idle(cyclone_dsn, worker, listeners=1)
    _, due = _due_in(DELAY)
    run = client.submit(wka_timer_wf, 9)
    _started_within("wka_after_timer", due, LATE)
    assert run.result(timeout=PROMPT) == 9


def test_a_debounced_run_starts_when_its_window_closes(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker(wka_debounce_wf, queues=["wka_debounced"], poll_interval=LONG_POLL)
    wait_idle(cyclone_dsn, worker, listeners=1)
    _, due = _due_in(DELAY)
    run = client.submit(
        wka_debounce_wf, {"doc": "d1"}, debounce=Debounce(key="doc", delay=timedelta(seconds=DELAY))
    )
    _started_within("wka_debounced", due, LATE)
    assert run.result(timeout=PROMPT) == {"doc": "d1"}


def test_a_schedule_that_fires_wakes_its_run_s_step(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """A cron with a seconds field (croniter's sixth field): it fires every second, the
    first time at the next whole second, when the scanner (each 1 s) finds it due."""
    worker = start_worker(
        wka_scheduled, queues=["wka_scheduled"], poll_interval=LONG_POLL, scan_interval=1.0
    )
    wait_idle(cyclone_dsn, worker, listeners=1)
    since = time.monotonic()
    client.schedule(wka_scheduled, "* * * * * *", id="wka-every-second", location="UTC")
    _started_within("wka_scheduled", since + 2.0, LATE)
