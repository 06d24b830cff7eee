"""Order processing: a join of two branches and a result.

Run it with ``python3 dev.py demo`` (the flagship demo builds on it), or::

    cyclone worker examples.orders
"""

from __future__ import annotations

from datetime import timedelta

from cyclone_dsl import step, workflow


@step(max_attempts=3, timeout=timedelta(seconds=30))
def fetch_order(order_id: str) -> dict[str, object]:
    lines = [{"sku": f"sku-{i}", "qty": i + 1, "price": 10 * (i + 1)} for i in range(3)]
    return {"id": order_id, "customer": "c-42", "lines": lines}


@step
def price_order(order: dict[str, object]) -> int:
    lines = order["lines"]
    assert isinstance(lines, list)
    return sum(int(line["qty"]) * int(line["price"]) for line in lines)


@step
def check_stock(order: dict[str, object]) -> bool:
    return True


@step
def confirm(total: int, in_stock: bool) -> dict[str, object]:
    return {"status": "confirmed" if in_stock else "backordered", "total": total}


@workflow(name="orders")
def orders(order_id):  # type: ignore[no-untyped-def]
    order = fetch_order(order_id)
    total = price_order(order)
    stock = check_stock(order)
    return confirm(total, stock)
