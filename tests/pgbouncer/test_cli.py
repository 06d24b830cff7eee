"""The command line through PgBouncer: ``--pooled`` and ``--listen-url``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from tests.cli.test_cli import ROOT


def cyclone(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cyclone_dsl.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        check=False,
    )


def test_migrate_refuses_a_pooled_dsn_and_uses_the_listen_url(
    pooled_dsn: str, cyclone_dsn: str
) -> None:
    refused = cyclone("--dsn", pooled_dsn, "--pooled", "migrate")
    assert refused.returncode == 2
    assert "direct" in refused.stderr and "--listen-url" in refused.stderr
    done = cyclone(
        "migrate",
        env={
            "CYCLONE_DATABASE_URL": pooled_dsn,
            "CYCLONE_POOLED": "1",
            "CYCLONE_LISTEN_URL": cyclone_dsn,
        },
    )
    assert done.returncode == 0, done.stderr
    assert "schema version at" in done.stdout


def test_worker_and_submit_through_pgbouncer_without_listen(pooled_dsn: str) -> None:
    worker = subprocess.Popen(
        [
            *(sys.executable, "-m", "cyclone_dsl.cli", "--dsn", pooled_dsn, "worker"),
            *("tests.cli.flows", "--pooled", "--poll-interval", "0.1", "--grace", "5"),
            *("--processes", "1"),  # one process: the polling notice is logged once
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        result = cyclone(
            "--dsn",
            pooled_dsn,
            "--pooled",
            "submit",
            "tests.cli.flows:flow",
            "--input",
            "41",
            "--wait",
            "--json",
        )
    finally:
        worker.send_signal(signal.SIGTERM)
        _, errors = worker.communicate(timeout=30)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["result"] == 42
    assert worker.returncode == 0, errors
    assert errors.count("no LISTEN connection") == 1
