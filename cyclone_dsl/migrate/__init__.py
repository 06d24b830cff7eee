"""Schema migrations: :func:`migrate` and the version constants."""

from __future__ import annotations

from typing import Any

import psycopg

from cyclone_dsl.migrate.files import Migration, load_migrations
from cyclone_dsl.migrate.runner import applied_version, connect_for_migration, run_migrations

LATEST_SCHEMA_VERSION = 19
"""The version a full :func:`migrate` of this build records."""

SCHEMA_VERSION_TABLE = "cyclone_schema_version"
"""The table holding the applied schema version (tern's layout: one row, one column)."""


def migrate(
    target: str | psycopg.Connection[Any],
    *,
    version: int | None = None,
    lock_timeout: float = 60.0,
) -> int:
    """Apply pending migrations (or step down to ``version``); return the resulting version.

    ``target`` is a conninfo/URL or an open psycopg connection in autocommit
    mode. Use a direct or session-mode connection: the migration lock is a
    session-level advisory lock, which a transaction-mode pooler would leak.
    Safe to call on every start: an up-to-date schema is a no-op, and
    concurrent callers wait for each other.
    """
    if isinstance(target, str):
        with connect_for_migration(target) as conn:
            return run_migrations(conn, target=version, lock_timeout_s=lock_timeout)[1]
    return run_migrations(target, target=version, lock_timeout_s=lock_timeout)[1]


def schema_version(conninfo: str) -> int:
    """The schema version recorded in the database at ``conninfo`` (0 if none)."""
    with connect_for_migration(conninfo) as conn:
        return applied_version(conn)


__all__ = [
    "LATEST_SCHEMA_VERSION",
    "SCHEMA_VERSION_TABLE",
    "Migration",
    "load_migrations",
    "migrate",
    "schema_version",
]
