"""A multi-process worker (one supervisor, N worker processes) killed and stopped.

The supervisor is ``tests.faults.worker_main`` with ``processes=N``; its children are found
through the worker registry, where each registers as ``<name>/<index>``.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cyclone_dsl import Client, InvalidArgument, Worker
from cyclone_dsl.states import RunState
from tests.faults import handlers
from tests.faults.conftest import ROOT, read_log, wait_for

Spawn = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def fault_times(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "times.log"
    path.touch()
    monkeypatch.setenv("CYCLONE_FAULT_TIMES", str(path))
    return path


def children(client: Client, supervisor_pid: int) -> dict[int, int]:
    """Live registry entries of this supervisor's worker processes: index to pid."""
    found = {}
    for row in client.workers():
        base, _, index = row["id"].rpartition("/")
        if row["live"] and base.endswith(f":{supervisor_pid}") and index.isdigit():
            found[int(index)] = row["pid"]
    return found


def holding_steps(client: Client, supervisor_pid: int) -> dict[int, int]:
    """The live worker processes of this supervisor that hold a running step: index to pid."""
    live = children(client, supervisor_pid)
    busy = {
        int(row["id"].rpartition("/")[2])
        for row in client.workers()
        if row["live"] and row["pid"] in live.values() and row["slots_in_use"] > 0
    }
    return {index: pid for index, pid in live.items() if index in busy}


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def step_rows(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT run_id, state, output IS NOT NULL, reclaims FROM cyclone_steps ORDER BY 1"
        ).fetchall()


