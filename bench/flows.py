"""The workloads the benchmarks run."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

from psycopg_pool import ConnectionPool

from cyclone_dsl import Concurrency, RateLimit, StepContext, for_each, step, workflow

started: list[float] = []


@step(name="bench_noop")
def noop(x: object = None) -> None:
    return None


@step(name="bench_sleep")
def sleepy(x: object = None) -> None:
    time.sleep(0.01)


@step(name="bench_async_sleep")
async def async_sleepy(x: object = None) -> None:
    await asyncio.sleep(0.01)


@step(name="bench_async_sleep_1s")
async def async_sleepy_1s(x: object = None) -> None:
    await asyncio.sleep(1.0)


@step(name="bench_sleep_1s")
def sleepy_1s(x: object = None) -> None:
    time.sleep(1.0)


@step(name="bench_mark")
def mark(x: object = None) -> None:
    started.append(time.perf_counter())


#: Events each ``bench_emit`` step stores.
EVENTS_PER_STEP = 10


@step(name="bench_emit")
def emitter(x: object, ctx: StepContext) -> None:
    for done in range(1, EVENTS_PER_STEP + 1):
        ctx.progress(done, EVENTS_PER_STEP)


@step(name="bench_inc")
def inc(x: int) -> int:
    return x + 1


@step(name="bench_add")
def add(a: int, b: int) -> int:
    return a + b


@step(name="bench_sum")
def total(values: list[int]) -> int:
    return sum(values)


@step(name="bench_items")
def items(n: int) -> list[int]:
    return list(range(n))


@workflow(name="bench_chain")
def chain(x):  # type: ignore[no-untyped-def]
    return inc(inc(inc(x)))


@workflow(name="bench_diamond")
def diamond(x):  # type: ignore[no-untyped-def]
    top = inc(x)
    return add(inc(top), inc(top))


@workflow(name="bench_wide")
def wide(x):  # type: ignore[no-untyped-def]
    return total([inc(x) for _ in range(6)])


@workflow(name="bench_five")
def five(x):  # type: ignore[no-untyped-def]
    a = inc(x)
    return total([inc(a), inc(a), inc(a)])


@workflow(name="bench_fan")
def fan(n):  # type: ignore[no-untyped-def]
    return for_each(inc, over=items(n))


@step(name="bench_keyed", concurrency=Concurrency(key="k", limit=100))
def keyed(x: object = None) -> None:
    return None


@step(name="bench_rated", rate_limit=RateLimit(limit=50_000, per=timedelta(seconds=1)))
def rated(x: object = None) -> None:
    return None


WRITE = "INSERT INTO bench_ledger (step_id) VALUES (%s)"


@step(name="bench_tx_write", transactional=True)
def tx_write(x: object = None, *, ctx: StepContext) -> None:
    """One insert, committed with the step's completion."""
    ctx.connection.execute(WRITE, (ctx.step_id,))


#: The pool :func:`own_write` writes with (set by the benchmark).
write_pool: list[ConnectionPool[Any]] = []


@step(name="bench_own_write")
def own_write(x: object = None, *, ctx: StepContext) -> None:
    """The same insert in a transaction of its own, committed before the step completes:
    what a handler does without ``transactional=True``."""
    with write_pool[0].connection() as conn:
        conn.execute(WRITE, (ctx.step_id,))
