"""Conditional nodes: ``when=``, ``otherwise=`` and ``on_skip=``, decided by the engine
from recorded outputs in the transaction that completes the upstream step.

Each test runs real workflows on a worker and reads back which nodes ran (their handlers
record calls) and what the run shows (skipped nodes as skipped).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable
from typing import Any

import pytest

from cyclone_dsl import (
    Client,
    InvalidGraph,
    StepContext,
    Worker,
    child,
    define_result,
    for_each,
    step,
    wait_signal,
    workflow,
)
from cyclone_dsl.graph.fingerprint import canonical
from cyclone_dsl.states import RunState, StepState

StartWorker = Callable[..., Worker]

calls: list[tuple[int, str]] = []
names = itertools.count()
lock = threading.Lock()


def called(ctx: StepContext) -> None:
    with lock:
        calls.append((ctx.run_id, ctx.node))


@pytest.fixture(autouse=True)
def _fresh_calls() -> None:
    """Run ids restart in each test's schema: forget the calls of earlier tests."""
    with lock:
        calls.clear()


def ran(run_id: int) -> set[str]:
    with lock:
        return {node for run, node in calls if run == run_id}


@step(name="cd_score")
def score(order: dict[str, Any], *, ctx: StepContext) -> float:
    called(ctx)
    return float(order["score"])


@step(name="cd_details")
def details(order: dict[str, Any], *, ctx: StepContext) -> dict[str, Any]:
    called(ctx)
    return {"risk": {"level": order["level"]}, "tags": order.get("tags", [])}


@step(name="cd_escalate")
def escalate(order: dict[str, Any], *, ctx: StepContext) -> str:
    called(ctx)
    return "escalated"


@step(name="cd_ship")
def ship(order: dict[str, Any], *, ctx: StepContext) -> str:
    called(ctx)
    return "shipped"


@step(name="cd_async_ship")
async def async_ship(order: dict[str, Any], *, ctx: StepContext) -> str:
    called(ctx)
    await asyncio.sleep(0)
    return "shipped async"


@step(name="cd_join")
def join(first: object, second: object, *, ctx: StepContext) -> list[object]:
    called(ctx)
    return [first, second]


@step(name="cd_gather")
def gather(values: list[object], *, ctx: StepContext) -> list[object]:
    called(ctx)
    return values


@step(name="cd_after")
def after_it(value: object, *, ctx: StepContext) -> object:
    called(ctx)
    return value


@workflow(name="cd_branch")
def branch(order):  # type: ignore[no-untyped-def]
    risk = score(order)
    review = escalate(order, when=risk.gt(0.8))
    shipped = ship(order, otherwise=review)
    return join(review, shipped)


@workflow(name="cd_async_branch")
def async_branch(order):  # type: ignore[no-untyped-def]
    risk = score(order)
    review = escalate(order, when=risk.gt(0.8))
    shipped = async_ship(order, otherwise=review)
    return join(review, shipped)


@workflow(name="cd_chain")
def chain(order):  # type: ignore[no-untyped-def]
    risk = score(order)
    review = escalate(order, when=risk.gt(0.8))
    return after_it.named("follow")(after_it(review))


@workflow(name="cd_run_anyway")
def run_anyway(order):  # type: ignore[no-untyped-def]
    risk = score(order)
    review = escalate(order, when=risk.gt(0.8))
    return after_it(review, on_skip="run")


@workflow(name="cd_paths")
def paths(order):  # type: ignore[no-untyped-def]
    info = details(order)
    high = escalate.named("high")(order, when=info.at("risk", "level").eq("high"))
    listed = ship.named("listed")(order, when=info.at("risk", "level").isin(["low", "mid"]))
    tagged = ship.named("tagged")(order, when=info.at("tags").truthy())
    either = ship.named("either")(
        order, when=info.at("risk", "level").eq("high") | info.at("tags", 0).eq("vip")
    )
    neither = ship.named("neither")(order, when=~info.at("tags").truthy() & info.at("x").falsy())
    return join(high, gather([listed, tagged, either, neither]))


@workflow(name="cd_input")
def on_input(order):  # type: ignore[no-untyped-def]
    return ship(order, when=order.at("express").eq(True))


@workflow(name="cd_inner")
def inner(order):  # type: ignore[no-untyped-def]
    return ship(order)


@workflow(name="cd_special")
def special(order):  # type: ignore[no-untyped-def]
    risk = score(order)
    approval = wait_signal("approve", when=risk.gt(0.8))
    sub = child(inner, order, when=risk.le(0.8))
    fanned = for_each(after_it, over=details(order), when=risk.gt(100))
    define_result(gather([approval, sub, fanned]))


def states(client: Client, run_id: int) -> dict[str, StepState]:
    return {s.node: s.state for s in client.get_run(run_id).steps}


