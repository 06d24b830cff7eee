"""AsyncClient: the Client's API as coroutines.

Each call runs the same short engine transaction as :class:`Client`, on a
worker thread (``asyncio.to_thread``), so both clients share one code path
for every transition. Waiting for a run is natively asynchronous: it
LISTENs on an async connection and never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any

import attrs
import psycopg

from cyclone_dsl.client.handle import RECHECK_SECONDS
from cyclone_dsl.client.model import Run
from cyclone_dsl.client.sync import Client
from cyclone_dsl.db.listen import listen_async
from cyclone_dsl.dsl.registry import Registry
from cyclone_dsl.engine.notify import RUN_DONE_CHANNEL, names_run
from cyclone_dsl.engine.signals import Delivery
from cyclone_dsl.errors import RunNotFound
from cyclone_dsl.payload import JSONValue
from cyclone_dsl.sql import Q
from cyclone_dsl.states import RunState


@attrs.frozen
class AsyncRunHandle:
    id: int
    client: AsyncClient = attrs.field(repr=False, eq=False)
    created: bool = True

    async def wait(self, timeout: float | None = None) -> Run:
        await self.client.wait_terminal(self.id, timeout)
        return await self.client.get_run(self.id)

    async def result(self, timeout: float | None = None) -> JSONValue:
        await self.client.wait_terminal(self.id, timeout)
        return await asyncio.to_thread(self.client.sync.outcome, self.id)


class AsyncClient:
    """``async with AsyncClient(dsn) as client: handle = await client.submit(wf, input)``."""

    def __init__(
        self,
        dsn: str | None = None,
        *,
        registry: Registry | None = None,
        pool_size: int = 4,
        shift: timedelta = timedelta(0),
    ) -> None:
        self.sync = Client(dsn, registry=registry, pool_size=pool_size, shift=shift)

    async def close(self) -> None:
        await asyncio.to_thread(self.sync.close)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def _handle(self, run_id: int, created: bool = True) -> AsyncRunHandle:
        return AsyncRunHandle(run_id, self, created)

    async def submit(
        self, workflow: object, input: JSONValue = None, *, deadline: timedelta | None = None
    ) -> AsyncRunHandle:
        handle = await asyncio.to_thread(self.sync.submit, workflow, input, deadline=deadline)
        return self._handle(handle.id)

    async def submit_once(
        self,
        workflow: object,
        input: JSONValue = None,
        *,
        key: str,
        deadline: timedelta | None = None,
    ) -> AsyncRunHandle:
        handle = await asyncio.to_thread(
            self.sync.submit_once, workflow, input, key=key, deadline=deadline
        )
        return self._handle(handle.id, handle.created)

    async def enqueue(
        self,
        step: object,
        input: JSONValue = None,
        *,
        queue: str | None = None,
        priority: int | None = None,
        scheduled_at: datetime | None = None,
        max_attempts: int | None = None,
        timeout: timedelta | float | None = None,
        unique_key: str | None = None,
        sequence_key: str | None = None,
        retention: timedelta | float | None = None,
    ) -> AsyncRunHandle:
        handle = await asyncio.to_thread(
            self.sync.enqueue,
            step,
            input,
            queue=queue,
            priority=priority,
            scheduled_at=scheduled_at,
            max_attempts=max_attempts,
            timeout=timeout,
            unique_key=unique_key,
            sequence_key=sequence_key,
            retention=retention,
        )
        return self._handle(handle.id, handle.created)

    async def get_run(self, run_id: int) -> Run:
        return await asyncio.to_thread(self.sync.get_run, run_id)

    async def list_runs(self, **filters: Any) -> list[Run]:
        return await asyncio.to_thread(lambda: self.sync.list_runs(**filters))

    async def cancel(self, run_id: int) -> None:
        await asyncio.to_thread(self.sync.cancel, run_id)

    async def retry(self, run_id: int, node: str) -> None:
        await asyncio.to_thread(self.sync.retry, run_id, node)

    async def signal(self, run_id: int, name: str, payload: JSONValue = None) -> Delivery:
        return await asyncio.to_thread(self.sync.signal, run_id, name, payload)

    async def pause(self, run_id: int) -> None:
        await asyncio.to_thread(self.sync.pause, run_id)

    async def resume(self, run_id: int) -> None:
        await asyncio.to_thread(self.sync.resume, run_id)

    async def wait_terminal(self, run_id: int, timeout: float | None) -> str:
        """Wait on an async LISTEN connection until the run is terminal."""
        deadline = None if timeout is None else time.monotonic() + timeout
        async with await psycopg.AsyncConnection.connect(
            self.sync.dsn, autocommit=True, application_name="cyclone-wait"
        ) as conn:
            await listen_async(conn, RUN_DONE_CHANNEL)
            while True:
                cur = await conn.execute(Q.get_run_state, {"run_id": run_id})
                row = await cur.fetchone()
                if row is None:
                    raise RunNotFound(run_id)
                if RunState(row[1]).is_terminal:
                    return str(row[1])
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"run {run_id} is still {row[1]} after {timeout}s")
                wait_for = RECHECK_SECONDS if remaining is None else min(RECHECK_SECONDS, remaining)
                async for note in conn.notifies(timeout=wait_for):
                    if names_run(note.payload, run_id):
                        break
