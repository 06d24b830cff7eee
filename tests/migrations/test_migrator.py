"""The migrator: idempotence, concurrency, bad file sets, failures, down-migrations, locks;
the extension track and the start-up check ``require_current_schema``."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import psycopg
import pytest

from cyclone_dsl import (
    EXTENSION_VERSION_TABLE,
    LATEST_EXTENSION_VERSION,
    LATEST_SCHEMA_VERSION,
    SCHEMA_VERSION_TABLE,
    migrate,
)
from cyclone_dsl.errors import MigrationError, MigrationLockTimeout, SchemaVersionMismatch
from cyclone_dsl.migrate import (
    load_extension_migrations,
    load_migrations,
    migrate_versions,
    require_current_schema,
    schema_version,
    versions,
)
from cyclone_dsl.migrate.files import SEPARATOR
from cyclone_dsl.migrate.runner import (
    LOCK_NAMESPACE,
    apply_migrations,
    connect_for_migration,
    run_migrations,
)


def version_rows(dsn: str) -> list[tuple[int]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(f"SELECT version FROM {SCHEMA_VERSION_TABLE}").fetchall()


def test_migrate_twice_is_a_no_op(empty_schema: tuple[str, str]) -> None:
    _, dsn = empty_schema
    assert migrate(dsn) == 19
    assert migrate(dsn) == 19
    assert version_rows(dsn) == [(19,)]
    assert schema_version(dsn) == 19
    assert ext_version_rows(dsn) == [(LATEST_EXTENSION_VERSION,)]


def test_eight_concurrent_migrators_make_one_schema(empty_schema: tuple[str, str]) -> None:
    _, dsn = empty_schema
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []
    results: list[int] = []

    def run() -> None:
        barrier.wait()
        try:
            results.append(migrate(dsn))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == [19] * 8
    assert version_rows(dsn) == [(19,)]
    assert ext_version_rows(dsn) == [(LATEST_EXTENSION_VERSION,)]


def _write(folder: Path, name: str, up: str, down: str = "") -> None:
    (folder / name).write_text(f"{up}\n{SEPARATOR}\n{down}\n")


def test_a_gap_or_a_duplicate_is_rejected(tmp_path: Path) -> None:
    _write(tmp_path, "001_a.sql", "SELECT 1")
    _write(tmp_path, "003_c.sql", "SELECT 1")
    with pytest.raises(MigrationError, match="gap"):
        load_migrations(tmp_path)
    _write(tmp_path, "002_b.sql", "SELECT 1")
    _write(tmp_path, "002_bis.sql", "SELECT 1")
    with pytest.raises(MigrationError, match="two migrations have version 2"):
        load_migrations(tmp_path)


def test_a_file_without_separator_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "001_a.sql").write_text("SELECT 1")
    with pytest.raises(MigrationError, match="exactly once"):
        load_migrations(tmp_path)


def test_a_failing_migration_rolls_back_only_itself(
    empty_schema: tuple[str, str], tmp_path: Path
) -> None:
    _, dsn = empty_schema
    _write(tmp_path, "001_ok.sql", "CREATE TABLE t_ok (x int)", "DROP TABLE t_ok")
    _write(tmp_path, "002_bad.sql", "CREATE TABLE t_bad (x int); SELECT 1/0", "DROP TABLE t_bad")
    files = load_migrations(tmp_path)
    with connect_for_migration(dsn) as conn, pytest.raises(MigrationError, match="002_bad"):
        run_migrations(conn, target=None, lock_timeout_s=5, migrations=files)
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT to_regclass('t_ok') IS NOT NULL").fetchone() == (True,)
        assert conn.execute("SELECT to_regclass('t_bad') IS NULL").fetchone() == (True,)
    assert version_rows(dsn) == [(1,)]
    _write(tmp_path, "002_bad.sql", "CREATE TABLE t_bad (x int)", "DROP TABLE t_bad")
    with connect_for_migration(dsn) as conn:
        assert run_migrations(
            conn, target=None, lock_timeout_s=5, migrations=load_migrations(tmp_path)
        ) == (1, 2)


def test_a_newer_database_is_refused(empty_schema: tuple[str, str]) -> None:
    _, dsn = empty_schema
    migrate(dsn)
    with psycopg.connect(dsn) as conn:
        conn.execute(f"UPDATE {SCHEMA_VERSION_TABLE} SET version = 20")
    with pytest.raises(SchemaVersionMismatch, match="newer"):
        migrate(dsn)


def test_lock_timeout_names_the_holder(empty_schema: tuple[str, str]) -> None:
    _, dsn = empty_schema
    with psycopg.connect(dsn, autocommit=True) as holder:
        pid = holder.info.backend_pid
        holder.execute("SELECT pg_advisory_lock(%s, hashtext(current_schema()))", (LOCK_NAMESPACE,))
        with pytest.raises(MigrationLockTimeout, match=str(pid)):
            migrate(dsn, lock_timeout=0.3)
    assert migrate(dsn) == 19


def test_target_out_of_range(empty_schema: tuple[str, str]) -> None:
    _, dsn = empty_schema
    with pytest.raises(MigrationError, match="outside"):
        migrate(dsn, version=20)


def test_down_from_18_refuses_while_paused(cyclone_dsn: str) -> None:
    with psycopg.connect(cyclone_dsn) as conn:
        conn.execute(
            "INSERT INTO cyclone_runs (workflow, def_version, state) VALUES ('w', 'v', 'paused')"
        )
    with pytest.raises(MigrationError, match=r"018_pause_resume .down. refused.*paused"):
        migrate(cyclone_dsn, version=17)
    # Every guard on the way down is checked before the first migration goes down: 19's
    # down (and the extension track's) would have applied before 18's refused.
    assert versions(cyclone_dsn) == (LATEST_SCHEMA_VERSION, LATEST_EXTENSION_VERSION)
    with psycopg.connect(cyclone_dsn) as conn:
        conn.execute("UPDATE cyclone_runs SET state = 'cancelled'")
    assert migrate(cyclone_dsn, version=17) == 17
    assert migrate(cyclone_dsn) == 19


def test_down_from_19_refuses_while_waiting_child(cyclone_dsn: str) -> None:
    with psycopg.connect(cyclone_dsn) as conn:
        run_id = conn.execute(
            "INSERT INTO cyclone_runs (workflow, def_version) VALUES ('w', 'v') RETURNING id"
        ).fetchone()
        assert run_id is not None
        conn.execute(
            "INSERT INTO cyclone_steps (run_id, node, kind, state) "
            "VALUES (%s, 'c', '@child', 'waiting_child')",
            run_id,
        )
    with pytest.raises(MigrationError, match="waiting_child"):
        migrate(cyclone_dsn, version=18)
    # The extension track is not taken down first for a core down that is then refused.
    assert versions(cyclone_dsn) == (LATEST_SCHEMA_VERSION, LATEST_EXTENSION_VERSION)
    with psycopg.connect(cyclone_dsn) as conn:
        conn.execute("UPDATE cyclone_steps SET state = 'cancelled'")
    assert migrate(cyclone_dsn, version=18) == 18


def test_migration_13_repairs_rows_written_by_an_old_api(empty_schema: tuple[str, str]) -> None:
    _, dsn = empty_schema
    migrate(dsn, version=12)
    with psycopg.connect(dsn) as conn:
        run_id = conn.execute(
            "INSERT INTO cyclone_runs (workflow, def_version) VALUES ('w', 'v') RETURNING id"
        ).fetchone()
        assert run_id is not None
        conn.execute(
            "INSERT INTO cyclone_steps (run_id, node, kind, unique_key, sequence_key, "
            "max_attempts) VALUES (%s, 'n', 'k', '', '', 0)",
            run_id,
        )
    migrate(dsn, version=13)
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT unique_key, sequence_key, max_attempts FROM cyclone_steps"
        ).fetchone()
    assert row == (None, None, 1)


def test_migration_4_changes_only_the_default(empty_schema: tuple[str, str]) -> None:
    _, dsn = empty_schema
    migrate(dsn, version=3)
    with psycopg.connect(dsn) as conn:
        run_id = conn.execute(
            "INSERT INTO cyclone_runs (workflow, def_version) VALUES ('w', 'v') RETURNING id"
        ).fetchone()
        assert run_id is not None
        conn.execute("INSERT INTO cyclone_steps (run_id, node, kind) VALUES (%s, 'a', 'k')", run_id)
    migrate(dsn, version=4)
    with psycopg.connect(dsn) as conn:
        conn.execute("INSERT INTO cyclone_steps (run_id, node, kind) VALUES (%s, 'b', 'k')", run_id)
        rows = conn.execute("SELECT node, max_attempts FROM cyclone_steps ORDER BY node").fetchall()
    assert rows == [("a", 25), ("b", 5)]


# -- the extension track ---------------------------------------------------------------


def ext_version_rows(dsn: str) -> list[tuple[int]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(f"SELECT version FROM {EXTENSION_VERSION_TABLE}").fetchall()


def present(dsn: str, *relations: str) -> dict[str, bool]:
    with psycopg.connect(dsn) as conn:
        return {
            r: bool(conn.execute("SELECT to_regclass(%s) IS NOT NULL", (r,)).fetchone() == (True,))
            for r in relations
        }


EXT_TABLES = (
    "cyclone_ext_workers",
    "cyclone_ext_worker_handlers",
    "cyclone_ext_worker_versions",
    "cyclone_ext_attempts",
    "cyclone_ext_fan_out_limits",
    "cyclone_ext_limits",
    "cyclone_ext_slots",
    "cyclone_ext_gates",
    "cyclone_ext_debounce",
    "cyclone_ext_guards",
    "cyclone_ext_forks",
    "cyclone_ext_events",
    "cyclone_ext_event_seqs",
    "cyclone_ext_event_counts",
    "cyclone_ext_trace_context",
    "cyclone_ext_due_wakes",
    "cyclone_ext_scan_marks",
)


def applied(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The migration lines logged so far ("migration 001_x up", "extension migration ...")."""
    return [r.getMessage() for r in caplog.records if "migration 0" in r.getMessage()]


