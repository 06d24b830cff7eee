"""Audit: odd CLI input is one ``cyclone:`` line, the documented exit code, nothing
written, and ``--json`` output parses."""

from __future__ import annotations

import json
import subprocess

import pytest

from cyclone_dsl import Client, RunState, StepState
from tests.cli import flows
from tests.cli.runner import Cli, in_process

HUGE = str(10**20)
NUL = "a\x00b"
SURR = "a\udc80b"


@pytest.fixture
def cyclone(cyclone_dsn: str) -> Cli:
    return in_process(cyclone_dsn)


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = [ln for ln in result.stderr.strip().splitlines() if " WARNING cyclone." not in ln]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("cyclone: "), result.stderr
    assert result.stdout == "", result.stdout
    return lines[0]


def refused(result: subprocess.CompletedProcess[str], code: int = 2, text: str = "") -> str:
    line = error_line(result)
    assert "unexpected error" not in line, line
    assert "the database refused the call" not in line, line
    assert result.returncode == code, (result.returncode, line)
    assert text in line, line
    return line


def unrefused(cyclone: Cli, commands: list[tuple[str, ...]]) -> list[tuple[object, ...]]:
    """The commands that were not refused as bad input (exit 2), each with what it did."""
    problems: list[tuple[object, ...]] = []
    for args in commands:
        result = cyclone(*args)
        try:
            refused(result, 2)
        except AssertionError:
            problems.append((args[:3], result.returncode, result.stderr.strip()[:200]))
    return problems


# -- run ids -------------------------------------------------------------------------------

RUN_ID_COMMANDS = [
    ("run",),
    ("run", "--json"),
    ("cancel",),
    ("pause",),
    ("resume",),
    ("retry", "cli_add"),
    ("signal", "go"),
    ("fork", "cli_add"),
]


@pytest.mark.parametrize("cmd", RUN_ID_COMMANDS, ids=lambda c: "-".join(c))
@pytest.mark.parametrize("run_id", ["0", "9223372036854775807", "-9223372036854775808"])
def test_odd_run_ids_are_unknown_runs(cyclone: Cli, cmd: tuple[str, ...], run_id: str) -> None:
    verb, *rest = cmd
    opts = [a for a in rest if a.startswith("--")]
    rest = [a for a in rest if not a.startswith("--")]
    args = [verb, *opts, "--", run_id, *rest]
    result = cyclone(*args)
    refused(result, 2, "does not exist")


@pytest.mark.parametrize("cmd", RUN_ID_COMMANDS, ids=lambda c: "-".join(c))
@pytest.mark.parametrize("run_id", ["abc", "1.5", "1e3", "", " 1"])
def test_non_integer_run_ids_are_usage_errors(
    cyclone: Cli, cmd: tuple[str, ...], run_id: str
) -> None:
    verb, *rest = cmd
    result = cyclone(verb, run_id, *rest)
    refused(result, 2)


def test_run_follow_of_unknown_or_huge_after(cyclone: Cli, client: Client) -> None:
    refused(cyclone("run", "0", "--follow"), 2, "does not exist")
    run_id = client.submit(flows.waiting, 1).id
    client.cancel(run_id)
    for after in ("-1", HUGE, "abc"):
        result = cyclone("run", str(run_id), "--follow", "--after", after, "--json")
        if after == "abc":
            refused(result, 2)
            continue
        assert "Traceback" not in result.stderr
        assert result.returncode in (1, 2), (after, result)
        if result.returncode == 1:
            lines = result.stdout.strip().splitlines()
            assert json.loads(lines[-1]) == {"run_id": run_id, "state": "cancelled"}, after
        else:
            error_line(result)


