"""Every error of the real CLI is one line on stderr, with the fix, and never a password.

Through ``python -m cyclone_dsl.cli`` in a subprocess, as a user runs it, for the first
command of each test and for every ``worker``; the others run in this process through the
entry point's own error handling (tests/cli/runner.py), which costs no interpreter start.
Against the test run's PostgreSQL:
a DSN with another URL scheme or a password libpq quotes back, a server that is down,
the preconditions of ``migrate``, ``demo`` and ``scan``, click's usage errors, a role that
may not migrate, a migration that fails, and a database error nobody planned for.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlencode

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from cyclone_dsl import LATEST_SCHEMA_VERSION, SCHEMA_VERSION_TABLE
from cyclone_dsl.testing.schemas import create_schema, drop_schema, with_search_path
from tests.cli.runner import Cli, in_process, one_error_line, runner
from tests.roles import limited_role

#: One command of each way in: a client, the migrator, the demo, the scanner, a worker.
CONNECTING: list[tuple[str, ...]] = [
    ("runs",),
    ("migrate",),
    ("demo",),
    ("scan", "--once"),
    ("worker", "tests.cli.flows"),
]


def each_fails(dsn: str, commands: list[tuple[str, ...]], code: int) -> set[str]:
    """Run each command on ``dsn``; each must exit ``code`` with one error line. The lines.

    The first command, and a worker (which would not end on its own if it did not fail),
    run in a subprocess; the others in this process."""
    lines = set()
    for index, command in enumerate(commands):
        run = runner(dsn) if index == 0 or command[0] == "worker" else in_process(dsn)
        result = run(*command)
        assert result.returncode == code, (command, result.stderr)
        lines.add(one_error_line(result))
    return lines


@pytest.fixture
def cyclone(cyclone_dsn: str) -> Cli:
    return runner(cyclone_dsn)


@pytest.fixture
def schema(cyclone_admin_dsn: str) -> Iterator[str]:
    """A new schema with nothing in it, dropped at the end."""
    name = create_schema(cyclone_admin_dsn, migrated=False)
    yield name
    drop_schema(cyclone_admin_dsn, name)


# -- the DSN ----------------------------------------------------------------------------


def test_a_dsn_of_another_scheme_is_one_line_that_names_it() -> None:
    for scheme, commands in [
        ("mysql", CONNECTING),
        ("http", CONNECTING[:1]),
        ("postgresql+psycopg", CONNECTING[:1]),
    ]:
        [line] = each_fails(f"{scheme}://app:s3cret@localhost/app", commands, 2)
        assert line == (
            f"cyclone: the DSN cannot be parsed: its URL scheme is {scheme!r}: a PostgreSQL "
            "URL starts with postgresql:// or postgres://"
        )


def as_url(dsn: str, scheme: str) -> str:
    """``dsn`` (a conninfo string) written as a ``scheme://`` URL."""
    params: dict[str, Any] = conninfo_to_dict(dsn)
    user = quote(str(params.pop("user", "")), safe="")
    password = params.pop("password", None)
    auth = f"{user}:{quote(str(password), safe='')}@" if password else f"{user}@"
    database = quote(str(params.pop("dbname", "")), safe="")
    return f"{scheme}://{auth}/{database}?{urlencode(params, quote_via=quote)}"


def test_both_postgresql_schemes_are_accepted(cyclone_dsn: str) -> None:
    for scheme in ("postgresql", "postgres"):
        result = runner(as_url(cyclone_dsn, scheme))("runs")
        assert (result.returncode, result.stdout.strip()) == (0, "no runs"), result.stderr


def test_a_password_the_dsn_parser_quotes_back_is_masked() -> None:
    # libpq quotes the piece of a URL it cannot parse: here, the password.
    lines = each_fails("postgresql://app:hunter 2@localhost/app", CONNECTING[:2], 2)
    assert lines == {
        'cyclone: the DSN cannot be parsed: unexpected spaces found in "****", use '
        "percent-encoded spaces (%20) instead"
    }


def test_a_server_that_is_down_is_one_line_and_exit_1() -> None:
    # A one-letter password: masking it must not mangle the words that contain the letter.
    [line] = each_fails("postgresql://app:b@127.0.0.1:1/app?connect_timeout=3", CONNECTING, 1)
    assert line == (
        "cyclone: cannot connect to 127.0.0.1:1 (database 'app'): Connection refused: "
        "is PostgreSQL running there, and is the port right?"
    )


@pytest.mark.parametrize(
    ("dsn", "code", "line"),
    [
        (
            "mysql://app:s3cret@localhost/app",
            2,
            "the DSN cannot be parsed: its URL scheme is 'mysql': a PostgreSQL URL starts "
            "with postgresql:// or postgres://",
        ),
        (
            "postgresql://app:hunter 2@localhost/app",
            2,
            'the DSN cannot be parsed: unexpected spaces found in "****", use '
            "percent-encoded spaces (%20) instead",
        ),
        (
            "postgresql://app:s3cret@127.0.0.1:1/app?connect_timeout=3",
            1,
            "cannot connect to 127.0.0.1:1 (database 'app'): Connection refused: is "
            "PostgreSQL running there, and is the port right?",
        ),
    ],
)
def test_a_worker_checks_its_transactional_dsn_at_start(
    cyclone: Cli, dsn: str, code: int, line: str
) -> None:
    result = cyclone("worker", "tests.cli.tx_flows", "--transactional-dsn", dsn)
    assert result.returncode == code
    assert one_error_line(result) == f"cyclone: {line}"


