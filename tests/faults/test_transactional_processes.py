"""Transactional steps with worker processes that die or freeze: every completed step has
exactly one row in the application's table, written by the execution that completed it.
"""

from __future__ import annotations

import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from cyclone_dsl import Client
from cyclone_dsl.dsl.step import StepDef
from cyclone_dsl.states import RunState
from tests.faults import handlers
from tests.faults.conftest import read_log, wait_for, working

Spawn = Callable[..., subprocess.Popen[str]]


def make_ledger(dsn: str, *, unique: bool) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE fault_ledger (run_id bigint, node text, pid int"
            + (", UNIQUE (run_id, node))" if unique else ")")
        )


def ledger_rows(dsn: str) -> list[tuple[int, str, int]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [tuple(row) for row in conn.execute("SELECT run_id, node, pid FROM fault_ledger")]


def all_done(client: Client, count: int) -> bool:
    return client.run_counts().get(RunState.COMPLETED.value, 0) == count


#: The same handler at read committed, and at repeatable read (its lease is then held by
#: its open transaction's lock instead of heartbeats: a dead or frozen worker's lock ends
#: with its session, and the scanner reclaims the step).
LEDGERS = pytest.mark.parametrize(
    "ledger", [handlers.ledger, handlers.ledger_repeatable_read], ids=["read_committed", "rr"]
)


@pytest.mark.timeout(180)
@LEDGERS
def test_one_row_per_step_through_sigkills(
    client: Client, cyclone_dsn: str, spawn_worker: Spawn, fault_log: Path, ledger: StepDef
) -> None:
    make_ledger(cyclone_dsn, unique=False)  # a duplicate write would show, not fail
    handles = client.enqueue_many(ledger, list(range(300)))
    rng = random.Random(11)
    workers = [spawn_worker(CYCLONE_FAULT_SLEEP="0.05") for _ in range(4)]
    for _ in range(6):  # a worker dies inside open transactions; a new one takes its place
        time.sleep(rng.uniform(0.3, 0.8))
        victim = rng.choice(working(fault_log, workers))
        workers.remove(victim)
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        workers.append(spawn_worker(CYCLONE_FAULT_SLEEP="0.05"))
    wait_for(lambda: all_done(client, 300), timeout=120)
    assert [h.result(timeout=5) for h in handles] == list(range(300))
    rows = ledger_rows(cyclone_dsn)
    assert sorted(run_id for run_id, _, _ in rows) == sorted(h.id for h in handles)
    starts = [row for row in read_log(fault_log) if row[3] == "start"]
    assert len(starts) > 300, "no worker died inside a transaction"


@pytest.mark.timeout(120)
@LEDGERS
def test_a_frozen_worker_cannot_commit_its_writes(
    client: Client, cyclone_dsn: str, spawn_worker: Spawn, fault_log: Path, ledger: StepDef
) -> None:
    """A worker freezes (SIGSTOP) after its handler wrote, inside its open transaction. Its
    lease expires; the server ends its idle transaction, so the row lock it held does not
    block the next execution; when it wakes up, nothing it wrote is kept."""
    make_ledger(cyclone_dsn, unique=True)  # the next execution's insert waits on the lock
    handle = client.enqueue(ledger, 1)
    frozen = spawn_worker(CYCLONE_FAULT_SLEEP="4", CYCLONE_FAULT_LEASE="1")
    wait_for(lambda: any(row[3] == "start" for row in read_log(fault_log)), timeout=30)
    time.sleep(0.2)  # the insert is sent; the handler sleeps in its transaction
    frozen.send_signal(signal.SIGSTOP)
    other = spawn_worker(CYCLONE_FAULT_SLEEP="0", CYCLONE_FAULT_LEASE="1")
    assert handle.result(timeout=30) == 1
    frozen.send_signal(signal.SIGCONT)
    time.sleep(5)  # the frozen handler wakes, returns, and tries to complete
    assert ledger_rows(cyclone_dsn) == [(handle.id, ledger.name, other.pid)]
    assert client.get_run(handle.id).state == RunState.COMPLETED


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "handler",
    [handlers.statement, handlers.statement_repeatable_read],
    ids=["read_committed", "repeatable_read"],
)
def test_a_killed_workers_running_statement_does_not_hold_its_step(
    client: Client, cyclone_dsn: str, spawn_worker: Spawn, fault_log: Path, handler: StepDef
) -> None:
    """A worker dies while its handler's statement runs on the server. The server noticed
    the lost client only when the statement ended (a minute here), and until then its
    transaction held the step: its lock kept the repeatable read step from being
    reclaimed, and its uncommitted row blocked the next execution's insert."""
    make_ledger(cyclone_dsn, unique=True)
    handle = client.enqueue(handler, 1)
    victim = spawn_worker(CYCLONE_FAULT_SQL_SLEEP="60", CYCLONE_FAULT_LEASE="1")
    wait_for(lambda: any(row[3] == "start" for row in read_log(fault_log)), timeout=30)
    time.sleep(0.3)  # the insert is done; the sleeping statement runs
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    other = spawn_worker(CYCLONE_FAULT_SQL_SLEEP="0", CYCLONE_FAULT_LEASE="1")
    assert handle.result(timeout=30) == 1
    assert ledger_rows(cyclone_dsn) == [(handle.id, handler.name, other.pid)]
