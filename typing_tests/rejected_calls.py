"""Step calls that do not fit the handler fail to type-check, inside a builder or outside."""

from __future__ import annotations

from cyclone_dsl import NodeRef, Ref, StepContext, step, workflow


@step
def fetch(order_id: str) -> dict[str, int]:
    return {"total": len(order_id)}


@step
def charge(order: dict[str, int], ctx: StepContext) -> int:
    return order["total"]


@step
def add_up(amounts: list[int]) -> int:
    return sum(amounts)


@step(on_dep_failure="cancel")  # E: call-overload, untyped-decorator
def misspelt() -> None:
    return None


fetch(17)  # E: call-overload
fetch("o-1", "o-2")  # E: call-overload
fetch(id="o-1")  # E: call-overload


@workflow
def orders(order_id: Ref[str]) -> NodeRef[int]:
    order = fetch(order_id)
    fetch(order)  # E: arg-type
    charge(order_id)  # E: arg-type
    charge(order, 2)  # E: call-overload
    charge()  # E: call-overload
    fetch(order_id, queue=3)  # E: call-overload
    fetch(order_id, on_dep_failure="cancel")  # E: call-overload
    fetch(order_id, priority="high")  # E: call-overload
    fetch(order_id, order_id=order_id)  # E: call-overload
    fetch(order_id, after=["fetch"])  # E: list-item
    fetch(order_id, after=order_id)  # E: call-overload
    add_up([order, order])  # E: list-item
    return charge(order)
