"""An audit of the ``cyclone`` command line against a real PostgreSQL.

In this process, through :func:`cyclone_dsl.cli.main.run` (the entry point's own error
handling): bad input is one ``cyclone:`` line with the documented exit code and writes
nothing, ``--json`` agrees with the client, and hostile names do not break the human output.
The tests marked xfail are findings: each says what happens and what should.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from cyclone_dsl import Client, RunState, StepState, step, wait_signal, workflow
from cyclone_dsl.cli.main import run as cli_main
from tests.cli import flows

#: A workflow name with emoji, both quotes, non-ASCII letters and 200 more characters.
HOSTILE = "cla_🚀 \"double\" 'single' é " + "ü" * 200


@step(name="cla_hostile_step 🚀 \"q\" 'q'")
def cla_hostile_step(x: int) -> int:
    return x


@workflow(name=HOSTILE)
def cla_hostile(x):  # type: ignore[no-untyped-def]
    return cla_hostile_step(wait_signal("go"))


@workflow(name="cla_two\nlines \x1b]0;title\x07")
def cla_control(x):  # type: ignore[no-untyped-def]
    return cla_hostile_step(x)


@dataclass
class Result:
    code: int | str | None
    out: str
    err: str

    def one_error_line(self) -> str:
        """The single ``cyclone: ...`` line on stderr, nothing on stdout (a worker's warnings
        about invalid workflows other tests of this process defined are left out)."""
        lines = [
            line
            for line in self.err.strip().splitlines()
            if " WARNING cyclone." not in line and not line.startswith("  - ")
        ]
        assert len(lines) == 1, self.err
        assert lines[0].startswith("cyclone: "), self.err
        assert "Traceback" not in self.err
        assert self.out == "", self.out
        return lines[0]


Cli = Callable[..., Result]


def invoke(args: list[str], input_text: str | None = None) -> Result:
    """``cyclone ARGS`` in this process, stdin not a terminal; its exit code and output."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level  # `worker` replaces the root's handlers
    runner = CliRunner()
    try:
        with runner.isolation(input=input_text) as (out, err, _):
            try:
                code: int | str | None = cli_main(args)
            except SystemExit as exc:
                code = exc.code
            return Result(code, out.getvalue().decode(), err.getvalue().decode())
    finally:
        for handler in root.handlers[:]:
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)


@pytest.fixture
def cyclone(cyclone_dsn: str) -> Cli:
    def run(*args: str, input_text: str | None = None) -> Result:
        return invoke(["--dsn", cyclone_dsn, *args], input_text)

    return run


HUGE = str(10**20)  # past bigint


# -- unknown runs and bad input: one line, exit 2, nothing written ------------------------


def test_a_run_id_past_bigint_is_unknown_for_every_command(cyclone: Cli) -> None:
    for args in [
        ("run", HUGE),
        ("run", HUGE, "--json"),
        ("run", HUGE, "--follow"),
        ("cancel", HUGE),
        ("pause", HUGE),
        ("resume", HUGE),
        ("retry", HUGE, "cli_add"),
        ("retry", HUGE, "cli_add", "--force"),
        ("signal", HUGE, "go", "1"),
        ("fork", HUGE, "cli_add"),
    ]:
        result = cyclone(*args)
        assert result.code == 2, (args, result)
        assert result.one_error_line() == f"cyclone: run {HUGE} does not exist", args


#: Payloads every command that takes JSON refuses, and what it says.
BAD_PAYLOADS = [
    ('"a\\u0000b"', "contains a NUL character"),
    ("1e999", "inf is not valid JSON"),
    ("NaN", "nan is not valid JSON"),
    (HUGE, "integer out of the 64-bit range"),
    ('{"a": [1, {"b": -' + HUGE + "}]}", "integer out of the 64-bit range"),
    ("{bad", "is not valid JSON"),
    ("", "is not valid JSON"),
]


def test_bad_payloads_are_refused_and_write_nothing(
    cyclone: Cli, client: Client, tmp_path: Path
) -> None:
    waiting = client.submit(flows.waiting, 1).id
    for number, (payload, message) in enumerate(BAD_PAYLOADS):
        file = tmp_path / f"input{number}.json"
        file.write_text(payload)
        for args in [
            ("submit", "tests.cli.flows:flow", "--input", payload),
            ("submit", "tests.cli.flows:flow", "--input", f"@{file}", "--json"),
            ("signal", str(waiting), "go", payload),
            ("schedules", "add", "tests.cli.flows:flow", "0 3 * * *", "--input", f"@{file}"),
        ]:
            result = cyclone(*args)
            assert result.code == 2, (args, result)
            assert message in result.one_error_line(), args
    assert [r.id for r in client.list_runs()] == [waiting]
    assert client.get_run(waiting).step("go").state is StepState.WAITING_SIGNAL
    assert client.signals_of(waiting) == []
    assert client.list_schedules() == []


