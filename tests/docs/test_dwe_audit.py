"""Audit of the user documentation as a new user reads it (part E): docs/howto/testing.md,
docs/howto/frameworks.md, docs/howto/monitoring.md and docs/ui.md.

Each test runs a page's sample (handlers renamed with the ``dwe_`` prefix) or checks one of
its claims through the public API, against the real database and a real worker. The
dashboard under hostile input (tests/ui/test_uia_audit.py), observability internals
(tests/integration/test_oba_audit.py) and the testing helpers' schema reuse
(tests/integration/test_tha_audit.py) are audited elsewhere; here are the pages' other
promises.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from cyclone_dsl import (
    AsyncClient,
    Client,
    InvalidArgument,
    InvalidGraph,
    RunNotFound,
    RunState,
    StepContext,
    StepState,
    Worker,
    step,
    wait_signal,
    workflow,
)
from cyclone_dsl.errors import SchemaVersionMismatch
from cyclone_dsl.graph.model import Graph
from cyclone_dsl.graph.validate import validate
from cyclone_dsl.migrate import versions
from cyclone_dsl.testing import shifted_clock
from cyclone_dsl.testing.failpoints import arm, disarm
from cyclone_dsl.testing.schemas import (
    SchemaPool,
    create_schema,
    drop_schema,
    with_search_path,
)
from cyclone_dsl.testing.strategies import graphs, invalid_graphs
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
StartWorker = Callable[..., Worker]
Clock = Callable[[datetime], None]

HAVE_FRAMEWORKS = True
try:
    import django  # noqa: F401
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import JSONResponse, StreamingResponse
    from fastapi.testclient import TestClient
    from psycopg_pool import AsyncConnectionPool
    from pydantic import BaseModel
    from sqlalchemy import create_engine
    from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

    from cyclone_dsl.contrib.fastapi import (
        CycloneClient,
        cyclone_lifespan,
        result_response,
        status_stream,
    )
    from cyclone_dsl.contrib.sqlalchemy import enqueue_tx, submit_once_tx, submit_tx
except ImportError:  # pragma: no cover - the extras are installed in the repo's .venv
    HAVE_FRAMEWORKS = False
else:

    class NewOrder(BaseModel):
        sku: str
        refuse: bool = False
        fail: bool = False

    class Base(DeclarativeBase):
        pass

    class Order(Base):
        __tablename__ = "orders"
        id: Mapped[int] = mapped_column(primary_key=True)
        sku: Mapped[str]


needs_frameworks = pytest.mark.skipif(
    not HAVE_FRAMEWORKS,
    reason="the fastapi/django/sqlalchemy extras are not installed: frameworks.md not checked",
)

# -- handlers -----------------------------------------------------------------------------

flaky_calls: list[int] = []


@step(name="dwe_charge")
def dwe_charge(order_id: int) -> str:
    logging.getLogger("dwe.flows").info("charging card")
    return f"charged {order_id}"


@step(name="dwe_fulfil_step")
def dwe_fulfil_step(order: dict[str, Any]) -> str:
    return f"order {order['order_id']} fulfilled"


@workflow(name="dwe_fulfil")
def dwe_fulfil(order):  # type: ignore[no-untyped-def]
    return dwe_fulfil_step(order)


@step(name="dwe_reject", max_attempts=1)
def dwe_reject(order: dict[str, Any]) -> str:
    raise ValueError(f"order {order['order_id']} refused")


@workflow(name="dwe_rejected")
def dwe_rejected(order):  # type: ignore[no-untyped-def]
    return dwe_reject(order)


@step(name="dwe_after_signal")
def dwe_after_signal(payload: dict[str, Any]) -> dict[str, Any]:
    return {"charged": 140, "by": payload["by"]}


@workflow(name="dwe_waiting")
def dwe_waiting(order_id):  # type: ignore[no-untyped-def]
    return dwe_after_signal(wait_signal("approved"))


@step(name="dwe_flaky", max_attempts=3)
def dwe_flaky(n: int, *, ctx: StepContext) -> int:
    flaky_calls.append(ctx.attempt)
    if ctx.attempt < 3:
        raise RuntimeError(f"attempt {ctx.attempt} fails")
    return n


@step(name="dwe_fails_once", max_attempts=2)
def dwe_fails_once(n: int, *, ctx: StepContext) -> int:
    if ctx.attempt == 1:
        raise RuntimeError("first attempt fails")
    return n


@step(name="dwe_ok")
def dwe_ok(n: int) -> int:
    return n + 1


@workflow(name="dwe_pair")
def dwe_pair(n):  # type: ignore[no-untyped-def]
    return dwe_ok(dwe_ok(n))


@step(name="dwe_tick")
def dwe_tick(n: int) -> int:
    return n


# -- helpers ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rows(dsn: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(query).fetchall()


def table_counts(admin_dsn: str, schema: str) -> dict[str, int]:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = %s", (schema,)
            ).fetchall()
        ]
        return {
            t: conn.execute(
                sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, t))
            ).fetchone()[0]  # type: ignore[index]
            for t in tables
        }


# == docs/howto/testing.md ================================================================


def test_dwe_testing_fixtures_give_a_migrated_empty_schema_on_the_dsns_search_path(
    cyclone_admin_dsn: str, cyclone_schema: str, cyclone_dsn: str
) -> None:
    """testing.md:19-20: ``cyclone_schema`` is ``cyclone_test_<random>`` with every
    migration applied and empty tables; ``cyclone_dsn``'s ``search_path`` is that schema."""
    assert re.fullmatch(r"cyclone_test_[0-9a-f]{6,}", cyclone_schema)
    with psycopg.connect(cyclone_dsn) as conn:
        assert conn.execute("SHOW search_path").fetchone() == (cyclone_schema,)
        assert conn.execute("SELECT current_schema()").fetchone() == (cyclone_schema,)
    from cyclone_dsl import LATEST_EXTENSION_VERSION, LATEST_SCHEMA_VERSION

    assert versions(cyclone_dsn) == (LATEST_SCHEMA_VERSION, LATEST_EXTENSION_VERSION)
    counts = table_counts(cyclone_admin_dsn, cyclone_schema)
    assert "cyclone_runs" in counts and "cyclone_steps" in counts
    versioned = {t for t in counts if "version" in t or "migration" in t}
    assert {t: n for t, n in counts.items() if n and t not in versioned} == {}


