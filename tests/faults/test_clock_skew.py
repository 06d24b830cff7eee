"""Workers whose clocks are two hours off decide nothing with them.

Every lease, backoff, timer and deadline decision uses PostgreSQL's ``now()``.
Here the only workers have their wall clocks moved +2 h and -2 h (time-machine,
in the worker processes), with 1 s leases: a worker that judged leases with its
own clock would steal live ones (+2 h) or keep dead ones; one that judged
``scheduled_at`` would retry at once (+2 h) or never (-2 h), fire timers early
or late, and the +2 h one would fail every run on its deadline. Handler times
are logged with the system-wide monotonic clock, which the skew leaves alone.
"""

from __future__ import annotations

import subprocess
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

from cyclone_dsl import Client
from cyclone_dsl.states import RunState
from tests.faults import handlers

Spawn = Callable[..., subprocess.Popen[str]]
TWO_HOURS = 2 * 3600


@pytest.mark.timeout(120)
def test_skewed_worker_clocks_change_no_decision(
    client: Client, spawn_worker: Spawn, tmp_path: Path
) -> None:
    times = tmp_path / "times.log"
    times.touch()
    env = {"CYCLONE_FAULT_TIMES": str(times), "CYCLONE_FAULT_SLEEP": "3"}
    ahead = spawn_worker(CYCLONE_FAULT_CLOCK_SKEW=str(TWO_HOURS), **env)
    behind = spawn_worker(CYCLONE_FAULT_CLOCK_SKEW=str(-TWO_HOURS), **env)
    handles = [client.submit(handlers.timed, i, deadline=timedelta(seconds=90)) for i in range(6)]

    for handle in handles:
        run = handle.wait(timeout=60)
        assert run.state is RunState.COMPLETED, run
        assert all(step.reclaims == 0 for step in run.steps), "a live lease was taken over"

    events: dict[tuple[int, str, str, int], float] = {}
    pids = set()
    for line in times.read_text().splitlines():
        pid, run_text, node, event, attempt, at = line.split()
        key = (int(run_text), node, event, int(attempt))
        assert key not in events, f"{key} happened twice"
        events[key] = float(at)
        pids.add(int(pid))
    assert pids <= {ahead.pid, behind.pid}
    per_run: dict[int, int] = defaultdict(int)
    for run_id, _node, event, _ in events:
        per_run[run_id] += event == "start"
    for handle in handles:
        run_id = handle.id
        assert per_run[run_id] == 3  # flaky twice (one backoff retry), slow once
        first_try = events[(run_id, "fault_flaky", "start", 1)]  # ctx.attempt counts from 1
        retry = events[(run_id, "fault_flaky", "start", 2)]
        assert retry - first_try >= 0.45, "the retry did not wait for its backoff"
        timer_started = events[(run_id, "fault_flaky", "end", 2)]
        assert events[(run_id, "fault_slow", "start", 1)] - timer_started >= 1.95, "early timer"
        assert (run_id, "fault_slow", "end", 1) in events
