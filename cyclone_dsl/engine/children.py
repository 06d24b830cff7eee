"""child(): start a child run on activation; settle the parent node when the child ends."""

from __future__ import annotations

from collections.abc import Sequence

from cyclone_dsl.db.tx import Row, Tx
from cyclone_dsl.engine import notify
from cyclone_dsl.engine.submit import insert_run
from cyclone_dsl.engine.transitions import (
    Hooks,
    after_completions,
    after_discards,
    end_past_deadline,
    end_runs,
)
from cyclone_dsl.errors import CycloneError, InvalidTransition, UnknownWorkflow
from cyclone_dsl.failpoints import failpoint
from cyclone_dsl.graph.rows import KIND_CHILD
from cyclone_dsl.sql import Q
from cyclone_dsl.states import ErrorKind, RunState, StepState


def start_on_activation(tx: Tx, activated: list[Row], hooks: Hooks) -> None:
    """Activation hook: a child node now ``waiting_child`` inserts its child run."""
    _start(tx, activated, hooks, defer_unknown=True)


def _start(tx: Tx, activated: list[Row], hooks: Hooks, *, defer_unknown: bool) -> None:
    # In id order (a fan-out's items: their item order): the activations come from
    # statements whose row order PostgreSQL does not set, and the order decides the child
    # runs' ids and, when two cannot start, which one fails the parent.
    nodes = sorted(
        (r for r in activated if r["kind"] == KIND_CHILD and r["state"] == StepState.WAITING_CHILD),
        key=lambda r: int(r["id"]),
    )
    if not nodes:
        return
    inputs = {r["id"]: r for r in tx.rows(Q.assemble_inputs, ids=[n["id"] for n in nodes])}
    parents = {
        r["id"]: (r["workflow"], r["def_version"])
        for r in tx.rows(Q.versions_of_runs, run_ids=sorted({n["run_id"] for n in nodes}))
    }
    deferred = False
    for index, node in enumerate(nodes):
        if index and not _still_waiting(tx, node):
            # An earlier child of this batch failed as it started, which failed the parent
            # run and cancelled this node: its child run must not start.
            continue
        found = tx.one(Q.child_run_of, run_id=node["run_id"], node=node["node"])
        if found is not None:  # started before (idx_runs_parent: one child per parent node)
            if node.get("item_of") is not None and RunState(found["state"]).is_terminal:
                _reuse(tx, node, found, hooks)
            continue
        try:
            if hooks.compile_child is None:
                raise UnknownWorkflow("this process has no registry to compile child workflows")
            compiled = hooks.compile_child(
                node["child_workflow"], inputs[node["id"]]["input"], parents[node["run_id"]]
            )
        except CycloneError as exc:
            if isinstance(exc, UnknownWorkflow) and defer_unknown:
                # This process (a CLI, another application's scanner, another deploy) does
                # not have the child's definition as the run's version has it: the node
                # waits, and a worker that serves the run (so has the definitions it
                # calls) starts the child.
                deferred = True
                continue
            _fail_node(
                tx, node, f"cannot start child workflow {node['child_workflow']!r}: {exc}", hooks
            )
            continue
        insert_run(tx, compiled, parent=(node["run_id"], node["node"]), hooks=hooks)
        failpoint("child.after_insert")
    if deferred:
        notify.wake_queues(tx, [CHILD_WAKE])


def _still_waiting(tx: Tx, node: Row) -> bool:
    """Whether a child node still waits for its child run to start."""
    rows = tx.rows(Q.lease_states, ids=[node["id"]])
    return bool(rows) and rows[0]["state"] == StepState.WAITING_CHILD


def _reuse(tx: Tx, item: Row, child_run: Row, hooks: Hooks) -> None:
    """A retried fan-out item waits again for the child run it started before: a completed
    one settles it at once, a failed or cancelled one is retried in place."""
    state = RunState(child_run["state"])
    if state == RunState.COMPLETED:
        settle_parents(tx, [child_run], state, hooks)
        return
    try:
        if hooks.retry_child is None:
            raise InvalidTransition("this engine cannot retry child runs")
        with tx.savepoint():
            hooks.retry_child(tx, child_run["id"], hooks)
    except InvalidTransition as exc:
        _fail_node(tx, item, f"cannot retry child run {child_run['id']}: {exc}", hooks)


