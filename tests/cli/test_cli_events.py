"""``cyclone run ID --follow`` against a real PostgreSQL: events printed live, one line
each, then the run's final state and exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from cyclone_dsl import Client, Permanent, StepContext, Worker, step

ROOT = Path(__file__).resolve().parents[2]


@step(name="cli_ev_report")
def report(n: int, ctx: StepContext) -> int:
    ctx.emit({"phase": "start"})
    for i in range(1, n + 1):
        ctx.progress(i, n, f"item {i}")
    if n > 3:
        raise Permanent("too many items")
    return n


def follow(dsn: str, run_id: int, *extra: str) -> subprocess.Popen[str]:
    """Start ``cyclone run ID --follow``: it runs while the test starts the worker."""
    command = ["run", str(run_id), "--follow", *extra]
    return subprocess.Popen(
        [sys.executable, "-m", "cyclone_dsl.cli", "--dsn", dsn, *command],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_follow_prints_events_as_they_come_then_the_final_state(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    handle = client.enqueue(report, 3)
    cli = follow(cyclone_dsn, handle.id)
    start_worker(report)  # the step runs while the CLI already follows
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 0, err
    lines = out.splitlines()
    assert len(lines) == 5
    assert lines[0].endswith('#1 cli_ev_report {"phase": "start"}')
    assert lines[1].endswith("#2 cli_ev_report progress 1/3 (33%) item 1")
    assert lines[3].endswith("#4 cli_ev_report progress 3/3 (100%) item 3")
    assert lines[4] == f"run {handle.id} cli_ev_report completed"


def test_follow_json_lines_and_a_failed_run_exits_1(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(report)
    handle = client.enqueue(report, 4)
    handle.wait(timeout=20)
    cli = follow(cyclone_dsn, handle.id, "--after", "3", "--json")
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 1, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r.get("seq") for r in rows] == [4, 5, None]
    assert rows[0]["data"] == {"done": 3, "total": 4, "message": "item 3"}
    assert rows[0]["kind"] == "progress" and rows[0]["fenced"] is False
    assert rows[-1] == {"run_id": handle.id, "state": "failed"}


def test_follow_an_unknown_run_is_one_line_and_exit_2(cyclone_dsn: str) -> None:
    cli = follow(cyclone_dsn, 999_999)
    _out, err = cli.communicate(timeout=60)
    assert cli.returncode == 2
    assert err.strip() == "cyclone: run 999999 does not exist"