def test_steering_an_ended_run_is_exit_2_and_changes_nothing(cyclone: Cli, client: Client) -> None:
    run_id = client.submit(flows.waiting, 1).id
    client.cancel(run_id)
    for args in [
        ("cancel", str(run_id)),
        ("pause", str(run_id)),
        ("resume", str(run_id)),
        ("signal", str(run_id), "go", "1"),
        ("retry", str(run_id), "no_such_node"),
    ]:
        result = cyclone(*args, "--json")
        assert result.code == 2, (args, result)
        result.one_error_line()
    assert client.get_run(run_id).state is RunState.CANCELLED


def test_schedule_values_that_are_refused_create_nothing(cyclone: Cli, client: Client) -> None:
    target = ("schedules", "add", "tests.cli.flows:flow")
    for args, message in [
        (("not a cron",), "is not a valid cron expression"),
        (("0 3 * * *", "--location", "Mars/Olympus"), "is not an IANA time zone"),
        (("0 3 * * *", "--timeout", "0s"), "timeout must be a positive duration"),
        (("0 3 * * *", "--retention", "99999999999w"), "longer than any duration"),
        (("0 3 * * *", "--priority", HUGE), "priority must be a 32-bit integer"),
        (("0 3 * * *", "--max-attempts", "0"), "max_attempts must be an integer"),
        (("0 3 * * *", "--id", ""), "a schedule id must be a non-empty string"),
        (("0 3 * * *", "--queue", ""), "queue must be a non-empty string"),
        (("0 3 * * *", "--input", "1e999"), "inf is not valid JSON"),
    ]:
        result = cyclone(*target, *args, "--json")
        assert result.code == 2, (args, result)
        assert message in result.one_error_line(), args
    unknown = cyclone("schedules", "add", "tests.cli.flows:nothing", "0 3 * * *")
    assert unknown.code == 2
    assert unknown.one_error_line() == "cyclone: module 'tests.cli.flows' has no 'nothing'"
    for verb in ("enable", "disable", "rm"):
        missing = cyclone("schedules", verb, "cla_nope", "--json")
        assert missing.code == 2
        assert missing.one_error_line() == "cyclone: there is no schedule 'cla_nope'"
    assert client.list_schedules() == []


def test_bulk_and_purge_refusals_change_nothing(cyclone: Cli, client: Client) -> None:
    running = client.submit(flows.waiting, 1).id
    ended = client.submit(flows.waiting, 2).id
    client.cancel(ended)
    for args, message in [
        (
            (
                "cancel-many",
                "--since",
                "2026-01-01T00:00:00+00:00",
                "--until",
                "2020-01-01T00:00:00Z",
            ),
            "must be before until",
        ),
        (("cancel-many", "--all", "--batch-size", "0"), "invalid value for '--batch-size'"),
        (("retry-many", "--ended-since", "last week"), "--ended-since must be an ISO 8601"),
        (("resume-many", "--queue", "q", "--all"), "--all selects every run"),
        (("purge", "--older-than", "0s", "--batch-size", "0"), "invalid value for '--batch-size'"),
        (("purge", "--older-than", "1e400s"), "is not a duration"),
        (("purge", "--older-than", "0s", "--state", "running"), "invalid value for '--state'"),
    ]:
        result = cyclone(*args, "--yes")
        assert result.code == 2, (args, result)
        assert message in result.one_error_line(), args
    assert client.get_run(running).state is RunState.RUNNING
    assert client.get_run(ended).state is RunState.CANCELLED


def test_purge_without_yes_off_a_terminal_refuses_and_deletes_nothing(
    cyclone: Cli, client: Client
) -> None:
    ended = client.submit(flows.waiting, 2).id
    client.cancel(ended)
    refused = cyclone("purge", "--older-than", "0s", input_text="y\n")
    assert refused.code == 2
    assert refused.one_error_line() == (
        "cyclone: 1 runs would be deleted: confirm with --yes (or see --dry-run)"
    )
    dry = cyclone("purge", "--older-than", "0s", "--dry-run", "--json")
    assert (dry.code, json.loads(dry.out)) == (0, {"would_delete": 1, "older_than_s": 0.0})
    assert [r.id for r in client.list_runs()] == [ended]
    done = cyclone("purge", "--older-than", "0s", "--yes", "--json")
    assert (done.code, json.loads(done.out)) == (0, {"deleted": 1})
    assert client.list_runs() == []


