"""A reference has no value in the builder: using it as one fails to type-check."""

from __future__ import annotations

from cyclone_dsl import NodeRef, Ref, step, workflow


@step
def fetch(order_id: str) -> dict[str, int]:
    return {"total": len(order_id)}


@step
def send(text: str) -> None:
    return None


@workflow
def orders(order_id: Ref[str]) -> NodeRef[dict[str, int]]:
    order = fetch(order_id)
    _ = order["total"]  # E: index
    _ = order + 1  # E: operator
    _ = len(order)  # E: arg-type
    for line in order:  # E: attr-defined
        send(line)
    _ = order.items()  # E: attr-defined
    _ = order == {"total": 1}  # E: comparison-overlap
    send(order_id + "!")  # E: operator
    return order
