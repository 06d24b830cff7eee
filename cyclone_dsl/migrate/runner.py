"""Applies migrations on one dedicated connection under a session advisory lock.

The lock is taken, the versions are read *after* locking, each migration runs
in its own transaction together with the version update, and the lock is
released on the same connection (an unlock that returns false is an error).
The lock key is (namespace, hash of the schema), so migrations of different
schemas of one database do not wait for each other.

Two tracks share the lock: the core (``cyclone_schema_version``) and, after it, the
extension track (``cyclone_ext_schema_version``), which needs the core at its latest
version. Taking the core below its latest version takes the extension track down to 0
first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, LiteralString, NamedTuple

import attrs
import psycopg
from psycopg.rows import dict_row

from cyclone_dsl.db.diagnose import connect_checked
from cyclone_dsl.db.errors import first_line
from cyclone_dsl.errors import (
    DatabaseUnavailable,
    MigrationError,
    MigrationLockTimeout,
    MigrationPermissionDenied,
    SchemaVersionMismatch,
)
from cyclone_dsl.migrate.files import Migration, load_extension_migrations, load_migrations
from cyclone_dsl.sql import Q

log = logging.getLogger("cyclone.migrate")

LOCK_NAMESPACE = 0x0C7C10E  # Cyclone's advisory-lock namespace

#: The longest one try of a migration waits for a table lock. While an ``ALTER`` waits for
#: its lock, every query on that table queues behind it: a try that cannot get its locks
#: in this time is rolled back, the queue drains, and it tries again (within the call's
#: ``lock_timeout``).
DDL_LOCK_TRY_S = 2.0
#: The pause between two tries, for the queries that queued behind the last one.
DDL_LOCK_PAUSE_S = 0.5

PERMISSION_ADVICE = "run the migrations as a role that owns the schema or has CREATE on it"


class SchemaVersions(NamedTuple):
    """The applied versions of the two tracks (a ``tuple[int, int]``)."""

    core: int
    extension: int


@attrs.frozen
class MigrationOutcome:
    """The versions of both tracks before and after one :func:`apply_migrations`."""

    before: int
    version: int
    extension_before: int
    extension_version: int


@attrs.frozen
class _Track:
    label: str  # "" for the core, "extension " for the extension track
    files: tuple[Migration, ...]
    update: LiteralString


def _one(
    conn: psycopg.Connection[Any], query: LiteralString, params: Mapping[str, object] | None = None
) -> dict[str, Any] | None:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(query, params)
        return cur.fetchone() if cur.description else None


def _version(conn: psycopg.Connection[Any], query: LiteralString) -> int | None:
    row = _one(conn, query)
    return None if row is None else int(str(row["version"]))


def read_versions(conn: psycopg.Connection[Any]) -> SchemaVersions:
    """Both recorded versions (0 for a track with no version table or no row).

    Read-only: creates nothing and takes no lock.
    """
    present = _one(conn, Q.version_tables_exist)
    try:
        core = _version(conn, Q.read_version) if present and present["core"] else None
        ext = _version(conn, Q.read_ext_version) if present and present["extension"] else None
    except psycopg.errors.InsufficientPrivilege as exc:
        raise DatabaseUnavailable(
            f"the role {conn.info.user!r} may not read Cyclone's schema version: "
            f"{first_line(exc)}: grant it SELECT, INSERT, UPDATE and DELETE on Cyclone's "
            f"tables (see the roles in docs/howto/deploy.md)",
            "permission_denied",
        ) from exc
    return SchemaVersions(core or 0, ext or 0)


def applied_version(conn: psycopg.Connection[Any]) -> int:
    """The core schema version recorded in the database (0 when nothing is applied)."""
    return read_versions(conn).core


def apply_migrations(
    conn: psycopg.Connection[Any],
    *,
    target: int | None,
    lock_timeout_s: float,
    extension_target: int | None = None,
    migrations: Sequence[Migration] | None = None,
    extensions: Sequence[Migration] | None = None,
) -> MigrationOutcome:
    """Bring the core to ``target`` (default: latest) and the extension track to
    ``extension_target`` (default: latest when the core goes to its latest, else 0).

    ``migrations`` and ``extensions`` replace the shipped files (tests); a custom core set
    given without ``extensions`` has an empty extension track.
    """
    core_files = tuple(migrations) if migrations is not None else load_migrations()
    if extensions is not None:
        ext_files = tuple(extensions)
    else:
        ext_files = () if migrations is not None else load_extension_migrations()
    latest, ext_latest = len(core_files), len(ext_files)
    goal = latest if target is None else target
    if not 0 <= goal <= latest:
        raise MigrationError(f"target version {goal} is outside 0..{latest}")
    if extension_target is not None:
        if goal != latest:
            raise MigrationError(
                f"an extension version needs the core schema at {latest}, not {goal}: "
                f"the extension track is applied only on the latest core schema"
            )
        if not 0 <= extension_target <= ext_latest:
            raise MigrationError(
                f"extension target version {extension_target} is outside 0..{ext_latest}"
            )
    ext_goal = extension_target if extension_target is not None else 0
    if extension_target is None and goal == latest:
        ext_goal = ext_latest
    if not conn.autocommit:
        raise MigrationError("migrate() needs a connection in autocommit mode")
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        # Each migration commits on its own, under the lock: inside the caller's transaction
        # nothing would be committed when the lock is released.
        raise MigrationError("migrate() needs a connection outside any transaction")
    core = _Track("", core_files, Q.update_version)
    ext = _Track("extension ", ext_files, Q.update_ext_version)
    with _typed("cannot read the session's schema"):
        session = _one(conn, Q.migration_session)
    assert session is not None
    if session["schema"] is None:
        raise MigrationError(
            f"no schema to migrate: no schema on the search_path ({session['search_path']}) "
            f"exists and may be used by this role; create the schema, or grant USAGE and "
            f"CREATE on it"
        )
    with _typed("cannot take the migration lock"):
        _lock(conn, lock_timeout_s, restore=str(session["lock_timeout"]))
    try:
        with _typed("cannot read or create the version tables"):
            current, ext_current = _prepare_version_tables(conn)
        if current > latest:
            raise SchemaVersionMismatch(
                f"the database is at schema version {current}, newer than this build's "
                f"{latest}: upgrade cyclone-dsl before running it against this database"
            )
        if ext_current > ext_latest:
            raise SchemaVersionMismatch(
                f"the database is at extension schema version {ext_current}, newer than this "
                f"build's {ext_latest}: upgrade cyclone-dsl before running it against this "
                f"database"
            )
        before, ext_before = current, ext_current
        ext_first = goal < latest and ext_current > 0
        _check_guards(
            conn,
            [
                *(_downs(ext, ext_current, 0) if ext_first else []),
                *_downs(core, current, goal),
                *_downs(ext, 0 if ext_first else ext_current, ext_goal),
            ],
            lock_timeout_s,
        )
        if ext_first:
            log.warning(
                "the core schema goes down to version %d (below %d): taking the extension "
                "track down from %d to 0 first, which drops its tables",
                goal,
                latest,
                ext_current,
            )
            ext_current = _move(conn, ext, ext_current, 0, lock_timeout_s)
        current = _move(conn, core, current, goal, lock_timeout_s)
        ext_current = _move(conn, ext, ext_current, ext_goal, lock_timeout_s)
    except BaseException:
        _unlock_after_failure(conn)
        raise
    _unlock(conn)
    return MigrationOutcome(before, current, ext_before, ext_current)


def run_migrations(
    conn: psycopg.Connection[Any],
    *,
    target: int | None,
    lock_timeout_s: float,
    migrations: Sequence[Migration] | None = None,
    extension_target: int | None = None,
    extensions: Sequence[Migration] | None = None,
) -> tuple[int, int]:
    """:func:`apply_migrations`, returning the core's (before, after) versions only."""
    outcome = apply_migrations(
        conn,
        target=target,
        lock_timeout_s=lock_timeout_s,
        extension_target=extension_target,
        migrations=migrations,
        extensions=extensions,
    )
    return outcome.before, outcome.version


