"""The migrator: idempotence, concurrency, bad file sets, failures, down-migrations, locks."""

from __future__ import annotations

import threading
from pathlib import Path

import psycopg
import pytest

from cyclone_dsl import SCHEMA_VERSION_TABLE, migrate
from cyclone_dsl.errors import MigrationError, MigrationLockTimeout, SchemaVersionMismatch
from cyclone_dsl.migrate import load_migrations, schema_version
from cyclone_dsl.migrate.files import SEPARATOR
from cyclone_dsl.migrate.runner import LOCK_NAMESPACE, connect_for_migration, run_migrations


def version_rows(dsn: str) -> list[tuple[int]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(f"SELECT version FROM {SCHEMA_VERSION_TABLE}").fetchall()


def test_migrate_twice_is_a_no_op(empty_schema: tuple[str, str]) -> None:
    _, dsn = empty_schema
    assert migrate(dsn) == 19
    assert migrate(dsn) == 19
    assert version_rows(dsn) == [(19,)]
    assert schema_version(dsn) == 19


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
    with pytest.raises(MigrationError, match="paused"):
        migrate(cyclone_dsn, version=17)
    assert schema_version(cyclone_dsn) == 18  # 19's down applied, 18's refused
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
    assert schema_version(cyclone_dsn) == 19
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
