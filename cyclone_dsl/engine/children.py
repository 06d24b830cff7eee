"""child(): start a child run on activation; settle the parent node when the child ends."""

from __future__ import annotations

from cyclone_dsl.db.tx import Row, Tx
from cyclone_dsl.engine.submit import insert_run
from cyclone_dsl.engine.transitions import Hooks, after_completions, after_discards, end_runs
from cyclone_dsl.errors import CycloneError
from cyclone_dsl.failpoints import failpoint
from cyclone_dsl.graph.rows import KIND_CHILD
from cyclone_dsl.sql import Q
from cyclone_dsl.states import ErrorKind, RunState, StepState


def start_on_activation(tx: Tx, activated: list[Row], hooks: Hooks) -> None:
    """Activation hook: a child node now ``waiting_child`` inserts its child run."""
    nodes = [
        r for r in activated if r["kind"] == KIND_CHILD and r["state"] == StepState.WAITING_CHILD
    ]
    if not nodes:
        return
    inputs = {r["id"]: r for r in tx.rows(Q.assemble_inputs, ids=[n["id"] for n in nodes])}
    for node in nodes:
        if tx.one(Q.child_run_of, run_id=node["run_id"], node=node["node"]) is not None:
            continue  # started before (idx_runs_parent keeps one child per parent node)
        try:
            if hooks.compile_child is None:
                raise CycloneError("this process has no registry to compile child workflows")
            compiled = hooks.compile_child(node["child_workflow"], inputs[node["id"]]["input"])
        except CycloneError as exc:
            failed = tx.rows(
                Q.discard_node,
                id=node["id"],
                error=f"cannot start child workflow {node['child_workflow']!r}: {exc}",
                error_kind=ErrorKind.CHILD_FAILED.value,
            )
            after_discards(tx, failed, hooks)
            continue
        insert_run(tx, compiled, parent=(node["run_id"], node["node"]), hooks=hooks)
        failpoint("child.after_insert")


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