def test_dwe_testing_a_reused_schema_is_emptied_and_its_sequences_restarted(
    cyclone_admin_dsn: str,
) -> None:
    """testing.md:22-25: a pooled schema is emptied for each test that reuses it (a DELETE
    from small tables, a TRUNCATE of one holding more than a thousand rows) and its
    sequences restarted: nothing the last test left reaches the next one."""
    pool = SchemaPool(cyclone_admin_dsn)
    try:
        name = pool.checkout()
        dsn = with_search_path(cyclone_admin_dsn, name)
        with Client(dsn) as client:
            handles = client.enqueue_many(dwe_tick, list(range(1200)))  # > 1000 rows
            first = client.submit(dwe_waiting, 1)
            client.signal(first.id, "approved", {"by": "test"})
            client.schedule(dwe_pair, "0 0 1 1 *", id="dwe-yearly", input=1)
        with Worker(dsn, [dwe_tick], poll_interval=0.2, scan_interval=0.2):
            wait_until(
                lambda: len(rows(dsn, "SELECT 1 FROM cyclone_steps WHERE state = 'completed'")) > 0,
                what="the worker to complete a step",
            )
        assert max(h.id for h in handles) > 1000
        left = {t: n for t, n in table_counts(cyclone_admin_dsn, name).items() if n}
        assert {"cyclone_runs", "cyclone_steps"} <= set(left)
        pool.checkin(name, reusable=True)

        again = pool.checkout()
        assert again == name, "a passing test's schema is reused"
        counts = table_counts(cyclone_admin_dsn, name)
        kept = {t for t in counts if "version" in t or "migration" in t}
        assert {t: n for t, n in counts.items() if n and t not in kept} == {}
        with Client(dsn) as client:
            assert client.list_schedules() == []
            assert client.enqueue(dwe_tick, 1).id == 1, "run ids start again at 1"
            assert client.get_run(1).steps[0].id == 1, "step ids start again at 1"
        pool.checkin(again, reusable=True)
    finally:
        pool.close()


def test_dwe_testing_a_schema_whose_structure_changed_is_dropped_not_reused(
    cyclone_admin_dsn: str,
) -> None:
    """testing.md:25-28: the schema of a test that changed its structure is dropped."""
    pool = SchemaPool(cyclone_admin_dsn)
    try:
        name = pool.checkout()
        with psycopg.connect(with_search_path(cyclone_admin_dsn, name), autocommit=True) as conn:
            conn.execute("CREATE INDEX dwe_extra ON cyclone_runs (created_at)")
        pool.checkin(name, reusable=True)
        other = pool.checkout()
        assert other != name
        with psycopg.connect(cyclone_admin_dsn) as conn:
            assert conn.execute(
                "SELECT count(*) FROM pg_namespace WHERE nspname = %s", (name,)
            ).fetchone() == (0,)
        pool.checkin(other, reusable=True)
    finally:
        pool.close()


def test_dwe_testing_create_schema_unmigrated_and_at_a_version(cyclone_admin_dsn: str) -> None:
    """testing.md:29-30: ``create_schema`` makes a schema of the test's own, unmigrated or at
    another version."""
    bare = create_schema(cyclone_admin_dsn, migrated=False)
    older = create_schema(cyclone_admin_dsn, version=3)
    try:
        assert re.fullmatch(r"cyclone_test_[0-9a-f]+", bare)
        assert table_counts(cyclone_admin_dsn, bare) == {}
        assert versions(with_search_path(cyclone_admin_dsn, older))[0] == 3
        with pytest.raises(SchemaVersionMismatch, match="schema version 3"):
            Client(with_search_path(cyclone_admin_dsn, older))
    finally:
        drop_schema(cyclone_admin_dsn, bare)
        drop_schema(cyclone_admin_dsn, older)


@settings(max_examples=40)
@given(graphs())
def test_dwe_testing_every_generated_graph_validates(graph: Graph) -> None:
    """testing.md:62-70: ``graphs()`` draws valid graphs (``validate`` accepts them)."""
    validate(graph)


@settings(max_examples=40)
@given(invalid_graphs())
def test_dwe_testing_every_generated_invalid_graph_is_refused(case: tuple[Graph, str]) -> None:
    """testing.md:64: ``invalid_graphs()`` draws graphs ``validate`` refuses."""
    graph, _node = case
    with pytest.raises(InvalidGraph):
        validate(graph)


def test_dwe_testing_the_shifted_clock_moves_the_retry_backoff(
    client: Client, start_worker: StartWorker
) -> None:
    """testing.md:74-80: the shift applies to backoff: a retry's due time is on the
    shifted clock, and it runs at once there."""
    with shifted_clock(timedelta(hours=2)):
        handle = client.enqueue(dwe_fails_once, 5)
        start_worker(dwe_fails_once)
        assert handle.result(timeout=20) == 5
        (s,) = client.get_run(handle.id).steps
    assert [a.outcome for a in s.attempts] == ["retried"], s
    assert s.scheduled_at > datetime.now(UTC) + timedelta(hours=1, minutes=50)


