"""The benchmark runs end to end in --smoke mode (a check that it works, not of speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)  # about 45 s alone; more beside other tests on two cores
def test_bench_quick_writes_a_report(tmp_path: Path, cyclone_admin_dsn: str) -> None:
    out = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CYCLONE_DATABASE_URL": cyclone_admin_dsn},
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    scenarios = {row["scenario"] for row in report["results"]}
    assert "standalone no-op steps" in scenarios
    assert "wake-up latency, median" in scenarios
    assert "untuned worker, async 10 ms sleep steps" in scenarios
    assert any(s.startswith("retention:") for s in scenarios)
    assert any(s.startswith("idle scanner look") for s in scenarios)
    assert any(s.startswith("standalone with") for s in scenarios)
    assert all(row["cyclone"] > 0 for row in report["results"])
    # Every result() and events() of a client waits on its one connection.
    connections = [
        row["cyclone"] for row in report["results"] if row["scenario"].endswith("wait connections")
    ]
    assert connections == [1, 1]
    # A client's start checks the database on the session its pool then keeps.
    sessions = {row["scenario"]: row["cyclone"] for row in report["results"]}
    assert sessions["sessions a client start opens"] == 1
    assert sessions["sessions a worker start and stop open"] <= 4  # pool, listen, heartbeat
    assert report["mode"] == "smoke"
