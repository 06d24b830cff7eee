"""Operator transitions on whole runs: cancel and retry."""

from __future__ import annotations

from cyclone_dsl.db.tx import Tx
from cyclone_dsl.engine.transitions import DEFAULT_HOOKS, Hooks, activate, end_runs
from cyclone_dsl.errors import AlreadyTerminal, InvalidTransition, NodeNotFound, RunNotFound
from cyclone_dsl.sql import Q
from cyclone_dsl.states import ErrorKind, RunState, StepState


def _lock_tree(tx: Tx, run_id: int) -> list[int]:
    tree = [r["id"] for r in tx.rows(Q.run_tree, run_id=run_id)]
    locked = tx.rows(Q.lock_runs, run_ids=tree)
    if not any(r["id"] == run_id for r in locked):
        raise RunNotFound(run_id)
    return [r["id"] for r in locked if RunState(r["state"]) in _OPEN]


_OPEN = (RunState.RUNNING, RunState.PAUSED)


def cancel(tx: Tx, run_id: int, hooks: Hooks = DEFAULT_HOOKS) -> None:
    """Cancel a run and every descendant run; running handlers see their leases end."""
    open_runs = _lock_tree(tx, run_id)
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


def retry(tx: Tx, run_id: int, node: str, hooks: Hooks = DEFAULT_HOOKS) -> None:
    """Operator retry: the node (discarded or cancelled) and every cancelled step run again.

    The node gets a fresh attempt budget (``attempt = 0``) and reclaim count;
    a failed or cancelled run is reopened.
    """
    locked = tx.rows(Q.lock_runs, run_ids=[run_id])
    if not locked:
        raise RunNotFound(run_id)
    step = tx.one(Q.node_state, run_id=run_id, node=node)
    if step is None:
        raise NodeNotFound(run_id, node)
    if step["state"] not in (StepState.DISCARDED, StepState.CANCELLED):
        raise InvalidTransition(
            f"run {run_id}: node {node!r} is {step['state']}; only a discarded or cancelled "
            "node can be retried"
        )
    if RunState(locked[0]["state"]) not in _OPEN:
        tx.rows(Q.reopen_run, run_id=run_id)
    reset = tx.rows(Q.retry_node, run_id=run_id, node=node)
    activate(tx, ((run_id, r["node"]) for r in reset), hooks)