def test_dwe_testing_the_shifted_clock_fires_a_cron_slot(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    """testing.md:74-78: the shift applies to cron slots: a yearly schedule fires once the
    clock is moved past its next slot, without waiting a year."""
    client.schedule(dwe_pair, "0 0 1 1 *", id="dwe-new-year", input=1)
    now = datetime.now(UTC)
    clock(datetime(now.year + 1, 1, 1, 0, 0, 30, tzinfo=UTC))
    start_worker(dwe_pair, dwe_ok)
    runs = wait_until(
        lambda: client.list_runs(workflow="dwe_pair"), what="the schedule to fire its slot"
    )
    (run,) = runs
    assert client.result(run.id, timeout=20) == 3


def test_dwe_testing_a_failpoint_armed_with_a_callable_runs_it_in_the_transaction(
    client: Client, start_worker: StartWorker
) -> None:
    """testing.md:92-99: armed with a callable, the point runs it (here: raising a
    psycopg.OperationalError, as the page suggests) and the transaction fails; once
    disarmed, the work goes on and completes exactly once."""
    fired: list[int] = []

    def broken_connection() -> None:
        fired.append(1)
        raise psycopg.OperationalError("dwe: the connection broke at commit")

    arm("complete.before_commit", broken_connection)
    try:
        handle = client.enqueue(dwe_tick, 9)
        start_worker(dwe_tick, lease=2.0)
        wait_until(lambda: fired, what="the failpoint to fire")
        assert client.get_run(handle.id).state == RunState.RUNNING, "the completion rolled back"
    finally:
        disarm()
    assert handle.result(timeout=30) == 9
    (s,) = client.get_run(handle.id).steps
    assert s.state == StepState.COMPLETED


def test_dwe_testing_an_unknown_failpoint_or_action_is_refused() -> None:
    """testing.md:88-99 names the points and the actions: others are refused at once."""
    with pytest.raises(ValueError, match="unknown failpoint"):
        arm("complete.after_commit", "exit")
    with pytest.raises(ValueError, match="'exit', 'stop', 'raise' or a callable"):
        arm("complete.before_commit", "crash")


# == docs/howto/frameworks.md =============================================================


@pytest.fixture
def app_dsn(cyclone_admin_dsn: str, cyclone_schema: str) -> Iterator[str]:
    """The page's ``orders`` table (``id``, ``sku``) in a schema of its own, on the
    ``search_path`` after the test's Cyclone schema, as an application's connection has."""
    name = f"dwe_app_{secrets.token_hex(6)}"
    with psycopg.connect(cyclone_admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
        conn.execute(
            sql.SQL("CREATE TABLE {} (id bigserial PRIMARY KEY, sku text NOT NULL)").format(
                sql.Identifier(name, "orders")
            )
        )
    yield with_search_path(cyclone_admin_dsn, f"{cyclone_schema},{name}")
    drop_schema(cyclone_admin_dsn, name)


def orders(dsn: str) -> list[str]:
    return [r[0] for r in rows(dsn, "SELECT sku FROM orders ORDER BY id")]


def test_dwe_frameworks_a_rolled_back_run_leaves_a_gap_and_is_not_found(
    app_dsn: str, client: Client
) -> None:
    """frameworks.md:24-27: a rolled-back run never runs, ``get_run`` raises RunNotFound,
    and run ids come from a sequence, so the rolled-back run leaves a gap."""
    with psycopg.connect(app_dsn) as conn:
        with conn.transaction(force_rollback=True):
            conn.execute("INSERT INTO orders (sku) VALUES ('gone')")
            lost = client.submit_tx(conn, dwe_fulfil, {"order_id": 1})
        with conn.transaction():
            conn.execute("INSERT INTO orders (sku) VALUES ('kept')")
            kept = client.submit_tx(conn, dwe_fulfil, {"order_id": 2})
    with pytest.raises(RunNotFound):
        client.get_run(lost.id)
    assert kept.id > lost.id
    assert orders(app_dsn) == ["kept"]
    assert [r.id for r in client.list_runs()] == [kept.id]


def test_dwe_frameworks_a_failed_submit_leaves_the_callers_writes_committable(
    app_dsn: str, client: Client
) -> None:
    """frameworks.md:31-32: a submit that fails (a refused key) raises, leaves nothing of
    itself in the transaction, and the caller's own writes can still commit."""
    with psycopg.connect(app_dsn) as conn, conn.transaction():
        conn.execute("INSERT INTO orders (sku) VALUES ('placed')")
        with pytest.raises(InvalidArgument):
            client.submit_once_tx(conn, dwe_fulfil, {"order_id": 1}, key="")
        with pytest.raises(InvalidArgument):
            client.submit_tx(conn, dwe_fulfil, {"order_id": float("nan")})
        conn.execute("INSERT INTO orders (sku) VALUES ('after')")
    assert orders(app_dsn) == ["placed", "after"]
    assert client.list_runs() == []


@needs_frameworks
def test_dwe_fastapi_the_pages_snippets_work_together(
    app_dsn: str, cyclone_dsn: str, client: Client, start_worker: StartWorker
) -> None:
    """frameworks.md:38-101: the page's FastAPI snippets, put together as a user would:
    201 with the order and its run, an HTTPException inside the transaction rolls back
    both, the result route answers 200/202/409/404, and the event stream ends with the
    run's terminal state."""
    pool = AsyncConnectionPool(app_dsn, open=False, min_size=1, max_size=2)

    @asynccontextmanager
    async def database(app: FastAPI) -> AsyncIterator[None]:
        await pool.open()
        yield
        await pool.close()

    app = FastAPI(lifespan=cyclone_lifespan(cyclone_dsn, lifespan=database))

    @app.post("/orders", status_code=201)
    async def place_order(order: NewOrder, client: CycloneClient) -> dict[str, int]:
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "INSERT INTO orders (sku) VALUES (%s) RETURNING id", (order.sku,)
            )
            (order_id,) = await cur.fetchone()  # type: ignore[misc]
            wf = dwe_rejected if order.fail else dwe_fulfil
            run = await client.submit_tx(conn, wf, {"order_id": order_id})
            if order.refuse:
                raise HTTPException(status_code=422, detail="refused")
        return {"order_id": order_id, "run_id": run.id}

    @app.get("/runs/{run_id}/result")
    async def run_result(run_id: int, client: CycloneClient, timeout: float = 10) -> JSONResponse:
        return await result_response(client, run_id, timeout=min(timeout, 30))

    @app.get("/runs/{run_id}/events")
    async def run_events(run_id: int, client: CycloneClient) -> StreamingResponse:
        return await status_stream(client, run_id)

    def events(http: TestClient, run_id: int) -> list[dict[str, Any]]:
        with http.stream("GET", f"/runs/{run_id}/events") as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            return [
                json.loads(line.removeprefix("data: ")) for line in response.iter_lines() if line
            ]

    with TestClient(app) as http:
        placed = http.post("/orders", json={"sku": "sku-1"})
        assert placed.status_code == 201, placed.text
        run_id = placed.json()["run_id"]
        assert http.get(f"/runs/{run_id}/result", params={"timeout": 0.2}).json() == {
            "run_id": run_id,
            "state": "running",
        }
        refused = http.post("/orders", json={"sku": "sku-2", "refuse": True})
        assert refused.status_code == 422
        assert orders(app_dsn) == ["sku-1"]
        assert [r.id for r in client.list_runs()] == [run_id]

        start_worker(dwe_fulfil, dwe_rejected)
        done = http.get(f"/runs/{run_id}/result")
        assert (done.status_code, done.json()) == (
            200,
            {
                "run_id": run_id,
                "state": "completed",
                "result": f"order {placed.json()['order_id']} fulfilled",
            },
        )
        assert events(http, run_id)[-1] == {
            "run_id": run_id,
            "state": "completed",
            "done": 1,
            "total": 1,
        }

        failing = http.post("/orders", json={"sku": "sku-3", "fail": True}).json()["run_id"]
        failed = http.get(f"/runs/{failing}/result")
        assert failed.status_code == 409
        assert failed.json()["node"] == "dwe_reject"
        assert "refused" in failed.json()["error"]
        assert events(http, failing)[-1]["state"] == "failed"

        assert http.get(f"/runs/{failing + 1000}/result").status_code == 404
        assert http.get(f"/runs/{failing + 1000}/events").status_code == 404


@needs_frameworks
def test_dwe_fastapi_a_cancelled_run_answers_409(cyclone_dsn: str, client: Client) -> None:
    """frameworks.md:78-79: 409 "with the failing node and error for a failed or cancelled
    run"; the status stream ends with the cancelled state."""
    app = FastAPI(lifespan=cyclone_lifespan(cyclone_dsn))

    @app.get("/runs/{run_id}/result")
    async def run_result(run_id: int, client: CycloneClient) -> JSONResponse:
        return await result_response(client, run_id, timeout=5)

    handle = client.submit(dwe_waiting, 1)
    client.cancel(handle.id)
    with TestClient(app) as http:
        answer = http.get(f"/runs/{handle.id}/result")
    assert answer.status_code == 409, answer.text
    assert answer.json()["state"] == "cancelled"
    assert answer.json()["node"]


@needs_frameworks
def test_dwe_sqlalchemy_the_pages_orm_sample(
    app_dsn: str, client: Client, start_worker: StartWorker
) -> None:
    """frameworks.md:190-213: an ORM ``Order`` flushed for its id and its run commit
    together; an exception in the block rolls back both; ``run.result(timeout=10)``."""
    engine = create_engine("postgresql+psycopg://", connect_args=conninfo_to_dict(app_dsn))
    try:
        with Session(engine) as session, session.begin():
            order = Order(sku="sku-1")
            session.add(order)
            session.flush()  # the order gets its id
            run = submit_tx(session, client, dwe_fulfil, {"order_id": order.id})
            order_id = order.id

        submitted: list[int] = []

        def refused() -> None:
            with Session(engine) as session, session.begin():
                session.add(Order(sku="sku-2"))
                session.flush()
                lost = submit_once_tx(session, client, dwe_fulfil, {"order_id": 2}, key="o-2")
                submitted.append(lost.id)
                raise ZeroDivisionError

        with pytest.raises(ZeroDivisionError):
            refused()
        (lost_id,) = submitted
        with pytest.raises(RunNotFound):
            client.get_run(lost_id)

        with engine.begin() as conn:  # a Core Connection
            again = submit_once_tx(conn, client, dwe_fulfil, {"order_id": 3}, key="o-3")
            same = submit_once_tx(conn, client, dwe_fulfil, {"order_id": 3}, key="o-3")
            job = enqueue_tx(conn, client, dwe_tick, 7, unique_key="t-7")
        assert again.created and not same.created and same.id == again.id

        start_worker(dwe_fulfil, dwe_tick)
        assert run.result(timeout=10) == f"order {order_id} fulfilled"
        assert job.result(timeout=10) == 7
    finally:
        engine.dispose()
    assert orders(app_dsn) == ["sku-1"]


@needs_frameworks
def test_dwe_sqlalchemy_the_psycopg2_dialect_is_refused_with_a_type_error(client: Client) -> None:
    """frameworks.md:213: another dialect (``postgresql+psycopg2``) is refused with a
    TypeError."""
    pytest.importorskip("psycopg2", reason="psycopg2 is not installed: that dialect not checked")
    engine = create_engine("postgresql+psycopg2://", connect_args=conninfo_to_dict(client.dsn))
    try:
        with Session(engine) as session, pytest.raises(TypeError, match="psycopg"):
            submit_tx(session, client, dwe_fulfil, {"order_id": 1})
    finally:
        engine.dispose()


DJANGO_SCRIPT = r"""
import json, sys
import django
from django.conf import settings
from cyclone_dsl.contrib.django import database_settings

dsn, other_dsn = sys.argv[1], sys.argv[2]
settings.configure(
    SECRET_KEY="dwe",
    USE_TZ=True,
    ALLOWED_HOSTS=["testserver"],
    ROOT_URLCONF=__name__,
    INSTALLED_APPS=["cyclone_dsl.contrib.django"],
    DATABASES={
        "default": {**database_settings(dsn), "ATOMIC_REQUESTS": True},
        "other": database_settings(other_dsn),
    },
    CYCLONE={"MODULES": ["tests.docs.test_dwe_audit"]},
)
django.setup()

from django.db import connections, transaction
from django.http import HttpResponse, JsonResponse
from django.test import Client as DjangoClient, override_settings
from django.urls import path
from cyclone_dsl import Client
from cyclone_dsl.contrib.django import enqueue_tx, get_client, submit_once_tx, submit_tx
from tests.docs.test_dwe_audit import dwe_fulfil, dwe_tick


class Refused(Exception):
    pass


def place_order(request):
    with connections["default"].cursor() as cursor:
        cursor.execute("INSERT INTO orders (sku) VALUES (%s) RETURNING id", [request.POST["sku"]])
        (order_id,) = cursor.fetchone()
    run = submit_tx(dwe_fulfil, {"order_id": order_id})  # joins the request's block
    if request.POST.get("refuse"):
        raise Refused("refused after the submit")
    return JsonResponse({"order_id": order_id, "run_id": run.id})


urlpatterns = [path("orders", place_order)]

out = {}
web = DjangoClient(raise_request_exception=False)
ok = web.post("/orders", {"sku": "kept"})
out["ok"] = [ok.status_code, ok.json()["run_id"]]
bad = web.post("/orders", {"sku": "gone", "refuse": "1"})
out["refused_status"] = bad.status_code

with Client(other_dsn) as mine:
    with transaction.atomic(using="other"):
        once = submit_once_tx(dwe_fulfil, {"order_id": 9}, key="o-9", using="other", client=mine)
        job = enqueue_tx(dwe_tick, 5, using="other", client=mine)
    out["other"] = [once.id, job.id]

first = get_client()
with override_settings(CYCLONE={"POOL_SIZE": 2}):
    out["replaced"] = get_client() is not first
try:
    with override_settings(CYCLONE={"POOL": 2}):
        get_client()
    out["unknown_key"] = "accepted"
except Exception as exc:
    out["unknown_key"] = type(exc).__name__ + ": " + str(exc)
print(json.dumps(out))
"""


@needs_frameworks
def test_dwe_django_atomic_requests_using_client_and_settings(
    app_dsn: str, cyclone_admin_dsn: str, client: Client
) -> None:
    """frameworks.md:132, 157-164: with ATOMIC_REQUESTS the view's submit joins the request's
    block (an exception in the view rolls back the order and the run);
    ``submit_once_tx``/``enqueue_tx`` take ``using=`` and ``client=``; ``get_client()`` is
    replaced under ``override_settings``; an unknown ``CYCLONE`` key is an error. Django's
    settings are process-wide, so this runs in a process of its own."""
    other_schema = create_schema(cyclone_admin_dsn)
    other = with_search_path(cyclone_admin_dsn, other_schema)
    try:
        done = subprocess.run(
            [sys.executable, "-c", DJANGO_SCRIPT, app_dsn, other],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        out = json.loads(done.stdout.strip().splitlines()[-1])
        with Client(other) as theirs:
            assert [r.id for r in theirs.list_runs()] == sorted(out["other"], reverse=True)
    finally:
        drop_schema(cyclone_admin_dsn, other_schema)
    assert out["ok"][0] == 200
    assert out["refused_status"] == 500
    assert orders(app_dsn) == ["kept"]
    assert [r.id for r in client.list_runs()] == [out["ok"][1]]
    assert out["replaced"] is True
    assert "ImproperlyConfigured" in out["unknown_key"] and "POOL" in out["unknown_key"]


# == docs/howto/monitoring.md =============================================================

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape_text(port: int | None) -> str:
    assert port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def parse(text: str) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= set(ls))


def label_names(samples: Samples, name: str) -> set[tuple[str, ...]]:
    return {
        tuple(k for k, _ in ls if k not in ("le", "quantile"))
        for (n, ls) in samples
        if n == name or n.startswith(name + "_")
    }


STEP_METRICS = (
    "cyclone_steps_claimed_total",
    "cyclone_steps_completed_total",
    "cyclone_steps_retried_total",
    "cyclone_steps_failed_total",
    "cyclone_steps_fenced_total",
    "cyclone_step_claim_to_start_seconds",
    "cyclone_step_handler_seconds",
)


def test_dwe_metrics_every_documented_metric_with_its_documented_labels(
    client: Client, start_worker: StartWorker
) -> None:
    """monitoring.md:38-40, 52-69, 87-93: port 0 takes a free port (``worker.metrics_port``),
    ``metrics_host`` chooses the address; step metrics are labelled by queue and kind only,
    run metrics by workflow and state, the reclaim counter has no labels; the gauges."""
    worker = start_worker(
        dwe_pair, dwe_ok, dwe_flaky, metrics_port=0, metrics_host="127.0.0.1", concurrency=3
    )
    assert isinstance(worker.metrics_port, int) and worker.metrics_port > 0
    flaky_calls.clear()
    assert client.submit(dwe_pair, 1).result(timeout=20) == 3
    assert client.enqueue(dwe_flaky, 4).result(timeout=20) == 4
    client.submit(dwe_waiting, 1)  # an open run, waiting

    def completions_counted() -> Samples | None:
        scraped = parse(scrape_text(worker.metrics_port))
        return scraped if total(scraped, "cyclone_steps_completed_total") == 3 else None

    samples = wait_until(completions_counted, what="the three completions to be counted")
    assert samples is not None
    for name in STEP_METRICS:
        assert label_names(samples, name) == {("kind", "queue")}, name
    assert total(samples, "cyclone_steps_retried_total", kind="dwe_flaky", queue="default") == 2
    assert label_names(samples, "cyclone_run_duration_seconds") == {("state", "workflow")}
    assert (
        total(samples, "cyclone_run_duration_seconds_count", workflow="dwe_pair", state="completed")
        == 1
    )
    assert label_names(samples, "cyclone_leases_reclaimed_total") == {()}
    for gauge in (
        "cyclone_worker_slots_in_use",
        "cyclone_worker_slots",
        "cyclone_worker_listener_connected",
        "cyclone_runs_waiting",
        "cyclone_database_gauges_up",
    ):
        assert label_names(samples, gauge) == {()}, gauge
    assert total(samples, "cyclone_worker_slots") == 3
    assert total(samples, "cyclone_worker_listener_connected") == 1
    assert label_names(samples, "cyclone_queue_steps") == {("queue", "state")}
    assert label_names(samples, "cyclone_queue_oldest_runnable_age_seconds") == {("queue",)}
    assert label_names(samples, "cyclone_runs_open") == {("state",)}
    assert total(samples, "cyclone_runs_open", state="running") == 1
    assert total(samples, "cyclone_runs_waiting") == 1
    assert total(samples, "cyclone_queue_steps", queue="default", state="waiting_signal") == 1


def test_dwe_metrics_two_workers_in_one_process_serve_their_own_figures(
    client: Client, start_worker: StartWorker
) -> None:
    """monitoring.md:45-46: each worker has a registry of its own."""
    first = start_worker(dwe_tick, metrics_port=0, metrics_host="127.0.0.1", queues=["dwe-a"])
    second = start_worker(dwe_tick, metrics_port=0, metrics_host="127.0.0.1", queues=["dwe-b"])
    assert first.metrics_port != second.metrics_port
    for n in range(3):
        assert client.enqueue(dwe_tick, n, queue="dwe-a").result(timeout=20) == n
    assert client.enqueue(dwe_tick, 9, queue="dwe-b").result(timeout=20) == 9

    def counted(worker: Worker, queue: str) -> float:
        return total(
            parse(scrape_text(worker.metrics_port)), "cyclone_steps_completed_total", queue=queue
        )

    wait_until(lambda: counted(first, "dwe-a") == 3, what="the first worker's 3 completions")
    wait_until(lambda: counted(second, "dwe-b") == 1, what="the second worker's completion")
    assert counted(first, "dwe-b") == 0 and counted(second, "dwe-a") == 0


def test_dwe_metrics_a_worker_without_metrics_port_never_imports_prometheus_client(
    cyclone_dsn: str,
) -> None:
    """monitoring.md:47-48: without ``metrics_port``, a running worker never imports
    prometheus_client."""
    code = (
        "import sys\n"
        "from cyclone_dsl import Client, Worker\n"
        "from tests.docs.test_dwe_audit import dwe_tick\n"
        f"dsn = {cyclone_dsn!r}\n"
        "with Worker(dsn, [dwe_tick], poll_interval=0.2, scan_interval=0.2), Client(dsn) as c:\n"
        "    assert c.enqueue(dwe_tick, 3).result(timeout=20) == 3\n"
        "print(sorted(m for m in sys.modules if m.startswith('prometheus')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_dwe_metrics_database_gauges_are_read_once_per_5_seconds_and_match_client_gauges(
    client: Client, start_worker: StartWorker
) -> None:
    """monitoring.md:83-85, 102: the gauges are read once per scrape and reused for 5 s;
    they count only the steps of open runs; ``Client.gauges()`` reads the same rows."""
    worker = start_worker(dwe_tick, metrics_port=0, metrics_host="127.0.0.1", queues=["dwe-other"])
    for n in range(3):
        client.enqueue(dwe_tick, n, queue="dwe-idle")
    first = parse(scrape_text(worker.metrics_port))
    assert total(first, "cyclone_queue_steps", queue="dwe-idle", state="available") == 3
    gauges = client.gauges()
    (row,) = [g for g in gauges if g["gauge"] == "steps" and g["queue"] == "dwe-idle"]
    assert (row["state"], row["value"]) == ("available", 3)
    assert row["oldest_s"] is not None and row["oldest_s"] >= 0

    client.enqueue(dwe_tick, 4, queue="dwe-idle")
    again = parse(scrape_text(worker.metrics_port))
    assert total(again, "cyclone_queue_steps", queue="dwe-idle", state="available") == 3, (
        "a scrape within 5 s reuses the last read"
    )
    wait_until(
        lambda: (
            total(
                parse(scrape_text(worker.metrics_port)),
                "cyclone_queue_steps",
                queue="dwe-idle",
                state="available",
            )
            == 4
        ),
        timeout=15,
        what="a scrape more than 5 s later to read the gauges again",
    )
    with psycopg.connect(client.dsn) as conn:
        conn.execute("SELECT 1")
    for r in client.list_runs():
        client.cancel(r.id)
    assert [g for g in client.gauges() if g["gauge"] == "steps" and g["queue"] == "dwe-idle"] == []


def test_dwe_metrics_the_dashboard_route_answers_501_without_the_extra(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """monitoring.md:95-97: without the metrics extra the dashboard's /metrics answers 501
    (prometheus_client made unimportable here)."""
    import cyclone_dsl.observability as observability
    from cyclone_dsl.ui.app import create_app

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.delitem(sys.modules, "cyclone_dsl.observability.metrics", raising=False)
    monkeypatch.delattr(observability, "metrics", raising=False)
    from starlette.testclient import TestClient as WebClient

    with WebClient(create_app(client)) as web:
        answer = web.get("/metrics")
    assert answer.status_code == 501
    assert "pip install 'cyclone-dsl[metrics]'" in answer.text


def test_dwe_metrics_cli_processes_serve_consecutive_ports_and_json_logs_carry_the_step(
    cyclone_dsn: str, client: Client
) -> None:
    """monitoring.md:22-24, 42-44, 143-159: ``cyclone -v worker --metrics-port P`` with two
    processes serves P and P+1, each its own figures; ``--log-format json`` prints a
    handler's line as one JSON object with the step's context."""
    port = free_port()
    while True:
        try:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port + 1))
            break
        except OSError:
            port = free_port()
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cyclone_dsl.cli",
            "--dsn",
            cyclone_dsn,
            "-v",
            "worker",
            "tests.docs.test_dwe_audit",
            "--processes",
            "2",
            "--metrics-port",
            str(port),
            "--metrics-host",
            "127.0.0.1",
            "--log-format",
            "json",
            "--poll-interval",
            "0.2",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def serving(p: int) -> bool:
            try:
                scrape_text(p)
            except (urllib.error.URLError, ConnectionError):
                return False
            return True

        try:
            wait_until(lambda: serving(port) and serving(port + 1), timeout=60, what="both ports")
        except AssertionError:
            worker.kill()
            _, err = worker.communicate()
            pytest.fail(f"the worker did not serve ports {port} and {port + 1}: {err[-3000:]}")
        handle = client.enqueue(dwe_charge, 42)
        assert handle.result(timeout=30) == "charged 42"

        def claims() -> list[float] | None:
            each = [
                total(parse(scrape_text(p)), "cyclone_steps_claimed_total", kind="dwe_charge")
                for p in (port, port + 1)
            ]
            return each if sum(each) == 1 else None

        claimed = wait_until(claims, what="one claim counted")
        assert claimed is not None
        assert sorted(claimed) == [0, 1], "each process serves its own figures"
    finally:
        worker.terminate()
        try:
            _, err = worker.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            worker.kill()
            _, err = worker.communicate()
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    (charging,) = [line for line in lines if line.get("message") == "charging card"]
    assert charging["level"] == "INFO" and charging["logger"] == "dwe.flows"
    (s,) = client.get_run(handle.id).steps
    assert {k: charging[k] for k in ("run_id", "node", "step_id", "attempt", "kind")} == {
        "run_id": handle.id,
        "node": "dwe_charge",
        "step_id": s.id,
        "attempt": 1,
        "kind": "dwe_charge",
    }
    assert datetime.fromisoformat(charging["time"]).utcoffset() is not None


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@step(name="dwe_logs_in_a_thread")
async def dwe_logs_in_a_thread(n: int) -> int:
    await asyncio.to_thread(logging.getLogger("dwe.flows").warning, "from a thread %d", n)
    logging.getLogger("dwe.flows").warning("with extra", extra={"order": n})
    return n


