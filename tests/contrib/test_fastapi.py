"""cyclone_dsl.contrib.fastapi through FastAPI's TestClient.

The app submits on a connection of its own pool, in the request's transaction: the
run exists iff the handler commits, for every root shape and submit method. The
result endpoint answers 200/202/404/409; the status stream emits one event per change
of state or progress and ends with the run.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.testclient import TestClient
from psycopg_pool import AsyncConnectionPool

from cyclone_dsl import AsyncClient, Client, ClientClosed, Worker
from cyclone_dsl.contrib.fastapi import (
    CycloneClient,
    cyclone_lifespan,
    result_response,
    status_stream,
)
from tests.contrib.shapes import (
    SHAPES,
    WORKFLOWS,
    check_activated,
    counts,
    failing,
    no_result,
    work,
)
from tests.waiting import wait_until

OTHERS = {"failing": failing, "no_result": no_result}


def make_app(app_dsn: str, cyclone_dsn: str, seen: list[AsyncClient]) -> FastAPI:
    pool = AsyncConnectionPool(app_dsn, open=False, min_size=1, max_size=2)

    @asynccontextmanager
    async def database(app: FastAPI) -> AsyncIterator[None]:
        seen.append(app.state.cyclone)  # the app's own lifespan runs with the client open
        await pool.open()
        try:
            yield
        finally:
            await pool.close()

    app = FastAPI(lifespan=cyclone_lifespan(cyclone_dsn, lifespan=database))

    @app.post("/orders/{shape}", status_code=201)
    async def place(
        shape: str, client: CycloneClient, method: str = "submit_tx", refuse: bool = False
    ) -> dict[str, Any]:
        if shape in SHAPES:
            wf, value = SHAPES[shape].workflow, SHAPES[shape].input
        else:
            wf, value = OTHERS[shape], {"order_id": 1}
        async with pool.connection() as conn, conn.transaction():
            await conn.execute("INSERT INTO orders (sku, qty) VALUES (%s, 1)", (shape,))
            if method == "submit_tx":
                handle = await client.submit_tx(conn, wf, value)
            elif method == "submit_once_tx":
                handle = await client.submit_once_tx(conn, wf, value, key=f"order-{shape}")
            else:
                handle = await client.enqueue_tx(conn, work, value, unique_key="order-1")
            if refuse:
                raise HTTPException(status_code=409, detail="refused")
        return {"run_id": handle.id, "created": handle.created}

    @app.get("/runs/{run_id}/result")
    async def result(run_id: int, client: CycloneClient, timeout: float = 10) -> JSONResponse:
        return await result_response(client, run_id, timeout=timeout)

    @app.get("/runs/{run_id}/events")
    async def events(run_id: int, client: CycloneClient) -> StreamingResponse:
        return await status_stream(client, run_id, interval=0.05)

    return app


@pytest.fixture
def seen() -> list[AsyncClient]:
    return []


@pytest.fixture
def http(app_dsn: str, cyclone_dsn: str, seen: list[AsyncClient]) -> Iterator[TestClient]:
    with TestClient(make_app(app_dsn, cyclone_dsn, seen)) as test_client:
        yield test_client


def place(http: TestClient, shape: str, **params: Any) -> Any:
    response = http.post(f"/orders/{shape}", params=params)
    return response


@pytest.mark.parametrize("method", ["submit_tx", "submit_once_tx"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_run_exists_iff_the_request_commits(
    http: TestClient, app_dsn: str, client: Client, shape: str, method: str
) -> None:
    refused = place(http, shape, method=method, refuse=True)
    assert refused.status_code == 409, refused.text
    assert counts(app_dsn) == (0, 0), "a refused request left its order or its run"
    placed = place(http, shape, method=method)
    assert placed.status_code == 201, placed.text
    assert counts(app_dsn) == (1, SHAPES[shape].runs)
    check_activated(client, placed.json()["run_id"], shape)


def test_enqueue_tx(http: TestClient, app_dsn: str, client: Client) -> None:
    assert place(http, "step", method="enqueue_tx", refuse=True).status_code == 409
    assert counts(app_dsn) == (0, 0)
    first = place(http, "step", method="enqueue_tx").json()
    again = place(http, "step", method="enqueue_tx").json()
    assert first["created"] and not again["created"]
    assert again["run_id"] == first["run_id"]
    assert counts(app_dsn) == (2, 1)
    assert client.get_run(first["run_id"]).step("fw_work").state.value == "available"


def test_the_result_endpoint(
    http: TestClient, client: Client, start_worker: Callable[..., Worker]
) -> None:
    run_id = place(http, "wait").json()["run_id"]
    pending = http.get(f"/runs/{run_id}/result", params={"timeout": 0.1})
    assert (pending.status_code, pending.json()) == (202, {"run_id": run_id, "state": "running"})

    start_worker(*WORKFLOWS)
    client.signal(run_id, "go", {"order_id": 7})
    done = http.get(f"/runs/{run_id}/result", params={"timeout": 20})
    assert (done.status_code, done.json()) == (
        200,
        {"run_id": run_id, "state": "completed", "result": "order 7 done"},
    )

    failed_id = place(http, "failing").json()["run_id"]
    failed = http.get(f"/runs/{failed_id}/result", params={"timeout": 20})
    assert failed.status_code == 409, failed.text
    assert failed.json()["state"] == "failed"
    assert failed.json()["node"] == "fw_reject"
    assert "order 1 refused" in failed.json()["error"]

    quiet_id = place(http, "no_result").json()["run_id"]
    quiet = http.get(f"/runs/{quiet_id}/result", params={"timeout": 20})
    assert (quiet.status_code, quiet.json()) == (200, {"run_id": quiet_id, "state": "completed"})

    assert http.get(f"/runs/{quiet_id + 100}/result").status_code == 404


def read_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line:
            assert line.startswith("data: "), line
            yield json.loads(line.removeprefix("data: "))


def test_the_status_stream_follows_the_run_to_its_end(
    http: TestClient,
    client: Client,
    start_worker: Callable[..., Worker],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One event per change: while nothing changes the stream polls (counted) and stays
    silent; pause, resume and the run's end each make an event."""
    polls: list[int] = []
    progress = AsyncClient.progress

    async def counted(self: AsyncClient, run_id: int) -> tuple[int, int]:
        polls.append(run_id)
        return await progress(self, run_id)

    monkeypatch.setattr(AsyncClient, "progress", counted)

    def polled_again() -> None:
        since = len(polls)
        wait_until(
            lambda: len(polls) >= since + 3,
            timeout=10,
            what="the stream to poll 3 more times (an event it sent would block it)",
        )

    run_id = place(http, "wait").json()["run_id"]
    start_worker(*WORKFLOWS)
    with http.stream("GET", f"/runs/{run_id}/events") as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = read_events(response.iter_lines())
        seen = [next(events)]
        assert seen[0] == {"run_id": run_id, "state": "running", "done": 0, "total": 2}
        polled_again()
        client.pause(run_id)
        seen.append(next(events))
        assert seen[-1]["state"] == "paused"
        polled_again()
        client.resume(run_id)
        seen.append(next(events))
        assert seen[-1]["state"] == "running"
        polled_again()
        client.signal(run_id, "go", {"order_id": 1})
        seen += list(events)  # the stream ends when the run ends
    assert seen[-1] == {"run_id": run_id, "state": "completed", "done": 2, "total": 2}
    assert all(a != b for a, b in itertools.pairwise(seen)), "an event repeated"
    done = [event["done"] for event in seen]
    assert done == sorted(done)


def test_the_status_stream_of_an_unknown_run_is_404(http: TestClient) -> None:
    assert http.get("/runs/12345/events").status_code == 404


def test_the_lifespan_closes_the_client(
    app_dsn: str, cyclone_dsn: str, seen: list[AsyncClient]
) -> None:
    app = make_app(app_dsn, cyclone_dsn, seen)
    with TestClient(app) as http:
        assert http.get("/runs/1/result", params={"timeout": 0}).status_code == 404
    (client,) = seen
    assert not hasattr(app.state, "cyclone")
    with pytest.raises(ClientClosed):
        asyncio.run(client.get_run(1))


def test_a_handler_without_the_lifespan_is_told_what_is_missing() -> None:
    app = FastAPI()

    @app.get("/")
    async def handler(client: CycloneClient) -> None:
        raise AssertionError("unreachable")

    with TestClient(app) as http, pytest.raises(RuntimeError, match="cyclone_lifespan"):
        http.get("/")
