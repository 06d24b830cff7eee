"""``--read-url`` on the command line: the read-only commands read the replica, a replica
that cannot be reached is refused in one line, a primary given as one only warns."""

from __future__ import annotations

import json

from cyclone_dsl import Client, step, workflow
from tests.cli.runner import one_error_line, runner
from tests.replica.conftest import Pair


@step(name="replica_cli_echo")
def echo(x: object) -> object:
    return x


@workflow(name="replica_cli_flow")
def flow(x):  # type: ignore[no-untyped-def]
    return echo(x)


def listed(output: str) -> set[int]:
    return {run["id"] for run in json.loads(output)}


def test_runs_and_stats_read_the_replica(live_pair: Pair) -> None:
    cli = runner(live_pair.primary_url)
    live_pair.replay(paused=True)
    with Client(live_pair.primary_url) as client:
        handle = client.submit(flow, 1)
    from_replica = cli("runs", "--json", "--read-url", live_pair.replica_url)
    assert from_replica.returncode == 0, from_replica.stderr
    assert handle.id not in listed(from_replica.stdout)
    assert handle.id in listed(cli("runs", "--json").stdout)
    stats = cli("stats", "--json", "--read-url", live_pair.replica_url)
    assert stats.returncode == 0 and "queues" in json.loads(stats.stdout)
    shown = cli("run", str(handle.id), "--read-url", live_pair.replica_url)
    assert shown.returncode == 2  # not replayed yet: the replica does not know it
    assert f"run {handle.id} does not exist" in shown.stderr


def test_a_read_url_that_cannot_be_reached_is_refused_in_one_line(live_pair: Pair) -> None:
    cli = runner(live_pair.primary_url)
    nowhere = "postgresql://postgres:s3cret@/postgres?host=/nonexistent-cyclone-socket&port=5432"
    for args in (("ui", "--read-url", nowhere), ("stats", "--read-url", nowhere)):
        result = cli(*args)
        assert result.returncode == 1
        line = one_error_line(result)
        assert line.startswith("cyclone: --read-url: cannot connect to socket"), line
        assert "s3cret" not in line


def test_a_primary_given_as_read_url_is_read_with_a_warning(live_pair: Pair) -> None:
    cli = runner(live_pair.primary_url)
    result = cli("stats", "--json", "--read-url", live_pair.primary_url)
    assert result.returncode == 0
    assert "warning: --read-url is not a standby" in result.stderr
    assert "queues" in json.loads(result.stdout)
