"""A database whose sessions default to another isolation level (``ALTER ROLE … SET
default_transaction_isolation``, or the DSN's ``options``): the engine's transactions are
written for read committed and run at it, whatever the default.

Before, a ``submit`` on such a database raised a serialization failure to the caller.
"""

from __future__ import annotations

import psycopg
import pytest

from cyclone_dsl import Client, StepContext, Worker, for_each, step, wait_signal, workflow


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
