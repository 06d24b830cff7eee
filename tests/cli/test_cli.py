"""Every CLI command against a real PostgreSQL: output, exit codes and error paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from cyclone_dsl import LATEST_EXTENSION_VERSION, Client, Worker
from cyclone_dsl.cli.main import cli
from tests.cli import flows
from tests.cli.runner import in_process, runner
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
Cli = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def cyclone(cyclone_dsn: str) -> Cli:
    """``cyclone --dsn DSN ARGS``: a ``worker`` in a subprocess (it would not end on its own
    if it did not fail), the other commands in this process through the entry point's own
    error handling (tests/cli/runner.py). The help test and the unreachable database start
    the installed entry point as a user does."""
    subprocess_run, here = runner(cyclone_dsn), in_process(cyclone_dsn)

    def run(*args: str, input_text: str | None = None) -> subprocess.CompletedProcess[str]:
        return (subprocess_run if "worker" in args else here)(*args, input_text=input_text)

    return run


def test_help_on_every_command(cyclone_dsn: str) -> None:
    commands = [
        "migrate",
        "worker",
        "submit",
        "runs",
        "run",
        "signal",
        "cancel",
        "pause",
        "resume",
        "retry",
        "schedules",
        "stats",
        "purge",
        "scan",
        "demo",
    ]
    top = runner(cyclone_dsn)("--help")  # the installed entry point, once
    assert top.returncode == 0
    click_runner = CliRunner()
    for command in commands:  # each command's help in this process: 16 starts cost 20 s
        assert command in top.stdout
        result = click_runner.invoke(cli, [command, "--help"])
        assert result.exit_code == 0, (command, result.output)
        assert result.output.startswith(f"Usage: cli {command} ")


def test_migrate_status(cyclone: Cli) -> None:
    result = cyclone("migrate", "--status", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "version": 19,
        "latest": 19,
        "extension_version": LATEST_EXTENSION_VERSION,
        "extension_latest": LATEST_EXTENSION_VERSION,
    }


def test_submit_wait_and_read(cyclone: Cli, start_worker: Callable[..., Worker]) -> None:
    start_worker(flows.add)
    result = cyclone("submit", "tests.cli.flows:flow", "--input", "41", "--wait", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["result"] == 42
    run_id = data["run_id"]
    listed = json.loads(cyclone("runs", "--json").stdout)
    assert [r["id"] for r in listed] == [run_id]
    assert listed[0]["state"] == "completed"
    shown = cyclone("run", str(run_id))
    assert shown.returncode == 0
    assert "cli_add [completed]" in shown.stdout
    assert json.loads(cyclone("run", str(run_id), "--json").stdout)["steps"][0]["output"] == 42


def test_submit_once_and_input_file(cyclone: Cli, tmp_path: Path) -> None:
    payload = tmp_path / "input.json"
    payload.write_text("7")
    first = json.loads(
        cyclone(
            "submit", "tests.cli.flows:flow", "--input", f"@{payload}", "--once", "k", "--json"
        ).stdout
    )
    again = json.loads(
        cyclone("submit", "tests.cli.flows:flow", "--input", "8", "--once", "k", "--json").stdout
    )
    assert first["created"] and not again["created"]
    assert first["run_id"] == again["run_id"]


def test_signal_pause_resume_cancel_retry(cyclone: Cli, client: Client) -> None:
    handle = client.submit(flows.waiting, 0)
    assert cyclone("pause", str(handle.id)).returncode == 0
    assert client.get_run(handle.id).state == "paused"
    assert cyclone("resume", str(handle.id)).returncode == 0
    delivered = cyclone("signal", str(handle.id), "go", "5", "--json")
    assert json.loads(delivered.stdout) == {"delivery": "consumed"}
    assert cyclone("cancel", str(handle.id)).returncode == 0
    assert client.get_run(handle.id).state == "cancelled"
    again = cyclone("cancel", str(handle.id))
    assert again.returncode == 2
    assert again.stderr.strip() == f"cyclone: run {handle.id} is already cancelled"
    retried = cyclone("retry", str(handle.id), "cli_add")
    assert retried.returncode == 0, retried.stderr
    assert client.get_run(handle.id).state == "running"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("run", "999999"), "run 999999 does not exist"),
        (("signal", "999999", "go"), "run 999999 does not exist"),
        (("submit", "tests.cli.flows:flow", "--input", "{bad"), "--input is not valid JSON"),
        (("submit", "no_such_workflow"), "workflow 'no_such_workflow' is not registered"),
        (("submit", "no.such.module:flow"), "cannot import 'no.such.module'"),
        (("runs", "--state", "sleeping"), "'sleeping' is not a run state; the states are running"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    cyclone: Cli, args: tuple[str, ...], message: str
) -> None:
    result = cyclone(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_unreachable_database_is_one_line_and_exit_1() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "cyclone_dsl.cli",
            "--dsn",
            "postgresql://nobody@127.0.0.1:1/none?connect_timeout=2",
            "runs",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "cyclone: cannot connect to 127.0.0.1:1 (database 'none'): Connection refused: "
        "is PostgreSQL running there, and is the port right?"
    ]


def test_schedules_stats_purge_scan(cyclone: Cli, client: Client) -> None:
    client.schedule(flows.flow, "0 3 * * *", id="nightly", location="UTC", input=1)
    listed = json.loads(cyclone("schedules", "--json").stdout)
    assert [s["id"] for s in listed] == ["nightly"]
    assert "nightly" in cyclone("schedules").stdout
    client.enqueue(flows.add, 1)
    stats = json.loads(cyclone("stats", "--json").stdout)
    assert stats["queues"][0]["available"] == 1
    assert json.loads(cyclone("purge", "--json").stdout) == {"deleted": 0}
    scanned = cyclone("scan", "--once", "-m", "tests.cli.flows")
    assert scanned.returncode == 0, scanned.stderr
    assert "scan pass done" in scanned.stdout


def test_stats_and_workers_show_who_serves_what(
    cyclone: Cli, client: Client, start_worker: Callable[..., Worker]
) -> None:
    client.enqueue(flows.add, 1, queue="nobody")  # a queue no worker serves
    text = cyclone("stats").stdout
    assert "kind " in text and "cli_add" in text
    assert "waiting for a worker" in text and "queue 'nobody'" in text
    assert "no live workers" in cyclone("workers").stdout
    worker = start_worker(flows.flow)
    listed = json.loads(cyclone("workers", "--json").stdout)
    assert [w["id"] for w in listed] == [worker.id]
    assert {"workflow": "cli_flow", "def_version": flows.flow.def_version} in listed[0]["versions"]
    assert worker.id in cyclone("workers").stdout


def test_a_conflicting_worker_is_one_line_and_exit_2(
    cyclone: Cli, start_worker: Callable[..., Worker]
) -> None:
    start_worker(flows.flow)
    result = cyclone("worker", "tests.cli.other_app")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "kind 'cli_add'" in lines[0], result.stderr


def test_worker_retention_deletes_ended_runs_after_it(cyclone_dsn: str, client: Client) -> None:
    """`cyclone worker --retention 1s`: the worker's scanner deletes a run a second after
    it ended (the default keeps it 7 days)."""
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "cyclone_dsl.cli", "--dsn", cyclone_dsn, "worker"),
            *("tests.cli.flows", "--processes", "1", "--retention", "1s", "--lease", "5"),
            *("--catch-up", "all", "--grace", "5"),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        handle = client.submit(flows.flow, 1)
        assert handle.result(timeout=30) == 2
        wait_until(lambda: client.list_runs() == [], timeout=20, what="retention to take the run")
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize(
    ("args", "refusal"),
    [
        (("--retention", "0s"), "retention must be a positive duration"),
        (("--retention", "soon"), "'soon' is not a duration"),
        (("--lease", "0"), "0.0 is not in the range x>0"),
    ],
)
def test_worker_refuses_a_bad_retention_or_lease(
    cyclone: Cli, args: tuple[str, ...], refusal: str
) -> None:
    result = cyclone("worker", "tests.cli.flows", "--processes", "1", *args)
    assert result.returncode == 2
    assert refusal in result.stderr, result.stderr


def test_a_module_without_handlers_is_one_line(cyclone: Cli) -> None:
    result = cyclone("worker", "json")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "cyclone: this worker has no handlers: pass the modules (or the @workflow, @step and "
        "@action objects) whose steps it runs"
    ]
