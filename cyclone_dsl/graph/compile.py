"""A validated graph plus a run input becomes the rows of one run (see :mod:`rows`)."""

from __future__ import annotations

from cyclone_dsl.graph.fingerprint import fingerprint
from cyclone_dsl.graph.model import Arg, ArgKind, Binding, Graph, Node
from cyclone_dsl.graph.rows import (
    KIND_CHILD,
    KIND_SIGNAL,
    KIND_TIMER,
    TUPLE_KEYS,
    CompiledRun,
    DepRow,
    InputRow,
    StepRow,
)
from cyclone_dsl.graph.validate import validate
from cyclone_dsl.payload import JSONValue, encode
from cyclone_dsl.states import OnDepFailure, StepState


def _value(arg: Arg, run_input: JSONValue) -> JSONValue:
    return run_input if arg.kind is ArgKind.INPUT else arg.value


def _input_binding(
    node: Node, run_input: JSONValue
) -> tuple[str | None, str | None, list[InputRow]]:
    """(input JSON text, input_from, input rows) of a node."""
    if node.binding is Binding.NONE:
        return None, None, []
    if node.binding is Binding.STATIC:
        return encode(_value(node.args[0], run_input), what=f"the input of {node.id!r}"), None, []
    if node.binding is Binding.SINGLE:
        return None, node.args[0].ref, []
    if node.binding is Binding.ARRAY:
        rows = [
            InputRow(node.id, slot, arg.ref or "", "array") for slot, arg in enumerate(node.args)
        ]
        return None, None, rows
    static: dict[str, JSONValue] = {}
    rows = []
    for slot, arg in enumerate(node.args):
        if arg.kind is ArgKind.REF:
            rows.append(InputRow(node.id, slot, arg.ref or "", "tuple"))
        else:
            static[TUPLE_KEYS[slot]] = _value(arg, run_input)
    text = encode(static, what=f"the input of {node.id!r}") if static or not rows else None
    return text, None, rows


def _state(node: Node) -> str:
    special = node.kind in (KIND_SIGNAL, KIND_TIMER, KIND_CHILD) or node.fan_out is not None
    return StepState.PENDING if special or node.deps else StepState.AVAILABLE


def compile_run(
    graph: Graph, run_input: JSONValue, *, def_version: str | None = None
) -> CompiledRun:
    """Validate the graph and produce every row of a run of it with ``run_input``.

    ``def_version`` passes a fingerprint computed before (a :class:`WorkflowDef`
    caches it, and its graph was validated when it was built).
    """
    if def_version is None:
        validate(graph)
        def_version = fingerprint(graph)
    run_text = encode(run_input, what="the run input")
    steps: list[StepRow] = []
    deps: list[DepRow] = []
    inputs: list[InputRow] = []
    for node in graph.nodes:
        text, input_from, rows = _input_binding(node, run_input)
        inputs.extend(rows)
        data = node.data_deps
        deps.extend(DepRow(node.id, dep, "data") for dep in data)
        deps.extend(DepRow(node.id, dep, "control") for dep in node.control_deps if dep not in data)
        wait, fan_out, child, options = node.wait, node.fan_out, node.child, node.options
        steps.append(
            StepRow(
                node=node.id,
                kind=node.kind,
                state=_state(node),
                input=text,
                input_from=input_from,
                queue=options.queue,
                priority=options.priority,
                max_attempts=options.max_attempts,
                timeout=options.timeout,
                signal_name=wait.signal_name if wait else None,
                signal_names=wait.signal_names if wait else None,
                wait_for=wait.duration if wait else None,
                wait_count=wait.count if wait else None,
                on_dep_failure=(
                    None
                    if options.on_dep_failure == OnDepFailure.FAIL_RUN
                    else options.on_dep_failure
                ),
                fan_out_parallel=fan_out.max_parallel if fan_out else None,
                fan_out_max_bytes=fan_out.max_bytes if fan_out else None,
                child_workflow=child.workflow if child else None,
                child_needs_result=child.needs_result if child else None,
                retention=options.retention,
            )
        )
    return CompiledRun(
        workflow=graph.workflow,
        def_version=def_version,
        input=run_text,
        result_node=graph.result,
        has_fan_out=graph.has_fan_out,
        steps=tuple(steps),
        deps=tuple(deps),
        inputs=tuple(inputs),
    )
