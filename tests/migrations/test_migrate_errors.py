"""migrate() raises typed errors for what a user can meet, never the driver's own.

A role without the privilege a migration needs, a schema newer than this build, a
migration that fails, a server that is down: each is a CycloneError whose one-line
message names the migration (or the version tables) and what to do.
"""

from __future__ import annotations

import psycopg
import pytest

from cyclone_dsl import DatabaseUnavailable, migrate
from cyclone_dsl.errors import MigrationError, MigrationPermissionDenied, SchemaVersionMismatch
from cyclone_dsl.migrate import versions
from tests.roles import limited_role


def test_a_role_that_may_not_create_gets_a_typed_error(
    cyclone_admin_dsn: str, empty_schema: tuple[str, str]
) -> None:
    name, _ = empty_schema
    with (
        limited_role(cyclone_admin_dsn, name) as dsn,
        pytest.raises(MigrationPermissionDenied) as caught,
    ):
        migrate(dsn)
    assert str(caught.value) == (
        f"cannot read or create the version tables: permission denied for schema {name}: "
        "run the migrations as a role that owns the schema or has CREATE on it"
    )
    assert isinstance(caught.value.__cause__, psycopg.errors.InsufficientPrivilege)


def test_a_migration_the_role_may_not_apply_is_named_and_rolled_back(
    cyclone_admin_dsn: str, empty_schema: tuple[str, str]
) -> None:
    name, admin = empty_schema
    migrate(admin, version=18)
    with limited_role(cyclone_admin_dsn, name, select=True) as dsn:
        with pytest.raises(MigrationPermissionDenied, match=r"^migration 019_child_runs \(up\)"):
            migrate(dsn)
        assert versions(dsn) == (18, 0)


def test_an_up_to_date_schema_needs_no_create_privilege(
    cyclone_admin_dsn: str, empty_schema: tuple[str, str]
) -> None:
    """migrate() on every start is a no-op for a role that may only use the rows."""
    name, admin = empty_schema
    latest = migrate(admin)
    with limited_role(cyclone_admin_dsn, name, select=True) as dsn:
        assert migrate(dsn) == latest


def test_a_failed_migration_is_a_migration_error_that_names_it(
    empty_schema: tuple[str, str],
) -> None:
    _, dsn = empty_schema
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE cyclone_runs (id int)")
    with pytest.raises(MigrationError) as caught:
        migrate(dsn)
    assert type(caught.value) is MigrationError
    assert str(caught.value) == (
        "migration 001_initial_schema (up) failed and was rolled back: relation "
        '"cyclone_runs" already exists'
    )
    assert versions(dsn) == (0, 0)


def test_a_newer_schema_is_refused_with_what_to_do(empty_schema: tuple[str, str]) -> None:
    _, dsn = empty_schema
    migrate(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE cyclone_schema_version SET version = 99")
    with pytest.raises(SchemaVersionMismatch, match="newer than this build's 19: upgrade"):
        migrate(dsn)


def test_a_server_that_is_down_is_database_unavailable() -> None:
    with pytest.raises(DatabaseUnavailable) as caught:
        migrate("postgresql://app:s3cret@127.0.0.1:1/app?connect_timeout=3")
    assert caught.value.cause == "connection_refused"
    assert "s3cret" not in str(caught.value)
