"""The pytest plugin (registered through the ``pytest11`` entry point).

Fixtures:

``cyclone_admin_dsn``
    (session) a DSN of the test server: ``$CYCLONE_DATABASE_URL``, else the
    embedded server, started on first use and stopped by the last test
    process that leaves (safe under ``pytest -n``).
``cyclone_schema``
    a fresh schema ``cyclone_test_<random>`` with every migration applied,
    dropped after the test.
``cyclone_dsn``
    a DSN whose ``search_path`` is that schema: give it to ``Client`` and
    ``Worker``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cyclone_dsl.db.embedded import embedded_database
from cyclone_dsl.testing.schemas import create_schema, drop_schema, with_search_path


@pytest.fixture(scope="session")
def cyclone_admin_dsn() -> Iterator[str]:
    with embedded_database() as url:
        yield url


@pytest.fixture
def cyclone_schema(cyclone_admin_dsn: str) -> Iterator[str]:
    name = create_schema(cyclone_admin_dsn)
    yield name
    drop_schema(cyclone_admin_dsn, name)


@pytest.fixture
def cyclone_dsn(cyclone_admin_dsn: str, cyclone_schema: str) -> str:
    return with_search_path(cyclone_admin_dsn, cyclone_schema)
