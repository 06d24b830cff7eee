from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: ``CYCLONE_FULL=1`` runs the fault scenarios at full size (CI runs them bounded).
FULL = os.environ.get("CYCLONE_FULL") == "1"


@pytest.fixture
def fault_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "invocations.log"
    path.touch()
    monkeypatch.setenv("CYCLONE_FAULT_LOG", str(path))
    return path


def read_log(path: Path) -> list[tuple[int, int, str, str]]:
    rows = []
    for line in path.read_text().splitlines():
        pid, run_id, node, event = line.split()
        rows.append((int(pid), int(run_id), node, event))
    return rows


def working(fault_log: Path, workers: list[Any], timeout: float = 30.0) -> list[Any]:
    """The workers (processes) that have started a handler, once there is one: a kill then
    finds its victim holding work (on a loaded machine a fresh worker process takes
    seconds to claim, and a late one may find nothing left)."""
    found: list[Any] = []

    def some() -> bool:
        started = {row[0] for row in read_log(fault_log) if row[3] == "start"}
        found[:] = [w for w in workers if w.pid in started]
        return bool(found)

    wait_for(some, timeout=timeout)
    return found


def wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


@contextlib.contextmanager
def worker_processes(dsn: str) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """``spawn(**env)`` starts a ``worker_main`` process on ``dsn`` (its settings from
    ``env``); every process still alive at the end is killed."""
    procs: list[subprocess.Popen[str]] = []

    def spawn(**env: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.worker_main", dsn],
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        procs.append(proc)
        return proc

    try:
        yield spawn
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            proc.wait(10)
            if proc.stdout:
                proc.stdout.close()


@pytest.fixture
def spawn_worker(cyclone_dsn: str) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    with worker_processes(cyclone_dsn) as spawn:
        yield spawn
