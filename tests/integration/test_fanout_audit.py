"""Audit of fan-out (``for_each``) at its edges: empty and one-item lists, odd element
values, inputs that are not lists, max_parallel with retries and failures, the max_items
and max_bytes guards at their exact boundaries, item failure with and without
``cancel_branch``, child-workflow items, nested and joined fan-outs, result order, cancel,
worker loss, progress counts and the async client. Public API only, on real PostgreSQL.

Every step and workflow here is named ``fa_...`` (names are global across the suite)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from cyclone_dsl import (
    AsyncClient,
    Client,
    Concurrency,
    Permanent,
    RunFailed,
    StepContext,
    Worker,
    action,
    define_result,
    for_each,
    step,
    wait_signal,
    workflow,
)
from cyclone_dsl.states import RunState, StepState
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]

# -- shared state the handlers report into ------------------------------------------------

_lock = threading.Lock()
#: (tag, value, what, attempt) in the order the handlers did it.
events: list[tuple[str, Any, str, int]] = []
#: (tag, value) -> whether ctx.wait_cancelled() returned True (the item was told to stop).
told: dict[tuple[str, Any], bool] = {}
#: gate name -> event an item waits on before it returns.
gates: dict[str, threading.Event] = {}
#: values the echo handler received, by tag of the test.
received: list[Any] = []


def _log(tag: str, value: Any, what: str, attempt: int) -> None:
    with _lock:
        events.append((tag, value, what, attempt))


def _of(tag: str) -> list[tuple[Any, str, int]]:
    with _lock:
        return [(v, w, a) for t, v, w, a in events if t == tag]


def _started(tag: str) -> set[Any]:
    return {v for v, w, _ in _of(tag) if w == "start"}


def _gate(name: str) -> threading.Event:
    with _lock:
        return gates.setdefault(name, threading.Event())


@pytest.fixture(autouse=True)
def _clean_state() -> Iterator[None]:
    with _lock:
        events.clear()
        told.clear()
        gates.clear()
        received.clear()
    yield
    with _lock:
        for gate in gates.values():  # never leave a handler blocked behind a test
            gate.set()


def _act(spec: dict[str, Any], ctx: StepContext) -> Any:
    """One item, as its spec says: ``v`` (its output), ``sleep`` (seconds), ``fail`` (the
    number of attempts that raise), ``perm`` (raise Permanent), ``await_started`` (values of
    the same tag that must have started first), ``block`` (wait that long to be told to
    stop), ``gate`` (wait for that gate)."""
    tag, value = spec["tag"], spec.get("v")
    _log(tag, value, "start", ctx.attempt)
    if "await_started" in spec:
        wanted = set(spec["await_started"])
        deadline = time.monotonic() + 10
        while not wanted <= _started(tag) and time.monotonic() < deadline:
            time.sleep(0.01)
    if spec.get("sleep"):
        time.sleep(spec["sleep"])
    if "gate" in spec:
        _gate(spec["gate"]).wait(15)
    if ctx.attempt <= spec.get("fail", 0):
        _log(tag, value, "fail", ctx.attempt)
        raise RuntimeError(f"item {value} fails attempt {ctx.attempt}")
    if spec.get("perm"):
        _log(tag, value, "fail", ctx.attempt)
        raise Permanent(f"item {value} fails for good")
    if spec.get("block"):
        got = ctx.wait_cancelled(spec["block"])
        with _lock:
            told[(tag, value)] = got
    _log(tag, value, "end", ctx.attempt)
    return value


# -- steps ---------------------------------------------------------------------------------


@step(name="fa_item", max_attempts=3)
def item(spec: dict[str, Any], ctx: StepContext) -> Any:
    return _act(spec, ctx)


@step(name="fa_item_once", max_attempts=1)
def item_once(spec: dict[str, Any], ctx: StepContext) -> Any:
    return _act(spec, ctx)


@step(name="fa_echo")
def echo(value: Any) -> Any:
    with _lock:
        received.append(value)
    return value


@step(name="fa_value")
def value_of(value: Any) -> Any:
    return value


@step(name="fa_range")
def make_range(n: int) -> list[int]:
    return list(range(n))


@step(name="fa_square")
def square(x: int) -> int:
    return x * x


@step(name="fa_sum")
def total(values: list[int]) -> int:
    return sum(values)


@step(name="fa_join")
def join(a: Any, b: Any) -> list[Any]:
    return [a, b]


@step(name="fa_describe")
def describe(value: Any) -> str:
    return repr(value)


@action(name="fa_note")
def note(x: Any) -> None:
    with _lock:
        received.append(x)


@step(name="fa_lossy", max_attempts=3)
def lossy(x: int, ctx: StepContext) -> int:
    """Blocks for ever in a worker process started with FA_VICTIM (it is killed there)."""
    if os.environ.get("FA_VICTIM"):
        time.sleep(120)
    _log("lossy", x, "start", ctx.attempt)
    return x * 10


STEPS = (item, item_once, echo, value_of, make_range, square, total, join, describe, note)

# -- workflows -----------------------------------------------------------------------------


@workflow(name="fa_echo_input")
def echo_input(values):  # type: ignore[no-untyped-def]
    return for_each(echo, over=values)


@workflow(name="fa_echo_output")
def echo_output(values):  # type: ignore[no-untyped-def]
    return for_each(echo, over=value_of(values))


@workflow(name="fa_echo_then_describe")
def echo_then_describe(values):  # type: ignore[no-untyped-def]
    return describe(for_each(echo, over=value_of(values)))


@workflow(name="fa_over_action")
def over_action(x):  # type: ignore[no-untyped-def]
    return for_each(echo, over=note(x))


@workflow(name="fa_items_serial")
def items_serial(specs):  # type: ignore[no-untyped-def]
    return for_each(item, over=value_of(specs), max_parallel=1)


@workflow(name="fa_items_two")
def items_two(specs):  # type: ignore[no-untyped-def]
    return for_each(item, over=value_of(specs), max_parallel=2)


@workflow(name="fa_items_once_serial")
def items_once_serial(specs):  # type: ignore[no-untyped-def]
    return for_each(item_once, over=specs, max_parallel=1)


@workflow(name="fa_items_once_three")
def items_once_three(specs):  # type: ignore[no-untyped-def]
    return for_each(item_once, over=value_of(specs), max_parallel=3)


@workflow(name="fa_items_once_contained")
def items_once_contained(specs):  # type: ignore[no-untyped-def]
    fanned = for_each(item_once, over=value_of(specs), max_parallel=3)
    describe(fanned, on_dep_failure="cancel_branch")
    define_result(value_of.named("fa_other")("other branch"))


@workflow(name="fa_items_free")
def items_free(specs):  # type: ignore[no-untyped-def]
    return for_each(item, over=specs)


@workflow(name="fa_items_gated")
def items_gated(specs):  # type: ignore[no-untyped-def]
    return for_each(item, over=value_of(specs), max_parallel=2)


@workflow(name="fa_items_root_two")
def items_root_two(specs):  # type: ignore[no-untyped-def]
    return for_each(item, over=specs, max_parallel=2)


def _limited(limit: int) -> Any:
    @workflow(name=f"fa_max_items_{limit}")
    def limited(n):  # type: ignore[no-untyped-def]
        return for_each(square, over=make_range(n), max_items=limit)

    return limited


LIMITED = {limit: _limited(limit) for limit in (1, 3)}


@workflow(name="fa_max_items_root")
def limited_root(values):  # type: ignore[no-untyped-def]
    return for_each(square, over=values, max_items=2)


#: Values whose collected output is exactly BYTES_EXACT bytes, measured as Cyclone measures
#: every other payload (payload.encode: compact JSON, UTF-8): 45 bytes. PostgreSQL's jsonb
#: text of the same list has a space after each comma: 47 bytes (it was counted so before).
BYTES_VALUES = ["a" * 10, "b" * 20, "c" * 5]
BYTES_EXACT = len(json.dumps(BYTES_VALUES, separators=(",", ":")).encode())


def _bytes_limited(limit: int) -> Any:
    @workflow(name=f"fa_max_bytes_{limit}")
    def bytes_limited(values):  # type: ignore[no-untyped-def]
        return for_each(echo, over=value_of(values), max_bytes=limit)

    return bytes_limited


BYTES_LIMITED = {limit: _bytes_limited(limit) for limit in (BYTES_EXACT, BYTES_EXACT - 1)}


@workflow(name="fa_nested")
def nested(sizes):  # type: ignore[no-untyped-def]
    ranges = for_each(make_range, over=value_of(sizes))
    return for_each(total, over=ranges)


@workflow(name="fa_nested_squares")
def nested_squares(sizes):  # type: ignore[no-untyped-def]
    ranges = for_each(make_range, over=sizes)
    return total(for_each(total, over=ranges))


@workflow(name="fa_over_action_fan_out")
def over_action_fan_out(values):  # type: ignore[no-untyped-def]
    return for_each(echo, over=for_each(note, over=values))


@workflow(name="fa_two_joined")
def two_joined(n):  # type: ignore[no-untyped-def]
    a = for_each(square, over=make_range(n), max_parallel=1)
    b = for_each(square, over=make_range.named("fa_range_b")(value_of(n)), max_parallel=2)
    return join(a, b)


@workflow(name="fa_two_joined_empty")
def two_joined_empty(n):  # type: ignore[no-untyped-def]
    a = for_each(square, over=make_range(n))
    b = for_each(square, over=[])
    return join(a, b)


@workflow(name="fa_action_fan_out")
def action_fan_out(values):  # type: ignore[no-untyped-def]
    return describe(for_each(note, over=value_of(values)))


@workflow(name="fa_kid")
def kid(spec):  # type: ignore[no-untyped-def]
    return item_once(spec)


@workflow(name="fa_kid_waits")
def kid_waits(x):  # type: ignore[no-untyped-def]
    return join(x, wait_signal("fa_kid_go"))


@workflow(name="fa_kids")
def kids(specs):  # type: ignore[no-untyped-def]
    return for_each(kid, over=value_of(specs), max_parallel=3)


@workflow(name="fa_kids_contained")
def kids_contained(specs):  # type: ignore[no-untyped-def]
    fanned = for_each(kid, over=value_of(specs), max_parallel=3)
    describe(fanned, on_dep_failure="cancel_branch")
    define_result(value_of.named("fa_kids_other")("kept"))


@workflow(name="fa_kids_waiting")
def kids_waiting(xs):  # type: ignore[no-untyped-def]
    return for_each(kid_waits, over=xs)


@workflow(name="fa_kids_waiting_serial")
def kids_waiting_serial(xs):  # type: ignore[no-untyped-def]
    return for_each(kid_waits, over=xs, max_parallel=1)


@workflow(name="fa_lossy_all")
def lossy_all(n):  # type: ignore[no-untyped-def]
    return for_each(lossy, over=make_range(n), max_parallel=1)


# -- helpers -------------------------------------------------------------------------------


def _specs(tag: str, *specs: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"tag": tag, "v": i, **s} for i, s in enumerate(specs)]


def _items(run: Any, node: str) -> list[Any]:
    return sorted((s for s in run.steps if s.item_of == node), key=lambda s: s.item_index)


def _in_flight_peak(tag: str) -> int:
    """The most items of a tag that were between their start and their end (or failure)."""
    peak = running = 0
    for _, what, _ in _of(tag):
        running += 1 if what == "start" else -1
        peak = max(peak, running)
    return peak


# -- empty, one, odd values ----------------------------------------------------------------


@pytest.mark.parametrize("wf", [echo_input, echo_output], ids=["run_input", "node_output"])
def test_an_empty_list_completes_with_an_empty_list(
    wf: Any, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(wf, [])
    assert handle.result(timeout=20) == []
    run = handle.get()
    assert run.state is RunState.COMPLETED
    assert _items(run, "fa_echo") == []
    assert received == []


def test_an_empty_list_at_submit_ends_the_run_with_no_worker(client: Client) -> None:
    handle = client.submit(echo_input, [])
    run = handle.get()
    assert run.state is RunState.COMPLETED
    assert handle.result(timeout=5) == []


def test_an_empty_fan_out_feeds_its_downstream_step(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    assert client.submit(echo_then_describe, []).result(timeout=20) == "[]"


@pytest.mark.parametrize("wf", [echo_input, echo_output], ids=["run_input", "node_output"])
def test_one_item(wf: Any, client: Client, start_worker: Callable[..., Worker]) -> None:
    start_worker(*STEPS)
    handle = client.submit(wf, [{"k": 1}])
    assert handle.result(timeout=20) == [{"k": 1}]
    (only,) = _items(handle.get(), "fa_echo")
    assert (only.node, only.item_index, only.state) == ("fa_echo[0]", 0, StepState.COMPLETED)


def test_a_list_of_none_gives_none_to_each_item_and_keeps_them(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(echo_output, [None, None, None])
    assert handle.result(timeout=20) == [None, None, None]
    assert received == [None, None, None]
    assert [s.state for s in _items(handle.get(), "fa_echo")] == [StepState.COMPLETED] * 3


NESTED_VALUES: list[Any] = [
    [1, [2, [3, []]]],
    {"a": {"b": [None, {"c": "d"}]}, "": 0},
    "",
    0,
    False,
    True,
    -1.5,
    {},
    [],
    "snow \u2603 and quotes \" ' \\ %s",
]


def test_nested_and_falsy_values_go_through_unchanged_and_in_order(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS, concurrency=8)
    handle = client.submit(echo_output, NESTED_VALUES)
    assert handle.result(timeout=20) == NESTED_VALUES
    key = lambda v: json.dumps(v, sort_keys=True)  # noqa: E731
    assert sorted(map(key, received)) == sorted(map(key, NESTED_VALUES))


def test_large_strings(client: Client, start_worker: Callable[..., Worker]) -> None:
    values = [chr(ord("a") + i) * 400_000 for i in range(4)]
    start_worker(*STEPS, concurrency=4)
    handle = client.submit(echo_output, values)
    assert handle.result(timeout=30) == values


def test_many_items_none_lost(client: Client, start_worker: Callable[..., Worker]) -> None:
    start_worker(*STEPS, concurrency=16)
    values = list(range(300))
    handle = client.submit(echo_output, values)
    assert handle.result(timeout=60) == values
    assert len(_items(handle.get(), "fa_echo")) == 300


# -- inputs that are not lists -------------------------------------------------------------


@pytest.mark.parametrize(
    "value", [{"a": 1}, "abc", 5, 0, None, True, 1.5], ids=lambda v: type(v).__name__
)
def test_a_node_output_that_is_not_a_list_fails_with_invalid_input(
    value: Any, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(echo_output, value)
    run = handle.wait(timeout=20)
    assert run.state is RunState.FAILED
    node = run.step("fa_echo")
    assert (node.state, node.error_kind) == (StepState.DISCARDED, "invalid_input")
    assert _items(run, "fa_echo") == [] and received == []


@pytest.mark.parametrize("value", [{"a": [1]}, "abc", 7, None], ids=lambda v: type(v).__name__)
def test_a_run_input_that_is_not_a_list_fails_at_submit(value: Any, client: Client) -> None:
    handle = client.submit(echo_input, value)
    run = handle.get()  # no worker: the root fan-out is judged in the submit
    assert run.state is RunState.FAILED
    assert run.step("fa_echo").error_kind == "invalid_input"
    with pytest.raises(RunFailed):
        handle.result(timeout=5)


def test_a_fan_out_over_an_actions_missing_output_fails_with_invalid_input(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    run = client.submit(over_action, [1, 2]).wait(timeout=20)
    assert run.state is RunState.FAILED
    assert run.step("fa_echo").error_kind == "invalid_input"


def test_a_fan_out_over_an_action_fan_out_fails_with_invalid_input(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    run = client.submit(over_action_fan_out, [1, 2]).wait(timeout=20)
    assert run.state is RunState.FAILED
    assert run.step("fa_note").state is StepState.COMPLETED
    assert run.step("fa_echo").error_kind == "invalid_input"


# -- max_parallel with failures and retries ------------------------------------------------


def test_max_parallel_one_waits_for_a_retried_item_to_succeed(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS, concurrency=4)
    specs = _specs("mp1", {"fail": 1}, {}, {})
    handle = client.submit(items_serial, specs)
    assert handle.result(timeout=30) == [0, 1, 2]
    assert _of("mp1") == [
        (0, "start", 1),
        (0, "fail", 1),
        (0, "start", 2),
        (0, "end", 2),
        (1, "start", 1),
        (1, "end", 1),
        (2, "start", 1),
        (2, "end", 1),
    ]
    first = _items(handle.get(), "fa_item")[0]
    assert (first.attempt_number, [a.outcome for a in first.attempts]) == (2, ["retried"])


def test_max_parallel_two_with_retries_never_runs_three(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS, concurrency=8)
    specs = _specs("mp2", {"fail": 1, "sleep": 0.05}, {"sleep": 0.1}, {"fail": 1}, {}, {})
    handle = client.submit(items_two, specs)
    assert handle.result(timeout=30) == [0, 1, 2, 3, 4]
    assert _in_flight_peak("mp2") <= 2
    assert {v for v, w, _ in _of("mp2") if w == "end"} == {0, 1, 2, 3, 4}


def test_max_parallel_one_item_failing_for_good_starts_no_more(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(items_once_serial, _specs("mp1f", {}, {"perm": True}, {}, {}))
    with pytest.raises(RunFailed):
        handle.result(timeout=20)
    run = handle.get()
    assert run.state is RunState.FAILED
    assert [s.state for s in _items(run, "fa_item_once")] == [
        StepState.COMPLETED,
        StepState.DISCARDED,
        StepState.CANCELLED,
        StepState.CANCELLED,
    ]
    assert _started("mp1f") == {0, 1}
    node = run.step("fa_item_once")
    assert node.state is StepState.DISCARDED and "fa_item_once[1]" in (node.error or "")


# -- max_items and max_bytes at their boundaries -------------------------------------------


@pytest.mark.parametrize(("n", "limit"), [(1, 1), (3, 3), (0, 1)])
def test_max_items_lets_exactly_the_limit_through(
    n: int, limit: int, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(LIMITED[limit], n)
    assert handle.result(timeout=20) == [i * i for i in range(n)]


@pytest.mark.parametrize(("n", "limit"), [(2, 1), (4, 3)])
def test_max_items_one_over_the_limit_fails_before_any_item(
    n: int, limit: int, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(LIMITED[limit], n)
    run = handle.wait(timeout=20)
    assert run.state is RunState.FAILED
    node = run.step("fa_square")
    assert (node.state, node.error_kind) == (StepState.DISCARDED, "item_limit")
    assert _items(run, "fa_square") == []


def test_max_items_on_a_root_fan_out_is_judged_at_submit(client: Client) -> None:
    assert client.submit(limited_root, [1, 2]).get().state is RunState.RUNNING
    run = client.submit(limited_root, [1, 2, 3]).get()
    assert run.state is RunState.FAILED
    assert run.step("fa_square").error_kind == "item_limit"
    assert _items(run, "fa_square") == []


def test_max_bytes_lets_exactly_the_limit_through(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(BYTES_LIMITED[BYTES_EXACT], BYTES_VALUES)
    assert handle.result(timeout=20) == BYTES_VALUES


def test_max_bytes_one_byte_under_fails_with_output_limit(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(BYTES_LIMITED[BYTES_EXACT - 1], BYTES_VALUES)
    run = handle.wait(timeout=20)
    assert run.state is RunState.FAILED
    node = run.step("fa_echo")
    assert (node.state, node.error_kind, node.output) == (
        StepState.DISCARDED,
        "output_limit",
        None,
    )
    assert f"over its max_bytes of {BYTES_EXACT - 1}" in (node.error or "")


# -- item failure: default policy and cancel_branch ----------------------------------------


def _failing_with_running_siblings(tag: str) -> list[dict[str, Any]]:
    """Items 0 and 2 run until told to stop; item 1 fails once they run; item 3 waits."""
    return _specs(tag, {"block": 10}, {"perm": True, "await_started": [0, 2]}, {"block": 10}, {})


def test_an_item_failing_fails_the_run_and_tells_running_siblings(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS, concurrency=4)
    handle = client.submit(items_once_three, _failing_with_running_siblings("dflt"))
    run = handle.wait(timeout=20)
    assert run.state is RunState.FAILED
    assert run.step("fa_item_once").state is StepState.DISCARDED
    assert [s.state for s in _items(run, "fa_item_once")] == [
        StepState.CANCELLED,
        StepState.DISCARDED,
        StepState.CANCELLED,
        StepState.CANCELLED,
    ]
    wait_until(lambda: len(told) == 2, timeout=10, what="both running siblings to return")
    assert told == {("dflt", 0): True, ("dflt", 2): True}
    assert 3 not in _started("dflt")
    # Their late returns are fenced: the items stay cancelled.
    late = _items(handle.get(), "fa_item_once")
    assert (late[0].state, late[2].state) == (StepState.CANCELLED, StepState.CANCELLED)


def test_an_item_failing_under_cancel_branch_cancels_the_rest_and_the_run_goes_on(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS, concurrency=4)
    handle = client.submit(items_once_contained, _failing_with_running_siblings("cb"))
    assert handle.result(timeout=20) == "other branch"
    run = handle.get()
    assert run.state is RunState.COMPLETED
    assert run.step("fa_item_once").state is StepState.DISCARDED
    assert run.step("fa_describe").state is StepState.CANCELLED
    assert [s.state for s in _items(run, "fa_item_once")] == [
        StepState.CANCELLED,
        StepState.DISCARDED,
        StepState.CANCELLED,
        StepState.CANCELLED,
    ]
    wait_until(lambda: len(told) == 2, timeout=10, what="both running siblings to return")
    assert told == {("cb", 0): True, ("cb", 2): True}
    assert 3 not in _started("cb")
    done, total_ = client.progress(handle.id)
    assert done == total_


# -- child workflow items ------------------------------------------------------------------


def test_a_failing_child_item_fails_the_run_and_cancels_open_children(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS, kid, concurrency=4)
    handle = client.submit(kids, _failing_with_running_siblings("kid"))
    run = handle.wait(timeout=20)
    assert run.state is RunState.FAILED
    node = run.step("fa_kid")
    assert node.state is StepState.DISCARDED and "fa_kid[1]" in (node.error or "")
    children = {c.parent_node_id: c.state for c in client.list_runs(workflow="fa_kid")}
    assert children == {
        "fa_kid[0]": RunState.CANCELLED,
        "fa_kid[1]": RunState.FAILED,
        "fa_kid[2]": RunState.CANCELLED,
    }
    wait_until(lambda: len(told) == 2, timeout=10, what="both running children to return")
    assert told == {("kid", 0): True, ("kid", 2): True}


def test_a_failing_child_item_under_cancel_branch_lets_the_run_complete(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS, kid, concurrency=4)
    handle = client.submit(kids_contained, _failing_with_running_siblings("kidcb"))
    assert handle.result(timeout=20) == "kept"
    run = handle.get()
    assert run.step("fa_kid").state is StepState.DISCARDED
    assert run.step("fa_describe").state is StepState.CANCELLED
    assert all(c.state.is_terminal for c in client.list_runs(workflow="fa_kid"))
    assert len(client.list_runs(workflow="fa_kid")) == 3  # item 3 never started its run
    wait_until(lambda: len(told) == 2, timeout=10, what="both running children to return")
    assert told == {("kidcb", 0): True, ("kidcb", 2): True}


def _kid_runs(client: Client) -> dict[int, int]:
    """item index -> child run id of the fa_kid_waits runs."""
    return {
        int((c.parent_node_id or "")[len("fa_kid_waits[") : -1]): c.id
        for c in client.list_runs(workflow="fa_kid_waits")
    }


def test_children_waiting_for_signals_answered_in_reverse_give_results_in_item_order(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS, kid_waits)
    handle = client.submit(kids_waiting, ["a", "b", "c"])
    runs = wait_until(lambda: len(_kid_runs(client)) == 3 and _kid_runs(client), what="3 kids")
    for index in (2, 1, 0):
        client.signal(runs[index], "fa_kid_go", index * 10)
    assert handle.result(timeout=20) == [["a", 0], ["b", 10], ["c", 20]]


def test_serial_children_start_one_at_a_time_as_signals_end_them(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS, kid_waits)
    handle = client.submit(kids_waiting_serial, ["a", "b", "c"])
    for index in range(3):
        runs = wait_until(
            lambda i=index: len(_kid_runs(client)) == i + 1 and _kid_runs(client),
            what=f"kid {index}",
        )
        assert all(
            client.get_run(r).state is RunState.COMPLETED for i, r in runs.items() if i < index
        )
        client.signal(runs[index], "fa_kid_go", index)
    assert handle.result(timeout=20) == [["a", 0], ["b", 1], ["c", 2]]
    assert (d := client.progress(handle.id))[0] == d[1]


def test_cancelling_a_child_waiting_for_a_signal_fails_the_fan_out(client: Client) -> None:
    handle = client.submit(kids_waiting, ["a", "b"])
    runs = _kid_runs(client)
    assert sorted(runs) == [0, 1]
    client.cancel(runs[1])
    run = handle.wait(timeout=20)
    assert run.state is RunState.FAILED
    assert run.step("fa_kid_waits").state is StepState.DISCARDED
    assert client.get_run(runs[0]).state is RunState.CANCELLED


# -- nested and joined fan-outs, order -----------------------------------------------------


def test_a_fan_out_over_the_output_of_another(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS, concurrency=8)
    assert client.submit(nested, [3, 0, 1, 4]).result(timeout=20) == [3, 0, 0, 6]
    assert client.submit(nested, []).result(timeout=20) == []
    assert client.submit(nested_squares, [0, 0]).result(timeout=20) == 0
    assert client.submit(nested_squares, [2, 5]).result(timeout=20) == 11


def test_two_fan_outs_in_parallel_join_into_one_step(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS, concurrency=8)
    assert client.submit(two_joined, 4).result(timeout=20) == [[0, 1, 4, 9], [0, 1, 4, 9]]
    assert client.submit(two_joined, 0).result(timeout=20) == [[], []]
    assert client.submit(two_joined_empty, 3).result(timeout=20) == [[0, 1, 4], []]


def test_results_follow_input_order_when_items_finish_in_reverse(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS, concurrency=8)
    specs = _specs("order", *({"sleep": 0.08 * (5 - i)} for i in range(6)))
    handle = client.submit(items_free, specs)
    assert handle.result(timeout=20) == [0, 1, 2, 3, 4, 5]
    ended = [v for v, w, _ in _of("order") if w == "end"]
    assert ended == [5, 4, 3, 2, 1, 0]  # they did finish in reverse


def test_an_action_fan_out_keeps_no_output(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(action_fan_out, [1, 2, 3])
    assert handle.result(timeout=20) == "None"
    assert sorted(received) == [1, 2, 3]
    run = handle.get()
    assert run.step("fa_note").output is None
    assert client.submit(action_fan_out, []).result(timeout=20) == "None"


# -- cancel, pause, worker loss ------------------------------------------------------------


def test_cancelling_the_run_mid_fan_out_tells_running_items_and_starts_no_more(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS, concurrency=4)
    handle = client.submit(items_root_two, _specs("cx", {"block": 10}, {"block": 10}, {}, {}))
    wait_until(lambda: _started("cx") == {0, 1}, what="two items running")
    client.cancel(handle.id)
    run = handle.get()
    assert run.state is RunState.CANCELLED
    assert [s.state for s in _items(run, "fa_item")] == [StepState.CANCELLED] * 4
    wait_until(lambda: len(told) == 2, timeout=10, what="both running items to return")
    assert told == {("cx", 0): True, ("cx", 1): True}
    time.sleep(0.5)
    assert _started("cx") == {0, 1}
    assert [s.state for s in _items(handle.get(), "fa_item")] == [StepState.CANCELLED] * 4
    done, total_ = client.progress(handle.id)
    assert done == total_ == 5


def test_pause_mid_fan_out_starts_nothing_until_resumed(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS, concurrency=4)
    handle = client.submit(items_root_two, _specs("pz", {"gate": "pz0"}, {"gate": "pz1"}, {}, {}))
    wait_until(lambda: _started("pz") == {0, 1}, what="two items running")
    client.pause(handle.id)
    _gate("pz0").set()
    _gate("pz1").set()
    wait_until(
        lambda: [s.state for s in _items(handle.get(), "fa_item")][:2] == [StepState.COMPLETED] * 2,
        what="the running items to complete",
    )
    time.sleep(0.5)
    assert _started("pz") == {0, 1}
    assert handle.get().state is RunState.PAUSED
    client.resume(handle.id)
    assert handle.result(timeout=20) == [0, 1, 2, 3]


def test_a_worker_stopped_mid_item_loses_nothing(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """The first worker stops past its grace with item 1 held: the item goes back, a second
    worker runs it, and the first handler's late return is fenced."""
    first = start_worker(*STEPS, grace=0.2, concurrency=4)
    handle = client.submit(items_serial, _specs("stop", {}, {"gate": "stop1"}, {}))
    wait_until(lambda: 1 in _started("stop"), what="item 1 to start")
    first.stop()
    second = start_worker(*STEPS, concurrency=4)
    wait_until(lambda: len([e for e in _of("stop") if e[:2] == (1, "start")]) == 2, what="rerun")
    _gate("stop1").set()
    assert handle.result(timeout=20) == [0, 1, 2]
    assert second is not first
    run = handle.get()
    assert all(s.state is StepState.COMPLETED for s in _items(run, "fa_item"))
    assert [v for v, w, _ in _of("stop") if w == "start"].count(2) == 1