@pytest.mark.parametrize(
    ("flow", "shipper"),
    [(branch, "cd_ship"), (async_branch, "cd_async_ship")],
    ids=["sync", "async"],
)
def test_a_branch_runs_one_side_and_the_join_gets_none_for_the_other(
    client: Client, start_worker: StartWorker, flow: Any, shipper: str
) -> None:
    start_worker(flow)
    high = client.submit(flow, {"score": 0.9})
    low = client.submit(flow, {"score": 0.1})
    assert high.result(timeout=30) == ["escalated", None]
    assert low.result(timeout=30) == [None, "shipped" if shipper == "cd_ship" else "shipped async"]
    assert ran(high.id) == {"cd_score", "cd_escalate", "cd_join"}
    assert ran(low.id) == {"cd_score", shipper, "cd_join"}
    assert states(client, high.id)[shipper] is StepState.SKIPPED
    assert states(client, low.id)["cd_escalate"] is StepState.SKIPPED
    assert client.get_run(high.id).state is RunState.COMPLETED


def test_what_depends_only_on_skipped_nodes_is_skipped(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(chain)
    run = client.submit(chain, {"score": 0.1})
    assert run.wait(timeout=30).state is RunState.COMPLETED
    assert ran(run.id) == {"cd_score"}
    assert states(client, run.id) == {
        "cd_score": StepState.COMPLETED,
        "cd_escalate": StepState.SKIPPED,
        "cd_after": StepState.SKIPPED,
        "follow": StepState.SKIPPED,
    }


def test_on_skip_run_runs_a_node_whose_dependencies_were_all_skipped(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(run_anyway)
    run = client.submit(run_anyway, {"score": 0.1})
    assert run.result(timeout=30) is None
    assert ran(run.id) == {"cd_score", "cd_after"}


def test_paths_membership_truthiness_and_combinations(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(paths)
    high = client.submit(paths, {"score": 0, "level": "high", "tags": []})
    vip = client.submit(paths, {"score": 0, "level": "low", "tags": ["vip"]})
    assert high.result(timeout=30) == ["escalated", [None, None, "shipped", "shipped"]]
    assert vip.result(timeout=30) == [None, ["shipped", "shipped", "shipped", None]]
    # A path that does not exist ("x") is falsy; a missing list index is not "vip".
    plain = client.submit(paths, {"score": 0, "level": "other"})
    assert plain.result(timeout=30) == [None, [None, None, None, "shipped"]]


def test_a_condition_on_the_run_input_decides_a_root(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(on_input)
    express = client.submit(on_input, {"express": True})
    slow = client.submit(on_input, {"express": "yes"})  # not the JSON value true
    assert express.result(timeout=30) == "shipped"
    assert slow.wait(timeout=30).state is RunState.COMPLETED
    assert states(client, slow.id) == {"cd_ship": StepState.SKIPPED}
    assert ran(slow.id) == set()


def test_waits_children_and_fan_outs_can_be_skipped(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(special, inner)
    low = client.submit(special, {"score": 0.1, "level": "x"})
    assert low.result(timeout=30) == [None, "shipped", None]
    shown = states(client, low.id)
    assert shown["approve"] is StepState.SKIPPED
    assert shown["cd_after"] is StepState.SKIPPED
    assert [c["workflow"] for c in client.children_of(low.id)] == ["cd_inner"]
    high = client.submit(special, {"score": 0.9, "level": "x"})
    client.signal(high.id, "approve", "ok")
    assert high.result(timeout=30) == ["ok", None, None]
    assert client.children_of(high.id) == []


def test_graphs_without_conditions_keep_their_def_version() -> None:
    """Conditions enter the fingerprint only where set: existing definitions keep theirs."""

    @workflow(name="cd_plain")
    def plain(order):  # type: ignore[no-untyped-def]
        return join(score(order), ship(order))

    @workflow(name="cd_plain_conditional")
    def conditional(order):  # type: ignore[no-untyped-def]
        return join(score(order), ship(order, when=order.at("a").eq(1)))

    shape = canonical(plain.graph)
    assert '"when"' not in shape and '"on_skip"' not in shape
    assert plain.def_version != conditional.def_version


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda o: ship(o, when=score(o).at("risk").eq(1)), "which is not an object"),
        (lambda o: ship(o, when=details(o).at(0).eq(1)), "which is an object"),
        (lambda o: ship(o, when=score(o).gt([1])), "JSON scalar"),
        (lambda o: ship(o, when=score(o).isin([])), "non-empty list"),
        (lambda o: ship(o, when=score(o).gt(None)), "needs a number or a string"),
        (lambda o: ship(o, when=True), "when= takes a condition"),
        (lambda o: ship(o, otherwise=score(o)), "without when="),
        (lambda o: ship(o, when=score(o).gt(1), otherwise=score(o)), "not both"),
        (lambda o: ship(o, on_skip="maybe"), "on_skip"),
        (lambda o: ship(o, when=o.at(True).eq(1)), "object keys"),
    ],
)
def test_bad_conditions_are_refused_when_the_workflow_is_built(
    build: Callable[[Any], Any], message: str
) -> None:
    @workflow(name=f"cd_bad_{next(names)}")
    def bad(order):  # type: ignore[no-untyped-def]
        return build(order)

    with pytest.raises(InvalidGraph, match=message):
        _ = bad.graph


def test_a_condition_used_as_a_bool_in_the_builder_is_refused() -> None:
    from cyclone_dsl.errors import BuildTimeValue

    @workflow(name="cd_if")
    def uses_if(order):  # type: ignore[no-untyped-def]
        risk = score(order)
        if risk.gt(0.8):
            escalate(order)
        return risk

    with pytest.raises(BuildTimeValue, match="pass it as when="):
        _ = uses_if.graph
