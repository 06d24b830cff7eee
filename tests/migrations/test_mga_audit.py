"""An audit of the migrator as a demanding user meets it (prefix ``mga_``).

Concurrent migrators, a migrator killed mid-migration, a migration failing half-way
through a shipped file, a database newer than the build, a schema taken down and up
again, a search_path schema that does not exist, a role that may not use the schema, a
tampered version table, a wrong password, and ``cyclone migrate``'s exit codes.
"""

from __future__ import annotations

import json
import re
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cyclone_dsl import (
    LATEST_EXTENSION_VERSION,
    LATEST_SCHEMA_VERSION,
    Client,
    DatabaseUnavailable,
    Worker,
    migrate,
    step,
)
from cyclone_dsl.errors import (
    CycloneError,
    InvalidArgument,
    MigrationError,
    SchemaVersionMismatch,
)
from cyclone_dsl.migrate import load_migrations, migrate_versions, versions
from cyclone_dsl.migrate.files import SEPARATOR
from cyclone_dsl.migrate.runner import LOCK_NAMESPACE
from cyclone_dsl.testing.schemas import create_schema, drop_schema, with_search_path
from tests.cli.runner import one_error_line, runner
from tests.migrations import expected_schema as expected
from tests.migrations.catalog import catalog_differences, read_catalog

ROOT = Path(__file__).resolve().parents[2]
FULL = (LATEST_SCHEMA_VERSION, LATEST_EXTENSION_VERSION)


@step(name="mga_noop")
def mga_noop() -> None:
    return None


