"""Applies migrations on one dedicated connection under a session advisory lock.

The lock is taken, the version is read *after* locking, each migration runs
in its own transaction together with the version update, and the lock is
released on the same connection (an unlock that returns false is an error).
The lock key is (namespace, hash of the schema), so migrations of different
schemas of one database do not wait for each other.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, LiteralString

import psycopg
from psycopg.rows import dict_row

from cyclone_dsl.errors import MigrationError, MigrationLockTimeout, SchemaVersionMismatch
from cyclone_dsl.migrate.files import Migration, load_migrations
from cyclone_dsl.sql import Q

log = logging.getLogger("cyclone.migrate")

LOCK_NAMESPACE = 0x0C7C10E  # Cyclone's advisory-lock namespace


def _one(
    conn: psycopg.Connection[Any], query: LiteralString, params: Mapping[str, object] | None = None
) -> dict[str, Any] | None:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(query, params)
        return cur.fetchone() if cur.description else None


def applied_version(conn: psycopg.Connection[Any]) -> int:
    """The schema version recorded in the database (0 when nothing is applied)."""
    row = _one(conn, Q.version_table_exists)
    if row is None or not row["present"]:
        return 0
    version_row = _one(conn, Q.read_version)
    return 0 if version_row is None else int(str(version_row["version"]))


def run_migrations(
    conn: psycopg.Connection[Any],
    *,
    target: int | None,
    lock_timeout_s: float,
    migrations: Sequence[Migration] | None = None,
) -> tuple[int, int]:
    """Bring the schema to ``target`` (default: latest); return (before, after) versions."""
    files = tuple(migrations) if migrations is not None else load_migrations()
    latest = len(files)
    goal = latest if target is None else target
    if not 0 <= goal <= latest:
        raise MigrationError(f"target version {goal} is outside 0..{latest}")
    if not conn.autocommit:
        raise MigrationError("migrate() needs a connection in autocommit mode")
    _lock(conn, lock_timeout_s)
    try:
        conn.execute(Q.create_version_table)
        row = _one(conn, Q.read_version)
        if row is None:
            conn.execute(Q.insert_version, {"version": 0})
            current = 0
        else:
            current = int(str(row["version"]))
        if current > latest:
            raise SchemaVersionMismatch(
                f"the database is at schema version {current}, newer than this build's "
                f"{latest}: upgrade cyclone-dsl before running it against this database"
            )
        before = current
        while current < goal:
            migration = files[current]
            _apply(conn, migration.up, migration, migration.version)
            current = migration.version
        while current > goal:
            migration = files[current - 1]
            _apply(conn, migration.down, migration, migration.version - 1)
            current = migration.version - 1
        return before, current
    finally:
        _unlock(conn)


def _apply(conn: psycopg.Connection[Any], sql: str, migration: Migration, new_version: int) -> None:
    direction = "up" if new_version == migration.version else "down"
    log.info("migration %03d_%s %s", migration.version, migration.name, direction)
    try:
        with conn.transaction():
            if sql:
                # Migration files are trusted text shipped with the package, not user input.
                conn.execute(sql.encode("utf-8"))
            conn.execute(Q.update_version, {"version": new_version})
    except psycopg.Error as exc:
        raise MigrationError(
            f"migration {migration.version:03d}_{migration.name} ({direction}) failed and was "
            f"rolled back: {exc}"
        ) from exc


def _lock(conn: psycopg.Connection[Any], timeout_s: float) -> None:
    conn.execute(Q.set_lock_timeout, {"timeout": f"{max(1, int(timeout_s * 1000))}ms"})
    try:
        conn.execute(Q.migration_lock_try, {"namespace": LOCK_NAMESPACE})
    except psycopg.errors.LockNotAvailable:
        holder = _one(conn, Q.migration_lock_holder, {"namespace": LOCK_NAMESPACE})
        pid = holder["pid"] if holder else "unknown"
        raise MigrationLockTimeout(
            f"the migration lock is held by the session with pid {pid} for over {timeout_s}s; "
            f"wait for it, or end it with pg_terminate_backend({pid}) if it is stuck"
        ) from None
    finally:
        conn.execute(Q.set_lock_timeout, {"timeout": "0"})


def _unlock(conn: psycopg.Connection[Any]) -> None:
    if conn.closed:
        return  # the server released the lock with the session
    row = _one(conn, Q.migration_unlock, {"namespace": LOCK_NAMESPACE})
    if row is None or not row["released"]:
        raise MigrationError("the migration lock was not held at unlock time")


def connect_for_migration(conninfo: str) -> psycopg.Connection[Any]:
    return psycopg.connect(conninfo, autocommit=True, application_name="cyclone-migrate")
