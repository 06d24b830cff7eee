"""Deadlines, step timeouts and wait timeouts, and how they meet pause/resume,
cancel, retries (backoff), child runs and fan-out. Public API only."""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from cyclone_dsl import (
    Client,
    StepContext,
    Worker,
    child,
    define_result,
    for_each,
    step,
    wait_n,
    wait_signal,
    wait_timer,
    workflow,
)
from cyclone_dsl.errors import (
    CycloneError,
    InvalidArgument,
    InvalidGraph,
    InvalidTransition,
    RunFailed,
)
from cyclone_dsl.states import RunState, StepState
from tests.waiting import PROMPT, scanner_passes, wait_until

# -- shared state the handlers report into ------------------------------------------------

calls: dict[str, int] = {}
_serial = itertools.count()
calls_lock = threading.Lock()
seen_cancelled: dict[str, bool] = {}


def _count(name: str) -> int:
    with calls_lock:
        calls[name] = calls.get(name, 0) + 1
        return calls[name]


def _reset(*names: str) -> None:
    with calls_lock:
        for n in names:
            calls.pop(n, None)
            seen_cancelled.pop(n, None)


# -- steps ---------------------------------------------------------------------------------


@step(name="audit_dl_echo")
def echo(value: object) -> object:
    return value


@step(name="audit_dl_hang", max_attempts=1)
def hang(x: int, ctx: StepContext) -> int:
    _count("hang")
    seen_cancelled["hang"] = ctx.wait_cancelled(15)
    return x


@step(name="audit_dl_async_hang", max_attempts=1)
async def async_hang(x: int) -> int:
    _count("async_hang")
    try:
        await asyncio.sleep(15)
    except asyncio.CancelledError:
        seen_cancelled["async_hang"] = True
        raise
    return x


@step(name="audit_dl_timeout_always", timeout=0.3, max_attempts=2)
def timeout_always(x: int, ctx: StepContext) -> int:
    _count("timeout_always")
    ctx.wait_cancelled(3)
    return x


# 1.5 s: the retry, which returns at once, must do so within it on a loaded machine.
@step(name="audit_dl_timeout_once", timeout=1.5, max_attempts=3)
def timeout_once(x: int, ctx: StepContext) -> int:
    n = _count("timeout_once")
    if n == 1:
        ctx.wait_cancelled(10)
        return -1  # ignored: timed out
    return x * 10


@step(name="audit_dl_async_swallow", timeout=0.3, max_attempts=1)
async def async_swallow(x: int) -> str:
    _count("async_swallow")
    try:
        await asyncio.sleep(3)
    except asyncio.CancelledError:
        return "late"  # swallows the cancellation
    return "on time"


#: Holds the first attempt of audit_dl_fail_once until the test sets it.
fail_once_gate = threading.Event()


@step(name="audit_dl_fail_once", max_attempts=3)
def fail_once(x: int) -> int:
    n = _count("fail_once")
    if n == 1:
        fail_once_gate.wait(PROMPT)
        raise RuntimeError("first attempt fails")
    return x + 1


@step(name="audit_dl_fail_always", max_attempts=5)
def fail_always(x: int) -> int:
    _count("fail_always")
    raise RuntimeError("always fails")


# 1.5 s: the test's pause must land before the first attempt's timeout on a loaded machine.
@step(name="audit_dl_pause_timeout", timeout=1.5, max_attempts=2)
def pause_timeout(x: int, ctx: StepContext) -> int:
    n = _count("pause_timeout")
    if n == 1:
        ctx.wait_cancelled(10)
        return -1
    return x + 100


@step(name="audit_dl_items")
def items(n: int) -> list[int]:
    return list(range(n))


@step(name="audit_dl_item_hang", max_attempts=1)
def item_hang(i: int, ctx: StepContext) -> int:
    _count("item_hang")
    ctx.wait_cancelled(5)
    return i


@step(name="audit_dl_item_timeout", timeout=0.3, max_attempts=1)
def item_timeout(i: int, ctx: StepContext) -> int:
    if i == 1:
        ctx.wait_cancelled(3)
    return i


