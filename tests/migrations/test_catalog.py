"""After all 19 migrations the catalog is exactly the schema reference's."""

from __future__ import annotations

import re
from typing import Any

import psycopg
import pytest

from cyclone_dsl import LATEST_SCHEMA_VERSION, migrate
from cyclone_dsl.migrate import load_migrations
from tests.migrations import expected_schema as expected
from tests.migrations.catalog import read_catalog


@pytest.fixture
def catalog(cyclone_dsn: str, cyclone_schema: str) -> dict[str, Any]:
    with psycopg.connect(cyclone_dsn) as conn:
        return read_catalog(conn, cyclone_schema)


def test_latest_version_matches_the_files() -> None:
    assert len(load_migrations()) == LATEST_SCHEMA_VERSION == 19


@pytest.mark.parametrize("table", sorted(expected.TABLES))
def test_table_columns(catalog: dict[str, Any], table: str) -> None:
    assert catalog["columns"].get(table) is not None, f"{table} is missing"
    actual = sorted(catalog["columns"][table])
    assert actual == sorted(expected.TABLES[table])


def test_no_extra_tables(catalog: dict[str, Any]) -> None:
    assert set(catalog["columns"]) == set(expected.TABLES)


def test_defaults(catalog: dict[str, Any]) -> None:
    wrong = {
        key: (catalog["defaults"].get(key), default)
        for key, default in expected.DEFAULTS.items()
        if catalog["defaults"].get(key) != default
    }
    assert wrong == {}
    for table in ("cyclone_runs", "cyclone_steps", "cyclone_signals"):
        assert "now()" in catalog["defaults"][(table, "created_at")]


def test_primary_and_foreign_keys(catalog: dict[str, Any]) -> None:
    assert catalog["primary_keys"] == expected.PRIMARY_KEYS
    assert catalog["foreign_keys"] == expected.FOREIGN_KEYS
    unique = [d for _, (t, _, d) in catalog["constraints"].items() if t == "u"]
    assert any("UNIQUE (run_id, node)" in d for d in unique)


def test_check_constraints(catalog: dict[str, Any]) -> None:
    checks = {n: d for n, (t, _, d) in catalog["constraints"].items() if t == "c"}
    assert set(checks) >= expected.CHECKS
    step_states = set(re.findall(r"'(\w+)'", checks["cyclone_steps_state_check"]))
    assert step_states == expected.STEP_STATES
    run_states = set(re.findall(r"'(\w+)'", checks["cyclone_runs_state_check"]))
    assert run_states == expected.RUN_STATES
    assert "256" in checks["cyclone_steps_queue_check"]
    assert "max_attempts >= 1" in checks["cyclone_steps_max_attempts_check"]


def test_indexes(catalog: dict[str, Any]) -> None:
    problems = []
    for name, (table, unique, fragment) in expected.INDEXES.items():
        actual = catalog["indexes"].get(name)
        if actual is None:
            problems.append(f"{name} missing")
            continue
        actual_table, definition = actual
        if actual_table != table or ("UNIQUE" in definition) != unique:
            problems.append(f"{name}: {definition}")
        if fragment not in definition:
            problems.append(f"{name} lacks {fragment!r}: {definition}")
    assert problems == []


def test_views(catalog: dict[str, Any]) -> None:
    assert set(catalog["views"]) == set(expected.VIEWS)
    for view, columns in expected.VIEWS.items():
        assert columns <= catalog["views"][view], view


def test_hot_tables_have_autovacuum_settings(cyclone_dsn: str) -> None:
    with psycopg.connect(cyclone_dsn) as conn:
        rows = dict(
            conn.execute(
                "SELECT relname, reloptions FROM pg_class "
                "WHERE relnamespace = current_schema()::regnamespace "
                "AND relname IN ('cyclone_steps', 'cyclone_runs', 'cyclone_signals')"
            ).fetchall()
        )
    for table in ("cyclone_steps", "cyclone_runs", "cyclone_signals"):
        assert any("autovacuum_vacuum_scale_factor" in o for o in rows[table]), table


def test_migrating_in_two_parts_gives_the_same_catalog(
    empty_schema: tuple[str, str], catalog: dict[str, Any]
) -> None:
    name, dsn = empty_schema
    assert migrate(dsn, version=7) == 7
    assert migrate(dsn) == 19
    with psycopg.connect(dsn) as conn:
        assert read_catalog(conn, name) == catalog


def test_down_to_zero_and_up_again(empty_schema: tuple[str, str], catalog: dict[str, Any]) -> None:
    name, dsn = empty_schema
    migrate(dsn)
    assert migrate(dsn, version=0) == 0
    with psycopg.connect(dsn) as conn:
        leftover = read_catalog(conn, name)
    assert set(leftover["columns"]) == {"cyclone_schema_version"}
    assert leftover["views"] == {}
    migrate(dsn)
    with psycopg.connect(dsn) as conn:
        assert read_catalog(conn, name) == catalog
