"""A database whose sessions default to another isolation level (``ALTER ROLE … SET
default_transaction_isolation``, or the DSN's ``options``): the engine's transactions are
written for read committed and run at it, whatever the default.

Before, a ``submit`` on such a database raised a serialization failure to the caller.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from cyclone_dsl import (
    Client,
    StepContext,
    Worker,
    for_each,
    step,
    wait_signal,
    wait_timer,
    workflow,
)


@step(name="dbd_items")
def items(n: int) -> list[int]:
    return list(range(n))


@step(name="dbd_square")
def square(x: int) -> int:
    return x * x


@step(name="dbd_total")
def total(squares: list[int], _signal: object) -> int:
    return sum(squares)


@step(name="dbd_level", transactional=True)
def level(_: object, ctx: StepContext) -> str:
    row = ctx.connection.execute("SHOW transaction_isolation").fetchone()
    return str(row[0])


@workflow(name="dbd_flow")
def flow(n):  # type: ignore[no-untyped-def]
    return total(for_each(square, over=items(n), max_parallel=3), wait_signal("go"))


def with_default_level(dsn: str, level: str) -> str:
    options = psycopg.conninfo.conninfo_to_dict(dsn).get("options") or ""
    escaped = level.replace(" ", "\\ ")
    return psycopg.conninfo.make_conninfo(
        dsn, options=f"{options} -c default_transaction_isolation={escaped}".strip()
    )


@pytest.mark.parametrize("default", ["serializable", "repeatable read"])
def test_runs_complete_on_a_database_whose_default_level_is_not_read_committed(
    cyclone_dsn: str, default: str
) -> None:
    dsn = with_default_level(cyclone_dsn, default)
    with psycopg.connect(dsn) as conn:  # the setting is in force for an ordinary session
        assert conn.execute("SHOW default_transaction_isolation").fetchone() == (default,)
    with Client(dsn) as client, Worker(dsn, [flow, level], concurrency=8):
        runs = [client.submit(flow, 20) for _ in range(15)]
        for run in runs:
            client.signal(run.id, "go", None)
        assert [run.result(timeout=60) for run in runs] == [sum(x * x for x in range(20))] * 15
        assert client.enqueue(level, None).result(timeout=20) == "read committed"


@workflow(name="dbd_timer")
def long_timer(_):  # type: ignore[no-untyped-def]
    return square(2, after=[wait_timer(timedelta(days=120))])


def in_zone(dsn: str, zone: str) -> str:
    options = psycopg.conninfo.conninfo_to_dict(dsn).get("options") or ""
    return psycopg.conninfo.make_conninfo(dsn, options=f"{options} -c TimeZone={zone}".strip())


@pytest.mark.parametrize("where", ["own connections", "submit_tx on the caller's connection"])
def test_durations_of_days_are_exact_across_a_daylight_saving_change(
    cyclone_dsn: str, where: str
) -> None:
    """In a session whose time zone has daylight saving (a server's default, or Django's
    connection without USE_TZ), ``now() + interval '120 days'`` is calendar days: a deadline
    or timer across the change was an hour short or long."""
    dsn = in_zone(cyclone_dsn, "America/Chicago")  # 120 days from December span March
    with Client(dsn) as client:
        if where == "own connections":
            handle = client.submit(long_timer, None, deadline=timedelta(days=120))
        else:
            with psycopg.connect(dsn) as conn:
                handle = client.submit_tx(conn, long_timer, None, deadline=timedelta(days=120))
        run = handle.get()
        (timer,) = [s for s in run.steps if s.kind == "@timer"]
        assert run.deadline_at is not None

        def after_creation(at: datetime) -> timedelta:  # in UTC: a real length of time
            return at.astimezone(UTC) - run.created_at.astimezone(UTC)

        assert abs(after_creation(run.deadline_at) - timedelta(days=120)) < timedelta(seconds=5)
        assert abs(after_creation(timer.scheduled_at) - timedelta(days=120)) < timedelta(seconds=5)
        client.cancel(handle.id)
