"""for_each and child runs through the public API."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import pytest

from cyclone_dsl import (
    AlreadyTerminal,
    Client,
    RunFailed,
    Worker,
    action,
    child,
    for_each,
    step,
    wait_signal,
    workflow,
)
from cyclone_dsl.states import RunState, StepState

running = 0
peak = 0
lock = threading.Lock()
seen: list[int] = []


@step(name="fc_items")
def make_items(n: int) -> list[int]:
    return list(range(n))


@step(name="fc_not_a_list")
def not_a_list(n: int) -> dict[str, int]:
    return {"n": n}


@step(name="fc_square")
def square(x: int) -> int:
    global running, peak
    with lock:
        running += 1
        peak = max(peak, running)
    time.sleep(random.random() / 50)
    with lock:
        running -= 1
    return x * x


@step(name="fc_fail_on_three", max_attempts=1)
def fail_on_three(x: int) -> int:
    if x == 3:
        raise ValueError("three")
    return x


@action(name="fc_note")
def note(x: int) -> None:
    with lock:
        seen.append(x)


@step(name="fc_sum")
def total(values: list[int]) -> int:
    return sum(values)


@workflow(name="fc_fan")
def fan(n):  # type: ignore[no-untyped-def]
    return for_each(square, over=make_items(n))


@workflow(name="fc_fan_limited")
def fan_limited(n):  # type: ignore[no-untyped-def]
    return for_each(square, over=make_items(n), max_parallel=3)


@workflow(name="fc_fan_bytes")
def fan_bytes(n):  # type: ignore[no-untyped-def]
    return for_each(square, over=make_items(n), max_bytes=20)


@workflow(name="fc_fan_fail")
def fan_fail(n):  # type: ignore[no-untyped-def]
    return for_each(fail_on_three, over=make_items(n))


@workflow(name="fc_fan_action")
def fan_action(n):  # type: ignore[no-untyped-def]
    for_each(note, over=make_items(n))


@workflow(name="fc_fan_bad")
def fan_bad(n):  # type: ignore[no-untyped-def]
    return for_each(square, over=not_a_list(n))


@workflow(name="fc_inner")
def inner(n):  # type: ignore[no-untyped-def]
    return total(for_each(square, over=make_items(n)))


@workflow(name="fc_outer")
def outer(n):  # type: ignore[no-untyped-def]
    return child(inner, n)


@workflow(name="fc_grand")
def grand(n):  # type: ignore[no-untyped-def]
    return child(outer, n)


@workflow(name="fc_child_fails")
def child_fails(n):  # type: ignore[no-untyped-def]
    return child(fan_fail, n)


HANDLERS = [make_items, not_a_list, square, fail_on_three, note, total]


@pytest.mark.parametrize("n", [0, 1, 100])
def test_fan_out_outputs_in_input_order(
    n: int, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS, concurrency=16)
    assert client.submit(fan, n).result(timeout=30) == [i * i for i in range(n)]


def test_max_parallel_bounds_running_items(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    global peak
    peak = 0
    start_worker(*HANDLERS, concurrency=16)
    handle = client.submit(fan_limited, 30)
    assert handle.result(timeout=30) == [i * i for i in range(30)]
    assert 1 <= peak <= 3
    items = [s for s in handle.get().steps if s.item_of is not None]
    assert [s.item_index for s in items] == list(range(30))
    assert items[4].node == "fc_square[4]"


def test_max_bytes_fails_the_fan_out(client: Client, start_worker: Callable[..., Worker]) -> None:
    start_worker(*HANDLERS)
    handle = client.submit(fan_bytes, 20)
    with pytest.raises(RunFailed):
        handle.result(timeout=30)
    node = next(s for s in handle.get().steps if s.node == "fc_square")
    assert node.state is StepState.DISCARDED and node.error_kind == "output_limit"


def test_an_item_failing_for_good_fails_the_fan_out_and_the_run(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS)
    handle = client.submit(fan_fail, 6)
    with pytest.raises(RunFailed):
        handle.result(timeout=30)
    run = handle.get()
    assert run.step("fc_fail_on_three").state is StepState.DISCARDED
    assert run.step("fc_fail_on_three[3]").state is StepState.DISCARDED


def test_action_fan_out_keeps_no_output(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    seen.clear()
    start_worker(*HANDLERS)
    handle = client.submit(fan_action, 5)
    assert handle.wait(timeout=30).state is RunState.COMPLETED
    assert sorted(seen) == [0, 1, 2, 3, 4]
    assert handle.get().step("fc_note").output is None


def test_fan_out_over_a_non_list_is_a_clear_error(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS)
    handle = client.submit(fan_bad, 2)
    with pytest.raises(RunFailed):
        handle.result(timeout=30)
    node = handle.get().step("fc_square")
    assert node.error_kind == "invalid_input"
    assert "needs a JSON list" in (node.error or "")


def test_child_result_is_passed_up_through_grandchildren(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS, inner, outer, grand)
    handle = client.submit(grand, 4)
    assert handle.result(timeout=30) == 0 + 1 + 4 + 9
    children = client.list_runs(workflow="fc_outer")
    assert len(children) == 1 and children[0].parent_run_id == handle.id


def test_child_failure_fails_the_parent_node(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS, fan_fail)
    handle = client.submit(child_fails, 5)
    with pytest.raises(RunFailed):
        handle.result(timeout=30)
    node = handle.get().step("fc_fan_fail")
    assert node.kind == "@child"
    assert node.state is StepState.DISCARDED
    assert node.error_kind == "child_failed"
    (child_run,) = client.list_runs(workflow="fc_fan_fail")
    assert child_run.state is RunState.FAILED
    assert child_run.parent_run_id == handle.id and child_run.parent_node_id == "fc_fan_fail"


def test_one_purge_deletes_a_failed_parent_and_its_child_runs(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A child run is kept while its parent has not completed (a retry of the parent may
    need it), so a failed parent's children became purgeable only once the parent was
    deleted: one purge() left them behind, and its dry-run count left them out."""
    start_worker(*HANDLERS, fan_fail)
    handle = client.submit(child_fails, 5)
    with pytest.raises(RunFailed):
        handle.result(timeout=30)
    assert len(client.list_runs()) == 2
    assert client.count_purgeable() == 2
    assert client.purge(batch_size=1) == 2
    assert client.list_runs() == []
    assert client.count_purgeable() == 0


