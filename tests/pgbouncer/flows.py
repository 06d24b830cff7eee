"""A workflow with a join, a signal wait, a fan-out and a child run, for the PgBouncer tests."""

from __future__ import annotations

from datetime import timedelta

from cyclone_dsl import NodeRef, Ref, child, for_each, step, wait_signal, workflow


@step(name="pgb_items")
def items(n: int) -> list[int]:
    return list(range(n))


@step(name="pgb_square")
def square(x: int) -> int:
    return x * x


@step(name="pgb_double")
def double(x: int) -> int:
    return 2 * x


@step(name="pgb_join")
def join(parts: list[object]) -> dict[str, object]:
    squares, doubled, approval, inner = parts
    assert isinstance(squares, list)
    return {"squares": sum(squares), "doubled": doubled, "by": approval, "inner": inner}


@workflow(name="pgb_inner")
def inner(x: Ref[int]) -> NodeRef[int]:
    return double.named("inner_double")(x)


@workflow(name="pgb_outer")
def outer(n: Ref[int]) -> NodeRef[dict[str, object]]:
    squares = for_each(square, over=items(n))
    doubled = double(n)
    approval = wait_signal("approved", timeout=timedelta(minutes=5))
    inner_result = child(inner, doubled)
    return join([squares, doubled, approval, inner_result])


def expected(n: int, by: object) -> dict[str, object]:
    return {"squares": sum(i * i for i in range(n)), "doubled": 2 * n, "by": by, "inner": 4 * n}
