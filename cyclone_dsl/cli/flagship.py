"""The flagship example that ``cyclone demo`` runs: an order, priced and checked in parallel."""

from __future__ import annotations

import time

from cyclone_dsl import step, workflow


@step(max_attempts=3)
def fetch_order(order_id: str) -> dict[str, object]:
    time.sleep(0.2)
    lines = [{"sku": f"sku-{i}", "qty": i + 1, "price": 10 * (i + 1)} for i in range(4)]
    return {"id": order_id, "customer": "c-42", "lines": lines}


@step
def price_order(order: dict[str, object]) -> int:
    time.sleep(0.3)
    lines = order["lines"]
    assert isinstance(lines, list)
    return sum(int(line["qty"]) * int(line["price"]) for line in lines)


@step
def check_stock(order: dict[str, object]) -> dict[str, bool]:
    time.sleep(0.4)
    lines = order["lines"]
    assert isinstance(lines, list)
    return {str(line["sku"]): True for line in lines}


@step
def confirm(total: int, stock: dict[str, bool]) -> dict[str, object]:
    time.sleep(0.1)
    return {"status": "confirmed" if all(stock.values()) else "backordered", "total": total}


@workflow(name="demo_order")
def demo_order(order_id):  # type: ignore[no-untyped-def]
    order = fetch_order(order_id)
    total = price_order(order)
    stock = check_stock(order)
    return confirm(total, stock)