@step(name="audit_dl_item_fail_once", max_attempts=3)
def item_fail_once(i: int) -> int:
    if _count(f"item_fail_once_{i}") == 1:
        raise RuntimeError(f"item {i} fails once")
    return i * 2


@step(name="audit_dl_overrun", timeout=0.3, max_attempts=1)
def overrun(x: int) -> int:
    time.sleep(0.32)  # returns just past its timeout
    return x


# -- workflows -----------------------------------------------------------------------------


@workflow(name="audit_dl_hang_wf")
def hang_wf(x):  # type: ignore[no-untyped-def]
    return hang(x)


@workflow(name="audit_dl_async_hang_wf")
def async_hang_wf(x):  # type: ignore[no-untyped-def]
    return async_hang(x)


@workflow(name="audit_dl_signal_wf")
def signal_wf(x):  # type: ignore[no-untyped-def]
    return echo(wait_signal("audit_dl_go"))


@workflow(name="audit_dl_signal_timeout_wf")
def signal_timeout_wf(x):  # type: ignore[no-untyped-def]
    return echo(wait_signal("audit_dl_go", timeout=timedelta(seconds=1)))


@workflow(name="audit_dl_wait_n_timeout_wf")
def wait_n_timeout_wf(x):  # type: ignore[no-untyped-def]
    return echo(wait_n("audit_dl_vote", 3, timeout=timedelta(seconds=0.6)))


@workflow(name="audit_dl_timeout_always_wf")
def timeout_always_wf(x):  # type: ignore[no-untyped-def]
    return timeout_always(x)


@workflow(name="audit_dl_timeout_once_wf")
def timeout_once_wf(x):  # type: ignore[no-untyped-def]
    return timeout_once(x)


@workflow(name="audit_dl_async_swallow_wf")
def async_swallow_wf(x):  # type: ignore[no-untyped-def]
    return async_swallow(x)


@workflow(name="audit_dl_fail_once_wf")
def fail_once_wf(x):  # type: ignore[no-untyped-def]
    return fail_once(x)


@workflow(name="audit_dl_fail_always_wf")
def fail_always_wf(x):  # type: ignore[no-untyped-def]
    return fail_always(x)


@workflow(name="audit_dl_pause_timeout_wf")
def pause_timeout_wf(x):  # type: ignore[no-untyped-def]
    return pause_timeout(x)


@workflow(name="audit_dl_child_signal")
def child_signal(x):  # type: ignore[no-untyped-def]
    return echo(wait_signal("audit_dl_child_go"))


@workflow(name="audit_dl_parent")
def parent_wf(x):  # type: ignore[no-untyped-def]
    return echo(child(child_signal, x))


@workflow(name="audit_dl_child_timer")
def child_timer(x):  # type: ignore[no-untyped-def]
    t = wait_timer(timedelta(hours=1))
    return echo(x, after=[t])


@workflow(name="audit_dl_parent_timer")
def parent_timer(x):  # type: ignore[no-untyped-def]
    return echo(child(child_timer, x))


@workflow(name="audit_dl_child_timeout")
def child_timeout(x):  # type: ignore[no-untyped-def]
    return timeout_always(x)


@workflow(name="audit_dl_parent_child_timeout")
def parent_child_timeout(x):  # type: ignore[no-untyped-def]
    return echo(child(child_timeout, x))


@workflow(name="audit_dl_fan_hang")
def fan_hang(n):  # type: ignore[no-untyped-def]
    return for_each(item_hang, over=items(n), max_parallel=2)


@workflow(name="audit_dl_fan_timeout")
def fan_timeout(n):  # type: ignore[no-untyped-def]
    return for_each(item_timeout, over=items(n))


@workflow(name="audit_dl_fan_children")
def fan_children(n):  # type: ignore[no-untyped-def]
    return for_each(child_signal, over=items(n))


@workflow(name="audit_dl_signal_short_wf")
def signal_short_wf(x):  # type: ignore[no-untyped-def]
    return echo(wait_signal("audit_dl_go", timeout=timedelta(seconds=0.3)))


