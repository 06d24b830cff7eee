"""for_each over a child workflow: one child run per item, through the public API."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from cyclone_dsl import (
    Client,
    InvalidGraph,
    RunFailed,
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

lock = threading.Lock()
running = 0
peak = 0
fixed = threading.Event()  # set: the bad region deploys too


@step(name="fec_regions")
def regions(n: int) -> list[str]:
    return [f"r{i}" for i in range(n)]


@step(name="fec_deploy", max_attempts=1)
def deploy(region: str) -> str:
    global running, peak
    with lock:
        running += 1
        peak = max(peak, running)
    time.sleep(0.02)
    with lock:
        running -= 1
    if region == "r3-bad" and not fixed.is_set():
        raise ValueError(f"cannot deploy {region}")
    return f"deployed {region}"


@step(name="fec_block")
def block(region: str) -> str:
    time.sleep(30)
    return region


@step(name="fec_report")
def report(results: list[str]) -> str:
    return "; ".join(results)


@workflow(name="fec_region")
def region_wf(region):  # type: ignore[no-untyped-def]
    return deploy(region)


@workflow(name="fec_region_quiet")
def region_quiet(region):  # type: ignore[no-untyped-def]
    deploy(region)


@workflow(name="fec_region_blocked")
def region_blocked(region):  # type: ignore[no-untyped-def]
    return block(region)


@workflow(name="fec_all")
def deploy_all(n):  # type: ignore[no-untyped-def]
    return for_each(region_wf, over=regions(n), max_parallel=2)


@workflow(name="fec_all_then_report")
def deploy_and_report(n):  # type: ignore[no-untyped-def]
    return report(for_each(region_wf, over=regions(n)))


@workflow(name="fec_static")
def deploy_static(_):  # type: ignore[no-untyped-def]
    return for_each(region_wf, over=["a", "r3-bad", "c"], max_parallel=1)


@workflow(name="fec_quiet")
def deploy_quiet(n):  # type: ignore[no-untyped-def]
    for_each(region_quiet, over=regions(n))


@workflow(name="fec_contained")
def deploy_contained(_):  # type: ignore[no-untyped-def]
    results = for_each(region_wf, over=["a", "r3-bad", "c"])
    report(results, on_dep_failure="cancel_branch")
    define_result(regions(1))


@workflow(name="fec_blocked_all")
def deploy_blocked(names):  # type: ignore[no-untyped-def]
    return for_each(region_blocked, over=names, max_parallel=2)


@workflow(name="fec_contained_blocked")
def contained_blocked(names):  # type: ignore[no-untyped-def]
    results = for_each(region_blocked, over=names, max_parallel=2)
    report(results, on_dep_failure="cancel_branch")
    return wait_signal("go")


@workflow(name="fec_nested")
def nested(n):  # type: ignore[no-untyped-def]
    return child(deploy_all, n)


HANDLERS = [regions, deploy, report]


def test_one_child_run_per_item_results_in_item_order(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    global peak
    peak = 0
    start_worker(*HANDLERS, region_wf, concurrency=16)
    handle = client.submit(deploy_all, 5)
    assert handle.result(timeout=30) == [f"deployed r{i}" for i in range(5)]
    children = client.list_runs(workflow="fec_region")
    assert sorted(c.parent_node_id or "" for c in children) == [
        f"fec_region[{i}]" for i in range(5)
    ]
    assert all(c.parent_run_id == handle.id and c.state is RunState.COMPLETED for c in children)
    assert peak <= 2  # max_parallel bounds the child runs open at once
    node = handle.get().step("fec_region")
    assert node.kind == "@child" and node.state is StepState.COMPLETED


def test_the_collected_results_feed_a_downstream_step(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS, region_wf, concurrency=8)
    handle = client.submit(deploy_and_report, 3)
    assert handle.result(timeout=30) == "deployed r0; deployed r1; deployed r2"


@pytest.mark.parametrize("n", [0, 1])
def test_small_lists(n: int, client: Client, start_worker: Callable[..., Worker]) -> None:
    start_worker(*HANDLERS, region_wf)
    assert client.submit(deploy_all, n).result(timeout=30) == [f"deployed r{i}" for i in range(n)]


def test_children_without_a_result_keep_no_output(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS, region_quiet)
    handle = client.submit(deploy_quiet, 3)
    assert handle.wait(timeout=30).state is RunState.COMPLETED
    assert handle.get().step("fec_region_quiet").output is None
    assert len(client.list_runs(workflow="fec_region_quiet")) == 3


def test_a_failed_child_fails_the_fan_out_and_starts_no_more(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS, region_wf)
    handle = client.submit(deploy_static, None)
    with pytest.raises(RunFailed):
        handle.result(timeout=30)
    node = handle.get().step("fec_region")
    assert node.state is StepState.DISCARDED and "fec_region[1]" in (node.error or "")
    started = sorted(c.parent_node_id or "" for c in client.list_runs(workflow="fec_region"))
    assert started == ["fec_region[0]", "fec_region[1]"]  # max_parallel=1: item 2 never ran


def test_a_contained_child_failure_cancels_the_branch_and_open_siblings(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS, region_wf)
    handle = client.submit(deploy_contained, None)
    assert handle.result(timeout=30) == ["r0"]
    run = handle.get()
    assert run.step("fec_region").state is StepState.DISCARDED
    assert run.step("fec_report").state is StepState.CANCELLED
    assert all(c.state.is_terminal for c in client.list_runs(workflow="fec_region"))


def test_a_failed_item_cancels_the_child_runs_still_open(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    handle = client.submit(deploy_blocked, ["a", "b", "c"])
    open_children = client.list_runs(workflow="fec_region_blocked")
    assert len(open_children) == 2  # max_parallel=2
    # Cancelling one child run fails its item, so the fan-out: its sibling is cancelled.
    client.cancel(open_children[0].id)
    with pytest.raises(RunFailed):
        handle.result(timeout=30)
    for c in client.list_runs(workflow="fec_region_blocked"):
        assert c.state is RunState.CANCELLED
        assert all(s.state.is_terminal for s in client.get_run(c.id).steps)


def test_a_contained_failure_cancels_the_open_sibling_runs_while_the_run_goes_on(
    client: Client,
) -> None:
    handle = client.submit(contained_blocked, ["a", "b", "c"])
    first, second = sorted(
        client.list_runs(workflow="fec_region_blocked"), key=lambda r: r.parent_node_id or ""
    )
    client.cancel(first.id)
    run = handle.get()
    assert run.state is RunState.RUNNING  # the signal wait keeps it going
    assert run.step("fec_region_blocked").state is StepState.DISCARDED
    assert run.step("fec_report").state is StepState.CANCELLED
    assert run.step("fec_region_blocked[1]").state is StepState.CANCELLED
    assert client.get_run(second.id).state is RunState.CANCELLED
    assert len(client.list_runs(workflow="fec_region_blocked")) == 2  # item 2 never started
    client.signal(handle.id, "go", None)
    assert handle.wait(timeout=30).state is RunState.COMPLETED


def test_cancel_reaches_every_child_run(client: Client) -> None:
    handle = client.submit(deploy_blocked, ["a", "b", "c", "d"])
    assert len(client.list_runs(workflow="fec_region_blocked")) == 2
    client.cancel(handle.id)
    assert handle.get().state is RunState.CANCELLED
    children = client.list_runs(workflow="fec_region_blocked")
    assert len(children) == 2 and all(c.state is RunState.CANCELLED for c in children)


def test_pause_and_resume_reach_every_child_run(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    handle = client.submit(deploy_all, 4)  # no worker yet: the regions step waits
    start_worker(regions)
    wait_until(lambda: len(client.list_runs(workflow="fec_region")) == 2, what="2 children")
    client.pause(handle.id)
    children = client.list_runs(workflow="fec_region")
    assert all(c.state is RunState.PAUSED for c in children)
    for c in children:  # their ready steps are paused: no worker can claim them
        assert [s.state for s in client.get_run(c.id).steps] == [StepState.PAUSED]
    start_worker(deploy, report, region_wf)
    client.resume(handle.id)
    assert handle.result(timeout=30) == [f"deployed r{i}" for i in range(4)]


def test_a_child_paused_on_its_own_stays_paused_when_the_parent_resumes(
    client: Client,
) -> None:
    handle = client.submit(deploy_blocked, ["a", "b"])
    first, second = client.list_runs(workflow="fec_region_blocked")
    client.pause(first.id)
    client.pause(handle.id)
    client.resume(handle.id)
    assert client.get_run(first.id).state is RunState.PAUSED
    assert client.get_run(second.id).state is RunState.RUNNING


def test_fan_out_of_children_inside_a_child(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS, region_wf, deploy_all, concurrency=8)
    assert client.submit(nested, 3).result(timeout=30) == [f"deployed r{i}" for i in range(3)]


def test_max_items_guards_a_fan_out_of_children(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    @workflow(name="fec_guarded")
    def guarded(n):  # type: ignore[no-untyped-def]
        return for_each(region_wf, over=regions(n), max_items=2)

    start_worker(*HANDLERS, region_wf)
    handle = client.submit(guarded, 3)
    with pytest.raises(RunFailed):
        handle.result(timeout=30)
    assert handle.get().step("fec_region").error_kind == "item_limit"
    assert client.list_runs(workflow="fec_region") == []


def test_for_each_refuses_what_is_not_a_step_or_workflow() -> None:
    @workflow(name="fec_bad")
    def bad(n):  # type: ignore[no-untyped-def]
        return for_each("deploy", over=regions(n))  # type: ignore[call-overload]

    with pytest.raises(InvalidGraph, match="for_each needs a @step, @action or @workflow"):
        _ = bad.graph


def test_retrying_the_fan_out_retries_the_failed_child_and_starts_the_rest(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    fixed.clear()
    start_worker(*HANDLERS, region_wf)
    handle = client.submit(deploy_static, None)
    with pytest.raises(RunFailed):
        handle.result(timeout=30)
    (failed_child,) = [
        c for c in client.list_runs(workflow="fec_region") if c.state is RunState.FAILED
    ]
    fixed.set()
    client.retry(handle.id, "fec_region")
    assert handle.result(timeout=30) == ["deployed a", "deployed r3-bad", "deployed c"]
    # The failed child run was retried in place (one child run per item, ever).
    assert client.get_run(failed_child.id).state is RunState.COMPLETED
    assert len(client.list_runs(workflow="fec_region")) == 3


def test_step_options_are_refused_on_a_fan_out_of_children() -> None:
    @workflow(name="fec_bad_options")
    def bad(n):  # type: ignore[no-untyped-def]
        return for_each(region_wf, over=regions(n), queue="io")

    with pytest.raises(InvalidGraph, match="takes no step options \\(queue\\)"):
        _ = bad.graph


# -- child runs that end as they start -------------------------------------------------------


@step(name="fec_double")
def double(x: int) -> int:
    return x * 2


@step(name="fec_empties")
def empties(n: int) -> list[list[int]]:
    return [[] for _ in range(n)]


@workflow(name="fec_empty_inner")
def empty_inner(x):  # type: ignore[no-untyped-def]
    return for_each(double, over=x)  # ends as it starts when its input is []


@workflow(name="fec_many_instant")
def many_instant(n):  # type: ignore[no-untyped-def]
    return for_each(empty_inner, over=empties(n), max_parallel=1)


@workflow(name="fec_many_instant_literal")
def many_instant_literal(_):  # type: ignore[no-untyped-def]
    return for_each(empty_inner, over=[[] for _ in range(100)], max_parallel=1)


def test_a_fan_out_of_child_runs_that_end_as_they_start_completes(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Each such child run ended inside its start, which started the next item from there:
    a call chain about 15 frames deep per item. Past about 65 items the completion raised
    RecursionError, the worker stopped (WorkerCrashed) and the run never ended."""
    start_worker(empties, double, empty_inner, many_instant)
    run = client.submit(many_instant, 100)
    assert run.result(timeout=20) == [[] for _ in range(100)]


def test_submitting_a_fan_out_of_child_runs_that_end_as_they_start_completes(
    client: Client,
) -> None:
    """The same from a literal list: the submit itself raised RecursionError."""
    handle = client.submit(many_instant_literal, None)
    assert handle.result(timeout=20) == [[] for _ in range(100)]


# -- a child run that fails as it starts -----------------------------------------------------


@workflow(name="fec_listy")
def listy(x):  # type: ignore[no-untyped-def]
    wait_signal("fec_hold")
    return for_each(double, over=x)  # fails as it starts (invalid_input) when x is no list


@workflow(name="fec_listy_fan")
def listy_fan(_):  # type: ignore[no-untyped-def]
    return for_each(listy, over=[5, [1], [2]])


def test_a_child_run_that_fails_as_it_starts_leaves_no_sibling_open(client: Client) -> None:
    """Item 0's child run failed inside its start, which failed the fan-out and the parent
    run and cancelled items 1 and 2; their child runs were started afterwards all the same,
    and stayed open (here waiting for a signal for ever) under the failed parent."""
    run = client.submit(listy_fan, None)
    assert run.get().state is RunState.FAILED
    assert [k.state for k in client.list_runs(workflow="fec_listy")] == [RunState.FAILED]