def test_run_follow_json_of_completed_and_cancelled(
    cyclone: Cli, client: Client, start_worker
) -> None:
    start_worker(flows)
    done = client.submit(flows.flow, 1)
    assert done.result(timeout=60) == 2
    result = cyclone("run", str(done.id), "--follow", "--json")
    assert result.returncode == 0, result
    for line in result.stdout.strip().splitlines():
        json.loads(line)
    cancelled = client.submit(flows.waiting, 1).id
    client.cancel(cancelled)
    result = cyclone("run", str(cancelled), "--follow", "--json")
    assert result.returncode == 1, result
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "run_id": cancelled,
        "state": "cancelled",
    }


# -- names with NUL bytes and lone surrogates -----------------------------------------------


@pytest.mark.parametrize("bad", [NUL, SURR], ids=["nul", "surrogate"])
def test_bad_names_on_a_live_run(cyclone: Cli, client: Client, bad: str) -> None:
    run_id = str(client.submit(flows.waiting, 1).id)
    problems = []
    for args in [
        ("signal", run_id, bad, "1"),
        ("signal", run_id, "go", json.dumps(bad) if bad == NUL else '"\\udc80"'),
        ("retry", run_id, bad),
        ("retry", run_id, bad, "--force"),
        ("fork", run_id, bad),
    ]:
        result = cyclone(*args)
        try:
            refused(result, 2)
        except AssertionError as exc:
            problems.append((args, result.returncode, result.stderr.strip()[:300], str(exc)[:200]))
    assert client.get_run(int(run_id)).step("go").state is StepState.WAITING_SIGNAL
    assert client.signals_of(int(run_id)) == []
    assert [r.id for r in client.list_runs()] == [int(run_id)]
    assert problems == []


@pytest.mark.parametrize("bad", [NUL, SURR], ids=["nul", "surrogate"])
def test_bad_names_in_filters_and_reads(cyclone: Cli, client: Client, bad: str) -> None:
    problems = []
    for args in [
        ("runs", "--workflow", bad),
        ("runs", "--state", bad),
        ("cancel-many", "--workflow", bad, "--dry-run"),
        ("cancel-many", "--queue", bad, "--dry-run"),
        ("cancel-many", "--state", bad, "--dry-run"),
        ("retry-many", "--error-kind", bad, "--dry-run"),
        ("schedules", "rm", bad),
        ("schedules", "enable", bad),
        ("queue-limit", bad, "3"),
        ("submit", "tests.cli.flows:flow", "--once", bad),
        ("submit", bad),
        ("submit", f"tests.cli.flows:{bad}"),
        ("schedules", "add", "tests.cli.flows:flow", "0 3 * * *", "--id", bad),
        ("schedules", "add", "tests.cli.flows:flow", "0 3 * * *", "--queue", bad),
        ("schedules", "add", "tests.cli.flows:flow", "0 3 * * *", "--location", bad),
        ("schedules", "add", "tests.cli.flows:flow", bad),
    ]:
        result = cyclone(*args)
        try:
            # an empty listing with exit 0 is fine for the reads
            if result.returncode == 0 and args[0] == "runs":
                continue
            if result.returncode == 0 and args[0] == "cancel-many":
                continue
            refused(result, 2)
        except AssertionError as exc:
            problems.append((args, result.returncode, result.stderr.strip()[:300], str(exc)[:200]))
    assert client.list_runs() == []
    assert client.list_schedules() == []
    assert problems == []


# -- numbers -------------------------------------------------------------------------------


@pytest.mark.parametrize("limit", ["0", "-1", HUGE, "1.5", "abc", "9223372036854775807"])
def test_runs_limit(cyclone: Cli, limit: str) -> None:
    result = cyclone("runs", "--limit", limit, "--json")
    if result.returncode == 0:
        assert json.loads(result.stdout) == []
    else:
        refused(result, 2)


@pytest.mark.parametrize("limit", ["0", "-5", HUGE, "1.5", "", "nonE"])
def test_queue_limit_odd_values(cyclone: Cli, client: Client, limit: str) -> None:
    result = cyclone("queue-limit", "cle_q", limit, "--json")
    if limit == "nonE":
        assert result.returncode == 0, result
        assert json.loads(result.stdout) == {"queue": "cle_q", "limit": None}
        return
    refused(result, 2)
    stats = client.stats()
    assert not [row for row in stats.get("queues", []) if row["queue"] == "cle_q"]


