"""Audit of the framework integrations and the ``*_tx`` client methods they rely on.

The outbox promise (a run exists iff the application's transaction commits) under the
transaction shapes each framework offers (Django's nested atomics, ``set_rollback``,
``on_commit``; SQLAlchemy's Core connections, nested and async sessions; a FastAPI
dependency that owns the request's transaction), connections configured their own way,
and refused submits, which must leave nothing behind and the transaction usable.

Tests marked ``xfail(strict=True)`` show a finding: the reason says what happens and what
should.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any
from zoneinfo import ZoneInfo

import psycopg
import pytest
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.testclient import TestClient
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus
from psycopg.types.numeric import FloatLoader
from psycopg.types.string import TextLoader
from psycopg_pool import AsyncConnectionPool
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from cyclone_dsl import (
    AsyncClient,
    Client,
    CycloneError,
    InvalidArgument,
    RunNotFound,
    step,
    workflow,
)
from cyclone_dsl.contrib import django as cyclone_django
from cyclone_dsl.contrib import sqlalchemy as cyclone_sa
from cyclone_dsl.contrib.fastapi import CycloneClient, cyclone_lifespan, result_response
from cyclone_dsl.testing.failpoints import FailpointError, arm, disarm
from tests.contrib.shapes import SHAPES, check_activated, counts
from tests.waiting import wait_until


@step(name="cta_work")
def cta_work(x: Any) -> Any:
    return x


@workflow(name="cta_flow")
def cta_flow(x):  # type: ignore[no-untyped-def]
    return cta_work(x)


CHILD = SHAPES["child"]


class Refused(Exception):
    pass


def committed_runs(dsn: str) -> list[tuple[int, Any]]:
    """(id, input) of the committed top-level runs, as another session sees them."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT id, input FROM cyclone_runs WHERE parent_run_id IS NULL ORDER BY id"
        ).fetchall()
    return [(int(row[0]), row[1]) for row in rows]


# -- Django ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def django_settings(cyclone_admin_dsn: str) -> Iterator[None]:
    import django
    from django.conf import settings
    from django.db import connections
    from django.utils.functional import empty

    assert not settings.configured, "another test configured Django in this process"
    settings.configure(
        INSTALLED_APPS=["cyclone_dsl.contrib.django"],
        DATABASES={"default": cyclone_django.database_settings(cyclone_admin_dsn)},
        USE_TZ=True,
    )
    django.setup()
    yield
    connections.close_all()
    cyclone_django.close_client()
    settings._wrapped = empty  # unconfigured again, as before this module


@pytest.fixture
def db(django_settings: None, app_dsn: str) -> Iterator[None]:
    """Django's ``default`` connection on this test's schemas (Cyclone's and the app's)."""
    from django.db import connections

    wrapper = connections["default"]
    wrapper.close()
    saved = dict(wrapper.settings_dict["OPTIONS"])
    wrapper.settings_dict["OPTIONS"] = {**saved, "options": conninfo_to_dict(app_dsn)["options"]}
    cyclone_django.close_client()
    yield
    wrapper.close()
    wrapper.settings_dict["OPTIONS"] = saved
    cyclone_django.close_client()


def insert_order(sku: str) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO orders (sku, qty) VALUES (%s, 1)", [sku])


def test_django_set_rollback_after_the_submit_drops_the_run(
    db: None, app_dsn: str, client: Client
) -> None:
    from django.db import transaction

    with transaction.atomic():
        insert_order("dropped")
        handle = cyclone_django.submit_tx(cta_flow, {"n": 1})
        transaction.set_rollback(True)
    assert counts(app_dsn) == (0, 0)
    with pytest.raises(RunNotFound):
        client.get_run(handle.id)


def test_django_on_commit_sees_the_run_and_a_submit_there_commits_on_its_own(
    db: None, app_dsn: str, client: Client
) -> None:
    from django.db import connection, transaction

    seen: list[str] = []
    later: list[int] = []

    def after_commit() -> None:
        seen.append(client.get_run(handle.id).state.value)
        assert connection.get_autocommit()  # Django runs on_commit callbacks in autocommit
        later.append(cyclone_django.submit_tx(cta_flow, {"n": 2}).id)

    with transaction.atomic():
        insert_order("placed")
        handle = cyclone_django.submit_tx(cta_flow, {"n": 1})
        transaction.on_commit(after_commit)
        assert seen == []
    assert seen == ["running"]
    assert counts(app_dsn) == (1, 2)
    assert [run_id for run_id, _ in committed_runs(app_dsn)] == [handle.id, later[0]]


