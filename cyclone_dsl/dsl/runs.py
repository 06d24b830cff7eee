"""From definitions to rows, without I/O: workflows, standalone work, child runs, schedules.

Shared by the clients, the worker and the scanner (the engine takes the
compilers it needs as callables, so it never imports the DSL).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

import attrs

from cyclone_dsl.dsl.gating import standalone_flow, workflow_flow
from cyclone_dsl.dsl.registry import Registry
from cyclone_dsl.dsl.schedule import ScheduleSpec, check_schedule
from cyclone_dsl.dsl.step import (
    StepDef,
    call_problem,
    count_fits,
    handler_signature,
    make_options,
    takes_positional,
)
from cyclone_dsl.dsl.workflow import WorkflowDef
from cyclone_dsl.errors import (
    CycloneError,
    InvalidArgument,
    ScheduleError,
    UnknownDefinition,
    UnknownKind,
    UnknownWorkflow,
)
from cyclone_dsl.graph.compile import instantiate
from cyclone_dsl.graph.model import NodeOptions
from cyclone_dsl.graph.rows import (
    CompiledRun,
    RunFlow,
    RunTemplate,
    ScheduleCompiler,
    ScheduleRow,
    StepRow,
)
from cyclone_dsl.graph.validate import check_options
from cyclone_dsl.payload import JSONValue, encode
from cyclone_dsl.states import StepState


def resolve_workflow(registry: Registry, workflow: object) -> WorkflowDef:
    if isinstance(workflow, WorkflowDef):
        return workflow
    if isinstance(workflow, str):
        return registry.workflow(workflow)
    raise UnknownWorkflow(f"{workflow!r} is not a @workflow (or the name of a registered one)")


def resolve_step(registry: Registry, step: object) -> StepDef[Any, Any]:
    if isinstance(step, StepDef):
        return step
    if isinstance(step, str):
        return registry.kind(step)
    raise UnknownKind(f"{step!r} is not a @step or @action (or a registered kind name)")


def resolve_schedulable(registry: Registry, target: object) -> StepDef[Any, Any] | WorkflowDef:
    """A workflow or handler, given as the object or by name."""
    if isinstance(target, StepDef | WorkflowDef):
        return target
    if isinstance(target, str):
        if target in registry.workflows:
            return registry.workflows[target]
        return registry.kind(target)
    raise UnknownDefinition(f"{target!r} is not a @workflow, @step or @action")


def workflow_template(registry: Registry, workflow: object) -> RunTemplate:
    """The rows every run of ``workflow`` shares (for bulk submits)."""
    return resolve_workflow(registry, workflow).template


def compile_workflow(registry: Registry, workflow: object, run_input: JSONValue) -> CompiledRun:
    """Every row of one run of ``workflow`` with ``run_input``, with its flow control."""
    return compile_definition(resolve_workflow(registry, workflow), run_input)


def compile_definition(definition: WorkflowDef, run_input: JSONValue) -> CompiledRun:
    compiled = instantiate(definition.template, run_input)
    flow = workflow_flow(
        definition.name,
        definition.concurrency,
        definition.step_defs(),
        compiled.steps,
        run_input,
    )
    return compiled if flow is None else attrs.evolve(compiled, flow=flow)


def workflow_flows(
    registry: Registry, workflow: object, inputs: Iterable[JSONValue]
) -> list[RunFlow | None]:
    """The flow control of one run per input (for bulk submits; None where nothing applies)."""
    definition = resolve_workflow(registry, workflow)
    handlers = definition.step_defs()
    steps = definition.template.steps
    return [
        workflow_flow(definition.name, definition.concurrency, handlers, steps, value)
        for value in inputs
    ]


def standalone_template(
    registry: Registry,
    step: object,
    *,
    queue: str | None,
    priority: int | None,
    max_attempts: int | None,
    timeout: timedelta | float | None,
    retention: timedelta | float | None,
) -> RunTemplate:
    """Standalone work: one available step whose kind is also the run's workflow name.

    Refuses (:class:`InvalidArgument`) a handler a worker could not call the
    standalone way: with the input as its one positional argument, or with no
    argument when it takes no positional parameter.
    """
    definition = resolve_step(registry, step)
    check_standalone_handler(definition)
    options = step_options(
        definition,
        queue=queue,
        priority=priority,
        max_attempts=max_attempts,
        timeout=timeout,
        retention=retention,
    )
    row = StepRow(
        node=definition.name,
        kind=definition.name,
        state=StepState.AVAILABLE.value,
        queue=options.queue,
        priority=options.priority,
        max_attempts=options.max_attempts,
        timeout=options.timeout,
        retention=options.retention,
        input_is_run_input=True,
    )
    return RunTemplate(
        workflow=definition.name,
        def_version="standalone",
        result_node=definition.name if definition.keep_output else None,
        has_fan_out=False,
        steps=(row,),
        deps=(),
        inputs=(),
    )


def compile_standalone(
    registry: Registry,
    step: object,
    run_input: JSONValue,
    *,
    queue: str | None,
    priority: int | None,
    max_attempts: int | None,
    timeout: timedelta | float | None,
    retention: timedelta | float | None,
    concurrency_key: str | None = None,
) -> CompiledRun:
    """A standalone run (see :func:`standalone_template`) with its input."""
    template = standalone_template(
        registry,
        step,
        queue=queue,
        priority=priority,
        max_attempts=max_attempts,
        timeout=timeout,
        retention=retention,
    )
    definition = resolve_step(registry, step)
    check_standalone_inputs(definition, (run_input,))
    compiled = instantiate(template, run_input, what="the input")
    flow = standalone_flow(definition, run_input, concurrency_key=concurrency_key)
    return compiled if flow is None else attrs.evolve(compiled, flow=flow)


def standalone_flows(
    registry: Registry, step: object, inputs: Iterable[JSONValue]
) -> list[RunFlow | None]:
    """The flow control of one standalone run per input (for bulk enqueues)."""
    definition = resolve_step(registry, step)
    return [standalone_flow(definition, value) for value in inputs]


def check_standalone_handler(definition: StepDef[Any, Any]) -> None:
    """Refuse a handler that standalone work cannot call (it would fail at run time)."""
    signature = handler_signature(definition.fn)
    if signature is None:
        return
    passed = 1 if takes_positional(signature) else 0
    problem = call_problem(definition.fn, definition.name, passed, "standalone work")
    if problem is None:
        return
    if passed and not count_fits(signature, passed):
        problem += (
            " (enqueue() passes its input as the one positional argument): give the handler "
            "one parameter and pass a dict or a list to carry several values, or call it "
            "from a @workflow, which can pass 2 to 4 arguments"
        )
    raise InvalidArgument(f"cannot enqueue {definition.name!r}: {problem}")


def check_standalone_inputs(definition: StepDef[Any, Any], inputs: Iterable[JSONValue]) -> None:
    """Refuse an input for a handler that takes no positional parameter (it would be dropped)."""
    signature = handler_signature(definition.fn)
    if signature is None or takes_positional(signature):
        return
    values = list(inputs)
    for index, value in enumerate(values):
        if value is not None:
            which = "an input" if len(values) == 1 else f"an input (inputs[{index}])"
            raise InvalidArgument(
                f"cannot enqueue {definition.name!r} with {which}: the handler takes no "
                "positional argument, so standalone work calls it with none and the input "
                "would be dropped; enqueue it without an input (None), or give the handler "
                "a parameter for it"
            )


def step_options(
    definition: StepDef[Any, Any],
    *,
    queue: str | None,
    priority: int | None,
    max_attempts: int | None,
    timeout: timedelta | float | None,
    retention: timedelta | float | None,
) -> NodeOptions:
    """The handler's options with the given overrides, validated."""
    try:
        options = make_options(
            definition.options,
            {
                "queue": queue,
                "priority": priority,
                "max_attempts": max_attempts,
                "timeout": timeout,
                "retention": retention,
            },
        )
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(str(exc)) from None
    problems = check_options(options)
    if problems:
        raise InvalidArgument("; ".join(problems))
    return options


