from __future__ import annotations

from collections.abc import Iterator

import pytest

from cyclone_dsl.testing.schemas import create_schema, drop_schema, with_search_path


@pytest.fixture
def empty_schema(cyclone_admin_dsn: str) -> Iterator[tuple[str, str]]:
    """(schema name, DSN) of a new schema with no migration applied."""
    name = create_schema(cyclone_admin_dsn, migrated=False)
    yield name, with_search_path(cyclone_admin_dsn, name)
    drop_schema(cyclone_admin_dsn, name)


@pytest.fixture
def cyclone_schema(cyclone_admin_dsn: str) -> Iterator[str]:
    """A fresh migrated schema, never a pooled one: these tests move it between versions."""
    name = create_schema(cyclone_admin_dsn)
    yield name
    drop_schema(cyclone_admin_dsn, name)