def test_django_savepoints_nested_three_deep(db: None, app_dsn: str) -> None:
    """A released inner block keeps its run, a rolled-back one drops it, a submit after a
    rolled-back savepoint still joins the outer block."""
    from django.db import transaction

    def refuse_inside() -> None:
        with transaction.atomic():
            cyclone_django.submit_once_tx(cta_flow, "inner", key="inner")
            cyclone_django.enqueue_tx(cta_work, "inner", unique_key="m2")
            raise Refused

    with transaction.atomic():
        outer = cyclone_django.submit_tx(cta_flow, "outer")
        with transaction.atomic():
            middle = cyclone_django.enqueue_tx(cta_work, "middle", unique_key="m")
            with pytest.raises(Refused):
                refuse_inside()
            again = cyclone_django.submit_once_tx(cta_flow, "after", key="inner")
            assert again.created
        insert_order("placed")
    assert counts(app_dsn) == (1, 3)
    assert committed_runs(app_dsn) == [
        (outer.id, "outer"),
        (middle.id, "middle"),
        (again.id, "after"),
    ]


def test_django_a_broken_atomic_block_refuses_the_submit_with_a_typed_error(
    db: None, app_dsn: str
) -> None:
    from django.db import transaction
    from django.db.transaction import TransactionManagementError

    with transaction.atomic():
        insert_order("placed")
        with contextlib.suppress(ValueError), transaction.atomic(savepoint=False):
            raise ValueError  # marks the outer block for rollback
        with pytest.raises(TransactionManagementError):
            cyclone_django.submit_tx(cta_flow, {"n": 1})
    assert counts(app_dsn) == (0, 0)


BAD_SUBMITS: dict[str, Callable[[], object]] = {
    "not JSON": lambda: cyclone_django.submit_tx(cta_flow, {"x": object()}),
    "NUL": lambda: cyclone_django.submit_tx(cta_flow, "a\x00b"),
    "lone surrogate": lambda: cyclone_django.submit_tx(cta_flow, "\ud800"),
    "huge int": lambda: cyclone_django.submit_tx(cta_flow, {"x": 10**30}),
    "nan": lambda: cyclone_django.submit_tx(cta_flow, float("nan")),
    "deadline": lambda: cyclone_django.submit_tx(cta_flow, 1, deadline=timedelta(-1)),
    "empty key": lambda: cyclone_django.submit_once_tx(cta_flow, 1, key=""),
    "unknown workflow": lambda: cyclone_django.submit_tx("cta_no_such_flow", 1),
    "naive scheduled_at": lambda: cyclone_django.enqueue_tx(
        cta_work, 1, scheduled_at=datetime(2030, 1, 1)
    ),
    "priority": lambda: cyclone_django.enqueue_tx(cta_work, 1, priority=2**40),
    "queue": lambda: cyclone_django.enqueue_tx(cta_work, 1, queue=""),
    "max_attempts": lambda: cyclone_django.enqueue_tx(cta_work, 1, max_attempts=0),
    "unique_key NUL": lambda: cyclone_django.enqueue_tx(cta_work, 1, unique_key="a\x00"),
}


def test_django_refused_submits_are_typed_and_leave_the_block_usable(
    db: None, app_dsn: str
) -> None:
    from django.db import connection, transaction

    with transaction.atomic():
        insert_order("first")
        for name, bad in BAD_SUBMITS.items():
            with pytest.raises(CycloneError):
                bad()
            assert connection.connection.info.transaction_status == TransactionStatus.INTRANS, name
        assert not connection.needs_rollback
        insert_order("second")
    assert counts(app_dsn) == (2, 0)