def test_dwe_logs_the_pages_filter_sample_adds_the_step_fields_and_tolerates_their_absence(
    client: Client, start_worker: StartWorker
) -> None:
    """monitoring.md:126-131, 157-158, 172-188: the page's ``StepContextFilter`` +
    ``JsonFormatter`` sample: lines an async handler logs (and a thread it starts with
    ``asyncio.to_thread``) carry run_id, node, step_id, attempt and kind, ``extra=`` fields
    too; a record outside a step has none, and JsonFormatter still prints it."""
    from cyclone_dsl.observability import JsonFormatter, StepContextFilter

    handler = Captured()
    handler.addFilter(StepContextFilter())
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("dwe.flows")
    logger.addHandler(handler)
    try:
        logger.warning("outside any step")
        start_worker(dwe_logs_in_a_thread)
        handle = client.enqueue(dwe_logs_in_a_thread, 5)
        assert handle.result(timeout=20) == 5
    finally:
        logger.removeHandler(handler)
    records = [json.loads(line) for line in handler.lines]
    outside, thread, extra = records
    assert outside["message"] == "outside any step"
    assert not {"run_id", "node", "step_id", "attempt", "kind"} & set(outside)
    (s,) = client.get_run(handle.id).steps
    context = {
        "run_id": handle.id,
        "node": "dwe_logs_in_a_thread",
        "step_id": s.id,
        "attempt": 1,
        "kind": "dwe_logs_in_a_thread",
    }
    assert thread["message"] == "from a thread 5"
    assert {k: thread.get(k) for k in context} == context
    assert {k: extra.get(k) for k in context} == context
    assert extra["order"] == 5


