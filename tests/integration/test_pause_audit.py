"""Audit: pause and resume meeting the rest of the engine (docs/concepts/waits.md,
runs-and-steps.md, flow-control.md, fan-out-and-children.md).

Tests marked ``xfail(strict=True)`` show a finding: they fail today and pass once fixed.
The others pin behaviour that is already right.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import pytest

from cyclone_dsl import (
    AlreadyTerminal,
    AsyncClient,
    Client,
    Concurrency,
    Delivery,
    InvalidTransition,
    MailboxFull,
    Registry,
    RunFailed,
    RunFilter,
    RunNotFound,
    RunState,
    StepContext,
    StepState,
    Worker,
    child,
    for_each,
    step,
    wait_n,
    wait_signal,
    wait_timer,
    workflow,
)
from cyclone_dsl.testing import set_clock_shift
from tests.waiting import PROMPT, expire_leases_until, scanner_passes, seconds_until, wait_until

# -- handler controls -------------------------------------------------------------------------

GATES: dict[str, threading.Event] = {}
CALLS: Counter[str] = Counter()
CALLS_LOCK = threading.Lock()


def gate(name: str) -> threading.Event:
    return GATES.setdefault(name, threading.Event())


def called(name: str) -> None:
    with CALLS_LOCK:
        CALLS[name] += 1


@pytest.fixture(autouse=True)
def _fresh_gates(start_worker: Callable[..., Worker]) -> Iterator[None]:
    """Set up after start_worker, so torn down before it: blocked handlers are released
    before the workers stop (and the clock shift is back to zero)."""
    GATES.clear()
    CALLS.clear()
    yield
    set_clock_shift(timedelta(0))
    for event in list(GATES.values()):
        event.set()


# -- steps ------------------------------------------------------------------------------------


@step(name="pa_echo")
def echo(value: object) -> object:
    called("pa_echo")
    return value


@step(name="pa_hold")
def hold(value: object) -> object:
    called("pa_hold")
    gate("hold").wait(10)
    return value


@step(name="pa_list")
def make_list(n: int) -> list[int]:
    return list(range(n))


@step(name="pa_item")
def item(x: int) -> int:
    called(f"pa_item[{x}]")
    if x < 2:
        gate("items").wait(10)
    return x * 10


@step(name="pa_kid_step")
def kid_step(x: int) -> int:
    called(f"pa_kid_step[{x}]")
    if x < 2:
        gate("kids").wait(10)
    return x + 100


@step(name="pa_fail_hold", max_attempts=1)
def fail_hold(value: object) -> object:
    called("pa_fail_hold")
    gate("fail").wait(10)
    raise RuntimeError("pa boom")


@step(name="pa_fail_then_ok", max_attempts=3)
def fail_then_ok(value: int, ctx: StepContext) -> int:
    called("pa_fail_then_ok")
    if ctx.attempt == 1:
        gate("fail_once").wait(10)
        raise RuntimeError("pa first attempt fails")
    return value + 1


@step(name="pa_reclaimed")
def reclaimed_step(value: int) -> int:
    called("pa_reclaimed")
    with CALLS_LOCK:
        first = CALLS["pa_reclaimed"] == 1
    if first:
        gate("reclaim").wait(10)
    return value * 3


@step(name="pa_slow_timeout", timeout=2.0, max_attempts=1)
def slow_timeout(value: int, ctx: StepContext) -> int:
    called("pa_slow_timeout")
    gate("slow_timeout_started").set()
    ctx.wait_cancelled(5)
    return value


@step(name="pa_seq")
def seq_step(value: str) -> str:
    called(f"pa_seq:{value}")
    return value


@step(name="pa_limited", concurrency=Concurrency(limit=1))
def limited(value: str) -> str:
    called(f"pa_limited:{value}")
    if value == "first":
        gate("limited").wait(10)
    return value


@step(name="pa_run_limited_step")
def run_limited_step(value: str) -> str:
    called(f"pa_run_limited:{value}")
    if value == "first":
        gate("run_limited").wait(10)
    return value


# -- workflows --------------------------------------------------------------------------------


@workflow(name="pa_chain")
def chain(x):  # type: ignore[no-untyped-def]
    return echo(hold(x))


@workflow(name="pa_single")
def single(x):  # type: ignore[no-untyped-def]
    return hold(x)


@workflow(name="pa_fan_steps")
def fan_steps(n):  # type: ignore[no-untyped-def]
    return for_each(item, over=make_list(n), max_parallel=2)


@workflow(name="pa_kid")
def kid(x):  # type: ignore[no-untyped-def]
    return kid_step(x)


@workflow(name="pa_fan_kids")
def fan_kids(n):  # type: ignore[no-untyped-def]
    return for_each(kid, over=make_list(n), max_parallel=2)


@workflow(name="pa_parent")
def parent(x):  # type: ignore[no-untyped-def]
    return echo(child(kid, x))


@workflow(name="pa_grandparent")
def grandparent(x):  # type: ignore[no-untyped-def]
    return echo(child(parent, x))


@workflow(name="pa_votes")
def votes(x):  # type: ignore[no-untyped-def]
    return echo(wait_n("pa_vote", 3, timeout=timedelta(hours=1)))


@workflow(name="pa_late_wait")
def late_wait(x):  # type: ignore[no-untyped-def]
    first = hold(x)
    return echo(wait_signal("pa_go", after=[first]))


@workflow(name="pa_timer")
def timer_wf(x):  # type: ignore[no-untyped-def]
    t = wait_timer(timedelta(hours=1))
    return echo(x, after=[t])


@workflow(name="pa_sig_timeout")
def sig_timeout(x):  # type: ignore[no-untyped-def]
    return echo(wait_signal("pa_ok", timeout=timedelta(hours=1)))


@workflow(name="pa_fail_wf")
def fail_wf(x):  # type: ignore[no-untyped-def]
    return echo(fail_hold(x))


@workflow(name="pa_retry_wf")
def retry_wf(x):  # type: ignore[no-untyped-def]
    return echo(fail_then_ok(x))


@workflow(name="pa_timeout_wf")
def timeout_wf(x):  # type: ignore[no-untyped-def]
    return echo(slow_timeout(x))


@workflow(name="pa_one_at_a_time", concurrency=Concurrency(limit=1))
def one_at_a_time(x):  # type: ignore[no-untyped-def]
    return run_limited_step(x)


@workflow(name="pa_fan_parent")
def fan_parent(n):  # type: ignore[no-untyped-def]
    return echo(child(fan_steps, n))


ALL_STEPS = (
    echo,
    hold,
    make_list,
    item,
    kid_step,
    fail_hold,
    fail_then_ok,
    reclaimed_step,
    slow_timeout,
    seq_step,
    limited,
    run_limited_step,
)
ALL_WORKFLOWS = (chain, single, fan_steps, kid, fan_kids, parent, grandparent)


def state_of(client: Client, run_id: int) -> RunState:
    return client.get_run(run_id).state


def items_of(client: Client, run_id: int, node: str) -> list:  # type: ignore[type-arg]
    run = client.get_run(run_id)
    return sorted((s for s in run.steps if s.item_of == node), key=lambda s: s.item_index or 0)


# -- typed errors -----------------------------------------------------------------------------


def test_pause_twice_resume_twice_and_ended_runs_raise_typed_errors(client: Client) -> None:
    handle = client.submit(chain, 1)  # no worker: nothing moves
    with pytest.raises(InvalidTransition):
        client.resume(handle.id)  # not paused
    client.pause(handle.id)
    run = handle.get()
    assert run.state is RunState.PAUSED and run.paused_at is not None
    assert run.step("pa_hold").state is StepState.PAUSED
    assert run.step("pa_echo").state is StepState.PAUSED
    with pytest.raises(InvalidTransition):
        client.pause(handle.id)
    client.resume(handle.id)
    run = handle.get()
    assert run.state is RunState.RUNNING and run.paused_at is None
    assert run.step("pa_hold").state is StepState.AVAILABLE
    assert run.step("pa_echo").state is StepState.PENDING
    with pytest.raises(InvalidTransition):
        client.resume(handle.id)
    client.cancel(handle.id)
    with pytest.raises(AlreadyTerminal):
        client.pause(handle.id)
    with pytest.raises(AlreadyTerminal):
        client.resume(handle.id)
    with pytest.raises(RunNotFound):
        client.pause(2**62)
    with pytest.raises(RunNotFound):
        client.resume(2**62)


def test_async_client_pause_and_resume(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL_STEPS)

    async def scenario() -> tuple[object, RunState, RunState]:
        async with AsyncClient(cyclone_dsn) as aclient:
            handle = await aclient.submit(chain, 7)
            await aclient.pause(handle.id)
            with pytest.raises(InvalidTransition):
                await aclient.pause(handle.id)
            paused = (await aclient.get_run(handle.id)).state
            await asyncio.sleep(0.5)  # a worker is up: nothing of a paused run is claimed
            still = (await aclient.get_run(handle.id)).state
            await aclient.resume(handle.id)
            with pytest.raises(InvalidTransition):  # before the run can end: pa_hold holds
                await aclient.resume(handle.id)
            gate("hold").set()
            result = await handle.result(timeout=10)
            with pytest.raises(AlreadyTerminal):
                await aclient.pause(handle.id)
            with pytest.raises(AlreadyTerminal):
                await aclient.resume(handle.id)
            return result, paused, still

    result, paused, still = asyncio.run(scenario())
    assert result == 7
    assert paused is RunState.PAUSED and still is RunState.PAUSED
    assert CALLS["pa_hold"] == 1


# -- running steps finishing inside the pause -------------------------------------------------


def test_a_running_step_that_completes_while_paused_starts_nothing_downstream(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL_STEPS)
    handle = client.submit(chain, 3)
    wait_until(lambda: handle.get().step("pa_hold").state is StepState.RUNNING, what="pa_hold runs")
    client.pause(handle.id)
    gate("hold").set()
    wait_until(
        lambda: handle.get().step("pa_hold").state is StepState.COMPLETED,
        what="pa_hold to complete inside the pause",
    )
    time.sleep(0.4)
    run = handle.get()
    assert run.state is RunState.PAUSED
    assert run.step("pa_echo").state is StepState.PAUSED
    assert CALLS["pa_echo"] == 0
    client.resume(handle.id)
    assert handle.result(timeout=10) == 3


def test_the_last_step_completing_while_paused_completes_the_run(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL_STEPS)
    handle = client.submit(single, 4)
    wait_until(lambda: handle.get().step("pa_hold").state is StepState.RUNNING, what="pa_hold runs")
    client.pause(handle.id)
    gate("hold").set()
    run = handle.wait(timeout=10)
    assert run.state is RunState.COMPLETED
    assert run.paused_at is not None  # a run that ends while paused keeps its paused_at
    assert handle.result(timeout=1) == 4


def test_a_running_step_failing_for_good_while_paused_fails_the_run(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL_STEPS)
    handle = client.submit(fail_wf, 1)
    wait_until(
        lambda: handle.get().step("pa_fail_hold").state is StepState.RUNNING,
        what="pa_fail_hold runs",
    )
    client.pause(handle.id)
    gate("fail").set()
    with pytest.raises(RunFailed):
        handle.result(timeout=10)
    run = handle.get()
    assert run.state is RunState.FAILED and run.paused_at is not None
    assert run.step("pa_fail_hold").state is StepState.DISCARDED
    assert run.step("pa_echo").state is StepState.CANCELLED
    assert CALLS["pa_echo"] == 0


def test_a_step_failing_with_attempts_left_while_paused_waits_for_the_resume(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL_STEPS)
    handle = client.submit(retry_wf, 1)
    wait_until(
        lambda: handle.get().step("pa_fail_then_ok").state is StepState.RUNNING,
        what="pa_fail_then_ok runs",
    )
    client.pause(handle.id)
    gate("fail_once").set()
    wait_until(
        lambda: handle.get().step("pa_fail_then_ok").attempt == 1,
        what="the first attempt to fail",
    )
    time.sleep(1.5)  # past any first backoff (at most 1 s): no retry inside the pause
    run = handle.get()
    assert run.state is RunState.PAUSED
    assert run.step("pa_fail_then_ok").state is StepState.PAUSED
    assert CALLS["pa_fail_then_ok"] == 1
    client.resume(handle.id)
    assert handle.result(timeout=10) == 2
    assert CALLS["pa_fail_then_ok"] == 2


def test_a_retry_backoff_that_passed_during_the_pause_runs_at_once_on_resume(
    client: Client,
    cyclone_dsn: str,
    clock: Callable[[datetime], None],
    start_worker: Callable[..., Worker],
) -> None:
    worker = start_worker(*ALL_STEPS)
    handle = client.enqueue(fail_then_ok, 5)
    wait_until(
        lambda: handle.get().step("pa_fail_then_ok").state is StepState.RUNNING,
        what="pa_fail_then_ok runs",
    )
    client.pause(handle.id)
    gate("fail_once").set()  # the first attempt fails inside the pause: its retry backs off
    wait_until(
        lambda: handle.get().step("pa_fail_then_ok").attempt == 1,
        what="the first attempt to fail",
    )
    backoff_ends = handle.get().step("pa_fail_then_ok").scheduled_at
    clock(datetime.now(UTC) + timedelta(hours=1))  # the backoff passes inside the pause
    assert seconds_until(cyclone_dsn, backoff_ends) < 0
    scanner_passes(worker)  # and a poll or more: nothing of the paused run is claimed
    assert handle.get().step("pa_fail_then_ok").state is StepState.PAUSED
    assert CALLS["pa_fail_then_ok"] == 1
    client.resume(handle.id)
    # Due at once: its start is not moved by the pause (an hour) nor a backoff served again.
    assert seconds_until(cyclone_dsn, handle.get().step("pa_fail_then_ok").scheduled_at) <= 0
    assert handle.result(timeout=PROMPT) == 6
    assert CALLS["pa_fail_then_ok"] == 2


def test_a_step_timeout_runs_across_the_pause(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL_STEPS)
    handle = client.submit(timeout_wf, 1)
    assert gate("slow_timeout_started").wait(PROMPT), "pa_slow_timeout did not start"
    client.pause(handle.id)  # its 2 s timeout started before: it runs on inside the pause
    with pytest.raises(RunFailed):
        handle.result(timeout=10)
    run = handle.get()
    assert run.state is RunState.FAILED
    assert run.step("pa_slow_timeout").error_kind == "timeout"
    assert CALLS["pa_echo"] == 0


def test_a_lease_that_expires_while_paused_is_reclaimed_into_the_pause(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL_STEPS, lease=30.0)  # heartbeats every 10 s
    handle = client.enqueue(reclaimed_step, 2)
    wait_until(
        lambda: handle.get().step("pa_reclaimed").state is StepState.RUNNING,
        what="pa_reclaimed runs",
    )
    client.pause(handle.id)
    expire_leases_until(lambda: handle.get().step("pa_reclaimed").reclaims == 1, what="the reclaim")
    assert handle.get().step("pa_reclaimed").state is StepState.PAUSED
    gate("reclaim").set()  # the first execution's completion is fenced
    time.sleep(0.5)
    run = handle.get()
    assert run.state is RunState.PAUSED
    assert run.step("pa_reclaimed").state is StepState.PAUSED
    client.resume(handle.id)
    assert handle.result(timeout=10) == 6
    assert CALLS["pa_reclaimed"] == 2


# -- fan-out ----------------------------------------------------------------------------------


def test_pause_inside_a_fan_out_of_steps_holds_the_next_items(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL_STEPS)
    handle = client.submit(fan_steps, 6)
    wait_until(
        lambda: (
            [s.state for s in items_of(client, handle.id, "pa_item")][:2]
            == [StepState.RUNNING, StepState.RUNNING]
        ),
        what="the first two items to run",
    )
    client.pause(handle.id)
    gate("items").set()
    wait_until(
        lambda: (
            [s.state for s in items_of(client, handle.id, "pa_item")][:2]
            == [StepState.COMPLETED, StepState.COMPLETED]
        ),
        what="the running items to complete inside the pause",
    )
    time.sleep(0.4)
    states = [s.state for s in items_of(client, handle.id, "pa_item")]
    assert states[2:] == [StepState.PAUSED] * 4
    assert handle.get().step("pa_item").state is StepState.PAUSED
    assert not any(CALLS[f"pa_item[{i}]"] for i in range(2, 6))
    client.resume(handle.id)
    assert handle.result(timeout=10) == [0, 10, 20, 30, 40, 50]
    assert all(CALLS[f"pa_item[{i}]"] == 1 for i in range(6))


def test_a_fan_out_paused_before_it_expanded_expands_after_the_resume(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Paused before its list's step ran, the fan-out had no items yet: the resume must
    not take it for one whose items all ended (it completed with [] and no item ran)."""
    gate("items").set()
    handle = client.submit(fan_steps, 4)
    client.pause(handle.id)
    client.resume(handle.id)
    assert handle.get().step("pa_item").state is StepState.PENDING
    start_worker(*ALL_STEPS)
    assert handle.result(timeout=15) == [0, 10, 20, 30]
    assert all(CALLS[f"pa_item[{i}]"] == 1 for i in range(4))


