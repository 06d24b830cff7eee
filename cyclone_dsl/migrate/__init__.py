"""Schema migrations: :func:`migrate`, the version constants and the start-up check.

Two tracks of migrations share one advisory lock: the core (versions 1 to 19, the schema
reference's, recorded in ``cyclone_schema_version``) and the extension track (this build's
additive tables, numbered on their own, recorded in ``cyclone_ext_schema_version``). The
extension track is applied after the core, and only on the latest core schema.
"""

from __future__ import annotations

from typing import Any

import psycopg

from cyclone_dsl.db.connect import configure_connection, connection_kwargs
from cyclone_dsl.db.diagnose import connect_checked, parse_dsn
from cyclone_dsl.errors import InvalidArgument, SchemaVersionMismatch
from cyclone_dsl.migrate.files import Migration, load_extension_migrations, load_migrations
from cyclone_dsl.migrate.runner import (
    MigrationOutcome,
    SchemaVersions,
    apply_migrations,
    connect_for_migration,
    read_versions,
)

LATEST_SCHEMA_VERSION = 19
"""The core version a full :func:`migrate` of this build records."""

LATEST_EXTENSION_VERSION = 12
"""The extension-track version a full :func:`migrate` of this build records."""

MAX_LOCK_TIMEOUT_S = 2_147_483
"""The longest wait for the migration lock, in seconds: PostgreSQL's lock_timeout is an int
of milliseconds."""

SCHEMA_VERSION_TABLE = "cyclone_schema_version"
"""The table holding the applied core version (tern's layout: one row, one column)."""

EXTENSION_VERSION_TABLE = "cyclone_ext_schema_version"
"""The table holding the applied extension-track version (the same layout)."""


def migrate(
    target: str | psycopg.Connection[Any],
    *,
    version: int | None = None,
    extension_version: int | None = None,
    lock_timeout: float = 60.0,
) -> int:
    """Apply pending migrations (or step down to ``version``); return the core version.

    ``target`` is a conninfo/URL or an open psycopg connection in autocommit
    mode. Use a direct or session-mode connection: the migration lock is a
    session-level advisory lock, which a transaction-mode pooler would leak.
    Safe to call on every start: an up-to-date schema is a no-op, and
    concurrent callers wait for each other.

    With no ``version`` the core goes to ``LATEST_SCHEMA_VERSION``, then the extension
    track to ``LATEST_EXTENSION_VERSION``. A ``version`` below the latest core version
    takes the extension track down to 0 first (its tables and rows are dropped), then
    the core down. ``extension_version`` moves the extension track to that version; it
    needs the core at its latest version (``version`` unset or ``LATEST_SCHEMA_VERSION``).
    :func:`migrate_versions` does the same and returns both versions.

    ``lock_timeout`` bounds the wait for the migration lock, and each migration's wait
    for its table locks, which it takes in short tries so that the application's queries
    do not queue behind it for long (2 s a try); past it,
    :class:`MigrationLockTimeout` names the sessions in the way.
    """
    return migrate_versions(
        target, version=version, extension_version=extension_version, lock_timeout=lock_timeout
    ).core


def migrate_versions(
    target: str | psycopg.Connection[Any],
    *,
    version: int | None = None,
    extension_version: int | None = None,
    lock_timeout: float = 60.0,
) -> SchemaVersions:
    """:func:`migrate`, returning the resulting ``(core, extension)`` versions."""
    outcome = migrate_outcome(
        target, version=version, extension_version=extension_version, lock_timeout=lock_timeout
    )
    return SchemaVersions(outcome.version, outcome.extension_version)


