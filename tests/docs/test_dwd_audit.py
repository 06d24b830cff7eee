"""Audit of the operator docs as an operator reads them (part D): docs/howto/deploy.md,
docs/howto/scale.md and docs/reference/cli.md.

Each test runs one claim for real against PostgreSQL: a ``cyclone`` command (in this
process through ``cyclone_dsl.cli.main.run`` where it can, a subprocess where a real
process matters: a worker, a scanner that loops), its exit code, its output, the
environment variables it reads, its defaults and its refusals of bad input. PgBouncer
(not installed here), read replicas (tests/replica) and multi-process workers (another
audit) are left out.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cyclone_dsl import (
    Client,
    Concurrency,
    DatabaseUnavailable,
    InvalidArgument,
    InvalidTransition,
    StepContext,
    Worker,
    migrate,
    step,
    wait_signal,
    workflow,
)
from cyclone_dsl.cli.main import run
from cyclone_dsl.errors import MigrationPermissionDenied, SchemaVersionMismatch
from cyclone_dsl.migrate import LATEST_EXTENSION_VERSION, LATEST_SCHEMA_VERSION
from cyclone_dsl.testing.schemas import create_schema, drop_schema, with_search_path
from tests.cli import flows
from tests.roles import limited_role
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
UNREACHABLE = "postgresql://dwd:s3cretpw@127.0.0.1:1/app"
Outcome = tuple[int, str, str]
Cli = Callable[..., Outcome]
StartWorker = Callable[..., Worker]

# -- handlers -------------------------------------------------------------------------------

release = threading.Event()


@step(name="dwd_add")
def dwd_add(x: int) -> int:
    return x + 1


@workflow(name="dwd_flow")
def dwd_flow(x):  # type: ignore[no-untyped-def]
    return dwd_add(x)


@step(name="dwd_boom", max_attempts=1)
def dwd_boom(x: int) -> int:
    raise RuntimeError(f"dwd boom {x}")


@workflow(name="dwd_failing")
def dwd_failing(x):  # type: ignore[no-untyped-def]
    return dwd_boom(x)


@workflow(name="dwd_waiting")
def dwd_waiting(x):  # type: ignore[no-untyped-def]
    return dwd_add(wait_signal("go"))


@step(name="dwd_tx_settings", transactional=True)
def dwd_tx_settings(x: int, *, ctx: StepContext) -> dict[str, str]:
    cur = ctx.connection.execute(
        "SELECT current_setting('idle_in_transaction_session_timeout'), current_setting('jit')"
    )
    row = cur.fetchone()
    assert row is not None
    return {"idle": str(row[0]), "jit": str(row[1])}


@workflow(name="dwd_tx_flow")
def dwd_tx_flow(x):  # type: ignore[no-untyped-def]
    return dwd_tx_settings(x)


#: Names a terminal would act on: an escape and a line break (no '[': node ids refuse it).
HOSTILE_STEP = "dwd_kind\x1bX\nfake row"
HOSTILE_WORKFLOW = "dwd_wf\x1bY\nfake row"


@step(name=HOSTILE_STEP, concurrency=Concurrency(key="tenant", limit=1))
def dwd_hostile(job: dict[str, str]) -> str:
    release.wait(30)
    return job["tenant"]


@workflow(name=HOSTILE_WORKFLOW)
def dwd_hostile_flow(job):  # type: ignore[no-untyped-def]
    return dwd_hostile(job)


# -- running the command line ---------------------------------------------------------------


def invoke(capsys: pytest.CaptureFixture[str], *args: str) -> Outcome:
    """``cyclone ARGS`` in this process: (exit code, stdout, stderr)."""
    try:
        code = run(list(args))
    except SystemExit as exc:  # fail() exits; main() would turn run()'s code into one too
        code = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def cli(cyclone_dsn: str, capsys: pytest.CaptureFixture[str]) -> Cli:
    def call(*args: str) -> Outcome:
        return invoke(capsys, "--dsn", cyclone_dsn, *args)

    return call


def one_line(outcome: Outcome, code: int) -> str:
    """The one ``cyclone: ...`` line of a refused command, with its exit code."""
    got, out, err = outcome
    assert got == code, outcome
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("cyclone: "), err
    assert "Traceback" not in err
    assert out == "", out
    return lines[0]


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CYCLONE_")}
    env.update(PYTHONPATH=str(ROOT), **extra)
    return env


def spawn(dsn: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "cyclone_dsl.cli", "--dsn", dsn, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )


def stop(proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> tuple[int, str, str]:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err


@pytest.fixture
def unmigrated(cyclone_admin_dsn: str) -> Iterator[str]:
    """A DSN on a new, empty schema."""
    name = create_schema(cyclone_admin_dsn, migrated=False)
    yield with_search_path(cyclone_admin_dsn, name)
    drop_schema(cyclone_admin_dsn, name)


def schema_of(dsn: str) -> str:
    match = re.search(r"search_path=(\w+)", dsn)
    assert match is not None
    return match.group(1)


# -- cli.md: every command and flag of the table ---------------------------------------------


def documented_commands() -> dict[tuple[str, ...], set[str]]:
    """Each command of cli.md's table, with the flags its synopsis lists."""
    text = (DOCS / "reference" / "cli.md").read_text(encoding="utf-8")
    filters = set(re.findall(r"`(--[a-z-]+)", text.split("The filter options of")[1]))
    found: dict[tuple[str, ...], set[str]] = {}
    for line in text.splitlines():
        if not line.startswith("| `cyclone "):
            continue
        synopses = re.findall(r"`(cyclone [^`]*)`", line.split(" | ")[0])
        for synopsis in synopses:
            words = tuple(w for w in synopsis.split()[1:] if re.fullmatch(r"[a-z][a-z-]*", w))
            flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*|-m)\b", synopsis))
            if "FILTER..." in synopsis:
                flags |= filters
            found[words] = flags
    return found


