"""Run creation: a whole graph in one statement, submit keys, standalone work with unique keys."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta

import attrs

from cyclone_dsl.db.errors import UniqueViolation
from cyclone_dsl.db.tx import Tx
from cyclone_dsl.engine import gates, tracecontext
from cyclone_dsl.engine.transitions import Hooks, activate
from cyclone_dsl.errors import SubmitContended
from cyclone_dsl.graph.rows import CompiledRun, RunFlow, RunTemplate, StepRow
from cyclone_dsl.sql import Q
from cyclone_dsl.states import StepState

#: How often a lost uniqueness race is re-read before giving up (it settles in one or two).
RACE_ATTEMPTS = 10


@attrs.frozen
class Submitted:
    run_id: int
    created: bool  # False when an existing run was returned (submit key, unique key)


def _seconds(value: timedelta | None) -> float | None:
    return None if value is None else value.total_seconds()


def _step_fields(
    step: StepRow, unique_key: str | None, sequence_key: str | None
) -> dict[str, object]:
    return {
        "node": step.node,
        "kind": step.kind,
        "state": step.state,
        "input_from": step.input_from,
        "queue": step.queue,
        "priority": step.priority,
        "max_attempts": step.max_attempts,
        "timeout_s": _seconds(step.timeout),
        "signal_name": step.signal_name,
        "signal_names": list(step.signal_names) if step.signal_names is not None else None,
        "wait_for_s": _seconds(step.wait_for),
        "wait_count": step.wait_count,
        "on_dep_failure": step.on_dep_failure,
        "fan_out_parallel": step.fan_out_parallel,
        "fan_out_max_bytes": step.fan_out_max_bytes,
        "child_workflow": step.child_workflow,
        "child_needs_result": step.child_needs_result,
        "retention_s": _seconds(step.retention),
        "unique_key": unique_key,
        "sequence_key": sequence_key,
    }


def _with_input_text(fields: dict[str, object], input_text: str | None) -> str:
    """One JSON object: the input is JSON text already, spliced in rather than re-encoded."""
    text = json.dumps(fields, ensure_ascii=False, separators=(",", ":"))
    return f'{text[:-1]},"input":{input_text or "null"}}}'


def _steps_document(
    steps: Iterable[StepRow], unique_key: str | None, sequence_key: str | None
) -> str:
    parts = (_with_input_text(_step_fields(s, unique_key, sequence_key), s.input) for s in steps)
    return f"[{','.join(parts)}]"


def _run_params(
    compiled: CompiledRun,
    *,
    deadline: timedelta | None = None,
    submit_key: str | None = None,
    parent: tuple[int, str] | None = None,
    scheduled_at: datetime | None = None,
    unique_key: str | None = None,
    sequence_key: str | None = None,
) -> dict[str, object]:
    return {
        "workflow": compiled.workflow,
        "def_version": compiled.def_version,
        "input": compiled.input,
        "deadline": deadline,
        "result_node": compiled.result_node,
        "submit_key": submit_key,
        "has_fan_out": compiled.has_fan_out,
        "parent_run_id": parent[0] if parent else None,
        "parent_node_id": parent[1] if parent else None,
        "scheduled_at": scheduled_at,
        "steps": _steps_document(compiled.steps, unique_key, sequence_key),
        "deps": json.dumps([attrs.asdict(d) for d in compiled.deps]),
        "inputs": json.dumps([attrs.asdict(i) for i in compiled.inputs]),
        # NOTIFY inside the insert statement: the wake-up costs no extra round trip.
        "wake": sorted({s.queue for s in compiled.steps if s.state == StepState.AVAILABLE}),
    }


def special_roots(graph: CompiledRun | RunTemplate) -> list[str]:
    """Pending nodes without dependencies: waits, timers, children, fan-outs to activate."""
    with_deps = {d.node for d in graph.deps}
    return [s.node for s in graph.steps if s.state == StepState.PENDING and s.node not in with_deps]


def _fan_out_limits(graph: CompiledRun | RunTemplate) -> list[tuple[str, int]]:
    """(node, max_items) of the fan-out nodes that set a max_items guard."""
    return [(s.node, s.fan_out_max_items) for s in graph.steps if s.fan_out_max_items is not None]


def is_one_statement(compiled: CompiledRun) -> bool:
    """Whether :func:`insert_run` is one statement (nothing to activate or record after the
    insert).

    Such a submit can run in autocommit mode: atomic on its own, and two round
    trips (BEGIN, COMMIT) shorter than an explicit transaction.
    """
    return (
        not special_roots(compiled)
        and not _fan_out_limits(compiled)
        and compiled.flow is None
        and not compiled.guards
    )


def _record_guards(tx: Tx, graph: CompiledRun | RunTemplate) -> None:
    """Store the definition's conditions before any of its nodes is activated."""
    if graph.guards:
        tx.rows(
            Q.record_guards,
            def_version=graph.def_version,
            guards=json.dumps(
                [
                    {
                        "node": g.node,
                        "condition": g.condition,
                        "variables": json.loads(g.variables),
                        "sources": list(g.sources),
                        "on_skip": g.on_skip,
                    }
                    for g in graph.guards
                ]
            ),
        )


def _record_fan_out_limits(
    tx: Tx, run_ids: Sequence[int], graph: CompiledRun | RunTemplate
) -> None:
    limits = _fan_out_limits(graph)
    if limits:
        tx.rows(
            Q.insert_fan_out_limits,
            run_ids=[run_id for run_id in run_ids for _ in limits],
            nodes=[node for _ in run_ids for node, _ in limits],
            max_items=[limit for _ in run_ids for _, limit in limits],
        )