def _fail_node(tx: Tx, node: Row, error: str, hooks: Hooks) -> None:
    """A child node (or item) whose child run cannot start or restart fails for good."""
    failed = tx.rows(
        Q.discard_node, id=node["id"], error=error, error_kind=ErrorKind.CHILD_FAILED.value
    )
    after_discards(tx, failed, hooks)


#: The wake-up payload (on the work channel) of a child run left for a worker to start.
CHILD_WAKE = KIND_CHILD


def wake_unstarted_on_resume(tx: Tx, run: Row, hooks: Hooks) -> None:
    """Resume hook: child runs left for a worker to start wait while their parent is
    paused; tell the workers they may start them now."""
    found = tx.one(Q.has_unstarted_children, run_id=run["id"])
    if found is not None and found["found"]:
        notify.wake_queues(tx, [CHILD_WAKE])


def start_deferred(
    tx: Tx, *, versions: Sequence[tuple[str, str]], hooks: Hooks, limit: int = 100
) -> int:
    """Start the child runs that a process without their definition left waiting, in runs
    of the given versions (those the caller has); return how many started."""
    found = tx.rows(
        Q.unstarted_children,
        workflows=[w for w, _ in versions],
        versions=[v for _, v in versions],
        limit=limit,
    )
    if not found:
        return 0
    # A run past its deadline ends first: its child nodes are then no longer waiting.
    end_past_deadline(tx, tx.rows(Q.lock_runs, run_ids=sorted({r["run_id"] for r in found})), hooks)
    nodes = tx.rows(Q.waiting_child_nodes, ids=[r["id"] for r in found])
    _start(tx, nodes, hooks, defer_unknown=False)  # the caller has the run's definitions
    return len(nodes)


def repair_ended(tx: Tx, *, after_id: int, limit: int, hooks: Hooks) -> list[Row]:
    """Settle parent nodes still waiting for child runs that have ended; return the runs."""
    ended = tx.rows(Q.ended_children_of_waiting_nodes, after_id=after_id, limit=limit)
    if ended:
        tx.rows(Q.lock_runs, run_ids=sorted({r["id"] for r in ended}))
        for state in (RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED):
            rows = [r for r in ended if r["state"] == state]
            if rows:
                settle_parents(tx, rows, state, hooks)
    return ended


def settle_parents(tx: Tx, ended: list[Row], state: RunState, hooks: Hooks) -> None:
    """Runs-ended hook: cancel open descendants, then settle the parents' child nodes."""
    ended_ids = [r["id"] for r in ended]
    if state != RunState.COMPLETED:
        below = [r["id"] for r in tx.rows(Q.open_descendants, run_ids=ended_ids)]
        if below:
            tx.rows(Q.lock_runs, run_ids=below)
            end_runs(
                tx,
                below,
                RunState.CANCELLED,
                error="cancelled with its parent run",
                error_kind=ErrorKind.CANCELLED,
                hooks=hooks,
            )
    children = [r["id"] for r in ended if r["parent_run_id"] is not None]
    if not children:
        return
    settled = tx.rows(Q.finish_child_nodes, child_ids=children)
    done = [r for r in settled if r["state"] == StepState.COMPLETED]
    failed = [r for r in settled if r["state"] == StepState.DISCARDED]
    if done:
        after_completions(tx, done, hooks)
    if failed:
        after_discards(tx, failed, hooks)


def cancel_with_nodes(tx: Tx, run_id: int, cancelled: list[Row], hooks: Hooks) -> None:
    """Nodes-cancelled hook: the child runs of cancelled child nodes are cancelled too."""
    nodes = [r["node"] for r in cancelled if r["kind"] == KIND_CHILD]
    if not nodes:
        return
    open_runs = [r["id"] for r in tx.rows(Q.open_child_runs_of_nodes, run_id=run_id, nodes=nodes)]
    if open_runs:
        tx.rows(Q.lock_runs, run_ids=open_runs)
        end_runs(
            tx,
            open_runs,
            RunState.CANCELLED,
            error="cancelled with its parent node",
            error_kind=ErrorKind.CANCELLED,
            hooks=hooks,
        )