def test_verbose_keeps_planned_errors_to_one_line(cyclone: Cli) -> None:
    for args in [
        ("-v", "cancel", HUGE),
        ("-v", "submit", "tests.cli.flows:flow", "--input", "{bad"),
        ("-v", "schedules", "rm", "cla_nope"),
        ("-v", "runs", "--state", "sleeping"),
    ]:
        result = cyclone(*args)
        assert result.code == 2, (args, result)
        result.one_error_line()


def test_unreachable_read_url_is_exit_1_for_every_read_command(cyclone: Cli) -> None:
    nowhere = "postgresql://app:s3cret@127.0.0.1:1/app?connect_timeout=2"
    for args in [("runs",), ("run", "1"), ("workers", "--all"), ("schedules",), ("stats",)]:
        result = cyclone(*args, "--read-url", nowhere, "--json")
        assert result.code == 1, (args, result)
        line = result.one_error_line()
        assert line.startswith("cyclone: --read-url: cannot connect to 127.0.0.1:1"), line
        assert "s3cret" not in line
    wrong = cyclone("runs", "--read-url", "mysql://app:s3cret@localhost/app")
    assert wrong.code == 2
    assert "its URL scheme is 'mysql'" in wrong.one_error_line()


def test_worker_refuses_bad_arguments_in_one_line_and_registers_nothing(
    cyclone: Cli, client: Client
) -> None:
    base = ("worker", "tests.cli.flows", "--processes", "1", "--no-scanners")
    for args, message in [
        (("--concurrency", "4", "--max-concurrency", "8"), "with a fixed concurrency"),
        (("--grace", "nan"), "grace must be a finite number"),
        (("--poll-interval", "0"), "poll_interval must be a finite number of seconds > 0"),
        (("--lease", "inf"), "lease must be a finite number"),
        (("--queues", " , ,"), "a worker needs at least one queue"),
        (("--max-async", HUGE), "max_async must be an integer"),
        (("--metrics-port", "70000"), "is not in the range 0<=x<=65535"),
        (("--retention", "12 parsecs"), "is not a duration"),
        (("--catch-up", "some"), "invalid value for '--catch-up'"),
    ]:
        result = cyclone(*base, *args)
        assert result.code == 2, (args, result)
        assert message in result.one_error_line(), args
    assert client.workers() == []


# -- what --json prints agrees with the client; hostile names do not break the output --


def test_runs_json_matches_list_runs_with_each_filter(cyclone: Cli, client: Client) -> None:
    first = client.submit(cla_hostile, 1).id
    second = client.submit(flows.waiting, 2).id
    third = client.submit(cla_hostile, 3).id
    client.cancel(second)
    for args, kwargs in [
        ((), {}),
        (("--workflow", HOSTILE), {"workflow": HOSTILE}),
        (("--state", "cancelled"), {"state": "cancelled"}),
        (("--state", "running", "--limit", "1"), {"state": "running", "limit": 1}),
    ]:
        result = cyclone("runs", *args, "--json")
        assert result.code == 0, (args, result.err)
        listed = json.loads(result.out)
        expected = client.list_runs(**kwargs)  # type: ignore[arg-type]
        assert [row["id"] for row in listed] == [r.id for r in expected], args
        for row, run in zip(listed, expected, strict=True):
            assert (row["workflow"], row["state"], row["input"]) == (
                run.workflow,
                run.state.value,
                run.input,
            )
            assert datetime.fromisoformat(row["created_at"]) == run.created_at
            assert row["def_version"] == run.def_version
    assert [r["id"] for r in json.loads(cyclone("runs", "--json").out)] == [third, second, first]


def test_run_json_matches_get_run(cyclone: Cli, client: Client) -> None:
    run_id = client.submit(cla_hostile, 7).id
    result = cyclone("run", str(run_id), "--json")
    assert result.code == 0, result.err
    shown = json.loads(result.out)
    run = client.get_run(run_id)
    assert (shown["id"], shown["workflow"], shown["state"], shown["input"]) == (
        run_id,
        HOSTILE,
        "running",
        7,
    )
    assert [(s["node"], s["state"], s["attempt"]) for s in shown["steps"]] == [
        (s.node, s.state.value, s.attempt) for s in run.steps
    ]
    assert shown["child_runs"] == {}
    assert shown["waiting_for"] == client.why_waiting(run_id)