def test_queue_limit_round_trip_json(cyclone: Cli) -> None:
    result = cyclone("queue-limit", "cle_q2", "3", "--json")
    assert result.returncode == 0, result
    assert json.loads(result.stdout) == {"queue": "cle_q2", "limit": 3}
    result = cyclone("queue-limit", "cle_q2", "none")
    assert result.returncode == 0, result
    assert "no cap" in result.stdout


@pytest.mark.parametrize("interval", ["0", "-1", "nan", "inf", "abc"])
def test_scan_bad_interval(cyclone: Cli, interval: str) -> None:
    result = cyclone("scan", "--once", "--interval", interval)
    refused(result, 2)


@pytest.mark.parametrize("retention", ["0s", "-1s", "5x", "999999999y", "99999999999999999d"])
def test_scan_bad_retention(cyclone: Cli, retention: str) -> None:
    refused(cyclone("scan", "--once", "--retention", retention), 2)


def test_scan_once_huge_retention(cyclone: Cli) -> None:
    result = cyclone("scan", "--once", "--retention", "999999999d")
    assert "Traceback" not in result.stderr
    if result.returncode != 0:
        refused(result, 2)


# -- durations -----------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["5x", "-1s", "999999999y", "1e3s", "nan", "inf", " ", "1.5.5s"])
def test_submit_wait_bad_timeout_submits_nothing(cyclone: Cli, client: Client, text: str) -> None:
    result = cyclone("submit", "tests.cli.flows:flow", "--wait", "--timeout", text)
    assert "Traceback" not in result.stderr
    if text == "999999999d":
        # a valid (huge) duration: refused up front or accepted; must not crash either way
        if result.returncode == 2:
            error_line(result)
            assert client.list_runs() == []
        return
    refused(result, 2)
    assert client.list_runs() == []


@pytest.mark.parametrize("text", ["0s", "0.0001s", "1ms"])
def test_submit_wait_tiny_timeout_is_exit_1(cyclone: Cli, text: str) -> None:
    result = cyclone("submit", "tests.cli.flows:waiting", "--wait", "--timeout", text)
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("cyclone: run 1 did not finish")


@pytest.mark.parametrize(
    ("option", "text"),
    [
        ("--timeout", "999999999d"),
        ("--retention", "999999999d"),
        ("--timeout", "-1s"),
        ("--retention", "0s"),
        ("--timeout", "1ms"),
    ],
)
def test_schedule_add_durations(cyclone: Cli, client: Client, option: str, text: str) -> None:
    result = cyclone("schedules", "add", "tests.cli.flows:flow", "0 3 * * *", option, text)
    assert "Traceback" not in result.stderr
    if result.returncode == 0:
        assert len(client.list_schedules()) == 1
        return
    refused(result, 2)
    assert client.list_schedules() == []


@pytest.mark.parametrize(
    ("cron", "location"),
    [
        ("61 * * * *", None),
        ("* * * * * * *", None),
        ("", None),
        ("0 3 31 2 *", None),
        ("0 3 * * *", ""),
        ("0 3 * * *", "../../etc/passwd"),
        ("0 3 * * *", "UTC "),
        ("0 3 * * *", "utc"),
        ("@hourly", None),
        ("@reboot", None),
        ("0 3 * * *", "+05:00"),
    ],
)
def test_schedule_add_odd_crons_and_zones(
    cyclone: Cli, client: Client, cron: str, location: str | None
) -> None:
    extra = () if location is None else ("--location", location)
    result = cyclone("schedules", "add", "tests.cli.flows:flow", cron, *extra, "--json")
    assert "Traceback" not in result.stderr, result.stderr
    if result.returncode == 0:
        data = json.loads(result.stdout)
        assert len(client.list_schedules()) == 1, data
        return
    refused(result, 2)
    assert client.list_schedules() == []