def test_django_connection_settings_survive_submits(db: None, app_dsn: str) -> None:
    """Autocommit, the search path, the session time zone and Django's cursor class are as
    Django set them, after a submit in autocommit mode, a failed one and one in a block."""
    from django.db import connection, transaction

    def state() -> tuple[object, ...]:
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('search_path'), current_setting('TimeZone')")
            settings = cursor.fetchone()
        raw = connection.connection
        return (connection.get_autocommit(), raw.autocommit, raw.cursor_factory, *settings)

    before = state()
    cyclone_django.submit_tx(cta_flow, 1)
    assert state() == before
    arm("child.after_insert", "raise")
    try:
        with pytest.raises(FailpointError):
            cyclone_django.submit_tx(CHILD.workflow, CHILD.input)
    finally:
        disarm()
    assert state() == before
    assert connection.connection.info.transaction_status == TransactionStatus.IDLE
    with transaction.atomic():
        cyclone_django.submit_tx(CHILD.workflow, CHILD.input)
    assert state() == before
    assert counts(app_dsn) == (0, 3)


@pytest.fixture
def django_local_time(db: None) -> Iterator[None]:
    """Django with ``USE_TZ = False`` in a zone with daylight saving: its connection's
    session time zone is that zone, and it reads timestamps naive."""
    from django.db import connections
    from django.test import override_settings

    connections["default"].close()
    with override_settings(USE_TZ=False, TIME_ZONE="America/Chicago"):
        yield
        connections["default"].close()


def test_django_without_use_tz_keeps_what_cyclone_reads_and_writes(
    django_local_time: None, app_dsn: str, client: Client
) -> None:
    from django.db import connection, transaction

    at = datetime(2031, 1, 2, 3, 4, 5, tzinfo=UTC)
    with transaction.atomic():
        parent = cyclone_django.submit_tx(CHILD.workflow, CHILD.input)
        queued = cyclone_django.enqueue_tx(cta_work, {"n": 1}, scheduled_at=at)
        with connection.cursor() as cursor:
            cursor.execute("SELECT '2030-01-02 03:04:05+00'::timestamptz")
            mine = cursor.fetchone()[0]
    assert mine == datetime(2030, 1, 1, 21, 4, 5)  # Django's own read: naive, local
    check_activated(client, parent.id, "child")
    assert client.get_run(queued.id).step("cta_work").scheduled_at == at


def _days_across_one_dst_change(zone: ZoneInfo) -> int:
    now = datetime.now(UTC)
    offset = now.astimezone(zone).utcoffset()
    return next(
        days
        for days in range(1, 367)
        if (now + timedelta(days=days)).astimezone(zone).utcoffset() != offset
    )


def test_django_without_use_tz_a_deadline_is_an_exact_duration(
    django_local_time: None, app_dsn: str, client: Client
) -> None:
    from django.db import transaction

    days = _days_across_one_dst_change(ZoneInfo("America/Chicago"))
    with transaction.atomic():
        handle = cyclone_django.submit_tx(cta_flow, 1, deadline=timedelta(days=days))
    run = client.get_run(handle.id)
    assert run.deadline_at is not None
    off = (run.deadline_at - run.created_at) - timedelta(days=days)
    assert abs(off) < timedelta(seconds=60), f"the deadline is off by {off}"


# -- SQLAlchemy --------------------------------------------------------------------------


@pytest.fixture
def engine(app_dsn: str) -> Iterator[Engine]:
    engine = create_engine("postgresql+psycopg://", connect_args=conninfo_to_dict(app_dsn))
    yield engine
    engine.dispose()


def test_sqlalchemy_core_connection_commit_as_you_go(
    engine: Engine, app_dsn: str, client: Client
) -> None:
    with engine.connect() as conn:
        handle = cyclone_sa.submit_tx(conn, client, cta_flow, {"n": 1})
        conn.commit()
    assert committed_runs(app_dsn) == [(handle.id, {"n": 1})]


def test_sqlalchemy_core_connection_closed_without_commit_drops_the_run(
    engine: Engine, app_dsn: str, client: Client
) -> None:
    with engine.connect() as conn:
        conn.execute(text("INSERT INTO orders (sku, qty) VALUES ('dropped', 1)"))
        cyclone_sa.submit_tx(conn, client, cta_flow, {"n": 1})
    assert counts(app_dsn) == (0, 0)


