"""Audit: child runs and fan-out crossed with failures and run control (nested fan-outs,
grandchildren, pauses of a parent or a child alone, contained failures, retries of
cancelled parents), through the public API."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta

import pytest

from cyclone_dsl import (
    Client,
    Concurrency,
    RunFailed,
    RunFilter,
    Worker,
    child,
    define_result,
    for_each,
    step,
    wait_signal,
    workflow,
)
from cyclone_dsl.states import RunState, StepState
from tests.waiting import wait_until

StartWorker = Callable[..., Worker]

calls: Counter[str] = Counter()
calls_lock = threading.Lock()
broken: set[str] = set()  # values whose handler fails while listed


def _count(key: str) -> None:
    with calls_lock:
        calls[key] += 1


@pytest.fixture(autouse=True)
def _reset() -> None:
    calls.clear()
    broken.clear()


@step(name="xcf_double", max_attempts=1)
def double(x: int) -> int:
    _count(f"double:{x}")
    if f"double:{x}" in broken:
        raise ValueError(f"broken {x}")
    return x * 2


@step(name="xcf_range")
def make_range(n: int) -> list[int]:
    return list(range(n))


@step(name="xcf_sum")
def total(xs: list[int]) -> int:
    _count("sum")
    return sum(xs)


@step(name="xcf_echo")
def echo(x: object) -> object:
    return x


# -- a leaf workflow: fan-out of steps -------------------------------------------------


@workflow(name="xcf_leaf")
def leaf(n):  # type: ignore[no-untyped-def]
    return total(for_each(double, over=make_range(n)))


@workflow(name="xcf_outer")
def outer(ns):  # type: ignore[no-untyped-def]
    return for_each(leaf, over=ns, max_parallel=1)


@workflow(name="xcf_top")
def top(ns):  # type: ignore[no-untyped-def]
    return child(outer, ns)


LEAF_HANDLERS = [double, make_range, total, echo]


def test_nested_fan_out_item_failure_retried_from_the_outer_fan_out(
    client: Client, start_worker: StartWorker
) -> None:
    broken.add("double:2")
    start_worker(*LEAF_HANDLERS, outer)
    handle = client.submit(outer, [2, 3, 4])
    with pytest.raises(RunFailed):
        handle.result(timeout=30)
    broken.clear()
    client.retry(handle.id, "xcf_leaf")
    assert handle.result(timeout=30) == [2, 6, 12]
    leaves = client.list_runs(workflow="xcf_leaf")
    assert len(leaves) == 3
    assert all(r.state is RunState.COMPLETED for r in leaves)
    # child 0 completed before the failure: its items are not run again
    assert calls["double:3"] == 1  # only child 2 has an item 3


def test_grandchild_fan_out_failure_retried_from_the_top(
    client: Client, start_worker: StartWorker
) -> None:
    broken.add("double:1")
    start_worker(*LEAF_HANDLERS, top)
    handle = client.submit(top, [2, 2])
    with pytest.raises(RunFailed):
        handle.result(timeout=30)
    run = client.get_run(handle.id)
    assert run.state is RunState.FAILED
    assert run.step("xcf_outer").error_kind == "child_failed"
    (mid,) = client.list_runs(workflow="xcf_outer")
    assert mid.state is RunState.FAILED
    broken.clear()
    client.retry(handle.id, "xcf_outer")
    assert handle.result(timeout=30) == [2, 2]
    assert len(client.list_runs(workflow="xcf_outer")) == 1
    assert len(client.list_runs(workflow="xcf_leaf")) == 2


# -- children waiting for a signal ---------------------------------------------------


@workflow(name="xcf_gated")
def gated(x):  # type: ignore[no-untyped-def]
    return double(wait_signal("go", after=echo(x)))


@workflow(name="xcf_gated_quiet")
def gated_quiet(x):  # type: ignore[no-untyped-def]
    wait_signal("go", after=echo(x))


@workflow(name="xcf_fan_gated")
def fan_gated(xs):  # type: ignore[no-untyped-def]
    return for_each(gated, over=xs, max_parallel=1)


@workflow(name="xcf_fan_gated2")
def fan_gated2(xs):  # type: ignore[no-untyped-def]
    return total(for_each(gated, over=xs, max_parallel=2))


@workflow(name="xcf_fan_gated_contained")
def fan_gated_contained(xs):  # type: ignore[no-untyped-def]
    done = for_each(gated, over=xs)
    total(done, on_dep_failure="cancel_branch")
    return echo("side")


@workflow(name="xcf_one_gated")
def one_gated(x):  # type: ignore[no-untyped-def]
    return total([child(gated, x)])


def _children(client: Client, run_id: int, workflow_name: str) -> list:
    return sorted(
        (r for r in client.list_runs(workflow=workflow_name) if r.parent_run_id == run_id),
        key=lambda r: r.id,
    )


def _open_child(client: Client, run_id: int, wf: str, index: int) -> int:
    def found() -> int | None:
        kids = _children(client, run_id, wf)
        if len(kids) <= index:
            return None
        go = client.get_run(kids[index].id).step("go")
        if go.state is StepState.WAITING_SIGNAL:
            return kids[index].id
        return None

    return wait_until(found, what=f"child {index} waiting for its signal")


def test_pause_parent_resume_child_alone_in_serial_fan_out_holds_next_child(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*LEAF_HANDLERS, fan_gated)
    handle = client.submit(fan_gated, [1, 2, 3])
    first = _open_child(client, handle.id, "xcf_gated", 0)
    client.pause(handle.id)
    assert client.get_run(first).state is RunState.PAUSED
    client.resume(first)
    client.signal(first, "go", 5)
    wait_until(
        lambda: client.get_run(first).state is RunState.COMPLETED, what="first child completed"
    )
    # the parent is paused: no next child starts
    time.sleep(1.0)
    assert len(_children(client, handle.id, "xcf_gated")) == 1
    assert client.get_run(handle.id).state is RunState.PAUSED
    client.resume(handle.id)
    second = _open_child(client, handle.id, "xcf_gated", 1)
    client.signal(second, "go", 6)
    third = _open_child(client, handle.id, "xcf_gated", 2)
    client.signal(third, "go", 7)
    assert handle.result(timeout=30) == [10, 12, 14]


def test_cancelling_a_paused_child_of_a_paused_parent_fails_the_parent(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*LEAF_HANDLERS, one_gated)
    handle = client.submit(one_gated, 1)
    kid = _open_child(client, handle.id, "xcf_gated", 0)
    client.pause(handle.id)
    client.cancel(kid)
    run = client.wait(handle.id, timeout=20)
    assert run.state is RunState.FAILED
    assert run.step("xcf_gated").error_kind == "child_failed"


def test_child_resumed_alone_fails_fan_out_of_paused_parent_cancels_paused_siblings(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*LEAF_HANDLERS, fan_gated2)
    broken.add("double:1")
    handle = client.submit(fan_gated2, [1, 2, 3])
    a = _open_child(client, handle.id, "xcf_gated", 0)
    b = _open_child(client, handle.id, "xcf_gated", 1)
    client.pause(handle.id)
    client.resume(a)
    client.signal(a, "go", 1)  # double(1) fails for good
    run = client.wait(handle.id, timeout=20)
    assert run.state is RunState.FAILED
    assert client.get_run(b).state is RunState.CANCELLED
    assert len(_children(client, handle.id, "xcf_gated")) == 2
    # retry: the failed child retried in place, the cancelled sibling too, item 2 starts
    broken.clear()
    client.retry(handle.id, "xcf_gated")
    assert client.get_run(b).state is RunState.RUNNING
    assert client.get_run(handle.id).state is RunState.RUNNING
    # a's signal wait had completed: only its failed step runs again
    wait_until(lambda: client.get_run(a).state is RunState.COMPLETED, what="a completed")
    _open_child(client, handle.id, "xcf_gated", 1)
    client.signal(b, "go", 2)
    c = _open_child(client, handle.id, "xcf_gated", 2)
    client.signal(c, "go", 3)
    assert handle.result(timeout=30) == 12
    assert len(_children(client, handle.id, "xcf_gated")) == 3


def test_contained_fan_out_failure_in_paused_parent_then_resume_completes(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*LEAF_HANDLERS, fan_gated_contained)
    broken.add("double:1")
    handle = client.submit(fan_gated_contained, [1, 2])
    a = _open_child(client, handle.id, "xcf_gated", 0)
    b = _open_child(client, handle.id, "xcf_gated", 1)
    wait_until(
        lambda: client.get_run(handle.id).step("xcf_echo").state is StepState.COMPLETED,
        what="side completed",
    )
    client.pause(handle.id)
    client.resume(a)
    client.signal(a, "go", 1)
    wait_until(lambda: client.get_run(b).state is RunState.CANCELLED, what="b cancelled")
    # every step is terminal: the run ends while paused (documented: it keeps paused_at)
    run = client.wait(handle.id, timeout=20)
    assert run.state is RunState.COMPLETED, run.state
    assert run.paused_at is not None
    assert handle.result(timeout=20) == "side"


def test_child_resumed_alone_ends_past_the_paused_parents_original_deadline(
    client: Client, start_worker: StartWorker, clock: Callable[[timedelta], None]
) -> None:
    start_worker(*LEAF_HANDLERS, one_gated)
    handle = client.submit(one_gated, 4, deadline=timedelta(minutes=10))
    kid = _open_child(client, handle.id, "xcf_gated", 0)
    client.pause(handle.id)
    clock(timedelta(minutes=20))  # past the deadline as given: its clock stood still
    client.resume(kid)
    client.signal(kid, "go", 3)
    wait_until(lambda: client.get_run(kid).state.is_terminal, what="child ended")
    assert client.get_run(kid).state is RunState.COMPLETED
    run = client.get_run(handle.id)
    steps = [(s.node, s.state, s.error) for s in run.steps]
    assert run.state is RunState.PAUSED, (run.state, steps)
    client.resume(handle.id)
    assert handle.result(timeout=20) == 6


def test_retrying_a_contained_fan_out_of_children_failure_reopens_and_completes(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*LEAF_HANDLERS, fan_gated_contained)
    broken.add("double:1")
    handle = client.submit(fan_gated_contained, [1, 2])
    a = _open_child(client, handle.id, "xcf_gated", 0)
    b = _open_child(client, handle.id, "xcf_gated", 1)
    client.signal(b, "go", 2)
    wait_until(lambda: client.get_run(b).state is RunState.COMPLETED, what="b completed")
    client.signal(a, "go", 1)
    assert handle.result(timeout=20) == "side"
    assert client.get_run(handle.id).step("xcf_sum").state is StepState.CANCELLED
    broken.clear()
    client.retry(handle.id, "xcf_gated[0]")
    run = client.wait(handle.id, timeout=20)
    assert run.state is RunState.COMPLETED
    assert run.step("xcf_sum").output == 2 + 4
    assert run.step("xcf_gated").output == [2, 4]
    assert len(_children(client, handle.id, "xcf_gated")) == 2


@workflow(name="xcf_cancelled_top")
def cancelled_top(xs):  # type: ignore[no-untyped-def]
    return total(for_each(gated, over=xs, max_parallel=2))


def test_retry_of_a_cancelled_parent_mid_fan_out_of_children(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*LEAF_HANDLERS, cancelled_top)
    handle = client.submit(cancelled_top, [1, 2, 3, 4])
    a = _open_child(client, handle.id, "xcf_gated", 0)
    b = _open_child(client, handle.id, "xcf_gated", 1)
    client.signal(a, "go", 1)
    c = _open_child(client, handle.id, "xcf_gated", 2)
    client.cancel(handle.id)
    assert client.get_run(b).state is RunState.CANCELLED
    assert client.get_run(c).state is RunState.CANCELLED
    result = client.retry_many(RunFilter(workflows="xcf_cancelled_top", states="cancelled"))
    assert result.acted == 1, result
    _open_child(client, handle.id, "xcf_gated", 1)
    client.signal(b, "go", 2)
    _open_child(client, handle.id, "xcf_gated", 2)
    client.signal(c, "go", 3)
    d = _open_child(client, handle.id, "xcf_gated", 3)
    client.signal(d, "go", 4)
    assert handle.result(timeout=20) == 20
    assert len(_children(client, handle.id, "xcf_gated")) == 4
    assert calls["double:1"] == 1


@step(name="xcf_slow", max_attempts=1)
def slow(x: int) -> int:
    _count(f"slow:{x}")
    time.sleep(0.2)
    if f"slow:{x}" in broken:
        raise ValueError(f"broken {x}")
    return x + 100


@workflow(name="xcf_limited", concurrency=Concurrency(limit=1))
def limited(x):  # type: ignore[no-untyped-def]
    return slow(x)


@workflow(name="xcf_fan_limited")
def fan_limited(xs):  # type: ignore[no-untyped-def]
    return for_each(limited, over=xs)


def test_fan_out_of_concurrency_limited_children_failure_then_retry(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*LEAF_HANDLERS, slow, fan_limited, concurrency=4)
    broken.add("slow:1")
    handle = client.submit(fan_limited, [0, 1, 2, 3])
    with pytest.raises(RunFailed):
        handle.result(timeout=30)
    kids = _children(client, handle.id, "xcf_limited")
    assert all(client.get_run(k.id).state.is_terminal for k in kids)
    # the slot is free: another run of the limited workflow goes through
    other = client.submit(limited, 9)
    assert other.result(timeout=20) == 109
    broken.clear()
    client.retry(handle.id, "xcf_limited")
    assert handle.result(timeout=30) == [100, 101, 102, 103]
    assert len(_children(client, handle.id, "xcf_limited")) == 4


def test_pause_resume_parent_with_queued_limited_children(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*LEAF_HANDLERS, slow, fan_limited, concurrency=4)
    handle = client.submit(fan_limited, [0, 1, 2, 3, 4])
    wait_until(lambda: calls["slow:0"] + calls["slow:1"] >= 1, what="a child started")
    client.pause(handle.id)
    time.sleep(1.0)
    started = sum(calls.values())
    time.sleep(1.0)
    assert sum(calls.values()) == started  # nothing more starts while paused
    client.resume(handle.id)
    assert handle.result(timeout=30) == [100, 101, 102, 103, 104]
    assert sum(calls.values()) == 5


@workflow(name="xcf_root_fan")
def root_fan(xs):  # type: ignore[no-untyped-def]
    return for_each(limited_free, over=xs, max_parallel=2)


@workflow(name="xcf_free")
def limited_free(x):  # type: ignore[no-untyped-def]
    return double(x)


@workflow(name="xcf_root_child")
def root_child(x):  # type: ignore[no-untyped-def]
    return child(limited_free, x)


@workflow(name="xcf_root_fan_quiet")
def root_fan_quiet(xs):  # type: ignore[no-untyped-def]
    got = for_each(gated_quiet, over=xs)
    define_result(got)


@workflow(name="xcf_child_quiet")
def child_quiet(x):  # type: ignore[no-untyped-def]
    define_result(child(gated_quiet, x))


def test_submit_many_with_root_child_and_root_fan_out_of_children(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*LEAF_HANDLERS, root_fan, root_child)
    fans = client.submit_many(root_fan, [[1, 2, 3], [], [4]])
    kids = client.submit_many(root_child, [5, 6])
    assert [h.result(timeout=30) for h in fans] == [[2, 4, 6], [], [8]]
    assert [h.result(timeout=30) for h in kids] == [10, 12]


def test_results_of_quiet_children_are_none(client: Client, start_worker: StartWorker) -> None:
    start_worker(*LEAF_HANDLERS, root_fan_quiet, child_quiet)
    empty = client.submit(root_fan_quiet, [])
    assert empty.result(timeout=20) is None
    one = client.submit(child_quiet, 1)
    kid = _open_child(client, one.id, "xcf_gated_quiet", 0)
    client.signal(kid, "go", 1)
    assert one.result(timeout=20) is None
