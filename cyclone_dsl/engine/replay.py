"""Operator replay: run a node that ended, and everything downstream of it, again.

``retry(run_id, node, force=True)`` is for a node whose outcome the operator wants
recomputed (a handler fixed after it completed with a wrong result, a side effect to
redo): the node and every node that depends on it, directly or not, go back to pending
with fresh attempt budgets and no output; the run is reopened if it had ended, and the
nodes run again as their dependencies allow. Every other node keeps its outcome.
"""

from __future__ import annotations

from collections import defaultdict

from cyclone_dsl.db.tx import Tx
from cyclone_dsl.engine import gates
from cyclone_dsl.engine.control import refusing_taken_keys
from cyclone_dsl.engine.transitions import Hooks, activate, finish_if_done
from cyclone_dsl.errors import InvalidTransition, NodeNotFound, RunNotFound
from cyclone_dsl.sql import Q
from cyclone_dsl.states import RunState, StepState

#: States a node of the replayed cone may be in: ended, or not started yet.
_REPLAYABLE = frozenset(
    {StepState.COMPLETED, StepState.DISCARDED, StepState.CANCELLED, StepState.PENDING}
)


def replay(tx: Tx, run_id: int, node: str, hooks: Hooks) -> list[str]:
    """Reset ``node`` and its downstream cone and run them again; return the cone.

    Refused with :class:`InvalidTransition`, and nothing written, when the replay could
    not run or finish: the run is paused or past its deadline; ``node`` is an item
    task (replay its fan-out node); a node of the cone is still under way (running,
    waiting, available); a child node of the cone has a child run (fork the run
    instead); a node outside the cone did not complete (retry it first); a node of the
    cone has a unique key another active step holds now.

    A run that ended while paused is judged, and reopened, as if resumed now: its deadline
    moves forward by the length of the pause.
    """
    tree = [r["id"] for r in tx.rows(Q.run_tree, run_id=run_id)]
    tx.rows(Q.lock_runs, run_ids=tree)  # the locks of every run transition, in id order
    run = tx.one(Q.retry_run, run_id=run_id)
    if run is None:
        raise RunNotFound(run_id)
    if RunState(run["state"]) == RunState.PAUSED:
        raise InvalidTransition(f"run {run_id} is paused: resume it first, then replay {node!r}")
    if run["past_deadline"]:
        raise InvalidTransition(f"run {run_id} is past its deadline: a replay would fail again")
    if run["parent_run_id"] is not None:
        # Its parent's node started it, so that node cannot be replayed either.
        raise InvalidTransition(
            f"run {run_id} is a child run of run {run['parent_run_id']}, and a replay cannot "
            f"start a child run again: fork run {run['parent_run_id']} from its node "
            f"{run['parent_node_id'].split('[', 1)[0]!r} instead (client.fork), which starts "
            "a new child run"
        )
    if "[" in node:
        raise InvalidTransition(f"{node!r} is an item task: replay its fan-out node instead")
    steps = {r["node"]: r for r in tx.rows(Q.retry_steps, run_id=run_id)}
    if node not in steps:
        raise NodeNotFound(run_id, node)
    dependents: dict[str, list[str]] = defaultdict(list)
    for edge in tx.rows(Q.retry_deps, run_id=run_id):
        dependents[edge["dep_node"]].append(edge["node"])
    cone: set[str] = set()
    todo = [node]
    while todo:
        current = todo.pop()
        if current not in cone:
            cone.add(current)
            todo.extend(dependents[current])
    # A pending fan-out node with open items is collecting them: under way too.
    busy = sorted(n for n in cone if steps[n]["state"] not in _REPLAYABLE or steps[n]["open_items"])
    if busy:
        listed = ", ".join(
            f"{n!r} ({steps[n]['state']}{', items under way' if steps[n]['open_items'] else ''})"
            for n in busy
        )
        raise InvalidTransition(
            f"run {run_id}: cannot replay {node!r} while {listed} is under way: wait for it "
            "to end, or cancel the run first"
        )
    # A child node (or a fan-out over a workflow) that a condition skipped, or that ended
    # without a child run, is judged again like any node: only a child run it started stops
    # the replay, as it cannot be started again.
    parents = {r["parent_node_id"] for r in tx.rows(Q.child_runs, run_id=run_id)}
    started = {p.split("[", 1)[0] for p in parents if p is not None}
    with_children = sorted(n for n in cone if n in started)
    if with_children:
        raise InvalidTransition(
            f"run {run_id}: {', '.join(map(repr, with_children))} started a child run, which a "
            "replay cannot start again: fork the run from that node instead (client.fork)"
        )
    unfinished = sorted(
        n for n, s in steps.items() if n not in cone and s["state"] != StepState.COMPLETED
    )
    if unfinished:
        listed = ", ".join(f"{n!r} ({steps[n]['state']})" for n in unfinished)
        raise InvalidTransition(
            f"run {run_id}: cannot replay {node!r}: {listed} outside it did not complete, so "
            "the run could not finish: retry those first"
        )
    ordered = [n for n in steps if n in cone]
    unique = [
        (steps[n]["kind"], steps[n]["unique_key"])
        for n in ordered
        if steps[n]["unique_key"] is not None
    ]
    # A node back to pending takes its unique key again: refused while another active
    # step holds it, as a retry is.
    with refusing_taken_keys(tx, run_id, unique, "replay", repr(node)):
        tx.rows(Q.replay_reset_steps, run_id=run_id, nodes=ordered)
        fan_outs = [n for n in ordered if steps[n]["has_items"]]
        if fan_outs and tx.rows(Q.replay_drop_items, run_id=run_id, nodes=fan_outs):
            # A slot whose holder is deleted is free to no claim (they take slots without a
            # holder, or whose holder they see has ended): the items' slots of a key or a
            # queue cap would stay taken until the scanner's slow pass.
            gates.clear_lost_holders(tx)
        if RunState(run["state"]).is_terminal:
            tx.rows(Q.retry_reopen_run, run_id=run_id)
            gates.release_run_slots(tx, run_id)
        gates.unpark(tx, run_id)
        activate(tx, ((run_id, n) for n in ordered), hooks)
        finish_if_done(tx, [run_id], hooks)
    return ordered
