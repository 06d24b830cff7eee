"""Real worker processes killed, frozen and stopped mid-step: nothing lost, nothing twice.

Each test checks its invariant from the database afterwards: every run completed,
each step completed once (one output, from the worker that held the final lease),
reclaims counted, and handler invocations bounded.
"""

from __future__ import annotations

import signal
import subprocess
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from cyclone_dsl import Client, Worker
from cyclone_dsl.states import RunState, StepState
from tests.faults import async_handlers, handlers
from tests.faults.conftest import read_log, wait_for

Spawn = Callable[..., subprocess.Popen[str]]


def test_sigkill_mid_step_is_reclaimed_once(
    client: Client, spawn_worker: Spawn, fault_log: Path, start_worker: Callable[..., Worker]
) -> None:
    victim = spawn_worker(CYCLONE_FAULT_SLEEP="30")
    handles = [client.enqueue(handlers.work, i) for i in range(6)]
    wait_for(lambda: len(read_log(fault_log)) == 6)
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    start_worker(handlers, lease=1.0)
    for handle in handles:
        run = handle.wait(timeout=30)
        assert run.state is RunState.COMPLETED
        row = run.step("fault_work")
        assert row.reclaims == 1
        assert row.attempt == 0  # a crash is not a handler failure
        assert row.output is not None and row.output["by"] != victim.pid
    starts = Counter(run_id for _, run_id, _, event in read_log(fault_log) if event == "start")
    assert set(starts.values()) == {2}  # the killed attempt and the reclaimed one


def test_sigkill_with_hundreds_of_async_handlers_in_flight_loses_none(
    client: Client, spawn_worker: Spawn, fault_log: Path, start_worker: Callable[..., Worker]
) -> None:
    """Async handlers have a lane of their own (its own fetch loop and slots, far more in
    flight than sync ones): a SIGKILL with both kinds in flight loses nothing, and each
    step runs once more, on the next worker."""
    victim = spawn_worker(CYCLONE_FAULT_SLEEP="30", CYCLONE_FAULT_ASYNC="1")
    async_handles = client.enqueue_many(async_handlers.async_work, list(range(300)))
    sync_handles = [client.enqueue(handlers.work, i) for i in range(4)]
    total = len(async_handles) + len(sync_handles)
    wait_for(lambda: len(read_log(fault_log)) == total, timeout=60)
    assert {pid for pid, *_ in read_log(fault_log)} == {victim.pid}
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    start_worker(handlers, async_handlers, lease=1.0)
    for handle in [*async_handles, *sync_handles]:
        run = handle.wait(timeout=60)
        assert run.state is RunState.COMPLETED
        (row,) = run.steps
        assert row.reclaims == 1 and row.attempt == 0
        assert row.output is not None and row.output["by"] != victim.pid
    starts = Counter(run_id for _, run_id, _, event in read_log(fault_log) if event == "start")
    assert len(starts) == total and set(starts.values()) == {2}


def test_frozen_worker_is_fenced_when_it_wakes(
    client: Client, spawn_worker: Spawn, fault_log: Path, start_worker: Callable[..., Worker]
) -> None:
    zombie = spawn_worker(CYCLONE_FAULT_SLEEP="1.5")
    handle = client.enqueue(handlers.work, 7)
    wait_for(lambda: len(read_log(fault_log)) == 1)
    zombie.send_signal(signal.SIGSTOP)
    start_worker(handlers, lease=1.0)
    run = handle.wait(timeout=30)
    assert run.state is RunState.COMPLETED
    winner = run.step("fault_work").output
    zombie.send_signal(signal.SIGCONT)
    wait_for(lambda: sum(1 for *_, e in read_log(fault_log) if e == "end") == 2)
    zombie.send_signal(signal.SIGTERM)
    output, _ = zombie.communicate(timeout=30)
    again = client.get_run(handle.id).step("fault_work")
    assert again.output == winner
    assert again.output is not None and again.output["by"] != zombie.pid
    assert again.reclaims == 1
    assert "lease lost" in output or "fenced" in output


def test_sigterm_releases_leases_for_another_worker_at_once(
    client: Client, spawn_worker: Spawn, fault_log: Path, start_worker: Callable[..., Worker]
) -> None:
    first = spawn_worker(
        CYCLONE_FAULT_SLEEP="30", CYCLONE_FAULT_LEASE="60", CYCLONE_FAULT_GRACE="0.5"
    )
    handles = [client.enqueue(handlers.work, i) for i in range(3)]
    wait_for(lambda: len(read_log(fault_log)) == 3)
    first.send_signal(signal.SIGTERM)
    output, _ = first.communicate(timeout=20)
    assert "released 3 leases" in output
    for handle in handles:
        row = client.get_run(handle.id).step("fault_work")
        assert row.state is StepState.AVAILABLE
        assert row.attempt == 0
    start_worker(handlers)  # the lease was 60 s: only a release lets this finish quickly
    for handle in handles:
        assert handle.wait(timeout=10).state is RunState.COMPLETED