def test_sqlalchemy_begin_nested_rollback_takes_only_its_runs(
    engine: Engine, app_dsn: str, client: Client
) -> None:
    with Session(engine) as session, session.begin():
        session.execute(text("INSERT INTO orders (sku, qty) VALUES ('kept', 1)"))
        kept = cyclone_sa.submit_tx(session, client, cta_flow, "kept")
        nested = session.begin_nested()
        cyclone_sa.submit_once_tx(session, client, cta_flow, "dropped", key="k")
        cyclone_sa.enqueue_tx(session, client, cta_work, "dropped", unique_key="u")
        nested.rollback()
        with session.begin_nested():
            released = cyclone_sa.submit_once_tx(session, client, cta_flow, "released", key="k")
        assert released.created
    assert committed_runs(app_dsn) == [(kept.id, "kept"), (released.id, "released")]
    assert counts(app_dsn) == (1, 2)


def test_sqlalchemy_session_closed_without_commit_drops_the_run(
    engine: Engine, app_dsn: str, client: Client
) -> None:
    session = Session(engine)
    session.execute(text("INSERT INTO orders (sku, qty) VALUES ('dropped', 1)"))
    cyclone_sa.submit_tx(session, client, CHILD.workflow, CHILD.input)
    session.close()
    assert counts(app_dsn) == (0, 0)


def test_sqlalchemy_a_submit_that_fails_half_way_leaves_the_session_usable(
    engine: Engine, app_dsn: str, client: Client
) -> None:
    with Session(engine) as session, session.begin():
        session.execute(text("INSERT INTO orders (sku, qty) VALUES ('placed', 1)"))
        arm("child.after_insert", "raise")
        try:
            with pytest.raises(FailpointError):
                cyclone_sa.submit_tx(session, client, CHILD.workflow, CHILD.input)
        finally:
            disarm()
        with pytest.raises(InvalidArgument):
            cyclone_sa.submit_once_tx(session, client, cta_flow, 1, key="")
        once = cyclone_sa.submit_once_tx(session, client, cta_flow, 1, key="k")
        same = cyclone_sa.submit_once_tx(session, client, cta_flow, 2, key="k")
        assert (same.id, same.created) == (once.id, False)
        assert session.execute(text("SELECT count(*) FROM orders")).scalar_one() == 1
    assert counts(app_dsn) == (1, 1)


def test_sqlalchemy_async_session(app_dsn: str, cyclone_dsn: str) -> None:
    """The helpers take sync sessions only and refuse an AsyncSession with a TypeError; on
    the async session's own psycopg connection, AsyncClient.submit_tx follows the session:
    rolled back with it, committed with it, and the engine's json_deserializer stays the
    session's."""
    aengine = create_async_engine(
        "postgresql+psycopg://",
        connect_args=conninfo_to_dict(app_dsn),
        json_deserializer=lambda raw: {"decoded by": "the app"},
    )

    async def driver(session: AsyncSession) -> psycopg.AsyncConnection[Any]:
        raw = await (await session.connection()).get_raw_connection()
        conn = raw.driver_connection
        assert isinstance(conn, psycopg.AsyncConnection)
        return conn

    async def refused(aclient: AsyncClient) -> None:
        async with AsyncSession(aengine) as session, session.begin():
            await session.execute(text("INSERT INTO orders (sku, qty) VALUES ('no', 1)"))
            await aclient.submit_tx(await driver(session), cta_flow, 1)
            raise Refused

    async def scenario() -> int:
        async with AsyncClient(cyclone_dsn) as aclient:
            with Client(cyclone_dsn) as client:
                async with AsyncSession(aengine) as session:
                    with pytest.raises(TypeError):
                        cyclone_sa.submit_tx(session, client, cta_flow, 1)  # type: ignore[arg-type]
            with pytest.raises(Refused):
                await refused(aclient)
            assert counts(app_dsn) == (0, 0)
            async with AsyncSession(aengine) as session, session.begin():
                await session.execute(text("INSERT INTO orders (sku, qty) VALUES ('yes', 1)"))
                handle = await aclient.submit_tx(await driver(session), CHILD.workflow, CHILD.input)
                mine = (await session.execute(text("""SELECT '{"a": 1}'::jsonb"""))).scalar_one()
                assert mine == {"decoded by": "the app"}
                assert counts(app_dsn) == (0, 0)
            return handle.id

    async def disposed() -> int:
        try:
            return await scenario()
        finally:
            await aengine.dispose()

    run_id = asyncio.run(disposed())
    assert counts(app_dsn) == (1, 2)
    with Client(cyclone_dsn) as client:
        check_activated(client, run_id, "child")


