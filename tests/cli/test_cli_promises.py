"""What docs/reference/cli.md promises: one-line errors, --json everywhere (ISO 8601
timestamps), schedules subcommands, a safe purge, readable runs, and flow control."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime

import pytest

from cyclone_dsl import Client, RunState, StepContext, Worker, step, workflow
from cyclone_dsl.testing.schemas import create_schema, drop_schema, with_search_path
from tests.cli import flows
from tests.cli.runner import Cli, in_process, runner
from tests.waiting import wait_until


@pytest.fixture
def cyclone(cyclone_dsn: str) -> Cli:
    return in_process(cyclone_dsn)


@pytest.mark.parametrize(
    "args",
    [("runs",), ("run", "1"), ("cancel", "1"), ("stats",), ("schedules",), ("purge", "--yes")],
)
def test_an_unmigrated_database_says_run_cyclone_migrate(
    cyclone_admin_dsn: str, args: tuple[str, ...]
) -> None:
    schema = create_schema(cyclone_admin_dsn, migrated=False)
    try:
        result = in_process(with_search_path(cyclone_admin_dsn, schema))(*args)
    finally:
        drop_schema(cyclone_admin_dsn, schema)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("cyclone: the database is at schema version 0")
    assert "run `cyclone migrate`" in line
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("dsn", "message"),
    [
        ("postgress://x@localhost/db", "the DSN cannot be parsed"),
        ("postgresql://postgres@nohost.invalid:5432/db", "check the host name in the DSN"),
    ],
)
def test_a_mistyped_dsn_is_one_line(dsn: str, message: str) -> None:
    result = runner(dsn)("runs")
    assert result.returncode in (1, 2)
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("cyclone: ") and message in line


def test_steering_commands_print_json(cyclone: Cli, client: Client) -> None:
    handle = client.submit(flows.waiting, 0)
    assert json.loads(cyclone("pause", str(handle.id), "--json").stdout) == {
        "run_id": handle.id,
        "action": "pause",
        "state": "paused",
    }
    resumed = json.loads(cyclone("resume", str(handle.id), "--json").stdout)
    assert resumed["state"] == "running"
    cancelled = json.loads(cyclone("cancel", str(handle.id), "--json").stdout)
    assert cancelled == {"run_id": handle.id, "action": "cancel", "state": "cancelled"}
    retried = json.loads(cyclone("retry", str(handle.id), "cli_add", "--json").stdout)
    assert retried == {
        "run_id": handle.id,
        "action": "retry",
        "node": "cli_add",
        "force": False,
        "state": "running",
    }


def test_json_timestamps_are_iso_8601(cyclone: Cli, client: Client) -> None:
    handle = client.submit(flows.waiting, 0)
    (listed,) = json.loads(cyclone("runs", "--json").stdout)
    assert datetime.fromisoformat(listed["created_at"]).tzinfo is not None
    assert "T" in listed["created_at"]
    shown = json.loads(cyclone("run", str(handle.id), "--json").stdout)
    assert all("T" in step["created_at"] for step in shown["steps"])


def test_schedules_subcommands(cyclone: Cli, client: Client) -> None:
    added = cyclone(
        "schedules",
        "add",
        "cli_flow",
        "0 3 * * *",
        "--id",
        "nightly",
        "--location",
        "Europe/Paris",
        "--input",
        "4",
        "--queue",
        "night",
        "--timeout",
        "5m",
        "-m",
        "tests.cli.flows",
        "--json",
    )
    assert added.returncode == 0, added.stderr
    created = json.loads(added.stdout)
    assert (created["id"], created["location"], created["queue"]) == (
        "nightly",
        "Europe/Paris",
        "night",
    )
    assert created["timeout_s"] == 300.0
    listing = cyclone("schedules").stdout.splitlines()
    assert listing[0].split()[:4] == ["id", "cron", "zone", "enabled"]
    assert "Europe/Paris" in listing[1] and " yes " in listing[1]
    assert cyclone("schedules", "disable", "nightly").stdout.strip() == "schedule nightly: disabled"
    assert not client.list_schedules()[0].enabled
    assert " no " in cyclone("schedules").stdout.splitlines()[1]
    assert cyclone("schedules", "enable", "nightly").returncode == 0
    assert client.list_schedules()[0].enabled
    assert cyclone("schedules", "rm", "nightly").returncode == 0
    assert client.list_schedules() == []
    missing = cyclone("schedules", "rm", "nightly")
    assert missing.returncode == 2
    assert missing.stderr.strip() == "cyclone: there is no schedule 'nightly'"
    bad = cyclone("schedules", "add", "cli_flow", "not a cron", "-m", "tests.cli.flows")
    assert bad.returncode == 2 and "not a valid cron expression" in bad.stderr


def ended_runs(client: Client, count: int) -> list[int]:
    ids = []
    for n in range(count):
        handle = client.submit(flows.waiting, n)
        client.cancel(handle.id)
        ids.append(handle.id)
    return ids


def test_purge_keeps_recent_runs_by_default(cyclone: Cli, client: Client) -> None:
    ended_runs(client, 3)
    assert json.loads(cyclone("purge", "--dry-run", "--json").stdout)["would_delete"] == 0
    assert cyclone("purge", "--yes").stdout.strip() == "deleted 0 runs"
    assert len(client.list_runs()) == 3
    dry = cyclone("purge", "--older-than", "0s", "--dry-run")
    assert dry.stdout.strip() == "3 runs ended more than 0s ago would be deleted"
    assert len(client.list_runs()) == 3


def test_purge_asks_before_deleting(cyclone: Cli, client: Client) -> None:
    ended_runs(client, 2)
    refused = cyclone("purge", "--older-than", "0s")  # stdin is not a terminal
    assert refused.returncode == 2
    assert "2 runs would be deleted: confirm with --yes" in refused.stderr
    assert len(client.list_runs()) == 2
    done = cyclone("purge", "--older-than", "0s", "--state", "cancelled", "--yes", "--json")
    assert json.loads(done.stdout) == {"deleted": 2}
    assert client.list_runs() == []


@pytest.mark.parametrize("text", ["7 days", "-1d", "d"])
def test_purge_refuses_a_bad_duration(cyclone: Cli, text: str) -> None:
    result = cyclone("purge", "--older-than", text, "--dry-run")
    assert result.returncode == 2
    assert "is not a duration" in result.stderr


@pytest.mark.parametrize(
    ("text", "refusal"),
    [
        ("10000000d", "older_than must be a timedelta from 0 to 1000 years"),
        ("99999999999999d", "is longer than any duration Cyclone takes"),
    ],
)
def test_purge_refuses_a_duration_past_the_timestamp_range(
    cyclone: Cli, text: str, refusal: str
) -> None:
    for extra in (("--dry-run",), ("--yes",)):
        result = cyclone("purge", "--older-than", text, *extra)
        assert result.returncode == 2
        assert refusal in result.stderr
        assert "Traceback" not in result.stderr


def test_runs_has_a_header_and_submit_once_says_nothing_new(cyclone: Cli, client: Client) -> None:
    first = cyclone("submit", "tests.cli.flows:flow", "--once", "k1", "--input", "1")
    again = cyclone("submit", "tests.cli.flows:flow", "--once", "k1", "--input", "1")
    assert first.stdout.strip().isdigit()
    assert again.stdout.strip() == (
        f"{first.stdout.strip()} (existing run for key 'k1': nothing new was created)"
    )
    lines = cyclone("runs").stdout.splitlines()
    assert lines[0].split() == ["run", "state", "workflow", "created"]
    assert len(lines) == 2


def test_run_collapses_a_big_fan_out_and_names_child_runs(
    cyclone: Cli, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(flows.fan_out, flows.parent)
    fanned = client.submit(flows.fan_out, 500)
    assert fanned.wait(timeout=60).state is RunState.COMPLETED
    text = cyclone("run", str(fanned.id)).stdout
    assert "cli_item[0..499]  500 items: 500 completed" in text
    assert len(text.splitlines()) < 10
    parent = client.submit(flows.parent, 1)
    (child,) = client.children_of(parent.id)
    assert f"→ child run {child['id']}" in cyclone("run", str(parent.id)).stdout


def test_stats_and_run_show_flow_control(
    cyclone: Cli, client: Client, start_worker: Callable[..., Worker]
) -> None:
    assert cyclone("queue-limit", "mail", "3").stdout.strip() == "queue 'mail': at most 3 running"
    assert cyclone("queue-limit", "mail", "zero").returncode == 2
    flows.release.clear()
    running = client.enqueue(flows.keyed, {"tenant": "t7"})
    waiting = client.enqueue(flows.keyed, {"tenant": "t7"})
    start_worker(flows.keyed)
    try:
        wait_until(lambda: running.get().steps[0].state.value == "running", what="the first step")
        lines = cyclone("stats").stdout.splitlines()
        (share,) = [line for line in lines if line.startswith("step:cli_keyed")]
        assert share.split() == ["step:cli_keyed", "t7", "1/1", "1"]
        assert any(line.startswith("queue:mail") for line in lines)
        shown = cyclone("run", str(waiting.id)).stdout
        assert "waiting for a concurrency slot (t7: 1/1)" in shown
    finally:
        flows.release.set()
    assert cyclone("queue-limit", "mail", "none").stdout.strip() == "queue 'mail': no cap"
    assert waiting.result(timeout=20) == "t7"


def test_retry_force_replays_and_fork_copies(
    cyclone: Cli, client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(flows.chained)
    handle = client.submit(flows.chained, 1)
    assert handle.result(timeout=30) == 3
    replayed = json.loads(cyclone("retry", str(handle.id), "cli_add_2", "--force", "--json").stdout)
    assert replayed["force"] is True
    assert handle.result(timeout=30) == 3
    forked = cyclone("fork", str(handle.id), "cli_add_2", "-m", "tests.cli.flows", "--json")
    assert forked.returncode == 0, forked.stderr
    data = json.loads(forked.stdout)
    assert (data["forked_from"], data["copied"]) == (handle.id, ["cli_add"])
    assert client.handle(data["run_id"]).result(timeout=30) == 3
    shown = cyclone("run", str(data["run_id"])).stdout
    assert f"fork of run {handle.id} from node 'cli_add_2'" in shown
    assert f"(copied from run {handle.id})" in shown
    refused = cyclone("retry", str(handle.id), "cli_add")
    assert refused.returncode == 2
    assert "cyclone: " in refused.stderr and "--force" not in refused.stdout


HOSTILE_TEXT = "bad \x1b[31mred\x9b2J\nforged line"


@step(name="cli_hostile_fail", max_attempts=1)
def hostile_fail(x: int, ctx: StepContext) -> int:
    ctx.progress(1, 2, HOSTILE_TEXT)
    raise RuntimeError(HOSTILE_TEXT)


@workflow(name="cli_hostile\x1b]0;title\x07")
def hostile_flow(x):  # type: ignore[no-untyped-def]
    return hostile_fail(x)


def test_error_texts_and_event_messages_from_handlers_are_escaped(
    cyclone: Cli, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A handler's error and progress message are user data: the end line of
    ``run --follow``, its event lines and ``submit --wait``'s error line escape their
    control characters (C1 ones too), as the listings do."""
    start_worker(hostile_fail, hostile_flow)
    handle = client.submit(hostile_flow, 1)
    assert handle.wait(timeout=20).state is RunState.FAILED
    followed = cyclone("run", str(handle.id), "--follow")
    waited = cyclone("submit", f"{__name__}:hostile_flow", "--input", "1", "--wait")
    assert followed.returncode == 1 and waited.returncode == 1
    for output in (followed.stdout, waited.stderr):
        assert "\x1b" not in output and "\x9b" not in output and "\x07" not in output, output
        assert not any(line.startswith("forged") for line in output.splitlines()), output
    assert "forged line" in followed.stdout  # escaped, on its event's line
    assert waited.stderr.strip().splitlines()[-1].startswith("cyclone: run "), waited.stderr
