"""Run creation: a whole graph in one statement, submit keys, standalone work with unique keys."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timedelta

import attrs

from cyclone_dsl.db.errors import (
    DatabaseError,
    SerializationFailure,
    UniqueViolation,
    is_lock_wait_timeout,
)
from cyclone_dsl.db.tx import Tx
from cyclone_dsl.engine import gates, tracecontext
from cyclone_dsl.engine.transitions import Hooks, activate
from cyclone_dsl.errors import SubmitContended
from cyclone_dsl.graph.rows import CompiledRun, RunFlow, RunTemplate, StepRow
from cyclone_dsl.payload import DEFAULT_MAX_BYTES
from cyclone_dsl.sql import Q
from cyclone_dsl.states import StepState

#: How often a lost uniqueness race is re-read before giving up (it settles in one or two).
RACE_ATTEMPTS = 10


@attrs.frozen
class Submitted:
    run_id: int
    created: bool  # False when an existing run was returned (submit key, unique key)


@attrs.frozen
class TemplateRun:
    """One run of ``template`` with ``input`` (JSON text) and its flow control.

    The insert puts the run input where the graph uses it, so the template's rows are
    encoded once per definition (see :func:`graph_text`) rather than once per submit.
    """

    template: RunTemplate
    input: str
    flow: RunFlow | None = None

    @property
    def workflow(self) -> str:
        return self.template.workflow


#: What :func:`insert_run` inserts: rows compiled for one run, or a template and an input.
OneRun = CompiledRun | TemplateRun


@attrs.frozen
class GraphText:
    """A graph's rows as the insert statements take them, and what the submit does after."""

    steps: str  # JSON array; null fields left out (jsonb_to_recordset reads them as NULL)
    deps: str
    inputs: str
    wake: list[str]  # the queues of the steps that start available
    roots: tuple[str, ...]  # see special_roots
    fan_out_limits: tuple[tuple[str, int], ...]
    splice_chars: int  # the longest input a run input is put into, less the run input
    splice_count: int  # how many times that input holds the run input


def _seconds(value: timedelta | None) -> float | None:
    return None if value is None else value.total_seconds()