def test_hostile_names_render_in_every_human_listing(cyclone: Cli, client: Client) -> None:
    run_id = client.submit(cla_hostile, 1).id
    added = cyclone(
        "schedules",
        "add",
        "tests.cli.test_cli_audit:cla_hostile",
        "0 3 * * *",
        "--id",
        'cla 🚀 "it\'s" ' + "x" * 300,
        "--location",
        "UTC",
        "--input",
        '"ü 🚀"',
    )
    assert added.code == 0, added.err
    for args in [("runs",), ("run", str(run_id)), ("schedules",), ("stats",)]:
        result = cyclone(*args)
        assert result.code == 0, (args, result.err)
        assert result.err == ""
        assert "🚀" in result.out, args
    listed = cyclone("runs").out.splitlines()
    assert len(listed) == 2 and HOSTILE in listed[1]
    assert cyclone("run", str(run_id)).out.splitlines()[0] == f"run {run_id} {HOSTILE} [running]"
    (schedule,) = json.loads(cyclone("schedules", "--json").out)
    assert schedule["input"] == "ü 🚀" and schedule["kind"] == HOSTILE


def test_stats_and_workers_json_agree_with_the_client(cyclone: Cli, client: Client) -> None:
    client.submit(cla_hostile, 1)
    client.enqueue(flows.add, 1, queue="cla 🚀 queue")
    stats = cyclone("stats", "--json")
    assert stats.code == 0, stats.err
    data = json.loads(stats.out)
    expected = client.stats()
    assert sorted(q["queue"] for q in data["queues"]) == sorted(
        q["queue"] for q in expected["queues"]
    )
    assert {(k["kind"], k["state"], k["count"]) for k in data["kinds"]} == {
        (k["kind"], k["state"], k["count"]) for k in expected["kinds"]
    }
    assert [(u["kind"], u["queue"], u["steps"]) for u in data["unserved"]] == [
        (u["kind"], u["queue"], u["steps"]) for u in expected["unserved"]
    ]
    assert ("cli_add", "cla 🚀 queue", 1) in [
        (u["kind"], u["queue"], u["steps"]) for u in data["unserved"]
    ]
    assert "queue 'cla 🚀 queue'" in cyclone("stats").out
    workers = cyclone("workers", "--all", "--json")
    assert (workers.code, json.loads(workers.out)) == (0, [])


def test_migrate_on_a_migrated_schema_changes_nothing_and_says_so(cyclone: Cli) -> None:
    status = json.loads(cyclone("migrate", "--status", "--json").out)
    again = cyclone("migrate", "--json")
    assert again.code == 0, again.err
    assert json.loads(again.out) == {
        "before": status["version"],
        "version": status["version"],
        "extension_before": status["extension_version"],
        "extension_version": status["extension_version"],
    }
    assert cyclone("migrate").out.strip() == (
        f"schema version at {status['version']}, extension version at {status['extension_version']}"
    )


# -- findings -----------------------------------------------------------------------------


def test_a_malformed_module_name_is_a_usage_error(cyclone: Cli) -> None:
    for args in [
        ("submit", ":flow"),
        ("submit", "cli_flow", "-m", ""),
        ("schedules", "add", ".rel:flow", "0 3 * * *"),
        ("worker", ""),
        ("fork", "1", "cli_add", "-m", ".rel"),
    ]:
        result = cyclone(*args)
        line = result.one_error_line()
        assert (result.code, "unexpected error" in line) == (2, False), (args, line)
        assert line.startswith("cyclone: cannot import"), (args, line)


def test_an_input_file_that_is_not_utf8_is_a_usage_error(
    cyclone: Cli, client: Client, tmp_path: Path
) -> None:
    file = tmp_path / "input.json"
    file.write_bytes(b"\xff\xfe{}")
    waiting = client.submit(flows.waiting, 1).id
    for args in [
        ("submit", "tests.cli.flows:flow", "--input", f"@{file}"),
        ("signal", str(waiting), "go", f"@{file}"),
        ("schedules", "add", "tests.cli.flows:flow", "0 3 * * *", "--input", f"@{file}"),
    ]:
        result = cyclone(*args)
        line = result.one_error_line()
        assert (result.code, "unexpected error" in line) == (2, False), (args, line)
    assert [r.id for r in client.list_runs()] == [waiting]


