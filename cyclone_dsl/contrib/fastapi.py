"""Cyclone in a FastAPI application (extra ``fastapi``).

- :func:`cyclone_lifespan` opens an :class:`~cyclone_dsl.AsyncClient` when the app
  starts, keeps it on ``app.state.cyclone`` and closes it when the app stops; it can
  wrap the app's own lifespan (which then sees the client).
- :data:`CycloneClient` is the dependency that hands that client to a handler.
- :func:`result_response` waits for a run's result and answers with it.
- :func:`status_stream` answers with a run's status as server-sent events.

Submitting in the request's own transaction needs no helper: open the transaction on
a ``psycopg.AsyncConnection`` the app owns (from a ``psycopg_pool.AsyncConnectionPool``),
write the rows, and call ``await client.submit_tx(conn, workflow, input)`` before it
commits: the run exists iff the transaction commits.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Annotated, Any, TypeVar

from cyclone_dsl.client.aio import AsyncClient
from cyclone_dsl.contrib import missing_extra
from cyclone_dsl.dsl.registry import Registry
from cyclone_dsl.errors import NoOutput, RunFailed, RunNotFound

try:
    from fastapi import Depends, HTTPException, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.applications import Starlette
except ImportError as exc:
    raise missing_extra("fastapi", "FastAPI", "fastapi") from exc

__all__ = [
    "CycloneClient",
    "cyclone_lifespan",
    "get_client",
    "result_response",
    "status_events",
    "status_stream",
]

AppT = TypeVar("AppT", bound=Starlette)


def cyclone_lifespan(
    dsn: str | None = None,
    *,
    registry: Registry | None = None,
    pool_size: int = 4,
    lifespan: Callable[[AppT], AbstractAsyncContextManager[None]] | None = None,
) -> Callable[[AppT], AbstractAsyncContextManager[None]]:
    """A lifespan for ``FastAPI(lifespan=...)`` with an :class:`~cyclone_dsl.AsyncClient`.

    The client (``AsyncClient(dsn, registry=..., pool_size=...)``; ``dsn`` defaults to
    ``$CYCLONE_DATABASE_URL``) is opened at startup and kept on ``app.state.cyclone``
    for :func:`get_client`; the app's own ``lifespan``, if given, runs inside, with
    the client already there. The client is closed at shutdown.
    """

    @asynccontextmanager
    async def run(app: AppT) -> AsyncIterator[None]:
        client = await asyncio.to_thread(AsyncClient, dsn, registry=registry, pool_size=pool_size)
        app.state.cyclone = client
        try:
            if lifespan is None:
                yield
            else:
                async with lifespan(app):
                    yield
        finally:
            del app.state.cyclone
            await client.close()

    return run


def get_client(request: Request) -> AsyncClient:
    """The app's :class:`~cyclone_dsl.AsyncClient` (a FastAPI dependency)."""
    client = getattr(request.app.state, "cyclone", None)
    if not isinstance(client, AsyncClient):
        raise RuntimeError(
            "this app has no Cyclone client: create it with FastAPI(lifespan=cyclone_lifespan())"
        )
    return client


#: ``client: CycloneClient`` in a handler's parameters receives the app's client.
CycloneClient = Annotated[AsyncClient, Depends(get_client)]


async def result_response(
    client: AsyncClient, run_id: int, *, timeout: float | None
) -> JSONResponse:
    """Wait up to ``timeout`` seconds for the run to end, and answer with its outcome.

    - 200 ``{"run_id", "state": "completed", "result"}`` (no ``result`` key when the
      workflow defines none);
    - 202 ``{"run_id", "state"}`` when the run has not ended within ``timeout``: ask again;
    - 409 ``{"run_id", "state", "node", "error", "error_kind"}`` for a failed or
      cancelled run;
    - 404 when there is no such run.

    Bound ``timeout`` (``None`` waits as long as the run takes, holding the request).
    """
    try:
        result = await client.result(run_id, timeout=timeout)
    except RunNotFound:
        raise HTTPException(status_code=404, detail=f"no run {run_id}") from None
    except TimeoutError:
        run = await client.get_run(run_id)
        return JSONResponse({"run_id": run_id, "state": run.state.value}, status_code=202)
    except RunFailed as failed:
        body = {
            "run_id": run_id,
            "state": failed.state,
            "node": failed.node,
            "error": failed.error,
            "error_kind": failed.error_kind,
        }
        return JSONResponse(body, status_code=409)
    except NoOutput:
        return JSONResponse({"run_id": run_id, "state": "completed"})
    return JSONResponse({"run_id": run_id, "state": "completed", "result": result})


async def status_events(
    client: AsyncClient, run_id: int, *, interval: float = 0.5
) -> AsyncIterator[dict[str, Any]]:
    """The run's status ``{"run_id", "state", "done", "total"}`` (``done`` of ``total``
    steps are terminal), read every ``interval`` seconds and yielded each time it
    changes, ending with the run's terminal state. Raises
    :class:`~cyclone_dsl.RunNotFound` if the run does not exist (or is purged)."""
    last: dict[str, Any] | None = None
    while True:
        run = await client.get_run(run_id)
        # Progress is read after the state: the terminal status has the final counts.
        done, total = await client.progress(run_id)
        status = {"run_id": run_id, "state": run.state.value, "done": done, "total": total}
        if status != last:
            yield status
            last = status
        if run.state.is_terminal:
            return
        await asyncio.sleep(interval)


async def status_stream(
    client: AsyncClient, run_id: int, *, interval: float = 0.5
) -> StreamingResponse:
    """A ``text/event-stream`` response: one ``data: {json}`` event per change of
    :func:`status_events`; the stream ends when the run ends. 404 if there is no such run.
    """
    try:
        await client.get_run(run_id)
    except RunNotFound:
        raise HTTPException(status_code=404, detail=f"no run {run_id}") from None

    async def events() -> AsyncIterator[str]:
        async for status in status_events(client, run_id, interval=interval):
            yield f"data: {json.dumps(status)}\n\n"

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
