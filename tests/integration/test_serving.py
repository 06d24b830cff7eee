"""Which workflows a worker given step objects serves: those of its process it has work in."""

from __future__ import annotations

from collections.abc import Callable

from cyclone_dsl import Client, Worker, child, step, wait_signal, workflow


@step(name="srv_mine")
def mine(x: int) -> int:
    return x + 1


@step(name="srv_theirs")
def theirs(x: int) -> int:
    return x - 1


@workflow(name="srv_calls_mine")
def calls_mine(x: int) -> int:
    return mine(theirs(x))


@workflow(name="srv_calls_theirs")
def calls_theirs(x: int) -> int:
    return theirs(x)


@workflow(name="srv_starts_a_child")
def starts_a_child(x: int) -> object:
    return child(calls_theirs, theirs(x))


@workflow(name="srv_waits_only")
def waits_only() -> object:
    return wait_signal("srv_go")


def served_by(client: Client, worker: Worker) -> set[str]:
    (row,) = [w for w in client.workers() if w["id"] == worker.id]
    return {v["workflow"] for v in row["versions"]}


def test_a_worker_given_a_step_serves_the_workflows_of_its_process_it_has_work_in(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A workflow that calls one of its handlers, has a child node (a child run left by a
    process without the child's definition is started by a worker serving the parent), or
    calls no handler at all; not one that only calls other workers' handlers: its version
    would ride along in every claim and registration for nothing."""
    worker = start_worker(mine)
    served = served_by(client, worker)
    assert {"srv_calls_mine", "srv_starts_a_child", "srv_waits_only"} <= served
    assert "srv_calls_theirs" not in served


def test_runs_still_complete_across_workers_that_serve_part_of_them(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(mine)
    start_worker(theirs)
    assert client.submit(calls_mine, 5).result(timeout=20) == 5
    assert client.submit(starts_a_child, 5).result(timeout=20) == 3