COMMANDS = documented_commands()


def test_dwd_the_table_lists_every_command() -> None:
    assert {words[0] for words in COMMANDS} >= {
        "migrate", "worker", "workers", "submit", "runs", "run", "signal", "cancel",
        "pause", "resume", "retry", "cancel-many", "retry-many", "resume-many", "fork",
        "schedules", "stats", "queue-limit", "purge", "scan", "demo", "ui",
    }  # fmt: skip
    assert COMMANDS[("cancel-many",)] >= {"--workflow", "--ended-until", "--all", "--yes"}
    assert COMMANDS[("worker",)] >= {"--max-async", "--metrics-host", "--log-format"}


@pytest.mark.parametrize("words", sorted(COMMANDS), ids=" ".join)
def test_dwd_every_command_has_help_listing_its_documented_flags(
    words: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = invoke(capsys, *words, "--help")
    assert code == 0, err
    assert out.startswith(f"Usage: cyclone {' '.join(words)}"), out
    missing = {flag for flag in COMMANDS[words] if not re.search(rf"{flag}\b", out)}
    assert not missing, f"documented but not in --help: {sorted(missing)}"


def test_dwd_global_options_and_their_environment(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = invoke(capsys, "--help")
    assert code == 0
    for option in ("--dsn", "--pooled", "--listen-url", "-v"):
        assert option in out


# -- cli.md: where the database comes from ----------------------------------------------------


def test_dwd_dsn_comes_from_cyclone_database_url(
    cyclone_dsn: str,
    client: Client,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    handle = client.submit(dwd_flow, 1)
    monkeypatch.setenv("CYCLONE_DATABASE_URL", cyclone_dsn)
    code, out, err = invoke(capsys, "runs", "--json")
    assert code == 0, err
    assert [r["id"] for r in json.loads(out)] == [handle.id]
    # --dsn wins over the environment
    monkeypatch.setenv("CYCLONE_DATABASE_URL", UNREACHABLE)
    code, out, err = invoke(capsys, "--dsn", cyclone_dsn, "runs", "--json")
    assert code == 0, err
    line = one_line(invoke(capsys, "runs"), 1)
    assert "cannot connect to 127.0.0.1:1" in line
    assert "s3cretpw" not in line


@pytest.mark.parametrize(
    ("dsn", "code", "expected"),
    [
        (
            "mysql://u@h/db",
            2,
            "cyclone: the DSN cannot be parsed: its URL scheme is 'mysql': a PostgreSQL URL "
            "starts with postgresql:// or postgres://",
        ),
        (
            "postgresql://u:sec ret@h/db",
            2,
            'cyclone: the DSN cannot be parsed: unexpected spaces found in "****", use '
            "percent-encoded spaces (%20) instead",
        ),
        (
            "postgresql://u:s3cretpw@127.0.0.1:1/app",
            1,
            "cyclone: cannot connect to 127.0.0.1:1 (database 'app'): Connection refused: is "
            "PostgreSQL running there, and is the port right?",
        ),
        ("postgresql://u:s3cretpw@127.0.0.1:abc/app", 2, "port"),
        ("host=127.0.0.1 port=1 dbname=app password=s3cretpw", 1, "Connection refused"),
    ],
    ids=["scheme", "spaces", "refused", "port", "key-value"],
)
def test_dwd_dsn_errors_are_one_line_with_the_documented_exit_code(
    dsn: str, code: int, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = one_line(invoke(capsys, "--dsn", dsn, "runs"), code)
    assert expected == line if expected.startswith("cyclone:") else expected in line
    assert "s3cretpw" not in line and "sec ret" not in line


def test_dwd_every_command_but_migrate_refuses_an_unmigrated_database(
    unmigrated: str, capsys: pytest.CaptureFixture[str]
) -> None:
    wanted = (
        f"cyclone: the database is at schema version 0 (extension 0); this build needs "
        f"{LATEST_SCHEMA_VERSION} (extension {LATEST_EXTENSION_VERSION}): run `cyclone "
        "migrate` (or cyclone_dsl.migrate(dsn))"
    )
    commands = [
        ["runs"], ["run", "1"], ["run", "1", "--follow"], ["workers"], ["stats"],
        ["schedules"], ["submit", "tests.cli.flows:flow"], ["signal", "1", "go"],
        ["cancel", "1"], ["pause", "1"], ["resume", "1"], ["retry", "1", "x"],
        ["cancel-many", "--all", "--dry-run"], ["retry-many", "--all", "--dry-run"],
        ["resume-many", "--all", "--dry-run"], ["fork", "1", "x"],
        ["queue-limit", "q", "3"], ["purge", "--dry-run"], ["scan", "--once"],
        ["schedules", "add", "tests.cli.flows:flow", "* * * * *"],
        ["schedules", "enable", "x"], ["schedules", "rm", "x"],
    ]  # fmt: skip
    for command in commands:
        assert one_line(invoke(capsys, "--dsn", unmigrated, *command), 2) == wanted, command
    code, out, _ = invoke(capsys, "--dsn", unmigrated, "migrate", "--status", "--json")
    assert code == 0
    assert json.loads(out)["version"] == 0


# -- cli.md: usage errors -------------------------------------------------------------------

USAGE_ERRORS: list[tuple[list[str], str]] = [
    (["runs", "--bogus"], "cyclone: no such option '--bogus' (see 'cyclone runs --help')"),
    (
        ["run", "abc"],
        "cyclone: invalid value for 'RUN_ID': 'abc' is not a valid integer "
        "(see 'cyclone run --help')",
    ),
    (["bogus-command"], "no such command"),
    (["worker"], "missing argument"),
    (["runs", "--limit", "-1"], "limit"),
    (["runs", "--state", "bogus"], "running, paused, completed, failed, cancelled"),
    (["migrate", "--target", str(LATEST_SCHEMA_VERSION + 1)], "--target"),
    (["migrate", "--target", "-1"], "--target"),
    (["migrate", "--status", "--target", "3"], "--status"),
    (["migrate", "--extension-target", str(LATEST_EXTENSION_VERSION + 1)], "--extension-target"),
    (["worker", "tests.cli.flows", "--concurrency", "0"], "--concurrency"),
    (["worker", "tests.cli.flows", "--max-concurrency", "0"], "--max-concurrency"),
    (["worker", "tests.cli.flows", "--max-async", "0"], "--max-async"),
    (["worker", "tests.cli.flows", "--processes", "0"], "--processes"),
    (["worker", "tests.cli.flows", "--lease", "0"], "--lease"),
    (["worker", "tests.cli.flows", "--grace", "soon"], "--grace"),
    (["worker", "tests.cli.flows", "--poll-interval", "x"], "--poll-interval"),
    (["worker", "tests.cli.flows", "--retention", "0s"], "retention"),
    (["worker", "tests.cli.flows", "--retention", "forever"], "none"),
    (["worker", "tests.cli.flows", "--catch-up", "some"], "--catch-up"),
    (["worker", "tests.cli.flows", "--log-format", "xml"], "--log-format"),
    (["worker", "tests.cli.flows", "--metrics-port", "70000"], "--metrics-port"),
    (["submit", "tests.cli.flows:flow", "--timeout", "soon"], "30s, 15m, 12h, 7d or 2w"),
    (["submit", "tests.cli.flows:add"], "is not a @workflow"),
    (["submit", "dwd_no_such_workflow"], "dwd_no_such_workflow"),
    (["submit", "tests.cli.flows:flow", "-m", "dwd.no.such"], "cannot import"),
    (["submit", "tests.cli.flows:flow", "--input", "{oops"], "not valid JSON"),
    (["submit", "tests.cli.flows:flow", "--input", "@/nonexistent/dwd.json"], "cannot read"),
    (["signal", "1", "go", "{bad"], "PAYLOAD is not valid JSON"),
    (["purge", "--older-than", "7 days"], "not a duration"),
    (["purge", "--batch-size", "0", "--dry-run"], "--batch-size"),
    (["purge", "--state", "running", "--dry-run"], "--state"),
    (["cancel-many", "--dry-run"], "--all"),
    (["cancel-many", "--all", "--dry-run", "--batch-size", "0"], "--batch-size"),
    (["retry-many", "--since", "2026-05-01T12:00:00", "--dry-run"], "offset"),
    (["resume-many", "--until", "yesterday", "--dry-run"], "ISO 8601"),
    (["queue-limit", "q", "many"], "LIMIT"),
    (["queue-limit", "q", "0"], "limit"),
    (["schedules", "add", "tests.cli.flows:flow", "not a cron"], "cron"),
    (["schedules", "add", "tests.cli.flows:flow", "* * * * *", "--location", "Mars/X"], "zone"),
    (["schedules", "add", "tests.cli.flows:flow", "* * * * *", "--timeout", "x"], "duration"),
    (["scan", "--retention", "0s", "--once"], "retention"),
    (["run", "1", "--follow", "--after", "-1"], "after"),
]


@pytest.mark.parametrize(
    ("args", "expected"), USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS]
)
def test_dwd_bad_usage_is_one_line_and_exit_2(args: list[str], expected: str, cli: Cli) -> None:
    line = one_line(cli(*args), 2)
    assert expected == line if expected.startswith("cyclone:") else expected in line


def test_dwd_verbose_usage_error_prints_clicks_usage(cli: Cli) -> None:
    code, _, err = cli("-v", "run", "abc")
    assert code == 2
    assert err.startswith("Usage: cyclone run [OPTIONS] RUN_ID"), err
    assert "Traceback" not in err


def test_dwd_submit_timeout_is_checked_before_anything_is_submitted(
    cli: Cli, client: Client
) -> None:
    one_line(cli("submit", "tests.cli.flows:flow", "--input", "1", "--timeout", "10 min"), 2)
    assert client.list_runs() == []


# -- cli.md: migrate ------------------------------------------------------------------------


def test_dwd_migrate_is_a_no_op_when_current_and_steps_down_with_target(cli: Cli) -> None:
    code, out, err = cli("migrate", "--json")
    assert code == 0, err
    assert json.loads(out) == {
        "before": LATEST_SCHEMA_VERSION,
        "version": LATEST_SCHEMA_VERSION,
        "extension_before": LATEST_EXTENSION_VERSION,
        "extension_version": LATEST_EXTENSION_VERSION,
    }
    code, out, _ = cli("migrate")
    assert out.strip() == (
        f"schema version at {LATEST_SCHEMA_VERSION}, extension version at "
        f"{LATEST_EXTENSION_VERSION}"
    )
    code, out, err = cli("migrate", "--target", "5", "--json")
    assert code == 0, err
    assert json.loads(out)["version"] == 5
    status = json.loads(cli("migrate", "--status", "--json")[1])
    assert status == {
        "version": 5,
        "latest": LATEST_SCHEMA_VERSION,
        "extension_version": 0,
        "extension_latest": LATEST_EXTENSION_VERSION,
    }
    assert "schema version 5" in one_line(cli("runs"), 2)
    code, out, err = cli("migrate")
    assert code == 0, err
    assert out.strip() == (
        f"schema version 5 -> {LATEST_SCHEMA_VERSION}, extension version 0 -> "
        f"{LATEST_EXTENSION_VERSION}"
    )
    assert cli("runs")[0] == 0


@pytest.mark.parametrize("how", ["flag", "env-1", "env-true", "env-yes"])
def test_dwd_pooled_migrate_without_a_listen_url_is_refused(
    how: str, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CYCLONE_LISTEN_URL", raising=False)
    if how == "flag":
        outcome = cli("--pooled", "migrate", "--status")
    else:
        monkeypatch.setenv("CYCLONE_POOLED", how.removeprefix("env-"))
        outcome = cli("migrate")
    assert "--listen-url" in one_line(outcome, 2)


@pytest.mark.parametrize("how", ["flags", "env"])
def test_dwd_pooled_migrate_runs_on_the_listen_url(
    how: str, unmigrated: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pooled DSN cannot be reached at all: the migration must run on the listen URL.
    if how == "flags":
        args = ["--dsn", UNREACHABLE, "--pooled", "--listen-url", unmigrated, "migrate", "--json"]
    else:
        monkeypatch.setenv("CYCLONE_DATABASE_URL", UNREACHABLE)
        monkeypatch.setenv("CYCLONE_POOLED", "1")
        monkeypatch.setenv("CYCLONE_LISTEN_URL", unmigrated)
        args = ["migrate", "--json"]
    code, out, err = invoke(capsys, *args)
    assert code == 0, err
    assert json.loads(out)["version"] == LATEST_SCHEMA_VERSION
    code, out, err = invoke(capsys, "--dsn", unmigrated, "runs", "--json")
    assert (code, out.strip()) == (0, "[]"), err


def test_dwd_cyclone_pooled_0_is_not_pooled(cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CYCLONE_POOLED", "0")
    monkeypatch.delenv("CYCLONE_LISTEN_URL", raising=False)
    code, _, err = cli("migrate")
    assert code == 0, err


def test_dwd_concurrent_migrations_wait_for_each_other(unmigrated: str) -> None:
    versions: list[int] = []
    errors: list[BaseException] = []

    def apply() -> None:
        try:
            versions.append(migrate(unmigrated))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=apply) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert versions == [LATEST_SCHEMA_VERSION] * 3


def test_dwd_migrations_as_a_role_without_create(
    cyclone_admin_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """deploy.md: a role that may not apply a migration gets MigrationPermissionDenied
    naming it; on a current schema, migrate() creates nothing, so an application role can
    call it on every start. cli.md: exit 1, with the migration's name."""
    schema = create_schema(cyclone_admin_dsn, version=5)
    try:
        with limited_role(cyclone_admin_dsn, schema, select=True) as app:
            with pytest.raises(MigrationPermissionDenied, match=r"006_"):
                migrate(app)
            line = one_line(invoke(capsys, "--dsn", app, "migrate"), 1)
            assert "006_" in line and "run the migrations as a role that owns" in line
            migrate(with_search_path(cyclone_admin_dsn, schema))
            assert migrate(app) == LATEST_SCHEMA_VERSION  # current: no privilege needed
            with Client(app) as client:
                assert client.list_runs() == []
    finally:
        drop_schema(cyclone_admin_dsn, schema)


def test_dwd_new_schema_as_a_role_without_create(
    unmigrated: str, cyclone_admin_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with limited_role(cyclone_admin_dsn, schema_of(unmigrated)) as app:
        line = one_line(invoke(capsys, "--dsn", app, "migrate"), 1)
    assert "cannot read or create the version tables" in line


def test_dwd_a_role_that_may_not_read_the_tables_gets_permission_denied(
    cyclone_dsn: str, cyclone_admin_dsn: str
) -> None:
    with (
        limited_role(cyclone_admin_dsn, schema_of(cyclone_dsn)) as app,
        pytest.raises(DatabaseUnavailable) as caught,
    ):
        Client(app)
    assert caught.value.cause == "permission_denied"
    assert "cyclone_" in str(caught.value)  # names the table


# -- deploy.md: when the database cannot be reached --------------------------------------------


def test_dwd_client_unreachable_causes(cyclone_admin_dsn: str) -> None:
    started = time.monotonic()
    with pytest.raises(DatabaseUnavailable) as refused:
        Client(UNREACHABLE)
    assert refused.value.cause == "connection_refused"
    assert "127.0.0.1:1" in str(refused.value) and "s3cretpw" not in str(refused.value)
    assert "\n" not in str(refused.value)
    with pytest.raises(DatabaseUnavailable) as unknown:
        Client("postgresql://dwd:s3cretpw@dwd-no-such-host.invalid/app")
    assert unknown.value.cause == "unknown_host"
    params = conninfo_to_dict(cyclone_admin_dsn)
    params["dbname"] = "dwd_no_such_database"
    with pytest.raises(DatabaseUnavailable) as missing:
        Client(make_conninfo("", **params))
    assert missing.value.cause == "database_missing"
    assert time.monotonic() - started < 20  # one direct attempt each, not a pool timeout


def test_dwd_unparsable_dsn_and_unmigrated_database_in_python(unmigrated: str) -> None:
    with pytest.raises(InvalidArgument):
        Client("postgress://dwd@localhost/app")
    with pytest.raises(SchemaVersionMismatch, match="cyclone migrate"):
        Client(unmigrated)


# -- deploy.md: a Worker runs once, options checked before it connects -----------------------


def test_dwd_worker_options_are_checked_before_connecting() -> None:
    for bad in (
        {"lease": "30"},
        {"concurrency": 0},
        {"max_async": -1},
        {"grace": -1},
        {"poll_interval": 0},
        {"retention": "7d"},
        {"concurrency": 4, "max_concurrency": 8},
    ):
        with pytest.raises(InvalidArgument):
            Worker(UNREACHABLE, [dwd_flow], **bad)


def test_dwd_worker_runs_once(cyclone_dsn: str) -> None:
    never = Worker(cyclone_dsn, [dwd_flow])
    never.stop()  # not running: returns at once
    broken = Worker(UNREACHABLE, [dwd_flow])
    for _ in range(2):  # a start() that failed may be called again
        with pytest.raises(DatabaseUnavailable):
            broken.start()
    worker = Worker(cyclone_dsn, [dwd_flow], poll_interval=0.2)
    worker.start()
    try:
        with pytest.raises(InvalidTransition):
            worker.start()
    finally:
        worker.stop()
    with pytest.raises(InvalidTransition):
        worker.start()
    worker.stop()


def test_dwd_adaptive_defaults(start_worker: StartWorker) -> None:
    plain = start_worker(dwd_flow).settings()
    assert plain.adaptive and plain.concurrency == 10 and plain.max_concurrency == 256
    assert plain.async_concurrency == 100 and plain.max_async == 10000
    assert plain.claim_size <= plain.batch_size == 100
    assert start_worker(dwd_tx_flow).settings().max_concurrency == 32
    fixed = start_worker(dwd_flow, concurrency=4).settings()
    assert not fixed.adaptive and fixed.concurrency == 4


def test_dwd_transactional_session_settings(
    start_worker: StartWorker, client: Client, cyclone_admin_dsn: str
) -> None:
    """deploy.md: the transactional step's session has idle_in_transaction_session_timeout
    = the worker's lease, and keeps the server's jit."""
    with psycopg.connect(cyclone_admin_dsn) as conn:
        row = conn.execute("SELECT current_setting('jit')").fetchone()
    assert row is not None
    start_worker(dwd_tx_flow, lease=12)
    got = client.submit(dwd_tx_flow, 1).result(timeout=30)
    assert got == {"idle": "12s", "jit": row[0]}


# -- scale.md: pooled without a listen URL polls, and says so once ---------------------------


def test_dwd_pooled_worker_without_listen_polls_and_logs_once(
    start_worker: StartWorker,
    client: Client,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CYCLONE_LISTEN_URL", raising=False)
    monkeypatch.setenv("CYCLONE_POOLED", "yes")  # the default of Worker(pooled=...)
    caplog.set_level("INFO")
    start_worker(dwd_flow, poll_interval=1.0)
    assert client.submit(dwd_flow, 1).result(timeout=30) == 2
    said = [r.getMessage() for r in caplog.records if "no LISTEN connection" in r.getMessage()]
    assert len(said) == 1, said
    assert (
        "no LISTEN connection (the DSN is pooled and no listen_dsn is set): polling for work "
        "every 1s"
    ) in said[0]


def test_dwd_pooled_and_listen_url_from_the_environment(
    cyclone_dsn: str,
    start_worker: StartWorker,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CYCLONE_POOLED", "true")
    monkeypatch.setenv("CYCLONE_LISTEN_URL", cyclone_dsn)
    caplog.set_level("INFO")
    with Client(cyclone_dsn) as client:
        assert client.pooled
        start_worker(dwd_flow, poll_interval=30.0)  # only a wake-up can start the step soon
        assert client.submit(dwd_flow, 5).result(timeout=20) == 6
    assert not [r for r in caplog.records if "no LISTEN connection" in r.getMessage()]
    monkeypatch.setenv("CYCLONE_POOLED", "0")
    with Client(cyclone_dsn) as client:
        assert not client.pooled


# -- deploy.md: monitoring views --------------------------------------------------------------


def test_dwd_monitoring_views(cyclone_dsn: str, client: Client) -> None:
    client.submit(dwd_flow, 1)
    with psycopg.connect(cyclone_dsn) as conn:
        for view in ("cyclone_v_runs", "cyclone_v_steps", "cyclone_v_kinds", "cyclone_v_queues"):
            cur = conn.execute(sql.SQL("SELECT * FROM {}").format(sql.Identifier(view)))
            assert cur.description is not None, view
        kinds = conn.execute("SELECT * FROM cyclone_v_kinds").fetchall()
        columns = [c.name for c in conn.execute("SELECT * FROM cyclone_v_kinds").description or []]
    text = " ".join(columns)
    assert "oldest" in text and "expired" in text, columns
    assert any("dwd_add" in map(str, row) for row in kinds), kinds


# -- cli.md: the commands at work ---------------------------------------------------------------


def test_dwd_runs_and_run_json(cli: Cli, client: Client) -> None:
    assert cli("runs")[1].strip() == "no runs"
    handle = client.submit(dwd_waiting, 1)
    _, out, _ = cli("runs")
    header, row = out.strip().splitlines()
    assert header.split() == ["run", "state", "workflow", "created"]
    assert row.split()[:3] == [str(handle.id), "running", "dwd_waiting"]
    listed = json.loads(cli("runs", "--json", "--state", "running", "--limit", "5")[1])
    created = datetime.fromisoformat(listed[0]["created_at"])
    assert created.tzinfo is not None
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?[+-]\d\d:\d\d", listed[0]["created_at"]
    )
    assert json.loads(cli("runs", "--json", "--workflow", "dwd_other")[1]) == []
    shown = json.loads(cli("run", str(handle.id), "--json")[1])
    assert {"child_runs", "waiting_for", "steps"} <= set(shown)


def test_dwd_steering_commands(cli: Cli, client: Client) -> None:
    handle = client.submit(dwd_waiting, 1)
    rid = str(handle.id)
    assert json.loads(cli("pause", rid, "--json")[1]) == {
        "run_id": handle.id,
        "action": "pause",
        "state": "paused",
    }
    assert cli("resume", rid)[1].strip() == f"run {rid}: resume done (now running)"
    assert json.loads(cli("signal", rid, "go", "5", "--json")[1]) == {"delivery": "consumed"}
    assert json.loads(cli("cancel", rid, "--json")[1])["state"] == "cancelled"
    assert "already cancelled" in one_line(cli("signal", rid, "go", "1"), 2)  # has ended
    assert "999999" in one_line(cli("cancel", "999999"), 2)  # an unknown run


def test_dwd_submit_wait_follow_retry_and_fork(
    cli: Cli, client: Client, start_worker: StartWorker
) -> None:
    start_worker(flows.add, flows.make_list, flows.item)
    code, out, err = cli("submit", "tests.cli.flows:chained", "--input", "1", "--wait", "--json")
    assert code == 0, err
    done = json.loads(out)
    assert done["result"] == 3
    rid = str(done["run_id"])
    code, out, _ = cli("run", rid, "--follow", "--json")
    assert code == 0
    assert json.loads(out.strip().splitlines()[-1]) == {
        "run_id": done["run_id"],
        "state": "completed",
    }
    nodes = [s["node"] for s in json.loads(cli("run", rid, "--json")[1])["steps"]]
    code, out, err = cli("retry", rid, nodes[-1], "--force", "--json")
    assert code == 0, err
    assert json.loads(out)["force"] is True
    wait_until(lambda: client.get_run(int(rid)).state.value == "completed", what="replayed")
    code, out, err = cli("fork", rid, nodes[-1], "--input", "10", "-m", "tests.cli.flows", "--json")
    assert code == 0, err
    forked = json.loads(out)
    assert forked["forked_from"] == int(rid) and nodes[0] in forked["copied"]
    # --once says when it returned an existing run
    first = json.loads(cli("submit", "tests.cli.flows:flow", "--once", "k1", "--json")[1])
    code, out, _ = cli("submit", "tests.cli.flows:flow", "--once", "k1")
    assert out.strip() == f"{first['run_id']} (existing run for key 'k1': nothing new was created)"


def test_dwd_failed_run_and_timeout_exit_1(
    cli: Cli, client: Client, start_worker: StartWorker
) -> None:
    code, out, err = cli("submit", "tests.cli.flows:flow", "--wait", "--timeout", "1s")
    assert (code, out) == (1, ""), err
    *progress, line = err.strip().splitlines()
    assert all(p.endswith("steps done") for p in progress), err  # --wait shows progress
    assert line.startswith("cyclone: run ") and line.endswith("did not finish within 1s")
    start_worker(dwd_failing)
    handle = client.submit(dwd_failing, 7)
    wait_until(lambda: client.get_run(handle.id).is_terminal, what="failed", timeout=30)
    code, out, _ = cli("run", str(handle.id), "--follow")
    assert code == 1
    assert out.strip().splitlines()[-1].startswith(f"run {handle.id} dwd_failing failed")


def test_dwd_purge_durations_and_confirmation(cli: Cli, client: Client) -> None:
    for text, seconds in (
        ("30s", 30),
        ("15m", 900),
        ("12h", 43200),
        ("7d", 604800),
        ("2w", 1209600),
    ):
        code, out, err = cli("purge", "--dry-run", "--older-than", text, "--json")
        assert code == 0, err
        assert json.loads(out) == {"would_delete": 0, "older_than_s": seconds}
    default = json.loads(cli("purge", "--dry-run", "--json")[1])
    assert default["older_than_s"] == 7 * 86400  # default 7d
    handle = client.submit(dwd_waiting, 1)
    client.cancel(handle.id)
    assert (
        json.loads(cli("purge", "--dry-run", "--older-than", "0s", "--json")[1])["would_delete"]
        == 1
    )
    assert "--yes" in one_line(cli("purge", "--older-than", "0s"), 2)  # not a terminal
    assert client.get_run(handle.id).state.value == "cancelled"
    code, out, _ = cli("purge", "--older-than", "0s", "--yes", "--json")
    assert (code, json.loads(out)) == (0, {"deleted": 1})


def test_dwd_bulk_commands(cli: Cli, client: Client) -> None:
    handles = [client.submit(dwd_waiting, i) for i in range(3)]
    code, out, _ = cli("cancel-many", "--workflow", "dwd_waiting", "--dry-run", "--json")
    assert json.loads(out)["matched"] == 3 and json.loads(out)["dry_run"] is True
    assert "--yes" in one_line(cli("cancel-many", "--all"), 2)
    code, out, err = cli("cancel-many", "--all", "--yes", "--json", "--batch-size", "2")
    assert code == 0
    assert json.loads(out)["acted"] == 3
    assert "runs done" in err  # progress on standard error
    assert {client.get_run(h.id).state.value for h in handles} == {"cancelled"}


def test_dwd_schedules_queue_limit_scan_and_stats(cli: Cli) -> None:
    code, out, err = cli(
        "schedules", "add", "tests.cli.flows:flow", "0 3 * * *", "--id", "dwd_nightly",
        "--location", "Europe/Paris", "--input", "1", "--disabled", "--queue", "q",
        "--priority", "3", "--max-attempts", "2", "--timeout", "5m", "--retention", "2w",
        "--json",
    )  # fmt: skip
    assert code == 0, err
    added = json.loads(out)
    assert (added["id"], added["location"], added["enabled"]) == (
        "dwd_nightly",
        "Europe/Paris",
        False,
    )
    assert cli("schedules", "enable", "dwd_nightly")[1].strip() == "schedule dwd_nightly: enabled"
    listed = json.loads(cli("schedules", "--json")[1])
    assert [(s["id"], s["enabled"]) for s in listed] == [("dwd_nightly", True)]
    assert cli("schedules", "disable", "dwd_nightly")[0] == 0
    assert cli("schedules", "rm", "dwd_nightly", "--json")[0] == 0
    assert cli("schedules")[1].strip() == "no schedules"
    assert json.loads(cli("queue-limit", "q", "3", "--json")[1]) == {"queue": "q", "limit": 3}
    assert json.loads(cli("queue-limit", "q", "none", "--json")[1]) == {"queue": "q", "limit": None}
    code, out, err = cli("scan", "--once", "--retention", "none", "--interval", "2")
    assert code == 0, err
    assert re.fullmatch(r"scan pass done: \d+ rows changed", out.strip())
    data = json.loads(cli("stats", "--json")[1])
    assert set(data) >= {"queues", "kinds", "limits", "unserved"}


def test_dwd_workers_lists_live_workers_with_the_adaptive_cap(
    cli: Cli, start_worker: StartWorker
) -> None:
    assert cli("workers")[1].strip() == "no live workers"
    worker = start_worker(dwd_flow, queues=["default", "dwd_q"])
    rows = json.loads(cli("workers", "--json")[1])
    assert len(rows) == 1
    assert rows[0]["queues"] == ["default", "dwd_q"]
    assert rows[0]["concurrency"] == 256  # the cap of an adaptive worker
    assert "dwd_add" in rows[0]["handlers"]
    assert "dwd_flow" in [v["workflow"] for v in rows[0]["versions"]]
    worker.stop()
    assert json.loads(cli("workers", "--json")[1]) == []
    assert [r["live"] for r in json.loads(cli("workers", "--all", "--json")[1])] == [False]


# -- cli.md: names in the listings are printed escaped -----------------------------------------


@pytest.fixture
def hostile_worker(start_worker: StartWorker, client: Client) -> Iterator[None]:
    release.clear()
    start_worker(dwd_hostile_flow)
    for _ in range(2):  # one runs, one waits for the key: a row in the limits listing
        client.submit(dwd_hostile_flow, {"tenant": "t\x1bZ\nfake"})
    wait_until(lambda: client.stats()["limits"], what="a limited key")
    yield
    release.set()


def test_dwd_runs_and_run_escape_names(cli: Cli, hostile_worker: None) -> None:
    for command in (["runs"], ["run", "1"]):
        out = cli(*command)[1]
        assert "\x1b" not in out, command
        assert "dwd_wf\\x1bY\\nfake row" in out


def test_dwd_workers_listing_escapes_names(cli: Cli, hostile_worker: None) -> None:
    out = cli("workers")[1]
    assert "\x1b" not in out
    assert "dwd_wf\\x1bY\\nfake row" in out


def test_dwd_stats_listing_escapes_names(cli: Cli, hostile_worker: None) -> None:
    out = cli("stats")[1]
    assert "\x1b" not in out
    assert "dwd_kind\\x1bX\\nfake row" in out


# -- cli.md: cyclone worker and cyclone scan as real processes ----------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_dwd_cli_worker_with_every_flag(cyclone_dsn: str, client: Client) -> None:
    port = free_port()
    proc = spawn(
        cyclone_dsn, "worker", "tests.cli.flows", "--processes", "1", "--queues", "default,dwd_q",
        "--max-concurrency", "7", "--max-async", "50", "--grace", "5",
        "--transactional-dsn", cyclone_dsn, "--poll-interval", "0.5", "--lease", "10",
        "--retention", "none", "--no-scanners", "--catch-up", "all", "--pooled",
        "--metrics-port", str(port), "--metrics-host", "127.0.0.1", "--log-format", "json",
    )  # fmt: skip
    try:
        handle = client.submit(flows.flow, 41)
        assert handle.result(timeout=30) == 42
        rows = [w for w in client.workers() if w["live"]]
        assert len(rows) == 1
        assert rows[0]["queues"] == ["default", "dwd_q"] and rows[0]["concurrency"] == 7
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
            metrics = page.read().decode()
        assert "cyclone_worker_slots" in metrics
    finally:
        code, _, err = stop(proc)
    assert code == 0, err
    logged = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    polling = [e for e in logged if "no LISTEN connection" in json.dumps(e)]
    assert len(polling) == 1, err
    assert "every 0.5s" in json.dumps(polling[0])


@pytest.mark.parametrize(
    ("extra", "code", "expected"),
    [
        (["json"], 2, "no handlers"),
        (["dwd.no.such.module"], 2, "cannot import"),
        (["tests.cli.flows", "--concurrency", "4", "--max-concurrency", "8"], 2, "concurrency"),
        (["tests.cli.flows", "--grace", "-1"], 2, "grace"),
        (["tests.cli.flows", "--poll-interval", "0"], 2, "poll_interval"),
        (["tests.cli.flows", "--transactional-dsn", UNREACHABLE], 1, "127.0.0.1:1"),
        (["tests.cli.flows", "--transactional-dsn", "mysql://x"], 2, "cannot be parsed"),
        (["tests.cli.flows", "--metrics-port", "9", "--metrics-host", "256.1.1.1"], 2, "metrics"),
    ],
    ids=["no-handlers", "no-module", "both-caps", "grace", "poll", "tx-down", "tx-bad", "metrics"],
)
def test_dwd_cli_worker_refuses_to_start(
    extra: list[str], code: int, expected: str, cyclone_dsn: str
) -> None:
    proc = spawn(cyclone_dsn, "worker", *extra, "--processes", "1")
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        stop(proc)
    assert proc.returncode == code, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("cyclone: "), err
    assert expected in err and "s3cretpw" not in err


def test_dwd_cli_worker_refuses_an_unmigrated_database(unmigrated: str) -> None:
    proc = spawn(unmigrated, "worker", "tests.cli.flows", "--processes", "1")
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        stop(proc)
    assert proc.returncode == 2, err
    assert "run `cyclone migrate`" in err


def test_dwd_cli_worker_refuses_a_kind_served_with_another_handler(
    cyclone_dsn: str, start_worker: StartWorker
) -> None:
    start_worker(flows.add)
    proc = spawn(cyclone_dsn, "worker", "tests.cli.other_app", "--processes", "1")
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        stop(proc)
    assert proc.returncode == 2, err
    assert err.startswith("cyclone: ") and "cli_add" in err


def test_dwd_scan_refuses_a_negative_interval(cyclone_dsn: str) -> None:
    proc = spawn(cyclone_dsn, "scan", "--interval", "-1")
    try:
        _, err = proc.communicate(timeout=8)
    except subprocess.TimeoutExpired:
        stop(proc)
        pytest.fail("cyclone scan --interval -1 kept running")
    assert proc.returncode == 2, err
    assert "interval" in err
