"""stats() counts the open steps through the open runs; the schema's views
(cyclone_v_queues, cyclone_v_kinds) count them by walking every step. Both say the same."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from cyclone_dsl import Client, Permanent, RunFailed, Worker, step, wait_signal, workflow
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


def without_ages(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if k != "oldest_available_s"} for row in rows]


def test_stats_count_the_open_steps_as_the_views_do(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    start_worker(stv_hold, stv_echo, stv_boom, stv_waits, stv_fails, concurrency=4)
    held = [client.enqueue(stv_hold, i) for i in range(2)]
    waiting = client.submit(stv_waits, 1)
    paused = client.submit(stv_waits, 3)
    failed = client.submit(stv_fails, 2)
    for i in range(3):
        client.enqueue(stv_nobody, i)  # a queue no worker serves: available for good
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
    stats = client.stats()
    queues, kinds = stats["queues"], stats["kinds"]
    with psycopg.connect(cyclone_dsn, row_factory=dict_row) as conn:
        view_queues = conn.execute(
            "SELECT queue, available, running, waiting, extract(epoch FROM"
            " oldest_available_age)::float8 AS oldest_available_s, expired_leases"
            " FROM cyclone_v_queues ORDER BY queue"
        ).fetchall()
        view_kinds = conn.execute(
            "SELECT kind, state, count, extract(epoch FROM oldest_available_age)::float8"
            " AS oldest_available_s, expired_leases FROM cyclone_v_kinds ORDER BY kind, state"
        ).fetchall()
    assert without_ages(queues) == without_ages(view_queues)
    assert without_ages(kinds) == without_ages(view_kinds)
    pairs = [*zip(queues, view_queues, strict=True), *zip(kinds, view_kinds, strict=True)]
    for ours, theirs in pairs:
        if theirs["oldest_available_s"] is None:
            assert ours["oldest_available_s"] is None
        else:  # read a moment apart
            assert abs(ours["oldest_available_s"] - theirs["oldest_available_s"]) < 5
    assert {(k["kind"], k["state"], k["count"]) for k in kinds} >= {
        ("stv_hold", "running", 2),
        ("stv_nobody", "available", 3),
    }
    assert {q["queue"] for q in queues} == {"default", "stv_unserved"}
    release.set()  # before the worker's stop, which would wait for the held handlers
