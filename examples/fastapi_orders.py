"""FastAPI: take an order and start its workflow in one transaction; await or stream the run.

- ``POST /orders`` writes the order row and submits its run with
  ``AsyncClient.submit_tx`` on a connection from the app's own pool, in one
  transaction: both are committed, or (on an exception) neither exists.
- ``GET /runs/{id}/result?timeout=`` waits for the run's result.
- ``GET /runs/{id}/events`` streams its status as server-sent events until it ends.

Serve it with ``uvicorn --factory`` on a function that calls ``create_app(dsn)``
and run the worker as ``cyclone worker MODULE``; this script drives the app with
FastAPI's ``TestClient`` and runs a worker in background threads.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse, StreamingResponse
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel

from cyclone_dsl import NodeRef, Ref, step, workflow
from cyclone_dsl.contrib.fastapi import (
    CycloneClient,
    cyclone_lifespan,
    result_response,
    status_stream,
)

SCHEMA = "CREATE TABLE IF NOT EXISTS fa_orders (id bigserial PRIMARY KEY, sku text, qty int)"
STOCK = 100


@step(name="fa_reserve")
def reserve(order: dict[str, object]) -> dict[str, object]:
    return {**order, "reserved": True}


@step(name="fa_charge")
def charge(order: dict[str, object]) -> dict[str, object]:
    return {**order, "charged": 10 * int(str(order["qty"]))}


@step(name="fa_ship")
def ship(order: dict[str, object]) -> str:
    return f"order {order['order_id']}: {order['qty']} x {order['sku']} shipped"


@workflow(name="fa_fulfil")
def fulfil(order: Ref[dict[str, object]]) -> NodeRef[str]:
    return ship(charge(reserve(order)))


class NewOrder(BaseModel):
    sku: str
    qty: int


def create_app(dsn: str) -> FastAPI:
    pool = AsyncConnectionPool(dsn, open=False)

    @asynccontextmanager
    async def database(app: FastAPI) -> AsyncIterator[None]:
        await pool.open()
        try:
            yield
        finally:
            await pool.close()

    app = FastAPI(lifespan=cyclone_lifespan(dsn, lifespan=database))

    @app.post("/orders", status_code=201)
    async def place_order(order: NewOrder, client: CycloneClient) -> dict[str, int]:
        async with pool.connection() as conn, conn.transaction():
            cursor = await conn.execute(
                "INSERT INTO fa_orders (sku, qty) VALUES (%s, %s) RETURNING id",
                (order.sku, order.qty),
            )
            row = await cursor.fetchone()
            assert row is not None
            order_id = int(row[0])
            run = await client.submit_tx(
                conn, fulfil, {"order_id": order_id, "sku": order.sku, "qty": order.qty}
            )
            if order.qty > STOCK:  # raised inside the transaction: the order and run vanish
                raise HTTPException(status_code=409, detail=f"only {STOCK} {order.sku} left")
        return {"order_id": order_id, "run_id": run.id}

    @app.get("/runs/{run_id}/result")
    async def run_result(run_id: int, client: CycloneClient, timeout: float = 10) -> JSONResponse:
        # 200 with the result, 202 while it runs, 409 if it failed, 404 if there is no run.
        return await result_response(client, run_id, timeout=min(timeout, 30))

    @app.get("/runs/{run_id}/events")
    async def run_events(run_id: int, client: CycloneClient) -> StreamingResponse:
        return await status_stream(client, run_id, interval=0.2)

    return app


if __name__ == "__main__":
    import psycopg
    from fastapi.testclient import TestClient

    from cyclone_dsl import Worker, embedded_database, migrate

    with embedded_database() as dsn:
        migrate(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SCHEMA)
        with TestClient(create_app(dsn)) as http:
            refused = http.post("/orders", json={"sku": "sku-2", "qty": 1000})
            assert refused.status_code == 409, refused.text
            placed = http.post("/orders", json={"sku": "sku-1", "qty": 2})
            assert placed.status_code == 201, placed.text
            run_id = placed.json()["run_id"]
            waiting = http.get(f"/runs/{run_id}/result", params={"timeout": 0.1})
            print("before any worker:", waiting.status_code, waiting.json())
            with Worker(dsn, [fulfil]):
                with http.stream("GET", f"/runs/{run_id}/events") as events:
                    for line in events.iter_lines():
                        if line:
                            print(line)
                print(http.get(f"/runs/{run_id}/result", params={"timeout": 30}).json())