# -- the *_tx methods on a psycopg connection --------------------------------------------


def test_a_callers_connection_keeps_its_settings_and_loaders(app_dsn: str, client: Client) -> None:
    """An application's own loaders (numeric as float, jsonb as text, timestamptz as
    text), isolation level and session settings: the engine reads as it always does (a
    child run's input is intact), and the application's statements, in the same
    transaction and after it, see its own configuration."""
    with psycopg.connect(app_dsn) as conn:
        conn.adapters.register_loader("numeric", FloatLoader)
        conn.adapters.register_loader("jsonb", TextLoader)
        conn.adapters.register_loader("timestamptz", TextLoader)
        conn.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
        probe = """SELECT 1.5::numeric, '{"a": 1}'::jsonb, '2030-01-02 03:04:05+00'::timestamptz,
                  current_setting('transaction_isolation'), current_setting('synchronous_commit'),
                  current_setting('search_path'), current_setting('TimeZone'),
                  current_setting('lock_timeout'), current_setting('statement_timeout')"""

        def state() -> tuple[object, ...]:
            row = conn.execute(probe).fetchone()
            assert row is not None
            return (conn.autocommit, conn.isolation_level, conn.prepare_threshold, *row)

        before = state()
        assert before[3:6] == (1.5, '{"a": 1}', "2030-01-02 03:04:05+00")
        handle = client.submit_tx(conn, CHILD.workflow, CHILD.input)
        assert state() == before
        conn.commit()
        assert state() == before
        conn.commit()
    check_activated(client, handle.id, "child")


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_submit_once_tx_waits_for_an_uncommitted_holder_of_its_key(
    app_dsn: str, client: Client, outcome: str
) -> None:
    with psycopg.connect(app_dsn) as first, psycopg.connect(app_dsn) as second:
        held = client.submit_once_tx(first, cta_flow, "first", key="k")
        got: list[Any] = []
        waiter = threading.Thread(
            target=lambda: got.append(client.submit_once_tx(second, cta_flow, "second", key="k"))
        )
        waiter.start()
        pid = second.info.backend_pid
        with psycopg.connect(app_dsn, autocommit=True) as watch:
            wait_until(
                lambda: (
                    watch.execute(
                        "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s",
                        (pid,),
                    ).fetchone()
                    == (True,)
                ),
                timeout=10,
                what="the second submit to wait for the key's holder",
            )
        if outcome == "commit":
            first.commit()
        else:
            first.rollback()
        waiter.join(timeout=10)
        assert not waiter.is_alive()
        (handle,) = got
        second.execute("INSERT INTO orders (sku, qty) VALUES ('second', 1)")  # still usable
        second.commit()
    if outcome == "commit":
        assert (handle.id, handle.created) == (held.id, False)
        assert committed_runs(app_dsn) == [(held.id, "first")]
    else:
        assert handle.created
        assert committed_runs(app_dsn) == [(handle.id, "second")]
    assert counts(app_dsn)[0] == 1


def test_a_key_lost_to_a_later_commit_under_repeatable_read_is_a_serialization_failure(
    app_dsn: str, client: Client
) -> None:
    with psycopg.connect(app_dsn) as late, psycopg.connect(app_dsn) as winner:
        late.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        late.execute("INSERT INTO orders (sku, qty) VALUES ('late', 1)")  # takes the snapshot
        won = client.submit_once_tx(winner, cta_flow, "winner", key="k")
        winner.commit()
        with pytest.raises(psycopg.errors.SerializationFailure):
            client.submit_once_tx(late, cta_flow, "late", key="k")
        late.rollback()
        again = client.submit_once_tx(late, cta_flow, "late", key="k")
        late.commit()
    assert (again.id, again.created) == (won.id, False)
    assert counts(app_dsn) == (0, 1)


