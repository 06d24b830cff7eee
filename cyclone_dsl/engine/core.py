"""The :class:`Engine`: one object, built once with its hooks, through which every write goes.

Clients, workers, scanners, the CLI and the dashboard hold an ``Engine`` and
call its methods inside a transaction they open (a :class:`~cyclone_dsl.db.tx.Tx`):
the transaction's boundary is theirs (a pooled transaction, the caller's own
for ``submit_tx``, an autocommit claim), the transition is the engine's.
Nothing else writes Cyclone's tables.

The engine does not import the DSL: what needs a definition is given to it
as a callable. ``compile_child`` turns a child node's workflow and input into
rows; without it (a process that has no registry) a child run is left for a
worker that has its definition. ``compile_schedule`` turns a due schedule into
a run; without it, this engine fires no schedules.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime, timedelta
from typing import NoReturn, TypeVar

import attrs

from cyclone_dsl.db.tx import Row, Tx
from cyclone_dsl.engine import (
    bulk,
    children,
    claim,
    complete,
    control,
    debounce,
    events,
    fork,
    gates,
    replay,
    scan,
    schedules,
    signals,
    submit,
    tracecontext,
    waits,
    workers,
)
from cyclone_dsl.engine.bulk import BulkAction, BulkPage, RunFilter
from cyclone_dsl.engine.claim import Claimed
from cyclone_dsl.engine.complete import Failure, Success
from cyclone_dsl.engine.events import DEFAULT_MAX_EVENTS_PER_STEP, NewEvent, Outcome
from cyclone_dsl.engine.hooks import build_hooks
from cyclone_dsl.engine.schedules import CatchUp
from cyclone_dsl.engine.signals import Delivery
from cyclone_dsl.engine.submit import OneRun, Submitted
from cyclone_dsl.engine.tracecontext import TraceHook
from cyclone_dsl.engine.transitions import ChildCompiler
from cyclone_dsl.errors import CycloneError, HandlerConflict, InvalidArgument
from cyclone_dsl.graph.rows import CompiledRun, RunFlow, RunTemplate, ScheduleCompiler, ScheduleRow
from cyclone_dsl.sql import Q
from cyclone_dsl.states import RunState, StepState

#: One page of a scanner pass: (rows changed, the cursor of the next page or None).
Page = tuple[int, int | None]

#: How long an ended run is kept when none of its steps sets a retention (the worker's
#: retention scanner and ``cyclone purge`` use it unless told otherwise).
DEFAULT_RETENTION = timedelta(days=7)

#: How often a step whose worker died is reclaimed before it is discarded as
#: ``reclaim_limit``, when its kind sets no ``max_reclaims`` of its own.
DEFAULT_MAX_RECLAIMS = 3


T = TypeVar("T")


@attrs.frozen
class Refused:
    """An operation refused after the writes that came before it, which its transaction
    keeps (what came due in the run: see ``Engine._due_first``): raise ``error`` once the
    transaction has committed."""

    error: CycloneError

    def raise_it(self) -> NoReturn:
        raise self.error


class Engine:
    """The state machine of runs and steps; see the module docstring."""

    def __init__(
        self,
        *,
        compile_child: ChildCompiler | None = None,
        compile_schedule: ScheduleCompiler | None = None,
        on_runs_ended: Callable[[list[Row], RunState], None] | None = None,
        tracing: TraceHook | None = None,
    ) -> None:
        """``on_runs_ended`` hears, inside the transaction, of every run a transition of
        this engine ends (rows with id, workflow, created_at and finished_at): it must not
        write, and its caller learns whether the transaction committed.

        With ``tracing``, runs this engine inserts carry a trace context (extension 8), and
        reclaimed leases are told to it; without it nothing of that is read or written."""
        self._hooks = build_hooks(compile_child)
        self._hooks.tracing = tracing
        self._compile_schedule = compile_schedule
        if on_runs_ended is not None:
            told = on_runs_ended
            self._hooks.on_runs_ended.append(lambda tx, rows, state, hooks: told(rows, state))

    @property
    def fires_schedules(self) -> bool:
        """Whether this engine can turn due schedules into runs."""
        return self._compile_schedule is not None

    # -- runs ------------------------------------------------------------------------

    def is_one_statement(self, compiled: OneRun) -> bool:
        """Whether :meth:`submit` of ``compiled`` is one statement (autocommit is enough):
        not when this engine traces (the trace context is a second write)."""
        return self._hooks.tracing is None and submit.is_one_statement(compiled)

    def is_one_statement_many(
        self, template: RunTemplate, flows: Sequence[RunFlow | None] | None
    ) -> bool:
        """Whether :meth:`submit_many` of ``template`` with ``flows`` is one statement."""
        return (
            self._hooks.tracing is None
            and (flows is None or all(flow is None for flow in flows))
            and submit.is_one_statement_graph(template)
        )

    @property
    def traces(self) -> bool:
        """Whether this engine was given a trace hook."""
        return self._hooks.tracing is not None

    def trace_contexts(self, tx: Tx, run_ids: Sequence[int]) -> dict[int, dict[str, str]]:
        """The trace context (W3C carrier) of each of these runs that has one."""
        return tracecontext.read(tx, run_ids)

    def submit(
        self,
        tx: Tx,
        compiled: OneRun,
        *,
        deadline: timedelta | None = None,
        scheduled_at: datetime | None = None,
    ) -> int:
        """Insert a run and its graph, activate its roots, wake workers; return its id.

        ``compiled`` is the run's rows, or a :class:`TemplateRun` (its definition's
        template and its input), which costs less to send."""
        return submit.insert_run(
            tx, compiled, deadline=deadline, scheduled_at=scheduled_at, hooks=self._hooks
        )

    def submit_debounced(
        self,
        tx: Tx,
        compiled: CompiledRun,
        *,
        key: str,
        delay: timedelta,
        deadline: timedelta | None = None,
    ) -> Submitted:
        """Submit into the debounce window of (workflow, ``key``) (see
        :mod:`cyclone_dsl.engine.debounce`); ``created`` is False when the submit joined an
        open window's run."""
        return debounce.submit(
            tx, compiled, key=key, delay=delay, deadline=deadline, hooks=self._hooks
        )

    def submit_once(
        self, tx: Tx, compiled: CompiledRun, *, key: str, deadline: timedelta | None = None
    ) -> Submitted:
        """Insert unless a run of this workflow holds ``key`` (in any state)."""
        return submit.insert_run_once(
            tx, compiled, submit_key=key, deadline=deadline, hooks=self._hooks
        )

    def submit_many(
        self,
        tx: Tx,
        template: RunTemplate,
        inputs: Sequence[str],
        *,
        deadline: timedelta | None = None,
        scheduled_at: datetime | None = None,
        flows: Sequence[RunFlow | None] | None = None,
    ) -> list[int]:
        """Insert one run of ``template`` per input (JSON text); return their ids.

        ``flows[i]`` is the flow control of the run of ``inputs[i]`` (None: no limit).
        """
        return submit.insert_runs(
            tx,
            template,
            inputs,
            deadline=deadline,
            scheduled_at=scheduled_at,
            flows=flows,
            hooks=self._hooks,
        )

    def enqueue(
        self,
        tx: Tx,
        compiled: CompiledRun,
        *,
        unique_key: str | None = None,
        sequence_key: str | None = None,
        scheduled_at: datetime | None = None,
    ) -> Submitted:
        """Insert standalone work; with ``unique_key``, return the active holder instead."""
        return submit.insert_standalone(
            tx,
            compiled,
            unique_key=unique_key,
            sequence_key=sequence_key,
            scheduled_at=scheduled_at,
            hooks=self._hooks,
        )

    def _due_first(self, tx: Tx, run_id: int, operation: Callable[[], T]) -> T | Refused:
        """Apply what came due in the run's tree and no scanner applied yet (in due
        order), then ``operation``: it meets the run a prompt scanner would have left.
        When something came due and the operation then refuses, the refusal is returned,
        not raised: the caller commits what came due, then raises it."""
        if not self.settle_due(tx, run_id):
            return operation()
        try:
            with tx.savepoint():
                return operation()
        except CycloneError as refusal:
            return Refused(refusal)

    def settle_due(self, tx: Tx, run_id: int) -> int:
        """Apply what came due in the run's tree that no scanner applied yet, in due
        order, as a prompt scanner would have; return how many waits changed. (Every
        operation on a run does this first.)"""
        return waits.settle_due_in_tree(tx, run_id, self._hooks)

    def cancel(self, tx: Tx, run_id: int) -> Refused | None:
        return self._due_first(tx, run_id, lambda: control.cancel(tx, run_id, self._hooks))

    def fork(
        self, tx: Tx, source_run_id: int, compiled: CompiledRun, from_node: str
    ) -> tuple[int, list[str]]:
        """A new run of ``compiled`` started from ``from_node``, copying the nodes of run
        ``source_run_id`` outside its downstream part that completed; its id and the
        copied nodes. What came due in the source run is applied first, as for any
        operation on it: a timer due there is copied, not run again."""
        self.settle_due(tx, source_run_id)
        return fork.fork(tx, source_run_id, compiled, from_node, self._hooks)

    def fork_of(self, tx: Tx, run_id: int) -> Row | None:
        """Where a fork came from (source_run_id, from_node, copied), or None."""
        return tx.one(Q.fork_of, run_id=run_id)

    def retry(self, tx: Tx, run_id: int, node: str, *, force: bool = False) -> Refused | None:
        def operation() -> None:
            if force:
                replay.replay(tx, run_id, node, self._hooks)
            else:
                control.retry(tx, run_id, node, self._hooks)

        return self._due_first(tx, run_id, operation)

    def retry_run(self, tx: Tx, run_id: int) -> Refused | None:
        """Retry a failed or cancelled run as a whole: every node that failed it (a
        cancelled run: its cancelled steps), as :meth:`retry` of those nodes would."""
        return self._due_first(tx, run_id, lambda: control.retry_run(tx, run_id, self._hooks))

    # -- operations in bulk (see cyclone_dsl.engine.bulk) -----------------------------

    def bulk_bound(self, tx: Tx) -> int:
        """The newest run id now: a bulk operation started now acts on runs up to it."""
        return bulk.bound(tx)

    def count_bulk(self, tx: Tx, action: BulkAction, where: RunFilter, *, up_to: int) -> int:
        """How many runs :meth:`bulk_page` would select now (a dry run: no lock, no write)."""
        return bulk.count(tx, action, where, up_to=up_to)

    def bulk_page(
        self,
        tx: Tx,
        action: BulkAction,
        where: RunFilter,
        *,
        after_id: int,
        up_to: int,
        limit: int,
    ) -> BulkPage:
        """Lock the next ``limit`` runs ``where`` selects after ``after_id`` (ids up to
        ``up_to``), and cancel, retry (the run as a whole) or resume each through its
        single-run transition; a run that transition refuses is skipped with the reason."""
        return bulk.page(
            tx, action, where, after_id=after_id, up_to=up_to, limit=limit, hooks=self._hooks
        )

    def pause(self, tx: Tx, run_id: int) -> Refused | None:
        return self._due_first(tx, run_id, lambda: waits.pause(tx, run_id))

    def resume(self, tx: Tx, run_id: int) -> Refused | None:
        return self._due_first(tx, run_id, lambda: waits.resume(tx, run_id, self._hooks))

    def signal(self, tx: Tx, run_id: int, name: str, payload_text: str) -> Delivery | Refused:
        return self._due_first(
            tx, run_id, lambda: signals.deliver(tx, run_id, name, payload_text, self._hooks)
        )

    def end_past_deadline(self, tx: Tx, run_id: int) -> int:
        """Fail ``run_id`` if it (or a run above it) is past its deadline, as the scanner
        would: after a call refused with :class:`PassedDeadline`, whose own transaction
        rolled back. Return how many runs ended."""
        return waits.fail_past_deadline(tx, [{"id": run_id}], self._hooks)

    def purge(
        self,
        tx: Tx,
        *,
        states: Sequence[RunState],
        older_than: timedelta,
        limit: int,
        up_to: int | None = None,
    ) -> int:
        """Delete one batch of terminal runs that ended more than ``older_than`` ago (ids
        up to ``up_to``, if given: see :meth:`bulk_bound`).

        A child run is kept while its parent exists and has not completed.
        """
        if any(not state.is_terminal for state in states):
            raise InvalidArgument("only terminal runs (completed, failed, cancelled) can be purged")
        deleted = tx.rows(
            Q.purge_runs,
            states=[s.value for s in states],
            older_than=older_than,
            limit=limit,
            up_to=up_to,
        )
        if deleted:
            gates.clear_lost_holders(tx)
        return len(deleted)

    def purge_left(
        self, tx: Tx, *, states: Sequence[RunState], older_than: timedelta, up_to: int
    ) -> bool:
        """Whether a run :meth:`purge` would take is left (one a batch skipped: another
        transaction held it)."""
        row = tx.one(
            Q.purge_left, states=[s.value for s in states], older_than=older_than, up_to=up_to
        )
        return bool(row and row["left_over"])

    def count_purgeable(self, tx: Tx, *, states: Sequence[RunState], older_than: timedelta) -> int:
        """How many runs :meth:`purge` with these arguments would delete now."""
        row = tx.one(Q.count_purgeable, states=[s.value for s in states], older_than=older_than)
        return int(row["runs"]) if row else 0

    def expire_runs(self, tx: Tx, *, default_retention: timedelta, limit: int) -> int:
        """Delete one batch of terminal runs past their retention (a step's, else the default)."""
        deleted = tx.rows(Q.expire_runs, default_retention=default_retention, limit=limit)
        if deleted:
            gates.clear_lost_holders(tx)
        return len(deleted)

    # -- leases --------------------------------------------------------------------

    def claim(
        self,
        tx: Tx,
        *,
        owner: str,
        queues: Sequence[str],
        kinds: Sequence[str],
        versions: Sequence[tuple[str, str]],
        limit: int,
        lease: timedelta,
        gated: bool = False,
        capped: Collection[str] = (),
        per_queue: Mapping[str, int] | None = None,
        cursors: dict[str, str] | None = None,
    ) -> list[Claimed]:
        """Lease up to ``limit`` steps (see :func:`cyclone_dsl.engine.claim.claim`)."""
        return claim.claim(
            tx,
            owner=owner,
            queues=queues,
            kinds=kinds,
            versions=versions,
            limit=limit,
            lease=lease,
            gated=gated,
            capped=capped,
            per_queue=per_queue,
            cursors=cursors,
        )

    def heartbeat(
        self, tx: Tx, leases: Sequence[tuple[int, int]], lease: timedelta
    ) -> set[tuple[int, int]]:
        return claim.heartbeat(tx, leases, lease)

    def leases_held(self, tx: Tx, leases: Sequence[tuple[int, int]]) -> set[tuple[int, int]]:
        return claim.leases_held(tx, leases)

    def hold_lease(self, tx: Tx, step_id: int) -> bool:
        return claim.hold_lease(tx, step_id)

    def release(self, tx: Tx, leases: Sequence[tuple[int, int]]) -> set[int]:
        return claim.release(tx, leases)

    def lease_states(self, tx: Tx, step_ids: Sequence[int]) -> dict[int, str]:
        return claim.lease_states(tx, step_ids)

    def complete(
        self, tx: Tx, results: Sequence[Success], *, old_snapshot: bool = False
    ) -> set[int]:
        done = complete.complete(tx, results, self._hooks, old_snapshot=old_snapshot)
        gates.charge_units(tx, [(r.step_id, r.extra_units) for r in results if r.extra_units])
        # A limited step's outcome names the queue to wake: those are the gated ones.
        gates.park(tx, [r.step_id for r in results if r.wake_queue and r.step_id in done])
        return done

    def fail(self, tx: Tx, failures: Sequence[Failure]) -> dict[int, str]:
        """Record failed executions; return the ids applied, each with its step's new state
        (``discarded``: failed for good; ``available`` or ``paused``: it retries)."""
        states = complete.fail(tx, failures, self._hooks)
        gates.park(
            tx,
            (
                f.step_id
                for f in failures
                if f.wake_queue and states.get(f.step_id) == StepState.DISCARDED
            ),
        )
        return states

    # -- step events ---------------------------------------------------------------------

    def record_events(
        self, tx: Tx, batch: Sequence[NewEvent], *, cap: int = DEFAULT_MAX_EVENTS_PER_STEP
    ) -> list[Outcome]:
        """Store events of running steps' executions, in order, and wake their runs'
        followers (see :mod:`cyclone_dsl.engine.events`): one outcome per event, in order
        (its seq and fence, :class:`EventLimitExceeded` past ``cap``, or None when its step
        no longer exists). An event whose execution the worker has decided already (its
        timeout passed, its run was cancelled; maybe not committed yet) is stored fenced.

        One statement: on an autocommit ``tx`` it commits on its own, without waiting for
        the WAL flush (the step's completion flushes it).
        """
        return events.record_many(tx, batch, cap=cap)

    # -- scanner passes: each call handles one page, in the caller's transaction --------

    def scan_passes_with_work(
        self,
        tx: Tx,
        *,
        grace: timedelta = scan.TIMEOUT_GRACE,
        retention_every: timedelta = scan.RETENTION_LOOK_EVERY,
    ) -> frozenset[str]:
        """Which of the probed scanner passes (:data:`scan.PROBED_PASSES`) have work now."""
        return scan.probe(tx, grace=grace, retention_every=retention_every)

    def take_retention_look(self, tx: Tx, *, every: timedelta) -> bool:
        """Whether this scanner runs the retention pass now (no scanner ran it within
        ``every``); the pass's mark moves to now when it does."""
        return scan.take_retention_look(tx, every=every)

    def is_scan_leader(self, tx: Tx, scanner: str) -> bool:
        """Take this transaction's lock on one scanner pass (False: another process has it)."""
        return scan.is_leader(tx, scanner)

    def reclaim_expired_leases(
        self,
        tx: Tx,
        *,
        after_id: int,
        limit: int,
        max_reclaims: Mapping[str, int],
        default_max_reclaims: int,
        grace: timedelta = scan.TIMEOUT_GRACE,
    ) -> Page:
        """Reclaim a page of expired leases (not those of steps whose timeout plus
        ``grace`` came first: :meth:`fail_timed_out_steps` fails those)."""
        page = scan.expired_page(tx, after_id=after_id, limit=limit, grace=grace)
        rows = scan.reclaim(
            tx,
            page,
            max_reclaims=max_reclaims,
            default_max_reclaims=default_max_reclaims,
            hooks=self._hooks,
        )
        return len(rows), _next_cursor(page, limit)

    def fail_timed_out_steps(self, tx: Tx, *, after_id: int, limit: int, grace: timedelta) -> Page:
        page = scan.timed_out_page(tx, after_id=after_id, limit=limit, grace=grace)
        return len(scan.fail_timed_out(tx, page, self._hooks)), _next_cursor(page, limit)

    def wake_due_steps(self, tx: Tx) -> int:
        """Wake the queues of steps that came due since the last due pass; return how many
        queues (see :func:`cyclone_dsl.engine.scan.wake_due`)."""
        return scan.wake_due(tx)

    def fire_timers(self, tx: Tx, *, after_id: int, limit: int) -> Page:
        page = tx.rows(Q.due_timers, after_id=after_id, limit=limit)
        return waits.settle_runs_of(tx, page, self._hooks), _next_cursor(page, limit)

    def time_out_signal_waits(self, tx: Tx, *, after_id: int, limit: int) -> Page:
        page = tx.rows(Q.expired_signal_waits, after_id=after_id, limit=limit)
        return waits.settle_runs_of(tx, page, self._hooks), _next_cursor(page, limit)

    def fail_past_deadlines(self, tx: Tx, *, after_id: int, limit: int) -> Page:
        page = tx.rows(Q.expired_deadlines, after_id=after_id, limit=limit)
        return waits.fail_past_deadline(tx, page, self._hooks), _next_cursor(page, limit)

    def settle_ended_children(self, tx: Tx, *, after_id: int, limit: int) -> Page:
        """Settle parent nodes still ``waiting_child`` whose child run has ended (a repair).

        Settled nodes leave the page, so the next pass starts over: no cursor.
        """
        ended = children.repair_ended(tx, after_id=after_id, limit=limit, hooks=self._hooks)
        return len(ended), None

    def start_deferred_children(
        self, tx: Tx, *, versions: Sequence[tuple[str, str]], limit: int = 100
    ) -> int:
        """Start the child runs left waiting by a process without their definition, in runs
        of the given ``(workflow, def_version)`` pairs; return how many started."""
        return children.start_deferred(tx, versions=versions, hooks=self._hooks, limit=limit)

    def park_ended_gates(self, tx: Tx, *, after_id: int, limit: int) -> Page:
        """Park the gates of ended steps, one page (claims no longer walk past them)."""
        return gates.park_ended(tx, after_id=after_id, limit=limit)

    def clear_lost_slot_holders(self, tx: Tx) -> int:
        """Free the limit slots whose holder step or run was purged; return how many."""
        return gates.clear_lost_holders(tx)

    # -- flow control ----------------------------------------------------------------

    def set_queue_cap(self, tx: Tx, queue: str, cap: int | None) -> None:
        """Cap the running steps of ``queue`` across all workers (None: remove the cap)."""
        gates.set_queue_cap(tx, queue, cap)

    def queue_caps(self, tx: Tx) -> dict[str, int]:
        return gates.queue_caps(tx)

    def queues_with_gates(self, tx: Tx, queues: Sequence[str]) -> set[str]:
        return gates.queues_with_gates(tx, queues)

    def database_gauges(self, tx: Tx) -> list[Row]:
        """The database-wide gauges (one statement): rows of ``gauge`` (``steps``, ``runs``
        or ``waiting_runs``), ``queue``, ``state``, ``value`` and ``oldest_s``."""
        return tx.rows(Q.database_gauges)

    def flow_stats(self, tx: Tx) -> list[Row]:
        return gates.flow_stats(tx)

    def wait_reasons(self, tx: Tx, run_id: int) -> list[Row]:
        return gates.wait_reasons(tx, run_id)

    # -- schedules -------------------------------------------------------------------

    def register_schedule(
        self, tx: Tx, schedule: ScheduleRow, *, from_code: bool = False
    ) -> datetime:
        """Create or update a schedule; return its next slot (see :func:`schedules.register`)."""
        return schedules.register(tx, schedule, from_code=from_code)

    def set_schedule_enabled(self, tx: Tx, schedule_id: str, enabled: bool) -> None:
        schedules.set_enabled(tx, schedule_id, enabled)

    def delete_schedule(self, tx: Tx, schedule_id: str) -> None:
        schedules.delete(tx, schedule_id)

    def lease_due_schedules(self, tx: Tx, *, owner: str, limit: int, lease: timedelta) -> list[Row]:
        """Lease due schedules, those this engine's compiler can fire first."""
        return schedules.lease_due(
            tx, owner=owner, limit=limit, lease=lease, compile_target=self._compile_schedule
        )

    def fire_schedule(
        self, tx: Tx, schedule: Row, *, owner: str, catch_up: CatchUp = "latest"
    ) -> int | None:
        """Fire one leased schedule's due slot; return the run id (None: refused or done)."""
        if self._compile_schedule is None:
            raise InvalidArgument("this engine has no schedule compiler: it fires nothing")
        return schedules.fire(
            tx,
            schedule,
            owner=owner,
            compile_target=self._compile_schedule,
            hooks=self._hooks,
            catch_up=catch_up,
        )

    # -- the worker registry -----------------------------------------------------------

    def register_worker(
        self,
        tx: Tx,
        *,
        worker_id: str,
        host: str,
        pid: int,
        queues: Sequence[str],
        concurrency: int,
        identities: Mapping[str, str],
        versions: Sequence[tuple[str, str]],
        refuse_conflicts: bool = True,
    ) -> list[Row]:
        return workers.register(
            tx,
            worker_id=worker_id,
            host=host,
            pid=pid,
            queues=queues,
            concurrency=concurrency,
            identities=identities,
            versions=versions,
            refuse_conflicts=refuse_conflicts,
        )

    def check_handler_conflicts(
        self, tx: Tx, *, worker_id: str, identities: Mapping[str, str]
    ) -> None:
        """Raise :class:`~cyclone_dsl.errors.HandlerConflict` where a live worker serves one
        of these kinds with another handler; write nothing."""
        conflicts = workers.conflicting(tx, worker_id=worker_id, identities=identities)
        if conflicts:
            raise HandlerConflict(
                [(c["kind"], c["mine"], c["theirs"], c["worker_id"]) for c in conflicts]
            )

    def beat_worker(self, tx: Tx, worker_id: str) -> bool:
        return workers.beat(tx, worker_id)

    def stop_worker(self, tx: Tx, worker_id: str) -> None:
        workers.stop(tx, worker_id)

    def prune_workers(self, tx: Tx) -> int:
        """Forget workers stopped or silent for a day; return how many."""
        return workers.prune(tx)

    def list_workers(self, tx: Tx, live_for: timedelta = workers.LIVE_FOR) -> list[Row]:
        """Known workers, live ones first (see :func:`~cyclone_dsl.engine.workers.listing`)."""
        return workers.listing(tx, live_for)

    def unserved_work(
        self, tx: Tx, queues: Sequence[str] | None = None, live_for: timedelta = workers.LIVE_FOR
    ) -> list[Row]:
        """Due available work that no live worker serves, grouped by queue, kind and version."""
        return workers.unserved(tx, queues, live_for)


def _next_cursor(page: list[Row], limit: int) -> int | None:
    return page[-1]["id"] if len(page) >= limit else None