def migrate_outcome(
    target: str | psycopg.Connection[Any],
    *,
    version: int | None = None,
    extension_version: int | None = None,
    lock_timeout: float = 60.0,
) -> MigrationOutcome:
    """:func:`migrate`, returning both tracks' versions before (read under the migration
    lock) and after."""
    for name, value in (("version", version), ("extension_version", extension_version)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise InvalidArgument(f"{name} must be an int or None, not {value!r}")
    if (
        not isinstance(lock_timeout, int | float)
        or isinstance(lock_timeout, bool)
        or not 0 < lock_timeout <= MAX_LOCK_TIMEOUT_S
    ):
        raise InvalidArgument(
            f"lock_timeout must be a number of seconds above 0 and at most "
            f"{MAX_LOCK_TIMEOUT_S}, not {lock_timeout!r}"
        )
    return _run(target, version, extension_version, lock_timeout)


def _run(
    target: str | psycopg.Connection[Any],
    version: int | None,
    extension_version: int | None,
    lock_timeout: float,
) -> MigrationOutcome:
    if isinstance(target, str):
        with connect_for_migration(target) as conn:
            return _run(conn, version, extension_version, lock_timeout)
    return apply_migrations(
        target, target=version, extension_target=extension_version, lock_timeout_s=lock_timeout
    )


def schema_version(conninfo: str) -> int:
    """The core schema version recorded in the database at ``conninfo`` (0 if none)."""
    return versions(conninfo).core


def versions(target: str | psycopg.Connection[Any]) -> SchemaVersions:
    """The recorded ``(core, extension)`` versions (0 for a track not applied).

    ``target`` is a conninfo/URL or an open connection. Read-only: it creates nothing
    and does not wait for the migration lock.
    """
    if isinstance(target, str):
        with connect_for_migration(target) as conn:
            return read_versions(conn)
    if target.autocommit:
        return read_versions(target)
    with target.transaction():  # leaves the connection as it found it
        return read_versions(target)


def require_current_schema(conn: psycopg.Connection[Any]) -> None:
    """Raise ``SchemaVersionMismatch`` unless the core is at this build's version and the
    extension track at least at this build's (a newer one only added tables).

    Read-only, without the migration lock: a start-up check for clients and workers.
    The message says what to do: run ``cyclone migrate`` for an older schema, upgrade
    cyclone-dsl for a newer one.
    """
    core, ext = versions(conn)
    want, want_ext = LATEST_SCHEMA_VERSION, LATEST_EXTENSION_VERSION
    if core > want:
        raise SchemaVersionMismatch(
            f"the database is at schema version {core}, newer than this build's {want}: "
            f"upgrade cyclone-dsl"
        )
    # An extension schema newer than this build is fine: extension migrations only add
    # tables and indexes, so the previous build keeps running during a rolling deploy.
    if core != want or ext < want_ext:
        raise SchemaVersionMismatch(
            f"the database is at schema version {core} (extension {ext}); this build needs "
            f"{want} (extension {want_ext}): run `cyclone migrate` (or cyclone_dsl.migrate(dsn))"
        )


def check_database(dsn: str, *, name: str = "cyclone-check", pooled: bool = False) -> None:
    """The start-up check of a client or worker: the database answers within a few seconds
    (else :class:`~cyclone_dsl.errors.DatabaseUnavailable` naming the cause) and is migrated
    for this build (else :class:`SchemaVersionMismatch` saying what to run)."""
    with connect_checked(dsn, name=name, pooled=pooled) as conn:
        require_current_schema(conn)


def checked_connection(dsn: str, *, name: str, pooled: bool = False) -> psycopg.Connection[Any]:
    """:func:`check_database`'s check, made on an engine connection (as a pool's) and left
    open: for the pool of the client or worker that checked to take as its first
    (``make_pool(first=...)``), or for the caller's next statements."""
    parse_dsn(dsn)  # an unparsable DSN is InvalidArgument, before the settings read it
    settings = connection_kwargs(dsn, name, pooled=pooled)
    conn = connect_checked(dsn, name=name, pooled=pooled, settings=settings)
    try:
        configure_connection(conn)
        require_current_schema(conn)
    except BaseException:
        conn.close()
        raise
    return conn


__all__ = [
    "EXTENSION_VERSION_TABLE",
    "LATEST_EXTENSION_VERSION",
    "LATEST_SCHEMA_VERSION",
    "SCHEMA_VERSION_TABLE",
    "Migration",
    "SchemaVersions",
    "check_database",
    "checked_connection",
    "load_extension_migrations",
    "load_migrations",
    "migrate",
    "migrate_versions",
    "require_current_schema",
    "schema_version",
    "versions",
]