@pytest.mark.parametrize(
    ("option", "value"),
    [("--priority", "-2147483649"), ("--max-attempts", "-1"), ("--max-attempts", HUGE)],
)
def test_schedule_add_odd_numbers(cyclone: Cli, client: Client, option: str, value: str) -> None:
    result = cyclone("schedules", "add", "tests.cli.flows:flow", "0 3 * * *", option, value)
    refused(result, 2)
    assert client.list_schedules() == []


def test_schedules_json_listing_parses(cyclone: Cli, client: Client) -> None:
    added = cyclone("schedules", "add", "tests.cli.flows:flow", "0 3 * * *", "--json")
    assert added.returncode == 0, added
    json.loads(added.stdout)
    listing = cyclone("schedules", "--json")
    assert listing.returncode == 0, listing
    assert len(json.loads(listing.stdout)) == 1
    for verb in ("disable", "enable"):
        result = cyclone("schedules", verb, "cli_flow", "--json")
        assert result.returncode == 0, result
        assert json.loads(result.stdout)["enabled"] is (verb == "enable")
    rm = cyclone("schedules", "rm", "cli_flow", "--json")
    assert json.loads(rm.stdout) == {"id": "cli_flow", "deleted": True}
    again = cyclone("schedules", "rm", "cli_flow")
    refused(again, 2, "no schedule")


# -- runs in each state -------------------------------------------------------------------


def test_steering_a_running_run(cyclone: Cli, client: Client) -> None:
    run_id = client.submit(flows.waiting, 1).id
    rid = str(run_id)
    resumed = cyclone("resume", rid, "--json")
    assert "Traceback" not in resumed.stderr
    if resumed.returncode != 0:
        refused(resumed, 2)
    retried = cyclone("retry", rid, "go")  # a waiting node: not discarded
    refused(retried, 2)
    unknown_node = cyclone("retry", rid, "nope")
    refused(unknown_node, 2)
    paused = cyclone("pause", rid, "--json")
    assert paused.returncode == 0, paused
    assert json.loads(paused.stdout)["state"] == "paused"
    again = cyclone("pause", rid, "--json")
    assert "Traceback" not in again.stderr
    if again.returncode != 0:
        refused(again, 2)
    assert client.get_run(run_id).state is RunState.PAUSED
    signal = cyclone("signal", rid, "go", "5", "--json")
    assert "Traceback" not in signal.stderr
    assert signal.returncode == 0, signal
    json.loads(signal.stdout)
    cancel = cyclone("cancel", rid, "--json")
    assert json.loads(cancel.stdout)["state"] == "cancelled"
    fork = cyclone("fork", rid, "nope")
    refused(fork, 2)


def test_signal_unknown_name_to_a_waiting_run(cyclone: Cli, client: Client) -> None:
    run_id = client.submit(flows.waiting, 1).id
    result = cyclone("signal", str(run_id), "nobody_waits", "--json")
    refused(result, 2, "nobody_waits")
    assert client.signals_of(run_id) == []


def test_signal_empty_name(cyclone: Cli, client: Client) -> None:
    run_id = client.submit(flows.waiting, 1).id
    result = cyclone("signal", str(run_id), "")
    refused(result, 2)
    assert client.signals_of(run_id) == []


def test_retry_of_a_completed_run_without_force(cyclone: Cli, client: Client, start_worker) -> None:
    start_worker(flows)
    handle = client.submit(flows.flow, 1)
    assert handle.result(timeout=60) == 2
    result = cyclone("retry", str(handle.id), "cli_add")
    refused(result, 2)
    cancel = cyclone("cancel", str(handle.id))
    refused(cancel, 2)
    assert client.get_run(handle.id).state is RunState.COMPLETED