@workflow(name="audit_dl_contained_timeout_wf")
def contained_timeout_wf(x):  # type: ignore[no-untyped-def]
    bad = timeout_always(x)
    echo(bad, on_dep_failure="cancel_branch", node_id="after_bad")
    return echo(x, node_id="good")


@workflow(name="audit_dl_fan_fail_once")
def fan_fail_once(n):  # type: ignore[no-untyped-def]
    return for_each(item_fail_once, over=items(n), max_parallel=2)


@workflow(name="audit_dl_timer_wf")
def timer_wf(x):  # type: ignore[no-untyped-def]
    t = wait_timer(timedelta(seconds=1))
    return echo(x, after=[t])


STEPS = (
    echo,
    hang,
    async_hang,
    timeout_always,
    timeout_once,
    async_swallow,
    fail_once,
    fail_always,
    pause_timeout,
    items,
    item_hang,
    item_timeout,
    item_fail_once,
    overrun,
)


def _all_steps_terminal(client: Client, run_id: int) -> bool:
    return all(
        s.state in (StepState.COMPLETED, StepState.DISCARDED, StepState.CANCELLED)
        for s in client.get_run(run_id).steps
    )


# -- deadlines -----------------------------------------------------------------------------


def test_deadline_stops_a_running_sync_handler(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    _reset("hang")
    start_worker(*STEPS)
    handle = client.submit(hang_wf, 1, deadline=timedelta(hours=1))
    wait_until(lambda: calls.get("hang") == 1, what="the handler to start")
    started = time.monotonic()
    clock(datetime.now(UTC) + timedelta(hours=2))  # the deadline passes while it runs
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=8)
    assert (failed.value.state, failed.value.error_kind) == ("failed", "deadline")
    wait_until(lambda: "hang" in seen_cancelled, timeout=20, what="the handler to return")
    assert seen_cancelled["hang"] is True
    assert time.monotonic() - started < 4
    run = handle.get()
    assert run.step("audit_dl_hang").state is StepState.CANCELLED
    assert run.step("audit_dl_hang").error_kind == "deadline"


def test_deadline_cancels_a_running_async_handler(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    _reset("async_hang")
    start_worker(*STEPS)
    handle = client.submit(async_hang_wf, 1, deadline=timedelta(hours=1))
    wait_until(lambda: calls.get("async_hang") == 1, what="the handler to start")
    clock(datetime.now(UTC) + timedelta(hours=2))  # the deadline passes while it runs
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=8)
    assert failed.value.error_kind == "deadline"
    wait_until(lambda: seen_cancelled.get("async_hang"), timeout=10, what="CancelledError")


