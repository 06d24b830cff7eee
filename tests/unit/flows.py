"""Workflows used by the unit tests (no database): imported by subprocesses too."""

from __future__ import annotations

from datetime import timedelta

from cyclone_dsl import (
    action,
    child,
    for_each,
    step,
    wait_any,
    wait_n,
    wait_signal,
    wait_timer,
    workflow,
)


@step(name="u_fetch", max_attempts=3, timeout=timedelta(seconds=30), queue="io")
def fetch(order_id: str) -> dict[str, object]:
    """Docstrings do not change the fingerprint."""
    return {"id": order_id}


@step(name="u_charge")
def charge(order: dict[str, object], approval: object) -> str:
    return "charged"


@step(name="u_lines")
def lines(order: dict[str, object]) -> list[int]:
    return [1, 2, 3]


@step(name="u_ship")
def ship(line: int) -> int:
    return line


@step(name="u_summarize")
def summarize(parts: list[object]) -> str:
    return "ok"


@action(name="u_notify")
def notify(x: object) -> None:
    return None


@workflow(name="u_orders")
def orders(order_id):  # type: ignore[no-untyped-def]
    order = fetch(order_id)
    ok = wait_signal("approved", timeout=timedelta(hours=1))
    paid = charge(order, ok)
    shipped = for_each(ship, over=lines(order), max_parallel=8)
    report = summarize([paid, shipped])
    notify(paid, after=[report])
    return report


@workflow(name="u_child_parent")
def parent(x):  # type: ignore[no-untyped-def]
    quorum = wait_n("votes", 3)
    either = wait_any(["yes", "no"], after=[quorum])
    pause = wait_timer(30, after=[either])
    return child(orders, x, after=[pause])