def test_sigkilled_children_are_restarted_and_no_step_runs_twice_at_once(
    cyclone_dsn: str, client: Client, spawn_worker: Spawn, fault_times: Path
) -> None:
    supervisor = spawn_worker(
        CYCLONE_FAULT_PROCESSES="3", CYCLONE_FAULT_LEASE="3", CYCLONE_FAULT_SLEEP="0.05"
    )
    wait_for(lambda: len(children(client, supervisor.pid)) == 3, timeout=30)
    first = children(client, supervisor.pid)
    assert len(set(first.values())) == 3 and supervisor.pid not in first.values()
    handles = client.enqueue_many(handlers.span, list(range(150)))

    def starts() -> list[list[str]]:
        return [line.split() for line in fault_times.read_text().splitlines()]

    kills: dict[int, float] = {}  # pid -> monotonic time of its SIGKILL
    for after in (10, 40):
        wait_for(lambda after=after: len(starts()) >= after, timeout=30)  # type: ignore[misc]
        # One that holds steps, if one does within 10 s (a claim may have given every due
        # step to the others; the last ones may be done): its leases expire, reclaimed.
        deadline = time.monotonic() + 10
        while not holding_steps(client, supervisor.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        index, victim = min(
            (holding_steps(client, supervisor.pid) or children(client, supervisor.pid)).items()
        )
        os.kill(victim, signal.SIGKILL)
        kills[victim] = time.monotonic()
        wait_for(
            lambda index=index, victim=victim: (  # type: ignore[misc]
                children(client, supervisor.pid).get(index, victim) != victim
            ),
            timeout=30,
        )
    # The restarted processes are registered: a new batch is spread over all three.
    handles += client.enqueue_many(handlers.span, list(range(60)))
    for handle in handles:
        assert handle.wait(timeout=60).state is RunState.COMPLETED
    supervisor.send_signal(signal.SIGTERM)
    output, _ = supervisor.communicate(timeout=60)
    assert supervisor.returncode == 0, output
    assert output.count("was killed by SIGKILL") == 2
    assert "restarting it now" in output

    rows = step_rows(cyclone_dsn)
    assert len(rows) == 210
    assert all(state == "completed" and has_output for _, state, has_output, _ in rows)
    # The killed children held steps: those came back through their leases' expiry.
    assert sum(reclaims for *_, reclaims in rows) >= 1

    spans: dict[int, list[tuple[float, float, int]]] = defaultdict(list)
    open_starts: dict[tuple[int, int], float] = {}
    for pid, run_id, _node, event, _attempt, at in starts():
        key = (int(pid), int(run_id))
        if event == "start":
            open_starts[key] = float(at)
        else:
            spans[int(run_id)].append((open_starts.pop(key), float(at), int(pid)))
    for (pid, run_id), started in open_starts.items():
        assert pid in kills, f"step of run {run_id} started in {pid} and never ended"
        spans[run_id].append((started, kills[pid], pid))  # it ran until its process died
    restarted = {pid for runs in spans.values() for *_, pid in runs} - set(first.values())
    assert restarted, "the restarted worker processes ran no step"
    for run_id, runs in spans.items():
        runs.sort()
        for (_, end, pid), (start, _, other) in itertools.pairwise(runs):
            assert start >= end, f"run {run_id}: held by {pid} and {other} at once"


def test_sigterm_to_the_supervisor_stops_every_process_gracefully(
    cyclone_dsn: str,
    client: Client,
    spawn_worker: Spawn,
    fault_log: Path,
    start_worker: Callable[..., Worker],
) -> None:
    supervisor = spawn_worker(CYCLONE_FAULT_PROCESSES="2", CYCLONE_FAULT_SLEEP="1")
    wait_for(lambda: len(children(client, supervisor.pid)) == 2, timeout=30)
    pids = children(client, supervisor.pid)
    handles = client.enqueue_many(handlers.work, list(range(40)))
    wait_for(lambda: len({pid for pid, *_ in read_log(fault_log)}) == 2)  # both are busy
    supervisor.send_signal(signal.SIGTERM)
    output, _ = supervisor.communicate(timeout=60)
    assert supervisor.returncode == 0, output
    assert all(gone(pid) for pid in pids.values())
    events = read_log(fault_log)
    ended = Counter(run_id for _, run_id, _, event in events if event == "end")
    # Every step that had started when the signal came finished within the grace.
    assert all(ended[run_id] == 1 for _, run_id, _, event in events if event == "start")
    with psycopg.connect(cyclone_dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE state = 'running'), "
            "count(*) FILTER (WHERE state = 'completed') FROM cyclone_steps"
        ).fetchone()
    assert row is not None
    running, completed = row
    assert running == 0
    assert completed == sum(1 for _, _, _, event in events if event == "end")
    assert not children(client, supervisor.pid)  # both recorded their stop
    start_worker(handlers)
    for handle in handles:
        assert handle.wait(timeout=30).state is RunState.COMPLETED
    per_run = Counter(run_id for _, run_id, _, event in read_log(fault_log) if event == "start")
    assert set(per_run.values()) == {1}  # nothing ran twice, nothing was lost


def test_cli_processes_flag(cyclone_dsn: str, client: Client) -> None:
    from tests.cli import flows

    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "cyclone_dsl.cli", "--dsn", cyclone_dsn, "worker"),
            *("tests.cli.flows", "--processes", "2", "--grace", "5"),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: len(children(client, proc.pid)) == 2, timeout=30)
        pids = children(client, proc.pid)
        assert sorted(pids) == [1, 2] and proc.pid not in pids.values()
        assert client.submit(flows.flow, 41).result(timeout=30) == 42
    finally:
        proc.send_signal(signal.SIGTERM)
        _, errors = proc.communicate(timeout=30)
    assert proc.returncode == 0, errors
    assert all(gone(pid) for pid in pids.values())


def test_worker_processes_get_the_modules_of_a_generator(cyclone_dsn: str, client: Client) -> None:
    """The objects were read twice (this process's registry, then the processes' spec): a
    generator left the worker processes with no module to import, hence no handler."""
    from tests.cli import flows

    with Worker(cyclone_dsn, (m for m in [flows]), processes=2, grace=5):
        assert client.submit(flows.flow, 41).result(timeout=30) == 42


def test_a_module_name_given_alone_is_refused() -> None:
    """A string is iterable: Worker(dsn, "myapp.flows") looked for modules "m", "y"..."""
    with pytest.raises(InvalidArgument, match="list"):
        Worker("postgresql://unused", "tests.cli.flows")  # type: ignore[arg-type]