def _victim(dsn: str) -> subprocess.Popen[str]:
    code = (
        "import sys\n"
        "from cyclone_dsl import Worker\n"
        "from tests.integration import test_fanout_audit as m\n"
        "Worker(sys.argv[1], [m.lossy, m.make_range], lease=1.0, poll_interval=0.1,\n"
        "       scan_interval=60, grace=30, concurrency=2).run()\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, dsn],
        cwd=ROOT,
        env={**os.environ, "FA_VICTIM": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )


@pytest.mark.timeout(60)
def test_a_worker_killed_mid_item_is_taken_over_after_its_lease(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    handle = client.submit(lossy_all, 3)
    victim = _victim(cyclone_dsn)
    try:
        wait_until(
            lambda: any(s.state is StepState.RUNNING for s in _items(handle.get(), "fa_lossy")),
            timeout=30,
            what="the victim to hold item 0",
        )
        held = [s for s in _items(handle.get(), "fa_lossy") if s.state is StepState.RUNNING]
        assert [s.item_index for s in held] == [0]
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(10)
    start_worker(lossy, make_range, lease=5.0)
    assert handle.result(timeout=20) == [0, 10, 20]
    items = _items(handle.get(), "fa_lossy")
    assert items[0].reclaims == 1
    assert [s.reclaims for s in items[1:]] == [0, 0]
    assert [v for v, w, _ in _of("lossy") if w == "start"] == [0, 1, 2]


# -- progress and the async client ---------------------------------------------------------


def test_progress_counts_items_as_they_end(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    specs = _specs("pg", {"gate": "pg0"}, {"gate": "pg1"}, {"gate": "pg2"})
    handle = client.submit(items_gated, specs)
    assert client.progress(handle.id) == (0, 2)  # the source step and the fan-out node
    start_worker(*STEPS, concurrency=4)
    wait_until(lambda: _started("pg") == {0, 1}, what="two items running")
    assert client.progress(handle.id) == (1, 5)
    _gate("pg0").set()
    wait_until(lambda: client.progress(handle.id) == (2, 5), what="item 0 counted")
    _gate("pg1").set()
    _gate("pg2").set()
    assert handle.result(timeout=20) == [0, 1, 2]
    assert client.progress(handle.id) == (5, 5)


def test_progress_of_failed_and_guarded_fan_outs_ends_complete(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    guarded = client.submit(LIMITED[1], 5)
    guarded.wait(timeout=20)
    assert client.progress(guarded.id) == (2, 2)
    failed = client.submit(items_once_serial, _specs("pgf", {"perm": True}, {}, {}))
    failed.wait(timeout=20)
    assert client.progress(failed.id) == (4, 4)


def test_the_async_client_runs_a_fan_out(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS, kid_waits, concurrency=4)

    async def main() -> tuple[Any, Any, tuple[int, int], Any, list[Any]]:
        async with AsyncClient(cyclone_dsn) as aclient:
            plain = await aclient.submit(nested, [2, 3])
            empty = await aclient.submit(echo_input, [])
            waiting = await aclient.submit(kids_waiting, ["x", "y"])
            kids_ = []
            for _ in range(200):
                kids_ = await aclient.list_runs(workflow="fa_kid_waits")
                if len(kids_) == 2:
                    break
                await asyncio.sleep(0.05)
            for k in sorted(kids_, key=lambda r: r.parent_node_id or "", reverse=True):
                await aclient.signal(k.id, "fa_kid_go", k.parent_node_id)
            result = await plain.result(timeout=20)
            progress = await aclient.progress(plain.id)
            bad = await aclient.submit(echo_input, {"not": "a list"})
            bad_run = await bad.wait(timeout=20)
            return (
                result,
                await empty.result(timeout=20),
                progress,
                bad_run.state,
                await waiting.result(timeout=20),
            )

    result, empty, progress, bad_state, waited = asyncio.run(main())
    assert result == [1, 3]
    assert empty == []
    assert progress == (7, 7)  # fa_value, two fan-out nodes and their 2 + 2 items
    assert bad_state is RunState.FAILED
    assert waited == [["x", "fa_kid_waits[0]"], ["y", "fa_kid_waits[1]"]]


# -- more edges: timeouts, async items, conditions, signals, pause before expansion ----------


# 1.5 s: the attempts that do not overrun it must return within it on a loaded machine too.
@step(name="fa_slow_once", max_attempts=2, timeout=1.5)
def slow_once(spec: dict[str, Any], ctx: StepContext) -> Any:
    """Overruns its timeout on the first attempt (and then looks at ctx), not the second."""
    _log(spec["tag"], spec["v"], "start", ctx.attempt)
    if ctx.attempt == 1 and spec.get("slow"):
        ctx.wait_cancelled(5)
    _log(spec["tag"], spec["v"], "end", ctx.attempt)
    return spec["v"]


@step(name="fa_async_item", max_attempts=1)
async def async_item(spec: dict[str, Any], ctx: StepContext) -> Any:
    tag, value = spec["tag"], spec["v"]
    _log(tag, value, "start", ctx.attempt)
    if spec.get("perm"):
        for _ in range(500):
            if _started(tag) >= set(spec["await_started"]):
                break
            await asyncio.sleep(0.01)
        raise Permanent("async item fails for good")
    try:
        await asyncio.sleep(spec.get("sleep", 0))
    except asyncio.CancelledError:
        with _lock:
            told[(tag, value)] = True
        raise
    _log(tag, value, "end", ctx.attempt)
    return value


@step(name="fa_gate_list")
def gate_list(spec: dict[str, Any]) -> list[int]:
    _gate(spec["gate"]).wait(15)
    return list(range(spec["n"]))


@workflow(name="fa_timeouts_serial")
def timeouts_serial(specs):  # type: ignore[no-untyped-def]
    return for_each(slow_once, over=specs, max_parallel=1)


@workflow(name="fa_async_items")
def async_items(specs):  # type: ignore[no-untyped-def]
    return for_each(async_item, over=value_of(specs))


@workflow(name="fa_conditional")
def conditional(values):  # type: ignore[no-untyped-def]
    source = value_of(values)
    fanned = for_each(echo, over=source, when=source.truthy())
    return describe(fanned, on_skip="run")


@workflow(name="fa_over_signal")
def over_signal(_):  # type: ignore[no-untyped-def]
    return for_each(echo, over=wait_signal("fa_list"))


@workflow(name="fa_after_gate")
def after_gate(spec):  # type: ignore[no-untyped-def]
    return for_each(square, over=gate_list(spec), max_parallel=2)


def test_an_item_timing_out_is_retried_before_the_next_starts(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(slow_once, concurrency=4)
    handle = client.submit(timeouts_serial, _specs("to", {"slow": True}, {}))
    assert handle.result(timeout=30) == [0, 1]
    first = _items(handle.get(), "fa_slow_once")[0]
    assert [a.error_kind for a in first.attempts] == ["timeout"]
    starts = [(v, a) for v, w, a in _of("to") if w == "start"]
    assert starts == [(0, 1), (0, 2), (1, 1)]


def test_async_items_are_cancelled_when_a_sibling_fails(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS, async_item, concurrency=4)
    specs = _specs("as", {"sleep": 10}, {"perm": True, "await_started": [0, 2]}, {"sleep": 10})
    run = client.submit(async_items, specs).wait(timeout=20)
    assert run.state is RunState.FAILED
    assert [s.state for s in _items(run, "fa_async_item")] == [
        StepState.CANCELLED,
        StepState.DISCARDED,
        StepState.CANCELLED,
    ]
    wait_until(lambda: len(told) == 2, timeout=10, what="both async siblings cancelled")


@pytest.mark.parametrize(("values", "expected"), [([], "None"), ([1, 2], "[1, 2]"), (0, "None")])
def test_a_conditional_fan_out(
    values: Any, expected: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(conditional, values)
    assert handle.result(timeout=20) == expected
    node = handle.get().step("fa_echo")
    assert node.state is (StepState.COMPLETED if values else StepState.SKIPPED)


@pytest.mark.parametrize(
    ("payload", "ok"), [([1, [2]], True), ([], True), ({"a": 1}, False), (None, False)]
)
def test_a_fan_out_over_a_signal_payload(
    payload: Any, ok: bool, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(over_signal, None)
    client.signal(handle.id, "fa_list", payload)
    run = handle.wait(timeout=20)
    if ok:
        assert run.state is RunState.COMPLETED
        assert handle.result(timeout=5) == payload
    else:
        assert run.state is RunState.FAILED
        assert run.step("fa_echo").error_kind == "invalid_input"


def test_a_fan_out_made_ready_while_paused_expands_on_resume(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS, gate_list, concurrency=4)
    handle = client.submit(after_gate, {"gate": "pr", "n": 3})
    wait_until(
        lambda: handle.get().step("fa_gate_list").state is StepState.RUNNING, what="source runs"
    )
    client.pause(handle.id)
    _gate("pr").set()
    wait_until(
        lambda: handle.get().step("fa_gate_list").state is StepState.COMPLETED,
        what="the source to complete while paused",
    )
    run = handle.get()
    assert run.state is RunState.PAUSED
    assert _items(run, "fa_square") == []
    client.resume(handle.id)
    assert handle.result(timeout=20) == [0, 1, 4]


def test_a_run_deadline_mid_fan_out_fails_it_and_tells_running_items(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS, concurrency=4)
    handle = client.submit(
        items_root_two,
        _specs("dl", {"block": 10}, {"block": 10}, {}),
        deadline=timedelta(seconds=1),
    )
    run = handle.wait(timeout=20)
    assert run.state is RunState.FAILED
    assert [s.state for s in _items(run, "fa_item")] == [StepState.CANCELLED] * 3
    wait_until(lambda: len(told) == 2, timeout=10, what="both running items told")
    assert told == {("dl", 0): True, ("dl", 1): True}
    assert _started("dl") == {0, 1}


# -- probes: options on items, flow control, reclaim limit, child max_bytes -----------------


@step(name="fa_limited_item", concurrency=Concurrency(limit=1))
def limited_item(spec: dict[str, Any], ctx: StepContext) -> Any:
    return _act(spec, ctx)


@step(name="fa_lossy_once", max_reclaims=0)
def lossy_once(x: int, ctx: StepContext) -> int:
    if os.environ.get("FA_VICTIM"):
        time.sleep(120)
    return x


@workflow(name="fa_lossy_once_all")
def lossy_once_all(n):  # type: ignore[no-untyped-def]
    return for_each(lossy_once, over=make_range(n), max_parallel=1)


@workflow(name="fa_limited_fan")
def limited_fan(specs):  # type: ignore[no-untyped-def]
    return for_each(limited_item, over=specs)


@workflow(name="fa_queued_fan")
def queued_fan(specs):  # type: ignore[no-untyped-def]
    return for_each(item, over=specs, queue="fa_side", max_attempts=1, timeout=0.3)


@workflow(name="fa_kid_value")
def kid_value(x):  # type: ignore[no-untyped-def]
    return value_of(x)


def _kid_bytes(limit: int) -> Any:
    @workflow(name=f"fa_kid_bytes_{limit}")
    def kid_bytes(values):  # type: ignore[no-untyped-def]
        return for_each(kid_value, over=values, max_bytes=limit)

    return kid_bytes


KID_BYTES = {limit: _kid_bytes(limit) for limit in (BYTES_EXACT, BYTES_EXACT - 1)}


def test_json_looking_strings_stay_strings(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    values = ["null", "[1, 2]", '{"a": 1}', "1", "true", '"q"']
    start_worker(*STEPS)
    assert client.submit(echo_output, values).result(timeout=20) == values


def test_a_concurrency_limited_item_step_runs_one_item_at_a_time(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(limited_item, concurrency=8)
    handle = client.submit(limited_fan, _specs("lim", *({"sleep": 0.05} for _ in range(4))))
    assert handle.result(timeout=20) == [0, 1, 2, 3]
    assert _in_flight_peak("lim") == 1


def test_item_options_queue_and_timeout_apply_to_every_item(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(item, queues=["fa_side"], concurrency=4)
    handle = client.submit(queued_fan, _specs("qo", {}, {"sleep": 1.0}, {}))
    run = handle.wait(timeout=20)
    assert run.state is RunState.FAILED
    items = _items(run, "fa_item")
    assert {s.queue for s in items} == {"fa_side"}
    assert items[1].state is StepState.DISCARDED
    assert [a.error_kind for a in items[1].attempts] == ["timeout"]


@pytest.mark.parametrize("limit", [BYTES_EXACT, BYTES_EXACT - 1])
def test_max_bytes_of_a_fan_out_of_children_at_its_boundary(
    limit: int, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS, kid_value)
    run = client.submit(KID_BYTES[limit], BYTES_VALUES).wait(timeout=20)
    if limit == BYTES_EXACT:
        assert run.state is RunState.COMPLETED
        assert run.step("fa_kid_value").output == BYTES_VALUES
    else:
        assert run.state is RunState.FAILED
        assert run.step("fa_kid_value").error_kind == "output_limit"


@pytest.mark.timeout(60)
def test_an_item_past_its_reclaim_limit_fails_the_fan_out(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    handle = client.submit(lossy_once_all, 3)
    code = (
        "import sys\n"
        "from cyclone_dsl import Worker\n"
        "from tests.integration import test_fanout_audit as m\n"
        "Worker(sys.argv[1], [m.lossy_once, m.make_range], lease=1.0, poll_interval=0.1,\n"
        "       scan_interval=60, grace=30, concurrency=2).run()\n"
    )
    victim = subprocess.Popen(
        [sys.executable, "-c", code, cyclone_dsn],
        cwd=ROOT,
        env={**os.environ, "FA_VICTIM": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(
            lambda: any(
                s.state is StepState.RUNNING for s in _items(handle.get(), "fa_lossy_once")
            ),
            timeout=30,
            what="the victim to hold item 0",
        )
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(10)
    start_worker(lossy_once, make_range)
    run = handle.wait(timeout=20)
    assert run.state is RunState.FAILED
    items = _items(run, "fa_lossy_once")
    assert [(s.state, s.error_kind) for s in items] == [
        (StepState.DISCARDED, "reclaim_limit"),
        (StepState.CANCELLED, "dep_failed"),
        (StepState.CANCELLED, "dep_failed"),
    ]


@step(name="fa_bad_part")
def bad_part(specs: dict[str, Any]) -> Any:
    return specs["bad"]


@step(name="fa_good_part")
def good_part(specs: dict[str, Any]) -> Any:
    return specs["good"]


@workflow(name="fa_sibling_fan_outs")
def sibling_fan_outs(specs):  # type: ignore[no-untyped-def]
    failing = for_each(item_once, over=bad_part(specs))
    going = for_each(item, over=good_part(specs))
    join(failing, going, on_dep_failure="cancel_branch")
    return going


def test_a_contained_fan_out_failure_leaves_a_sibling_fan_out_running(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS, bad_part, good_part, concurrency=8)
    specs = {
        "bad": _specs("sbad", {"perm": True}, {}),
        "good": [{"tag": "sgood", "v": i, "gate": "sg"} for i in range(3)],
    }
    handle = client.submit(sibling_fan_outs, specs)
    wait_until(
        lambda: handle.get().step("fa_item_once").state is StepState.DISCARDED,
        what="the failing fan-out to fail",
    )
    run = handle.get()
    assert run.state is RunState.RUNNING
    assert run.step("fa_join").state is StepState.CANCELLED
    assert all(not s.state.is_terminal for s in _items(run, "fa_item"))
    _gate("sg").set()
    assert handle.result(timeout=20) == [0, 1, 2]
    assert handle.get().state is RunState.COMPLETED
