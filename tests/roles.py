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
from tests.waiting import wait_until


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


@contextmanager
def application_role(
    admin_dsn: str, schema: str, *, connection_limit: int | None = None, prefix: str = "app"
) -> Iterator[tuple[str, str]]:
    """(a DSN, the role's name) of a new login role with the grants deploy.md lists for
    an application, and no more: USAGE on ``schema``; SELECT, INSERT, UPDATE and DELETE on
    its tables; USAGE on its sequences; at most ``connection_limit`` sessions if given. At
    the end its sessions are ended (and waited for) and it is dropped."""
    role = f"{prefix}_role_{secrets.token_hex(4)}"
    name, space = sql.Identifier(role), sql.Identifier(schema)
    limit: sql.Composable = sql.SQL("")
    if connection_limit is not None:
        limit = sql.SQL(" CONNECTION LIMIT {}").format(sql.Literal(connection_limit))
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN{}").format(name, limit))
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(space, name))
        conn.execute(
            sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {} TO {}").format(
                space, name
            )
        )
        conn.execute(sql.SQL("GRANT USAGE ON ALL SEQUENCES IN SCHEMA {} TO {}").format(space, name))
    params: dict[str, Any] = conninfo_to_dict(with_search_path(admin_dsn, schema))
    params["user"] = role
    try:
        yield make_conninfo("", **params), role
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
            wait_until(
                lambda: (
                    conn.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE usename = %s", (role,)
                    ).fetchone()
                    == (0,)
                ),
                what="the role's sessions to end",
            )
            conn.execute(sql.SQL("DROP OWNED BY {}").format(name))
            conn.execute(sql.SQL("DROP ROLE {}").format(name))