def relations(dsn: str) -> list[str]:
    """The relations of the DSN's current schema (its search_path's first)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT relname FROM pg_class WHERE relnamespace = current_schema()::regnamespace "
            "ORDER BY 1"
        ).fetchall()
    return [r[0] for r in rows]


def catalog_of(dsn: str, schema: str, **options: Any) -> dict[str, Any]:
    with psycopg.connect(dsn) as conn:
        return read_catalog(conn, schema, **options)


def set_version(dsn: str, version: int, *, table: str = "cyclone_schema_version") -> None:
    with psycopg.connect(dsn) as conn:
        update = sql.SQL("UPDATE {} SET version = %s").format(sql.Identifier(table))
        conn.execute(update, (version,))


@pytest.fixture
def role_without_usage(cyclone_admin_dsn: str) -> Iterator[tuple[str, str, str]]:
    """(schema, admin DSN, role DSN): a migrated schema and a login role that has no
    privilege on it at all (not even USAGE)."""
    name = create_schema(cyclone_admin_dsn)
    role = f"mga_role_{secrets.token_hex(4)}"
    with psycopg.connect(cyclone_admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    params: dict[str, Any] = conninfo_to_dict(with_search_path(cyclone_admin_dsn, name))
    params["user"] = role
    try:
        yield name, with_search_path(cyclone_admin_dsn, name), make_conninfo("", **params)
    finally:
        drop_schema(cyclone_admin_dsn, name)
        with psycopg.connect(cyclone_admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


# -- a search_path schema that cannot be used ------------------------------------------


def test_mga_a_search_path_schema_that_does_not_exist_is_named(cyclone_admin_dsn: str) -> None:
    missing = f"mga_missing_{secrets.token_hex(4)}"
    with pytest.raises(MigrationError) as caught:
        migrate(with_search_path(cyclone_admin_dsn, missing))
    message = str(caught.value)
    assert "not held at unlock time" not in message
    assert message.startswith("no schema to migrate: no schema on the search_path")
    assert missing in message


def test_mga_cli_migrate_as_a_role_without_usage_names_the_privilege(
    role_without_usage: tuple[str, str, str],
) -> None:
    _, _, role_dsn = role_without_usage
    result = runner(role_dsn)("migrate")
    assert result.returncode == 1
    line = one_error_line(result)
    assert "not held at unlock time" not in line
    assert "no schema to migrate" in line and "grant USAGE and CREATE" in line


def test_mga_versions_as_a_role_without_usage_is_zero_and_creates_nothing(
    role_without_usage: tuple[str, str, str],
) -> None:
    """What the role sees: nothing, and the start-up check says to migrate (no raw error)."""
    _, admin, role_dsn = role_without_usage
    assert versions(role_dsn) == (0, 0)
    with pytest.raises(SchemaVersionMismatch, match="run `cyclone migrate`"):
        Client(role_dsn)
    assert versions(admin) == FULL


def test_mga_migrate_creates_only_in_the_search_path_schema(
    cyclone_admin_dsn: str, empty_schema: tuple[str, str]
) -> None:
    name, dsn = empty_schema
    with psycopg.connect(cyclone_admin_dsn) as conn:
        public_before = conn.execute(
            "SELECT count(*) FROM pg_class WHERE relnamespace = 'public'::regnamespace"
        ).fetchone()
    assert migrate_versions(dsn) == FULL
    with psycopg.connect(cyclone_admin_dsn) as conn:
        public_after = conn.execute(
            "SELECT count(*) FROM pg_class WHERE relnamespace = 'public'::regnamespace"
        ).fetchone()
    assert public_after == public_before
    assert {"cyclone_runs", "cyclone_schema_version", "cyclone_ext_schema_version"} <= set(
        relations(dsn)
    )
    assert (
        catalog_differences(expected.expected_at(19, expected.EXT_LATEST), catalog_of(dsn, name))
        == []
    )


def test_mga_the_lock_is_per_schema(cyclone_admin_dsn: str, empty_schema: tuple[str, str]) -> None:
    """A migration of schema A does not hold up one of schema B (the lock key is the
    schema), and it does hold up another of schema A."""
    _, dsn_a = empty_schema
    other = create_schema(cyclone_admin_dsn, migrated=False)
    try:
        dsn_b = with_search_path(cyclone_admin_dsn, other)
        with psycopg.connect(dsn_a, autocommit=True) as holder:
            holder.execute(
                "SELECT pg_advisory_lock(%s, hashtext(current_schema()))", (LOCK_NAMESPACE,)
            )
            assert migrate_versions(dsn_b, lock_timeout=1) == FULL
            with pytest.raises(MigrationError, match="held by the session with pid"):
                migrate(dsn_a, lock_timeout=0.2)
        assert versions(dsn_a) == (0, 0)
    finally:
        drop_schema(cyclone_admin_dsn, other)


# -- concurrency, crashes, failures half-way ------------------------------------------


def test_mga_a_migrator_killed_mid_migration_leaves_nothing_and_frees_the_lock(
    empty_schema: tuple[str, str],
) -> None:
    """The migrator waits on 019's ALTER behind a reader; its backend is terminated:
    a typed error naming 019, nothing of 019 kept, and the lock goes with the session."""
    _, dsn = empty_schema
    migrate(dsn, version=18)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["version"] = migrate(dsn)
        except BaseException as exc:
            outcome["error"] = exc

    with psycopg.connect(dsn) as blocker:
        blocker.execute("LOCK TABLE cyclone_runs IN ACCESS SHARE MODE")
        thread = threading.Thread(target=run)
        thread.start()
        with psycopg.connect(dsn, autocommit=True) as admin:
            pid = None
            for _ in range(200):
                # The migrator of this schema: other test processes migrate theirs.
                row = admin.execute(
                    "SELECT a.pid FROM pg_stat_activity AS a JOIN pg_locks AS l ON l.pid = "
                    "a.pid WHERE a.application_name = 'cyclone-migrate' AND NOT l.granted "
                    "AND l.relation = 'cyclone_runs'::regclass"
                ).fetchone()
                if row is not None:
                    pid = row[0]
                    break
                time.sleep(0.02)
            assert pid is not None, "the migrator never waited for the table lock"
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        thread.join(10)
    error = outcome.get("error")
    assert isinstance(error, MigrationError), outcome
    assert str(error).startswith("migration 019_child_runs (up) failed and was rolled back: ")
    assert versions(dsn) == (18, 0)
    with psycopg.connect(dsn) as conn:
        assert conn.execute(
            "SELECT count(*) FROM information_schema.columns WHERE table_schema = "
            "current_schema() AND column_name IN ('parent_run_id', 'child_workflow')"
        ).fetchone() == (0,)
    assert migrate_versions(dsn, lock_timeout=2) == FULL


def test_mga_a_shipped_migration_failing_half_way_keeps_none_of_its_statements(
    empty_schema: tuple[str, str],
) -> None:
    """019 adds columns and indexes, then drops the steps' state check: with the check
    gone, it fails there, and the columns and indexes it added before go too."""
    name, dsn = empty_schema
    migrate(dsn, version=18)
    at_18 = catalog_of(dsn, name, definitions=True)
    with psycopg.connect(dsn) as conn:
        definition = conn.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conname = 'cyclone_steps_state_check' "
            "AND connamespace = current_schema()::regnamespace"
        ).fetchone()
        assert definition is not None
        conn.execute("ALTER TABLE cyclone_steps DROP CONSTRAINT cyclone_steps_state_check")
    with pytest.raises(MigrationError, match=r"^migration 019_child_runs \(up\) failed") as caught:
        migrate(dsn)
    assert 'constraint "cyclone_steps_state_check"' in str(caught.value)
    assert versions(dsn) == (18, 0)
    with psycopg.connect(dsn) as conn:
        conn.execute(
            sql.SQL("ALTER TABLE cyclone_steps ADD CONSTRAINT cyclone_steps_state_check {}").format(
                sql.SQL(definition[0])
            )
        )
    assert catalog_differences(at_18, catalog_of(dsn, name, definitions=True)) == []
    assert migrate_versions(dsn) == FULL


def test_mga_an_upward_and_a_downward_migrator_at_once_end_consistent(
    empty_schema: tuple[str, str],
) -> None:
    """One caller migrates up, one down to 0, released together: both succeed, one waits,
    and the schema is exactly the catalog of the versions recorded."""
    name, dsn = empty_schema
    migrate(dsn, version=10)
    barrier = threading.Barrier(2)
    results: dict[str, Any] = {}

    def run(label: str, version: int | None) -> None:
        barrier.wait()
        try:
            results[label] = migrate_versions(dsn, version=version, lock_timeout=20)
        except BaseException as exc:
            results[label] = exc

    threads = [
        threading.Thread(target=run, args=("up", None)),
        threading.Thread(target=run, args=("down", 0)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results["up"] == FULL, results
    assert results["down"] == (0, 0), results
    final = versions(dsn)
    assert final in ((0, 0), FULL)
    assert catalog_differences(expected.expected_at(*final), catalog_of(dsn, name)) == []


def test_mga_migrate_refuses_a_connection_inside_a_transaction(
    empty_schema: tuple[str, str],
) -> None:
    _, dsn = empty_schema
    with psycopg.connect(dsn, autocommit=True) as conn:
        with conn.transaction(force_rollback=True), pytest.raises(MigrationError):
            migrate(conn)
        assert versions(dsn) == (0, 0)


def test_mga_migrate_on_a_caller_connection_keeps_its_lock_timeout(
    empty_schema: tuple[str, str],
) -> None:
    _, dsn = empty_schema
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '5s'")
        assert migrate(conn) == LATEST_SCHEMA_VERSION
        assert conn.execute("SHOW lock_timeout").fetchone() == ("5s",)


def test_mga_a_statement_timeout_while_waiting_for_the_lock_is_typed(
    empty_schema: tuple[str, str],
) -> None:
    """A role's statement_timeout shorter than the lock wait ends it: a MigrationError,
    not the driver's QueryCanceled."""
    _, dsn = empty_schema
    params: dict[str, Any] = conninfo_to_dict(dsn)
    params["options"] = f"{params.get('options', '')} -c statement_timeout=200".strip()
    short = make_conninfo("", **params)
    with psycopg.connect(dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s, hashtext(current_schema()))", (LOCK_NAMESPACE,))
        with pytest.raises(MigrationError) as caught:
            migrate(short, lock_timeout=30)
    assert isinstance(caught.value.__cause__, psycopg.errors.QueryCanceled)
    assert "statement timeout" in str(caught.value)
    assert "\n" not in str(caught.value)
    assert versions(dsn) == (0, 0)


