"""Step and run transitions shared by every caller: activation, completion, failure, run ends.

The caller holds an open transaction and, for the runs involved, their row
locks (taken first, in id order). Functions here only ever move a step out of
the state they found it in, guarded in SQL.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import LiteralString

import attrs

from cyclone_dsl.db.tx import Row, Tx
from cyclone_dsl.engine import gates, notify, sequences
from cyclone_dsl.engine.tracecontext import TraceHook
from cyclone_dsl.errors import PassedDeadline
from cyclone_dsl.graph.rows import CompiledRun
from cyclone_dsl.payload import JSONValue
from cyclone_dsl.sql import Q
from cyclone_dsl.states import ErrorKind, OnDepFailure, RunState, StepState

#: Compiles a child run: (workflow name, input, the parent run's (workflow, def_version))
#: -> rows. Supplied by the client or worker; raises UnknownWorkflow when this process has
#: not the parent's version (its child definitions may differ: another deploy's).
ChildCompiler = Callable[[str, JSONValue, tuple[str, str]], CompiledRun]


RowsHook = Callable[[Tx, list[Row], "Hooks"], None]


@attrs.define
class Hooks:
    """Extension points of activation that need more than SQL (child runs, fan-out)."""

    compile_child: ChildCompiler | None = None
    on_activated: list[RowsHook] = attrs.field(factory=list)
    on_items_completed: list[RowsHook] = attrs.field(factory=list)
    on_items_discarded: list[RowsHook] = attrs.field(factory=list)
    #: Called with the resumed run's row (id, state, has_fan_out, paused_at), locked.
    on_resumed: list[Callable[[Tx, Row, Hooks], None]] = attrs.field(factory=list)
    #: Called with the runs that just ended (rows with id, parent_run_id, parent_node_id).
    on_runs_ended: list[Callable[[Tx, list[Row], RunState, Hooks], None]] = attrs.field(
        factory=list
    )
    #: Retries an ended child run (an operator retry of the whole run), for a fan-out item
    #: retried by its fan-out: raises InvalidTransition when it cannot.
    retry_child: Callable[[Tx, int, Hooks], None] | None = None
    #: Called with the nodes of one run cancelled while the run goes on (rows with node,
    #: kind): a branch cut off by a contained failure, the open items of a failed fan-out.
    on_nodes_cancelled: list[Callable[[Tx, int, list[Row], Hooks], None]] = attrs.field(
        factory=list
    )
    #: A process that traces: runs carry trace context (None: nothing read or written).
    tracing: TraceHook | None = None


def lock_run(tx: Tx, run_id: int) -> Row | None:
    """Lock a run and its ancestor runs (in id order); return the run's own row (id, state,
    has_fan_out, paused_at), or None when there is no such run."""
    return next((r for r in tx.rows(Q.lock_runs, run_ids=[run_id]) if r["id"] == run_id), None)


def lock_run_checking_deadline(tx: Tx, run_id: int) -> Row | None:
    """:func:`lock_run` for a call that moves a running run on from outside (a signal, a
    pause): :class:`PassedDeadline` when the run or a run above it is past its deadline,
    its end being due first (the caller records it: see ``Engine.end_past_deadline``)."""
    locked = tx.rows(Q.lock_runs, run_ids=[run_id])
    run = next((r for r in locked if r["id"] == run_id), None)
    if run is None or RunState(run["state"]).is_terminal:
        return run
    late = [r["id"] for r in locked if r["past_deadline"]]
    if late:
        raise PassedDeadline(run_id, min(late))  # the topmost: its end ends the others
    return run


def end_past_deadline(tx: Tx, locked: Iterable[Row], hooks: Hooks) -> set[int]:
    """Fail the runs among ``locked`` (rows of ``lock_runs``) whose deadline has passed;
    return their ids.

    Every transition that moves a run on calls this once its runs are locked: a deadline
    that passed first wins, whether or not the scanner has got to it yet.
    """
    due = [r["id"] for r in locked if r["past_deadline"]]
    if not due:
        return set()
    ended = end_runs(
        tx,
        due,
        RunState.FAILED,
        error="the run passed its deadline",
        error_kind=ErrorKind.DEADLINE,
        hooks=hooks,
    )
    return {r["id"] for r in ended}


def activate(tx: Tx, run_nodes: Iterable[tuple[int, str]], hooks: Hooks) -> None:
    """Activate every listed pending node whose dependencies have all completed (a node of a
    conditional graph may end skipped instead; see the ``activate_candidates`` fragment)."""
    _activated(tx, Q.activate_ready, sorted(set(run_nodes)), hooks)


def after_completions(tx: Tx, completed: Sequence[Row], hooks: Hooks) -> None:
    """Follow-ups of completed steps (rows with run_id, node, item_of, has_downstream)."""
    items = [r for r in completed if r.get("item_of") is not None]
    if items:
        for hook in hooks.on_items_completed:
            hook(tx, items, hooks)
    with_downstream = [(r["run_id"], r["node"]) for r in completed if r.get("has_downstream")]
    # A run that just started a node is not done: only the others can have ended. (A hook
    # that ends a started node at once, such as an empty fan-out, follows it up itself.)
    going_on = _activated(tx, Q.activate_dependents, with_downstream, hooks)
    ended = {r["run_id"] for r in completed if r.get("item_of") is None} - going_on
    finish_if_done(tx, ended, hooks)


def _activated(
    tx: Tx, query: LiteralString, pairs: Sequence[tuple[int, str]], hooks: Hooks
) -> set[int]:
    """Run an activation query over (run id, node) pairs and follow up what it activated or
    skipped; return the runs of the nodes it started."""
    if not pairs:
        return set()
    rows = tx.rows(query, run_ids=[run for run, _ in pairs], nodes=[node for _, node in pairs])
    if not rows:
        return set()
    started = [r for r in rows if not r["skipped"]]
    notify.wake_queues(tx, (r["queue"] for r in started if r["state"] == StepState.AVAILABLE))
    if started:
        for hook in hooks.on_activated:
            hook(tx, started, hooks)
    skipped = [r for r in rows if r["skipped"]]
    if skipped:
        # A skipped node ended: what depends on it is judged in turn, and its run may end.
        after_completions(
            tx, [{**r, "item_of": None, "has_downstream": True} for r in skipped], hooks
        )
    return {r["run_id"] for r in started}


def finish_if_done(tx: Tx, run_ids: Iterable[int], hooks: Hooks) -> list[Row]:
    """Complete the runs whose steps are all terminal; return the finished runs."""
    ids = sorted(set(run_ids))
    if not ids:
        return []
    finished = tx.rows(Q.finish_runs, run_ids=ids)
    _runs_ended(tx, finished, RunState.COMPLETED, hooks)
    return finished


def after_discards(tx: Tx, discarded: Sequence[Row], hooks: Hooks) -> None:
    """Apply ``on_dep_failure`` for discarded steps (rows with run_id, node, error).

    Nodes first, item tasks after: a contained failure completes its run once nothing is
    left open, so every other node that failed in the same batch must have been judged
    (and have failed the run, if it does) before an item's failure settles its fan-out.
    In step id order: the rows come from statements whose row order PostgreSQL does not
    set, and the order decides which node a run's failure names, which item a fan-out's
    failure names, and which of two failing child runs ends failed (the other cancelled).
    """
    discarded = sorted(discarded, key=lambda r: int(r["id"]))
    items = [r for r in discarded if r.get("item_of") is not None]
    by_run: dict[int, list[Row]] = defaultdict(list)
    for row in discarded:
        if row.get("item_of") is None:
            by_run[row["run_id"]].append(row)
    failed_runs: list[int] = []
    contained: dict[int, list[Row]] = {}
    for run_id, rows in by_run.items():
        dependents = tx.rows(
            Q.dependents_of_nodes, run_ids=[run_id] * len(rows), nodes=[r["node"] for r in rows]
        )
        # Each failed node on its own: contained only if it has dependents and all of them
        # cancel their branch (a leaf's failure, or one dependent that fails the run, fails it).
        policies: dict[str, list[str | None]] = {r["node"]: [] for r in rows}
        for d in dependents:
            policies[d["dep_node"]].append(d["on_dep_failure"])
        if all(
            found and all(p == OnDepFailure.CANCEL_BRANCH for p in found)
            for found in policies.values()
        ):
            contained[run_id] = rows
        else:
            failed_runs.append(run_id)
    for run_id in failed_runs:
        first = by_run[run_id][0]
        end_runs(
            tx,
            [run_id],
            RunState.FAILED,
            error=f"cancelled: node {first['node']!r} failed",
            error_kind=ErrorKind.DEP_FAILED,
            hooks=hooks,
        )
    for run_id, rows in contained.items():
        nodes = [r["node"] for r in rows]
        cancelled = tx.rows(
            Q.cancel_downstream,
            run_id=run_id,
            nodes=nodes,
            error=f"cancelled: upstream {', '.join(repr(n) for n in nodes)} failed",
        )
        if any(c["was_running"] for c in cancelled):
            notify.steps_cancelled(tx, [run_id])
        gates.cancelled(tx, cancelled)
        nodes_cancelled(tx, run_id, cancelled, hooks)
    finish_if_done(tx, contained.keys(), hooks)
    if items:
        for hook in hooks.on_items_discarded:
            hook(tx, items, hooks)


def nodes_cancelled(tx: Tx, run_id: int, cancelled: list[Row], hooks: Hooks) -> None:
    """Follow-ups of nodes of a going run that were cancelled (rows with node, kind)."""
    if cancelled:
        for hook in hooks.on_nodes_cancelled:
            hook(tx, run_id, cancelled, hooks)


def end_runs(
    tx: Tx,
    run_ids: Sequence[int],
    state: RunState,
    *,
    error: str,
    error_kind: ErrorKind,
    hooks: Hooks,
) -> list[Row]:
    """Fail or cancel runs and every non-terminal step in them; return the runs ended."""
    ended = tx.rows(Q.end_runs, run_ids=sorted(run_ids), state=state.value)
    if ended:
        cancelled = tx.rows(
            Q.cancel_open_steps,
            run_ids=[r["id"] for r in ended],
            error=error,
            error_kind=error_kind.value,
        )
        notify.steps_cancelled(tx, (c["run_id"] for c in cancelled if c["was_running"]))
        gates.cancelled(tx, cancelled)
        sequences.wake_next(tx, cancelled)
    _runs_ended(tx, ended, state, hooks)
    return ended


def _runs_ended(tx: Tx, ended: list[Row], state: RunState, hooks: Hooks) -> None:
    if not ended:
        return
    notify.runs_finished(tx, (r["id"] for r in ended))
    gates.wake_run_slot_waiters(tx, ended)
    for hook in hooks.on_runs_ended:
        hook(tx, ended, state, hooks)
