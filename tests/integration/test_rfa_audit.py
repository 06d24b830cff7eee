"""Audit of the operator actions that reopen work (``Client.retry``, ``retry(force=True)``,
``retry_many``, ``Client.fork``) on nodes UPSTREAM of fan-outs, child nodes, waits,
timers, conditions, joins and result nodes.

The shape probed: a fan-out (or a wait, a child node) that had not started when its run
ended must start properly when the run is reopened, not complete empty. Every test computes
the expected result on its own, counts every handler execution (``CALLS``), bounds every
wait, and checks that a refused action changes nothing.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from cyclone_dsl import (
    AlreadyTerminal,
    Client,
    Delivery,
    InvalidArgument,
    InvalidTransition,
    Permanent,
    Run,
    RunFilter,
    RunState,
    StepContext,
    StepState,
    Worker,
    child,
    define_result,
    for_each,
    step,
    wait_any,
    wait_n,
    wait_signal,
    wait_timer,
    workflow,
)
from cyclone_dsl.cli.main import run as cli_run
from tests.waiting import wait_until

StartWorker = Callable[..., Worker]

FAILING: set[str] = set()
HOLD: set[str] = set()
CALLS: Counter[str] = Counter()
VALUES: dict[str, Any] = {}
_lock = threading.Lock()


@pytest.fixture(autouse=True)
def _reset() -> None:
    with _lock:
        FAILING.clear()
        HOLD.clear()
        CALLS.clear()
        VALUES.clear()


def _run_handler(tag: str, ctx: StepContext) -> None:
    """Count an execution; hold it while ``tag`` is in HOLD (until cancelled); fail it
    for good while ``tag`` is in FAILING."""
    with _lock:
        CALLS[tag] += 1
    if tag in HOLD:
        ctx.wait_cancelled(20)
        raise RuntimeError(f"{tag} was stopped")
    if tag in FAILING:
        raise Permanent(f"{tag} is set to fail")


def calls() -> dict[str, int]:
    with _lock:
        return {k: v for k, v in CALLS.items() if v}


# -- handlers --------------------------------------------------------------------------


@step(name="rfa_list", max_attempts=1)
def rfa_list(n: int, ctx: StepContext) -> list[int]:
    _run_handler("list", ctx)
    return list(range(VALUES.get("len", n)))


@step(name="rfa_item", max_attempts=1)
def rfa_item(x: int, ctx: StepContext) -> int:
    _run_handler(f"item-{x}", ctx)
    return int((x + 1) * VALUES.get("mult", 10))


@step(name="rfa_sum")
def rfa_sum(values: list[int], ctx: StepContext) -> int:
    _run_handler("sum", ctx)
    return sum(values)


@step(name="rfa_val", max_attempts=1)
def rfa_val(key: str, ctx: StepContext) -> Any:
    _run_handler(f"val-{key}", ctx)
    return VALUES.get(key, 1)


@step(name="rfa_double")
def rfa_double(x: int, ctx: StepContext) -> int:
    _run_handler("double", ctx)
    return x * 2


@step(name="rfa_add")
def rfa_add(a: int, b: int, ctx: StepContext) -> int:
    _run_handler("add", ctx)
    return a + b


@step(name="rfa_pair")
def rfa_pair(a: object, b: object, ctx: StepContext) -> list[object]:
    _run_handler("pair", ctx)
    return [a, b]


@step(name="rfa_after", max_attempts=1)
def rfa_after(value: object, ctx: StepContext) -> str:
    _run_handler("after", ctx)
    return f"after {value}"


HANDLERS = [rfa_list, rfa_item, rfa_sum, rfa_val, rfa_double, rfa_add, rfa_pair, rfa_after]


# -- workflows -------------------------------------------------------------------------


@workflow(name="rfa_fan")
def rfa_fan(n):  # type: ignore[no-untyped-def]
    return rfa_sum(for_each(rfa_item, over=rfa_list(n), max_parallel=2))


@workflow(name="rfa_fan_serial")
def rfa_fan_serial(n):  # type: ignore[no-untyped-def]
    return rfa_sum(for_each(rfa_item, over=rfa_list(n), max_parallel=1))


@workflow(name="rfa_fan_guarded")
def rfa_fan_guarded(n):  # type: ignore[no-untyped-def]
    return rfa_sum(for_each(rfa_item, over=rfa_list(n), max_parallel=2, max_items=3))


@workflow(name="rfa_inner")
def rfa_inner(x):  # type: ignore[no-untyped-def]
    return rfa_item(x)


@workflow(name="rfa_child_fan")
def rfa_child_fan(n):  # type: ignore[no-untyped-def]
    return rfa_sum(for_each(rfa_inner, over=rfa_list(n), max_parallel=2))


@workflow(name="rfa_kid")
def rfa_kid(x):  # type: ignore[no-untyped-def]
    return rfa_double(x)


@workflow(name="rfa_parent")
def rfa_parent(key):  # type: ignore[no-untyped-def]
    return rfa_after(child(rfa_kid, rfa_val(key)).named("kid"))


@workflow(name="rfa_kid_fails")
def rfa_kid_fails(key):  # type: ignore[no-untyped-def]
    return rfa_double(rfa_val(key))


@workflow(name="rfa_parent_of_failing")
def rfa_parent_of_failing(key):  # type: ignore[no-untyped-def]
    return rfa_after(child(rfa_kid_fails, key).named("kid"))


@workflow(name="rfa_sig")
def rfa_sig(key):  # type: ignore[no-untyped-def]
    a = rfa_val(key)
    return rfa_pair(a, wait_signal("rfa_go", after=[a]).named("w"))


@workflow(name="rfa_quorum")
def rfa_quorum(key):  # type: ignore[no-untyped-def]
    a = rfa_val(key)
    return rfa_pair(a, wait_n("rfa_vote", 2, after=[a]).named("w"))


@workflow(name="rfa_any")
def rfa_any(key):  # type: ignore[no-untyped-def]
    a = rfa_val(key)
    return rfa_pair(a, wait_any(["rfa_yes", "rfa_no"], after=[a]).named("w"))


@workflow(name="rfa_timer")
def rfa_timer(key):  # type: ignore[no-untyped-def]
    a = rfa_val(key)
    t = wait_timer(timedelta(seconds=1), after=[a]).named("t")
    return rfa_after(a, after=[t])


@workflow(name="rfa_cond_fan")
def rfa_cond_fan(n):  # type: ignore[no-untyped-def]
    flag = rfa_val("flag")
    items = for_each(rfa_item, over=rfa_list(n), max_parallel=2, when=flag.gt(5)).named("big")
    small = rfa_double(flag, otherwise=items).named("small")
    return rfa_pair(items, small)


@workflow(name="rfa_join")
def rfa_join(key):  # type: ignore[no-untyped-def]
    a = rfa_val("a").named("a")
    b = rfa_val("b", after=[a]).named("b")
    return rfa_double(rfa_add(a, b))


@workflow(name="rfa_contained_fan")
def rfa_contained_fan(n):  # type: ignore[no-untyped-def]
    """A fan-out in a contained branch, and a main branch waiting for a signal."""
    total = rfa_sum(
        for_each(rfa_item, over=rfa_list(n), max_parallel=2, on_dep_failure="cancel_branch")
    )
    return rfa_pair(total, wait_signal("rfa_go").named("w"))


@workflow(name="rfa_contained_done")
def rfa_contained_done(n):  # type: ignore[no-untyped-def]
    """A fan-out in a contained branch; the result comes from the other branch."""
    rfa_sum(for_each(rfa_item, over=rfa_list(n), max_parallel=2, on_dep_failure="cancel_branch"))
    return rfa_val("main")


@workflow(name="rfa_result_mid")
def rfa_result_mid(key):  # type: ignore[no-untyped-def]
    middle = rfa_double(rfa_val(key))
    rfa_after(middle)
    define_result(middle)


# -- helpers ---------------------------------------------------------------------------


def settled(client: Client, run_id: int, timeout: float = 20) -> Run:
    def ended() -> Run | None:
        run = client.get_run(run_id)
        return run if run.state.is_terminal else None

    run = wait_until(ended, timeout=timeout, what=f"run {run_id} to end")
    assert run is not None
    return run


def node_state(client: Client, run_id: int, node: str) -> StepState:
    return client.get_run(run_id).step(node).state


def snapshot(client: Client, run_id: int) -> tuple[object, ...]:
    """Everything a refused action must leave as it was."""
    run = client.get_run(run_id)
    steps = sorted(
        (s.node, s.state, s.output, s.attempt, s.error_kind, s.lease_owner, len(s.attempts))
        for s in run.steps
    )
    return (run.state, run.finished_at, tuple(steps), len(client.children_of(run_id)))


def items_of(run: Run, fan_out: str) -> list[Any]:
    return [s for s in sorted(run.steps, key=lambda s: s.item_index or 0) if s.item_of == fan_out]


def expected_sum(n: int, mult: int = 10) -> int:
    return sum((x + 1) * mult for x in range(n))


# -- retry upstream of a fan-out -------------------------------------------------------


def test_rfa_retry_of_a_failed_list_expands_the_fan_out_it_never_reached(
    client: Client, start_worker: StartWorker
) -> None:
    FAILING.add("list")
    start_worker(*HANDLERS, rfa_fan)
    run = client.submit(rfa_fan, 5)
    failed = settled(client, run.id)
    assert failed.state == RunState.FAILED
    assert failed.step("rfa_item").state == StepState.CANCELLED
    assert items_of(failed, "rfa_item") == []

    FAILING.clear()
    client.retry(run.id, "rfa_list")
    assert run.result(timeout=20) == expected_sum(5)
    done = client.get_run(run.id)
    assert [s.output for s in items_of(done, "rfa_item")] == [10, 20, 30, 40, 50]
    assert calls() == {"list": 2, "sum": 1, **{f"item-{i}": 1 for i in range(5)}}


def test_rfa_retry_many_of_a_failed_list_expands_the_fan_out(
    client: Client, start_worker: StartWorker
) -> None:
    FAILING.add("list")
    start_worker(*HANDLERS, rfa_fan)
    run = client.submit(rfa_fan, 3)
    assert settled(client, run.id).state == RunState.FAILED
    FAILING.clear()
    result = client.retry_many(RunFilter(workflows="rfa_fan"))
    assert (result.matched, result.acted, result.skipped) == (1, 1, 0)
    assert run.result(timeout=20) == expected_sum(3)
    assert calls() == {"list": 2, "sum": 1, "item-0": 1, "item-1": 1, "item-2": 1}


def test_rfa_retry_of_a_run_cancelled_before_its_fan_out_expanded(
    client: Client, start_worker: StartWorker
) -> None:
    HOLD.add("list")
    start_worker(*HANDLERS, rfa_fan)
    run = client.submit(rfa_fan, 4)
    wait_until(lambda: calls().get("list") == 1, what="rfa_list to start")
    client.cancel(run.id)
    cancelled = settled(client, run.id)
    assert cancelled.state == RunState.CANCELLED
    assert items_of(cancelled, "rfa_item") == []

    HOLD.clear()
    client.retry(run.id, "rfa_list")
    assert run.result(timeout=20) == expected_sum(4)
    assert calls() == {"list": 2, "sum": 1, **{f"item-{i}": 1 for i in range(4)}}


def test_rfa_retry_many_of_a_cancelled_run_mid_fan_out_runs_each_missing_item_once(
    client: Client, start_worker: StartWorker
) -> None:
    """max_parallel=1: item 0 completed, item 1 was running, items 2-3 never started."""
    HOLD.add("item-1")
    start_worker(*HANDLERS, rfa_fan_serial)
    run = client.submit(rfa_fan_serial, 4)
    wait_until(lambda: calls().get("item-1") == 1, what="item 1 to start")
    client.cancel(run.id)
    cancelled = settled(client, run.id)
    assert [s.state for s in items_of(cancelled, "rfa_item")] == [
        StepState.COMPLETED,
        StepState.CANCELLED,
        StepState.CANCELLED,
        StepState.CANCELLED,
    ]
    HOLD.clear()
    result = client.retry_many(RunFilter(workflows="rfa_fan_serial", states="cancelled"))
    assert (result.matched, result.acted) == (1, 1)
    assert run.result(timeout=20) == expected_sum(4)
    assert calls() == {"list": 1, "sum": 1, "item-0": 1, "item-1": 2, "item-2": 1, "item-3": 1}


def test_rfa_retry_of_an_item_keeps_completed_outputs_and_runs_the_rest_with_new_code(
    client: Client, start_worker: StartWorker
) -> None:
    """Item 0 completed (kept, with its old output), item 1 failed, item 2 never started:
    after the handler changed, 1 and 2 run with the new code, once each."""
    FAILING.add("item-1")
    start_worker(*HANDLERS, rfa_fan_serial)
    run = client.submit(rfa_fan_serial, 3)
    assert settled(client, run.id).state == RunState.FAILED
    FAILING.clear()
    VALUES["mult"] = 100
    client.retry(run.id, "rfa_item[1]")
    assert run.result(timeout=20) == 1 * 10 + 2 * 100 + 3 * 100
    assert calls() == {"list": 1, "sum": 1, "item-0": 1, "item-1": 2, "item-2": 1}


# -- replay upstream of a fan-out ------------------------------------------------------


def test_rfa_replay_of_the_list_after_a_failed_item_drops_every_item_and_runs_them_again(
    client: Client, start_worker: StartWorker
) -> None:
    FAILING.add("item-1")
    start_worker(*HANDLERS, rfa_fan_serial)
    run = client.submit(rfa_fan_serial, 3)
    assert settled(client, run.id).state == RunState.FAILED
    FAILING.clear()
    VALUES["mult"] = 100
    client.retry(run.id, "rfa_list", force=True)
    assert run.result(timeout=20) == expected_sum(3, 100)
    assert calls() == {"list": 2, "sum": 1, "item-0": 2, "item-1": 2, "item-2": 1}


def test_rfa_replay_of_a_list_that_becomes_empty_then_not_expands_each_time(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS, rfa_fan)
    run = client.submit(rfa_fan, 2)
    assert run.result(timeout=20) == expected_sum(2)
    VALUES["len"] = 0
    client.retry(run.id, "rfa_list", force=True)
    assert run.result(timeout=20) == 0
    assert items_of(client.get_run(run.id), "rfa_item") == []
    VALUES["len"] = 4
    client.retry(run.id, "rfa_list", force=True)
    assert run.result(timeout=20) == expected_sum(4)
    assert calls() == {"list": 3, "sum": 3, "item-0": 2, "item-1": 2, "item-2": 1, "item-3": 1}


def test_rfa_replay_of_the_fan_out_node_runs_every_item_again_and_refuses_an_item(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS, rfa_fan)
    run = client.submit(rfa_fan, 3)
    assert run.result(timeout=20) == expected_sum(3)
    before = snapshot(client, run.id)
    with pytest.raises(InvalidTransition, match="replay its fan-out node"):
        client.retry(run.id, "rfa_item[1]", force=True)
    assert snapshot(client, run.id) == before
    VALUES["mult"] = 7
    client.retry(run.id, "rfa_item", force=True)
    assert run.result(timeout=20) == expected_sum(3, 7)
    assert calls() == {"list": 1, "sum": 2, "item-0": 2, "item-1": 2, "item-2": 2}


def test_rfa_replay_past_max_items_fails_with_item_limit_and_a_second_replay_recovers(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS, rfa_fan_guarded)
    run = client.submit(rfa_fan_guarded, 2)
    assert run.result(timeout=20) == expected_sum(2)
    VALUES["len"] = 5
    client.retry(run.id, "rfa_list", force=True)
    failed = settled(client, run.id)
    assert failed.state == RunState.FAILED
    assert failed.step("rfa_item").error_kind == "item_limit"
    assert items_of(failed, "rfa_item") == []
    assert calls() == {"list": 2, "sum": 1, "item-0": 1, "item-1": 1}
    VALUES["len"] = 3
    client.retry(run.id, "rfa_list", force=True)
    assert run.result(timeout=20) == expected_sum(3)
    assert calls() == {"list": 3, "sum": 2, "item-0": 2, "item-1": 2, "item-2": 1}


# -- fan-out over a workflow, child nodes ----------------------------------------------


def test_rfa_retry_of_a_failed_list_starts_the_child_runs_of_a_workflow_fan_out(
    client: Client, start_worker: StartWorker
) -> None:
    FAILING.add("list")
    start_worker(*HANDLERS, rfa_child_fan, rfa_inner)
    run = client.submit(rfa_child_fan, 4)
    assert settled(client, run.id).state == RunState.FAILED
    assert client.children_of(run.id) == []
    FAILING.clear()
    client.retry(run.id, "rfa_list")
    assert run.result(timeout=20) == expected_sum(4)
    children = client.children_of(run.id)
    assert sorted(c["parent_node_id"] for c in children) == [f"rfa_inner[{i}]" for i in range(4)]
    assert all(c["state"] == RunState.COMPLETED for c in children)
    assert calls() == {"list": 2, "sum": 1, **{f"item-{i}": 1 for i in range(4)}}


def test_rfa_retry_upstream_of_a_child_node_starts_one_child_run(
    client: Client, start_worker: StartWorker
) -> None:
    FAILING.add("val-k")
    start_worker(*HANDLERS, rfa_parent, rfa_kid)
    run = client.submit(rfa_parent, "k")
    assert settled(client, run.id).state == RunState.FAILED
    assert client.children_of(run.id) == []
    FAILING.clear()
    VALUES["k"] = 21
    client.retry(run.id, "rfa_val")
    assert run.result(timeout=20) == "after 42"
    assert len(client.children_of(run.id)) == 1
    assert calls() == {"val-k": 2, "double": 1, "after": 1}


def test_rfa_a_child_runs_node_is_retried_through_its_parent_not_directly(
    client: Client, start_worker: StartWorker
) -> None:
    FAILING.add("val-k")
    start_worker(*HANDLERS, rfa_parent_of_failing, rfa_kid_fails)
    run = client.submit(rfa_parent_of_failing, "k")
    assert settled(client, run.id).state == RunState.FAILED
    (kid,) = client.children_of(run.id)
    assert kid["state"] == RunState.FAILED
    parent_before, kid_before = snapshot(client, run.id), snapshot(client, kid["id"])
    FAILING.clear()
    with pytest.raises(InvalidTransition, match=r"retry run .*'kid'"):
        client.retry(kid["id"], "rfa_val")
    with pytest.raises(InvalidTransition):
        client.retry(kid["id"], "rfa_val", force=True)
    assert snapshot(client, run.id) == parent_before
    assert snapshot(client, kid["id"]) == kid_before
    VALUES["k"] = 4
    client.retry(run.id, "kid")
    assert run.result(timeout=20) == "after 8"
    assert [c["id"] for c in client.children_of(run.id)] == [kid["id"]]
    assert calls() == {"val-k": 2, "double": 1, "after": 1}


def test_rfa_replay_upstream_of_a_started_child_is_refused_and_a_fork_starts_a_new_child(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS, rfa_parent, rfa_kid)
    VALUES["k"] = 5
    run = client.submit(rfa_parent, "k")
    assert run.result(timeout=20) == "after 10"
    (kid,) = client.children_of(run.id)
    before = snapshot(client, run.id)
    with pytest.raises(InvalidTransition, match="fork"):
        client.retry(run.id, "rfa_val", force=True)
    assert snapshot(client, run.id) == before

    VALUES["k"] = 6
    fork = client.fork(run.id, "rfa_val")
    assert fork.result(timeout=20) == "after 12"
    assert [c["parent_node_id"] for c in client.children_of(fork.id)] == ["kid"]
    assert client.children_of(fork.id)[0]["id"] != kid["id"]
    # From the node after the child node: the child node is copied, no child run starts.
    late = client.fork(run.id, "rfa_after")
    assert late.result(timeout=20) == "after 10"
    assert client.children_of(late.id) == []
    assert client.get_run(late.id).step("kid").copied
    assert calls() == {"val-k": 2, "double": 2, "after": 3}
    assert snapshot(client, run.id) == before


# -- waits upstream and downstream -----------------------------------------------------


WAITS: dict[str, tuple[Any, list[tuple[str, Any]], object]] = {
    "signal": (rfa_sig, [("rfa_go", "p")], "p"),
    "wait_n": (rfa_quorum, [("rfa_vote", 1), ("rfa_vote", 2)], [1, 2]),
    "wait_any": (rfa_any, [("rfa_no", "q")], {"name": "rfa_no", "payload": "q"}),
}


@pytest.mark.parametrize("kind", sorted(WAITS))
def test_rfa_signals_buffered_before_the_upstream_failure_are_consumed_after_the_retry(
    client: Client, start_worker: StartWorker, kind: str
) -> None:
    wf, signals, output = WAITS[kind]
    FAILING.add("val-k")
    run = client.submit(wf, "k")
    for name, payload in signals:
        assert client.signal(run.id, name, payload) == Delivery.BUFFERED
    start_worker(*HANDLERS, wf)
    failed = settled(client, run.id)
    assert failed.state == RunState.FAILED
    assert failed.step("w").state == StepState.CANCELLED
    with pytest.raises(AlreadyTerminal):
        client.signal(run.id, signals[0][0], "late")
    FAILING.clear()
    VALUES["k"] = 3
    client.retry(run.id, "rfa_val")
    assert run.result(timeout=20) == [3, output]
    assert calls() == {"val-k": 2, "pair": 1}


def test_rfa_replay_upstream_of_a_completed_wait_waits_for_a_new_signal(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS, rfa_sig)
    run = client.submit(rfa_sig, "k")
    wait_until(lambda: node_state(client, run.id, "w") == StepState.WAITING_SIGNAL, what="wait")
    assert client.signal(run.id, "rfa_go", "first") == Delivery.CONSUMED
    assert run.result(timeout=20) == [1, "first"]
    with pytest.raises(AlreadyTerminal):
        client.signal(run.id, "rfa_go", "ended")
    VALUES["k"] = 9
    client.retry(run.id, "rfa_val", force=True)
    wait_until(
        lambda: node_state(client, run.id, "w") == StepState.WAITING_SIGNAL,
        what="the replayed wait to wait",
    )
    assert client.get_run(run.id).state == RunState.RUNNING
    assert client.signal(run.id, "rfa_go", "second") == Delivery.CONSUMED
    assert run.result(timeout=20) == [9, "second"]
    assert calls() == {"val-k": 2, "pair": 2}


def test_rfa_retry_of_a_wait_cancelled_with_its_run_waits_again(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS, rfa_quorum)
    run = client.submit(rfa_quorum, "k")
    wait_until(lambda: node_state(client, run.id, "w") == StepState.WAITING_SIGNAL, what="wait")
    assert client.signal(run.id, "rfa_vote", "lost") == Delivery.CONSUMED
    client.cancel(run.id)
    assert settled(client, run.id).state == RunState.CANCELLED
    client.retry(run.id, "w")
    wait_until(lambda: node_state(client, run.id, "w") == StepState.WAITING_SIGNAL, what="wait")
    assert client.signal(run.id, "rfa_vote", "a") == Delivery.CONSUMED
    assert client.get_run(run.id).state == RunState.RUNNING
    assert client.signal(run.id, "rfa_vote", "b") == Delivery.CONSUMED
    assert run.result(timeout=20) == [1, ["a", "b"]]
    assert calls() == {"val-k": 1, "pair": 1}


def test_rfa_retry_upstream_of_a_timer_and_a_replay_of_it_wait_the_full_duration(
    client: Client, start_worker: StartWorker
) -> None:
    FAILING.add("val-k")
    start_worker(*HANDLERS, rfa_timer)
    run = client.submit(rfa_timer, "k")
    assert settled(client, run.id).state == RunState.FAILED
    FAILING.clear()
    VALUES["k"] = "x"
    started = time.monotonic()
    client.retry(run.id, "rfa_val")
    assert run.result(timeout=20) == "after x"
    assert time.monotonic() - started >= 0.9
    started = time.monotonic()
    client.retry(run.id, "t", force=True)
    assert client.get_run(run.id).step("t").state == StepState.WAITING_TIMER
    assert run.result(timeout=20) == "after x"
    assert time.monotonic() - started >= 0.9
    assert calls() == {"val-k": 2, "after": 2}


# -- conditions, joins, results --------------------------------------------------------


def test_rfa_retry_of_a_failed_list_expands_a_conditional_fan_out_judged_true(
    client: Client, start_worker: StartWorker
) -> None:
    VALUES["flag"] = 9
    FAILING.add("list")
    start_worker(*HANDLERS, rfa_cond_fan)
    run = client.submit(rfa_cond_fan, 3)
    failed = settled(client, run.id)
    assert failed.state == RunState.FAILED
    # rfa_val runs beside rfa_list: when the list fails first, the run's end cancels it
    # while it runs, and the retry runs it again.
    val_runs = 2 if failed.step("rfa_val").state == StepState.CANCELLED else 1
    FAILING.clear()
    client.retry(run.id, "rfa_list")
    assert run.result(timeout=20) == [[10, 20, 30], None]
    done = client.get_run(run.id)
    assert done.step("small").state == StepState.SKIPPED
    assert calls() == {
        "val-flag": val_runs,
        "list": 2,
        "pair": 1,
        "item-0": 1,
        "item-1": 1,
        "item-2": 1,
    }

    # A replay of the flag judges both branches again: the fan-out is skipped, no item runs.
    VALUES["flag"] = 2
    client.retry(run.id, "rfa_val", force=True)
    assert run.result(timeout=20) == [None, 4]
    assert client.get_run(run.id).step("big").state == StepState.SKIPPED
    assert calls() == {
        "val-flag": val_runs + 1,
        "list": 2,
        "pair": 2,
        "double": 1,
        "item-0": 1,
        "item-1": 1,
        "item-2": 1,
    }


def test_rfa_retry_of_one_failed_dep_of_a_join_runs_the_join_once_with_the_new_value(
    client: Client, start_worker: StartWorker
) -> None:
    VALUES.update(a=1, b=2)
    FAILING.add("val-b")
    start_worker(*HANDLERS, rfa_join)
    run = client.submit(rfa_join, None)
    failed = settled(client, run.id)
    assert failed.state == RunState.FAILED
    assert failed.step("a").output == 1
    FAILING.clear()
    VALUES["b"] = 5
    before_retry_a = snapshot(client, run.id)
    with pytest.raises(InvalidTransition, match="only a discarded or cancelled"):
        client.retry(run.id, "a")
    assert snapshot(client, run.id) == before_retry_a
    client.retry(run.id, "b")
    assert run.result(timeout=20) == (1 + 5) * 2
    assert calls() == {"val-a": 1, "val-b": 2, "add": 1, "double": 1}
    # A replay from the middle (the join) recomputes it and what follows, nothing else.
    VALUES.update(a=100, b=100)
    client.retry(run.id, "rfa_add", force=True)
    assert run.result(timeout=20) == (1 + 5) * 2
    assert calls() == {"val-a": 1, "val-b": 2, "add": 2, "double": 2}


def test_rfa_replay_upstream_of_a_defined_result_recomputes_it(
    client: Client, start_worker: StartWorker
) -> None:
    VALUES["k"] = 3
    start_worker(*HANDLERS, rfa_result_mid)
    run = client.submit(rfa_result_mid, "k")
    assert run.result(timeout=20) == 6
    VALUES["k"] = 10
    client.retry(run.id, "rfa_val", force=True)
    assert run.result(timeout=20) == 20
    done = client.get_run(run.id)
    assert done.step("rfa_after").output == "after 20"
    assert calls() == {"val-k": 2, "double": 2, "after": 2}


# -- forks -----------------------------------------------------------------------------


def test_rfa_fork_from_a_fan_out_runs_its_items_and_from_after_it_copies_them(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS, rfa_fan)
    run = client.submit(rfa_fan, 3)
    assert run.result(timeout=20) == expected_sum(3)
    VALUES["mult"] = 100
    from_fan = client.fork(run.id, "rfa_item")
    assert from_fan.result(timeout=20) == expected_sum(3, 100)
    assert [s.output for s in items_of(client.get_run(from_fan.id), "rfa_item")] == [
        100,
        200,
        300,
    ]
    after_fan = client.fork(run.id, "rfa_sum")
    assert after_fan.result(timeout=20) == expected_sum(3)  # the copied, old outputs
    copied = client.get_run(after_fan.id)
    assert copied.step("rfa_item").copied and items_of(copied, "rfa_item") == []
    assert calls() == {"list": 1, "sum": 3, "item-0": 2, "item-1": 2, "item-2": 2}
    assert client.get_run(run.id).state == RunState.COMPLETED


def test_rfa_fork_upstream_of_a_fan_out_with_a_failed_item_runs_every_item(
    client: Client, start_worker: StartWorker
) -> None:
    FAILING.add("item-2")
    start_worker(*HANDLERS, rfa_fan_serial)
    run = client.submit(rfa_fan_serial, 3)
    assert settled(client, run.id).state == RunState.FAILED
    FAILING.clear()
    before = snapshot(client, run.id)
    fork = client.fork(run.id, "rfa_list", input=2)
    assert fork.result(timeout=20) == expected_sum(2)
    assert snapshot(client, run.id) == before
    assert calls() == {"list": 2, "sum": 1, "item-0": 2, "item-1": 2, "item-2": 1}
    with pytest.raises(InvalidArgument):
        client.fork(run.id, "rfa_item[0]")
    assert snapshot(client, run.id) == before


def test_rfa_fork_after_a_fan_out_cancelled_mid_way_runs_the_whole_fan_out_again(
    client: Client, start_worker: StartWorker
) -> None:
    HOLD.add("item-1")
    start_worker(*HANDLERS, rfa_fan_serial)
    run = client.submit(rfa_fan_serial, 3)
    wait_until(lambda: calls().get("item-1") == 1, what="item 1 to start")
    client.cancel(run.id)
    assert settled(client, run.id).state == RunState.CANCELLED
    HOLD.clear()
    fork = client.fork(run.id, "rfa_sum")
    assert fork.result(timeout=20) == expected_sum(3)
    forked = client.get_run(fork.id)
    assert forked.step("rfa_list").copied
    assert not forked.step("rfa_item").copied
    assert calls() == {"list": 1, "sum": 1, "item-0": 2, "item-1": 2, "item-2": 1}


def test_rfa_fork_after_a_list_cancelled_before_the_fan_out_expanded(
    client: Client, start_worker: StartWorker
) -> None:
    HOLD.add("list")
    start_worker(*HANDLERS, rfa_fan)
    run = client.submit(rfa_fan, 2)
    wait_until(lambda: calls().get("list") == 1, what="rfa_list to start")
    client.cancel(run.id)
    assert settled(client, run.id).state == RunState.CANCELLED
    HOLD.clear()
    fork = client.fork(run.id, "rfa_sum")
    assert fork.result(timeout=20) == expected_sum(2)
    assert calls() == {"list": 2, "sum": 1, "item-0": 1, "item-1": 1}


def test_rfa_fork_upstream_of_a_completed_wait_waits_for_its_own_signal(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS, rfa_sig)
    run = client.submit(rfa_sig, "k")
    wait_until(lambda: node_state(client, run.id, "w") == StepState.WAITING_SIGNAL, what="wait")
    client.signal(run.id, "rfa_go", "source")
    assert run.result(timeout=20) == [1, "source"]
    VALUES["k"] = 2
    fork = client.fork(run.id, "rfa_val")
    wait_until(lambda: node_state(client, fork.id, "w") == StepState.WAITING_SIGNAL, what="wait")
    assert client.signal(fork.id, "rfa_go", "fork") == Delivery.CONSUMED
    assert fork.result(timeout=20) == [2, "fork"]
    assert run.result(timeout=5) == [1, "source"]
    assert calls() == {"val-k": 2, "pair": 2}


def test_rfa_a_contained_list_failure_in_a_paused_run_is_retried_after_resume(
    client: Client, start_worker: StartWorker
) -> None:
    FAILING.add("list")
    start_worker(*HANDLERS, rfa_contained_fan)
    run = client.submit(rfa_contained_fan, 3)
    wait_until(
        lambda: node_state(client, run.id, "rfa_list") == StepState.DISCARDED, what="list fails"
    )
    wait_until(
        lambda: node_state(client, run.id, "rfa_pair") == StepState.CANCELLED,
        what="the branch to be cancelled",
    )
    assert client.get_run(run.id).state == RunState.RUNNING
    FAILING.clear()
    client.pause(run.id)
    before = snapshot(client, run.id)
    with pytest.raises(InvalidTransition, match="paused"):
        client.retry(run.id, "rfa_list")
    with pytest.raises(InvalidTransition, match="paused"):
        client.retry(run.id, "rfa_list", force=True)
    assert snapshot(client, run.id) == before
    client.resume(run.id)
    client.retry(run.id, "rfa_list")
    wait_until(lambda: node_state(client, run.id, "rfa_sum") == StepState.COMPLETED, what="the sum")
    assert client.signal(run.id, "rfa_go", "go") == Delivery.CONSUMED
    assert run.result(timeout=20) == [expected_sum(3), "go"]
    assert calls() == {"list": 2, "sum": 1, "pair": 1, "item-0": 1, "item-1": 1, "item-2": 1}


def test_rfa_a_completed_run_with_a_contained_list_failure_reopens_and_expands(
    client: Client, start_worker: StartWorker
) -> None:
    FAILING.add("list")
    VALUES["main"] = "m"
    start_worker(*HANDLERS, rfa_contained_done)
    run = client.submit(rfa_contained_done, 3)
    done = settled(client, run.id)
    assert done.state == RunState.COMPLETED
    assert done.step("rfa_item").state == StepState.CANCELLED
    FAILING.clear()
    client.retry(run.id, "rfa_list")
    assert client.get_run(run.id).state in (RunState.RUNNING, RunState.COMPLETED)
    again = settled(client, run.id)
    assert again.state == RunState.COMPLETED
    assert again.step("rfa_sum").output == expected_sum(3)
    assert run.result(timeout=5) == "m"
    assert calls() == {"list": 2, "sum": 1, "val-main": 1, "item-0": 1, "item-1": 1, "item-2": 1}


def test_rfa_replay_of_a_flag_that_turns_a_skipped_fan_out_on_expands_it(
    client: Client, start_worker: StartWorker
) -> None:
    VALUES["flag"] = 1
    start_worker(*HANDLERS, rfa_cond_fan)
    run = client.submit(rfa_cond_fan, 2)
    assert run.result(timeout=20) == [None, 2]
    assert client.get_run(run.id).step("big").state == StepState.SKIPPED
    VALUES["flag"] = 8
    client.retry(run.id, "rfa_val", force=True)
    assert run.result(timeout=20) == [[10, 20], None]
    assert calls() == {"val-flag": 2, "list": 1, "pair": 2, "double": 1, "item-0": 1, "item-1": 1}


def test_rfa_replay_with_a_node_outside_it_not_completed_is_refused(
    client: Client, start_worker: StartWorker
) -> None:
    VALUES.update(a=1, b=2)
    FAILING.add("val-b")
    start_worker(*HANDLERS, rfa_join)
    run = client.submit(rfa_join, None)
    assert settled(client, run.id).state == RunState.FAILED
    before = snapshot(client, run.id)
    # The cone of 'rfa_add' leaves 'b' (discarded) outside: the run could not finish.
    with pytest.raises(InvalidTransition, match="'b'"):
        client.retry(run.id, "rfa_add", force=True)
    assert snapshot(client, run.id) == before
    # 'a' holds 'b' in its cone: allowed, and the discarded 'b' runs again with it.
    FAILING.clear()
    VALUES.update(a=10, b=20)
    client.retry(run.id, "a", force=True)
    assert run.result(timeout=20) == 60
    assert calls() == {"val-a": 2, "val-b": 2, "add": 1, "double": 1}


def test_rfa_a_workflow_fan_out_cancelled_before_expanding_starts_its_children_on_retry(
    client: Client, start_worker: StartWorker
) -> None:
    HOLD.add("list")
    start_worker(*HANDLERS, rfa_child_fan, rfa_inner)
    run = client.submit(rfa_child_fan, 3)
    wait_until(lambda: calls().get("list") == 1, what="rfa_list to start")
    client.cancel(run.id)
    assert settled(client, run.id).state == RunState.CANCELLED
    HOLD.clear()
    client.retry(run.id, "rfa_inner")  # the cancelled fan-out node itself
    assert run.result(timeout=20) == expected_sum(3)
    assert len(client.children_of(run.id)) == 3
    assert calls() == {"list": 2, "sum": 1, "item-0": 1, "item-1": 1, "item-2": 1}

    # Its child runs started: a replay upstream of them is refused and changes nothing.
    before = snapshot(client, run.id)
    with pytest.raises(InvalidTransition, match="fork"):
        client.retry(run.id, "rfa_list", force=True)
    assert snapshot(client, run.id) == before


def test_rfa_cli_retry_and_fork_upstream_of_a_fan_out(
    cyclone_dsn: str,
    client: Client,
    start_worker: StartWorker,
    capsys: pytest.CaptureFixture[str],
) -> None:
    FAILING.add("list")
    start_worker(*HANDLERS, rfa_fan)
    run = client.submit(rfa_fan, 2)
    assert settled(client, run.id).state == RunState.FAILED
    FAILING.clear()
    base = ["--dsn", cyclone_dsn]
    before = snapshot(client, run.id)
    capsys.readouterr()
    errors = []
    for node in ("rfa_sum", "rfa_item[0]"):  # cut off by the failed list; never expanded
        assert cli_run([*base, "retry", str(run.id), node]) != 0
        out, err = capsys.readouterr()
        assert out == ""
        assert err.startswith("cyclone: ") and err.count("\n") == 1, err
        assert "Traceback" not in err
        errors.append(err)
    assert "retry 'rfa_list'" in errors[0]  # names the node to retry instead
    assert "rfa_item[0]" in errors[1]
    assert snapshot(client, run.id) == before

    assert cli_run([*base, "retry", str(run.id), "rfa_list", "--json"]) == 0
    assert run.result(timeout=20) == expected_sum(2)
    capsys.readouterr()
    code = cli_run([*base, "fork", str(run.id), "rfa_list", "--input", "3", "-m", __name__])
    out, err = capsys.readouterr()
    assert code == 0, err
    fork_id = max(r.id for r in client.list_runs())
    assert fork_id != run.id and str(fork_id) in out
    assert client.result(fork_id, timeout=20) == expected_sum(3)
    assert calls() == {"list": 3, "sum": 2, "item-0": 2, "item-1": 2, "item-2": 1}
