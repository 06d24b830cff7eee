"""AsyncClient: the Client's API as coroutines, method for method.

Each call runs the same engine transition as :class:`Client`, in the same
short pooled transaction, on a worker thread (``asyncio.to_thread``): one code
path for every transition. The ``*_tx`` methods run the engine inside the
caller's own transaction on its :class:`psycopg.AsyncConnection` (see
:mod:`cyclone_dsl.db.callers`). Waiting for a run is natively asynchronous:
the same wait plan as the sync client's, on an async LISTEN connection.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any

import attrs

from cyclone_dsl.arguments import checked_flag
from cyclone_dsl.client import base, bulk
from cyclone_dsl.client.bulk import BulkResult, Progress
from cyclone_dsl.client.handle import EVENTS_PAGE, checked_after
from cyclone_dsl.client.model import Run, StepEvent
from cyclone_dsl.client.schedules import Schedule
from cyclone_dsl.client.sync import Client
from cyclone_dsl.db.callers import AsyncConnection, in_callers_async_transaction
from cyclone_dsl.db.clock import current_shift
from cyclone_dsl.dsl import runs
from cyclone_dsl.dsl.flow import Debounce
from cyclone_dsl.dsl.registry import Registry
from cyclone_dsl.engine import DEFAULT_BATCH_SIZE, BulkAction, Delivery, RunFilter
from cyclone_dsl.payload import JSONValue
from cyclone_dsl.states import RunState


@attrs.frozen
class AsyncRunHandle:
    """A reference to a submitted run. ``created`` is False when an existing run was returned."""

    id: int
    client: AsyncClient = attrs.field(repr=False, eq=False)
    created: bool = True

    async def get(self) -> Run:
        return await self.client.get_run(self.id)

    async def wait(self, timeout: float | None = None) -> Run:
        """Wait until the run is terminal and return it; ``TimeoutError`` after ``timeout`` s."""
        return await self.client.wait(self.id, timeout)

    async def result(self, timeout: float | None = None) -> JSONValue:
        """Wait, then return the result (see :meth:`RunHandle.result`)."""
        return await self.client.result(self.id, timeout)

    def events(self, after: int = 0, *, timeout: float | None = None) -> AsyncIterator[StepEvent]:
        """``async for event in handle.events():`` the run's events, live (see
        :meth:`RunHandle.events`)."""
        return self.client.events(self.id, after=after, timeout=timeout)


class AsyncClient:
    """``async with AsyncClient(dsn) as client: handle = await client.submit(wf, input)``.

    Every method of :class:`Client`, with the same parameters, as a coroutine
    (except :meth:`handle`, which does no I/O). With ``tracing=``, a submit's span is a
    child of the span current in the calling task. One client may be shared by every task
    (and thread) of a process, as a :class:`Client` may.

    A call whose task is cancelled (a request's timeout) may still have happened: the
    write is whole or absent, but a cancel can land after it committed. A caller that
    retries a cancelled submit should use :meth:`submit_once` with a key.

    The constructor checks the database and opens the pool as :class:`Client` does,
    blocking: on a running event loop, build it with
    ``await asyncio.to_thread(AsyncClient, dsn)`` (as ``cyclone_lifespan`` does) so an
    unreachable server does not stall the loop for the connect timeout.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        registry: Registry | None = None,
        pool_size: int = 4,
        pooled: bool | None = None,
        listen_dsn: str | None = None,
        tracing: object = False,
    ) -> None:
        self._client = Client(
            dsn,
            registry=registry,
            pool_size=pool_size,
            pooled=pooled,
            listen_dsn=listen_dsn,
            tracing=tracing,
        )
        self.dsn = self._client.dsn
        self.registry = self._client.registry
        self.pooled = self._client.pooled
        self.wait_route = self._client.wait_route

    async def close(self) -> None:
        await asyncio.to_thread(self._client.close)

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

    # -- submitting ----------------------------------------------------------------

    async def submit(
        self,
        workflow: object,
        input: JSONValue = None,
        *,
        deadline: timedelta | None = None,
        debounce: Debounce | None = None,
    ) -> AsyncRunHandle:
        """See :meth:`Client.submit`."""
        handle = await asyncio.to_thread(
            self._client.submit, workflow, input, deadline=deadline, debounce=debounce
        )
        return self._handle(handle.id, handle.created)

    async def submit_tx(
        self,
        conn: AsyncConnection,
        workflow: object,
        input: JSONValue = None,
        *,
        deadline: timedelta | None = None,
    ) -> AsyncRunHandle:
        """:meth:`Client.submit_tx` on the caller's async connection: the run exists iff the
        caller commits. Every workflow shape is accepted."""
        compiled = runs.compile_workflow(self.registry, workflow, input)
        deadline = base.check_deadline(deadline)
        engine = self._client._engine
        tracing = self._client._tracing
        if tracing is None:
            run_id = await in_callers_async_transaction(
                conn,
                lambda tx: engine.submit(tx, compiled, deadline=deadline),
                shift=current_shift(),
            )
            return self._handle(run_id)
        with tracing.span("submit", compiled.workflow) as span:
            run_id = await in_callers_async_transaction(
                conn,
                lambda tx: engine.submit(tx, compiled, deadline=deadline),
                shift=current_shift(),
            )
            tracing.note_runs(span, [run_id])
        return self._handle(run_id)

    async def submit_many(
        self,
        workflow: object,
        inputs: list[JSONValue],
        *,
        deadline: timedelta | None = None,
    ) -> list[AsyncRunHandle]:
        """See :meth:`Client.submit_many`."""
        handles = await asyncio.to_thread(
            self._client.submit_many, workflow, inputs, deadline=deadline
        )
        return [self._handle(h.id) for h in handles]

    async def submit_once(
        self,
        workflow: object,
        input: JSONValue = None,
        *,
        key: str,
        deadline: timedelta | None = None,
    ) -> AsyncRunHandle:
        """See :meth:`Client.submit_once`."""
        handle = await asyncio.to_thread(
            self._client.submit_once, workflow, input, key=key, deadline=deadline
        )
        return self._handle(handle.id, handle.created)

    async def submit_once_tx(
        self,
        conn: AsyncConnection,
        workflow: object,
        input: JSONValue = None,
        *,
        key: str,
        deadline: timedelta | None = None,
    ) -> AsyncRunHandle:
        """:meth:`Client.submit_once_tx` on the caller's async connection."""
        base.check_key("key", key)
        compiled = runs.compile_workflow(self.registry, workflow, input)
        deadline = base.check_deadline(deadline)
        engine = self._client._engine
        submitted = await in_callers_async_transaction(
            conn,
            lambda tx: engine.submit_once(tx, compiled, key=key, deadline=deadline),
            shift=current_shift(),
        )
        return self._handle(submitted.run_id, submitted.created)

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
        concurrency_key: str | None = None,
    ) -> AsyncRunHandle:
        """See :meth:`Client.enqueue`."""
        handle = await asyncio.to_thread(
            self._client.enqueue,
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
            concurrency_key=concurrency_key,
        )
        return self._handle(handle.id, handle.created)

    async def enqueue_tx(
        self,
        conn: AsyncConnection,
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
        concurrency_key: str | None = None,
    ) -> AsyncRunHandle:
        """:meth:`Client.enqueue_tx` on the caller's async connection."""
        compiled = self._client._standalone(
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
            concurrency_key=concurrency_key,
        )
        enqueue = self._client._enqueue
        tracing = self._client._tracing
        if tracing is None:
            submitted = await in_callers_async_transaction(
                conn,
                lambda tx: enqueue(tx, compiled, unique_key, sequence_key, scheduled_at),
                shift=current_shift(),
            )
            return self._handle(submitted.run_id, submitted.created)
        with tracing.span("enqueue", compiled.workflow) as span:
            submitted = await in_callers_async_transaction(
                conn,
                lambda tx: enqueue(tx, compiled, unique_key, sequence_key, scheduled_at),
                shift=current_shift(),
            )
            tracing.note_runs(span, [submitted.run_id])
        return self._handle(submitted.run_id, submitted.created)

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
        """See :meth:`Client.enqueue_many`."""
        handles = await asyncio.to_thread(
            self._client.enqueue_many,
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
        """A handle to an existing run (no database access)."""
        run_id = base.checked_run_id(run_id)
        return self._handle(run_id, created=False)

    # -- reading ---------------------------------------------------------------------

    async def get_run(self, run_id: int) -> Run:
        """See :meth:`Client.get_run`."""
        return await asyncio.to_thread(self._client.get_run, run_id)

    async def list_runs(
        self,
        *,
        state: RunState | str | None = None,
        workflow: str | None = None,
        limit: int = 50,
        before_id: int | None = None,
        parent_run_id: int | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        text: str | None = None,
        error_kind: str | None = None,
    ) -> list[Run]:
        """See :meth:`Client.list_runs`."""
        return await asyncio.to_thread(
            self._client.list_runs,
            state=state,
            workflow=workflow,
            limit=limit,
            before_id=before_id,
            parent_run_id=parent_run_id,
            since=since,
            until=until,
            text=text,
            error_kind=error_kind,
        )

    async def progress(self, run_id: int) -> tuple[int, int]:
        """See :meth:`Client.progress`."""
        return await asyncio.to_thread(self._client.progress, run_id)

    async def dependencies(self, run_id: int) -> dict[str, list[str]]:
        """See :meth:`Client.dependencies`."""
        return await asyncio.to_thread(self._client.dependencies, run_id)

    async def signals_of(self, run_id: int) -> list[dict[str, Any]]:
        """See :meth:`Client.signals_of`."""
        return await asyncio.to_thread(self._client.signals_of, run_id)

    async def children_of(self, run_id: int) -> list[dict[str, Any]]:
        """See :meth:`Client.children_of`."""
        return await asyncio.to_thread(self._client.children_of, run_id)

    async def run_counts(self) -> dict[str, int]:
        """See :meth:`Client.run_counts`."""
        return await asyncio.to_thread(self._client.run_counts)

    async def outcome(self, run_id: int) -> JSONValue:
        """See :meth:`Client.outcome`."""
        return await asyncio.to_thread(self._client.outcome, run_id)

    async def wait(self, run_id: int, timeout: float | None = None) -> Run:
        """See :meth:`Client.wait`; never blocks the event loop."""
        run_id = base.checked_run_id(run_id)
        self._client._db.check_open()
        await self._wait_for_end(run_id, timeout)
        return await self.get_run(run_id)

    async def result(self, run_id: int, timeout: float | None = None) -> JSONValue:
        """See :meth:`Client.result`; never blocks the event loop."""
        run_id = base.checked_run_id(run_id)
        self._client._db.check_open()
        await self._wait_for_end(run_id, timeout)
        return await self.outcome(run_id)

    async def _wait_for_end(self, run_id: int, timeout: float | None) -> None:
        await self._client._watcher.wait_async(run_id, timeout)

    def events(
        self, run_id: int, after: int = 0, *, timeout: float | None = None
    ) -> AsyncIterator[StepEvent]:
        """See :meth:`Client.events`: ``async for event in client.events(run_id):``, on the
        client's watcher (never blocks the event loop)."""
        run_id = base.checked_run_id(run_id)
        after = checked_after(after)
        self._client._db.check_open()
        return self._client._watcher.follow_async(run_id, after, timeout)

    async def events_of(
        self, run_id: int, after: int = 0, limit: int = EVENTS_PAGE
    ) -> list[StepEvent]:
        """See :meth:`Client.events_of`."""
        return await asyncio.to_thread(self._client.events_of, run_id, after, limit)

    # -- steering ----------------------------------------------------------------------

    async def cancel(self, run_id: int) -> None:
        """See :meth:`Client.cancel`."""
        run_id = base.checked_run_id(run_id)
        await asyncio.to_thread(self._client.cancel, run_id)

    async def fork(
        self,
        run_id: int,
        from_node: str,
        *,
        input: JSONValue | base.Unset = base.UNSET,
        current_definition: bool = False,
    ) -> AsyncRunHandle:
        """See :meth:`Client.fork`."""
        handle = await asyncio.to_thread(
            self._client.fork,
            run_id,
            from_node,
            input=input,
            current_definition=current_definition,
        )
        return self._handle(handle.id)

    async def retry(self, run_id: int, node: str, *, force: bool = False) -> None:
        """See :meth:`Client.retry`."""
        run_id = base.checked_run_id(run_id)
        await asyncio.to_thread(self._client.retry, run_id, node, force=force)

    async def signal(self, run_id: int, name: str, payload: JSONValue = None) -> Delivery:
        """See :meth:`Client.signal`."""
        return await asyncio.to_thread(self._client.signal, run_id, name, payload)

    async def pause(self, run_id: int) -> None:
        """See :meth:`Client.pause`."""
        run_id = base.checked_run_id(run_id)
        await asyncio.to_thread(self._client.pause, run_id)

    async def resume(self, run_id: int) -> None:
        """See :meth:`Client.resume`."""
        run_id = base.checked_run_id(run_id)
        await asyncio.to_thread(self._client.resume, run_id)

    # -- operations in bulk ------------------------------------------------------------

    async def cancel_many(
        self,
        where: RunFilter,
        *,
        dry_run: bool = False,
        progress: Progress | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> BulkResult:
        """See :meth:`Client.cancel_many`; ``progress`` is called on the event
        loop (a coroutine function is awaited there)."""
        return await self._bulk(BulkAction.CANCEL, where, dry_run, progress, batch_size)

    async def retry_many(
        self,
        where: RunFilter,
        *,
        dry_run: bool = False,
        progress: Progress | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> BulkResult:
        """See :meth:`Client.retry_many`; ``progress`` is called on the event
        loop (a coroutine function is awaited there)."""
        return await self._bulk(BulkAction.RETRY, where, dry_run, progress, batch_size)

    async def resume_many(
        self,
        where: RunFilter,
        *,
        dry_run: bool = False,
        progress: Progress | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> BulkResult:
        """See :meth:`Client.resume_many`; ``progress`` is called on the event
        loop (a coroutine function is awaited there)."""
        return await self._bulk(BulkAction.RESUME, where, dry_run, progress, batch_size)

    async def _bulk(
        self,
        action: BulkAction,
        where: RunFilter,
        dry_run: bool,
        progress: Progress | None,
        batch_size: int,
    ) -> BulkResult:
        where = bulk.check(where, batch_size, progress, awaits=True)
        if checked_flag("dry_run", dry_run):
            return await asyncio.to_thread(self._client._bulk_dry_run, action, where)
        pages = self._client._bulk_pages(action, where, batch_size)
        result: BulkResult | None = None
        # One batch per thread hop; the progress callback runs here, on the loop. A batch's
        # thread cannot be stopped once it runs: a cancel (asked for by ``progress`` too)
        # must stop the call at the yield before the next hop, not after that batch.
        while True:
            await asyncio.sleep(0)
            found = await asyncio.to_thread(next, pages, None)
            if found is None:
                break
            result = found
            if progress is not None and inspect.isawaitable(reported := progress(result)):
                await reported
        assert result is not None  # the pages yield at least once
        return result

    # -- schedules, retention, stats -------------------------------------------------

    async def schedule(
        self,
        target: object,
        cron: str,
        *,
        id: str | None = None,
        location: str | None = None,
        enabled: bool = True,
        input: JSONValue = None,
        queue: str | None = None,
        priority: int | None = None,
        max_attempts: int | None = None,
        timeout: timedelta | float | None = None,
        retention: timedelta | float | None = None,
    ) -> Schedule:
        """See :meth:`Client.schedule`."""
        return await asyncio.to_thread(
            self._client.schedule,
            target,
            cron,
            id=id,
            location=location,
            enabled=enabled,
            input=input,
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            timeout=timeout,
            retention=retention,
        )

    async def register_schedules(self) -> list[str]:
        """See :meth:`Client.register_schedules`."""
        return await asyncio.to_thread(self._client.register_schedules)

    async def unschedule(self, schedule_id: str) -> None:
        """See :meth:`Client.unschedule`."""
        await asyncio.to_thread(self._client.unschedule, schedule_id)

    async def enable_schedule(self, schedule_id: str, enabled: bool = True) -> None:
        """See :meth:`Client.enable_schedule`."""
        await asyncio.to_thread(self._client.enable_schedule, schedule_id, enabled)

    async def list_schedules(self) -> list[Schedule]:
        """See :meth:`Client.list_schedules`."""
        return await asyncio.to_thread(self._client.list_schedules)

    async def purge(
        self,
        *,
        older_than: timedelta = timedelta(0),
        states: tuple[RunState | str, ...] = base.ENDED_STATES,
        batch_size: int = 1000,
    ) -> int:
        """See :meth:`Client.purge`."""
        return await asyncio.to_thread(
            self._client.purge, older_than=older_than, states=states, batch_size=batch_size
        )

    async def set_queue_limit(self, queue: str, limit: int | None) -> None:
        """See :meth:`Client.set_queue_limit`."""
        await asyncio.to_thread(self._client.set_queue_limit, queue, limit)

    async def why_waiting(self, run_id: int) -> dict[str, str]:
        """See :meth:`Client.why_waiting`."""
        return await asyncio.to_thread(self._client.why_waiting, run_id)

    async def count_purgeable(
        self,
        *,
        older_than: timedelta = timedelta(0),
        states: tuple[RunState | str, ...] = base.ENDED_STATES,
    ) -> int:
        """See :meth:`Client.count_purgeable`."""
        return await asyncio.to_thread(
            self._client.count_purgeable, older_than=older_than, states=states
        )

    async def stats(self, *, live_for: timedelta | None = None) -> dict[str, list[dict[str, Any]]]:
        """See :meth:`Client.stats`."""
        return await asyncio.to_thread(lambda: self._client.stats(live_for=live_for))

    async def gauges(self) -> list[dict[str, Any]]:
        """See :meth:`Client.gauges`."""
        return await asyncio.to_thread(self._client.gauges)

    async def workers(self, *, live_for: timedelta | None = None) -> list[dict[str, Any]]:
        """See :meth:`Client.workers`."""
        return await asyncio.to_thread(lambda: self._client.workers(live_for=live_for))

    async def throughput(
        self, *, window: timedelta = timedelta(hours=1), buckets: int = 30
    ) -> list[dict[str, Any]]:
        """See :meth:`Client.throughput`."""
        return await asyncio.to_thread(
            lambda: self._client.throughput(window=window, buckets=buckets)
        )