def test_async_refused_submits_leave_the_transaction_usable(app_dsn: str, cyclone_dsn: str) -> None:
    async def scenario() -> None:
        async with (
            AsyncClient(cyclone_dsn) as aclient,
            await psycopg.AsyncConnection.connect(app_dsn) as conn,
            conn.transaction(),
        ):
            await conn.execute("INSERT INTO orders (sku, qty) VALUES ('placed', 1)")
            with pytest.raises(InvalidArgument):
                await aclient.submit_once_tx(conn, cta_flow, 1, key="")
            with pytest.raises(InvalidArgument):
                await aclient.enqueue_tx(conn, cta_work, 1, priority="high")  # type: ignore[arg-type]
            with pytest.raises(InvalidArgument):
                await aclient.submit_tx(conn, cta_flow, {"x": {1, 2}})
            arm("child.after_insert", "raise")
            try:
                with pytest.raises(FailpointError):
                    await aclient.submit_tx(conn, CHILD.workflow, CHILD.input)
            finally:
                disarm()
            assert conn.info.transaction_status == TransactionStatus.INTRANS
            await conn.execute("INSERT INTO orders (sku, qty) VALUES ('again', 1)")

    asyncio.run(scenario())
    assert counts(app_dsn) == (2, 0)


def test_a_cancelled_async_submit_leaves_nothing_in_the_transaction(
    app_dsn: str, cyclone_dsn: str
) -> None:
    """The request is cancelled while the engine works in its thread: the thread finishes,
    its savepoint is rolled back, and the application's transaction goes on and commits."""
    reached, release = threading.Event(), threading.Event()

    def hold() -> None:
        reached.set()
        release.wait(10)

    async def scenario() -> None:
        async with (
            AsyncClient(cyclone_dsn) as aclient,
            await psycopg.AsyncConnection.connect(app_dsn) as conn,
            conn.transaction(),
        ):
            await conn.execute("INSERT INTO orders (sku, qty) VALUES ('placed', 1)")
            task = asyncio.create_task(aclient.submit_tx(conn, CHILD.workflow, CHILD.input))
            assert await asyncio.to_thread(reached.wait, 10)
            task.cancel()
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert conn.info.transaction_status == TransactionStatus.INTRANS
            await conn.execute("INSERT INTO orders (sku, qty) VALUES ('again', 1)")

    arm("child.after_insert", hold)
    try:
        asyncio.run(scenario())
    finally:
        disarm()
    assert counts(app_dsn) == (2, 0)


def test_concurrent_async_submits_on_one_connection(app_dsn: str, cyclone_dsn: str) -> None:
    arrived = threading.Semaphore(0)
    gates = [threading.Event(), threading.Event()]
    order = itertools.count()

    def hold() -> None:
        gate = gates[next(order)]
        arrived.release()
        gate.wait(10)

    async def scenario() -> list[Any]:
        async with (
            AsyncClient(cyclone_dsn) as aclient,
            await psycopg.AsyncConnection.connect(app_dsn) as conn,
        ):
            async with conn.transaction():
                first = asyncio.create_task(aclient.submit_tx(conn, CHILD.workflow, "first"))
                assert await asyncio.to_thread(arrived.acquire, True, 10)
                second = asyncio.create_task(aclient.submit_tx(conn, CHILD.workflow, "second"))
                # Bounded: a second submit that is refused or made to wait never arrives.
                if not await asyncio.to_thread(arrived.acquire, True, 2):
                    gates[1].set()
                gates[0].set()
                outcomes = await asyncio.gather(first, return_exceptions=True)
                gates[1].set()
                outcomes += await asyncio.gather(second, return_exceptions=True)
            return outcomes

    arm("child.after_insert", hold)
    try:
        outcomes = asyncio.run(scenario())
    finally:
        disarm()
    returned = sorted(o.id for o in outcomes if not isinstance(o, BaseException))
    raised = [repr(o) for o in outcomes if isinstance(o, BaseException)]
    committed = [run_id for run_id, _ in committed_runs(app_dsn)]
    assert committed == returned, f"committed {committed}, returned {returned}, raised {raised}"


def test_a_connection_with_raw_cursors(app_dsn: str, client: Client) -> None:
    with psycopg.connect(app_dsn, cursor_factory=psycopg.RawCursor) as conn:
        handle = client.submit_tx(conn, cta_flow, {"n": 1})
        conn.commit()
    assert committed_runs(app_dsn) == [(handle.id, {"n": 1})]


