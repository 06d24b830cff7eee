"""Two deploys on one database: a step runs only on a worker that has its run's definition;
work no live worker can run is visible; two applications cannot run each other's handlers."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pytest

from cyclone_dsl import Client, Registry, StepState, Worker, step
from cyclone_dsl.dsl.step import StepDef
from cyclone_dsl.dsl.workflow import WorkflowDef
from cyclone_dsl.errors import HandlerConflict


@step(name="vr_fetch")
def fetch(x: int) -> int:
    return x + 1


@step(name="vr_ship")
def ship(x: int) -> str:
    return f"shipped {x}"


@step(name="vr_ship_v2")
def ship_v2(order: dict[str, int]) -> str:  # the new deploy renamed ship and changed its input
    return f"shipped {order['id']}"


@step(name="vr_wrap")
def wrap(x: int) -> dict[str, int]:
    return {"id": x}


def orders_v1(x):  # type: ignore[no-untyped-def]
    return ship(fetch(x))


def orders_v2(x):  # type: ignore[no-untyped-def]
    return ship_v2(wrap(fetch(x)))


def deploy(builder: Callable[..., Any]) -> tuple[Registry, WorkflowDef]:
    """One deploy's registry: the workflow "vr_orders" as that deploy defines it."""
    definition = WorkflowDef(builder, "vr_orders")
    registry = Registry()
    registry.add_workflow_tree(definition)
    return registry, definition


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_each_version_runs_only_on_workers_that_have_it(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """Before: the new deploy's workers claimed the old runs' steps and failed them, and a
    renamed step left old runs available forever with nothing saying so."""
    old_registry, old = deploy(orders_v1)
    new_registry, new = deploy(orders_v2)
    assert old.def_version != new.def_version
    with (
        Client(cyclone_dsn, registry=old_registry) as old_client,
        Client(cyclone_dsn, registry=new_registry) as new_client,
    ):
        in_flight = [old_client.submit("vr_orders", i) for i in range(3)]
        start_worker(registry=new_registry)  # the new deploy starts first
        fresh = new_client.submit("vr_orders", 7)
        assert fresh.result(timeout=20) == "shipped 8"
        # The old runs' steps are left alone: not claimed, not failed, no attempt spent.
        for handle in in_flight:
            (first,) = [s for s in handle.get().steps if s.node == "vr_fetch"]
            assert (first.state, first.attempt) == (StepState.AVAILABLE, 0)
        unserved = new_client.stats()["unserved"]
        assert [(u["workflow"], u["def_version"], u["kind"], u["steps"]) for u in unserved] == [
            ("vr_orders", old.def_version, "vr_fetch", 3)
        ]
        start_worker(registry=old_registry)  # an old worker drains the old version
        assert [h.result(timeout=20) for h in in_flight] == ["shipped 1", "shipped 2", "shipped 3"]
        assert new_client.stats()["unserved"] == []


def test_a_worker_warns_about_work_on_its_queues_that_no_live_worker_serves(
    cyclone_dsn: str, start_worker: Callable[..., Worker], caplog: pytest.LogCaptureFixture
) -> None:
    old_registry, old = deploy(orders_v1)
    new_registry, _ = deploy(orders_v2)
    with Client(cyclone_dsn, registry=old_registry) as old_client:
        old_client.submit("vr_orders", 1)
    worker = start_worker(registry=new_registry)
    caplog.set_level(logging.WARNING, logger="cyclone.worker")
    rows = worker.report_unserved()
    assert [(r["kind"], r["def_version"]) for r in rows] == [("vr_fetch", old.def_version)]
    assert any(
        "no live worker serves them" in r.getMessage() and old.def_version in r.getMessage()
        for r in caplog.records
    )


def other_application_ship(x: int) -> str:
    return f"the other application's ship of {x}"


def test_a_different_handler_under_a_live_kind_name_is_refused(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """Before: a second application's worker with its own `ship` claimed the first's steps
    and completed them with its own output."""
    start_worker(ship)
    other = StepDef(other_application_ship, "vr_ship", True, ship.options)
    registry = Registry()
    registry.register(other)
    intruder = Worker(cyclone_dsn, registry=registry)
    with pytest.raises(HandlerConflict, match=r"kind 'vr_ship'.*other_application_ship"):
        intruder.start()
    assert client.enqueue(ship, 1).result(timeout=20) == "shipped 1"


def test_the_same_handler_in_many_workers_is_fine(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    for _ in range(3):
        start_worker(ship)
    assert [client.enqueue(ship, i).result(timeout=20) for i in range(3)] == [
        "shipped 0",
        "shipped 1",
        "shipped 2",
    ]


def test_a_stopped_worker_no_longer_blocks_another_handler(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    first = start_worker(ship)
    first.stop()
    other = StepDef(other_application_ship, "vr_ship", True, ship.options)
    registry = Registry()
    registry.register(other)
    worker = start_worker(registry=registry)
    assert client.enqueue("vr_ship", 2).result(timeout=20) == "the other application's ship of 2"
    workers = client.workers()
    live = [w for w in workers if w["live"]]
    assert [w["id"] for w in live] == [worker.id]
    assert live[0]["handlers"] == {"vr_ship": f"{__name__}:other_application_ship"}