def test_submit_once_empty_key_and_json(cyclone: Cli, client: Client) -> None:
    result = cyclone("submit", "tests.cli.flows:waiting", "--once", "", "--json")
    assert "Traceback" not in result.stderr
    if result.returncode == 0:
        json.loads(result.stdout)
    else:
        refused(result, 2)
        assert client.list_runs() == []


@pytest.mark.parametrize(
    "spec",
    [
        "tests.cli.flows:",
        ":flow",
        "tests.cli.flows:add",
        "nosuch_workflow",
        "tests.cli.flows:flow:x",
    ],
)
def test_submit_odd_workflow_specs(cyclone: Cli, client: Client, spec: str) -> None:
    refused(cyclone("submit", spec), 2)
    assert client.list_runs() == []


@pytest.mark.parametrize(
    "payload", ['"\\ud800"', '{"\\u0000": 1}', "[" * 100000 + "]" * 100000, "1" * 5000]
)
def test_submit_odd_json_inputs(cyclone: Cli, client: Client, payload: str) -> None:
    result = cyclone("submit", "tests.cli.flows:waiting", "--input", payload)
    refused(result, 2)
    assert client.list_runs() == []


@pytest.mark.parametrize(
    "args",
    [
        ("--since", "2026-13-01T00:00:00Z"),
        ("--since", "2026-01-01"),
        ("--state", "sleeping"),
        ("--error-kind", "nonsense"),
        ("--until", "9999-12-31T23:59:59-23:59"),
        ("--since", "0001-01-01T00:00:00+14:00"),
    ],
)
def test_bulk_odd_filters(cyclone: Cli, client: Client, args: tuple[str, ...]) -> None:
    run_id = client.submit(flows.waiting, 1).id
    for verb in ("cancel-many", "retry-many", "resume-many"):
        result = cyclone(verb, *args, "--dry-run", "--json")
        assert "Traceback" not in result.stderr, (verb, result.stderr)
        if result.returncode == 0:
            json.loads(result.stdout)
        else:
            refused(result, 2)
    assert client.get_run(run_id).state is RunState.RUNNING


def test_cancel_many_when_all_are_skipped_exits_1_json(cyclone: Cli, client: Client) -> None:
    run_id = client.submit(flows.waiting, 1).id
    result = cyclone("resume-many", "--all", "--yes", "--json")
    assert "Traceback" not in result.stderr
    data = json.loads(result.stdout) if result.stdout else None
    assert result.returncode in (0, 1), result
    assert client.get_run(run_id).state is RunState.RUNNING
    assert data is not None


@pytest.mark.parametrize(
    "args",
    [
        ("migrate", "--target", "-1"),
        ("migrate", "--target", HUGE),
        ("migrate", "--extension-target", "1.5"),
        ("purge", "--older-than", "5x"),
        ("purge", "--older-than", "-1s"),
        ("purge", "--older-than", "999999999d", "--dry-run"),
        ("purge", "--older-than", "999999999w", "--dry-run"),
        ("purge", "--batch-size", HUGE, "--dry-run"),
        ("cancel", "1", "extra"),
        ("runs", "extra"),
        ("stats", "extra"),
        ("schedules", "bogus"),
        ("workers", "--all", "extra"),
        ("scan", "--once", "-m", ""),
        ("submit",),
        ("signal", "1"),
        ("retry", "1"),
        ("fork", "1"),
        ("queue-limit", "q"),
        ("bogus",),
    ],
    ids=lambda a: " ".join(a),
)
def test_misc_usage_errors(cyclone: Cli, args: tuple[str, ...]) -> None:
    refused(cyclone(*args), 2)