def insert_run(
    tx: Tx,
    compiled: CompiledRun,
    *,
    deadline: timedelta | None = None,
    submit_key: str | None = None,
    parent: tuple[int, str] | None = None,
    scheduled_at: datetime | None = None,
    unique_key: str | None = None,
    sequence_key: str | None = None,
    hooks: Hooks,
) -> int:
    """Insert the run and its graph, activate special roots, wake workers; return the run id."""
    params = _run_params(
        compiled,
        deadline=deadline,
        submit_key=submit_key,
        parent=parent,
        scheduled_at=scheduled_at,
        unique_key=unique_key,
        sequence_key=sequence_key,
    )
    _record_guards(tx, compiled)
    row = tx.one(Q.insert_run_graph, **params)
    assert row is not None
    run_id: int = row["run_id"]
    if hooks.tracing is not None:
        tracecontext.on_insert(tx, hooks.tracing, run_id, compiled.workflow, parent)
    _record_fan_out_limits(tx, [run_id], compiled)
    if compiled.flow is not None:
        gates.record(tx, [run_id], [compiled.flow])
    activate(tx, [(run_id, node) for node in special_roots(compiled)], hooks)
    return run_id


def insert_runs(
    tx: Tx,
    template: RunTemplate,
    run_inputs: Sequence[str],
    *,
    deadline: timedelta | None = None,
    scheduled_at: datetime | None = None,
    flows: Sequence[RunFlow | None] | None = None,
    hooks: Hooks,
) -> list[int]:
    """Insert one run of ``template`` per input (JSON text) in two statements.

    The run ids are reserved first; then the template's rows go once and
    PostgreSQL multiplies them by the runs, so the cost in Python and in JSON
    parsing does not grow with the graph times the number of runs.
    """
    if not run_inputs:
        return []
    _record_guards(tx, template)
    ids: list[int] = [r["id"] for r in tx.rows(Q.allocate_run_ids, count=len(run_inputs))]
    steps = []
    for step in template.steps:
        fields = _step_fields(step, None, None)
        fields["input_is_run_input"] = step.input_is_run_input
        fields["run_input_keys"] = list(step.run_input_keys) or None
        steps.append(_with_input_text(fields, step.input))
    tx.one(
        Q.insert_run_graphs,
        ids=ids,
        run_inputs=list(run_inputs),
        workflow=template.workflow,
        def_version=template.def_version,
        result_node=template.result_node,
        has_fan_out=template.has_fan_out,
        steps=f"[{','.join(steps)}]",
        deps=json.dumps([attrs.asdict(d) for d in template.deps]),
        inputs=json.dumps([attrs.asdict(i) for i in template.inputs]),
        deadline=deadline,
        scheduled_at=scheduled_at,
        wake=sorted({s.queue for s in template.steps if s.state == StepState.AVAILABLE}),
    )
    if hooks.tracing is not None:
        tracecontext.record(tx, ids, hooks.tracing.current())
    _record_fan_out_limits(tx, ids, template)
    if flows is not None and any(flow is not None for flow in flows):
        gates.record(tx, ids, flows)
    roots = special_roots(template)
    activate(tx, [(run_id, node) for run_id in ids for node in roots], hooks)
    return ids


def insert_run_once(
    tx: Tx, compiled: CompiledRun, *, submit_key: str, deadline: timedelta | None, hooks: Hooks
) -> Submitted:
    """Insert unless a run of this workflow holds ``submit_key`` (in any state)."""
    for _ in range(RACE_ATTEMPTS):
        existing = tx.one(
            Q.find_run_by_submit_key, workflow=compiled.workflow, submit_key=submit_key
        )
        if existing is not None:
            return Submitted(existing["run_id"], created=False)
        try:
            with tx.savepoint():  # a savepoint: a lost race must not abort the caller's tx
                run_id = insert_run(
                    tx, compiled, deadline=deadline, submit_key=submit_key, hooks=hooks
                )
        except UniqueViolation:
            continue  # another caller committed the key meanwhile: read it back
        return Submitted(run_id, created=True)
    raise SubmitContended(f"submit key {submit_key!r} is contended; try again")


def insert_standalone(
    tx: Tx,
    compiled: CompiledRun,
    *,
    unique_key: str | None,
    sequence_key: str | None,
    scheduled_at: datetime | None,
    hooks: Hooks,
) -> Submitted:
    """Enqueue standalone work; with a unique key, return the active holder instead.

    Without a unique key this is one statement (see :func:`is_one_statement`).
    """
    if unique_key is None:
        run_id = insert_run(
            tx, compiled, scheduled_at=scheduled_at, sequence_key=sequence_key, hooks=hooks
        )
        return Submitted(run_id, created=True)
    kind = compiled.steps[0].kind
    for _ in range(RACE_ATTEMPTS):
        if unique_key is not None:
            existing = tx.one(Q.find_active_unique, kind=kind, unique_key=unique_key)
            if existing is not None:
                return Submitted(existing["run_id"], created=False)
        try:
            with tx.savepoint():
                run_id = insert_run(
                    tx,
                    compiled,
                    scheduled_at=scheduled_at,
                    unique_key=unique_key,
                    sequence_key=sequence_key,
                    hooks=hooks,
                )
        except UniqueViolation:
            # The holder committed, or rolled back and freed the key: look again.
            continue
        return Submitted(run_id, created=True)
    raise SubmitContended(f"unique key {unique_key!r} of {kind!r} is contended; try again")
