"""A child node activated by a process without the child's definition (a CLI signal, another
application's scanner) still starts its child run: a worker that has it starts it."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from psycopg import OperationalError

from cyclone_dsl import Client, Registry, Worker, child, step, wait_signal, workflow


@step(name="cs_leaf")
def leaf(x: int) -> int:
    return x * 10


@workflow(name="cs_inner")
def inner(x):  # type: ignore[no-untyped-def]
    return leaf(x)


@workflow(name="cs_outer")
def outer(x):  # type: ignore[no-untyped-def]
    go = wait_signal("go")
    return child(inner, go)


def test_a_signal_from_a_process_without_the_definitions_starts_the_child(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """Before: the child node was discarded ("cannot start child workflow") because the
    signalling process had no registry entry for it: the run failed."""
    start_worker(outer)
    handle = client.submit(outer, 0)
    with Client(cyclone_dsn, registry=Registry()) as bare:  # like `cyclone signal`
        bare.signal(handle.id, "go", 4)
    assert handle.result(timeout=20) == 40


def test_a_worker_starts_the_children_left_for_it_before_its_start_returns(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """A child left by a process without its definition, while no worker with it ran, is
    started by the next worker's start, not at its registry's first beat (5 s later),
    and no notification reaches a worker that was not listening yet."""
    handle = client.submit(outer, 0)
    with Client(cyclone_dsn, registry=Registry()) as bare:
        bare.signal(handle.id, "go", 4)
    assert client.children_of(handle.id) == []  # deferred: no one had the definition
    start_worker(outer)
    assert len(client.children_of(handle.id)) == 1
    assert handle.result(timeout=20) == 40


def test_a_start_whose_look_for_deferred_children_fails_still_starts_them(
    client: Client, cyclone_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start's look fails (a lost connection): the worker starts all the same, and its
    housekeeping looks again at once, not at its first beat."""
    handle = client.submit(outer, 0)
    with Client(cyclone_dsn, registry=Registry()) as bare:
        bare.signal(handle.id, "go", 4)
    looks: list[float] = []
    real = Worker.start_deferred_children

    def flaky(self: Worker) -> int:
        looks.append(time.monotonic())
        if len(looks) == 1:
            raise OperationalError("the connection was lost")
        return real(self)

    monkeypatch.setattr(Worker, "start_deferred_children", flaky)
    worker = Worker(cyclone_dsn, [outer], poll_interval=0.5, scan_interval=0.5).start()
    try:
        assert handle.result(timeout=20) == 40
        assert looks[1] - looks[0] < 2  # the registry's first beat is 5 s away
    finally:
        worker.stop()


@step(name="cs_hold")
def hold(x: int) -> int:
    return x


@workflow(name="cs_held")
def held(x):  # type: ignore[no-untyped-def]
    return hold(wait_signal("never"))


@workflow(name="cs_parent")
def parent(x):  # type: ignore[no-untyped-def]
    return child(held, x)


def test_a_parent_left_waiting_for_an_ended_child_is_repaired(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """A child run that ended without settling its parent node (written by another
    implementation, or by hand) no longer leaves the parent waiting forever: the scanner
    settles it."""
    import psycopg

    handle = client.submit(parent, 1)
    (child_run,) = client.children_of(handle.id)
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:  # end it behind the engine
        conn.execute(
            "UPDATE cyclone_runs SET state = 'failed', finished_at = now() WHERE id = %s",
            (child_run["id"],),
        )
    start_worker(parent)
    run = handle.wait(timeout=20)
    assert run.state == "failed"
    assert run.step("cs_held").error_kind == "child_failed"


def test_a_parent_left_waiting_for_a_completed_child_gets_its_result(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """The same repair for a child run that completed behind the engine: the parent node
    completes with the child's result, and the run goes on."""
    import psycopg

    handle = client.submit(parent, 1)
    (child_run,) = client.children_of(handle.id)
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE cyclone_steps SET state = 'completed', output = '7' WHERE run_id = %s",
            (child_run["id"],),
        )
        conn.execute(
            "UPDATE cyclone_runs SET state = 'completed', finished_at = now() WHERE id = %s",
            (child_run["id"],),
        )
    start_worker(parent)
    assert handle.result(timeout=20) == 7
