"""Outside a builder a decorated handler keeps its signature and runs the function."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from datetime import timedelta
from typing import Any, assert_type

from cyclone_dsl import StepContext, action, schedule, step


@step
def fetch(order_id: str) -> dict[str, int]:
    return {"total": len(order_id)}


@step(name="typing_price", max_attempts=3, timeout=timedelta(seconds=5), on_dep_failure="fail_run")
def price(order: dict[str, int], discount: float = 0.0) -> float:
    return order["total"] * (1 - discount)


@step
async def fetch_async(order_id: str) -> dict[str, int]:
    return {"total": len(order_id)}


@step
def charge(order: dict[str, int], ctx: StepContext) -> int:
    return order["total"]


@action
def notify(order: dict[str, int]) -> None:
    return None


@schedule("0 3 * * *", id="typing-nightly")
@step(name="typing_nightly")
def nightly() -> str:
    return "done"


as_function: Callable[[str], dict[str, int]] = fetch
assert_type(fetch("o-1"), dict[str, int])
assert_type(fetch(order_id="o-1"), dict[str, int])
assert_type(price({"total": 2}), float)
assert_type(price({"total": 2}, 0.5), float)
assert_type(price({"total": 2}, discount=0.5), float)
pending = assert_type(fetch_async("o-1"), Coroutine[Any, Any, dict[str, int]])
assert_type(notify({"total": 1}), None)
assert_type(nightly(), str)
assert_type(fetch.named("first")(order_id="o-1"), dict[str, int])
assert_type(fetch.with_options(queue="io", priority=2)("o-1"), dict[str, int])


def a_unit_test(ctx: StepContext) -> None:
    assert_type(charge({"total": 1}, ctx), int)
    assert_type(charge({"total": 1}, ctx=ctx), int)


parts: list[int] = []


@step
def total(parts: list[int]) -> int:
    return sum(parts)


assert_type(total([1, 2]), int)
assert_type(total(parts), int)