def test_a_child_runs_fan_out_paused_with_its_parent_expands_after_the_resume(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """The same one level down: pausing the parent pauses its child run, whose fan-out
    has not expanded; resuming the parent resumes the child run's fan-out intact."""
    gate("items").set()
    handle = client.submit(fan_parent, 3)
    client.pause(handle.id)
    client.resume(handle.id)
    start_worker(*ALL_STEPS, *ALL_WORKFLOWS, fan_parent)
    assert handle.result(timeout=15) == [0, 10, 20]


def test_pause_inside_a_fan_out_of_child_runs_pauses_them_and_holds_the_next(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL_STEPS, *ALL_WORKFLOWS)
    handle = client.submit(fan_kids, 5)
    wait_until(
        lambda: CALLS["pa_kid_step[0]"] and CALLS["pa_kid_step[1]"],
        what="the first two child runs to run their step",
    )
    client.pause(handle.id)
    kids = client.children_of(handle.id)
    assert len(kids) == 2
    assert all(state_of(client, k["id"]) is RunState.PAUSED for k in kids)
    gate("kids").set()
    wait_until(
        lambda: all(state_of(client, k["id"]) is RunState.COMPLETED for k in kids),
        what="the two child runs to complete inside the pause",
    )
    time.sleep(0.4)
    assert len(client.children_of(handle.id)) == 2, "a child run started inside the pause"
    assert handle.get().state is RunState.PAUSED
    client.resume(handle.id)
    assert handle.result(timeout=15) == [100, 101, 102, 103, 104]
    assert len(client.children_of(handle.id)) == 5


def test_a_child_resumed_alone_completes_and_the_parent_waits_for_its_own_resume(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL_STEPS, *ALL_WORKFLOWS)
    handle = client.submit(parent, 0)  # 0: the child's step blocks
    (kid_row,) = wait_until(lambda: client.children_of(handle.id), what="the child run")
    wait_until(lambda: CALLS["pa_kid_step[0]"], what="the child's step to run")
    client.pause(handle.id)
    assert state_of(client, kid_row["id"]) is RunState.PAUSED
    client.resume(kid_row["id"])  # the child alone
    assert handle.get().state is RunState.PAUSED
    gate("kids").set()
    assert client.handle(kid_row["id"]).result(timeout=10) == 100
    time.sleep(0.4)
    run = handle.get()
    assert run.state is RunState.PAUSED
    assert run.step("pa_echo").state is StepState.PAUSED
    client.resume(handle.id)
    assert handle.result(timeout=10) == 100


def test_pause_and_resume_reach_a_grandchild(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    handle = client.submit(grandparent, 0)  # 0: the grandchild's step blocks
    (kid_row,) = client.children_of(handle.id)
    (grand_row,) = client.children_of(kid_row["id"])
    client.pause(handle.id)
    assert state_of(client, kid_row["id"]) is RunState.PAUSED
    assert state_of(client, grand_row["id"]) is RunState.PAUSED
    start_worker(*ALL_STEPS, *ALL_WORKFLOWS)
    time.sleep(0.5)
    assert CALLS["pa_kid_step[0]"] == 0
    client.resume(handle.id)
    assert state_of(client, grand_row["id"]) is RunState.RUNNING
    gate("kids").set()
    assert handle.result(timeout=10) == 100


def test_pause_then_cancel_ends_the_tree_and_fences_the_running_step(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL_STEPS, *ALL_WORKFLOWS)
    handle = client.submit(parent, 0)
    (kid_row,) = wait_until(lambda: client.children_of(handle.id), what="the child run")
    wait_until(lambda: CALLS["pa_kid_step[0]"], what="the child's step to run")
    client.pause(handle.id)
    client.cancel(handle.id)
    gate("kids").set()
    run = handle.wait(timeout=10)
    assert run.state is RunState.CANCELLED
    kid_run = client.handle(kid_row["id"]).wait(timeout=10)
    assert kid_run.state is RunState.CANCELLED
    time.sleep(0.4)
    assert client.get_run(kid_row["id"]).step("pa_kid_step").state is StepState.CANCELLED
    assert all(s.state is StepState.CANCELLED for s in client.get_run(handle.id).steps)


# -- waits ------------------------------------------------------------------------------------


def test_a_partial_quorum_keeps_its_votes_and_its_timeout_stops_during_the_pause(
    client: Client, clock: Callable[[datetime], None], start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker(*ALL_STEPS)
    handle = client.submit(votes, 0)
    due = handle.get().step("pa_vote").scheduled_at
    assert client.signal(handle.id, "pa_vote", "a") is Delivery.CONSUMED
    client.pause(handle.id)
    clock(datetime.now(UTC) + timedelta(hours=2))  # the 1 h timeout would have passed
    assert client.signal(handle.id, "pa_vote", "b") is Delivery.CONSUMED
    scanner_passes(worker)  # it stands still
    run = handle.get()
    assert run.state is RunState.PAUSED
    assert run.step("pa_vote").state is StepState.WAITING_SIGNAL
    client.resume(handle.id)
    moved = handle.get().step("pa_vote").scheduled_at
    assert timedelta(hours=2) <= moved - due < timedelta(hours=2, minutes=1)  # by the pause
    assert client.signal(handle.id, "pa_vote", "c") is Delivery.CONSUMED
    assert handle.result(timeout=10) == ["a", "b", "c"]


def test_signals_buffered_for_a_paused_wait_are_consumed_on_resume(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL_STEPS)
    handle = client.submit(late_wait, 0)
    wait_until(lambda: handle.get().step("pa_hold").state is StepState.RUNNING, what="pa_hold runs")
    client.pause(handle.id)
    assert client.signal(handle.id, "pa_go", "first") is Delivery.BUFFERED
    with pytest.raises(MailboxFull):
        client.signal(handle.id, "pa_go", "second")
    gate("hold").set()
    wait_until(
        lambda: handle.get().step("pa_hold").state is StepState.COMPLETED,
        what="pa_hold to complete inside the pause",
    )
    assert handle.get().step("pa_go").state is StepState.PAUSED
    client.resume(handle.id)
    assert handle.result(timeout=10) == "first"


def test_a_timer_does_not_fire_while_paused_and_is_moved_by_the_pause(
    client: Client, clock: Callable[[datetime], None], start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker(*ALL_STEPS)
    handle = client.submit(timer_wf, 9)
    due = handle.get().step("timer").scheduled_at
    client.pause(handle.id)
    clock(datetime.now(UTC) + timedelta(hours=2))  # the 1 h timer would be due
    scanner_passes(worker)
    run = handle.get()
    assert run.step("timer").state is StepState.WAITING_TIMER
    assert run.state is RunState.PAUSED
    client.resume(handle.id)
    moved = handle.get().step("timer").scheduled_at
    assert timedelta(hours=2) <= moved - due < timedelta(hours=2, minutes=1)  # by the pause
    scanner_passes(worker)  # not due yet: an hour is left, as at the pause
    assert handle.get().step("timer").state is StepState.WAITING_TIMER
    clock(moved + timedelta(minutes=1))  # past the moved time: it fires
    assert handle.result(timeout=PROMPT) == 9


def test_a_signal_timeout_is_moved_by_the_pause(
    client: Client, clock: Callable[[datetime], None], start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker(*ALL_STEPS)
    handle = client.submit(sig_timeout, 0)
    due = handle.get().step("pa_ok").scheduled_at
    client.pause(handle.id)
    clock(datetime.now(UTC) + timedelta(hours=2))  # the 1 h timeout would have passed
    client.resume(handle.id)
    moved = handle.get().step("pa_ok").scheduled_at
    assert timedelta(hours=2) <= moved - due < timedelta(hours=2, minutes=1)  # by the pause
    scanner_passes(worker)  # a scanner pass or more
    assert handle.get().step("pa_ok").state is StepState.WAITING_SIGNAL
    assert client.signal(handle.id, "pa_ok", "yes") is Delivery.CONSUMED
    assert handle.result(timeout=PROMPT) == "yes"


# -- sequence_key -----------------------------------------------------------------------------


def test_a_paused_step_holds_the_later_steps_of_its_sequence(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    first = client.enqueue(seq_step, "a", sequence_key="pa-seq-1")
    second = client.enqueue(seq_step, "b", sequence_key="pa-seq-1")
    client.pause(first.id)
    start_worker(*ALL_STEPS)
    time.sleep(0.8)
    assert CALLS["pa_seq:b"] == 0, "a step ran before the paused step ahead of it"
    assert second.get().step("pa_seq").state is StepState.AVAILABLE
    client.resume(first.id)
    assert first.result(timeout=10) == "a"
    assert second.result(timeout=10) == "b"


def test_a_paused_step_does_not_hold_the_earlier_steps_of_its_sequence(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    first = client.enqueue(seq_step, "x", sequence_key="pa-seq-2")
    second = client.enqueue(seq_step, "y", sequence_key="pa-seq-2")
    client.pause(second.id)  # the later one: it keeps its place, after the first
    start_worker(*ALL_STEPS)
    try:
        assert first.result(timeout=PROMPT) == "x"
    finally:
        client.resume(second.id)
    assert second.result(timeout=10) == "y"


# -- flow control -----------------------------------------------------------------------------


def test_a_paused_step_holds_no_concurrency_slot(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL_STEPS, concurrency=4)
    first = client.enqueue(limited, "first")
    wait_until(lambda: CALLS["pa_limited:first"], what="the first limited step to run")
    queued = client.enqueue(limited, "queued")  # waits for the slot
    client.pause(queued.id)
    gate("limited").set()
    assert first.result(timeout=10) == "first"
    third = client.enqueue(limited, "third")
    assert third.result(timeout=10) == "third"
    assert queued.get().step("pa_limited").state is StepState.PAUSED
    assert CALLS["pa_limited:queued"] == 0
    client.resume(queued.id)
    assert queued.result(timeout=10) == "queued"


def test_a_paused_run_keeps_its_run_slot_until_it_is_cancelled(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL_STEPS, one_at_a_time, concurrency=4)
    first = client.submit(one_at_a_time, "first")
    wait_until(lambda: CALLS["pa_run_limited:first"], what="the first run to start")
    client.pause(first.id)
    second = client.submit(one_at_a_time, "second")
    time.sleep(0.8)
    assert CALLS["pa_run_limited:second"] == 0  # the paused run holds its slot (documented)
    client.cancel(first.id)
    assert second.result(timeout=10) == "second"


# -- deadlines --------------------------------------------------------------------------------


def test_a_pause_after_the_deadline_passed_does_not_save_the_run(
    client: Client, clock: Callable[[datetime], None], start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker(*ALL_STEPS, scan_interval=60.0)  # the deadline scanner is late
    handle = client.submit(single, 1, deadline=timedelta(hours=1))
    wait_until(lambda: handle.get().step("pa_hold").state is StepState.RUNNING, what="pa_hold runs")
    scanner = worker._scanner
    assert scanner is not None
    # Its first look, at start, must not see the moved clock.
    wait_until(lambda: scanner.passes >= 1, what="the scanner's first look")
    clock(datetime.now(UTC) + timedelta(hours=2))  # the deadline passed; no scanner pass since
    with pytest.raises(AlreadyTerminal, match="passed its deadline"):
        client.pause(handle.id)
    gate("hold").set()
    run = handle.wait(timeout=10)
    assert run.state is RunState.FAILED
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=1)
    assert failed.value.error_kind == "deadline"


# -- child runs started while the parent is paused --------------------------------------------


def test_a_deferred_child_run_does_not_run_while_its_parent_is_paused(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    only_parent = Registry()
    only_parent.register(parent)  # not the child workflow: its start is left to a worker
    with Client(cyclone_dsn, registry=only_parent) as narrow:
        handle = narrow.submit(parent, 7)
        assert narrow.children_of(handle.id) == []
        narrow.pause(handle.id)
        start_worker(*ALL_STEPS, *ALL_WORKFLOWS)
        time.sleep(1.5)
        kids = narrow.children_of(handle.id)
        try:
            assert CALLS["pa_kid_step[7]"] == 0, "the child's step ran inside the pause"
            assert all(state_of(narrow, k["id"]) is RunState.PAUSED for k in kids)
        finally:
            narrow.resume(handle.id)
        assert handle.result(timeout=10) == 107


def test_without_a_pause_a_completion_after_the_deadline_fails_the_run(
    client: Client, clock: Callable[[datetime], None], start_worker: Callable[..., Worker]
) -> None:
    """The control of the finding above: the same run, not paused, fails with deadline."""
    start_worker(*ALL_STEPS, scan_interval=60.0)
    handle = client.submit(single, 1, deadline=timedelta(hours=1))
    wait_until(lambda: handle.get().step("pa_hold").state is StepState.RUNNING, what="pa_hold runs")
    clock(datetime.now(UTC) + timedelta(hours=2))  # the deadline passed; no scanner pass since
    gate("hold").set()
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)
    assert failed.value.error_kind == "deadline"


# -- deadlines of runs that ended while paused --------------------------------------------------
#
# A deadline's clock stops while its run is paused (docs/concepts/waits.md). A run that ended
# while paused (it keeps its paused_at) and is then retried or replayed is judged, and
# reopened, as if resumed at the retry: its deadline moves forward by the pause's length.


@step(name="pa_fail_once", max_attempts=1)
def fail_once(value: int) -> int:
    """Its first call fails for good (once gate "fail_once" opens); later calls return."""
    called("pa_fail_once")
    with CALLS_LOCK:
        first = CALLS["pa_fail_once"] == 1
    if first:
        gate("fail_once").wait(10)
        raise RuntimeError("pa fails once")
    return value


@workflow(name="pa_fail_once_wf")
def fail_once_wf(x):  # type: ignore[no-untyped-def]
    return echo(fail_once(x))


@workflow(name="pa_go")
def go_wf(x):  # type: ignore[no-untyped-def]
    return echo(wait_signal("pa_dl_go"))


@workflow(name="pa_timer_parent")
def timer_parent(x):  # type: ignore[no-untyped-def]
    return echo(child(timer_wf, x))


def _failed_while_paused(
    client: Client, clock: Callable[[timedelta], None], paused_for: timedelta
) -> int:
    """A pa_fail_once_wf run with a 1 h deadline, paused a few seconds in, that fails for good
    ``paused_for`` later, still paused."""
    handle = client.submit(fail_once_wf, 1, deadline=timedelta(hours=1))
    wait_until(
        lambda: handle.get().step("pa_fail_once").state is StepState.RUNNING,
        what="pa_fail_once runs",
    )
    client.pause(handle.id)
    clock(paused_for)
    gate("fail_once").set()
    run = handle.wait(timeout=10)
    assert run.state is RunState.FAILED and run.paused_at is not None
    assert run.step("pa_fail_once").error_kind == "error"
    return handle.id


def _moved_by(before: datetime | None, after: datetime | None) -> timedelta:
    assert before is not None and after is not None
    return after - before


def test_a_retry_of_a_run_that_failed_while_paused_keeps_the_pause_off_its_deadline(
    client: Client, clock: Callable[[timedelta], None], start_worker: Callable[..., Worker]
) -> None:
    """Deadline 1 h. Paused a few seconds in, the run stays paused 3 h and a step that was
    running fails for good inside the pause. Its deadline's clock stood still: it has used
    seconds of its hour, so a retry then is not past its deadline (it was refused so)."""
    start_worker(*ALL_STEPS, fail_once)
    run_id = _failed_while_paused(client, clock, timedelta(hours=3))
    before = client.get_run(run_id)
    client.retry(run_id, "pa_fail_once")
    after = client.get_run(run_id)
    assert after.paused_at is None
    # Moved forward by the pause: from the pause to the retry (3 h and a few seconds).
    moved = _moved_by(before.deadline_at, after.deadline_at)
    assert timedelta(hours=3) <= moved < timedelta(hours=3, minutes=1)
    assert client.wait(run_id, timeout=10).state is RunState.COMPLETED


def test_a_retry_of_a_run_cancelled_while_paused_keeps_the_pause_off_its_deadline(
    client: Client, clock: Callable[[timedelta], None], start_worker: Callable[..., Worker]
) -> None:
    """Deadline 2 h; paused at once, cancelled 3 h later (its clock stood still), retried at
    once: it has used none of its 2 h. Its timer waits its full hour from the retry, and
    fires inside the moved deadline."""
    handle = client.submit(timer_wf, 3, deadline=timedelta(hours=2))
    client.pause(handle.id)
    clock(timedelta(hours=3))
    client.cancel(handle.id)
    assert handle.get().state is RunState.CANCELLED
    client.retry(handle.id, "timer")
    assert handle.get().state is RunState.RUNNING
    worker = start_worker(*ALL_STEPS)
    scanner_passes(worker)
    assert handle.get().state is RunState.RUNNING  # not failed by its deadline at once
    clock(timedelta(hours=4, minutes=1))  # the timer is due; the moved deadline is not
    assert handle.result(timeout=10) == 3


def test_a_run_retried_before_its_deadline_gets_its_paused_time_back(
    client: Client, clock: Callable[[timedelta], None], start_worker: Callable[..., Worker]
) -> None:
    """Deadline 1 h; paused at once, cancelled 20 min later, retried then (before its
    deadline). It gets the 20 paused minutes back: it does not fail at the original
    deadline, and fails 20 min after it."""
    handle = client.submit(go_wf, 1, deadline=timedelta(hours=1))
    client.pause(handle.id)
    clock(timedelta(minutes=20))
    client.cancel(handle.id)
    before = client.get_run(handle.id)
    (wait_node,) = [s.node for s in before.steps if s.node != "pa_echo"]
    client.retry(handle.id, wait_node)
    moved = _moved_by(before.deadline_at, client.get_run(handle.id).deadline_at)
    assert timedelta(minutes=20) <= moved < timedelta(minutes=21)
    worker = start_worker(*ALL_STEPS)
    clock(timedelta(hours=1, minutes=10))  # past the original deadline, not the moved one
    scanner_passes(worker)
    assert handle.get().state is RunState.RUNNING
    clock(timedelta(hours=1, minutes=22))  # past the moved one
    scanner_passes(worker)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)
    assert failed.value.error_kind == "deadline"


def test_a_run_that_ended_unpaused_past_its_deadline_is_still_refused_a_retry(
    client: Client, clock: Callable[[timedelta], None]
) -> None:
    """The control: a cancelled run that was never paused keeps its deadline; 3 h on it is
    past it, and the retry is refused (nothing changed)."""
    handle = client.submit(go_wf, 1, deadline=timedelta(hours=1))
    client.cancel(handle.id)
    before = client.get_run(handle.id)
    (wait_node,) = [s.node for s in before.steps if s.node != "pa_echo"]
    clock(timedelta(hours=3))
    with pytest.raises(InvalidTransition, match="past its deadline"):
        client.retry(handle.id, wait_node)
    after = client.get_run(handle.id)
    assert after.state is RunState.CANCELLED and after.deadline_at == before.deadline_at


def test_a_replay_of_a_run_that_completed_while_paused_keeps_the_pause_off_its_deadline(
    client: Client, clock: Callable[[timedelta], None], start_worker: Callable[..., Worker]
) -> None:
    """Deadline 1 h; the run's last step completes 3 h into a pause (the run completes,
    keeping its paused_at). A replay of that step then is not past the deadline."""
    start_worker(*ALL_STEPS)
    handle = client.submit(single, 5, deadline=timedelta(hours=1))
    wait_until(lambda: handle.get().step("pa_hold").state is StepState.RUNNING, what="pa_hold runs")
    client.pause(handle.id)
    clock(timedelta(hours=3))
    gate("hold").set()
    before = handle.wait(timeout=10)
    assert before.state is RunState.COMPLETED and before.paused_at is not None
    client.retry(handle.id, "pa_hold", force=True)
    after = client.get_run(handle.id)
    assert after.paused_at is None
    moved = _moved_by(before.deadline_at, after.deadline_at)
    assert timedelta(hours=3) <= moved < timedelta(hours=3, minutes=1)
    wait_until(lambda: CALLS["pa_hold"] == 2, what="pa_hold runs again")
    assert handle.result(timeout=10) == 5


def test_retry_many_takes_a_run_that_failed_while_paused_past_its_nominal_deadline(
    client: Client, clock: Callable[[timedelta], None], start_worker: Callable[..., Worker]
) -> None:
    """retry_many skipped it as "past its deadline"."""
    start_worker(*ALL_STEPS, fail_once)
    run_id = _failed_while_paused(client, clock, timedelta(hours=3))
    result = client.retry_many(RunFilter(workflows="pa_fail_once_wf"))
    assert (result.acted, result.skipped, result.skipped_runs) == (1, 0, ())
    assert client.wait(run_id, timeout=10).state is RunState.COMPLETED


def test_a_retry_reopens_a_child_run_cancelled_while_paused_with_its_parent(
    client: Client, clock: Callable[[timedelta], None], start_worker: Callable[..., Worker]
) -> None:
    """Parent with a 2 h deadline, paused with its child run at once and cancelled with it
    3 h later; a retry of the parent's child node reopens both, the parent's deadline moved
    by the pause, and the tree completes."""
    handle = client.submit(timer_parent, 4, deadline=timedelta(hours=2))
    (kid_row,) = client.children_of(handle.id)
    client.pause(handle.id)
    assert client.get_run(kid_row["id"]).state is RunState.PAUSED
    clock(timedelta(hours=3))
    client.cancel(handle.id)
    before = client.get_run(handle.id)
    kid_before = client.get_run(kid_row["id"])
    assert kid_before.state is RunState.CANCELLED and kid_before.paused_at is not None
    (child_node,) = [s.node for s in before.steps if s.node != "pa_echo"]
    client.retry(handle.id, child_node)
    after = client.get_run(handle.id)
    kid_after = client.get_run(kid_row["id"])
    assert after.state is RunState.RUNNING and kid_after.state is RunState.RUNNING
    assert after.paused_at is None and kid_after.paused_at is None
    moved = _moved_by(before.deadline_at, after.deadline_at)
    assert timedelta(hours=3) <= moved < timedelta(hours=3, minutes=1)
    worker = start_worker(*ALL_STEPS, *ALL_WORKFLOWS, timer_wf)
    scanner_passes(worker)
    assert client.get_run(handle.id).state is RunState.RUNNING
    clock(timedelta(hours=4, minutes=1))  # the child's timer is due; the moved deadline is not
    assert handle.result(timeout=10) == 4


# -- more fan-out, waits and bulk -------------------------------------------------------------


@step(name="pa_item_fails", max_attempts=1)
def item_fails(x: int) -> int:
    called(f"pa_item_fails[{x}]")
    if x < 2:
        gate(f"item_fails{x}").wait(10)
    if x == 1:
        raise RuntimeError("pa item 1 fails")
    return x


@workflow(name="pa_fan_fails")
def fan_fails(n):  # type: ignore[no-untyped-def]
    return for_each(item_fails, over=make_list(n), max_parallel=2)


def test_an_item_failing_for_good_while_paused_fails_the_run_and_cancels_the_rest(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL_STEPS, item_fails)
    handle = client.submit(fan_fails, 5)
    wait_until(
        lambda: CALLS["pa_item_fails[0]"] and CALLS["pa_item_fails[1]"],
        what="the first two items to run",
    )
    client.pause(handle.id)
    gate("item_fails0").set()
    wait_until(
        lambda: items_of(client, handle.id, "pa_item_fails")[0].state is StepState.COMPLETED,
        what="item 0 to complete inside the pause",
    )
    gate("item_fails1").set()
    run = handle.wait(timeout=10)
    assert run.state is RunState.FAILED
    items = items_of(client, handle.id, "pa_item_fails")
    assert items[0].state is StepState.COMPLETED
    assert items[1].state is StepState.DISCARDED
    assert [s.state for s in items[2:]] == [StepState.CANCELLED] * 3
    assert run.step("pa_item_fails").state is StepState.DISCARDED
    assert not any(CALLS[f"pa_item_fails[{i}]"] for i in range(2, 5))


def test_a_quorum_reached_inside_the_pause_holds_its_dependent(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL_STEPS)
    handle = client.submit(votes, 0)
    client.pause(handle.id)
    for vote in ("a", "b", "c"):
        assert client.signal(handle.id, "pa_vote", vote) is Delivery.CONSUMED
    assert client.signal(handle.id, "pa_vote", "d") is Delivery.NOT_STORED
    time.sleep(0.4)
    run = handle.get()
    assert run.step("pa_vote").state is StepState.COMPLETED
    assert run.step("pa_echo").state is StepState.PAUSED
    assert CALLS["pa_echo"] == 0
    client.resume(handle.id)
    assert handle.result(timeout=10) == ["a", "b", "c"]


def test_a_paused_step_keeps_its_unique_key(client: Client) -> None:
    first = client.enqueue(seq_step, "u", unique_key="pa-unique")
    client.pause(first.id)
    again = client.enqueue(seq_step, "u2", unique_key="pa-unique")
    assert again.created is False and again.id == first.id
    client.cancel(first.id)
    third = client.enqueue(seq_step, "u3", unique_key="pa-unique")
    assert third.created is True and third.id != first.id


def test_async_resume_many_resumes_a_paused_tree(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    handles = [client.submit(parent, 0), client.submit(parent, 1)]
    for h in handles:
        wait_until(functools.partial(client.children_of, h.id), what="the child run")
        client.pause(h.id)
    start_worker(*ALL_STEPS, *ALL_WORKFLOWS)
    gate("kids").set()

    async def scenario() -> tuple[int, int, int]:
        async with AsyncClient(cyclone_dsn) as aclient:
            result = await aclient.resume_many(RunFilter(workflows="pa_parent"))
            return result.matched, result.acted, result.skipped

    assert asyncio.run(scenario()) == (2, 2, 0)
    assert [h.result(timeout=10) for h in handles] == [100, 101]


# -- a child run created while its parent's pause is under way ----------------------------


@step(name="pa_leaf_step")
def pa_leaf_step(x: int) -> int:
    return x


@workflow(name="pa_leaf")
def pa_leaf(x):  # type: ignore[no-untyped-def]
    return pa_leaf_step(x)


@workflow(name="pa_parent_of_leaf")
def pa_parent_of_leaf(x):  # type: ignore[no-untyped-def]
    return child(pa_leaf, x)


@pytest.mark.parametrize("call", ["pause", "cancel"])
def test_a_child_run_created_during_its_parents_pause_is_not_updated_before_it_was_created(
    client: Client, cyclone_dsn: str, call: str
) -> None:
    """A pause (or cancel) locks the run, then its running descendants in later statements,
    which see child runs committed since its transaction began (a worker starting a child
    node meanwhile). Those were stamped with the transaction's start, before they existed
    (a cancelled child ended before it began)."""
    from cyclone_dsl.db.connect import connect
    from cyclone_dsl.db.tx import ConnectionTx

    conn = connect(cyclone_dsn, name="pa-pause", autocommit=False)
    try:
        conn.execute("SELECT 1")  # the pausing transaction begins: its now() is fixed
        time.sleep(0.05)
        handle = client.submit(pa_parent_of_leaf, 1)  # the child run is made at submit
        assert getattr(client._engine, call)(ConnectionTx(conn), handle.id) is None
        conn.commit()
    finally:
        conn.close()
    below = client.list_runs(parent_run_id=handle.id)
    runs = [client.get_run(run_id) for run_id in [handle.id, *(r.id for r in below)]]
    want = RunState.PAUSED if call == "pause" else RunState.CANCELLED
    assert [r.state for r in runs] == [want, want]
    for run in runs:
        assert run.updated_at >= run.created_at, run
        assert run.finished_at is None or run.finished_at >= run.created_at, run
        for node in run.steps:
            assert node.completed_at is None or node.completed_at >= node.created_at, node