def test_pause_stops_the_deadline_clock(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    worker = start_worker(*STEPS)
    handle = client.submit(signal_wf, 1, deadline=timedelta(hours=1))
    before = handle.get().deadline_at
    client.pause(handle.id)
    clock(datetime.now(UTC) + timedelta(hours=2))  # past the deadline as submitted
    scanner_passes(worker, 2)
    assert handle.get().state is RunState.PAUSED
    client.resume(handle.id)
    run = handle.get()
    assert run.state is RunState.RUNNING
    assert before is not None and run.deadline_at is not None
    # moved on by the pause, which lasted the 2 hours (less the moments before the pause)
    assert run.deadline_at - before >= timedelta(hours=1, minutes=59)
    client.signal(handle.id, "audit_dl_go", "ok")
    assert handle.result(timeout=8) == "ok"


def test_deadline_after_resume_still_fires(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    start_worker(*STEPS)
    now = datetime.now(UTC)
    handle = client.submit(signal_wf, 1, deadline=timedelta(hours=1))
    client.pause(handle.id)
    clock(now + timedelta(minutes=30))  # a pause of half an hour: the deadline moves on
    client.resume(handle.id)
    clock(now + timedelta(hours=2))  # past the moved deadline
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=8)
    assert failed.value.error_kind == "deadline"


def test_deadline_cancels_the_child_run(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(parent_wf, 1, deadline=timedelta(hours=1))
    kids = wait_until(lambda: client.children_of(handle.id), timeout=5, what="the child run")
    clock(datetime.now(UTC) + timedelta(hours=2))  # the deadline passes
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=8)
    assert failed.value.error_kind == "deadline"
    kid = client.handle(kids[0]["id"]).wait(timeout=5)
    assert kid.state is RunState.CANCELLED
    assert _all_steps_terminal(client, kid.id)


def test_deadline_cancels_a_child_run_paused_on_its_own(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(parent_wf, 1, deadline=timedelta(hours=1))
    kids = wait_until(lambda: client.children_of(handle.id), timeout=5, what="the child run")
    client.pause(kids[0]["id"])
    clock(datetime.now(UTC) + timedelta(hours=2))  # the parent's deadline passes
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=8)
    assert failed.value.error_kind == "deadline"
    kid = client.handle(kids[0]["id"]).wait(timeout=5)
    assert kid.state is RunState.CANCELLED
    assert _all_steps_terminal(client, kid.id)


def test_deadline_in_a_fan_out_ends_every_item(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    _reset("item_hang")
    start_worker(*STEPS)
    handle = client.submit(fan_hang, 5, deadline=timedelta(seconds=1))
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=8)
    assert failed.value.error_kind == "deadline"
    assert _all_steps_terminal(client, handle.id)
    time.sleep(0.5)
    assert calls.get("item_hang", 0) <= 2  # no item started after the deadline


def test_deadline_in_a_fan_out_over_workflows_cancels_children(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(fan_children, 3, deadline=timedelta(hours=1))
    wait_until(lambda: len(client.children_of(handle.id)) == 3, what="3 children")
    clock(datetime.now(UTC) + timedelta(hours=2))  # the deadline passes
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=8)
    assert failed.value.error_kind == "deadline"
    for kid in client.children_of(handle.id):
        assert client.handle(kid["id"]).wait(timeout=5).state is RunState.CANCELLED


def test_deadline_during_pause_resume_of_a_child_tree(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    """The parent pauses (and with it the child); the child's timer must not fire during
    the pause, and after resume the whole tree completes before the shifted deadline."""
    worker = start_worker(*STEPS)
    now = datetime.now(UTC)
    # The child's timer is due in 1 h, the deadline in 2 h.
    handle = client.submit(parent_timer, 7, deadline=timedelta(hours=2))
    kids = wait_until(lambda: client.children_of(handle.id), timeout=5, what="the child run")
    client.pause(handle.id)
    assert client.get_run(kids[0]["id"]).state is RunState.PAUSED
    clock(now + timedelta(hours=3))  # a pause of 3 h: past the timer and the deadline
    scanner_passes(worker, 2)
    assert client.get_run(kids[0]["id"]).step("timer").state is StepState.WAITING_TIMER
    assert handle.get().state is RunState.PAUSED
    client.resume(handle.id)  # the timer is now due at 4 h, the deadline at 5 h
    assert client.get_run(kids[0]["id"]).state is RunState.RUNNING
    clock(now + timedelta(hours=4, minutes=30))  # past the timer, not the deadline
    assert handle.result(timeout=8) == 7


def test_retry_of_a_run_failed_by_its_deadline_is_refused(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(signal_wf, 1, deadline=timedelta(seconds=0.5))
    with pytest.raises(RunFailed):
        handle.result(timeout=8)
    node = next(s.node for s in handle.get().steps if s.state is StepState.CANCELLED)
    with pytest.raises(InvalidTransition):
        client.retry(handle.id, node)
    with pytest.raises(InvalidTransition):
        client.retry(handle.id, node, force=True)


def test_deadline_during_retry_backoff_reports_deadline(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    _reset("fail_always")
    start_worker(*STEPS)
    handle = client.submit(fail_always_wf, 1, deadline=timedelta(seconds=1.5))
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)
    assert (failed.value.state, failed.value.error_kind) == ("failed", "deadline")


def test_submit_many_and_submit_once_apply_the_deadline(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    many = client.submit_many(signal_wf, [1, 2], deadline=timedelta(seconds=0.5))
    once = client.submit_once(signal_wf, 3, key="audit_dl_once", deadline=timedelta(seconds=0.5))
    for handle in [*many, once]:
        with pytest.raises(RunFailed) as failed:
            handle.result(timeout=8)
        assert failed.value.error_kind == "deadline"


# -- step timeouts -------------------------------------------------------------------------


def test_step_timeout_on_every_attempt_fails_with_timeout(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    _reset("timeout_always")
    start_worker(*STEPS)
    handle = client.submit(timeout_always_wf, 1)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)
    assert failed.value.error_kind == "timeout"
    assert failed.value.node == "audit_dl_timeout_always"
    s = handle.get().step("audit_dl_timeout_always")
    assert s.state is StepState.DISCARDED
    assert s.attempt == 2
    assert [a.outcome for a in s.attempts] == ["retried", "failed"]


def test_step_timeout_then_success_on_retry(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    _reset("timeout_once")
    start_worker(*STEPS)
    handle = client.submit(timeout_once_wf, 4)
    assert handle.result(timeout=10) == 40
    s = handle.get().step("audit_dl_timeout_once")
    assert s.state is StepState.COMPLETED
    assert s.error is None
    assert [a.error_kind for a in s.attempts] == ["timeout"]


def test_async_handler_swallowing_its_cancellation_still_times_out(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    _reset("async_swallow")
    start_worker(*STEPS)
    handle = client.submit(async_swallow_wf, 1)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=8)
    assert failed.value.error_kind == "timeout"


def test_step_timeout_while_paused_waits_for_resume(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    _reset("pause_timeout")
    worker = start_worker(*STEPS)
    handle = client.submit(pause_timeout_wf, 1)
    wait_until(lambda: calls.get("pause_timeout") == 1, what="the first attempt")
    client.pause(handle.id)
    wait_until(
        lambda: handle.get().step("audit_dl_pause_timeout").attempt == 1,
        timeout=10,
        what="the timeout",
    )
    assert handle.get().step("audit_dl_pause_timeout").state is StepState.PAUSED
    clock(datetime.now(UTC) + timedelta(minutes=1))  # past any backoff of a first retry
    scanner_passes(worker, 2)  # their due passes, and the worker's claims, find no retry
    assert handle.get().step("audit_dl_pause_timeout").state is StepState.PAUSED
    assert calls["pause_timeout"] == 1  # no retry while paused
    client.resume(handle.id)
    assert handle.result(timeout=8) == 101


def test_step_timeout_in_a_child_run_fails_the_parent_node(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    _reset("timeout_always")
    start_worker(*STEPS)
    handle = client.submit(parent_child_timeout, 1)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)
    assert failed.value.state == "failed"
    assert failed.value.error_kind == "child_failed"
    kid = client.children_of(handle.id)[0]
    assert kid["state"] == "failed"
    with pytest.raises(RunFailed) as kid_failed:
        client.result(kid["id"], timeout=1)
    assert kid_failed.value.error_kind == "timeout"


def test_step_timeout_of_a_fan_out_item_fails_the_fan_out(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(fan_timeout, 3)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=8)
    assert failed.value.state == "failed"
    assert "timeout" in (failed.value.error or "")
    run = handle.get()
    assert run.step("audit_dl_item_timeout[1]").error_kind == "timeout"
    assert _all_steps_terminal(client, handle.id)
    # The run is found by the error kind of the item that failed it.
    from cyclone_dsl import RunFilter

    found = client.retry_many(
        RunFilter(workflows="audit_dl_fan_timeout", error_kinds="timeout"), dry_run=True
    )
    assert found.matched >= 1


def test_enqueue_timeout_applies(client: Client, start_worker: Callable[..., Worker]) -> None:
    _reset("hang")
    start_worker(*STEPS)
    handle = client.enqueue(hang, 1, timeout=timedelta(seconds=0.3))
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=8)
    assert failed.value.error_kind == "timeout"


# -- retries and backoff with pause / cancel ----------------------------------------------


def test_pause_during_backoff_then_resume_completes(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    _reset("fail_once")
    fail_once_gate.clear()
    first = start_worker(*STEPS)
    handle = client.submit(fail_once_wf, 1)
    wait_until(lambda: calls.get("fail_once") == 1, what="the first attempt")
    # The first attempt is held; its worker stops claiming, then records its failure (the
    # retry waits out its backoff) and stops: no worker can claim the retry before the pause.
    first.request_stop()
    fail_once_gate.set()
    first.stop()
    assert handle.get().step("audit_dl_fail_once").attempt == 1
    now = datetime.now(UTC)
    clock(now - timedelta(hours=1))  # the pause lands well inside the backoff
    client.pause(handle.id)
    assert handle.get().step("audit_dl_fail_once").state is StepState.PAUSED
    clock(now + timedelta(minutes=1))  # past the backoff
    second = start_worker(*STEPS)
    scanner_passes(second, 2)  # their due passes, and the worker's claims, find no retry
    assert handle.get().step("audit_dl_fail_once").state is StepState.PAUSED
    assert calls["fail_once"] == 1
    client.resume(handle.id)
    assert handle.result(timeout=8) == 2


def test_cancel_during_backoff(client: Client, start_worker: Callable[..., Worker]) -> None:
    _reset("fail_always")
    start_worker(*STEPS)
    handle = client.submit(fail_always_wf, 1)
    wait_until(
        lambda: handle.get().step("audit_dl_fail_always").attempt >= 1,
        timeout=5,
        what="1 failure",
    )
    client.cancel(handle.id)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=5)
    assert (failed.value.state, failed.value.error_kind) == ("cancelled", "cancelled")
    n = calls["fail_always"]
    time.sleep(1.5)
    assert calls["fail_always"] == n


def test_cancel_while_paused_past_the_deadline(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    worker = start_worker(*STEPS)
    handle = client.submit(signal_wf, 1, deadline=timedelta(hours=1))
    client.pause(handle.id)
    clock(datetime.now(UTC) + timedelta(hours=2))  # past the deadline as submitted
    scanner_passes(worker, 2)
    client.cancel(handle.id)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=5)
    assert (failed.value.state, failed.value.error_kind) == ("cancelled", "cancelled")


# -- wait timeouts -------------------------------------------------------------------------


def test_signal_timeout_stands_still_while_paused(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(signal_timeout_wf, 1)
    wait_until(
        lambda: handle.get().step("audit_dl_go").state is StepState.WAITING_SIGNAL,
        timeout=5,
        what="the wait",
    )
    client.pause(handle.id)
    time.sleep(1.5)
    assert handle.get().step("audit_dl_go").state is StepState.WAITING_SIGNAL
    client.resume(handle.id)
    client.signal(handle.id, "audit_dl_go", "in time")
    assert handle.result(timeout=5) == "in time"


def test_signal_timeout_fires_after_resume(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(signal_timeout_wf, 1)
    client.pause(handle.id)
    time.sleep(0.3)
    client.resume(handle.id)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=8)
    assert failed.value.error_kind == "signal_timeout"


def test_wait_n_timeout_after_partial_quorum(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(wait_n_timeout_wf, 1)
    client.signal(handle.id, "audit_dl_vote", 1)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=8)
    assert failed.value.error_kind == "signal_timeout"


def test_retry_of_a_timed_out_wait_waits_again(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(signal_timeout_wf, 1)
    with pytest.raises(RunFailed):
        handle.result(timeout=8)
    client.retry(handle.id, "audit_dl_go")
    client.signal(handle.id, "audit_dl_go", "second")
    assert handle.result(timeout=8) == "second"


def test_timer_in_paused_run_does_not_fire_then_fires(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(timer_wf, 5)
    client.pause(handle.id)
    time.sleep(1.5)
    assert handle.get().step("timer").state is StepState.WAITING_TIMER
    client.resume(handle.id)
    assert handle.result(timeout=8) == 5


# -- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "deadline",
    [
        timedelta(0),
        timedelta(seconds=-1),
        1.5,
        "1h",
        True,
        timedelta(days=400_000),
        timedelta.max,
    ],
    ids=["zero", "negative", "float", "str", "bool", "past-max", "timedelta-max"],
)
def test_bad_deadline_is_refused_with_invalid_argument(client: Client, deadline: Any) -> None:
    with pytest.raises(InvalidArgument):
        client.submit(signal_wf, 1, deadline=deadline)
    with pytest.raises(InvalidArgument):
        client.submit_many(signal_wf, [1], deadline=deadline)
    with pytest.raises(InvalidArgument):
        client.submit_once(signal_wf, 1, key="audit_dl_bad", deadline=deadline)


def _define_with_step_timeout(timeout: Any) -> None:
    @step(name=f"audit_dl_bad_timeout_step_{next(_serial)}", timeout=timeout)
    def bad(x: int) -> int:
        return x

    @workflow(name=f"audit_dl_bad_timeout_wf_{next(_serial)}")
    def bad_wf(x):  # type: ignore[no-untyped-def]
        return bad(x)

    bad_wf.graph  # noqa: B018


@pytest.mark.parametrize(
    "timeout",
    [0, -1, math.nan, math.inf, 1e30, "5", True, timedelta(0), timedelta(seconds=-3), 1e-9],
    ids=["zero", "neg", "nan", "inf", "huge", "str", "bool", "td0", "tdneg", "tiny"],
)
def test_bad_step_timeout_is_a_typed_error(timeout: Any) -> None:
    with pytest.raises(CycloneError):
        _define_with_step_timeout(timeout)


@pytest.mark.parametrize(
    "timeout",
    [0, -1, math.nan, math.inf, 1e30, "5", True, timedelta(0), 1e-9],
    ids=["zero", "neg", "nan", "inf", "huge", "str", "bool", "td0", "tiny"],
)
def test_bad_enqueue_timeout_is_a_typed_error(client: Client, timeout: Any) -> None:
    with pytest.raises(CycloneError):
        client.enqueue(echo, 1, timeout=timeout)


@pytest.mark.parametrize(
    "value",
    [0, -1, math.nan, math.inf, 1e30, "5", True, timedelta(0), 1e-9],
    ids=["zero", "neg", "nan", "inf", "huge", "str", "bool", "td0", "tiny"],
)
def test_bad_wait_durations_are_invalid_graph(value: Any) -> None:
    @workflow(name=f"audit_dl_bad_timer_wf_{next(_serial)}")
    def bad_timer(x):  # type: ignore[no-untyped-def]
        t = wait_timer(value)
        return echo(x, after=[t])

    @workflow(name=f"audit_dl_bad_signal_timeout_wf_{next(_serial)}")
    def bad_signal(x):  # type: ignore[no-untyped-def]
        return echo(wait_signal("audit_dl_x", timeout=value))

    @workflow(name=f"audit_dl_bad_wait_n_timeout_wf_{next(_serial)}")
    def bad_wait_n(x):  # type: ignore[no-untyped-def]
        return echo(wait_n("audit_dl_x", 2, timeout=value))

    for wf in (bad_timer, bad_signal, bad_wait_n):
        with pytest.raises(InvalidGraph):
            wf.graph  # noqa: B018


@pytest.mark.parametrize("timeout", [-1, math.nan, "x", True], ids=["neg", "nan", "str", "bool"])
def test_bad_result_timeout_is_invalid_argument(client: Client, timeout: Any) -> None:
    handle = client.submit(signal_wf, 1)
    with pytest.raises(InvalidArgument):
        handle.result(timeout=timeout)
    with pytest.raises(InvalidArgument):
        handle.wait(timeout=timeout)
    client.cancel(handle.id)


def test_step_timeout_option_at_call_site_is_checked() -> None:
    @workflow(name=f"audit_dl_bad_call_timeout_wf_{next(_serial)}")
    def bad_call(x):  # type: ignore[no-untyped-def]
        return echo(x, timeout=-5)

    with pytest.raises(InvalidGraph):
        bad_call.graph  # noqa: B018


_ = define_result  # imported for completeness of the public surface


# -- deadlines across operator retry and replay --------------------------------------------


def test_deadline_still_applies_after_an_operator_retry(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(signal_short_wf, 1, deadline=timedelta(seconds=2))
    with pytest.raises(RunFailed) as first:
        handle.result(timeout=8)
    assert first.value.error_kind == "signal_timeout"
    client.retry(handle.id, "audit_dl_go")
    # The retried wait has a fresh 0.3 s timeout; let it time out again, then retry
    # again, until the deadline ends the run.
    started = time.monotonic()
    while True:
        with pytest.raises(RunFailed) as again:
            handle.result(timeout=8)
        if again.value.error_kind == "deadline":
            break
        assert again.value.error_kind == "signal_timeout"
        assert time.monotonic() - started < 6
        try:
            client.retry(handle.id, "audit_dl_go")
        except InvalidTransition:
            # Past the deadline: the retry is refused, and the run keeps its failure.
            assert handle.get().deadline_at is not None
            break


def test_replay_of_a_completed_run_keeps_its_deadline(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(signal_wf, 1, deadline=timedelta(seconds=1.5))
    client.signal(handle.id, "audit_dl_go", "first")
    assert handle.result(timeout=5) == "first"
    client.retry(handle.id, "audit_dl_go", force=True)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=8)
    assert failed.value.error_kind == "deadline"


def test_step_timeout_contained_by_cancel_branch(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    _reset("timeout_always")
    start_worker(*STEPS)
    handle = client.submit(contained_timeout_wf, 3)
    assert handle.result(timeout=10) == 3
    run = handle.get()
    assert run.state is RunState.COMPLETED
    assert run.step("audit_dl_timeout_always").error_kind == "timeout"
    assert run.step("after_bad").state is StepState.CANCELLED


def test_child_of_a_deadline_failed_parent_reports_cancelled(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(parent_wf, 1, deadline=timedelta(hours=1))
    kids = wait_until(lambda: client.children_of(handle.id), timeout=5, what="the child run")
    clock(datetime.now(UTC) + timedelta(hours=2))  # the deadline passes
    with pytest.raises(RunFailed):
        handle.result(timeout=8)
    with pytest.raises(RunFailed) as kid:
        client.result(kids[0]["id"], timeout=5)
    assert (kid.value.state, kid.value.error_kind) == ("cancelled", "cancelled")
    # A signal to the cancelled child run is refused with a typed error.
    with pytest.raises(CycloneError):
        client.signal(kids[0]["id"], "audit_dl_child_go", 1)


def test_fan_out_items_in_backoff_survive_pause_and_resume(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    _reset(*(f"item_fail_once_{i}" for i in range(4)))
    start_worker(*STEPS)
    handle = client.submit(fan_fail_once, 4)
    wait_until(
        lambda: any(s.item_of is not None and s.attempt >= 1 for s in handle.get().steps),
        timeout=5,
        what="an item failure",
    )
    client.pause(handle.id)
    time.sleep(1.2)
    client.resume(handle.id)
    assert handle.result(timeout=10) == [0, 2, 4, 6]


def test_sync_result_returned_past_the_timeout_is_not_a_success(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A sync handler returns 20 ms after its timeout: the docs say the step fails with
    timeout and the handler's result is ignored. Several at once, so the worker's
    0.1 s timeout check cannot catch each of them by luck."""
    start_worker(*STEPS, concurrency=8)
    handles = [client.enqueue(overrun, i) for i in range(6)]
    outcomes = []
    for h in handles:
        try:
            outcomes.append(("completed", h.result(timeout=8)))
        except RunFailed as exc:
            outcomes.append((exc.state, exc.error_kind))
    assert all(o == ("failed", "timeout") for o in outcomes), outcomes
