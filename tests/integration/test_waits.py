"""Signals, timers, deadlines, pause, resume and cancel through the public API."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest

from cyclone_dsl import (
    Client,
    Worker,
    step,
    wait_any,
    wait_n,
    wait_signal,
    wait_timer,
    workflow,
)
from cyclone_dsl.engine.signals import Delivery
from cyclone_dsl.errors import (
    AlreadyTerminal,
    InvalidTransition,
    MailboxFull,
    RunFailed,
    RunNotFound,
    SignalNotDeliverable,
)
from cyclone_dsl.states import RunState, StepState
from tests.waiting import PROMPT, wait_until

release = threading.Event()


@step(name="wt_echo")
def echo(value: object) -> object:
    return value


@step(name="wt_slow")
def slow(x: int) -> int:
    release.wait(10)
    return x


@workflow(name="wt_approval")
def approval(x):  # type: ignore[no-untyped-def]
    ok = wait_signal("approved")
    return echo(ok)


@workflow(name="wt_after_step")
def after_step(x):  # type: ignore[no-untyped-def]
    first = slow(x)
    ok = wait_signal("go", after=[first])
    return echo(ok)


@workflow(name="wt_votes")
def votes(x):  # type: ignore[no-untyped-def]
    return echo(wait_n("vote", 3))


@workflow(name="wt_votes_later")
def votes_later(x):  # type: ignore[no-untyped-def]
    first = slow(x)
    return echo(wait_n("vote", 3, after=[first]))


@workflow(name="wt_then_slow")
def then_slow(x):  # type: ignore[no-untyped-def]
    return slow(wait_signal("approved"))


@workflow(name="wt_any")
def any_of(x):  # type: ignore[no-untyped-def]
    return echo(wait_any(["yes", "no"]))


@workflow(name="wt_timeout")
def with_timeout(x):  # type: ignore[no-untyped-def]
    ok = wait_signal("late", timeout=timedelta(seconds=0.5))
    echo(ok, on_dep_failure="cancel_branch")
    return echo(x)


@workflow(name="wt_timer")
def timer(x):  # type: ignore[no-untyped-def]
    t = wait_timer(timedelta(seconds=0.5))
    return echo(x, after=[t])


@workflow(name="wt_stuck")
def stuck(x):  # type: ignore[no-untyped-def]
    return echo(wait_signal("never"))


@workflow(name="wt_long")
def long_chain(x):  # type: ignore[no-untyped-def]
    return echo(slow(x))


def test_signal_completes_the_wait_with_its_payload(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(echo, slow)
    handle = client.submit(approval, 1)
    assert client.signal(handle.id, "approved", {"by": "ana"}) is Delivery.CONSUMED
    assert handle.result(timeout=10) == {"by": "ana"}


def test_signal_before_activation_is_buffered_then_consumed(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    release.clear()
    start_worker(echo, slow)
    handle = client.submit(after_step, 5)
    assert client.signal(handle.id, "go", "early") is Delivery.BUFFERED
    with pytest.raises(MailboxFull):
        client.signal(handle.id, "go", "second")
    release.set()
    assert handle.result(timeout=10) == "early"


def test_wait_n_collects_in_order(client: Client, start_worker: Callable[..., Worker]) -> None:
    handle = client.submit(votes, 0)
    for v in ("a", "b", "c"):
        assert client.signal(handle.id, "vote", v) is Delivery.CONSUMED
    assert handle.get().step("vote").state is StepState.COMPLETED
    start_worker(echo)
    assert handle.result(timeout=10) == ["a", "b", "c"]


def test_wait_n_buffers_its_quorum_and_refuses_a_fourth(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    release.clear()
    start_worker(echo, slow)
    handle = client.submit(votes_later, 0)
    for v in ("a", "b", "c"):
        assert client.signal(handle.id, "vote", v) is Delivery.BUFFERED
    with pytest.raises(MailboxFull) as full:
        client.signal(handle.id, "vote", "d")
    assert full.value.capacity == 3
    release.set()
    assert handle.result(timeout=10) == ["a", "b", "c"]


def test_signal_after_the_wait_completed_is_not_stored(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    release.clear()
    start_worker(echo, slow)
    handle = client.submit(then_slow, 0)
    assert client.signal(handle.id, "approved", "first") is Delivery.CONSUMED
    assert client.signal(handle.id, "approved", "second") is Delivery.NOT_STORED
    release.set()
    assert handle.result(timeout=10) == "first"


def test_wait_any_takes_the_first(client: Client, start_worker: Callable[..., Worker]) -> None:
    start_worker(echo)
    handle = client.submit(any_of, 0)
    assert client.signal(handle.id, "no", 42) is Delivery.CONSUMED
    assert handle.result(timeout=10) == {"name": "no", "payload": 42}


def test_signal_errors(client: Client, start_worker: Callable[..., Worker]) -> None:
    start_worker(echo)
    handle = client.submit(approval, 1)
    with pytest.raises(SignalNotDeliverable):
        client.signal(handle.id, "unknown", 1)
    with pytest.raises(RunNotFound):
        client.signal(10**9, "approved", 1)
    client.signal(handle.id, "approved", 1)
    handle.wait(timeout=10)
    with pytest.raises(AlreadyTerminal):
        client.signal(handle.id, "approved", 2)


def test_signal_timeout_fails_the_wait_and_cancel_branch_contains_it(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(echo)
    handle = client.submit(with_timeout, 9)
    assert handle.result(timeout=10) == 9
    run = handle.get()
    wait = next(s for s in run.steps if s.kind == "@signal")
    assert wait.state is StepState.DISCARDED
    assert wait.error_kind == "signal_timeout"


def test_timer_fires_soon_after_its_due_time(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(echo)
    started = time.monotonic()
    handle = client.submit(timer, 3)
    assert handle.result(timeout=10) == 3
    elapsed = time.monotonic() - started
    # Not before its due time, by the database clock that fires it (and by this one) ...
    run = handle.get()
    fired, after = run.step("timer"), run.step("wt_echo")
    assert fired.completed_at is not None and fired.completed_at >= fired.scheduled_at
    assert after.started_at is not None and after.started_at >= fired.scheduled_at
    assert elapsed >= 0.5
    # ... and soon after it: a scan (every 0.5 s) and a claim, on a machine however loaded.
    assert elapsed < PROMPT


def test_deadline_fails_a_run_stuck_on_a_signal(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(echo)
    handle = client.submit(stuck, 1, deadline=timedelta(seconds=0.5))
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)
    assert failed.value.error_kind == "deadline"
    run = handle.get()
    assert run.state is RunState.FAILED
    assert all(s.state is StepState.CANCELLED for s in run.steps if s.kind == "@signal")


def test_pause_holds_downstream_and_resume_shifts_the_deadline(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    release.clear()
    start_worker(echo, slow)
    handle = client.submit(long_chain, 2, deadline=timedelta(hours=1))
    deadline_before = handle.get().deadline_at
    wait_until(
        lambda: handle.get().step("wt_slow").state is StepState.RUNNING,
        what="wt_slow to start",
    )
    client.pause(handle.id)
    paused_since = time.monotonic()
    with pytest.raises(InvalidTransition):
        client.pause(handle.id)
    release.set()
    wait_until(
        lambda: handle.get().step("wt_slow").state is StepState.COMPLETED,
        what="wt_slow to complete while the run is paused",
    )
    # The worker has claimed since wt_slow completed: a step enqueued now has run, so a
    # wt_echo wrongly made available by that completion would have been claimed too.
    assert client.enqueue(echo, "later").result(timeout=10) == "later"
    paused = handle.get()
    assert paused.state is RunState.PAUSED
    assert paused.step("wt_echo").state is StepState.PAUSED
    paused_for = time.monotonic() - paused_since  # the database saw a longer pause
    client.resume(handle.id)
    assert handle.result(timeout=10) == 2
    run = handle.get()
    assert run.deadline_at is not None and deadline_before is not None
    assert run.deadline_at - deadline_before >= timedelta(seconds=paused_for)
    with pytest.raises(AlreadyTerminal):
        client.resume(handle.id)


def test_cancel_during_a_long_step(client: Client, start_worker: Callable[..., Worker]) -> None:
    release.clear()
    worker = start_worker(echo, slow)
    handle = client.submit(long_chain, 2)
    wait_until(
        lambda: handle.get().step("wt_slow").state is StepState.RUNNING,
        what="wt_slow to start",
    )
    client.cancel(handle.id)
    release.set()
    run = handle.wait(timeout=5)
    assert run.state is RunState.CANCELLED
    # Stopping the worker waits for wt_slow's handler to return and for its outcome to be
    # committed (and fenced) or dropped: nothing the worker still does can change the run.
    worker.stop()
    run = handle.get()
    assert run.step("wt_slow").state is StepState.CANCELLED
    assert run.step("wt_echo").state is StepState.CANCELLED
    with pytest.raises(AlreadyTerminal):
        client.cancel(handle.id)


@workflow(name="wt_paused_timer")
def paused_timer(x):  # type: ignore[no-untyped-def]
    t = wait_timer(timedelta(minutes=10))
    return echo(x, after=[t])


def test_resume_shifts_a_waiting_timer_by_the_pause(client: Client) -> None:
    handle = client.submit(paused_timer, 1)
    due_before = handle.get().step("timer").scheduled_at
    client.pause(handle.id)
    time.sleep(0.6)
    client.resume(handle.id)
    due_after = handle.get().step("timer").scheduled_at
    assert due_after - due_before >= timedelta(seconds=0.6)
    assert handle.get().step("timer").state is StepState.WAITING_TIMER


# -- what a run failed by its deadline reports ------------------------------------------------


@step(name="wt_flaky", max_attempts=10)
def flaky(value: object) -> object:
    raise RuntimeError("wt boom")


@workflow(name="wt_contained_then_stuck")
def contained_then_stuck(x):  # type: ignore[no-untyped-def]
    a = wait_signal("wt_a", timeout=timedelta(seconds=0.3))
    echo(a, on_dep_failure="cancel_branch")
    return echo(wait_signal("wt_b"))


def test_a_deadline_after_a_contained_failure_is_reported_as_the_deadline(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """RunFailed named the contained failure (a wait that timed out earlier, its branch
    cancelled, the run going on) as the cause, not the deadline that failed the run."""
    start_worker(echo)
    handle = client.submit(contained_then_stuck, 1, deadline=timedelta(seconds=1.5))
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=15)
    assert (failed.value.state, failed.value.error_kind) == ("failed", "deadline")
    # The same run cancelled after its contained failure: the cancel ended it.
    cancelled = client.submit(contained_then_stuck, 2)
    wait_until(
        lambda: cancelled.get().step("wt_a").state is StepState.DISCARDED, what="the timeout"
    )
    client.cancel(cancelled.id)
    with pytest.raises(RunFailed) as failed:
        cancelled.result(timeout=15)
    assert (failed.value.state, failed.value.error_kind) == ("cancelled", "cancelled")


@workflow(name="wt_wait_then_flaky")
def wait_then_flaky(x):  # type: ignore[no-untyped-def]
    return flaky(wait_signal("wt_go"))


def test_a_deadline_during_a_retry_is_reported_as_the_deadline(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """The step waiting for its next attempt keeps its last attempt's error when the deadline
    cancels it, and RunFailed reported that error, as if the step had failed for good."""
    start_worker(echo, flaky)
    handle = client.submit(wait_then_flaky, 1, deadline=timedelta(seconds=3))
    assert client.signal(handle.id, "wt_go", 1) is Delivery.CONSUMED
    wait_until(lambda: handle.get().step("wt_flaky").attempt >= 1, what="a failed attempt")
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=15)
    assert (failed.value.state, failed.value.error_kind) == ("failed", "deadline")
    assert failed.value.node == "wt_flaky"
    # The step keeps its own error: runs filtered by error kind still find it.
    assert handle.get().step("wt_flaky").error_kind == "error"
