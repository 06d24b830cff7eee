"""A login role with only the privileges a test grants it, dropped afterwards."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cyclone_dsl.testing.schemas import with_search_path


@contextmanager
def limited_role(admin_dsn: str, schema: str, *, select: bool = False) -> Iterator[str]:
    """A DSN for a new role that may use ``schema`` (not create in it) and, with
    ``select``, read and write the rows of its tables; the role goes at the end."""
    role = f"cyclone_test_role_{secrets.token_hex(4)}"
    name, space = sql.Identifier(role), sql.Identifier(schema)
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(name))
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(space, name))
        if select:
            conn.execute(
                sql.SQL(
                    "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {} TO {}"
                ).format(space, name)
            )
    params: dict[str, Any] = conninfo_to_dict(with_search_path(admin_dsn, schema))
    params["user"] = role
    try:
        yield make_conninfo("", **params)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(name))
            conn.execute(sql.SQL("DROP ROLE {}").format(name))