def test_json_outputs_parse(cyclone: Cli, client: Client) -> None:
    client.submit(flows.waiting, 1)
    for args in [
        ("runs", "--json"),
        ("stats", "--json"),
        ("workers", "--json"),
        ("workers", "--all", "--json"),
        ("schedules", "--json"),
        ("migrate", "--status", "--json"),
        ("migrate", "--json"),
        ("purge", "--dry-run", "--json"),
        ("cancel-many", "--all", "--dry-run", "--json"),
        ("submit", "tests.cli.flows:waiting", "--json"),
    ]:
        result = cyclone(*args)
        assert result.returncode == 0, (args, result)
        json.loads(result.stdout)


@pytest.mark.parametrize("retention", ["999999999d", "100000000d", "365001d"])
def test_scan_retention_past_1000_years_is_refused_like_the_worker(
    cyclone: Cli, retention: str
) -> None:
    """`worker --retention 365001d` is refused (at most 1000 years); `scan` should be too."""
    refused(cyclone("scan", "--once", "--retention", retention), 2)


DEEP = "[" * 5000 + "]" * 5000
LONG_INT = "1" * 5000


@pytest.mark.parametrize(
    "payload", [DEEP, LONG_INT, "[" * 990 + "]" * 990], ids=["deep", "long-int", "990-deep"]
)
def test_json_payloads_too_deep_or_long_are_bad_input_everywhere(
    cyclone: Cli, client: Client, tmp_path, payload: str
) -> None:
    waiting = client.submit(flows.waiting, 1).id
    file = tmp_path / "in.json"
    file.write_text(payload)
    problems = unrefused(
        cyclone,
        [
            ("submit", "tests.cli.flows:flow", "--input", payload),
            ("submit", "tests.cli.flows:flow", "--input", f"@{file}"),
            ("signal", str(waiting), "go", payload),
            ("schedules", "add", "tests.cli.flows:flow", "0 3 * * *", "--input", payload),
            ("fork", str(waiting), "cli_add", "--input", payload),
        ],
    )
    assert [r.id for r in client.list_runs()] == [waiting]
    assert client.signals_of(waiting) == []
    assert client.list_schedules() == []
    assert problems == []


def test_raw_lone_surrogate_in_json_input(cyclone: Cli, client: Client) -> None:
    waiting = client.submit(flows.waiting, 1).id
    problems = unrefused(
        cyclone,
        [
            ("submit", "tests.cli.flows:flow", "--input", '"' + SURR + '"'),
            ("signal", str(waiting), "go", '{"k": "' + SURR + '"}'),
            ("schedules", "add", "tests.cli.flows:flow", "0 3 * * *", "--input", '"' + SURR + '"'),
        ],
    )
    assert [r.id for r in client.list_runs()] == [waiting]
    assert problems == []


def test_pooled_migrate_without_listen_url_is_exit_2(cyclone_dsn: str) -> None:
    from tests.cli.runner import in_process as ip

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        from click.testing import CliRunner

        from cyclone_dsl.cli.main import run as cli_main

        with CliRunner().isolation() as (out, err, _):
            try:
                code = cli_main(["--pooled", "--dsn", cyclone_dsn, *args])
            except SystemExit as exc:
                code = exc.code
            return subprocess.CompletedProcess(
                args, code, out.getvalue().decode(), err.getvalue().decode()
            )

    for args in (("migrate",), ("migrate", "--status", "--json")):
        refused(run(*args), 2, "--listen-url")
    del ip


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_ui_port_out_of_range_is_usage_error(cyclone_dsn: str, port: str) -> None:
    import os
    import sys

    from tests.cli.runner import ROOT

    proc = subprocess.Popen(
        [sys.executable, "-m", "cyclone_dsl.cli", "--dsn", cyclone_dsn, "ui", "--port", port],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"ui --port {port} kept running 30 s; stdout {out!r} stderr {err[-600:]!r}")
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert result.returncode == 2, (result.returncode, out, err[-600:])
    refused(result, 2)


def test_queue_limit_in_process_json_for_nul_queue(cyclone: Cli) -> None:
    refused(cyclone("queue-limit", NUL, "none", "--json"), 2)
