"""Client: submit runs and standalone work, read them, and steer them (sync, pooled).

Every write goes through the client's :class:`~cyclone_dsl.engine.Engine`, in
a short pooled transaction, or in the caller's own transaction for the
``*_tx`` methods. Reads are plain named queries.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, LiteralString, TypeVar

from cyclone_dsl.arguments import checked_flag
from cyclone_dsl.client import base, bulk
from cyclone_dsl.client.bulk import BulkResult, Progress
from cyclone_dsl.client.handle import (
    EVENTS_PAGE,
    RunHandle,
    WaitRoute,
    checked_after,
    outcome_from_row,
)
from cyclone_dsl.client.model import Attempt, Run, Step, StepEvent
from cyclone_dsl.client.schedules import Schedule, schedule_from_row, spec_for
from cyclone_dsl.client.watch import RunWatcher
from cyclone_dsl.db.callers import Connection, in_callers_transaction
from cyclone_dsl.db.clock import current_shift
from cyclone_dsl.db.connect import resolve_listen_dsn, resolve_pooled
from cyclone_dsl.db.embedded import ENV_URL
from cyclone_dsl.db.pool import PooledDatabase
from cyclone_dsl.db.tx import Tx
from cyclone_dsl.dsl import runs
from cyclone_dsl.dsl.flow import Debounce, key_of
from cyclone_dsl.dsl.registry import Registry, default_registry
from cyclone_dsl.engine import (
    DEFAULT_BATCH_SIZE,
    BulkAction,
    Delivery,
    Engine,
    Refused,
    RunFilter,
    Submitted,
    TemplateRun,
    template_fits,
)
from cyclone_dsl.errors import InvalidArgument, InvalidTransition, PassedDeadline, RunNotFound
from cyclone_dsl.graph.rows import CompiledRun
from cyclone_dsl.migrate import checked_connection
from cyclone_dsl.payload import JSONValue, encode
from cyclone_dsl.sql import Q
from cyclone_dsl.states import RunState

T = TypeVar("T")


def raised(result: T | Refused) -> T:
    """The result of an engine operation, or its refusal raised (after its transaction
    committed what came due before it: see ``Engine._due_first``)."""
    if isinstance(result, Refused):
        result.raise_it()
    return result


class Client:
    """The producer's entry point: ``Client(dsn)``, or ``Client()`` with ``$CYCLONE_DATABASE_URL``.

    Holds a small connection pool; close it with :meth:`close` or a ``with``
    block. One client may be shared by every thread of a process: each call takes a
    connection of its own from the pool (at most ``pool_size`` calls at once; the others
    wait for a connection). It survives ``os.fork()`` (gunicorn ``--preload``, prefork
    pools): a forked child never touches the parent's connections and opens its own on
    its first call. Workflows are given as the decorated objects, or by name when they
    are registered in ``registry`` (the process-wide default registry unless
    one is passed).

    ``pooled=True`` (default: ``$CYCLONE_POOLED``) says ``dsn`` goes through a
    transaction-mode pooler such as PgBouncer: no session state, no server-side
    prepared statements, no LISTEN on it. :meth:`wait` then LISTENs on
    ``listen_dsn`` (default: ``$CYCLONE_LISTEN_URL``), a direct connection to the
    same database and schema, or without one reads the run's state every 0.25 s.

    ``tracing=True`` (or a :class:`~opentelemetry.trace.TracerProvider`) makes each submit
    an OpenTelemetry span whose trace context is stored with the run, so that the steps
    of the run are spans of the same trace (the ``otel`` extra; see the monitoring guide).
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
        resolved = dsn or os.environ.get(ENV_URL)
        if not resolved:
            raise InvalidArgument(
                f"Client needs a DSN: pass one, or set {ENV_URL} (see embedded_database())"
            )
        if not isinstance(pool_size, int) or isinstance(pool_size, bool) or pool_size < 1:
            raise InvalidArgument(f"pool_size must be an integer >= 1, not {pool_size!r}")
        self.dsn = resolved
        self.registry = registry if registry is not None else default_registry()
        self._tracing = tracing_of(tracing)
        self._engine = Engine(
            compile_child=runs.child_compiler(self.registry),
            compile_schedule=runs.compiler_for(self.registry),
            tracing=self._tracing,
        )
        self.pooled = resolve_pooled(pooled)
        self.wait_route = WaitRoute.of(
            resolved, pooled=self.pooled, listen_dsn=resolve_listen_dsn(listen_dsn)
        )
        checked = checked_connection(resolved, name="cyclone-client", pooled=self.pooled)
        self._db = PooledDatabase(
            resolved, name="cyclone-client", max_size=pool_size, pooled=self.pooled, first=checked
        )
        self._watcher = RunWatcher(self.wait_route, closed=self._db.is_closed)

    def _traced(self, operation: str, workflow: str, write: Callable[[], T]) -> T:
        """Run a submit's write, in a span when this client traces."""
        if self._tracing is None:
            return write()
        result: T = self._tracing.around(operation, workflow, write, run_ids_of)
        return result

    def close(self) -> None:
        """Close the connection pool and the waits' connection; later calls raise
        :class:`ClientClosed`, and so do the waits (``wait``, ``result``) in flight, at
        once, and the event followers (``events``), at their next look (within a
        second)."""
        self._db.close()
        self._watcher.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- submitting ----------------------------------------------------------------

    def submit(
        self,
        workflow: object,
        input: JSONValue = None,
        *,
        deadline: timedelta | None = None,
        debounce: Debounce | None = None,
    ) -> RunHandle:
        """Start a run of ``workflow`` with ``input``; the whole graph is written at once.

        With ``debounce``, submits of one key inside its window make one run,
        which starts ``debounce.delay`` after the last of them, with its input and
        ``deadline``; the handle of a submit that joined an open window has
        ``created=False``. A submit of another definition (another deploy's) opens a
        window of its own.
        """
        if debounce is not None:
            compiled = runs.compile_workflow(self.registry, workflow, input)
            deadline = base.check_deadline(deadline)
            if not isinstance(debounce, Debounce):
                raise InvalidArgument(f"debounce must be a Debounce, not {debounce!r}")
            key = key_of(f"workflow {compiled.workflow!r} debounce", debounce.key, input)
            submitted = self._traced(
                "submit",
                compiled.workflow,
                lambda: self._db.transaction(
                    lambda tx: self._engine.submit_debounced(
                        tx, compiled, key=key, delay=debounce.delay, deadline=deadline
                    )
                ),
            )
            return RunHandle(submitted.run_id, self, submitted.created)
        one = self._one_run(workflow, input)
        deadline = base.check_deadline(deadline)
        run_id = self._traced(
            "submit",
            one.workflow,
            lambda: self._db.transaction(
                lambda tx: self._engine.submit(tx, one, deadline=deadline),
                one_statement=self._engine.is_one_statement(one),
            ),
        )
        return RunHandle(run_id, self)

    def _one_run(self, workflow: object, input: JSONValue) -> TemplateRun | CompiledRun:
        """A run of ``workflow``: its definition's template (encoded once per definition)
        and the input, or where the input is too big to be put in by the insert, its rows."""
        template = runs.workflow_template(self.registry, workflow)
        text = encode(input, what="the run input")
        if not template_fits(template, text):
            return runs.compile_workflow(self.registry, workflow, input)
        return TemplateRun(template, text, runs.workflow_flows(self.registry, workflow, [input])[0])

    def submit_tx(
        self,
        conn: Connection,
        workflow: object,
        input: JSONValue = None,
        *,
        deadline: timedelta | None = None,
    ) -> RunHandle:
        """:meth:`submit` inside the caller's transaction on ``conn``: the run exists iff the
        caller commits.

        Every workflow shape is accepted (roots that are steps, waits, timers,
        child runs or fan-outs). The writes run in a savepoint: if the submit
        fails, nothing of it stays in the caller's transaction. On a connection
        in autocommit mode the submit commits on its own.
        """
        compiled = runs.compile_workflow(self.registry, workflow, input)
        deadline = base.check_deadline(deadline)
        run_id = self._traced(
            "submit",
            compiled.workflow,
            lambda: in_callers_transaction(
                conn,
                lambda tx: self._engine.submit(tx, compiled, deadline=deadline),
                shift=current_shift(),
            ),
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
        inputs = base.checked_inputs(inputs)
        template = runs.workflow_template(self.registry, workflow)
        texts = base.encoded_inputs(inputs, "the run input")
        for value, text in zip(inputs, texts, strict=True):
            if not template_fits(template, text):
                # The insert would put this input into step inputs past the payload limit:
                # compiling the run in Python says which step (PayloadTooLarge), or fits.
                runs.compile_workflow(self.registry, workflow, value)
        flows = runs.workflow_flows(self.registry, workflow, inputs)
        deadline = base.check_deadline(deadline)
        ids = self._traced(
            "submit_many",
            template.workflow,
            lambda: self._db.transaction(
                lambda tx: self._engine.submit_many(
                    tx, template, texts, deadline=deadline, flows=flows
                ),
                one_statement=self._engine.is_one_statement_many(template, flows),
            ),
        )
        return [RunHandle(run_id, self) for run_id in ids]

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
        compiled, deadline = self._once(workflow, input, key, deadline)
        submitted = self._traced(
            "submit",
            compiled.workflow,
            lambda: self._db.transaction(
                lambda tx: self._engine.submit_once(tx, compiled, key=key, deadline=deadline)
            ),
        )
        return RunHandle(submitted.run_id, self, submitted.created)

    def submit_once_tx(
        self,
        conn: Connection,
        workflow: object,
        input: JSONValue = None,
        *,
        key: str,
        deadline: timedelta | None = None,
    ) -> RunHandle:
        """:meth:`submit_once` inside the caller's transaction on ``conn``.

        A run created here exists iff the caller commits; until then, another
        caller submitting the same key waits for this transaction to end (the
        key's unique index), then gets this run if it was committed.
        """
        compiled, deadline = self._once(workflow, input, key, deadline)
        submitted = in_callers_transaction(
            conn,
            lambda tx: self._engine.submit_once(tx, compiled, key=key, deadline=deadline),
            shift=current_shift(),
        )
        return RunHandle(submitted.run_id, self, submitted.created)

    def _once(
        self, workflow: object, input: JSONValue, key: str, deadline: timedelta | None
    ) -> tuple[CompiledRun, timedelta | None]:
        base.check_key("key", key)
        return runs.compile_workflow(self.registry, workflow, input), base.check_deadline(deadline)

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
        concurrency_key: str | None = None,
    ) -> RunHandle:
        """Enqueue standalone work: one run of one step (its ``workflow`` is the kind).

        With ``unique_key``, at most one active step per (kind, key) exists: a
        duplicate returns the holder's handle with ``created=False``. With
        ``sequence_key``, steps of one key run one at a time, in order of
        ``scheduled_at`` (a step in backoff can be overtaken by a later one).
        ``concurrency_key`` replaces, for this step, the key its kind's
        :class:`Concurrency` would take from the input.
        """
        compiled = self._standalone(
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
        submitted = self._traced(
            "enqueue",
            compiled.workflow,
            lambda: self._db.transaction(
                lambda tx: self._enqueue(tx, compiled, unique_key, sequence_key, scheduled_at),
                # A unique key may need a re-read and a retry; limits write their gates too.
                one_statement=unique_key is None and self._engine.is_one_statement(compiled),
            ),
        )
        return RunHandle(submitted.run_id, self, submitted.created)

    def enqueue_tx(
        self,
        conn: Connection,
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
    ) -> RunHandle:
        """:meth:`enqueue` inside the caller's transaction on ``conn``: the step exists iff
        the caller commits."""
        compiled = self._standalone(
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
        submitted = self._traced(
            "enqueue",
            compiled.workflow,
            lambda: in_callers_transaction(
                conn,
                lambda tx: self._enqueue(tx, compiled, unique_key, sequence_key, scheduled_at),
                shift=current_shift(),
            ),
        )
        return RunHandle(submitted.run_id, self, submitted.created)

    def _standalone(
        self,
        step: object,
        input: JSONValue,
        *,
        queue: str | None,
        priority: int | None,
        scheduled_at: datetime | None,
        max_attempts: int | None,
        timeout: timedelta | float | None,
        unique_key: str | None,
        sequence_key: str | None,
        retention: timedelta | float | None,
        concurrency_key: str | None,
    ) -> CompiledRun:
        compiled = runs.compile_standalone(
            self.registry,
            step,
            input,
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            timeout=timeout,
            retention=retention,
            concurrency_key=concurrency_key,
        )
        if unique_key is not None:
            base.check_key("unique_key", unique_key)
        if sequence_key is not None:
            base.check_key("sequence_key", sequence_key)
        base.check_scheduled_at(scheduled_at)
        return compiled

    def _enqueue(
        self,
        tx: Tx,
        compiled: CompiledRun,
        unique_key: str | None,
        sequence_key: str | None,
        scheduled_at: datetime | None,
    ) -> Submitted:
        return self._engine.enqueue(
            tx,
            compiled,
            unique_key=unique_key,
            sequence_key=sequence_key,
            scheduled_at=scheduled_at,
        )

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
        inputs = base.checked_inputs(inputs)
        template = runs.standalone_template(
            self.registry,
            step,
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            timeout=timeout,
            retention=retention,
        )
        runs.check_standalone_inputs(runs.resolve_step(self.registry, step), inputs)
        texts = base.encoded_inputs(inputs, "the input")
        flows = runs.standalone_flows(self.registry, step, inputs)
        base.check_scheduled_at(scheduled_at)
        ids = self._traced(
            "enqueue_many",
            template.workflow,
            lambda: self._db.transaction(
                lambda tx: self._engine.submit_many(
                    tx, template, texts, scheduled_at=scheduled_at, flows=flows
                )
            ),
        )
        return [RunHandle(run_id, self) for run_id in ids]

    def handle(self, run_id: int) -> RunHandle:
        """A handle to an existing run (no database access)."""
        run_id = base.checked_run_id(run_id)
        return RunHandle(run_id, self, created=False)

    # -- reading ---------------------------------------------------------------------

    def get_run(self, run_id: int) -> Run:
        """The run with every step, or :class:`RunNotFound`."""
        run_id = base.checked_run_id(run_id)

        def read(tx: Tx) -> Run:
            row = tx.one(Q.get_run, run_id=run_id)
            if row is None:
                raise RunNotFound(run_id)
            history: dict[int, list[Attempt]] = {}
            for a in tx.rows(Q.get_run_attempts, run_id=run_id):
                history.setdefault(a["step_id"], []).append(Attempt.from_row(a))
            fork = self._engine.fork_of(tx, run_id)
            copied = set(fork["copied"]) if fork else set()
            steps = tuple(
                Step.from_row(s, tuple(history.get(s["id"], ())), copied=s["node"] in copied)
                for s in tx.rows(Q.get_run_steps, run_id=run_id)
            )
            return Run.from_row(row, steps, fork)

        return self._db.transaction(read)

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
        text: str | None = None,
        error_kind: str | None = None,
    ) -> list[Run]:
        """Runs newest first (without steps); page with ``before_id`` = the last id seen.

        Filters: ``state``, ``workflow``, ``parent_run_id``, a creation-time range
        ``since`` (inclusive) to ``until`` (exclusive), ``text`` (found, ignoring case,
        in the input's JSON or the submit key) and ``error_kind`` (a step ended with
        that error kind, or one of its attempts failed with it: ``timeout``,
        ``reclaimed``...). ``text`` reads every run it passes: narrow it with the
        other filters on a large table.
        """
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 10_000:
            raise InvalidArgument(f"limit must be an integer between 1 and 10000, not {limit!r}")
        state_value = base.run_state(state).value if state is not None else None
        filters: dict[str, tuple[object, Callable[[str, object], object]]] = {
            "workflow": (workflow, base.checked_text),
            "text": (text, base.checked_text),
            "error_kind": (error_kind, lambda _, value: base.error_kind(value)),
            "before_id": (before_id, base.checked_id),
            "parent_run_id": (parent_run_id, base.checked_id),
            "since": (since, base.checked_aware),
            "until": (until, base.checked_aware),
        }
        for name, (given, check) in filters.items():
            if given is not None:
                check(name, given)
        rows = self._db.transaction(
            lambda tx: tx.rows(
                Q.list_runs,
                state=state_value,
                workflow=workflow,
                limit=limit,
                before_id=before_id,
                parent_run_id=parent_run_id,
                since=since,
                until=until,
                text=text or None,
                error_kind=error_kind or None,
            ),
            one_statement=True,
        )
        return [Run.from_row(r) for r in rows]

    def progress(self, run_id: int) -> tuple[int, int]:
        """(terminal steps, all steps) of a run; :class:`RunNotFound` for a run that does
        not exist (or was purged)."""
        run_id = base.checked_run_id(run_id)
        row = self._read_one(Q.run_progress, run_id=run_id)
        if row is None:
            raise RunNotFound(run_id)
        return (row["done"], row["total"])

    def dependencies(self, run_id: int) -> dict[str, list[str]]:
        """Each node of a run with the nodes it depends on (nodes without any are left
        out); :class:`RunNotFound` for a run that does not exist (or was purged)."""
        graph: dict[str, list[str]] = {}
        for edge in self._rows_of_run(Q.get_run_deps, run_id, "node"):
            graph.setdefault(edge["node"], []).append(edge["dep_node"])
        return graph

    def signals_of(self, run_id: int) -> list[dict[str, Any]]:
        """The run's signal mailbox (consumed rows included), in delivery order;
        :class:`RunNotFound` for a run that does not exist (or was purged)."""
        return self._rows_of_run(Q.run_signals, run_id, "id")

    def children_of(self, run_id: int) -> list[dict[str, Any]]:
        """The child runs started by a run's child nodes; :class:`RunNotFound` for a run
        that does not exist (or was purged)."""
        return self._rows_of_run(Q.child_runs_of_run, run_id, "id")

    def _rows_of_run(self, query: LiteralString, run_id: int, key: str) -> list[dict[str, Any]]:
        """The rows of a query that joins the run to what it lists: none when the run
        does not exist (:class:`RunNotFound`), one with ``key`` NULL when it lists nothing."""
        run_id = base.checked_run_id(run_id)
        rows = self._read(query, run_id=run_id)
        if not rows:
            raise RunNotFound(run_id)
        return [row for row in rows if row[key] is not None]

    def run_counts(self) -> dict[str, int]:
        """How many runs are in each state."""
        return {r["state"]: r["count"] for r in self._read(Q.run_counts)}

    def outcome(self, run_id: int) -> JSONValue:
        """The result of a terminal run (see :meth:`RunHandle.result`)."""
        run_id = base.checked_run_id(run_id)
        row = self._read_one(Q.run_outcome, run_id=run_id)
        if row is not None and not RunState(row["state"]).is_terminal:
            raise InvalidArgument(f"run {run_id} is still {row['state']}")
        return outcome_from_row(row, run_id)

    def wait(self, run_id: int, timeout: float | None = None) -> Run:
        """Block until the run is terminal and return it; ``TimeoutError`` after ``timeout`` s.

        Waits on LISTEN (no busy polling), re-reading the state every second as a
        fallback, and survives a lost or half-open connection. On a pooled DSN without
        ``listen_dsn``, reads the state every 0.25 s instead. Every wait of a client
        shares one connection and one thread (see docs/howto/scale.md).
        """
        run_id = base.checked_run_id(run_id)
        self._db.check_open()
        self._watcher.wait(run_id, timeout)
        return self.get_run(run_id)

    def result(self, run_id: int, timeout: float | None = None) -> JSONValue:
        """Wait (see :meth:`wait`), then return the result node's output.

        Raises :class:`RunFailed` for a failed or cancelled run and
        :class:`NoOutput` when the workflow defines no result.
        """
        run_id = base.checked_run_id(run_id)
        self._db.check_open()
        self._watcher.wait(run_id, timeout)
        return self.outcome(run_id)

    def events(
        self, run_id: int, after: int = 0, *, timeout: float | None = None
    ) -> Iterator[StepEvent]:
        """Iterate the run's events (``ctx.emit``, ``ctx.progress``) after seq ``after``
        (0: from the first), in order, as they are recorded.

        Ends once the run has ended (completed, failed or cancelled) and every event it
        recorded was yielded; raises :class:`RunNotFound`, or ``TimeoutError`` when the
        run has not ended after ``timeout`` seconds. Wakes up on LISTEN and always reads
        by seq from the table (re-reading every second without a notification), so a
        lost connection is replaced and no event is skipped. To resume after a break,
        pass the last ``seq`` seen as ``after``. Every follower and wait of a client shares
        one connection and one thread (see docs/howto/scale.md).
        """
        run_id = base.checked_run_id(run_id)
        after = checked_after(after)
        self._db.check_open()
        return self._watcher.follow(run_id, after, timeout)

    def events_of(self, run_id: int, after: int = 0, limit: int = EVENTS_PAGE) -> list[StepEvent]:
        """The run's events after seq ``after`` recorded so far (at most ``limit``, in
        order): one read, no waiting (see :meth:`events` to follow them)."""
        run_id = base.checked_run_id(run_id)
        after = checked_after(after)
        limit = base.checked_count("limit", limit)
        rows = self._read(Q.run_events_after, run_id=run_id, after=after, limit=limit)
        if not rows:
            raise RunNotFound(run_id)
        return [StepEvent.from_row(run_id, r) for r in rows if r["seq"] is not None]

    def _read(self, query: LiteralString, **params: object) -> list[dict[str, Any]]:
        return self._db.transaction(lambda tx: tx.rows(query, **params), one_statement=True)

    def _read_one(self, query: LiteralString, **params: object) -> dict[str, Any] | None:
        return self._db.transaction(lambda tx: tx.one(query, **params), one_statement=True)

    # -- steering ----------------------------------------------------------------------

    def cancel(self, run_id: int) -> None:
        """Cancel a run and its descendant runs; :class:`AlreadyTerminal` if it has ended,
        and its subclass :class:`PassedDeadline` if it (or its parent run) passed its
        deadline first: it ended there, failed by the deadline."""
        run_id = base.checked_run_id(run_id)
        with self._ending_past_deadline():
            raised(self._db.transaction(lambda tx: self._engine.cancel(tx, run_id)))

    def fork(
        self,
        run_id: int,
        from_node: str,
        *,
        input: JSONValue | base.Unset = base.UNSET,
        current_definition: bool = False,
    ) -> RunHandle:
        """A new run of run ``run_id``'s workflow, started again from ``from_node``.

        The nodes outside ``from_node``'s downstream part that completed (or were
        skipped) in run ``run_id`` are copied: they keep the outputs it recorded and
        do not run (``Step.copied``). ``from_node``, everything that depends on it and
        every node that did not complete run as in a new run, on the workers' current
        handlers (fix a handler, then fork from the node that failed). ``input``
        replaces the run input (by default the source run's). The source run is not
        changed; the fork's ``Run.forked_from`` names it.

        The fork uses the source run's definition (``def_version``), which this
        process must define; with ``current_definition=True`` it uses this process's
        definition of the workflow instead, as long as every copied node has the same
        kind in both (:class:`InvalidTransition` otherwise). :class:`RunNotFound`,
        :class:`UnknownWorkflow` when this process does not define the workflow, and
        :class:`InvalidArgument` when ``from_node`` is not one of its nodes.
        """
        run_id = base.checked_run_id(run_id)
        current_definition = checked_flag("current_definition", current_definition)
        source = self._read_one(Q.fork_source_run, run_id=run_id)
        if source is None:
            raise RunNotFound(run_id)
        definition = runs.resolve_workflow(self.registry, source["workflow"])
        if definition.def_version != source["def_version"] and not current_definition:
            raise InvalidTransition(
                f"run {run_id} ran {source['workflow']!r} at {source['def_version']}; this "
                f"process defines {definition.def_version}: pass current_definition=True to "
                "fork onto it (each copied node must keep its kind)"
            )
        value = source["input"] if isinstance(input, base.Unset) else input
        compiled = runs.compile_definition(definition, value)
        new_id, _ = self._db.transaction(
            lambda tx: self._engine.fork(tx, run_id, compiled, from_node)
        )
        return RunHandle(new_id, self)

    def retry(self, run_id: int, node: str, *, force: bool = False) -> None:
        """Operator retry: run again what the run needs to finish, starting from ``node``.

        With ``force=True`` (a replay), ``node`` may have completed (or been skipped):
        it and every node downstream of it, directly or not, go back to pending with
        no output and run again; every other node keeps its outcome, and each
        replayed completion stays in the attempt history (outcome ``replayed``). A
        fan-out in the replayed part expands again from its new input. Refused
        (:class:`InvalidTransition`, nothing changed) while a node of that part is
        under way, when it holds a child node that started a child run (fork the run
        instead: :meth:`fork`), or when a node outside it did not complete.

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
        run_id = base.checked_run_id(run_id)
        node = base.checked_text("node", node)
        force = checked_flag("force", force)
        raised(self._db.transaction(lambda tx: self._engine.retry(tx, run_id, node, force=force)))

    def signal(self, run_id: int, name: str, payload: JSONValue = None) -> Delivery:
        """Deliver a signal to the run's wait for ``name``.

        Returns :attr:`Delivery.CONSUMED` when the waiting node took it,
        :attr:`Delivery.BUFFERED` when its wait is not active yet, and
        :attr:`Delivery.NOT_STORED` when the wait already ended, or its timeout has
        passed (the wait then fails with ``signal_timeout`` at once, as the scanner
        would have failed it: when that ends the run, :class:`AlreadyTerminal`). Raises
        :class:`MailboxFull` past the wait's capacity (1, or N for ``wait_n``),
        :class:`SignalNotDeliverable` for a name no wait declares and
        :class:`AlreadyTerminal` for a run that has ended, and its subclass
        :class:`PassedDeadline` for one past its deadline or whose parent run is (the
        signal is not stored).
        """
        run_id = base.checked_run_id(run_id)
        base.check_key("signal name", name)
        text = encode(payload, what="the signal payload")
        with self._ending_past_deadline():
            return raised(
                self._db.transaction(lambda tx: self._engine.signal(tx, run_id, name, text))
            )

    def pause(self, run_id: int) -> None:
        """Pause a running run: ready and pending steps wait; running steps finish. A run
        past its deadline (or whose parent is) raises :class:`PassedDeadline`."""
        run_id = base.checked_run_id(run_id)
        with self._ending_past_deadline():
            raised(self._db.transaction(lambda tx: self._engine.pause(tx, run_id)))

    @contextlib.contextmanager
    def _ending_past_deadline(self) -> Iterator[None]:
        """A call refused with :class:`PassedDeadline` rolled back: record the deadline's
        end now (the scanner may be late), then raise."""
        try:
            yield
        except PassedDeadline as late:
            ended = late.deadline_run_id
            self._db.transaction(lambda tx: self._engine.end_past_deadline(tx, ended))
            raise

    def resume(self, run_id: int) -> None:
        """Resume a paused run; its deadline and timed waits move by the pause length. A
        child run paused on its own whose parent run passed its deadline meanwhile raises
        :class:`PassedDeadline`."""
        run_id = base.checked_run_id(run_id)
        with self._ending_past_deadline():
            raised(self._db.transaction(lambda tx: self._engine.resume(tx, run_id)))

    # -- operations in bulk ------------------------------------------------------------

    def cancel_many(
        self,
        where: RunFilter,
        *,
        dry_run: bool = False,
        progress: Progress | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> BulkResult:
        """Cancel every running or paused run ``where`` selects, as :meth:`cancel` would
        (child runs included), ``batch_size`` runs per transaction.

        What came due in any run and no scanner applied yet (timers, signal timeouts,
        deadlines) is applied first, as the scanner would, a dry run included. With
        ``dry_run=True``, only count them (``BulkResult.matched``). ``progress``
        is called with the counts so far after each committed batch. Only runs that
        existed when the call started are considered; a run that ended meanwhile is
        skipped. Running it again acts on nothing (unless new runs match). See
        docs/concepts/runs-and-steps.md, "Operations in bulk".
        """
        return self._bulk(BulkAction.CANCEL, where, dry_run, progress, batch_size)

    def retry_many(
        self,
        where: RunFilter,
        *,
        dry_run: bool = False,
        progress: Progress | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> BulkResult:
        """Retry every failed run ``where`` selects, as a whole: each node that failed it
        runs again with a fresh attempt budget, with its cancelled steps, as
        :meth:`retry` of that node would (``states=["cancelled"]`` in the filter retries
        cancelled runs too, from their cancelled steps).

        A run the retry refuses (past its deadline, a child run its parent no longer
        waits for: retry the parent) is skipped with the reason in
        ``BulkResult.skipped_runs``. ``dry_run``, ``progress`` and ``batch_size`` as
        in :meth:`cancel_many`; a run retried here that fails again is not retried
        again by the same call.
        """
        return self._bulk(BulkAction.RETRY, where, dry_run, progress, batch_size)

    def resume_many(
        self,
        where: RunFilter,
        *,
        dry_run: bool = False,
        progress: Progress | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> BulkResult:
        """Resume every paused run ``where`` selects, as :meth:`resume` would. ``dry_run``,
        ``progress`` and ``batch_size`` as in :meth:`cancel_many`."""
        return self._bulk(BulkAction.RESUME, where, dry_run, progress, batch_size)

    def _bulk(
        self,
        action: BulkAction,
        where: RunFilter,
        dry_run: bool,
        progress: Progress | None,
        batch_size: int,
    ) -> BulkResult:
        where = bulk.check(where, batch_size, progress)
        if checked_flag("dry_run", dry_run):
            return self._bulk_dry_run(action, where)
        result = None
        for result in self._bulk_pages(action, where, batch_size):
            if progress is not None:
                progress(result)
        assert result is not None  # the pages yield at least once
        return result

    def _bulk_dry_run(self, action: BulkAction, where: RunFilter) -> BulkResult:
        action.states_under(where)  # a state the action does not apply to: refused at once
        return bulk.dry_run(self._db.transaction, self._engine, action, where)

    def _bulk_pages(
        self, action: BulkAction, where: RunFilter, batch_size: int
    ) -> Iterator[BulkResult]:
        action.states_under(where)  # a state the action does not apply to: refused at once
        return bulk.run_pages(self._db.transaction, self._engine, action, where, batch_size)

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
        differs refuses to fire it until the schedule is registered again. The
        options given replace those of the steps of each run it fires.
        """
        definition = runs.resolve_schedulable(self.registry, target)
        spec = spec_for(
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
        row = runs.schedule_row(definition, spec)
        self._db.transaction(lambda tx: self._engine.register_schedule(tx, row))
        return next(s for s in self.list_schedules() if s.id == row.id)

    def register_schedules(self) -> list[str]:
        """Register every ``@schedule`` of this client's registry; return their ids."""
        rows = runs.registry_schedules(self.registry)

        def register(tx: Tx) -> list[str]:
            for row in rows:
                self._engine.register_schedule(tx, row, from_code=True)
            return [row.id for row in rows]

        return self._db.transaction(register)

    def unschedule(self, schedule_id: str) -> None:
        """Delete a schedule; :class:`ScheduleError` if there is none with that id."""
        self._db.transaction(lambda tx: self._engine.delete_schedule(tx, schedule_id))

    def enable_schedule(self, schedule_id: str, enabled: bool = True) -> None:
        """Enable (or disable) a schedule; :class:`ScheduleError` if there is none.

        Enabled again, it fires at most the latest slot it missed while disabled. A worker's
        start (registering its ``@schedule``s) does not enable a disabled schedule again.
        """
        enabled = checked_flag("enabled", enabled)
        self._db.transaction(lambda tx: self._engine.set_schedule_enabled(tx, schedule_id, enabled))

    def list_schedules(self) -> list[Schedule]:
        return [schedule_from_row(r) for r in self._read(Q.list_schedules)]

    def purge(
        self,
        *,
        older_than: timedelta = timedelta(0),
        states: tuple[RunState | str, ...] = base.ENDED_STATES,
        batch_size: int = 1000,
    ) -> int:
        """Delete terminal runs that ended more than ``older_than`` ago, in batches.

        Each batch is its own short transaction. A child run is kept while its
        parent exists and has not completed; a batch that deletes such a parent lets
        a later batch take its ended child runs. A run that another transaction holds
        (a retry or a signal of it) is skipped and tried again for up to
        :data:`~cyclone_dsl.client.base.PURGE_LOCK_WAIT_S` seconds; one held longer is
        left to the next purge. Purging frees the runs' submit keys.
        """
        wanted = base.purge_states(states)
        base.check_older_than(older_than)
        batch_size = base.checked_count("batch_size", batch_size)
        up_to: int = self._db.transaction(self._engine.bulk_bound)
        total = 0
        pauses = base.purge_pauses()
        while True:
            deleted = self._db.transaction(
                lambda tx: self._engine.purge(
                    tx, states=wanted, older_than=older_than, limit=batch_size, up_to=up_to
                )
            )
            total += deleted
            if deleted:  # a batch may have freed the child runs of the parents it took
                continue
            pause = next(pauses, None)
            if pause is None or not self._db.transaction(
                lambda tx: self._engine.purge_left(
                    tx, states=wanted, older_than=older_than, up_to=up_to
                ),
                one_statement=True,
            ):
                return total
            time.sleep(pause)

    def set_queue_limit(self, queue: str, limit: int | None) -> None:
        """Cap how many steps of ``queue`` run at once, across all workers (None: no cap).

        Workers read caps every few seconds; a step already running is never
        stopped by a lower cap, but no new one starts above it.
        """
        base.check_queue_limit(queue, limit)
        self._db.transaction(lambda tx: self._engine.set_queue_cap(tx, queue, limit))

    def why_waiting(self, run_id: int) -> dict[str, str]:
        """For each due step of the run that a limit holds back, why, in words:
        ``waiting for a concurrency slot (tenant-7: 3/3)`` or ``rate limited until 12:00:03``.
        :class:`RunNotFound` for a run that does not exist (or was purged).
        """
        run_id = base.checked_run_id(run_id)
        rows = self._db.transaction(lambda tx: self._engine.wait_reasons(tx, run_id))
        reasons: dict[str, list[str]] = {}
        for row in rows:
            reasons.setdefault(row["node"], []).append(base.wait_reason(row))
        return {node: "; ".join(found) for node, found in reasons.items()}

    def count_purgeable(
        self,
        *,
        older_than: timedelta = timedelta(0),
        states: tuple[RunState | str, ...] = base.ENDED_STATES,
    ) -> int:
        """How many runs :meth:`purge` with these arguments would delete now (a dry run)."""
        wanted = base.purge_states(states)
        base.check_older_than(older_than)
        return self._db.transaction(
            lambda tx: self._engine.count_purgeable(tx, states=wanted, older_than=older_than),
            one_statement=True,
        )

    def stats(self, *, live_for: timedelta | None = None) -> dict[str, list[dict[str, Any]]]:
        """Queues and kinds (the ``cyclone_v_queues`` and ``cyclone_v_kinds`` views), and the
        work that no live worker serves.

        ``unserved`` lists due available steps whose queue, kind and run version
        (``workflow``, ``def_version``) no live worker serves, grouped, with ``steps``
        and the ``oldest`` due time: work that waits for a worker of another deploy (see
        the versioning guide). It looks at the first 10,000 due steps at most. Child
        nodes whose child run waits for a worker of their run's version to start it count
        too, as ``kind`` ``@child``.

        ``limits`` lists every limited share (flow control): ``scope``
        (``step:<kind>``, ``run:<workflow>``, ``rate:<name>`` or ``queue:<queue>``),
        ``key``, ``max_count``, ``per_s`` (a rate's window), ``in_use`` (running, or
        started in the window), ``waiting`` (due steps held back) and, for a full
        rate, ``next_free_at``.

        ``live_for`` is how recent a worker's last beat must be for it to count as live
        (default 30 s; workers beat every 5 s).
        """
        live = base.live_for(live_for)
        return self._db.transaction(
            lambda tx: {
                "queues": tx.rows(Q.queue_stats),
                "kinds": tx.rows(Q.kind_stats),
                "unserved": self._engine.unserved_work(tx, live_for=live),
                "limits": self._engine.flow_stats(tx),
            }
        )

    def gauges(self) -> list[dict[str, Any]]:
        """The database-wide gauges that ``/metrics`` reports, read in one statement: rows
        of ``gauge``, ``queue``, ``state``, ``value`` and ``oldest_s``.

        ``gauge`` is ``steps`` (open steps of ``queue`` in ``state``; ``oldest_s`` is the
        age of its oldest due available step, or None), ``runs`` (open runs in ``state``)
        or ``waiting_runs`` (runs with a step waiting on a signal, a timer or a child run).
        """
        return self._db.transaction(self._engine.database_gauges, one_statement=True)

    def workers(self, *, live_for: timedelta | None = None) -> list[dict[str, Any]]:
        """Known workers, live ones first: id, host, pid, queues, concurrency,
        ``slots_in_use`` (running steps it holds), versions served, handler identities
        (``handlers``: kind to identity), start, last beat, ``stopped_at`` and ``live``
        (its last beat is younger than ``live_for``, by default 30 s, and it has not
        stopped)."""
        live = base.live_for(live_for)
        return self._db.transaction(
            lambda tx: self._engine.list_workers(tx, live), one_statement=True
        )

    def throughput(
        self, *, window: timedelta = timedelta(hours=1), buckets: int = 30
    ) -> list[dict[str, Any]]:
        """Steps started in each of ``buckets`` equal slices of the last ``window``, oldest
        first: ``bucket`` (0 is the oldest), ``until`` (the end of the window, on the
        database's clock), ``started``, ``completed`` (of those), and how long they waited
        once due (``wait_p50_s``, ``wait_p95_s``, ``wait_max_s``; None for an empty slice).

        A step counts at its latest start (a retried step once, in its last attempt's
        slice). It reads the steps started in the window through the ``started_at`` index.
        """
        if not isinstance(window, timedelta) or not (
            timedelta(seconds=1) <= window <= timedelta(days=31)
        ):
            raise InvalidArgument(
                f"window must be a timedelta between 1 second and 31 days, not {window!r}"
            )
        buckets = base.checked_count("buckets", buckets, 1, 1000)
        return self._read(Q.step_throughput, window=window, buckets=buckets)


def run_ids_of(result: object) -> list[int]:
    """The run ids a submit returned (an id, a :class:`Submitted` or a list of ids)."""
    if isinstance(result, Submitted):
        return [result.run_id]
    if isinstance(result, int):
        return [result]
    assert isinstance(result, list)
    return list(result)


def tracing_of(option: object) -> Any:
    """The tracing of ``tracing=``: None when off; importing OpenTelemetry only when on."""
    if option is None or option is False:
        return None
    try:
        from cyclone_dsl.observability import tracing  # only when asked: opentelemetry
    except ImportError as exc:
        raise InvalidArgument(
            f"tracing needs opentelemetry-api: pip install 'cyclone-dsl[otel]' ({exc})"
        ) from exc
    return tracing.tracing_of(option)
