"""A worker process dies *inside* the transactions that start a child run, expand a
fan-out or fire a schedule slot (failpoints armed with ``exit``); a claim loses its
connection between two queues (armed with a callable).

Expected: PostgreSQL rolls the transaction back whole — no orphan child run, no
half-made item set, no fire record — and after the lease expires another
worker redoes the transition exactly once.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest

from cyclone_dsl import Client, Worker
from cyclone_dsl.db.connect import make_pool
from cyclone_dsl.db.tx import Tx, in_autocommit, in_transaction
from cyclone_dsl.engine import Claimed, Engine
from cyclone_dsl.states import RunState
from cyclone_dsl.testing.failpoints import arm, disarm
from tests.faults import handlers

Spawn = Callable[..., subprocess.Popen[str]]


def crash_at(spawn_worker: Spawn, point: str, **env: str) -> None:
    victim = spawn_worker(CYCLONE_FAILPOINTS=f"{point}=exit", CYCLONE_FAULT_LEASE="1", **env)
    assert victim.wait(60) == 137, "the failpoint did not fire"


def test_crash_while_starting_a_child_run_leaves_no_orphan(
    client: Client, spawn_worker: Spawn, fault_log: Path, start_worker: Callable[..., Worker]
) -> None:
    handle = client.submit(handlers.with_child, 5)
    crash_at(spawn_worker, "child.after_insert")
    assert client.list_runs(workflow="fault_inner") == []  # the insert rolled back with it
    assert handle.get().step("fault_work").state == "running"  # its completion too
    start_worker(handlers, lease=1.0)
    assert handle.result(timeout=30) is not None
    run = handle.wait(timeout=30)
    assert run.state is RunState.COMPLETED
    assert run.step("fault_work").reclaims == 1
    children = client.list_runs(workflow="fault_inner")
    assert len(children) == 1 and children[0].parent_run_id == handle.id


def test_crash_while_expanding_a_fan_out_leaves_no_items(
    client: Client, spawn_worker: Spawn, fault_log: Path, start_worker: Callable[..., Worker]
) -> None:
    handle = client.submit(handlers.with_fanout, 6)
    crash_at(spawn_worker, "fanout.after_expand")
    assert [s for s in handle.get().steps if s.item_of is not None] == []
    start_worker(handlers, lease=1.0)
    run = handle.wait(timeout=30)
    assert run.state is RunState.COMPLETED
    items = [s for s in run.steps if s.item_of is not None]
    assert [s.item_index for s in items] == list(range(6))
    assert [o["x"] for o in run.step("fault_work").output] == list(range(6))  # type: ignore[union-attr, index]


def test_crash_while_firing_a_schedule_records_no_fire(
    client: Client, cyclone_dsn: str, spawn_worker: Spawn, fault_log: Path
) -> None:
    schedule = client.schedule(handlers.work, "0 * * * *", id="hourly", location="UTC", input=1)
    shift = schedule.next_run_at - datetime.now(UTC) + timedelta(seconds=2)
    env = {"CYCLONE_FAULT_SHIFT": str(shift.total_seconds())}
    crash_at(spawn_worker, "schedule.after_fire_record", **env)

    def fires() -> list[tuple[datetime]]:
        with psycopg.connect(cyclone_dsn) as conn:
            return conn.execute("SELECT scheduled_for FROM cyclone_schedule_fires").fetchall()

    assert fires() == []
    assert client.list_runs() == []
    # The dead scanner's lease on the schedule (30 s) must pass first: move the clock past it.
    survivor = spawn_worker(CYCLONE_FAULT_SHIFT=str(shift.total_seconds() + 31))
    try:
        deadline = datetime.now(UTC) + timedelta(seconds=60)
        while not fires():
            assert datetime.now(UTC) < deadline, "the slot was never fired"
            time.sleep(0.1)
        assert fires() == [(schedule.next_run_at,)]
        assert len(client.list_runs()) == 1
    finally:
        survivor.terminate()


def _lost_connection() -> None:
    raise psycopg.OperationalError("the connection was lost between two queue claims")


def test_a_claim_failing_on_a_later_queue_keeps_the_steps_already_claimed(
    client: Client, cyclone_dsn: str
) -> None:
    """Autocommit claims commit queue by queue: the steps of queue a, committed as leased to
    this worker, come back to it even though claiming queue b failed. In a transaction,
    the failure rolls everything back instead."""
    first = client.enqueue(handlers.work, 1, queue="a").id
    client.enqueue(handlers.work, 2, queue="b")
    lease = timedelta(seconds=30)

    def claim_both(tx: Tx) -> list[Claimed]:
        return Engine().claim(
            tx,
            owner="w",
            queues=["a", "b"],
            kinds=["fault_work"],
            versions=[("fault_work", "standalone")],
            limit=10,
            lease=lease,
        )

    arm("claim.between_queues", _lost_connection)
    try:
        with make_pool(cyclone_dsn, name="claim-test") as pool:
            with pytest.raises(psycopg.OperationalError):
                in_transaction(pool, claim_both)
            steps = [s for r in client.list_runs() for s in client.get_run(r.id).steps]
            assert {s.state for s in steps} == {"available"}  # rolled back whole
            claimed = in_autocommit(pool, claim_both)
    finally:
        disarm("claim.between_queues")
    assert [c.run_id for c in claimed] == [first]
    row = client.get_run(first).step("fault_work")
    assert (row.state, row.lease_owner) == ("running", "w")