def _prepare_version_tables(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """Both applied versions, after creating what is missing of the version tables.

    Tables that exist are not created again, so an up-to-date schema needs no CREATE
    privilege: a role that may only read and write rows can call migrate() on start.
    """
    present = _one(conn, Q.version_tables_exist)
    if not (present and present["core"] and present["extension"]):
        conn.execute(Q.create_version_table)
    core = _current(conn, Q.read_version, Q.insert_version, "cyclone_schema_version")
    return core, _current(
        conn, Q.read_ext_version, Q.insert_ext_version, "cyclone_ext_schema_version"
    )


@contextmanager
def _typed(what: str) -> Iterator[None]:
    """The database's errors as typed ones, on one line, saying ``what`` failed."""
    try:
        yield
    except psycopg.errors.InsufficientPrivilege as exc:
        raise MigrationPermissionDenied(f"{what}: {first_line(exc)}: {PERMISSION_ADVICE}") from exc
    except psycopg.Error as exc:
        raise MigrationError(f"{what}: {first_line(exc)}") from exc


def _current(
    conn: psycopg.Connection[Any], read: LiteralString, insert: LiteralString, table: str
) -> int:
    version = _version(conn, read)
    if version is None:
        conn.execute(insert, {"version": 0})
        return 0
    if version < 0:
        raise MigrationError(
            f"{table} records version {version}, which no migration has: the table was "
            f"edited; set it to the version the schema is really at"
        )
    return version


def _downs(track: _Track, current: int, goal: int) -> list[tuple[_Track, Migration]]:
    """The migrations of ``track`` going down from ``current`` to ``goal``, in order."""
    return [(track, track.files[version - 1]) for version in range(current, goal, -1)]


def _check_guards(
    conn: psycopg.Connection[Any], downs: Sequence[tuple[_Track, Migration]], lock_timeout_s: float
) -> None:
    """Run the guard of every down migration about to be applied, in one read-only
    transaction, before the first of them: each migration commits on its own, so a guard
    that refused half-way down would leave the migrations above it undone."""
    guards = [
        (_name(track, migration, "down"), guard)
        for track, migration in downs
        if (guard := migration.down_guard) is not None
    ]
    if not guards:
        return
    with conn.transaction(force_rollback=True):
        conn.execute(Q.read_only_transaction)
        conn.execute(Q.set_migration_lock_timeout, {"timeout": _milliseconds(lock_timeout_s)})
        for name, guard in guards:
            with _typed(f"cannot check whether {name} may apply"):
                try:
                    # Migration files are trusted text shipped with the package.
                    conn.execute(guard.encode("utf-8"))
                except psycopg.errors.RaiseException as exc:
                    raise MigrationError(
                        f"{name} refused: {first_line(exc)} (no migration was applied)"
                    ) from exc


def _milliseconds(seconds: float) -> str:
    """A ``lock_timeout`` setting of ``seconds`` (at least 1 ms: 0 would mean no limit)."""
    return f"{max(1, round(seconds * 1000))}ms"


def _name(track: _Track, migration: Migration, direction: str) -> str:
    return f"{track.label}migration {migration.version:03d}_{migration.name} ({direction})"


def _move(
    conn: psycopg.Connection[Any], track: _Track, current: int, goal: int, lock_timeout_s: float
) -> int:
    while current < goal:
        migration = track.files[current]
        _apply(conn, track, migration.up, migration, migration.version, lock_timeout_s)
        current = migration.version
    while current > goal:
        migration = track.files[current - 1]
        _apply(conn, track, migration.down, migration, migration.version - 1, lock_timeout_s)
        current = migration.version - 1
    return current


def _apply(
    conn: psycopg.Connection[Any],
    track: _Track,
    sql: str,
    migration: Migration,
    new_version: int,
    lock_timeout_s: float,
) -> None:
    """Apply one migration in its own transaction. A table lock it cannot get within
    :data:`DDL_LOCK_TRY_S` rolls the try back: an ``ALTER`` waiting for its lock makes
    every query on that table queue behind it, so it never waits long at once. It tries
    again after a pause, until ``lock_timeout_s`` have passed."""
    direction = "up" if new_version == migration.version else "down"
    # The core's lines start with "migration " (tests count them); the extension's with
    # "extension migration ".
    log.info("%smigration %03d_%s %s", track.label, migration.version, migration.name, direction)
    name = _name(track, migration, direction)
    given_up_at = time.monotonic() + lock_timeout_s
    with _typed(f"{name} failed and was rolled back"):
        while True:
            try_s = max(0.001, min(DDL_LOCK_TRY_S, given_up_at - time.monotonic()))
            try:
                with conn.transaction():
                    conn.execute(Q.set_migration_lock_timeout, {"timeout": _milliseconds(try_s)})
                    if sql:
                        # Migration files are trusted text shipped with the package.
                        conn.execute(sql.encode("utf-8"))
                    conn.execute(track.update, {"version": new_version})
                return
            except psycopg.errors.LockNotAvailable:
                holders = [row[0] for row in conn.execute(Q.long_lock_holders, {"seconds": try_s})]
            if time.monotonic() >= given_up_at:
                raise MigrationLockTimeout(
                    f"{name} waited over {lock_timeout_s:g}s for locks on its tables and was "
                    f"rolled back: {_holding(holders)} them in a transaction; end it "
                    f"(pg_terminate_backend), or migrate again once it is done"
                )
            log.warning(
                "%s could not lock its tables within %.1fs (%s them): trying again",
                name,
                try_s,
                _holding(holders),
            )
            time.sleep(min(DDL_LOCK_PAUSE_S, max(0.0, given_up_at - time.monotonic())))


def _holding(pids: list[int]) -> str:
    if not pids:
        return "another session holds"
    if len(pids) == 1:
        return f"the session with pid {pids[0]} holds"
    return f"the sessions with pids {', '.join(str(pid) for pid in pids)} hold"


def _lock(conn: psycopg.Connection[Any], timeout_s: float, *, restore: str) -> None:
    """Take the migration lock, waiting up to ``timeout_s``; the session's lock_timeout is
    ``restore`` again afterwards."""
    conn.execute(Q.set_lock_timeout, {"timeout": _milliseconds(timeout_s)})
    try:
        conn.execute(Q.migration_lock, {"namespace": LOCK_NAMESPACE})
    except psycopg.errors.LockNotAvailable:
        holder = _one(conn, Q.migration_lock_holder, {"namespace": LOCK_NAMESPACE})
        pid = holder["pid"] if holder else "unknown"
        raise MigrationLockTimeout(
            f"the migration lock is held by the session with pid {pid} for over {timeout_s}s; "
            f"wait for it, or end it with pg_terminate_backend({pid}) if it is stuck"
        ) from None
    finally:
        conn.execute(Q.set_lock_timeout, {"timeout": restore})


def _unlock(conn: psycopg.Connection[Any]) -> None:
    if conn.closed:
        return  # the server released the lock with the session
    with _typed("cannot release the migration lock"):
        row = _one(conn, Q.migration_unlock, {"namespace": LOCK_NAMESPACE})
    if row is None or not row["released"]:
        raise MigrationError("the migration lock was not held at unlock time")


def _unlock_after_failure(conn: psycopg.Connection[Any]) -> None:
    """Release the lock after a failed migration without hiding why it failed."""
    try:
        _unlock(conn)
    except MigrationError as exc:
        log.warning("after a failed migration: %s", exc)


def connect_for_migration(conninfo: str) -> psycopg.Connection[Any]:
    """One autocommit connection, or a typed error (DatabaseUnavailable, InvalidArgument)
    that names the cause without the DSN's password."""
    return connect_checked(conninfo, name="cyclone-migrate")
