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

from cyclone_dsl.client import base
from cyclone_dsl.client.handle import RECONNECT_SECONDS, check_state, recheck_in
from cyclone_dsl.client.model import Run
from cyclone_dsl.client.sync import Client
from cyclone_dsl.db.connect import connect_async
from cyclone_dsl.db.listen import PING_TIMEOUT_S, answer_within, listen_async
from cyclone_dsl.dsl.registry import Registry
from cyclone_dsl.engine.notify import RUN_DONE_CHANNEL, names_run
from cyclone_dsl.engine.signals import Delivery
from cyclone_dsl.engine.submit import insert_run_params
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

    async def submit_tx(
        self,
        conn: psycopg.AsyncConnection[Any],
        workflow: object,
        input: JSONValue = None,
        *,
        deadline: timedelta | None = None,
    ) -> AsyncRunHandle:
        """Submit inside the caller's open transaction: the run exists iff the caller commits.

        For workflows that start with steps: one whose root is a wait, timer,
        child or fan-out needs the engine's activation in the same transaction,
        which runs on synchronous connections only (:meth:`Client.submit_tx`);
        it is refused with :class:`InvalidArgument` and nothing is written.
        """
        compiled = base.compile_workflow(self.sync.registry, workflow, input)
        params = insert_run_params(compiled, deadline=base.check_deadline(deadline))
        cur = await conn.execute(Q.insert_run_graph, {**params, "shift": self.sync.shift})
        row = await cur.fetchone()
        assert row is not None
        return self._handle(row[0])

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

    async def submit_many(
        self,
        workflow: object,
        inputs: list[JSONValue],
        *,
        deadline: timedelta | None = None,
    ) -> list[AsyncRunHandle]:
        """Start one run per input, all in one transaction (see :meth:`Client.submit_many`)."""
        handles = await asyncio.to_thread(
            self.sync.submit_many, workflow, inputs, deadline=deadline
        )
        return [self._handle(h.id) for h in handles]

    async def enqueue_many(
        self,
        step: object,
        inputs: list[JSONValue],
        *,
        queue: str | None = None,
        priority: int | None = None,
        scheduled_at: datetime | None = None,
        max_attempts: int | None = None,
        timeout: timedelta | float | None = None,
        retention: timedelta | float | None = None,
    ) -> list[AsyncRunHandle]:
        """One standalone step per input, in one transaction (see :meth:`Client.enqueue_many`)."""
        handles = await asyncio.to_thread(
            self.sync.enqueue_many,
            step,
            inputs,
            queue=queue,
            priority=priority,
            scheduled_at=scheduled_at,
            max_attempts=max_attempts,
            timeout=timeout,
            retention=retention,
        )
        return [self._handle(h.id) for h in handles]

    def handle(self, run_id: int) -> AsyncRunHandle:
        """A handle on an existing run (nothing is read until it is awaited)."""
        return self._handle(run_id)

    async def purge(
        self,
        *,
        older_than: timedelta = timedelta(0),
        states: tuple[RunState | str, ...] = base.ENDED_STATES,
        batch_size: int = 1000,
    ) -> int:
        """Delete terminal runs in batches (see :meth:`Client.purge`)."""
        return await asyncio.to_thread(
            self.sync.purge, older_than=older_than, states=states, batch_size=batch_size
        )

    async def get_run(self, run_id: int) -> Run:
        return await asyncio.to_thread(self.sync.get_run, run_id)

    async def list_runs(self, **filters: Any) -> list[Run]:
        return await asyncio.to_thread(lambda: self.sync.list_runs(**filters))

    async def cancel(self, run_id: int) -> None:
        await asyncio.to_thread(self.sync.cancel, run_id)

    async def retry(self, run_id: int, node: str) -> None:
        """Operator retry: run again what the run needs to finish, starting from ``node``.

        The same retry as :meth:`Client.retry` (what runs again, what is refused
        with :class:`InvalidTransition` and nothing changed), run in a thread.
        """
        await asyncio.to_thread(self.sync.retry, run_id, node)

    async def signal(self, run_id: int, name: str, payload: JSONValue = None) -> Delivery:
        return await asyncio.to_thread(self.sync.signal, run_id, name, payload)

    async def pause(self, run_id: int) -> None:
        await asyncio.to_thread(self.sync.pause, run_id)

    async def resume(self, run_id: int) -> None:
        await asyncio.to_thread(self.sync.resume, run_id)

    async def wait_terminal(self, run_id: int, timeout: float | None) -> str:
        """Wait on an async LISTEN connection until the run is terminal (see the sync one)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return await self._wait_on_one_connection(run_id, deadline, timeout)
            except psycopg.OperationalError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"run {run_id}: no answer from PostgreSQL in {timeout}s"
                    ) from None
                await asyncio.sleep(RECONNECT_SECONDS)

    async def _wait_on_one_connection(
        self, run_id: int, deadline: float | None, timeout: float | None
    ) -> str:
        async with await connect_async(self.sync.dsn, name="cyclone-wait") as conn:
            await listen_async(conn, RUN_DONE_CHANNEL)
            while True:
                with answer_within(conn, PING_TIMEOUT_S):
                    cur = await conn.execute(Q.get_run_state, {"run_id": run_id})
                    row = await cur.fetchone()
                found = None if row is None else {"state": row[1]}
                state = check_state(found, run_id, deadline, timeout)
                if state is not None:
                    return state
                async for note in conn.notifies(timeout=recheck_in(deadline)):
                    if names_run(note.payload, run_id):
                        break
