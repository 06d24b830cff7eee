"""Operator retry (``client.retry``) through the public API: what runs again, what is refused.

Each handler here fails (``Permanent``, so at once) while its tag is in ``FAILING``;
a test fails the run, clears the tag, retries, and checks that the run finishes with
the right result, or that a refused retry changed nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from cyclone_dsl import (
    Client,
    Permanent,
    Run,
    RunFailed,
    Worker,
    child,
    for_each,
    step,
    wait_signal,
    workflow,
)
from cyclone_dsl.errors import InvalidTransition, NoOutput
from cyclone_dsl.states import RunState, StepState
from tests.waiting import wait_until

FAILING: set[str] = set()
lock = threading.Lock()
running_items = 0
peak_items = 0


def fail_if(tag: str) -> None:
    if tag in FAILING:
        raise Permanent(f"{tag} is set to fail")


@step(name="ry_items")
def make_items(n: int) -> list[int]:
    return list(range(n))


#: The item TAIL waits for this (set but in the test that clears it): the fan-out is still
#: mid-way when another item fails, however fast the others run. One item only: claims
#: take equal items in no set order, and more held items could fill every handler slot
#: before the failing one is claimed.
tail_open = threading.Event()
tail_open.set()
TAIL = 199


@step(name="ry_work", max_attempts=3)
def work(x: int) -> int:
    fail_if(f"item-{x}")
    if x == TAIL:
        tail_open.wait(20)
    return x * 10


@step(name="ry_slow_work")
def slow_work(x: int) -> int:
    global running_items, peak_items
    with lock:
        running_items += 1
        peak_items = max(peak_items, running_items)
    try:
        time.sleep(0.02)
        fail_if(f"item-{x}")
        return x * 10
    finally:
        with lock:
            running_items -= 1


@step(name="ry_task", max_attempts=3)
def task(tag: str) -> str:
    fail_if(tag)
    return tag


@step(name="ry_after")
def after(value: str) -> str:
    return f"after {value}"


@step(name="ry_join")
def join(a: object, b: object) -> list[object]:
    return [a, b]


@step(name="ry_total")
def total(values: list[int]) -> int:
    return sum(values)


@workflow(name="ry_fan")
def fan(n):  # type: ignore[no-untyped-def]
    return for_each(work, over=make_items(n))


@workflow(name="ry_fan_limited")
def fan_limited(n):  # type: ignore[no-untyped-def]
    return total(for_each(slow_work, over=make_items(n), max_parallel=3))


@workflow(name="ry_fan_and_other")
def fan_and_other(n):  # type: ignore[no-untyped-def]
    items = make_items(n)
    lines = for_each(slow_work, over=items, max_parallel=2)
    # After the items exist, so its failure always finds the fan-out mid-way.
    other = task("other", after=items).named("other")
    return join(lines, other)


@workflow(name="ry_inner")
def inner(tag):  # type: ignore[no-untyped-def]
    return after(task(tag))


@workflow(name="ry_outer")
def outer(tag):  # type: ignore[no-untyped-def]
    return after(child(inner, tag))


@workflow(name="ry_inner_waits")
def inner_waits(tag):  # type: ignore[no-untyped-def]
    return after(wait_signal("inner_go"))


@workflow(name="ry_outer_two")
def outer_two(tag):  # type: ignore[no-untyped-def]
    waited = child(inner_waits, tag)
    other = task("other").named("other")
    return join(waited, other)


@workflow(name="ry_wait")
def waits(tag):  # type: ignore[no-untyped-def]
    return after(wait_signal("approve", timeout=timedelta(hours=1)))


@workflow(name="ry_chain")
def chain(tag):  # type: ignore[no-untyped-def]
    return after(after(task(tag)))


@workflow(name="ry_branches")
def branches(tag):  # type: ignore[no-untyped-def]
    a1 = task("a1").named("a1")
    a2 = task("a2").named("a2")
    after(a1, on_dep_failure="cancel_branch").named("b1")
    after(a2, on_dep_failure="cancel_branch").named("b2")
    join(a1, a2, on_dep_failure="cancel_branch").named("both")
    return task("main").named("main")


@workflow(name="ry_two_failures")
def two_failures(tag):  # type: ignore[no-untyped-def]
    bad = task("bad").named("bad")
    slow = wait_signal("never")
    return join(after(bad), slow)


@workflow(name="ry_contained_open")
def contained_open(tag):  # type: ignore[no-untyped-def]
    bad = task("bad").named("bad")
    after(bad, on_dep_failure="cancel_branch").named("branch")
    return after(wait_signal("finish"))


release = threading.Event()


@step(name="ry_block")
def block(tag: str) -> str:
    release.wait(20)
    return tag


@workflow(name="ry_blocked")
def blocked(tag):  # type: ignore[no-untyped-def]
    return after(block(tag))


HANDLERS = [make_items, work, slow_work, task, after, join, total]
WORKFLOWS = [inner, inner_waits]


@pytest.fixture(autouse=True)
def _reset_failures() -> None:
    FAILING.clear()


def settled(client: Client, run_id: int, timeout: float = 20) -> Run:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = client.get_run(run_id)
        if run.state.is_terminal:
            return run
        time.sleep(0.05)
    raise AssertionError(f"run {run_id} did not end: {client.get_run(run_id)}")


def refused(client: Client, run_ids: list[int], run_id: int, node: str, match: str) -> None:
    """The retry raises InvalidTransition and every listed run reads back unchanged."""
    before = [client.get_run(r) for r in run_ids]
    with pytest.raises(InvalidTransition, match=match):
        client.retry(run_id, node)
    assert [client.get_run(r) for r in run_ids] == before


# -- fan-out ---------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["ry_work[17]", "ry_work"])
def test_a_fan_out_with_a_failed_item_runs_again(
    target: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("item-17")
    start_worker(*HANDLERS, concurrency=8)
    tail_open.clear()
    try:
        handle = client.submit(fan, 200)
        run = settled(client, handle.id)
    finally:
        tail_open.set()
    assert run.state is RunState.FAILED
    assert run.step("ry_work[17]").state is StepState.DISCARDED
    assert run.step("ry_work").state is StepState.DISCARDED
    items = [s for s in run.steps if s.item_of == "ry_work"]
    assert len(items) == 200
    assert any(s.state is StepState.CANCELLED for s in items)
    FAILING.clear()
    client.retry(handle.id, target)
    assert handle.result(timeout=30) == [x * 10 for x in range(200)]
    run = client.get_run(handle.id)
    assert {s.state for s in run.steps} == {StepState.COMPLETED}
    assert run.step("ry_work[17]").attempt == 0
    assert run.finished_at is not None


def test_a_fan_out_with_max_parallel_keeps_its_bound_on_retry(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    global peak_items
    FAILING.add("item-5")
    worker = start_worker(*HANDLERS, concurrency=8)
    handle = client.submit(fan_limited, 30)
    assert settled(client, handle.id).state is RunState.FAILED
    FAILING.clear()
    # Items cancelled with the run may still be finishing in the worker: wait until every
    # handler has returned, so that none of them counts towards the retry's peak.
    wait_until(lambda: not worker._running, what="the cancelled items' handlers to return")
    peak_items = 0
    client.retry(handle.id, "ry_slow_work[5]")
    assert handle.result(timeout=30) == sum(x * 10 for x in range(30))
    assert 1 <= peak_items <= 3


def test_a_fan_out_cancelled_mid_way_by_another_failure_resumes_its_items(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("other")
    start_worker(*HANDLERS, concurrency=4)
    handle = client.submit(fan_and_other, 40)
    run = settled(client, handle.id)
    assert run.state is RunState.FAILED
    assert run.step("other").state is StepState.DISCARDED
    assert run.step("ry_slow_work").state is StepState.CANCELLED
    items = [s for s in run.steps if s.item_of == "ry_slow_work"]
    assert any(s.state is StepState.CANCELLED for s in items)
    # Retrying the fan-out alone would leave the node that failed the run discarded.
    refused(client, [handle.id], handle.id, "ry_slow_work", "failed at node 'other'")
    FAILING.clear()
    client.retry(handle.id, "other")
    assert handle.result(timeout=30) == [[x * 10 for x in range(40)], "other"]


def test_retrying_a_completed_item_or_an_item_of_a_completed_fan_out_is_refused(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("item-3")
    start_worker(*HANDLERS, concurrency=1)
    handle = client.submit(fan, 6)
    run = settled(client, handle.id)
    completed = next(
        s.node for s in run.steps if s.item_of == "ry_work" and s.state is StepState.COMPLETED
    )
    refused(client, [handle.id], handle.id, completed, "only a discarded or cancelled")
    FAILING.clear()
    ok = client.submit(fan, 3)
    assert ok.result(timeout=20) == [0, 10, 20]
    refused(client, [ok.id], ok.id, "ry_work[1]", "only a discarded or cancelled")


# -- child runs ------------------------------------------------------------------------


def test_a_child_node_whose_child_run_failed_retries_that_child_run(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("deep")
    start_worker(*HANDLERS, *WORKFLOWS)
    handle = client.submit(outer, "deep")
    run = settled(client, handle.id)
    assert run.state is RunState.FAILED
    assert run.step("ry_inner").state is StepState.DISCARDED
    (child_run,) = client.list_runs(workflow="ry_inner")
    assert child_run.state is RunState.FAILED
    # The child run cannot be retried on its own: its parent node does not wait for it.
    refused(client, [handle.id, child_run.id], child_run.id, "ry_task", f"run {handle.id}'s node")
    FAILING.clear()
    client.retry(handle.id, "ry_inner")
    assert handle.result(timeout=20) == "after after deep"
    (again,) = client.list_runs(workflow="ry_inner")
    assert again.id == child_run.id and again.state is RunState.COMPLETED
    assert client.get_run(child_run.id).step("ry_task").attempt == 0


@workflow(name="ry_result_cut")
def result_cut(tag):  # type: ignore[no-untyped-def]
    bad = task("bad").named("bad")
    task("main").named("main")
    return after(bad, on_dep_failure="cancel_branch").named("branch")


def test_a_result_node_cut_off_by_a_contained_failure_is_no_result(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """The run completes (the failure is contained), but its result node was cancelled:
    result() returned None, as if the node had returned None."""
    FAILING.add("bad")
    start_worker(*HANDLERS, result_cut)
    handle = client.submit(result_cut, "x")
    assert handle.wait(timeout=20).state is RunState.COMPLETED
    with pytest.raises(NoOutput, match="its result node 'branch' was cancelled"):
        handle.result(timeout=5)
    FAILING.clear()


@workflow(name="ry_outer_cut")
def outer_cut(tag):  # type: ignore[no-untyped-def]
    return after(child(result_cut, tag))


def test_a_child_run_whose_result_node_was_cut_off_fails_its_node(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """The parent's child node took None as the child run's result and went on."""
    FAILING.add("bad")
    start_worker(*HANDLERS, result_cut, outer_cut)
    handle = client.submit(outer_cut, "x")
    with pytest.raises(RunFailed, match="completed without a result: its result node 'branch'"):
        handle.result(timeout=20)
    assert client.get_run(handle.id).step("ry_result_cut").error_kind == "child_failed"
    FAILING.clear()


@workflow(name="ry_contained_inner")
def contained_inner(tag):  # type: ignore[no-untyped-def]
    bad = task("bad").named("bad")
    after(bad, on_dep_failure="cancel_branch").named("branch")
    return task("main").named("main")


@workflow(name="ry_outer_contained")
def outer_contained(tag):  # type: ignore[no-untyped-def]
    return after(child(contained_inner, tag))


def test_a_completed_child_runs_contained_failure_points_to_a_fork(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """The refusal said to retry the parent's child node, which completed and so could not
    be retried either (nor replayed: its child run exists): the way out is a fork."""
    FAILING.add("bad")
    start_worker(*HANDLERS, *WORKFLOWS, contained_inner, outer_contained)
    handle = client.submit(outer_contained, "x")
    assert handle.result(timeout=20) == "after main"
    (child_run,) = client.list_runs(workflow="ry_contained_inner")
    assert client.get_run(child_run.id).step("bad").state is StepState.DISCARDED
    refused(client, [handle.id, child_run.id], child_run.id, "bad", f"fork run {handle.id} from")
    FAILING.clear()


def test_a_child_run_cancelled_with_its_parent_runs_again(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("other")
    start_worker(*HANDLERS, *WORKFLOWS)
    handle = client.submit(outer_two, "x")
    run = settled(client, handle.id)
    assert run.state is RunState.FAILED
    assert run.step("ry_inner_waits").state is StepState.CANCELLED
    (child_run,) = client.list_runs(workflow="ry_inner_waits")
    assert child_run.state is RunState.CANCELLED
    FAILING.clear()
    client.retry(handle.id, "other")
    assert client.get_run(child_run.id).state is RunState.RUNNING
    assert client.get_run(handle.id).step("ry_inner_waits").state is StepState.WAITING_CHILD
    client.signal(child_run.id, "inner_go", "go")
    assert handle.result(timeout=20) == ["after go", "other"]


# -- waits -----------------------------------------------------------------------------


def test_a_timed_out_signal_wait_waits_again(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    start_worker(*HANDLERS)
    handle = client.submit(waits, "x")
    wait_until(
        lambda: client.get_run(handle.id).step("approve").state is StepState.WAITING_SIGNAL,
        what="the wait",
    )
    moved = datetime.now(UTC) + timedelta(hours=2)
    clock(moved)  # past its hour-long timeout: the scanner times it out
    run = settled(client, handle.id)
    assert run.state is RunState.FAILED
    assert run.step("approve").error_kind == "signal_timeout"
    client.retry(handle.id, "approve")
    wait = client.get_run(handle.id).step("approve")
    assert wait.state is StepState.WAITING_SIGNAL
    # A fresh timeout, from now (the moved clock), not from when the wait first started.
    assert wait.scheduled_at > moved + timedelta(minutes=59)
    client.signal(handle.id, "approve", "yes")
    assert handle.result(timeout=20) == "after yes"


# -- whole runs and branches -------------------------------------------------------------


def test_a_cancelled_run_runs_again(client: Client, start_worker: Callable[..., Worker]) -> None:
    handle = client.submit(chain, "c")
    client.cancel(handle.id)
    assert {s.state for s in client.get_run(handle.id).steps} == {StepState.CANCELLED}
    client.retry(handle.id, "ry_after_2")  # any cancelled node: every cancelled step runs
    start_worker(*HANDLERS)
    assert handle.result(timeout=20) == "after after c"


def test_cancel_branch_with_two_failed_branches_retries_one_at_a_time(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.update({"a1", "a2"})
    start_worker(*HANDLERS)
    handle = client.submit(branches, "x")
    run = settled(client, handle.id)
    assert run.state is RunState.COMPLETED
    assert {run.step(n).state for n in ("a1", "a2")} == {StepState.DISCARDED}
    assert {run.step(n).state for n in ("b1", "b2", "both")} == {StepState.CANCELLED}
    FAILING.discard("a1")
    client.retry(handle.id, "a1")
    run = settled(client, handle.id)
    assert run.state is RunState.COMPLETED
    assert run.step("b1").output == "after a1"
    assert run.step("a2").state is StepState.DISCARDED
    assert {run.step(n).state for n in ("b2", "both")} == {StepState.CANCELLED}
    # A node whose upstream is still discarded cannot be retried on its own.
    refused(client, [handle.id], handle.id, "both", "depends on 'a2', which failed: retry 'a2'")
    FAILING.clear()
    client.retry(handle.id, "a2")
    run = settled(client, handle.id)
    assert run.state is RunState.COMPLETED
    assert {s.state for s in run.steps} == {StepState.COMPLETED}
    assert run.step("both").output == ["a1", "a2"]


def test_retrying_a_branch_of_an_open_run(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("bad")
    start_worker(*HANDLERS)
    handle = client.submit(contained_open, "x")
    deadline = time.monotonic() + 20
    while client.get_run(handle.id).step("branch").state is not StepState.CANCELLED:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    client.pause(handle.id)
    refused(client, [handle.id], handle.id, "bad", "resume it first")
    client.resume(handle.id)
    FAILING.clear()
    client.retry(handle.id, "bad")
    client.signal(handle.id, "finish", "done")
    run = settled(client, handle.id)
    assert run.state is RunState.COMPLETED
    assert run.step("branch").output == "after bad"


def test_retrying_a_cancelled_node_while_the_failed_one_stays_discarded_is_refused(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("bad")
    start_worker(*HANDLERS)
    handle = client.submit(two_failures, "x")
    run = settled(client, handle.id)
    assert run.state is RunState.FAILED
    assert run.step("never").state is StepState.CANCELLED
    refused(client, [handle.id], handle.id, "never", "failed at node 'bad': retry 'bad'")
    refused(client, [handle.id], handle.id, "ry_after", "depends on 'bad', which failed")


def test_retrying_a_completed_or_waiting_node_is_refused(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS)
    handle = client.submit(two_failures, "x")
    deadline = time.monotonic() + 20
    while client.get_run(handle.id).step("ry_after").state is not StepState.COMPLETED:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    refused(client, [handle.id], handle.id, "bad", "is completed; only a discarded or cancelled")
    refused(client, [handle.id], handle.id, "never", "is waiting_signal")


def test_retrying_a_running_node_is_refused(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    release.clear()
    start_worker(*HANDLERS, block)
    handle = client.submit(blocked, "r")
    deadline = time.monotonic() + 20
    while client.get_run(handle.id).step("ry_block").state is not StepState.RUNNING:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    before = client.get_run(handle.id)
    with pytest.raises(InvalidTransition, match="is running"):
        client.retry(handle.id, "ry_block")
    after_refusal = client.get_run(handle.id)
    assert after_refusal.state is before.state is RunState.RUNNING
    assert [(s.node, s.state, s.attempt) for s in after_refusal.steps] == [
        (s.node, s.state, s.attempt) for s in before.steps
    ]
    release.set()
    assert handle.result(timeout=20) == "after r"


def test_a_unique_key_held_by_another_step_refuses_the_retry(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("unique")
    start_worker(*HANDLERS)
    first = client.enqueue(task, "unique", unique_key="k1")
    assert settled(client, first.id).state is RunState.FAILED
    later = datetime.now(UTC) + timedelta(hours=1)
    holder = client.enqueue(task, "unique", unique_key="k1", scheduled_at=later)
    assert holder.id != first.id
    refused(client, [first.id, holder.id], first.id, "ry_task", "'ry_task'.*'k1'")


def test_a_run_past_its_deadline_is_refused(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS)
    handle = client.submit(two_failures, "x", deadline=timedelta(seconds=1))
    run = settled(client, handle.id)
    assert run.state is RunState.FAILED
    refused(client, [handle.id], handle.id, "never", "deadline")
