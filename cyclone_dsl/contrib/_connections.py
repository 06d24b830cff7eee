"""A framework's own psycopg connection, made fit for the engine's statements.

Frameworks configure the connections they own: Django loads ``jsonb`` as text
(its JSONField decodes it) and ``timestamptz`` in its own zone, naive when
``USE_TZ`` is off; SQLAlchemy can plug its own JSON decoder. The engine reads
what it wrote (a child run's input, for one) and expects psycopg's defaults:
while it runs on such a connection, the loaders of the types it reads are
psycopg's, and the framework's are put back afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psycopg  # noqa: TID251 - the framework hands over its psycopg connection
from psycopg.abc import Loader  # noqa: TID251

from cyclone_dsl.db.callers import Connection

#: The types the engine reads whose loaders frameworks are known to replace.
ENGINE_TYPES = ("json", "jsonb", "timestamptz", "timestamp", "interval", "numeric")


@contextlib.contextmanager
def engine_loaders(conn: Connection) -> Iterator[Connection]:
    """psycopg's default loaders on ``conn`` for the engine's types, inside the block."""
    replaced: list[tuple[int, type[Loader]]] = []
    for name in ENGINE_TYPES:
        oid = psycopg.adapters.types[name].oid
        for fmt in (psycopg.pq.Format.TEXT, psycopg.pq.Format.BINARY):
            default = psycopg.adapters.get_loader(oid, fmt)
            current = conn.adapters.get_loader(oid, fmt)
            if default is not None and current is not None and current is not default:
                replaced.append((oid, current))
                conn.adapters.register_loader(oid, default)
    try:
        yield conn
    finally:
        for oid, loader in replaced:
            conn.adapters.register_loader(oid, loader)


def psycopg_connection(conn: object, needs: str) -> Connection:
    """``conn`` if it is a synchronous psycopg 3 connection; else a TypeError saying what the
    integration ``needs``."""
    if not isinstance(conn, psycopg.Connection):
        raise TypeError(
            f"Cyclone submits on the application's psycopg 3 connection, so it needs {needs}; "
            f"got a {type(conn).__module__}.{type(conn).__qualname__}"
        )
    return conn