def test_a_connection_with_its_own_bigint_loader(app_dsn: str, client: Client) -> None:
    with psycopg.connect(app_dsn) as conn:
        conn.adapters.register_loader("int8", TextLoader)
        handle = client.submit_once_tx(conn, cta_flow, {"n": 1}, key="k")
        again = client.submit_once_tx(conn, cta_flow, {"n": 1}, key="k")
        conn.commit()
    ids = [handle.id, again.id]
    assert all(isinstance(run_id, int) for run_id in ids), f"run ids {ids!r}"


def test_a_connection_in_pipeline_mode(app_dsn: str, client: Client) -> None:
    """It died on a bare AssertionError (the engine's reads saw no row before a sync); it
    is refused before any statement, and the application's transaction goes on."""
    with psycopg.connect(app_dsn) as conn:
        with conn.pipeline():
            conn.execute("INSERT INTO orders (sku, qty) VALUES ('placed', 1)")
            with pytest.raises(InvalidArgument, match="pipeline"):
                client.submit_tx(conn, cta_flow, {"n": 1})
        conn.commit()
    assert committed_runs(app_dsn) == []
    assert counts(app_dsn)[0] == 1


def test_async_submit_on_a_sync_connection_is_refused_up_front(
    app_dsn: str, cyclone_dsn: str
) -> None:
    async def scenario() -> None:
        async with AsyncClient(cyclone_dsn) as aclient:
            with psycopg.connect(app_dsn) as conn:
                with pytest.raises(TypeError, match="AsyncConnection"):
                    await aclient.submit_tx(conn, cta_flow, 1)  # type: ignore[arg-type]
                assert conn.info.transaction_status == TransactionStatus.IDLE

    asyncio.run(scenario())
    assert counts(app_dsn) == (0, 0)


# -- FastAPI -----------------------------------------------------------------------------


async def request_tx(request: Request) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """The request's transaction, opened and ended by the dependency (not the handler)."""
    pool: AsyncConnectionPool[Any] = request.app.state.pool
    async with pool.connection() as conn, conn.transaction():
        yield conn


RequestTx = Annotated[psycopg.AsyncConnection, Depends(request_tx)]  # type: ignore[type-arg]


def test_fastapi_a_dependency_that_owns_the_transaction(
    app_dsn: str, cyclone_dsn: str, client: Client
) -> None:
    """An HTTPException after the submit rolls the run back with the order, a refused
    submit (422 from the app) leaves nothing, a normal return commits order and run; the
    result endpoint answers 404 for ids no run can have."""
    pool = AsyncConnectionPool(app_dsn, open=False, min_size=1, max_size=2)

    @contextlib.asynccontextmanager
    async def database(app: FastAPI) -> AsyncIterator[None]:
        app.state.pool = pool
        await pool.open()
        try:
            yield
        finally:
            await pool.close()

    app = FastAPI(lifespan=cyclone_lifespan(cyclone_dsn, lifespan=database))

    @app.post("/orders")
    async def place(conn: RequestTx, cyclone: CycloneClient, mode: str = "ok") -> dict[str, int]:
        await conn.execute("INSERT INTO orders (sku, qty) VALUES (%s, 1)", (mode,))
        if mode == "bad":
            try:
                await cyclone.enqueue_tx(conn, cta_work, 1, unique_key="")
            except InvalidArgument as exc:
                raise HTTPException(422, str(exc)) from exc
        handle = await cyclone.submit_tx(conn, CHILD.workflow, CHILD.input)
        if mode == "refuse":
            raise HTTPException(409, "refused")
        return {"run_id": handle.id}

    @app.get("/runs/{run_id}/result")
    async def result(run_id: int, cyclone: CycloneClient) -> Any:
        return await result_response(cyclone, run_id, timeout=0)

    with TestClient(app) as http:
        assert http.post("/orders", params={"mode": "refuse"}).status_code == 409
        assert http.post("/orders", params={"mode": "bad"}).status_code == 422
        assert counts(app_dsn) == (0, 0)
        placed = http.post("/orders")
        assert placed.status_code == 200, placed.text
        run_id = placed.json()["run_id"]
        assert counts(app_dsn) == (1, 2)
        pending = http.get(f"/runs/{run_id}/result")
        assert (pending.status_code, pending.json()["state"]) == (202, "running")
        for missing in (0, -1, 2**63, run_id + 1000):
            assert http.get(f"/runs/{missing}/result").status_code == 404
    check_activated(client, run_id, "child")