def test_dwe_logs_configure_logging_replaces_the_root_handlers() -> None:
    """monitoring.md:161-170: ``configure_logging`` installs one root handler (JSON lines
    on stderr) and replaces the root logger's handlers."""
    code = (
        "import logging, sys\n"
        "from cyclone_dsl.observability import configure_logging\n"
        "logging.basicConfig(stream=sys.stdout, format='OLD %(message)s')\n"
        "configure_logging(json=True, level=logging.INFO)\n"
        "print(len(logging.getLogger().handlers))\n"
        "logging.getLogger('dwe').info('hello %s', 'there')\n"
        "logging.getLogger('dwe').debug('not shown')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1", "the old handler was replaced"
    (line,) = done.stderr.strip().splitlines()
    record = json.loads(line)
    assert (record["level"], record["logger"], record["message"]) == ("INFO", "dwe", "hello there")


# -- traces --------------------------------------------------------------------------------


@step(name="dwe_traced")
def dwe_traced(n: int) -> int:
    from opentelemetry import trace

    with trace.get_tracer("dwe").start_as_current_span("dwe.own-span"):
        return n


def test_dwe_traces_a_private_provider_a_handlers_own_span_and_the_stored_context(
    client: Client, cyclone_dsn: str, start_worker: StartWorker
) -> None:
    """monitoring.md:215-235: ``tracing=provider`` uses that provider (not the global one);
    the enqueue span is ``cyclone.enqueue <kind>``; its trace context is stored in
    ``cyclone_ext_trace_context`` in the submit's own transaction (a rolled-back
    ``enqueue_tx`` leaves none); the step's span is current in the handler, so the
    handler's own spans nest under it."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    global_exporter = InMemorySpanExporter()
    try:
        with Client(cyclone_dsn, tracing=provider) as traced:
            with (
                psycopg.connect(cyclone_dsn) as conn,
                conn.transaction(force_rollback=True),
            ):
                traced.enqueue_tx(conn, dwe_traced, 1)
            assert rows(cyclone_dsn, "SELECT count(*) FROM cyclone_ext_trace_context") == [(0,)]
            handle = traced.enqueue(dwe_traced, 2)
        assert rows(cyclone_dsn, "SELECT count(*) FROM cyclone_ext_trace_context") == [(1,)]

        # The handler's own span uses the global provider, as instrumented libraries do;
        # give the global API a provider whose spans this test can read.
        own_provider = TracerProvider()
        own_provider.add_span_processor(SimpleSpanProcessor(global_exporter))
        tracer = own_provider.get_tracer("dwe")
        real_get_tracer = trace.get_tracer

        def get_tracer(name: str, *args: Any, **kwargs: Any) -> Any:
            return tracer if name == "dwe" else real_get_tracer(name, *args, **kwargs)

        trace.get_tracer = get_tracer  # type: ignore[assignment]
        try:
            start_worker(dwe_traced, tracing=provider)
            assert client.result(handle.id, timeout=20) == 2
            wait_until(
                lambda: any(
                    sp.name == "cyclone.step dwe_traced" for sp in exporter.get_finished_spans()
                ),
                what="the step's span",
            )
        finally:
            trace.get_tracer = real_get_tracer
    finally:
        provider.shutdown()
    spans = {sp.name: sp for sp in exporter.get_finished_spans()}
    assert set(spans) == {"cyclone.enqueue dwe_traced", "cyclone.step dwe_traced"}, set(spans)
    enqueue, attempt = spans["cyclone.enqueue dwe_traced"], spans["cyclone.step dwe_traced"]
    assert attempt.parent is not None and attempt.parent.span_id == enqueue.context.span_id
    assert attempt.attributes is not None
    assert attempt.attributes["cyclone.run_id"] == handle.id
    assert attempt.attributes["cyclone.queue"] == "default"
    assert isinstance(attempt.attributes["cyclone.max_attempts"], int)
    assert attempt.attributes["cyclone.outcome"] == "returned"
    (own,) = global_exporter.get_finished_spans()
    assert own.parent is not None and own.parent.span_id == attempt.context.span_id


def test_dwe_traces_an_async_client_takes_the_same_argument(cyclone_dsn: str) -> None:
    """monitoring.md:216-217: ``AsyncClient`` takes ``tracing=`` too: its submit is a span
    ``cyclone.submit <workflow>``, under the caller's current span."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def main() -> int:
        async with AsyncClient(cyclone_dsn, tracing=provider) as client:
            with provider.get_tracer("dwe").start_as_current_span("dwe.request"):
                handle = await client.submit(dwe_pair, 1)
                many = await client.submit_many(dwe_pair, [1, 2])
        assert len(many) == 2
        return handle.id

    try:
        run_id = asyncio.run(main())
    finally:
        provider.shutdown()
    spans = {sp.name: sp for sp in exporter.get_finished_spans()}
    request, submit = spans["dwe.request"], spans["cyclone.submit dwe_pair"]
    assert submit.parent is not None and submit.parent.span_id == request.context.span_id
    assert submit.attributes is not None and submit.attributes["cyclone.run_id"] == run_id
    assert submit.attributes["cyclone.workflow"] == "dwe_pair"
    (batch,) = [sp for sp in spans.values() if sp.attributes and "cyclone.run_ids" in sp.attributes]
    assert len(batch.attributes["cyclone.run_ids"]) == 2  # type: ignore[arg-type,index]


# -- the observer seam ---------------------------------------------------------------------


def test_dwe_observer_a_subclass_passed_to_the_worker_hears_the_documented_calls(
    client: Client, start_worker: StartWorker
) -> None:
    """monitoring.md:287-294: subclass WorkerObserver, override methods, pass it with
    ``observers=[mine]``."""
    from cyclone_dsl.worker.observe import WorkerObserver

    heard: list[tuple[str, object]] = []
    lock = threading.Lock()

    class Mine(WorkerObserver):
        def on_claimed(self, steps: Any) -> None:
            with lock:
                heard.append(("claimed", len(steps)))

        def on_started(self, step: Any, claim_to_start_s: float) -> None:
            with lock:
                heard.append(("started", claim_to_start_s >= 0))

        def on_finished(self, step: Any, outcome: str, duration_s: float) -> None:
            with lock:
                heard.append(("finished", outcome))

        def on_failure(self, step: Any, error_kind: str, error: str) -> None:
            with lock:
                heard.append(("failure", error_kind))

        def on_failed(self, step_ids: Any, *, retried: bool) -> None:
            with lock:
                heard.append(("failed", retried))

        def on_completed(self, step_ids: Any) -> None:
            with lock:
                heard.append(("completed", len(step_ids)))

        def on_runs_ended(self, runs: Any) -> None:
            with lock:
                heard.append(("runs_ended", len(runs)))

        def on_listener(self, connected: bool) -> None:
            with lock:
                heard.append(("listener", connected))

    start_worker(dwe_fails_once, observers=[Mine()])
    handle = client.enqueue(dwe_fails_once, 1)
    assert handle.result(timeout=20) == 1
    wait_until(lambda: ("runs_ended", 1) in heard, what="the run's end to be heard")
    with lock:
        seen = list(heard)
    assert ("listener", True) in seen
    for call in (
        ("started", True),
        ("failure", "error"),
        ("failed", True),
        ("finished", "failed"),
        ("finished", "returned"),
        ("completed", 1),
    ):
        assert call in seen, (call, seen)
    assert sum(n for what, n in seen if what == "claimed") == 2  # type: ignore[misc]


# == docs/ui.md ===========================================================================


def test_dwe_ui_the_attempts_api_lists_the_history_then_the_latest_attempt(
    client: Client, start_worker: StartWorker
) -> None:
    """ui.md:93-101: each node lists its attempts in order: the attempt history, then the
    step's own latest one, each with its worker (for a completed attempt, the one that
    completed it); ``/api/runs/<id>/attempts`` returns the same list."""
    from starlette.testclient import TestClient as WebClient

    from cyclone_dsl.ui.app import create_app

    worker = start_worker(dwe_flaky)
    flaky_calls.clear()
    handle = client.enqueue(dwe_flaky, 8)
    assert handle.result(timeout=30) == 8
    with WebClient(create_app(client)) as web:
        listed = web.get(f"/api/runs/{handle.id}/attempts").json()["dwe_flaky"]
    assert [(a["number"], a["outcome"], a["error_kind"]) for a in listed] == [
        (1, "retried", "error"),
        (2, "retried", "error"),
        (3, "completed", None),
    ]
    assert [a["worker"] for a in listed[:2]] == [worker.id, worker.id]
    assert "attempt 2 fails" in listed[1]["error"] and listed[2]["error"] is None
    assert listed[2]["worker"] == worker.id  # the worker that completed it


def test_dwe_ui_a_worker_is_gone_once_its_last_beat_is_older_than_30_seconds(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    """ui.md:107-116: a worker is live while its last beat is younger than 30 s, stopped
    after a graceful stop; ``create_app(client, live_for=...)`` changes the 30 s;
    ``/api/workers`` returns the workers as JSON."""
    from starlette.testclient import TestClient as WebClient

    from cyclone_dsl.ui.app import create_app

    live = start_worker(dwe_tick)
    stopped = start_worker(dwe_tick)
    stopped.stop()

    def statuses(live_for: timedelta | None = None) -> dict[str, str]:
        app = create_app(client) if live_for is None else create_app(client, live_for=live_for)
        with WebClient(app) as web:
            return {w["id"]: w["status"] for w in web.get("/api/workers").json()}

    assert statuses() == {live.id: "live", stopped.id: "stopped"}
    clock(datetime.now(UTC) + timedelta(seconds=45))  # its last beat is 45 s old now
    assert statuses() == {live.id: "gone", stopped.id: "stopped"}
    assert statuses(timedelta(minutes=5)) == {live.id: "live", stopped.id: "stopped"}
