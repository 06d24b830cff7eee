"""A framework's own psycopg connection, checked before the engine runs on it.

Frameworks configure the connections they own (Django loads ``jsonb`` as text): the
engine's statements on them use psycopg's own cursor class and the engine's adapters
anyway (see :class:`cyclone_dsl.db.callers.CallersTx`), so any psycopg 3 connection will
do (not one in pipeline mode).
"""

from __future__ import annotations

import psycopg  # noqa: TID251 - the framework hands over its psycopg connection

from cyclone_dsl.db.callers import Connection


def psycopg_connection(conn: object, needs: str) -> Connection:
    """``conn`` if it is a synchronous psycopg 3 connection; else a TypeError saying what the
    integration ``needs``."""
    if not isinstance(conn, psycopg.Connection):
        raise TypeError(
            f"Cyclone submits on the application's psycopg 3 connection, so it needs {needs}; "
            f"got a {type(conn).__module__}.{type(conn).__qualname__}"
        )
    return conn
