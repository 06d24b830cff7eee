"""The flagship example that ``cyclone demo`` runs.

An order is fetched, then priced and checked for stock in parallel (a join);
a manager's approval arrives as a signal; each order line ships as its own
step (a fan-out, two at a time); an invoice is produced by a child workflow;
the result gathers everything.
"""

from __future__ import annotations

import time
from datetime import timedelta

from cyclone_dsl import child, for_each, step, wait_signal, workflow


@step(max_attempts=3, name="demo_fetch_order")
def fetch_order(order_id: str) -> dict[str, object]:
    time.sleep(0.2)
    lines = [{"sku": f"sku-{i}", "qty": i + 1, "price": 10 * (i + 1)} for i in range(4)]
    return {"id": order_id, "customer": "c-42", "lines": lines}


@step(name="demo_price")
def price_order(order: dict[str, object]) -> int:
    time.sleep(0.3)
    lines = order["lines"]
    assert isinstance(lines, list)
    return sum(int(line["qty"]) * int(line["price"]) for line in lines)


@step(name="demo_check_stock")
def check_stock(order: dict[str, object]) -> bool:
    time.sleep(0.4)
    return True


@step(name="demo_confirm")
def confirm(total: int, in_stock: bool, approval: dict[str, object]) -> dict[str, object]:
    return {"total": total, "in_stock": in_stock, "approved_by": approval["by"]}


@step(name="demo_list_lines")
def list_lines(order: dict[str, object]) -> list[dict[str, object]]:
    lines = order["lines"]
    assert isinstance(lines, list)
    return lines


@step(name="demo_ship_line")
def ship_line(line: dict[str, object]) -> str:
    time.sleep(0.15)
    return f"{line['sku']} x{line['qty']} shipped"


@step(name="demo_render_invoice")
def render_invoice(order: dict[str, object]) -> str:
    time.sleep(0.1)
    return f"INV-{order['id']}"


@workflow(name="demo_invoice")
def invoice(order):  # type: ignore[no-untyped-def]
    return render_invoice(order)


@step(name="demo_summarize")
def summarize(parts: list[object]) -> dict[str, object]:
    confirmation, shipments, invoice_number = parts
    assert isinstance(confirmation, dict)
    return {**confirmation, "shipments": shipments, "invoice": invoice_number}


@workflow(name="demo_order")
def demo_order(order_id):  # type: ignore[no-untyped-def]
    order = fetch_order(order_id)
    total = price_order(order)
    in_stock = check_stock(order)
    approval = wait_signal("approved", timeout=timedelta(minutes=5))
    confirmation = confirm(total, in_stock, approval)
    shipments = for_each(ship_line, over=list_lines(order), max_parallel=2, after=[confirmation])
    invoice_number = child(invoice, order, after=[confirmation])
    return summarize([confirmation, shipments, invoice_number])
