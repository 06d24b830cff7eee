"""stats() counts the open steps through the open runs; the schema's views
(cyclone_v_queues, cyclone_v_kinds) count them by walking every step. Both say the same."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg.rows import dict_row

from cyclone_dsl import Client, Permanent, RunFailed, Worker, step, wait_signal, workflow
from cyclone_dsl.sql import Q
from tests.waiting import wait_until

release = threading.Event()


@pytest.fixture(autouse=True)
def _release() -> Iterator[None]:
    release.clear()
    yield
    release.set()


@step(name="stv_hold")
def stv_hold(x: int) -> int:
    release.wait(20)
    return x


@step(name="stv_echo")
def stv_echo(x: int) -> int:
    return x


@step(name="stv_nobody", queue="stv_unserved")
def stv_nobody(x: int) -> int:
    return x


@step(name="stv_boom", max_attempts=1)
def stv_boom(x: int) -> int:
    raise Permanent("boom")


@workflow(name="stv_waits")
def stv_waits(x):  # type: ignore[no-untyped-def]
    return stv_echo(wait_signal("stv_go"), after=[stv_echo(x)])


@workflow(name="stv_fails")
def stv_fails(x):  # type: ignore[no-untyped-def]
    return stv_echo(stv_boom(x))


def test_stats_count_the_open_steps_as_the_views_do(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    start_worker(stv_hold, stv_echo, stv_boom, stv_waits, stv_fails, concurrency=4)
    held = [client.enqueue(stv_hold, i) for i in range(2)]
    waiting = client.submit(stv_waits, 1)
    paused = client.submit(stv_waits, 3)
    failed = client.submit(stv_fails, 2)
    unserved = [client.enqueue(stv_nobody, i) for i in range(3)]
    done = [client.enqueue(stv_echo, i) for i in range(5)]
    assert [h.result(timeout=10) for h in done] == list(range(5))
    with pytest.raises(RunFailed):
        failed.result(timeout=10)
    wait_until(
        lambda: (
            {s.node: s.state.value for s in waiting.get().steps}.get("stv_go") == "waiting_signal"
        ),
        what="the signal wait",
    )
    wait_until(
        lambda: all(h.get().steps[0].state.value == "running" for h in held),
        what="the held steps to run",
    )
    wait_until(lambda: paused.get().step("stv_go").state.value == "waiting_signal", what="wait")
    client.pause(paused.id)
    with psycopg.connect(cyclone_dsn, row_factory=dict_row) as conn, conn.transaction():
        params = {"shift": "0 seconds"}
        queues = conn.execute(Q.queue_stats, params).fetchall()
        kinds = conn.execute(Q.kind_stats, params).fetchall()
        view_queues = conn.execute(
            "SELECT queue, available, running, waiting, extract(epoch FROM"
            " oldest_available_age)::float8 AS oldest_available_s, expired_leases"
            " FROM cyclone_v_queues ORDER BY queue"
        ).fetchall()
        view_kinds = conn.execute(
            "SELECT kind, state, count, extract(epoch FROM oldest_available_age)::float8"
            " AS oldest_available_s, expired_leases FROM cyclone_v_kinds ORDER BY kind, state"
        ).fetchall()
    assert queues == view_queues
    assert kinds == view_kinds
    assert {(k["kind"], k["state"], k["count"]) for k in kinds} >= {
        ("stv_hold", "running", 2),
        ("stv_nobody", "available", 3),
    }
    assert {q["queue"] for q in queues} == {"default", "stv_unserved"}
    assert len(unserved) == 3
    release.set()  # before the worker's stop, which would wait for the held handlers