@contextmanager
def cancelling_runs_after(dsn: str, seconds: float) -> Iterator[None]:
    """After ``seconds``, cancel every running run until the block ends (ends a --wait
    that would wait for ever)."""
    done = threading.Event()

    def cancel() -> None:
        if done.wait(seconds):
            return
        with Client(dsn) as canceller:
            while not done.is_set():
                for run in canceller.list_runs(state="running"):
                    canceller.cancel(run.id)
                done.wait(0.1)

    thread = threading.Thread(target=cancel, name="cla-canceller", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(10)


def test_submit_wait_refuses_a_bad_timeout_before_submitting(
    cyclone: Cli, client: Client, cyclone_dsn: str
) -> None:
    for timeout in ("nan", "-1"):
        started = time.monotonic()
        # No worker: a submitted run would never end; the canceller ends such a wait after
        # 10 s, twice the time a refusal may take on a loaded machine.
        with cancelling_runs_after(cyclone_dsn, 10.0):
            result = cyclone("submit", "tests.cli.flows:flow", "--wait", "--timeout", timeout)
        took = time.monotonic() - started
        assert result.code == 2, (timeout, took, result)
        assert took < 5, (timeout, took)  # refused, not waited for
        result.one_error_line()
        assert client.list_runs() == [], timeout


def test_migrate_refuses_an_impossible_target_as_bad_usage(cyclone: Cli) -> None:
    for args in [
        ("--target", "999"),
        ("--extension-target", "-1"),
        ("--target", "18", "--extension-target", "3"),
    ]:
        result = cyclone("migrate", *args)
        result.one_error_line()
        assert result.code == 2, (args, result)
    assert cyclone("migrate", "--status").out.startswith("schema version 19 ")


def test_migrate_status_with_a_target_is_refused(cyclone: Cli) -> None:
    result = cyclone("migrate", "--status", "--target", "19")  # 19: nothing to do either way
    assert result.code == 2, result
    result.one_error_line()


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port of 127.0.0.1 that another socket listens on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def test_worker_on_a_metrics_port_in_use_says_so(cyclone: Cli, taken_port: int) -> None:
    result = cyclone(
        *("worker", "tests.cli.flows", "--processes", "1", "--no-scanners"),
        *("--metrics-port", str(taken_port), "--metrics-host", "127.0.0.1"),
    )
    line = result.one_error_line()
    assert result.code in (1, 2)
    assert "unexpected error" not in line and str(taken_port) in line, line


def test_a_worker_that_fails_to_start_is_not_left_live(
    cyclone: Cli, client: Client, taken_port: int
) -> None:
    result = cyclone(
        *("worker", "tests.cli.flows", "--processes", "1", "--no-scanners"),
        *("--metrics-port", str(taken_port), "--metrics-host", "127.0.0.1"),
    )
    assert result.code != 0
    assert json.loads(cyclone("workers", "--json").out) == []
    assert "no live workers" in cyclone("workers").out


def test_a_dsn_with_a_bad_port_is_bad_input() -> None:
    result = invoke(["--dsn", "host=localhost port=abc dbname=app connect_timeout=2", "runs"])
    line = result.one_error_line()
    assert result.code == 2, line
    assert "port" in line and "host name" not in line, line


def test_a_bad_batch_size_is_refused_with_dry_run_too(cyclone: Cli, client: Client) -> None:
    client.submit(flows.waiting, 1)
    for args in [
        ("cancel-many", "--all", "--dry-run", "--batch-size", "-5"),
        ("purge", "--dry-run", "--batch-size", "0"),
    ]:
        result = cyclone(*args)
        assert result.code == 2, (args, result)
        assert "invalid value for '--batch-size'" in result.one_error_line()


def test_control_characters_in_names_keep_one_line_per_row(cyclone: Cli, client: Client) -> None:
    run_id = client.submit(cla_control, 1).id
    added = cyclone(
        *("schedules", "add", "tests.cli.flows:flow", "0 3 * * *"),
        *("--id", "cla_two\nlines", "--location", "UTC"),
    )
    assert added.code == 0, added.err
    for args, rows in [(("runs",), 2), (("schedules",), 2), (("run", str(run_id)), 2)]:
        out = cyclone(*args).out
        assert len(out.splitlines()) == rows, (args, out)
        assert not any(ord(c) < 32 and c != "\n" for c in out), (args, out)
