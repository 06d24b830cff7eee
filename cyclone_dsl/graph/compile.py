"""A validated graph plus a run input becomes the rows of one run (see :mod:`rows`)."""

from __future__ import annotations

import json

import attrs

from cyclone_dsl.graph import conditions
from cyclone_dsl.graph.fingerprint import fingerprint
from cyclone_dsl.graph.model import ArgKind, Binding, Graph, Node
from cyclone_dsl.graph.rows import (
    KIND_CHILD,
    KIND_SIGNAL,
    KIND_TIMER,
    TUPLE_KEYS,
    CompiledRun,
    DepRow,
    GuardRow,
    InputRow,
    RunTemplate,
    StepRow,
)
from cyclone_dsl.graph.validate import validate
from cyclone_dsl.payload import JSONValue, encode
from cyclone_dsl.states import OnDepFailure, StepState


@attrs.frozen
class _Binding:
    """How a node gets its input, before the run input is known."""

    input: str | None = None  # JSON text of the static part
    input_from: str | None = None
    rows: tuple[InputRow, ...] = ()
    is_run_input: bool = False
    run_input_keys: tuple[str, ...] = ()


def _input_binding(node: Node) -> _Binding:
    if node.binding is Binding.NONE:
        return _Binding()
    if node.binding is Binding.STATIC:
        arg = node.args[0]
        if arg.kind is ArgKind.INPUT:
            return _Binding(is_run_input=True)
        return _Binding(input=encode(arg.value, what=f"the input of {node.id!r}"))
    if node.binding is Binding.SINGLE:
        return _Binding(input_from=node.args[0].ref)
    if node.binding is Binding.ARRAY:
        rows = [
            InputRow(node.id, slot, arg.ref or "", "array") for slot, arg in enumerate(node.args)
        ]
        return _Binding(rows=tuple(rows))
    static: dict[str, JSONValue] = {}
    from_run: list[str] = []
    rows = []
    for slot, arg in enumerate(node.args):
        if arg.kind is ArgKind.REF:
            rows.append(InputRow(node.id, slot, arg.ref or "", "tuple"))
        elif arg.kind is ArgKind.INPUT:
            from_run.append(TUPLE_KEYS[slot])
        else:
            static[TUPLE_KEYS[slot]] = arg.value
    text = encode(static, what=f"the input of {node.id!r}") if static or not rows else None
    return _Binding(input=text, rows=tuple(rows), run_input_keys=tuple(from_run))


def _state(node: Node) -> str:
    special = node.kind in (KIND_SIGNAL, KIND_TIMER, KIND_CHILD) or node.fan_out is not None
    judged = node.when is not None  # a conditional root is activated (and judged) at submit
    return StepState.PENDING if special or judged or node.deps else StepState.AVAILABLE


def _guards(graph: Graph) -> tuple[GuardRow, ...]:
    """The conditional nodes and every node downstream of one (see :class:`GuardRow`)."""
    dependents: dict[str, list[str]] = {n.id: [] for n in graph.nodes}
    for node in graph.nodes:
        for dep in node.deps:
            dependents[dep].append(node.id)
    guarded: set[str] = set()
    todo = [n.id for n in graph.nodes if n.when is not None]
    while todo:
        current = todo.pop()
        if current not in guarded:
            guarded.add(current)
            todo.extend(dependents[current])
    rows = []
    for node in graph.nodes:
        if node.id not in guarded:
            continue
        path = conditions.to_jsonpath(node.when) if node.when is not None else None
        rows.append(
            GuardRow(
                node=node.id,
                condition=path.text if path else None,
                variables=encode(path.variables if path else {}, what="condition values"),
                sources=tuple(conditions.sources(node.when)) if node.when is not None else (),
                on_skip=node.on_skip if node.deps else "run",
            )
        )
    return tuple(rows)


def compile_template(graph: Graph, *, def_version: str | None = None) -> RunTemplate:
    """Validate the graph and produce the rows every run of it shares.

    ``def_version`` passes a fingerprint computed before (a :class:`WorkflowDef`
    caches it, and its graph was validated when it was built).
    """
    if def_version is None:
        validate(graph)
        def_version = fingerprint(graph)
    steps: list[StepRow] = []
    deps: list[DepRow] = []
    inputs: list[InputRow] = []
    for node in graph.nodes:
        binding = _input_binding(node)
        inputs.extend(binding.rows)
        data = node.data_deps
        deps.extend(DepRow(node.id, dep, "data") for dep in data)
        deps.extend(DepRow(node.id, dep, "control") for dep in node.control_deps if dep not in data)
        wait, fan_out, child, options = node.wait, node.fan_out, node.child, node.options
        steps.append(
            StepRow(
                node=node.id,
                kind=node.kind,
                state=_state(node),
                input=binding.input,
                input_from=binding.input_from,
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
                fan_out_max_items=fan_out.max_items if fan_out else None,
                child_workflow=child.workflow if child else None,
                child_needs_result=child.needs_result if child else None,
                retention=options.retention,
                input_is_run_input=binding.is_run_input,
                run_input_keys=binding.run_input_keys,
            )
        )
    return RunTemplate(
        workflow=graph.workflow,
        def_version=def_version,
        result_node=graph.result,
        has_fan_out=graph.has_fan_out,
        steps=tuple(steps),
        deps=tuple(deps),
        inputs=tuple(inputs),
        guards=_guards(graph),
    )


def instantiate(
    template: RunTemplate, run_input: JSONValue, *, what: str = "the run input"
) -> CompiledRun:
    """The rows of one run: the template with ``run_input`` put where the graph uses it."""
    run_text = encode(run_input, what=what)
    return CompiledRun(
        workflow=template.workflow,
        def_version=template.def_version,
        input=run_text,
        result_node=template.result_node,
        has_fan_out=template.has_fan_out,
        steps=tuple(_with_run_input(step, run_input, run_text) for step in template.steps),
        deps=template.deps,
        inputs=template.inputs,
        guards=template.guards,
    )


def _with_run_input(step: StepRow, run_input: JSONValue, run_text: str) -> StepRow:
    if step.input_is_run_input:
        return attrs.evolve(step, input=run_text, input_is_run_input=False)
    if step.run_input_keys:
        static = json.loads(step.input) if step.input is not None else {}
        static |= dict.fromkeys(step.run_input_keys, run_input)
        text = encode(static, what=f"the input of {step.node!r}")
        return attrs.evolve(step, input=text, run_input_keys=())
    return step


def compile_run(
    graph: Graph, run_input: JSONValue, *, def_version: str | None = None
) -> CompiledRun:
    """Validate the graph and produce every row of a run of it with ``run_input``."""
    return instantiate(compile_template(graph, def_version=def_version), run_input)
