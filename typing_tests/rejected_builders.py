"""Builders, waits, for_each, child and define_result reject what the builder would refuse."""

from __future__ import annotations

from cyclone_dsl import (
    NodeRef,
    Ref,
    child,
    define_result,
    for_each,
    step,
    wait_signal,
    wait_timer,
    workflow,
)


@step
def fetch(order_id: str) -> dict[str, int]:
    return {"total": len(order_id)}


@step
def ship(line: int) -> str:
    return f"shipped {line}"


@workflow  # E: arg-type
def two_inputs(a: Ref[str], b: Ref[str]) -> None:
    return None


@workflow  # E: arg-type
def returns_a_value(order_id: Ref[str]) -> str:
    return "done"


@workflow  # E: arg-type
def plain_input(order_id: str) -> None:
    return None


@workflow
def orders(order_id: Ref[str]) -> NodeRef[dict[str, int]]:
    order = fetch(order_id)
    for_each(ship, over=order)  # E: arg-type
    for_each(fetch, over=[1, 2])  # E: arg-type
    for_each(ship, over=[1], after=["x"])  # E: arg-type, list-item
    for_each(ship, over=[1], bogus=1)  # E: call-overload
    child(fetch, order_id)  # E: arg-type
    wait_signal("approved", after="fetch")  # E: arg-type
    wait_timer("10 minutes")  # E: arg-type
    define_result(order_id)  # E: arg-type
    return fetch("o-1")  # E: return-value
