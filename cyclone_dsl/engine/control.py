"""Operator transitions on whole runs: cancel and retry."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import attrs

from cyclone_dsl.db.errors import UniqueViolation
from cyclone_dsl.db.tx import Row, Tx
from cyclone_dsl.engine import children, fanout, gates
from cyclone_dsl.engine.transitions import (
    Hooks,
    activate,
    end_runs,
    finish_if_done,
)
from cyclone_dsl.errors import (
    AlreadyTerminal,
    InvalidTransition,
    NodeNotFound,
    PassedDeadline,
    RunNotFound,
)
from cyclone_dsl.graph.rows import KIND_CHILD
from cyclone_dsl.sql import Q
from cyclone_dsl.states import ErrorKind, OnDepFailure, RunState, StepState


def _lock_tree_rows(tx: Tx, run_id: int, *, checking_deadline: bool = False) -> list[Row]:
    """Lock a run, its descendant runs and their ancestors (in id order); return the rows
    of the run and its descendants (the ancestors are locked, not returned).

    ``checking_deadline``: :class:`PassedDeadline` when the run is open and it or a run
    above it is past its deadline (its end came first; the caller records it), as
    :func:`lock_run_checking_deadline` does."""
    tree = {r["id"] for r in tx.rows(Q.run_tree, run_id=run_id)}
    every = tx.rows(Q.lock_runs, run_ids=sorted(tree))
    locked = [r for r in every if r["id"] in tree]
    run = next((r for r in locked if r["id"] == run_id), None)
    if run is None:
        raise RunNotFound(run_id)
    if checking_deadline and RunState(run["state"]) in _OPEN:
        below = tree - {run_id}
        late = [r["id"] for r in every if r["past_deadline"] and r["id"] not in below]
        if late:
            raise PassedDeadline(run_id, min(late))  # the topmost: its end ends the others
    return locked


_OPEN = (RunState.RUNNING, RunState.PAUSED)
_FAILED = (StepState.DISCARDED, StepState.CANCELLED)


def cancel(tx: Tx, run_id: int, hooks: Hooks) -> None:
    """Cancel a run and every descendant run; running handlers see their leases end.
    :class:`PassedDeadline` when the run or a run above it is past its deadline."""
    open_runs = [
        r["id"]
        for r in _lock_tree_rows(tx, run_id, checking_deadline=True)
        if RunState(r["state"]) in _OPEN
    ]
    if run_id not in open_runs:
        state = tx.one(Q.get_run_state, run_id=run_id)
        raise AlreadyTerminal(run_id, state["state"] if state else "gone")
    end_runs(
        tx,
        open_runs,
        RunState.CANCELLED,
        error="the run was cancelled",
        error_kind=ErrorKind.CANCELLED,
        hooks=hooks,
    )


# -- operator retry ---------------------------------------------------------------------


@attrs.frozen
class _Plan:
    """What a retry of one run writes: computed from reads only, before any write."""

    run_id: int
    reopen: bool  # the run is terminal and goes back to running
    reset: tuple[str, ...]  # the non-item steps set back to pending, in id order
    fan_outs: tuple[str, ...]  # fan-out nodes of ``reset`` that have items
    unique: tuple[tuple[str, str], ...]  # (kind, unique_key) of the steps of ``reset``
    child_nodes: tuple[str, ...]  # child nodes of ``reset`` whose child run exists
    child_plans: tuple[tuple[str, _Plan], ...]  # (node, plan) for a failed or cancelled child


def retry(tx: Tx, run_id: int, node: str, hooks: Hooks) -> None:
    """Operator retry: run again what the run needs to finish, starting from ``node``.

    ``node`` must be discarded or cancelled (an item task ``F[i]`` stands for its
    fan-out node ``F``). The steps reset are ``node`` and every cancelled step of
    the run, less those that depend on a step that stays failed; a fan-out resets
    its failed and cancelled items and keeps its completed ones; a child node
    whose child run failed or was cancelled retries that child run as a whole.
    Each reset step gets a fresh attempt budget and reclaim count; the run is
    reopened if it had ended.

    Refused with :class:`InvalidTransition`, and nothing written, when the retry
    could not finish the run: the run is paused, past its deadline, a child run
    its parent node no longer waits for, ``node`` depends on a step that stays
    failed, or a step that failed the run would stay discarded. A unique key
    taken meanwhile by another active step refuses it too.

    A run that ended while paused (it keeps its ``paused_at``) is judged, and
    reopened, as if resumed now: its deadline moves forward by the length of the
    pause, as a resume moves it.
    """
    _lock_tree_rows(tx, run_id)
    run = tx.one(Q.retry_run, run_id=run_id)
    if run is None:
        raise RunNotFound(run_id)
    anchor = _anchor(tx, run_id, node)
    if RunState(run["state"]) == RunState.PAUSED:
        raise InvalidTransition(f"run {run_id} is paused: resume it first, then retry {node!r}")
    _check_parent_waits(tx, run)
    _apply_refusing_taken_keys(tx, _plan(tx, run, {anchor}), repr(node), hooks)


def retry_run(tx: Tx, run_id: int, hooks: Hooks) -> None:
    """Retry a failed or cancelled run as a whole: what :func:`retry` does for every node
    that failed the run at once (a cancelled run: for its cancelled steps).

    Refused with :class:`InvalidTransition` (nothing written) when the run is not
    failed or cancelled, and for the reasons :func:`retry` gives.
    """
    _lock_tree_rows(tx, run_id)
    run = tx.one(Q.retry_run, run_id=run_id)
    if run is None:
        raise RunNotFound(run_id)
    if RunState(run["state"]) not in (RunState.FAILED, RunState.CANCELLED):
        raise InvalidTransition(
            f"run {run_id} is {run['state']}: only a failed or cancelled run is retried whole"
        )
    _check_parent_waits(tx, run)
    plan = _plan(tx, run, None)
    if not plan.reset:
        raise InvalidTransition(f"run {run_id} has no discarded or cancelled node to retry")
    _apply_refusing_taken_keys(tx, plan, "it", hooks)


def _check_parent_waits(tx: Tx, run: Row) -> None:
    """A child run is retried only while its parent node waits for it."""
    if run["parent_run_id"] is None:
        return
    parent = tx.one(Q.node_state, run_id=run["parent_run_id"], node=run["parent_node_id"])
    if parent is None or parent["state"] != StepState.WAITING_CHILD:
        state = parent["state"] if parent is not None else "gone"
        # A parent node that completed cannot be retried (nor replayed: its child run
        # exists); a fork of the parent from that node starts a new child run.
        instead = (
            f"fork run {run['parent_run_id']} from its node {run['parent_node_id']!r} "
            "(client.fork), which starts a new child run"
            if state == StepState.COMPLETED
            else f"retry run {run['parent_run_id']}'s node {run['parent_node_id']!r}, "
            "which retries this run"
        )
        raise InvalidTransition(
            f"run {run['id']} is a child run of run {run['parent_run_id']}, whose node "
            f"{run['parent_node_id']!r} is {state} and does not wait for it: {instead}"
        )


def _apply_refusing_taken_keys(tx: Tx, plan: _Plan, what: str, hooks: Hooks) -> None:
    """Write ``plan``, or nothing when a unique key it needs is held by another active step."""
    with refusing_taken_keys(tx, plan.run_id, plan.unique, "retry", what):
        _apply(tx, plan, hooks)


@contextmanager
def refusing_taken_keys(
    tx: Tx, run_id: int, unique: Sequence[tuple[str, str]], action: str, what: str
) -> Iterator[None]:
    """Write what the block writes, or nothing when a step it moves back to active work
    finds its unique key held by another active step: :class:`InvalidTransition` then,
    naming ``unique``, the (kind, unique_key) of the steps it resets.

    ``action`` and ``what`` name the refused operation ("retry", "'node'")."""
    try:
        with tx.savepoint():  # a savepoint: a refused reset leaves nothing written
            yield
    except UniqueViolation:
        if not unique:
            raise
        held = ", ".join(f"kind {kind!r} with unique key {key!r}" for kind, key in unique)
        raise InvalidTransition(
            f"run {run_id}: cannot {action} {what}: another active step holds its {held}; "
            f"{action} once that step has finished"
        ) from None


def retry_child_run(tx: Tx, run_id: int, hooks: Hooks) -> None:
    """Retry an ended child run whose (fan-out item) parent node waits for it again: every
    node that failed it runs again. InvalidTransition when the run cannot finish."""
    run = tx.one(Q.retry_run, run_id=run_id)
    if run is None:
        raise RunNotFound(run_id)
    _apply(tx, _plan(tx, run, None), hooks)


def _anchor(tx: Tx, run_id: int, node: str) -> str:
    """The node the retry starts from: ``node``, or the fan-out node of an item task."""
    step = tx.one(Q.node_state, run_id=run_id, node=node)
    if step is None:
        raise NodeNotFound(run_id, node)
    if step["state"] not in _FAILED:
        state = "skipped" if step["error_kind"] == ErrorKind.SKIPPED else step["state"]
        raise InvalidTransition(
            f"run {run_id}: node {node!r} is {state}; only a discarded or cancelled "
            "node can be retried"
            + (" (a replay, force=True, judges its condition again)" if state == "skipped" else "")
        )
    if step["item_of"] is None:
        return node
    fan_out = tx.one(Q.node_state, run_id=run_id, node=step["item_of"])
    if fan_out is None or fan_out["state"] not in _FAILED:
        state = fan_out["state"] if fan_out is not None else "gone"
        raise InvalidTransition(
            f"run {run_id}: item {node!r} belongs to fan-out node {step['item_of']!r}, which "
            f"is {state}; only an item of a discarded or cancelled fan-out can be retried"
        )
    return str(step["item_of"])


def _contained(node: str, steps: dict[str, Row], dependents: dict[str, list[str]]) -> bool:
    """Whether a discarded node only cancelled its branch (see transitions.after_discards)."""
    below = dependents.get(node, [])
    return bool(below) and all(
        steps[d]["on_dep_failure"] == OnDepFailure.CANCEL_BRANCH for d in below
    )


def _plan(tx: Tx, run: Row, anchors: set[str] | None) -> _Plan:
    """The reset set of one run, or InvalidTransition.

    ``anchors`` are the nodes the operator retries; ``None`` (a child run retried
    from its parent node) means every node that failed the run.
    """
    run_id: int = run["id"]
    if run["past_deadline"]:
        raise InvalidTransition(
            f"run {run_id} is past its deadline: a retry would fail it again at once"
        )
    steps = {r["node"]: r for r in tx.rows(Q.retry_steps, run_id=run_id)}
    deps: dict[str, list[str]] = defaultdict(list)
    dependents: dict[str, list[str]] = defaultdict(list)
    for edge in tx.rows(Q.retry_deps, run_id=run_id):
        if edge["node"] in steps and edge["dep_node"] in steps:
            deps[edge["node"]].append(edge["dep_node"])
            dependents[edge["dep_node"]].append(edge["node"])
    discarded = [n for n, s in steps.items() if s["state"] == StepState.DISCARDED]
    failures = {n for n in discarded if not _contained(n, steps, dependents)}
    if anchors is None:
        anchors = failures
    elif anchors & failures:
        # Retrying a node that failed the run retries every node that failed it with it
        # (one batch of failures): each would refuse the retry of the other.
        anchors = anchors | failures
    reset = anchors | {n for n, s in steps.items() if s["state"] == StepState.CANCELLED}
    blocked_by: dict[str, str] = {}
    changed = True
    while changed:  # drop what depends on a step that stays discarded or cancelled
        changed = False
        for name in [n for n in steps if n in reset]:
            stuck = next(
                (d for d in deps[name] if steps[d]["state"] in _FAILED and d not in reset), None
            )
            if stuck is not None:
                reset.discard(name)
                blocked_by[name] = stuck
                changed = True
    for name in sorted(anchors):
        if name in reset:
            continue
        upstream = blocked_by[name]
        root = upstream
        while root in blocked_by:
            root = blocked_by[root]
        how = "which failed" if root == upstream else f"cancelled because {root!r} failed"
        raise InvalidTransition(
            f"run {run_id}: node {name!r} depends on {upstream!r}, {how}: retry {root!r}"
        )
    for name in discarded:
        if name not in reset and not _contained(name, steps, dependents):
            raise InvalidTransition(
                f"run {run_id} failed at node {name!r}: retry {name!r} (a retry that "
                "leaves it discarded cannot finish the run)"
            )
    ordered = tuple(n for n in steps if n in reset)
    child_nodes = [n for n in ordered if steps[n]["kind"] == KIND_CHILD]
    child_runs = (
        {
            r["parent_node_id"]: r
            for r in tx.rows(Q.retry_child_runs, run_id=run_id, nodes=child_nodes)
        }
        if child_nodes
        else {}
    )
    child_plans = tuple(
        (n, _plan(tx, child_runs[n], None))
        for n in child_nodes
        if n in child_runs and child_runs[n]["state"] in (RunState.FAILED, RunState.CANCELLED)
    )
    return _Plan(
        run_id=run_id,
        reopen=RunState(run["state"]).is_terminal,
        reset=ordered,
        fan_outs=tuple(n for n in ordered if steps[n]["has_items"]),
        unique=tuple(
            (steps[n]["kind"], steps[n]["unique_key"])
            for n in ordered
            if steps[n]["unique_key"] is not None
        ),
        child_nodes=tuple(n for n in child_nodes if n in child_runs),
        child_plans=child_plans,
    )


def _apply(tx: Tx, plan: _Plan, hooks: Hooks) -> None:
    """Write a plan: reset, reopen, activate; then the child runs below it."""
    run_id = plan.run_id
    tx.rows(Q.retry_reset_steps, run_id=run_id, nodes=list(plan.reset))
    if plan.fan_outs:
        tx.rows(Q.retry_reset_items, run_id=run_id, nodes=list(plan.fan_outs))
    if plan.reopen:
        tx.rows(Q.retry_reopen_run, run_id=run_id)
        gates.release_run_slots(tx, run_id)
    gates.unpark(tx, run_id)
    # Waits get a fresh timeout and timers their full duration; fan-outs without items
    # expand; child nodes without a child run start one; buffered signals are consumed.
    activate(tx, ((run_id, n) for n in plan.reset), hooks)
    for node in plan.fan_outs:  # the next items up to max_parallel, or the fan-out finishes
        fanout.advance(tx, run_id, node, hooks)
    for node, child_plan in plan.child_plans:
        parent = tx.one(Q.node_state, run_id=run_id, node=node)
        if parent is not None and parent["state"] == StepState.WAITING_CHILD:
            _apply(tx, child_plan, hooks)
    # A child node waiting for a child run that has ended (a completed child run, or one
    # that ended again at once) settles from it now.
    if plan.child_nodes:
        ended = [
            r
            for r in tx.rows(Q.retry_child_runs, run_id=run_id, nodes=list(plan.child_nodes))
            if RunState(r["state"]).is_terminal
        ]
        for state in (RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED):
            rows = [r for r in ended if r["state"] == state]
            if rows:
                children.settle_parents(tx, rows, state, hooks)
    finish_if_done(tx, [run_id], hooks)