# -- down and up again ------------------------------------------------------------------


@pytest.mark.parametrize("target", [0, 1, 11, 18])
def test_mga_down_to_a_target_and_up_again_is_the_fresh_schema(
    cyclone_admin_dsn: str, empty_schema: tuple[str, str], target: int
) -> None:
    name, dsn = empty_schema
    assert migrate_versions(dsn) == FULL
    fresh = catalog_of(dsn, name, definitions=True)
    assert migrate_versions(dsn, version=target) == (target, 0)
    assert catalog_differences(expected.expected_at(target), catalog_of(dsn, name)) == []
    assert migrate_versions(dsn) == FULL
    assert catalog_differences(fresh, catalog_of(dsn, name, definitions=True)) == []


# -- a database newer than the build, a tampered version table -------------------------


def test_mga_a_newer_core_stops_clients_workers_and_migrate(cyclone_dsn: str) -> None:
    set_version(cyclone_dsn, LATEST_SCHEMA_VERSION + 1)
    newer = "newer than this build's 19: upgrade cyclone-dsl"
    with pytest.raises(SchemaVersionMismatch, match=newer):
        Client(cyclone_dsn)
    worker = Worker(cyclone_dsn, [mga_noop])
    with pytest.raises(SchemaVersionMismatch, match=newer):
        worker.start()
    with pytest.raises(SchemaVersionMismatch, match=newer):
        migrate(cyclone_dsn, version=3)
    assert versions(cyclone_dsn) == (LATEST_SCHEMA_VERSION + 1, LATEST_EXTENSION_VERSION)
    result = runner(cyclone_dsn)("migrate")
    assert result.returncode == 2
    assert one_error_line(result).endswith(newer + " before running it against this database")
    set_version(cyclone_dsn, LATEST_SCHEMA_VERSION)