def test_the_core_then_the_extension_track_in_order(
    empty_schema: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    _, dsn = empty_schema
    caplog.set_level(logging.INFO, logger="cyclone.migrate")
    assert migrate_versions(dsn) == (LATEST_SCHEMA_VERSION, LATEST_EXTENSION_VERSION)
    core = [f"migration {m.version:03d}_{m.name} up" for m in load_migrations()]
    ext = [f"extension migration {m.version:03d}_{m.name} up" for m in load_extension_migrations()]
    assert applied(caplog) == core + ext
    assert version_rows(dsn) == [(19,)]
    assert ext_version_rows(dsn) == [(LATEST_EXTENSION_VERSION,)]
    assert versions(dsn) == (19, LATEST_EXTENSION_VERSION)
    assert all(present(dsn, *EXT_TABLES).values())


def test_a_rerun_applies_nothing(
    empty_schema: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    _, dsn = empty_schema
    assert migrate_versions(dsn) == (19, LATEST_EXTENSION_VERSION)
    caplog.set_level(logging.INFO, logger="cyclone.migrate")
    caplog.clear()
    assert migrate_versions(dsn) == (19, LATEST_EXTENSION_VERSION)
    assert migrate(dsn, version=19) == 19
    assert applied(caplog) == []
    assert version_rows(dsn) == [(19,)]
    assert ext_version_rows(dsn) == [(LATEST_EXTENSION_VERSION,)]


def test_extension_version_moves_only_the_extension_track(
    empty_schema: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    _, dsn = empty_schema
    assert migrate_versions(dsn, extension_version=1) == (19, 1)
    assert present(dsn, *EXT_TABLES) == {
        "cyclone_ext_workers": True,
        "cyclone_ext_worker_handlers": True,
        "cyclone_ext_worker_versions": True,
        "cyclone_ext_attempts": False,
        "cyclone_ext_fan_out_limits": False,
        "cyclone_ext_limits": False,
        "cyclone_ext_slots": False,
        "cyclone_ext_gates": False,
        "cyclone_ext_debounce": False,
        "cyclone_ext_guards": False,
        "cyclone_ext_forks": False,
        "cyclone_ext_events": False,
        "cyclone_ext_event_seqs": False,
        "cyclone_ext_event_counts": False,
        "cyclone_ext_trace_context": False,
        "cyclone_ext_due_wakes": False,
        "cyclone_ext_scan_marks": False,
    }
    caplog.set_level(logging.INFO, logger="cyclone.migrate")
    assert migrate_versions(dsn) == (19, LATEST_EXTENSION_VERSION)
    assert migrate_versions(dsn, version=19, extension_version=0) == (19, 0)
    assert not any(present(dsn, *EXT_TABLES).values())
    assert applied(caplog) == [
        "extension migration 002_attempts up",
        "extension migration 003_fan_out_limits up",
        "extension migration 004_flow_control up",
        "extension migration 005_conditions up",
        "extension migration 006_forks up",
        "extension migration 007_events up",
        "extension migration 008_trace_context up",
        "extension migration 009_run_slot_waits up",
        "extension migration 010_step_slot_waits up",
        "extension migration 011_due_wakes up",
        "extension migration 012_scan_marks up",
        "extension migration 012_scan_marks down",
        "extension migration 011_due_wakes down",
        "extension migration 010_step_slot_waits down",
        "extension migration 009_run_slot_waits down",
        "extension migration 008_trace_context down",
        "extension migration 007_events down",
        "extension migration 006_forks down",
        "extension migration 005_conditions down",
        "extension migration 004_flow_control down",
        "extension migration 003_fan_out_limits down",
        "extension migration 002_attempts down",
        "extension migration 001_workers down",
    ]
    assert version_rows(dsn) == [(19,)]
    assert ext_version_rows(dsn) == [(0,)]
    assert migrate(dsn, extension_version=2) == 19
    assert versions(dsn) == (19, 2)


def test_extension_version_needs_the_core_at_its_latest(empty_schema: tuple[str, str]) -> None:
    _, dsn = empty_schema
    with pytest.raises(MigrationError, match="needs the core schema at 19, not 18"):
        migrate(dsn, version=18, extension_version=1)
    beyond = LATEST_EXTENSION_VERSION + 1
    with pytest.raises(
        MigrationError,
        match=rf"extension target version {beyond} is outside 0\.\.{LATEST_EXTENSION_VERSION}",
    ):
        migrate(dsn, extension_version=beyond)
    assert versions(dsn) == (0, 0)  # refused before anything ran


def test_a_core_down_below_19_takes_the_extension_track_down_first(
    empty_schema: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    _, dsn = empty_schema
    migrate(dsn)
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO cyclone_ext_workers (id, host, pid, queues, concurrency, "
            "package_version) VALUES ('w', 'h', 1, '{default}', 1, '0')"
        )
    caplog.set_level(logging.INFO, logger="cyclone.migrate")
    assert migrate_versions(dsn, version=18) == (18, 0)
    ext_down = [
        f"extension migration {m.version:03d}_{m.name} down"
        for m in reversed(load_extension_migrations())
    ]
    assert applied(caplog) == [*ext_down, "migration 019_child_runs down"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "the core schema goes down to version 18 (below 19): taking the extension track "
        f"down from {LATEST_EXTENSION_VERSION} to 0 first, which drops its tables"
    ]
    assert not any(present(dsn, *EXT_TABLES).values())
    assert migrate_versions(dsn) == (19, LATEST_EXTENSION_VERSION)
    assert migrate_versions(dsn, version=0) == (0, 0)  # 001's down needs the ext tables gone
    with psycopg.connect(dsn) as conn:
        left = conn.execute(
            "SELECT relname FROM pg_class WHERE relnamespace = current_schema()::regnamespace "
            "ORDER BY 1"
        ).fetchall()
    assert left == [(EXTENSION_VERSION_TABLE,), (SCHEMA_VERSION_TABLE,)]
    assert migrate_versions(dsn) == (19, LATEST_EXTENSION_VERSION)


def test_extension_tables_on_a_core_taken_down_elsewhere_stay(
    empty_schema: tuple[str, str],
) -> None:
    """A build that knows no extension track (the Go build) takes the core to 18 and leaves
    the extension at its latest: migrate() brings the core back and keeps the extension."""
    _, dsn = empty_schema
    migrate(dsn)
    down_19 = load_migrations()[18].down
    with psycopg.connect(dsn) as conn:
        conn.execute(down_19.encode())
        conn.execute(f"UPDATE {SCHEMA_VERSION_TABLE} SET version = 18")
    assert versions(dsn) == (18, LATEST_EXTENSION_VERSION)
    assert migrate_versions(dsn) == (19, LATEST_EXTENSION_VERSION)


def test_a_newer_extension_track_is_refused_by_migrate_but_runs(
    empty_schema: tuple[str, str],
) -> None:
    """migrate() cannot move a track it does not know; a client or worker of the previous
    build still runs on it (extension migrations only add tables: rolling deploys)."""
    _, dsn = empty_schema
    migrate(dsn)
    with psycopg.connect(dsn) as conn:
        conn.execute(
            f"UPDATE {EXTENSION_VERSION_TABLE} SET version = %s", (LATEST_EXTENSION_VERSION + 1,)
        )
    with pytest.raises(
        SchemaVersionMismatch,
        match=f"extension schema version {LATEST_EXTENSION_VERSION + 1}, newer than this "
        f"build's {LATEST_EXTENSION_VERSION}",
    ):
        migrate(dsn)
    assert versions(dsn) == (19, LATEST_EXTENSION_VERSION + 1)
    with psycopg.connect(dsn) as conn:
        require_current_schema(conn)  # no error


def test_a_failing_extension_migration_rolls_back_only_itself(
    empty_schema: tuple[str, str], tmp_path: Path
) -> None:
    _, dsn = empty_schema
    core, ext = tmp_path / "core", tmp_path / "core" / "ext"
    ext.mkdir(parents=True)
    _write(core, "001_base.sql", "CREATE TABLE t_base (x int)", "DROP TABLE t_base")
    _write(ext, "001_ok.sql", "CREATE TABLE t_ext_ok (x int)", "DROP TABLE t_ext_ok")
    _write(ext, "002_bad.sql", "CREATE TABLE t_ext_bad (x int); SELECT 1/0", "DROP TABLE t_ext_bad")
    assert [m.name for m in load_migrations(core)] == ["base"]  # ext/ is not read
    with (
        connect_for_migration(dsn) as conn,
        pytest.raises(MigrationError, match="extension migration 002_bad \\(up\\) failed"),
    ):
        apply_migrations(
            conn,
            target=None,
            lock_timeout_s=5,
            migrations=load_migrations(core),
            extensions=load_extension_migrations(ext),
        )
    assert present(dsn, "t_base", "t_ext_ok", "t_ext_bad") == {
        "t_base": True,
        "t_ext_ok": True,
        "t_ext_bad": False,
    }
    assert version_rows(dsn) == [(1,)]
    assert ext_version_rows(dsn) == [(1,)]


def test_an_extension_file_set_is_checked_like_the_core(tmp_path: Path) -> None:
    _write(tmp_path, "001_a.sql", "SELECT 1")
    _write(tmp_path, "003_c.sql", "SELECT 1")
    with pytest.raises(MigrationError, match="gap"):
        load_extension_migrations(tmp_path)


def test_require_current_schema_on_an_unmigrated_schema(empty_schema: tuple[str, str]) -> None:
    _, dsn = empty_schema
    with psycopg.connect(dsn) as conn:
        with pytest.raises(SchemaVersionMismatch) as raised:
            require_current_schema(conn)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert str(raised.value) == (
        "the database is at schema version 0 (extension 0); this build needs 19 "
        f"(extension {LATEST_EXTENSION_VERSION}): run `cyclone migrate` "
        "(or cyclone_dsl.migrate(dsn))"
    )
    assert present(dsn, SCHEMA_VERSION_TABLE, EXTENSION_VERSION_TABLE) == {
        SCHEMA_VERSION_TABLE: False,
        EXTENSION_VERSION_TABLE: False,
    }  # read-only: nothing was created


def test_require_current_schema_on_a_partly_migrated_schema(
    empty_schema: tuple[str, str],
) -> None:
    _, dsn = empty_schema
    migrate(dsn, extension_version=0)
    with (
        psycopg.connect(dsn, autocommit=True) as conn,
        pytest.raises(SchemaVersionMismatch, match="schema version 19 \\(extension 0\\); this"),
    ):
        require_current_schema(conn)
    migrate(dsn, version=12)
    with (
        psycopg.connect(dsn, autocommit=True) as conn,
        pytest.raises(SchemaVersionMismatch, match="schema version 12 \\(extension 0\\); this"),
    ):
        require_current_schema(conn)


def test_require_current_schema_on_a_current_schema(empty_schema: tuple[str, str]) -> None:
    """Passes, and does not wait for the migration lock that another session holds."""
    _, dsn = empty_schema
    migrate(dsn)
    with psycopg.connect(dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s, hashtext(current_schema()))", (LOCK_NAMESPACE,))
        with psycopg.connect(dsn) as conn:
            conn.execute("SET lock_timeout = '200ms'")
            conn.commit()
            require_current_schema(conn)
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            assert versions(conn) == (LATEST_SCHEMA_VERSION, LATEST_EXTENSION_VERSION)


def test_require_current_schema_refuses_a_newer_core(empty_schema: tuple[str, str]) -> None:
    _, dsn = empty_schema
    migrate(dsn)
    with psycopg.connect(dsn) as conn:
        conn.execute(f"UPDATE {SCHEMA_VERSION_TABLE} SET version = 20")
        conn.commit()
        with pytest.raises(SchemaVersionMismatch) as raised:
            require_current_schema(conn)
    assert str(raised.value) == (
        "the database is at schema version 20, newer than this build's 19: upgrade cyclone-dsl"
    )


def test_concurrent_migrators_share_both_tracks(empty_schema: tuple[str, str]) -> None:
    """Eight threads: half migrate fully, half move the extension track to 1; each sees
    the lock, the core is applied once, the extension track ends at one of the goals."""
    _, dsn = empty_schema
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []
    results: list[tuple[int, int]] = []

    def run(extension: int | None) -> None:
        barrier.wait()
        try:
            results.append(migrate_versions(dsn, extension_version=extension))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(None if i % 2 else 1,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(results) == [(19, 1)] * 4 + [(19, LATEST_EXTENSION_VERSION)] * 4
    assert version_rows(dsn) == [(19,)]
    # The goal of the last lock holder:
    assert ext_version_rows(dsn) in ([(1,)], [(LATEST_EXTENSION_VERSION,)])


def test_cli_migrate_shows_and_moves_both_tracks(empty_schema: tuple[str, str]) -> None:
    from click.testing import CliRunner

    from cyclone_dsl.cli.main import cli

    _, dsn = empty_schema
    runner = CliRunner()

    def run(*args: str) -> str:
        result = runner.invoke(cli, ["--dsn", dsn, "migrate", *args], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.output

    assert json.loads(run("--status", "--json")) == {
        "version": 0,
        "latest": 19,
        "extension_version": 0,
        "extension_latest": LATEST_EXTENSION_VERSION,
    }
    assert run("--extension-target", "1") == "schema version 0 -> 19, extension version 0 -> 1\n"
    assert run("--status") == (
        f"schema version 19 (this build: 19)\nextension version 1 (this build: "
        f"{LATEST_EXTENSION_VERSION})\n"
    )
    assert json.loads(run("--json")) == {
        "before": 19,
        "version": 19,
        "extension_before": 1,
        "extension_version": LATEST_EXTENSION_VERSION,
    }
    assert run() == f"schema version at 19, extension version at {LATEST_EXTENSION_VERSION}\n"
    assert run("--target", "18") == (
        f"schema version 19 -> 18, extension version {LATEST_EXTENSION_VERSION} -> 0\n"
    )
    refused = runner.invoke(
        cli, ["--dsn", dsn, "migrate", "--target", "18", "--extension-target", "1"]
    )
    assert refused.exit_code == 2  # bad usage, refused before connecting
    assert "needs the core schema at its latest (19)" in refused.output
