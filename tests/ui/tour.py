"""A workflow that shows every kind of timeline row: a retried step, a signal wait, a
fan-out and a child run, joined at the end."""

from __future__ import annotations

import time

from cyclone_dsl import StepContext, child, for_each, step, wait_signal, workflow


@step(name="tl_flaky", max_attempts=3)
def flaky(x: int, *, ctx: StepContext) -> int:
    """Fails its first attempt: the retry waits for a backoff (0.5 to 1 s)."""
    if ctx.attempt == 1:
        raise RuntimeError("the first attempt fails")
    return x


@step(name="tl_items")
def items(x: int) -> list[int]:
    return list(range(x, x + 6))


@step(name="tl_square")
def square(n: int) -> int:
    time.sleep(0.05)
    return n * n


@step(name="tl_join")
def join(parts: list[object]) -> list[object]:
    return parts


@workflow(name="tl_inner")
def inner(x):  # type: ignore[no-untyped-def]
    return square.named("inner_square")(x)


@workflow(name="tl_tour")
def tour(x):  # type: ignore[no-untyped-def]
    tried = flaky(x)
    approval = wait_signal("go")
    squares = for_each(square, over=items(tried))
    sub = child(inner, tried)
    return join([approval, squares, sub])


@step(name="tl_score")
def score(x: int) -> float:
    return 0.1


@step(name="tl_review")
def review(x: int) -> str:
    return "reviewed"


@workflow(name="tl_cond")
def conditional(x):  # type: ignore[no-untyped-def]
    """``tl_review`` is skipped: the score is low."""
    risk = score(x)
    checked = review(x, when=risk.gt(0.8))
    return join([risk, checked])
