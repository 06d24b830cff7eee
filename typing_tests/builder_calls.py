"""Inside a ``@workflow`` builder a step call is typed as a reference to the node's output."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, assert_type

from cyclone_dsl import (
    NodeRef,
    Ref,
    StepContext,
    action,
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


@step
def fetch(order_id: str) -> dict[str, int]:
    return {"total": len(order_id)}


@step
def charge(order: dict[str, int], ctx: StepContext) -> int:
    return order["total"] + ctx.attempt


@step
def refund(order: dict[str, int], *, ctx: StepContext) -> int:
    return -order["total"]


@step
async def lines(order: dict[str, int]) -> list[int]:
    return [order["total"]]


@step
def ship(line: int) -> str:
    return f"shipped {line}"


@step
async def ship_async(line: int, ctx: StepContext) -> str:
    return f"shipped {line}"


@step
def combine(paid: int, shipped: list[str], approval: Any, note: str) -> str:
    return note


@step
def summarize(parts: list[object]) -> int:
    return len(parts)


@step
def add_up(amounts: list[int]) -> int:
    return sum(amounts)


@step
def log(value: object) -> None:
    return None


@step
def constant() -> int:
    return 1


@step
def tag(value: object, label: str) -> str:
    return label


@action
def notify(order: dict[str, int]) -> None:
    return None


@workflow
def invoice(order: Ref[dict[str, int]]) -> NodeRef[int]:
    return charge(order)


@workflow(name="typing_orders")
def orders(order_id: Ref[str]) -> NodeRef[str]:
    order = fetch(order_id)
    assert_type(order, NodeRef[dict[str, int]])
    paid = charge(order)
    assert_type(paid, NodeRef[int])
    assert_type(refund(order), NodeRef[int])
    assert_type(lines(order), NodeRef[list[int]])
    assert_type(fetch("o-1", node_id="fixed"), NodeRef[dict[str, int]])
    assert_type(fetch(order_id, queue="io", priority=1, max_attempts=2), NodeRef[dict[str, int]])
    assert_type(charge({"total": 1}), NodeRef[int])
    assert_type(notify(order, after=[paid]), NodeRef[None])
    assert_type(notify(order, after=paid, on_dep_failure="cancel_branch"), NodeRef[None])
    assert_type(notify.named("tell")(order), NodeRef[None])
    assert_type(fetch.with_options(timeout=timedelta(seconds=3))(order_id), NodeRef[dict[str, int]])

    approval = wait_signal("approved", timeout=timedelta(hours=1))
    assert_type(approval, NodeRef[Any])
    assert_type(wait_n("vote", 3), NodeRef[list[Any]])
    assert_type(wait_any(["yes", "no"], after=[approval]), NodeRef[dict[str, Any]])
    assert_type(wait_timer(timedelta(minutes=10), after=approval), NodeRef[None])

    shipped = for_each(ship, over=lines(order), max_parallel=8, after=[paid])
    assert_type(shipped, NodeRef[list[str]])
    assert_type(for_each(ship_async, over=[1, 2], queue="io"), NodeRef[list[str]])
    assert_type(child(invoice, order), NodeRef[Any])
    assert_type(for_each(invoice, over=lines(order), max_parallel=2), NodeRef[list[Any]])

    assert_type(summarize([paid, shipped]), NodeRef[int])
    assert_type(add_up([paid, paid]), NodeRef[int])
    assert_type(add_up([paid, 3]), NodeRef[int])
    assert_type(log(paid), NodeRef[None])
    # A parameter typed object takes a reference as a value: beside a value, a plain call.
    assert_type(tag(paid, "paid"), str)
    assert_type(tag(paid, "paid", node_id="tag"), NodeRef[str])

    report = combine(paid, shipped, approval, "thanks")
    assert_type(report, NodeRef[str])
    assert_type(report.named("report"), NodeRef[str])
    define_result(report)
    return report


@workflow
def without_input() -> None:
    # A call with no argument and no option reads as a plain call (see docs/workflows.md);
    # an option such as node_id= makes it a builder call.
    assert_type(constant(), int)
    assert_type(constant(node_id="constant"), NodeRef[int])
    # An empty list literal fits a list of references: a builder call.
    assert_type(add_up([]), NodeRef[int])