def test_mga_a_newer_extension_track_lets_clients_run_but_not_migrate(cyclone_dsn: str) -> None:
    set_version(cyclone_dsn, LATEST_EXTENSION_VERSION + 1, table="cyclone_ext_schema_version")
    with Client(cyclone_dsn) as client:
        assert client.list_runs() == []
    result = runner(cyclone_dsn)("migrate", "--target", "18")
    assert result.returncode == 2
    assert "upgrade cyclone-dsl" in one_error_line(result)
    assert versions(cyclone_dsn) == (LATEST_SCHEMA_VERSION, LATEST_EXTENSION_VERSION + 1)
    assert "cyclone_runs" in relations(cyclone_dsn)
    set_version(cyclone_dsn, LATEST_EXTENSION_VERSION, table="cyclone_ext_schema_version")


def test_mga_a_negative_recorded_version_is_refused(empty_schema: tuple[str, str]) -> None:
    _, dsn = empty_schema
    migrate(dsn, version=5)
    set_version(dsn, -1)
    try:
        outcome: object = migrate(dsn)
    except CycloneError as exc:
        outcome = exc
    with psycopg.connect(dsn) as conn:
        # Migration 6 adds deadline_at: a schema recorded at 19 must have it.
        has_6 = conn.execute(
            "SELECT count(*) FROM information_schema.columns WHERE table_schema = "
            "current_schema() AND table_name = 'cyclone_runs' AND column_name = 'deadline_at'"
        ).fetchone()
    recorded = versions(dsn).core
    assert not (recorded == LATEST_SCHEMA_VERSION and has_6 == (0,)), (
        f"migrate() returned {outcome!r} and recorded {recorded} without migration 6"
    )
    assert isinstance(outcome, CycloneError)


def test_mga_a_version_row_deleted_is_a_typed_failure_that_changes_nothing(
    empty_schema: tuple[str, str],
) -> None:
    name, dsn = empty_schema
    migrate(dsn)
    before = catalog_of(dsn, name)
    with psycopg.connect(dsn) as conn:
        conn.execute("DELETE FROM cyclone_schema_version")
    with pytest.raises(MigrationError, match=r"^migration 001_initial_schema \(up\) failed"):
        migrate(dsn)
    after = catalog_of(dsn, name)
    assert catalog_differences(before, after) == []


