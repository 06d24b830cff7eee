"""``cyclone cancel-many``, ``retry-many`` and ``resume-many`` against a real PostgreSQL."""

from __future__ import annotations

import json

import pytest

from cyclone_dsl import Client, RunState
from tests.cli import flows
from tests.cli.runner import Cli, in_process


@pytest.fixture
def cyclone(cyclone_dsn: str) -> Cli:
    """In this process, stdin not a terminal: no prompt, --yes or a refusal."""
    return in_process(cyclone_dsn)


def states(client: Client, run_ids: list[int]) -> list[RunState]:
    return [client.get_run(r).state for r in run_ids]


def test_cancel_many_counts_asks_then_acts_with_progress(cyclone: Cli, client: Client) -> None:
    waiting = [client.submit(flows.waiting, i).id for i in range(3)]
    other = client.submit(flows.flow, 9).id  # no worker: it stays running
    dry = cyclone("cancel-many", "--workflow", "cli_waiting", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["matched"] == 3
    assert states(client, waiting) == [RunState.RUNNING] * 3

    refused = cyclone("cancel-many", "--workflow", "cli_waiting")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "cyclone: 3 runs would be cancelled: confirm with --yes (or see --dry-run)"
    ]
    assert states(client, waiting) == [RunState.RUNNING] * 3

    done = cyclone("cancel-many", "--workflow", "cli_waiting", "--yes", "--batch-size", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "3 runs cancelled, 0 skipped"
    assert "2 runs done: 2 acted on, 0 skipped" in done.stderr
    assert states(client, waiting) == [RunState.CANCELLED] * 3
    assert client.get_run(other).state == RunState.RUNNING

    again = cyclone("cancel-many", "--workflow", "cli_waiting", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["acted"] == 0


def test_resume_many_and_retry_many_json(cyclone: Cli, client: Client) -> None:
    runs = [client.submit(flows.waiting, i).id for i in range(2)]
    client.pause(runs[0])
    resumed = cyclone("resume-many", "--all", "--yes", "--json")
    assert resumed.returncode == 0, resumed.stderr
    data = json.loads(resumed.stdout)
    assert (data["action"], data["matched"], data["acted"]) == ("resume", 1, 1)
    client.cancel(runs[1])
    retried = cyclone("retry-many", "--state", "cancelled", "--yes", "--json")
    assert retried.returncode == 0, retried.stderr
    assert json.loads(retried.stdout)["acted"] == 1
    assert states(client, runs) == [RunState.RUNNING, RunState.RUNNING]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "no filter option would select every run"),
        (("--all", "--workflow", "x"), "--all selects every run"),
        (("--state", "done"), "'done' is not a run state"),
        (("--state", "completed"), "cancel applies to running and paused runs"),
        (("--error-kind", "oops"), "'oops' is not an error kind"),
        (("--since", "2026-01-01T00:00:00"), "--since needs a UTC offset"),
        (("--until", "yesterday"), "--until must be an ISO 8601 date"),
    ],
)
def test_bad_filters_are_one_line_and_exit_2(
    cyclone: Cli, client: Client, args: tuple[str, ...], message: str
) -> None:
    run_id = client.submit(flows.waiting, 1).id
    result = cyclone("cancel-many", *args, "--yes")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert client.get_run(run_id).state == RunState.RUNNING
