"""The workflow shapes every framework integration submits, and what a commit leaves.

Imported by the framework tests and by the worker that ``manage.py cyclone_worker``
starts (``tests.contrib.shapes``). The inputs are JSON objects, so that a connection
whose framework decodes ``jsonb`` its own way (Django's reads it as text) would show
in a child run's input.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import attrs
import psycopg

from cyclone_dsl import Client, child, for_each, step, wait_signal, wait_timer, workflow


@step(name="fw_work")
def work(x: Any) -> Any:
    return x


@step(name="fw_label")
def label(x: Any) -> str:
    return f"order {x['order_id']} done"


@step(name="fw_reject", max_attempts=1)
def reject(x: Any) -> Any:
    raise ValueError(f"order {x['order_id']} refused")


@workflow(name="fw_failing")
def failing(x):  # type: ignore[no-untyped-def]
    return reject(x)


@workflow(name="fw_no_result")
def no_result(x):  # type: ignore[no-untyped-def]
    work(x)


@workflow(name="fw_step_root")
def step_root(x):  # type: ignore[no-untyped-def]
    return label(work(x))


@workflow(name="fw_wait_root")
def wait_root(x):  # type: ignore[no-untyped-def]
    return label(wait_signal("go"))


@workflow(name="fw_timer_root")
def timer_root(x):  # type: ignore[no-untyped-def]
    return work(x, after=[wait_timer(timedelta(hours=1))])


@workflow(name="fw_child_root")
def child_root(x):  # type: ignore[no-untyped-def]
    return child(step_root, x)


@workflow(name="fw_fan_out_root")
def fan_out_root(items):  # type: ignore[no-untyped-def]
    return for_each(work, over=items)


@attrs.frozen
class Shape:
    workflow: Any
    input: Any
    roots: dict[str, str]  # node -> state, right after the commit
    runs: int = 1  # runs a commit leaves (a child root starts its child run at once)


ORDER = {"order_id": 1, "sku": "sku-1", "meta": {"gift": True}}

SHAPES: dict[str, Shape] = {
    "step": Shape(step_root, ORDER, {"fw_work": "available", "fw_label": "pending"}),
    "wait": Shape(wait_root, ORDER, {"go": "waiting_signal", "fw_label": "pending"}),
    "timer": Shape(timer_root, ORDER, {"timer": "waiting_timer", "fw_work": "pending"}),
    "child": Shape(child_root, ORDER, {"fw_step_root": "waiting_child"}, runs=2),
    "fan_out": Shape(
        fan_out_root,
        [ORDER, {"order_id": 2}],
        {"fw_work": "pending", "fw_work[0]": "available", "fw_work[1]": "available"},
    ),
}

#: Everything a worker needs to run every shape.
WORKFLOWS = [step_root, wait_root, timer_root, child_root, fan_out_root, failing, no_result]


def states(client: Client, run_id: int) -> dict[str, str]:
    return {s.node: s.state.value for s in client.get_run(run_id).steps}


def check_activated(client: Client, run_id: int, shape: str) -> None:
    """The committed run is the shape's, with its roots activated and its input intact."""
    expected = SHAPES[shape]
    run = client.get_run(run_id)
    assert run.workflow == expected.workflow.name
    assert run.input == expected.input
    assert states(client, run_id) == expected.roots
    if shape == "child":
        (started,) = client.children_of(run_id)
        assert client.get_run(started["id"]).input == expected.input
        assert states(client, started["id"]) == {"fw_work": "available", "fw_label": "pending"}


def counts(dsn: str) -> tuple[int, int]:
    """(orders, runs) as another session sees them: what is committed."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM cyclone_runs)"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])