def schedule_row(target: StepDef[Any, Any] | WorkflowDef, spec: ScheduleSpec) -> ScheduleRow:
    """The row that registers ``spec`` of ``target`` (validated; a workflow is pinned).

    Its input is checked as a submit or an enqueue of it would be, so that a schedule is
    refused now rather than fail at each of its slots."""
    check_schedule(spec)
    input_text = encode(spec.input, what="the schedule input")
    if isinstance(target, WorkflowDef):  # its options were checked with the spec
        compile_definition(target, spec.input)
        return ScheduleRow(
            id=spec.id or target.name,
            kind=target.name,
            cron=spec.cron,
            location=spec.location,
            enabled=spec.enabled,
            input=input_text,
            def_version=target.def_version,
            queue=spec.queue or DEFAULT_SCHEDULE.queue,
            priority=spec.priority if spec.priority is not None else DEFAULT_SCHEDULE.priority,
            max_attempts=spec.max_attempts or DEFAULT_SCHEDULE.max_attempts,
            timeout=spec.timeout,
            retention=spec.retention,
        )
    options = step_options(
        target,
        queue=spec.queue,
        priority=spec.priority,
        max_attempts=spec.max_attempts,
        timeout=spec.timeout,
        retention=spec.retention,
    )
    check_standalone_handler(target)
    check_standalone_inputs(target, (spec.input,))
    standalone_flow(target, spec.input)
    return ScheduleRow(
        id=spec.id or target.name,
        kind=target.name,
        cron=spec.cron,
        location=spec.location,
        enabled=spec.enabled,
        input=input_text,
        def_version=None,
        queue=options.queue,
        priority=options.priority,
        max_attempts=options.max_attempts,
        timeout=options.timeout,
        retention=options.retention,
    )