@step(name="fc_block")
def block(x: int) -> int:
    time.sleep(30)
    return x


@workflow(name="fc_blocked")
def blocked_wf(x):  # type: ignore[no-untyped-def]
    return block(x)


@workflow(name="fc_mid")
def mid(x):  # type: ignore[no-untyped-def]
    return child(blocked_wf, x)


@workflow(name="fc_top")
def top(x):  # type: ignore[no-untyped-def]
    return child(mid, x)


@workflow(name="fc_contained")
def contained(n):  # type: ignore[no-untyped-def]
    failing = child(fan_fail, n)
    total(failing, on_dep_failure="cancel_branch")
    return make_items(n)


def test_cancel_reaches_children_and_grandchildren(client: Client) -> None:
    handle = client.submit(top, 1)
    (middle,) = client.list_runs(workflow="fc_mid")
    (bottom,) = client.list_runs(workflow="fc_blocked")
    assert bottom.parent_run_id == middle.id and middle.parent_run_id == handle.id
    client.cancel(handle.id)
    for run_id in (handle.id, middle.id, bottom.id):
        run = client.get_run(run_id)
        assert run.state is RunState.CANCELLED
        assert all(s.state.is_terminal for s in run.steps)


def test_cancel_branch_contains_a_failing_child(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS, fan_fail)
    handle = client.submit(contained, 5)
    assert handle.result(timeout=30) == [0, 1, 2, 3, 4]
    run = handle.get()
    assert run.state is RunState.COMPLETED
    assert run.step("fc_fan_fail").error_kind == "child_failed"
    assert run.step("fc_sum").state is StepState.CANCELLED


def test_cancelling_a_child_run_fails_its_parent_node_not_the_parent_run(
    client: Client,
) -> None:
    handle = client.submit(top, 1)
    (middle,) = client.list_runs(workflow="fc_mid")
    (bottom,) = client.list_runs(workflow="fc_blocked")
    client.cancel(bottom.id)
    assert client.get_run(bottom.id).state is RunState.CANCELLED
    # The cancelled child fails its parent node, and each parent follows its failure policy:
    # the operator cancelled one run, not its ancestors.
    for run_id, node in ((middle.id, "fc_blocked"), (handle.id, "fc_mid")):
        run = client.get_run(run_id)
        assert run.state is RunState.FAILED
        assert run.step(node).error_kind == "child_failed"


def test_a_child_run_pauses_and_resumes_on_its_own(client: Client) -> None:
    handle = client.submit(top, 1)
    (middle,) = client.list_runs(workflow="fc_mid")
    client.pause(middle.id)
    assert client.get_run(middle.id).state is RunState.PAUSED
    assert client.get_run(handle.id).state is RunState.RUNNING
    client.resume(middle.id)
    assert client.get_run(middle.id).state is RunState.RUNNING
    client.pause(handle.id)  # the whole tree, then the whole tree again
    assert {r.state for r in client.list_runs()} == {RunState.PAUSED}
    client.resume(handle.id)
    assert {r.state for r in client.list_runs()} == {RunState.RUNNING}


@workflow(name="fc_signalled")
def signalled(_):  # type: ignore[no-untyped-def]
    return wait_signal("a")


@workflow(name="fc_signalled_parent")
def signalled_parent(_):  # type: ignore[no-untyped-def]
    child(signalled, None)
    return wait_signal("x")


def test_a_signal_to_an_ended_child_run_is_refused_while_its_parent_runs(
    client: Client,
) -> None:
    handle = client.submit(signalled_parent, None)
    (kid,) = client.list_runs(workflow="fc_signalled")
    client.signal(kid.id, "a", 1)
    assert client.get_run(kid.id).state is RunState.COMPLETED
    assert handle.get().state is RunState.RUNNING
    with pytest.raises(AlreadyTerminal):
        client.signal(kid.id, "a", 2)
