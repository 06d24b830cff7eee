"""Fixtures of the framework tests: the application's own table next to Cyclone's.

The application's ``orders`` table lives in a schema of its own, made once per test
module; ``app_dsn`` puts it on the ``search_path`` after the test's Cyclone schema, so a
framework connection sees both, as an application's would, and the Cyclone schema stays
reusable (its structure is left alone).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from cyclone_dsl.testing.schemas import drop_schema, with_search_path


@pytest.fixture(scope="module")
def app_schema(cyclone_admin_dsn: str) -> Iterator[str]:
    name = f"fw_app_{secrets.token_hex(6)}"
    with psycopg.connect(cyclone_admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
        conn.execute(
            sql.SQL(
                "CREATE TABLE {} (id bigserial PRIMARY KEY, sku text NOT NULL, qty int NOT NULL)"
            ).format(sql.Identifier(name, "orders"))
        )
    yield name
    drop_schema(cyclone_admin_dsn, name)


@pytest.fixture
def app_dsn(cyclone_admin_dsn: str, cyclone_schema: str, app_schema: str) -> str:
    """A DSN that sees the test's Cyclone tables and an empty ``orders`` table."""
    with psycopg.connect(cyclone_admin_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("TRUNCATE {} RESTART IDENTITY").format(sql.Identifier(app_schema, "orders"))
        )
    return with_search_path(cyclone_admin_dsn, f"{cyclone_schema},{app_schema}")