#: What a workflow schedule stores for the options it does not set.
DEFAULT_SCHEDULE = ScheduleRow(
    id="", kind="", cron="", location=None, enabled=True, input="null", def_version=None
)


def registry_schedules(registry: Registry) -> list[ScheduleRow]:
    """The rows of every ``@schedule`` of the registry's workflows and handlers."""
    targets: list[StepDef[Any, Any] | WorkflowDef] = [
        *registry.workflows.values(),
        *registry.kinds.values(),
    ]
    rows = [schedule_row(target, spec) for target in targets for spec in target.schedules]
    seen: dict[str, str] = {}
    for row in rows:
        if row.id in seen:
            raise ScheduleError(
                f"two schedules have the id {row.id!r} (of {seen[row.id]!r} and {row.kind!r}): "
                "the second would replace the first; give each its own id= (a schedule "
                "without one takes its target's name)"
            )
        seen[row.id] = row.kind
    return rows


def _seconds(value: float | None) -> timedelta | None:
    return timedelta(seconds=value) if value else None


def with_schedule_options(compiled: CompiledRun, row: Mapping[str, Any]) -> CompiledRun:
    """A fired workflow run whose steps take the options its schedule set."""
    changes: dict[str, Any] = {}
    if row["queue"] != DEFAULT_SCHEDULE.queue:
        changes["queue"] = row["queue"]
    if row["priority"] != DEFAULT_SCHEDULE.priority:
        changes["priority"] = row["priority"]
    if row["max_attempts"] != DEFAULT_SCHEDULE.max_attempts:
        changes["max_attempts"] = row["max_attempts"]
    if row["timeout_s"]:
        changes["timeout"] = _seconds(row["timeout_s"])
    if row["retention_s"]:
        changes["retention"] = _seconds(row["retention_s"])
    if not changes:
        return compiled
    return attrs.evolve(compiled, steps=tuple(attrs.evolve(s, **changes) for s in compiled.steps))


def compiler_for(registry: Registry) -> ScheduleCompiler:
    """How a scanner of this process turns a due schedule into a run; it also says what
    it can fire (a :class:`~cyclone_dsl.engine.schedules.TargetedCompiler`)."""
    return _RegistryCompiler(registry)


class _RegistryCompiler:
    """The due schedules' compiler of a process with ``registry`` (see ``compiler_for``)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        #: The schedules this process refused for their input lately (kept by the engine).
        self.refused_lately: dict[str, float] = {}

    def __call__(self, kind: str, run_input: JSONValue, row: Mapping[str, Any]) -> CompiledRun:
        registry = self.registry
        if kind in registry.workflows:
            definition = registry.workflows[kind]
            pinned = row["def_version"]
            if pinned is not None and pinned != definition.def_version:
                raise UnknownDefinition(
                    f"the schedule pins definition {pinned}, this process has "
                    f"{definition.def_version}; a process with the pinned definition will "
                    "fire it, or re-register the schedule to pin the new one"
                )
            return with_schedule_options(compile_workflow(registry, definition, run_input), row)
        if row["def_version"] is not None:  # only a workflow's schedule pins a definition
            raise UnknownWorkflow(
                f"this worker was not given workflow {kind!r}: a worker given the workflow "
                "or its module fires its schedule"
            )
        return compile_standalone(
            registry,
            kind,
            run_input,
            queue=row["queue"],
            priority=row["priority"],
            max_attempts=row["max_attempts"],
            timeout=_seconds(row["timeout_s"]),
            retention=_seconds(row["retention_s"]),
        )

    def targets(self) -> tuple[list[str], dict[str, str]]:
        """The kinds this process has (workflows, steps, actions), and each workflow's
        def_version (one whose definition fails is left out: its schedule's fire says why)."""
        versions: dict[str, str] = {}
        for name, definition in self.registry.workflows.items():
            try:
                versions[name] = definition.def_version
            except CycloneError:
                continue
        return [*self.registry.workflows, *self.registry.kinds], versions


def child_compiler(
    registry: Registry, also: Registry | None = None
) -> Callable[[str, JSONValue, tuple[str, str]], CompiledRun]:
    """Compiles child runs from ``registry``, else from ``also``, for parent runs of a
    version this process has. An unknown workflow, or a parent run of a version this
    process has not (another deploy's, whose child definitions may differ), raises
    :class:`UnknownWorkflow`: the engine leaves the child for a worker that serves the
    parent's version."""

    def definition_of(workflow: str) -> WorkflowDef:
        if also is not None and workflow not in registry.workflows:
            return also.workflow(workflow)
        return registry.workflow(workflow)

    def compile_child(workflow: str, run_input: JSONValue, parent: tuple[str, str]) -> CompiledRun:
        parent_workflow, parent_version = parent
        if definition_of(parent_workflow).def_version != parent_version:
            raise UnknownWorkflow(
                f"this process has workflow {parent_workflow!r} at another version than "
                f"{parent_version}, the parent run's"
            )
        return compile_definition(definition_of(workflow), run_input)

    return compile_child
