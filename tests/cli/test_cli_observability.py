"""``cyclone worker --metrics-port N --log-format json`` through the real CLI process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from cyclone_dsl import Client
from tests.cli import log_flows
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


def test_worker_serves_metrics_and_prints_json_lines(cyclone_dsn: str, client: Client) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cyclone_dsl.cli",
            "--dsn",
            cyclone_dsn,
            "-v",
            "worker",
            "tests.cli.log_flows",
            "--metrics-port",
            "0",
            "--metrics-host",
            "127.0.0.1",
            "--log-format",
            "json",
            "--grace",
            "5",
            # One process: each worker process serves its own /metrics, and the step must
            # be counted on the port read below (the default is a process per core).
            "--processes",
            "1",
        ],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    lines: list[str] = []
    assert proc.stderr is not None
    stderr = proc.stderr
    reader = threading.Thread(target=lambda: lines.extend(iter(stderr.readline, "")))
    reader.start()
    try:

        def port() -> int | None:
            for line in list(lines):
                found = re.search(r"serving metrics on 127\.0\.0\.1:(\d+)/metrics", line)
                if found:
                    return int(found.group(1))
            assert proc.poll() is None, "".join(lines)
            return None

        metrics_port = wait_until(port, timeout=30, what="the worker serves its metrics")
        handle = client.enqueue(log_flows.logs_a_line, 21)
        assert handle.result(timeout=30) == 42
        step_id = client.get_run(handle.id).steps[0].id

        def completed() -> float:
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as response:
                text = response.read().decode()
            return sum(
                sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.name == "cyclone_steps_completed_total"
                and sample.labels == {"queue": "default", "kind": "cli_logs"}
            )

        wait_until(lambda: completed() == 1, what="the completion counted")
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        reader.join(timeout=10)
    assert code == 0, "".join(lines)
    parsed: list[dict[str, Any]] = [json.loads(line) for line in lines]  # every line is JSON
    [handled] = [p for p in parsed if p["message"] == "handling 21"]
    assert handled["logger"] == "tests.cli.log_flows" and handled["level"] == "WARNING"
    assert (
        handled["run_id"],
        handled["node"],
        handled["step_id"],
        handled["attempt"],
        handled["kind"],
    ) == (handle.id, "cli_logs", step_id, 1, "cli_logs")
    assert any("stopped" in p["message"] for p in parsed)