# -- what migrate, demo and scan need ---------------------------------------------------


def test_scan_on_an_unmigrated_schema_says_run_cyclone_migrate(
    cyclone_admin_dsn: str, schema: str
) -> None:
    cyclone = runner(with_search_path(cyclone_admin_dsn, schema))
    result = cyclone("scan", "--once")
    assert result.returncode == 2
    line = one_error_line(result)
    assert line.startswith("cyclone: the database is at schema version 0 (extension 0)")
    assert line.endswith("run `cyclone migrate` (or cyclone_dsl.migrate(dsn))")


def test_a_schema_newer_than_this_build_is_refused_with_one_line(cyclone_dsn: str) -> None:
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        conn.execute(f"UPDATE {SCHEMA_VERSION_TABLE} SET version = 99")
    try:
        lines = each_fails(cyclone_dsn, [("migrate",), ("demo",), ("scan", "--once")], 2)
    finally:
        with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
            conn.execute(f"UPDATE {SCHEMA_VERSION_TABLE} SET version = {LATEST_SCHEMA_VERSION}")
    assert lines == {
        "cyclone: the database is at schema version 99, newer than this build's 19: upgrade "
        "cyclone-dsl before running it against this database",
        "cyclone: the database is at schema version 99, newer than this build's 19: upgrade "
        "cyclone-dsl",
    }


def test_migrate_without_the_privilege_to_create_is_one_line(
    cyclone_admin_dsn: str, schema: str
) -> None:
    with limited_role(cyclone_admin_dsn, schema) as dsn:
        for run, command in [(runner(dsn), ("migrate",)), (in_process(dsn), ("demo",))]:
            result = run(*command)
            assert result.returncode == 1, result.stderr
            assert one_error_line(result) == (
                "cyclone: cannot read or create the version tables: permission denied for "
                f"schema {schema}: run the migrations as a role that owns the schema or has "
                "CREATE on it"
            )


def test_a_migration_the_role_may_not_apply_is_named(cyclone_admin_dsn: str, schema: str) -> None:
    dsn = with_search_path(cyclone_admin_dsn, schema)
    assert in_process(dsn)("migrate", "--target", "18").returncode == 0
    with limited_role(cyclone_admin_dsn, schema, select=True) as limited:
        result = runner(limited)("migrate")
        assert result.returncode == 1
        assert one_error_line(result) == (
            "cyclone: migration 019_child_runs (up) failed and was rolled back: must be owner "
            "of table cyclone_runs: run the migrations as a role that owns the schema or has "
            "CREATE on it"
        )
    assert in_process(dsn)("migrate", "--status").stdout.startswith("schema version 18 ")


def test_a_failed_migration_is_named_and_exit_1(cyclone_admin_dsn: str, schema: str) -> None:
    dsn = with_search_path(cyclone_admin_dsn, schema)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE cyclone_runs (id int)")  # a table of the same name
    result = runner(dsn)("migrate")
    assert result.returncode == 1
    assert one_error_line(result) == (
        "cyclone: migration 001_initial_schema (up) failed and was rolled back: relation "
        '"cyclone_runs" already exists'
    )


# -- click's usage errors ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (("runs", "--bogus"), "no such option '--bogus' (see 'cyclone runs --help')"),
        (("run",), "missing argument 'RUN_ID' (see 'cyclone run --help')"),
        (
            ("runs", "--limit", "ten"),
            "invalid value for '--limit': 'ten' is not a valid integer (see 'cyclone runs --help')",
        ),
        (("no-such-command",), "no such command 'no-such-command' (see 'cyclone --help')"),
        (
            ("worker", "tests.cli.flows", "--max-async", "0"),
            "invalid value for '--max-async': 0 is not in the range x>=1 "
            "(see 'cyclone worker --help')",
        ),
    ],
)
def test_a_usage_error_is_one_line_with_a_hint(
    cyclone_dsn: str, args: tuple[str, ...], line: str
) -> None:
    run = runner(cyclone_dsn) if args[0] == "worker" else in_process(cyclone_dsn)
    result = run(*args)
    assert result.returncode == 2
    assert one_error_line(result) == f"cyclone: {line}"


def test_a_usage_error_with_v_shows_clicks_usage(cyclone_dsn: str) -> None:
    result = in_process(cyclone_dsn)("-v", "run", "abc")
    assert result.returncode == 2
    assert result.stderr.splitlines()[0] == "Usage: cyclone run [OPTIONS] RUN_ID"
    assert "'abc' is not a valid integer" in result.stderr


# -- a database error nobody planned for ------------------------------------------------


def test_an_unplanned_database_error_is_its_first_line_unless_v(cyclone_dsn: str) -> None:
    """A schema at the right version whose table is gone: the database's error, one line."""
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE cyclone_runs CASCADE")
    cyclone = runner(cyclone_dsn)
    result = cyclone("runs")
    assert result.returncode == 1
    assert one_error_line(result) == (
        'cyclone: the database refused the call: relation "cyclone_runs" does not exist'
        " (-v prints the traceback)"
    )
    verbose = cyclone("-v", "runs")  # the interpreter prints the traceback
    assert verbose.returncode == 1
    assert "Traceback (most recent call last)" in verbose.stderr
    assert "psycopg.errors.UndefinedTable" in verbose.stderr
