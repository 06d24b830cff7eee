"""Order processing: a join of parallel branches, a signal, a fan-out and a result."""

from __future__ import annotations

from datetime import timedelta

from cyclone_dsl import NodeRef, Ref, action, for_each, step, wait_signal, workflow


@step(max_attempts=3, timeout=timedelta(seconds=30), name="ex_fetch_order")
def fetch_order(order_id: str) -> dict[str, object]:
    lines = [{"sku": f"sku-{i}", "qty": i + 1, "price": 10 * (i + 1)} for i in range(3)]
    return {"id": order_id, "lines": lines}


@step(name="ex_order_lines")
def order_lines(order: dict[str, object]) -> list[dict[str, object]]:
    lines = order["lines"]
    assert isinstance(lines, list)
    return lines


@step(name="ex_charge")
def charge(order: dict[str, object], approval: dict[str, object]) -> dict[str, object]:
    lines = order["lines"]
    assert isinstance(lines, list)
    total = sum(int(line["qty"]) * int(line["price"]) for line in lines)
    return {"charged": total, "approved_by": approval["by"]}


@step(name="ex_ship_line")
def ship_line(line: dict[str, object]) -> str:
    return f"{line['sku']} shipped"


@step(name="ex_summarize")
def summarize(parts: list[object]) -> dict[str, object]:
    payment, shipments = parts
    assert isinstance(payment, dict)
    return {**payment, "shipments": shipments}


@action(name="ex_notify")
def notify(payment: dict[str, object]) -> None:
    print(f"customer notified: {payment}")


@workflow(name="ex_orders")
def orders(order_id: Ref[str]) -> NodeRef[dict[str, object]]:
    order = fetch_order(order_id)
    approval = wait_signal("approved", timeout=timedelta(hours=1))
    payment = charge(order, approval)
    shipped = for_each(ship_line, over=order_lines(order), max_parallel=2, after=[payment])
    report = summarize([payment, shipped])
    notify(payment, after=[report])
    return report


if __name__ == "__main__":
    from cyclone_dsl import Client, Worker, embedded_database, migrate

    with embedded_database() as dsn:
        migrate(dsn)
        with Worker(dsn, [orders]), Client(dsn) as client:
            handle = client.submit(orders, "o-17")
            client.signal(handle.id, "approved", {"by": "ana"})
            print(handle.result(timeout=30))