def _step_json(step: StepRow) -> str:
    """One step as a JSON object; its input (JSON text already) is spliced in, not re-encoded."""
    fields: dict[str, object] = {
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
        "input_is_run_input": step.input_is_run_input or None,
        "run_input_keys": list(step.run_input_keys) or None,
    }
    text = json.dumps(
        {k: v for k, v in fields.items() if v is not None},
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return text if step.input is None else f'{text[:-1]},"input":{step.input}}}'


def _build_text(graph: CompiledRun | RunTemplate) -> GraphText:
    splices = [
        (len(s.input or "") + sum(len(k) + 4 for k in s.run_input_keys), len(s.run_input_keys))
        for s in graph.steps
        if s.run_input_keys
    ]
    return GraphText(
        steps=f"[{','.join(_step_json(s) for s in graph.steps)}]",
        deps=json.dumps([attrs.asdict(d) for d in graph.deps]),
        inputs=json.dumps([attrs.asdict(i) for i in graph.inputs]),
        wake=sorted({s.queue for s in graph.steps if s.state == StepState.AVAILABLE}),
        roots=tuple(special_roots(graph)),
        fan_out_limits=tuple(_fan_out_limits(graph)),
        splice_chars=max((chars for chars, _ in splices), default=0),
        splice_count=max((count for _, count in splices), default=0),
    )


#: Templates seen, by identity (a definition keeps its template for the process's life).
_TEXTS: dict[int, tuple[RunTemplate, GraphText]] = {}
_TEXTS_MAX = 1024


def graph_text(graph: CompiledRun | RunTemplate) -> GraphText:
    """The insert's text of ``graph``: built once per template, each time for compiled rows
    (whose inputs differ from run to run)."""
    if not isinstance(graph, RunTemplate):
        return _build_text(graph)
    seen = _TEXTS.get(id(graph))
    if seen is not None and seen[0] is graph:
        return seen[1]
    text = _build_text(graph)
    if len(_TEXTS) >= _TEXTS_MAX:  # templates made on the fly (standalone options): no leak
        _TEXTS.clear()
    _TEXTS[id(graph)] = (graph, text)
    return text


def template_fits(template: RunTemplate, input_text: str) -> bool:
    """Whether the insert may put ``input_text`` into the template's step inputs itself:
    each such input stays under the payload limit (else compiling the run in Python
    refuses it with :class:`~cyclone_dsl.errors.PayloadTooLarge`, naming the step)."""
    text = graph_text(template)
    chars = text.splice_chars + text.splice_count * len(input_text)
    return text.splice_count == 0 or chars * 4 <= DEFAULT_MAX_BYTES


def special_roots(graph: CompiledRun | RunTemplate) -> list[str]:
    """Pending nodes without dependencies: waits, timers, children, fan-outs to activate."""
    with_deps = {d.node for d in graph.deps}
    return [s.node for s in graph.steps if s.state == StepState.PENDING and s.node not in with_deps]


def _fan_out_limits(graph: CompiledRun | RunTemplate) -> list[tuple[str, int]]:
    """(node, max_items) of the fan-out nodes that set a max_items guard."""
    return [(s.node, s.fan_out_max_items) for s in graph.steps if s.fan_out_max_items is not None]


def is_one_statement(run: OneRun) -> bool:
    """Whether :func:`insert_run` is one statement (nothing to activate or record after the
    insert).

    Such a submit can run in autocommit mode: atomic on its own, and two round
    trips (BEGIN, COMMIT) shorter than an explicit transaction.
    """
    return run.flow is None and is_one_statement_graph(_rows_of(run))


def is_one_statement_graph(graph: CompiledRun | RunTemplate) -> bool:
    """Whether inserting runs of ``graph`` without flow control is one statement."""
    if isinstance(graph, RunTemplate):
        text = graph_text(graph)
        return not text.roots and not text.fan_out_limits and not graph.guards
    return not special_roots(graph) and not _fan_out_limits(graph) and not graph.guards


def _rows_of(run: OneRun) -> CompiledRun | RunTemplate:
    return run.template if isinstance(run, TemplateRun) else run


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


def _record_fan_out_limits(tx: Tx, run_ids: Sequence[int], text: GraphText) -> None:
    limits = text.fan_out_limits
    if limits:
        tx.rows(
            Q.insert_fan_out_limits,
            run_ids=[run_id for run_id in run_ids for _ in limits],
            nodes=[node for _ in run_ids for node, _ in limits],
            max_items=[limit for _ in run_ids for _, limit in limits],
        )


def insert_run(
    tx: Tx,
    run: OneRun,
    *,
    deadline: timedelta | None = None,
    submit_key: str | None = None,
    parent: tuple[int, str] | None = None,
    scheduled_at: datetime | None = None,
    unique_key: str | None = None,
    sequence_key: str | None = None,
    activate_roots: bool = True,
    hooks: Hooks,
) -> int:
    """Insert the run and its graph, activate special roots (unless the caller does it, as a
    fork after writing its copied outputs), wake workers; return the run id."""
    graph = _rows_of(run)
    text = graph_text(graph)
    _record_guards(tx, graph)
    row = tx.one(
        Q.insert_run_graph,
        workflow=graph.workflow,
        def_version=graph.def_version,
        input=run.input,
        deadline=deadline,
        result_node=graph.result_node,
        submit_key=submit_key,
        has_fan_out=graph.has_fan_out,
        parent_run_id=parent[0] if parent else None,
        parent_node_id=parent[1] if parent else None,
        scheduled_at=scheduled_at,
        steps=text.steps,
        deps=text.deps,
        inputs=text.inputs,
        unique_key=unique_key,
        sequence_key=sequence_key,
        # NOTIFY inside the insert statement: the wake-up costs no extra round trip.
        wake=text.wake,
    )
    assert row is not None
    run_id: int = row["run_id"]
    if hooks.tracing is not None:
        tracecontext.on_insert(tx, hooks.tracing, run_id, graph.workflow, parent)
    _record_fan_out_limits(tx, [run_id], text)
    if run.flow is not None:
        gates.record(tx, [run_id], [run.flow])
    if activate_roots:
        activate(tx, [(run_id, node) for node in text.roots], hooks)
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
    """Insert one run of ``template`` per input (JSON text) in one statement.

    The template's rows go once and PostgreSQL multiplies them by the runs, so
    the cost in Python and in JSON parsing does not grow with the graph times
    the number of runs. With no roots to activate, no limits and no trace
    context to record, it is the whole submit (see :func:`is_one_statement_graph`).
    """
    if not run_inputs:
        return []
    text = graph_text(template)
    _record_guards(tx, template)
    row = tx.one(
        Q.insert_run_graphs,
        run_inputs=list(run_inputs),
        workflow=template.workflow,
        def_version=template.def_version,
        result_node=template.result_node,
        has_fan_out=template.has_fan_out,
        steps=text.steps,
        deps=text.deps,
        inputs=text.inputs,
        deadline=deadline,
        scheduled_at=scheduled_at,
        wake=text.wake,
    )
    assert row is not None
    ids: list[int] = row["ids"]
    if hooks.tracing is not None:
        tracecontext.on_insert_many(tx, hooks.tracing, ids)
    _record_fan_out_limits(tx, ids, text)
    if flows is not None and any(flow is not None for flow in flows):
        gates.record(tx, ids, flows)
    activate(tx, [(run_id, node) for run_id in ids for node in text.roots], hooks)
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
            _lost_in_old_snapshot(tx, f"submit key {submit_key!r}")
            continue  # another caller committed the key meanwhile: read it back
        except DatabaseError as exc:
            if not is_lock_wait_timeout(exc):
                raise
            continue  # the key's holder has not committed yet: look again
        return Submitted(run_id, created=True)
    raise SubmitContended(f"submit key {submit_key!r} is contended; try again")


def _lost_in_old_snapshot(tx: Tx, what: str) -> None:
    """A key race lost in a transaction whose snapshot predates the winner's commit
    (repeatable read, serializable: a caller's ``*_tx``) can never read the winner back:
    raise a serialization failure, which the caller's retry of the whole transaction
    handles as any other (and the retry then finds the winner's run)."""
    row = tx.one(Q.transaction_isolation)
    if row is not None and row["level"] != "read committed":
        raise SerializationFailure(
            f"{what} was taken by a transaction that committed after this one's snapshot "
            f"({row['level']}): roll back and run the transaction again"
        )


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
            _lost_in_old_snapshot(tx, f"unique key {unique_key!r} of {kind!r}")
            # The holder committed, or rolled back and freed the key: look again.
            continue
        except DatabaseError as exc:
            if not is_lock_wait_timeout(exc):
                raise
            continue  # the key's holder has not committed yet: look again
        return Submitted(run_id, created=True)
    raise SubmitContended(f"unique key {unique_key!r} of {kind!r} is contended; try again")
