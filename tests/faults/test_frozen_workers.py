"""A worker process freezes (SIGSTOP, as a paused VM or a stalled host would) in the middle
of one of the engine's transactions, which it leaves open.

Expected: what that transaction holds (a scanner's pass lock, a run's lock) does not stop
the other workers for longer than the server's idle-in-transaction timeout of Cyclone's
sessions; the frozen worker's steps are taken back and completed by the others, and when
it wakes up nothing it wrote in that transaction is kept.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cyclone_dsl import Client, RunHandle
from cyclone_dsl.states import RunState
from tests.faults import handlers
from tests.faults.conftest import read_log, wait_for

Spawn = Callable[..., subprocess.Popen[str]]

#: How long a frozen worker's open transaction may stop the others: the idle-in-transaction
#: timeout of Cyclone's sessions (10 s, see docs/howto/deploy.md).
STALL_S = 10.0
#: The time a run may take once that transaction is ended: a lease (1 s), a scanner pass
#: (0.2 s), worker start-up and the load of a busy machine.
SLACK_S = 15.0


def is_stopped(proc: subprocess.Popen[str]) -> bool:
    """Whether the process is stopped by a signal (its state in ``/proc`` is ``T``)."""
    stat = Path(f"/proc/{proc.pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def freeze_at(spawn_worker: Spawn, point: str) -> subprocess.Popen[str]:
    """A worker that stops itself at ``point``, inside that point's transaction."""
    frozen = spawn_worker(CYCLONE_FAILPOINTS=f"{point}=stop", CYCLONE_FAULT_LEASE="1")
    wait_for(lambda: is_stopped(frozen), timeout=60)
    return frozen


def die_completing_a_step(spawn_worker: Spawn) -> None:
    """A worker takes an available step and dies before its completion commits: the step
    waits for a scanner to take its lease back."""
    victim = spawn_worker(CYCLONE_FAILPOINTS="complete.before_commit=exit")
    assert victim.wait(60) == 137, "the failpoint did not fire"


def completed_by_a_new_worker(
    spawn_worker: Spawn, handle: RunHandle, x: int
) -> subprocess.Popen[str]:
    """Start a worker; the run ends with its result within the stall's bound."""
    started = time.monotonic()
    survivor = spawn_worker()
    assert handle.result(timeout=STALL_S + SLACK_S) == {"x": x, "by": survivor.pid}
    assert time.monotonic() - started < STALL_S + SLACK_S
    return survivor


@pytest.mark.timeout(150)
def test_workers_frozen_in_a_scanner_pass_and_in_a_completion_stall_the_others_briefly(
    client: Client, spawn_worker: Spawn, fault_log: Path
) -> None:
    """One worker freezes while it completes a step: it holds that run's lock and the
    step's uncommitted completion, and the scanner that takes the step back waits on the
    lock. Another freezes in a scanner pass: it holds the lease scanner's lock, so no
    other worker takes back any expired lease. Both hold on until the server ends their
    transactions; woken up, the first finds its connection gone: its completion is not
    kept."""
    handle = client.enqueue(handlers.work, 1)
    completing = freeze_at(spawn_worker, "complete.before_commit")
    assert {row[0] for row in read_log(fault_log)} == {completing.pid}
    scanning = freeze_at(spawn_worker, "scan.leader")
    other_handle = client.enqueue(handlers.work, 2)
    die_completing_a_step(spawn_worker)
    survivor = completed_by_a_new_worker(spawn_worker, handle, 1)
    assert other_handle.result(timeout=SLACK_S) == {"x": 2, "by": survivor.pid}
    for frozen in (completing, scanning):
        frozen.send_signal(signal.SIGCONT)
    time.sleep(2)  # the frozen workers wake up; the first tries to commit
    run = client.get_run(handle.id)
    assert run.state is RunState.COMPLETED and run.step("fault_work").reclaims == 1
    assert handle.result(timeout=1) == {"x": 1, "by": survivor.pid}
    ends = [row[0] for row in read_log(fault_log) if row[1] == handle.id and row[3] == "end"]
    assert ends == [completing.pid, survivor.pid]


