"""Client: submit runs and standalone work, read them, and steer them (sync, pooled)."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, TypeVar

import psycopg
from psycopg_pool import PoolTimeout

from cyclone_dsl.client import base
from cyclone_dsl.client import schedules as schedules_api
from cyclone_dsl.client.handle import RunHandle, outcome_from_row
from cyclone_dsl.client.model import Attempt, Run, Step
from cyclone_dsl.client.schedules import Schedule
from cyclone_dsl.db.connect import make_pool
from cyclone_dsl.db.diagnose import check_reachable, describe_server, is_connection_loss, parse_dsn
from cyclone_dsl.db.embedded import ENV_URL
from cyclone_dsl.db.tx import Tx, in_autocommit, in_transaction
from cyclone_dsl.dsl.registry import Registry, default_registry
from cyclone_dsl.engine import control, signals, waits, workers
from cyclone_dsl.engine.hooks import engine_hooks
from cyclone_dsl.engine.signals import Delivery
from cyclone_dsl.engine.submit import (
    insert_run,
    insert_run_once,
    insert_runs,
    insert_standalone,
    is_one_statement,
)
from cyclone_dsl.errors import DatabaseUnavailable, InvalidArgument, RunNotFound, ScheduleError
from cyclone_dsl.migrate import check_database
from cyclone_dsl.payload import JSONValue, encode
from cyclone_dsl.sql import Q
from cyclone_dsl.states import RunState

T = TypeVar("T")


def _pool_unavailable(dsn: str, exc: PoolTimeout) -> DatabaseUnavailable:
    """Why the pool gave no connection: the server (named cause), or a busy pool."""
    try:
        check_reachable(dsn, name="cyclone-client-check")
    except DatabaseUnavailable as cause:
        return cause
    return DatabaseUnavailable(
        f"no pooled connection to {describe_server(parse_dsn(dsn))} became free in time "
        f"({exc}): raise pool_size, or make fewer calls at once",
        "pool_exhausted",
    )


class Client:
    """The producer's entry point: ``Client(dsn)``, or ``Client()`` with ``$CYCLONE_DATABASE_URL``.

    Holds a small connection pool; close it with :meth:`close` or a ``with``
    block. Workflows are given as the decorated objects, or by name when they
    are registered in ``registry`` (the process-wide default registry unless
    one is passed).
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        registry: Registry | None = None,
        pool_size: int = 4,
        shift: timedelta = timedelta(0),
    ) -> None:
        resolved = dsn or os.environ.get(ENV_URL)
        if not resolved:
            raise InvalidArgument(
                f"Client needs a DSN: pass one, or set {ENV_URL} (see embedded_database())"
            )
        self.dsn = resolved
        self.registry = registry if registry is not None else default_registry()
        self.shift = shift
        self.hooks = engine_hooks(self.registry)
        check_database(resolved, name="cyclone-client")
        try:
            self._pool = make_pool(resolved, name="cyclone-client", max_size=pool_size)
        except PoolTimeout as exc:
            raise _pool_unavailable(resolved, exc) from exc

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _tx(self, work: Callable[[Tx], T], *, one_statement: bool = False) -> T:
        """Run ``work`` in a transaction, or in autocommit mode when it is one statement
        (atomic on its own, and two round trips shorter without BEGIN and COMMIT)."""
        run = in_autocommit if one_statement else in_transaction
        try:
            return run(self._pool, work, shift=self.shift)
        except PoolTimeout as exc:
            raise _pool_unavailable(self.dsn, exc) from exc
        except psycopg.OperationalError as exc:
            if not is_connection_loss(exc):
                raise
            server = describe_server(parse_dsn(self.dsn))
            raise DatabaseUnavailable(
                f"the connection to {server} was lost: {str(exc).strip().splitlines()[0]}: "
                "the call did not finish (if it was a write, check whether it happened); "
                "the next call opens a new connection",
                "connection_lost",
            ) from exc

    # -- submitting ----------------------------------------------------------------

    def submit(
        self, workflow: object, input: JSONValue = None, *, deadline: timedelta | None = None
    ) -> RunHandle:
        """Start a run of ``workflow`` with ``input``; the whole graph is written at once."""
        compiled = base.compile_workflow(self.registry, workflow, input)
        deadline = base.check_deadline(deadline)
        run_id = self._tx(
            lambda tx: insert_run(tx, compiled, deadline=deadline, hooks=self.hooks),
            one_statement=is_one_statement(compiled),
        )
        return RunHandle(run_id, self)

    def submit_many(
        self,
        workflow: object,
        inputs: list[JSONValue],
        *,
        deadline: timedelta | None = None,
    ) -> list[RunHandle]:
        """Start one run per input, all in one transaction (the graph is sent once): bulk loads."""
        template = base.workflow_template(self.registry, workflow)
        texts = [encode(value, what="the run input") for value in inputs]
        deadline = base.check_deadline(deadline)
        ids = self._tx(
            lambda tx: insert_runs(tx, template, texts, deadline=deadline, hooks=self.hooks)
        )
        return [RunHandle(run_id, self) for run_id in ids]

    def enqueue_many(
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
    ) -> list[RunHandle]:
        """Enqueue one standalone step per input, in one transaction (no unique/sequence keys)."""
        template = base.standalone_template(
            self.registry,
            step,
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            timeout=timeout,
            retention=retention,
        )
        base.check_standalone_inputs(base.resolve_step(self.registry, step), inputs)
        texts = [encode(value, what="the input") for value in inputs]
        if scheduled_at is not None and scheduled_at.tzinfo is None:
            raise InvalidArgument("scheduled_at must be timezone-aware")
        ids = self._tx(lambda tx: insert_runs(tx, template, texts, scheduled_at=scheduled_at))
        return [RunHandle(run_id, self) for run_id in ids]

    def submit_tx(
        self,
        conn: psycopg.Connection[Any],
        workflow: object,
        input: JSONValue = None,
        *,
        deadline: timedelta | None = None,
    ) -> RunHandle:
        """Submit inside the caller's open transaction: the run exists iff the caller commits."""
        compiled = base.compile_workflow(self.registry, workflow, input)
        deadline = base.check_deadline(deadline)
        run_id = insert_run(Tx(conn, self.shift), compiled, deadline=deadline, hooks=self.hooks)
        return RunHandle(run_id, self)

    def submit_once(
        self,
        workflow: object,
        input: JSONValue = None,
        *,
        key: str,
        deadline: timedelta | None = None,
    ) -> RunHandle:
        """Start a run unless one of this workflow already holds ``key`` (in any state).

        Returns the existing run's handle in that case, with ``created=False``.
        Race-free: concurrent callers with one key get one run.
        """
        base.check_key("key", key)
        compiled = base.compile_workflow(self.registry, workflow, input)
        deadline = base.check_deadline(deadline)
        submitted = self._tx(
            lambda tx: insert_run_once(
                tx, compiled, submit_key=key, deadline=deadline, hooks=self.hooks
            )
        )
        return RunHandle(submitted.run_id, self, submitted.created)

    def enqueue(
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
    ) -> RunHandle:
        """Enqueue standalone work: one run of one step (its ``workflow`` is the kind).

        With ``unique_key``, at most one active step per (kind, key) exists: a
        duplicate returns the holder's handle with ``created=False``. With
        ``sequence_key``, steps of one key run one at a time, FIFO.
        """
        compiled = base.compile_standalone(
            self.registry,
            step,
            input,
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            timeout=timeout,
            retention=retention,
        )
        if unique_key is not None:
            base.check_key("unique_key", unique_key)
        if sequence_key is not None:
            base.check_key("sequence_key", sequence_key)
        if scheduled_at is not None and scheduled_at.tzinfo is None:
            raise InvalidArgument("scheduled_at must be timezone-aware")
        submitted = self._tx(
            lambda tx: insert_standalone(
                tx,
                compiled,
                unique_key=unique_key,
                sequence_key=sequence_key,
                scheduled_at=scheduled_at,
            ),
            one_statement=unique_key is None,  # a unique key may need a re-read and a retry
        )
        return RunHandle(submitted.run_id, self, submitted.created)

    def handle(self, run_id: int) -> RunHandle:
        """A handle to an existing run (no database access)."""
        return RunHandle(run_id, self, created=False)

    # -- reading ---------------------------------------------------------------------

    def get_run(self, run_id: int) -> Run:
        """The run with every step, or :class:`RunNotFound`."""

        def read(tx: Tx) -> Run:
            row = tx.one(Q.get_run, run_id=run_id)
            if row is None:
                raise RunNotFound(run_id)
            history: dict[int, list[Attempt]] = {}
            for a in tx.rows(Q.get_run_attempts, run_id=run_id):
                history.setdefault(a["step_id"], []).append(Attempt.from_row(a))
            steps = tuple(
                Step.from_row(s, tuple(history.get(s["id"], ())))
                for s in tx.rows(Q.get_run_steps, run_id=run_id)
            )
            return Run.from_row(row, steps)

        return self._tx(read)

    def list_runs(
        self,
        *,
        state: RunState | str | None = None,
        workflow: str | None = None,
        limit: int = 50,
        before_id: int | None = None,
        parent_run_id: int | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> list[Run]:
        """Runs newest first (without steps); page with ``before_id`` = the last id seen.

        Filters: ``state``, ``workflow``, ``parent_run_id`` and a creation-time
        range ``since`` (inclusive) to ``until`` (exclusive).
        """
        if not 1 <= limit <= 10_000:
            raise InvalidArgument("limit must be between 1 and 10000")
        state_value = RunState(state).value if state is not None else None
        rows = self._tx(
            lambda tx: tx.rows(
                Q.list_runs,
                state=state_value,
                workflow=workflow,
                limit=limit,
                before_id=before_id,
                parent_run_id=parent_run_id,
                since=since,
                until=until,
            )
        )
        return [Run.from_row(r) for r in rows]

    def progress(self, run_id: int) -> tuple[int, int]:
        """(terminal steps, all steps) of a run."""
        row = self._tx(lambda tx: tx.one(Q.run_progress, run_id=run_id))
        return (row["done"], row["total"]) if row else (0, 0)

    def dependencies(self, run_id: int) -> dict[str, list[str]]:
        """Each node of a run with the nodes it depends on."""
        edges = self._tx(lambda tx: tx.rows(Q.get_run_deps, run_id=run_id))
        graph: dict[str, list[str]] = {}
        for edge in edges:
            graph.setdefault(edge["node"], []).append(edge["dep_node"])
        return graph

    def signals_of(self, run_id: int) -> list[dict[str, Any]]:
        """The run's signal mailbox (consumed rows included), in delivery order."""
        return self._tx(lambda tx: tx.rows(Q.run_signals, run_id=run_id))

    def children_of(self, run_id: int) -> list[dict[str, Any]]:
        """The child runs started by a run's child nodes."""
        return self._tx(lambda tx: tx.rows(Q.child_runs, run_id=run_id))

    def run_counts(self) -> dict[str, int]:
        """How many runs are in each state."""
        rows = self._tx(lambda tx: tx.rows(Q.run_counts))
        return {r["state"]: r["count"] for r in rows}

    def outcome(self, run_id: int) -> JSONValue:
        """The result of a terminal run (see :meth:`RunHandle.result`)."""
        row = self._tx(lambda tx: tx.one(Q.run_outcome, run_id=run_id))
        if row is not None and not RunState(row["state"]).is_terminal:
            raise InvalidArgument(f"run {run_id} is still {row['state']}")
        return outcome_from_row(row, run_id)

    # -- steering ----------------------------------------------------------------------

    def cancel(self, run_id: int) -> None:
        """Cancel a run and its descendant runs; :class:`AlreadyTerminal` if it has ended."""
        self._tx(lambda tx: control.cancel(tx, run_id, self.hooks))

    def retry(self, run_id: int, node: str) -> None:
        """Operator retry: run again what the run needs to finish, starting from ``node``.

        ``node`` must be discarded or cancelled; an item task ``F[i]`` stands for
        its fan-out node ``F``. The node and every cancelled step of the run go
        back to pending with a fresh attempt budget and reclaim count, except the
        steps that depend on a step that stays discarded. A fan-out keeps its
        completed items and runs its failed and cancelled ones again; a child
        node whose child run failed or was cancelled retries that child run
        (same id, reopened); a signal wait waits again with a fresh timeout
        (signals sent while it had failed were not stored); a timer runs its
        full duration. A failed, cancelled or completed run is reopened. A
        retry of a node that failed the run also retries any node that failed
        it in the same batch.

        Raises :class:`RunNotFound` or :class:`NodeNotFound`, and
        :class:`InvalidTransition` (nothing is changed) when the node is not
        discarded or cancelled, the run is paused (resume it first) or past
        its deadline, the run is a child run its parent node no longer waits
        for (retry the parent's child node instead), the node depends on a
        step that stays discarded, a node that failed the run would stay
        discarded, or another active step holds a unique key of a step to
        reset. Each message names what to retry instead.
        See docs/concepts/runs-and-steps.md, "Retrying failed work".
        """
        self._tx(lambda tx: control.retry(tx, run_id, node, self.hooks))

    def signal(self, run_id: int, name: str, payload: JSONValue = None) -> Delivery:
        """Deliver a signal to the run's wait for ``name``.

        Returns :attr:`Delivery.CONSUMED` when the waiting node took it,
        :attr:`Delivery.BUFFERED` when its wait is not active yet, and
        :attr:`Delivery.NOT_STORED` when the wait already completed. Raises
        :class:`MailboxFull` past the wait's capacity (1, or N for ``wait_n``),
        :class:`SignalNotDeliverable` for a name no wait declares and
        :class:`AlreadyTerminal` for a run that has ended.
        """
        base.check_key("signal name", name)
        text = encode(payload, what="the signal payload")
        return self._tx(lambda tx: signals.deliver(tx, run_id, name, text, self.hooks))

    # -- schedules, retention, stats -------------------------------------------------

    def schedule(
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
        """Create or update a cron schedule of a workflow, step or action (by object or name).

        A workflow's ``def_version`` is pinned: a process whose definition
        differs refuses to fire it until the schedule is registered again.
        """
        definition = base.resolve_schedulable(self.registry, target)
        spec = schedules_api.spec_for(
            cron,
            schedule_id=id,
            location=location,
            enabled=enabled,
            input_value=input,
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            timeout=timeout,
            retention=retention,
        )
        schedule_id = self._tx(lambda tx: schedules_api.register(tx, definition, spec))
        return next(s for s in self.list_schedules() if s.id == schedule_id)

    def register_schedules(self) -> list[str]:
        """Register every ``@schedule`` of this client's registry; return their ids."""
        return self._tx(lambda tx: schedules_api.register_all(tx, self.registry))

    def unschedule(self, schedule_id: str) -> None:
        """Delete a schedule; :class:`ScheduleError` if there is none with that id."""
        if not self._tx(lambda tx: tx.rows(Q.delete_schedule, id=schedule_id)):
            raise ScheduleError(f"there is no schedule {schedule_id!r}")

    def enable_schedule(self, schedule_id: str, enabled: bool = True) -> None:
        """Enable (or disable) a schedule."""
        if not self._tx(
            lambda tx: tx.rows(Q.set_schedule_enabled, id=schedule_id, enabled=enabled)
        ):
            raise ScheduleError(f"there is no schedule {schedule_id!r}")

    def list_schedules(self) -> list[Schedule]:
        return [
            schedules_api.schedule_from_row(r)
            for r in self._tx(lambda tx: tx.rows(Q.list_schedules))
        ]

    def purge(
        self,
        *,
        older_than: timedelta = timedelta(0),
        states: tuple[RunState | str, ...] = base.ENDED_STATES,
        batch_size: int = 1000,
    ) -> int:
        """Delete terminal runs that ended more than ``older_than`` ago, in batches.

        Each batch is its own short transaction. A child run is kept while its
        parent exists and has not completed. Purging frees the runs' submit keys.
        """
        wanted = [RunState(s).value for s in states]
        if any(not RunState(s).is_terminal for s in wanted):
            raise InvalidArgument("only terminal runs (completed, failed, cancelled) can be purged")
        if older_than < timedelta(0) or batch_size < 1:
            raise InvalidArgument("older_than must be >= 0 and batch_size >= 1")
        total = 0
        while True:
            deleted = self._tx(
                lambda tx: tx.rows(
                    Q.purge_runs, states=wanted, older_than=older_than, limit=batch_size
                )
            )
            total += len(deleted)
            if len(deleted) < batch_size:
                return total

    def stats(self) -> dict[str, list[dict[str, Any]]]:
        """Queues and kinds (the ``cyclone_v_queues`` and ``cyclone_v_kinds`` views), and the
        work that no live worker serves.

        ``unserved`` lists due available steps whose queue, kind and run version
        (``workflow``, ``def_version``) no live worker serves, grouped, with ``steps``
        and the ``oldest`` due time: work that waits for a worker of another deploy (see
        the versioning guide). It looks at the first 10,000 due steps at most.
        """
        return self._tx(
            lambda tx: {
                "queues": tx.rows(Q.queue_stats),
                "kinds": tx.rows(Q.kind_stats),
                "unserved": workers.unserved(tx),
            }
        )

    def workers(self) -> list[dict[str, Any]]:
        """Known workers, live ones first: id, host, pid, queues, concurrency, versions
        served, handler identities, start and last beat, ``live``."""
        return self._tx(workers.listing)

    def pause(self, run_id: int) -> None:
        """Pause a running run: ready and pending steps wait; running steps finish."""
        self._tx(lambda tx: waits.pause(tx, run_id))

    def resume(self, run_id: int) -> None:
        """Resume a paused run; its deadline and timed waits move by the pause length."""
        self._tx(lambda tx: waits.resume(tx, run_id, self.hooks))
