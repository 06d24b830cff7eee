"""Forks: a new run of a run's graph, started again from one of its nodes.

The fork's nodes outside ``from_node``'s downstream part that completed (or were skipped)
in the source run are *copied*: inserted completed, with the outputs the source recorded,
and never run. ``from_node``, what depends on it, and every node the source run did not
complete run as in a new run. The graph may be the source's definition or a newer one of
the same workflow; a copied node must have the same kind in both.
"""

from __future__ import annotations

from collections import defaultdict

import attrs

from cyclone_dsl.db.tx import Tx
from cyclone_dsl.engine import submit
from cyclone_dsl.engine.transitions import Hooks, activate
from cyclone_dsl.errors import InvalidArgument, InvalidTransition, RunNotFound
from cyclone_dsl.graph.rows import CompiledRun, RunFlow
from cyclone_dsl.sql import Q
from cyclone_dsl.states import StepState


def fork(
    tx: Tx, source_run_id: int, compiled: CompiledRun, from_node: str, hooks: Hooks
) -> tuple[int, list[str]]:
    """Insert the fork of run ``source_run_id`` from ``from_node``; return its id and the
    nodes it copied."""
    source = tx.one(Q.fork_source, run_id=source_run_id)
    if source is None:
        raise RunNotFound(source_run_id)
    if source["workflow"] != compiled.workflow:
        raise InvalidArgument(
            f"run {source_run_id} is a run of {source['workflow']!r}, not {compiled.workflow!r}"
        )
    nodes = [s.node for s in compiled.steps]
    if from_node not in nodes:
        raise InvalidArgument(
            f"{from_node!r} is not a node of workflow {compiled.workflow!r} at "
            f"{compiled.def_version} (an item task F[i] is forked from its fan-out node F)"
        )
    recorded = {r["node"]: r for r in tx.rows(Q.fork_source_steps, run_id=source_run_id)}
    deps: dict[str, list[str]] = defaultdict(list)
    dependents: dict[str, list[str]] = defaultdict(list)
    for edge in compiled.deps:
        deps[edge.node].append(edge.dep_node)
        dependents[edge.dep_node].append(edge.node)
    cone: set[str] = set()
    todo = [from_node]
    while todo:
        current = todo.pop()
        if current not in cone:
            cone.add(current)
            todo.extend(dependents[current])
    kinds = {s.node: s.kind for s in compiled.steps}
    copied: list[str] = []
    for node in nodes:  # builder order: every node comes after its dependencies
        was = recorded.get(node)
        if node in cone or was is None or was["state"] != StepState.COMPLETED:
            continue
        if was["kind"] != kinds[node]:
            raise InvalidTransition(
                f"cannot fork run {source_run_id} onto {compiled.def_version}: node {node!r} "
                f"ran {was['kind']!r} there and is {kinds[node]!r} in this definition"
            )
        if all(dep in copied for dep in deps[node]):
            copied.append(node)
    kept = set(copied)
    rows = attrs.evolve(
        compiled,
        steps=tuple(
            attrs.evolve(s, state=StepState.COMPLETED.value) if s.node in kept else s
            for s in compiled.steps
        ),
        flow=_without(compiled.flow, kept),
    )
    # Nothing is activated before the copied nodes hold their outputs: a root that ends as
    # it starts (an empty fan-out) would activate nodes that read them.
    run_id = submit.insert_run(tx, rows, activate_roots=False, hooks=hooks)
    tx.rows(
        Q.fork_copy,
        run_id=run_id,
        source_run_id=source_run_id,
        from_node=from_node,
        nodes=copied,
    )
    activate(tx, [(run_id, n) for n in nodes if n not in kept], hooks)
    return run_id, copied


def _without(flow: RunFlow | None, copied: set[str]) -> RunFlow | None:
    """The run's flow control without the gates of copied nodes (they never run)."""
    if flow is None:
        return None
    gates = tuple(g for g in flow.gates if g.node not in copied)
    return attrs.evolve(flow, gates=gates) if gates else None
