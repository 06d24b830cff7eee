"""Fresh, migrated schemas for tests: ``cyclone_test_<random>``, dropped afterwards."""

from __future__ import annotations

import secrets
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cyclone_dsl.migrate import migrate


def with_search_path(dsn: str, schema: str) -> str:
    """``dsn`` with its ``search_path`` set to ``schema`` (other options kept)."""
    params: dict[str, Any] = conninfo_to_dict(dsn)
    options = str(params.get("options") or "")
    params["options"] = f"{options} -c search_path={schema}".strip()
    return make_conninfo("", **params)


def new_schema_name() -> str:
    return f"cyclone_test_{secrets.token_hex(6)}"


def create_schema(admin_dsn: str, *, migrated: bool = True, version: int | None = None) -> str:
    """Create a new schema (migrated unless ``migrated=False``); return its name."""
    name = new_schema_name()
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    if migrated:
        migrate(with_search_path(admin_dsn, name), version=version)
    return name


def drop_schema(admin_dsn: str, name: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))
