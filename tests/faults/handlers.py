"""Handlers for the fault tests: each invocation is recorded (in a file) before it runs."""

from __future__ import annotations

import os
import time
from datetime import timedelta

from cyclone_dsl import (
    Concurrency,
    Permanent,
    RateLimit,
    StepContext,
    child,
    for_each,
    step,
    wait_timer,
    workflow,
)


def record(ctx: StepContext, event: str) -> None:
    path = os.environ["CYCLONE_FAULT_LOG"]
    with open(path, "a") as log:
        log.write(f"{os.getpid()} {ctx.run_id} {ctx.node} {event}\n")


@step(name="fault_work", max_attempts=3, max_reclaims=5)
def work(x: object, *, ctx: StepContext) -> dict[str, object]:
    record(ctx, "start")
    time.sleep(float(os.environ.get("CYCLONE_FAULT_SLEEP", "0")))
    record(ctx, "end")
    return {"x": x, "by": os.getpid()}


@workflow(name="fault_five")
def five(x):  # type: ignore[no-untyped-def]
    first = work(x)
    middle = [work.named(f"branch_{i}")(first) for i in range(3)]
    return work.named("last")(middle)


@workflow(name="fault_inner")
def inner(x):  # type: ignore[no-untyped-def]
    return work.named("inner_work")(x)


@workflow(name="fault_with_child")
def with_child(x):  # type: ignore[no-untyped-def]
    return child(inner, work(x))


@step(name="fault_list")
def make_list(n: int) -> list[int]:
    return list(range(n))


@workflow(name="fault_with_fanout")
def with_fanout(n):  # type: ignore[no-untyped-def]
    return for_each(work, over=make_list(n))


def record_time(ctx: StepContext, event: str) -> None:
    """Log an event with the system-wide monotonic clock, which clock-skew tools leave alone."""
    path = os.environ["CYCLONE_FAULT_TIMES"]
    with open(path, "a") as log:
        log.write(
            f"{os.getpid()} {ctx.run_id} {ctx.node} {event} {ctx.attempt} {time.monotonic()}\n"
        )


@step(name="fault_flaky", max_attempts=3)
def flaky(x: object, *, ctx: StepContext) -> object:
    """Fails its first attempt, so its retry waits for a backoff of at least 0.5 s."""
    record_time(ctx, "start")
    if ctx.attempt == 1:
        raise RuntimeError("first attempt fails")
    record_time(ctx, "end")
    return x


@step(name="fault_slow", max_attempts=1)
def slow(x: object, *, ctx: StepContext) -> object:
    """Outlives its lease several times over: only heartbeats keep it."""
    record_time(ctx, "start")
    time.sleep(float(os.environ.get("CYCLONE_FAULT_SLEEP", "0")))
    record_time(ctx, "end")
    return x


@step(name="fault_span", max_reclaims=20)
def span(x: object, *, ctx: StepContext) -> object:
    """Records when it starts and ends on the monotonic clock all processes share."""
    record_time(ctx, "start")
    time.sleep(float(os.environ.get("CYCLONE_FAULT_SLEEP", "0")))
    record_time(ctx, "end")
    return x


@workflow(name="fault_timed")
def timed(x):  # type: ignore[no-untyped-def]
    first = flaky(x)
    timer = wait_timer(2, after=[first])
    return slow(first, after=[timer])


@step(
    name="fault_keyed",
    max_attempts=3,
    max_reclaims=20,
    concurrency=Concurrency(key="tenant", limit=3),
)
def keyed(job: dict[str, object], *, ctx: StepContext) -> object:
    record(ctx, "start")
    time.sleep(float(os.environ.get("CYCLONE_FAULT_SLEEP", "0")))
    record(ctx, "end")
    return job["n"]


@step(name="fault_rated", rate_limit=RateLimit(limit=20, per=timedelta(seconds=1)))
def rated(n: int) -> int:
    return n


@step(name="fault_fair", concurrency=Concurrency(key="tenant", limit=None))
def fair(job: dict[str, object]) -> object:
    return job["n"]


@step(name="fault_ledger", transactional=True, max_attempts=5, max_reclaims=20)
def ledger(n: int, *, ctx: StepContext) -> int:
    """Writes one row in ``fault_ledger`` in its step's transaction."""
    record(ctx, "start")
    ctx.connection.execute(
        "INSERT INTO fault_ledger (run_id, node, pid) VALUES (%s, %s, %s)",
        (ctx.run_id, ctx.node, os.getpid()),
    )
    time.sleep(float(os.environ.get("CYCLONE_FAULT_SLEEP", "0")))
    record(ctx, "end")
    return n


@step(
    name="fault_ledger_repeatable_read",
    transactional=True,
    isolation="repeatable read",
    max_attempts=5,
    max_reclaims=20,
)
def ledger_repeatable_read(n: int, *, ctx: StepContext) -> int:
    """:func:`ledger` in a repeatable read transaction: its lease is held by that
    transaction's lock, not renewed by heartbeats."""
    return ledger.fn(n, ctx=ctx)


def ledger_in_a_statement(ctx: StepContext) -> None:
    """Write one ``fault_ledger`` row, then wait ``$CYCLONE_FAULT_SQL_SLEEP`` seconds in a
    statement on the server (busy, not idle in transaction)."""
    record(ctx, "start")
    ctx.connection.execute(
        "INSERT INTO fault_ledger (run_id, node, pid) VALUES (%s, %s, %s)",
        (ctx.run_id, ctx.node, os.getpid()),
    )
    ctx.connection.execute(
        "SELECT pg_sleep(%s)", (float(os.environ.get("CYCLONE_FAULT_SQL_SLEEP", "0")),)
    )
    record(ctx, "end")


@step(name="fault_statement", transactional=True, max_attempts=5, max_reclaims=20)
def statement(n: int, *, ctx: StepContext) -> int:
    ledger_in_a_statement(ctx)
    return n


@step(
    name="fault_statement_repeatable_read",
    transactional=True,
    isolation="repeatable read",
    max_attempts=5,
    max_reclaims=20,
)
def statement_repeatable_read(n: int, *, ctx: StepContext) -> int:
    ledger_in_a_statement(ctx)
    return n


@step(name="fault_until_flag", max_attempts=1)
def until_flag(x: object, *, ctx: StepContext) -> object:
    """Fails (for good: one attempt) until the file ``$CYCLONE_FAULT_FLAG`` exists."""
    if not os.path.exists(os.environ["CYCLONE_FAULT_FLAG"]):
        record(ctx, "fail")
        raise Permanent("the flag is not set yet")
    record(ctx, "ok")
    return x


@workflow(name="fault_flagged")
def flagged(x):  # type: ignore[no-untyped-def]
    return until_flag(x)