@pytest.mark.timeout(150)
def test_a_worker_stalled_past_the_idle_timeout_keeps_its_outcome(
    client: Client, spawn_worker: Spawn, fault_log: Path
) -> None:
    """The worker stalls in the middle of completing a step for longer than the server lets
    a transaction sit idle, but not as long as its lease. The server ends its session; woken
    up, the worker commits the outcome again on a new connection (the step is still its
    own), rather than take the ended session for a refused outcome and fail the step."""
    handle = client.enqueue(handlers.work, 1)
    stalled = spawn_worker(
        CYCLONE_FAILPOINTS="complete.before_commit=stop", CYCLONE_FAULT_LEASE="60"
    )
    wait_for(lambda: is_stopped(stalled), timeout=60)
    time.sleep(STALL_S + 3)

    def resumed_and_ended() -> bool:
        if is_stopped(stalled):  # the failpoint stops it again at each try, for an instant
            stalled.send_signal(signal.SIGCONT)
        return client.get_run(handle.id).state.is_terminal

    wait_for(resumed_and_ended, timeout=SLACK_S)
    assert handle.result(timeout=1) == {"x": 1, "by": stalled.pid}
    step = client.get_run(handle.id).step("fault_work")
    assert (step.attempt, step.reclaims) == (0, 0)  # no failure, no reclaim


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_worker_frozen_before_a_handler_starts_does_not_start_it_once_its_lease_passed(
    client: Client, spawn_worker: Spawn, fault_log: Path, kind: str
) -> None:
    """A worker freezes (SIGSTOP) between claiming a step and starting its handler, for
    longer than the lease. Another worker takes the step over and completes it. Woken up,
    the frozen worker must not start the handler: its lease passed by its own clock, so the
    execution would be fenced, and its side effects repeated for nothing."""
    if kind == "sync":
        handle = client.enqueue(handlers.work, 1)
        frozen = freeze_at(spawn_worker, "worker.before_start")
        survivor = completed_by_a_new_worker(spawn_worker, handle, 1)
    else:
        from tests.faults import async_handlers

        handle = client.enqueue(async_handlers.async_work, 1)
        frozen = spawn_worker(
            CYCLONE_FAILPOINTS="worker.before_start=stop",
            CYCLONE_FAULT_LEASE="1",
            CYCLONE_FAULT_ASYNC="1",
        )
        wait_for(lambda: is_stopped(frozen), timeout=60)
        survivor = spawn_worker(CYCLONE_FAULT_ASYNC="1")
        assert handle.result(timeout=STALL_S + SLACK_S) == {"x": 1, "by": survivor.pid}
    frozen.send_signal(signal.SIGCONT)
    time.sleep(2)  # the frozen worker wakes up with the claimed step in hand
    assert frozen.poll() is None, "the woken worker died"
    starts = [row[0] for row in read_log(fault_log) if row[3] == "start"]
    assert starts == [survivor.pid]
    step = client.get_run(handle.id).steps[0]
    assert (step.attempt, step.reclaims) == (0, 1)


@pytest.mark.timeout(150)
def test_a_worker_frozen_past_its_lease_that_nobody_replaced_runs_the_step_once(
    client: Client, spawn_worker: Spawn, fault_log: Path
) -> None:
    """Frozen between the claim and the handler's start for longer than the lease, with no
    other worker: the lease is still the worker's (or its own scanner takes it back) when
    it wakes, so the step runs, once."""
    handle = client.enqueue(handlers.work, 3)
    frozen = freeze_at(spawn_worker, "worker.before_start")
    time.sleep(2.5)  # past the 1 s lease

    def resumed_and_ended() -> bool:
        if is_stopped(frozen):  # the failpoint stops it again at a start after a reclaim
            frozen.send_signal(signal.SIGCONT)
        return client.get_run(handle.id).state.is_terminal

    wait_for(resumed_and_ended, timeout=SLACK_S)
    assert handle.result(timeout=1) == {"x": 3, "by": frozen.pid}
    assert [row[3] for row in read_log(fault_log)] == ["start", "end"]
