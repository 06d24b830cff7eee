"""The pytest plugin (registered through the ``pytest11`` entry point).

Fixtures:

``cyclone_admin_dsn``
    (session) a DSN of the test server: ``$CYCLONE_DATABASE_URL``, else the
    embedded server, started on first use and stopped by the last test
    process that leaves (safe under ``pytest -n``).
``cyclone_schema_pool``
    (session) this process's :class:`~cyclone_dsl.testing.schemas.SchemaPool`;
    its schemas are dropped when the session ends.
``cyclone_schema``
    a migrated schema ``cyclone_test_<random>`` with empty tables, from the
    pool: migrated once, emptied (``TRUNCATE … RESTART IDENTITY``) for each
    test that reuses it. The schema of a test that did not pass (its setup,
    call or teardown failed), that changed the schema's structure (beyond tables,
    views and sequences of its own, which are dropped), or that left
    a worker running, is dropped rather than reused. A test that
    needs a schema of its own (unmigrated, at another version) makes it with
    :func:`~cyclone_dsl.testing.schemas.create_schema`.
``cyclone_dsn``
    a DSN whose ``search_path`` is that schema: give it to ``Client`` and
    ``Worker``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator

import pytest

from cyclone_dsl.db.embedded import embedded_database
from cyclone_dsl.testing.schemas import SchemaPool, with_search_path

_REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()
_CHECKED_IN = pytest.StashKey[tuple[SchemaPool, str]]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep each phase's report on the item: ``cyclone_schema`` reuses only a schema whose
    test passed. Its teardown runs before the teardown's report exists (the fixtures that
    use it are torn down first): a schema checked in for reuse whose teardown then failed
    is dropped here."""
    report = yield
    item.stash.setdefault(_REPORTS, {})[report.when] = report
    if report.when == "teardown" and report.failed and _CHECKED_IN in item.stash:
        pool, name = item.stash[_CHECKED_IN]
        pool.discard(name)
    return report


@pytest.fixture(scope="session")
def cyclone_admin_dsn(pytestconfig: pytest.Config) -> str:
    # The server is released when pytest ends, not in the last test's teardown: stopping it
    # waits for its shutdown checkpoint, which took minutes on a busy disk after a suite,
    # and the last test's timeout would count that wait.
    stack = contextlib.ExitStack()
    # Test data need not survive a crash of the machine: no commit waits for a WAL flush,
    # and the stop after the suite syncs nothing.
    url = stack.enter_context(embedded_database(durable=False))
    pytestconfig.add_cleanup(stack.close)
    return url


@pytest.fixture(scope="session")
def cyclone_schema_pool(cyclone_admin_dsn: str) -> Iterator[SchemaPool]:
    pool = SchemaPool(cyclone_admin_dsn)
    yield pool
    pool.close()


@pytest.fixture
def cyclone_schema(
    request: pytest.FixtureRequest, cyclone_schema_pool: SchemaPool
) -> Iterator[str]:
    name = cyclone_schema_pool.checkout()
    yield name
    reports = request.node.stash.get(_REPORTS, {})
    passed = [reports[when].passed for when in ("setup", "call") if when in reports]
    cyclone_schema_pool.checkin(name, reusable=passed == [True, True])
    request.node.stash[_CHECKED_IN] = (cyclone_schema_pool, name)


@pytest.fixture
def cyclone_dsn(cyclone_admin_dsn: str, cyclone_schema: str) -> str:
    return with_search_path(cyclone_admin_dsn, cyclone_schema)