# -- the migration files -------------------------------------------------------------


def _write(folder: Path, name: str) -> None:
    (folder / name).write_text(f"SELECT 1\n{SEPARATOR}\n")


def test_mga_a_file_numbered_zero_is_named(tmp_path: Path) -> None:
    _write(tmp_path, "000_zero.sql")
    _write(tmp_path, "001_a.sql")
    with pytest.raises(MigrationError, match=r"^migration 000_zero\.sql: versions start at 1$"):
        load_migrations(tmp_path)


def test_mga_the_same_version_written_two_ways_is_a_duplicate(tmp_path: Path) -> None:
    _write(tmp_path, "001_a.sql")
    _write(tmp_path, "01_b.sql")
    with pytest.raises(MigrationError, match="two migrations have version 1"):
        load_migrations(tmp_path)


# -- the CLI ----------------------------------------------------------------------------


def test_mga_cli_bad_targets_exit_2_and_touch_nothing(empty_schema: tuple[str, str]) -> None:
    from click.testing import CliRunner

    from cyclone_dsl.cli.main import cli

    _, dsn = empty_schema
    cyclone = runner(dsn)  # the real command line, for the one-line messages
    for args, detail in [
        (("--target", "20"), "invalid value for --target: 20 is outside 0..19"),
        (
            ("--extension-target", str(LATEST_EXTENSION_VERSION + 1)),
            f"is outside 0..{LATEST_EXTENSION_VERSION}",
        ),
    ]:
        result = cyclone("migrate", *args)
        assert result.returncode == 2, (args, result.stderr)
        assert detail in one_error_line(result), args
    in_process = CliRunner()
    for args, detail in [
        (("--target", "-1"), "-1 is outside 0..19"),
        (("--target", "abc"), "'abc' is not a valid integer"),
        (("--status", "--target", "3"), "--status shows the versions: it takes no target"),
    ]:
        refused = in_process.invoke(cli, ["--dsn", dsn, "migrate", *args])
        assert refused.exit_code == 2, (args, refused.output)
        assert detail in refused.output, args
    status = in_process.invoke(cli, ["--dsn", dsn, "migrate", "--status"])
    assert status.exit_code == 0, status.output
    assert status.output.startswith("schema version 0 (this build: 19)\n")
    assert relations(dsn) == []  # --status and refused targets created nothing


def _password_server(listener: socket.socket, got: list[bytes]) -> None:
    """Answers one startup with a cleartext password request, then refuses it (28P01)."""
    conn, _ = listener.accept()
    with conn:
        while True:
            length, code = struct.unpack("!ii", conn.recv(8))
            if length > 8:
                conn.recv(length - 8)
            if code in (80877103, 80877104):  # SSLRequest, GSSENCRequest: not here
                conn.sendall(b"N")
                continue
            break
        conn.sendall(b"R" + struct.pack("!ii", 8, 3))
        conn.recv(1)
        (size,) = struct.unpack("!i", conn.recv(4))
        got.append(conn.recv(size - 4))
        body = (
            b'SFATAL\x00VFATAL\x00C28P01\x00Mpassword authentication failed for user "app"\x00\x00'
        )
        conn.sendall(b"E" + struct.pack("!i", len(body) + 4) + body)


def _refusing_server() -> tuple[int, list[bytes], socket.socket]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    got: list[bytes] = []
    threading.Thread(target=_password_server, args=(listener, got), daemon=True).start()
    return listener.getsockname()[1], got, listener


def test_mga_a_wrong_password_is_named_without_the_password() -> None:
    secret = "Wr0ng-Pa55w0rd"
    port, got, listener = _refusing_server()
    with listener, pytest.raises(DatabaseUnavailable) as caught:
        migrate(f"postgresql://app:{secret}@127.0.0.1:{port}/app?connect_timeout=3")
    assert got == [secret.encode() + b"\x00"]  # the server did ask for it
    assert caught.value.cause == "authentication_failed"
    assert "password authentication failed" in str(caught.value)
    assert secret not in str(caught.value)

    port, got, listener = _refusing_server()
    with listener:
        result = runner(f"postgresql://app:{secret}@127.0.0.1:{port}/app?connect_timeout=3")(
            "migrate"
        )
    assert result.returncode == 1
    line = one_error_line(result)
    assert "password authentication failed" in line
    assert secret not in result.stderr + result.stdout


