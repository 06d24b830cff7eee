"""Client logic without I/O: resolving definitions, compiling, validating arguments."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from cyclone_dsl.dsl.registry import Registry
from cyclone_dsl.dsl.step import (
    StepDef,
    call_problem,
    count_fits,
    handler_signature,
    make_options,
    takes_positional,
)
from cyclone_dsl.dsl.workflow import WorkflowDef
from cyclone_dsl.errors import InvalidArgument, UnknownWorkflow
from cyclone_dsl.graph.compile import instantiate
from cyclone_dsl.graph.model import NodeOptions
from cyclone_dsl.graph.rows import CompiledRun, RunTemplate, StepRow
from cyclone_dsl.graph.validate import check_options
from cyclone_dsl.payload import JSONValue
from cyclone_dsl.states import RunState, StepState

MAX_KEY_BYTES = 1024

#: The run states purge deletes unless told otherwise: every terminal one.
ENDED_STATES: tuple[RunState, ...] = (RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED)


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
    raise UnknownWorkflow(f"{step!r} is not a @step or @action (or a registered kind name)")


def resolve_schedulable(registry: Registry, target: object) -> StepDef[Any, Any] | WorkflowDef:
    """A workflow or handler, given as the object or by name."""
    if isinstance(target, StepDef | WorkflowDef):
        return target
    if isinstance(target, str):
        if target in registry.workflows:
            return registry.workflows[target]
        return registry.kind(target)
    raise UnknownWorkflow(f"{target!r} is not a @workflow, @step or @action")


def workflow_template(registry: Registry, workflow: object) -> RunTemplate:
    """The rows every run of ``workflow`` shares (for bulk submits)."""
    return resolve_workflow(registry, workflow).template


def compile_workflow(registry: Registry, workflow: object, run_input: JSONValue) -> CompiledRun:
    return instantiate(workflow_template(registry, workflow), run_input)


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
    check_standalone_inputs(resolve_step(registry, step), (run_input,))
    return instantiate(template, run_input, what="the input")


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


def check_deadline(deadline: timedelta | None) -> timedelta | None:
    if deadline is None:
        return None
    if not isinstance(deadline, timedelta) or deadline <= timedelta(0):
        raise InvalidArgument(f"deadline must be a positive timedelta, not {deadline!r}")
    return deadline


def check_key(what: str, key: object) -> None:
    if not isinstance(key, str) or not key:
        raise InvalidArgument(f"{what} must be a non-empty string")
    if "\x00" in key:
        raise InvalidArgument(f"{what} must not contain NUL characters")
    if len(key.encode("utf-8")) > MAX_KEY_BYTES:
        raise InvalidArgument(f"{what} is longer than {MAX_KEY_BYTES} bytes")