# -- the documentation ------------------------------------------------------------------


def test_mga_the_docs_state_the_builds_extension_version() -> None:
    schema_md = (ROOT / "docs/reference/schema.md").read_text(encoding="utf-8")
    cli_md = (ROOT / "docs/reference/cli.md").read_text(encoding="utf-8")
    stated = re.findall(r"`LATEST_EXTENSION_VERSION` is (\d+)", schema_md)
    assert stated == [str(LATEST_EXTENSION_VERSION)]
    assert re.findall(r'"extension_latest": (\d+)', schema_md) == [str(LATEST_EXTENSION_VERSION)]
    assert re.findall(r"this build needs 19 \(extension (\d+)\)", cli_md) == [
        str(LATEST_EXTENSION_VERSION)
    ]


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"version": "3"}, "version"),
        ({"version": 5.5}, "version"),
        ({"version": True}, "version"),
        ({"extension_version": 1.0}, "extension_version"),
        ({"lock_timeout": float("nan")}, "lock_timeout"),
        ({"lock_timeout": 0}, "lock_timeout"),
        ({"lock_timeout": "5"}, "lock_timeout"),
    ],
)
def test_mga_bad_arguments_are_refused_before_anything_is_applied(
    empty_schema: tuple[str, str], options: dict[str, Any], named: str
) -> None:
    _, dsn = empty_schema
    with pytest.raises(InvalidArgument, match=f"^{named} must be"):
        migrate(dsn, **options)
    assert versions(dsn) == (0, 0)


def test_mga_cli_migrate_reports_the_versions_it_found_under_the_lock(
    empty_schema: tuple[str, str],
) -> None:
    """A `cyclone migrate` that waited for another migrator reports the versions that one
    left, not the ones it read before waiting."""
    _, dsn = empty_schema
    outcome: list[Any] = []
    with psycopg.connect(dsn, autocommit=True) as holder:
        lock = "SELECT pg_advisory_lock(%s, hashtext(current_schema()))"
        holder.execute(lock, (LOCK_NAMESPACE,))
        waiting = threading.Thread(
            target=lambda: outcome.append(runner(dsn)("migrate", "--json")), daemon=True
        )
        waiting.start()
        deadline = time.monotonic() + 30
        waiters = (
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND classid = %s::int::oid"
        )
        while holder.execute(waiters, (LOCK_NAMESPACE,)).fetchone() != (1,):
            assert time.monotonic() < deadline, "the command never waited for the lock"
            time.sleep(0.05)
        migrate(holder, version=5)  # the session's lock is taken again, then given back once
        holder.execute(
            "SELECT pg_advisory_unlock(%s, hashtext(current_schema()))", (LOCK_NAMESPACE,)
        )
        waiting.join(60)
    assert outcome and outcome[0].returncode == 0, outcome
    report = json.loads(outcome[0].stdout)
    assert (report["before"], report["version"]) == (5, LATEST_SCHEMA_VERSION)


def test_mga_a_role_that_may_not_read_the_version_tables_gets_a_typed_error(
    role_without_usage: tuple[str, str, str],
) -> None:
    """USAGE on the schema but no SELECT on its tables: the start-up check names the
    missing privilege instead of raising the driver's InsufficientPrivilege."""
    name, admin, role_dsn = role_without_usage
    role = conninfo_to_dict(role_dsn)["user"]
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(
            sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
                sql.Identifier(name), sql.Identifier(role)
            )
        )
    for call in (lambda: versions(role_dsn), lambda: Client(role_dsn)):
        with pytest.raises(DatabaseUnavailable) as caught:
            call()
        assert caught.value.cause == "permission_denied"
        assert "cyclone_schema_version" in str(caught.value)
        assert "\n" not in str(caught.value)
