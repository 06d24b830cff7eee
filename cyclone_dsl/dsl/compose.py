"""Composition nodes: ``for_each``, ``child`` and ``define_result``."""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar, overload

from typing_extensions import Unpack

from cyclone_dsl.dsl.builder import NodeRef, Ref, require_builder
from cyclone_dsl.dsl.signatures import After, FanOutOptions, Fn1, Fn1Ctx, HasHandler, OnSkip
from cyclone_dsl.dsl.step import StepDef
from cyclone_dsl.dsl.workflow import WorkflowDef
from cyclone_dsl.errors import InvalidGraph
from cyclone_dsl.graph.conditions import Condition
from cyclone_dsl.graph.model import ChildSpec, FanOutSpec
from cyclone_dsl.graph.rows import KIND_CHILD

E = TypeVar("E")
O = TypeVar("O")  # noqa: E741 - the output of an item handler


@overload
def for_each(
    handler: WorkflowDef,
    *,
    over: Sequence[Any] | Ref[Sequence[Any]],
    max_parallel: int = 0,
    max_bytes: int = 0,
    max_items: int | None = None,
    after: After = None,
    node_id: str = ...,
    when: Condition | None = None,
    otherwise: NodeRef[object] | None = None,
    on_skip: OnSkip = ...,
) -> NodeRef[list[Any]]: ...
@overload
def for_each(
    handler: HasHandler[Fn1[E, Coroutine[Any, Any, O]]],
    *,
    over: Sequence[E] | Ref[Sequence[E]],
    max_parallel: int = 0,
    max_bytes: int = 0,
    max_items: int | None = None,
    after: After = None,
    **options: Unpack[FanOutOptions],
) -> NodeRef[list[O]]: ...
@overload
def for_each(
    handler: HasHandler[Fn1Ctx[E, Coroutine[Any, Any, O]]],
    *,
    over: Sequence[E] | Ref[Sequence[E]],
    max_parallel: int = 0,
    max_bytes: int = 0,
    max_items: int | None = None,
    after: After = None,
    **options: Unpack[FanOutOptions],
) -> NodeRef[list[O]]: ...
@overload
def for_each(
    handler: HasHandler[Fn1[E, O]],
    *,
    over: Sequence[E] | Ref[Sequence[E]],
    max_parallel: int = 0,
    max_bytes: int = 0,
    max_items: int | None = None,
    after: After = None,
    **options: Unpack[FanOutOptions],
) -> NodeRef[list[O]]: ...
@overload
def for_each(
    handler: HasHandler[Fn1Ctx[E, O]],
    *,
    over: Sequence[E] | Ref[Sequence[E]],
    max_parallel: int = 0,
    max_bytes: int = 0,
    max_items: int | None = None,
    after: After = None,
    **options: Unpack[FanOutOptions],
) -> NodeRef[list[O]]: ...
def for_each(
    handler: object,
    *,
    over: object,
    max_parallel: int = 0,
    max_bytes: int = 0,
    max_items: int | None = None,
    after: object = None,
    **options: Any,
) -> Any:
    """Run ``handler`` once per element of the list ``over`` produces.

    The items run as ordinary steps ``<node>[<i>]``, at most ``max_parallel``
    at a time (0: no limit). For a step, the node's output is the list of the
    items' outputs in input order (failing with ``output_limit`` past
    ``max_bytes``, 0: no limit); an action keeps no output. For a workflow,
    each item is a child run (its parent node ``<node>[<i>]``), and the node's
    output is the children's results in item order (none if it defines none).
    """
    builder = require_builder("for_each")
    if not isinstance(over, Ref | list | tuple):  # a literal string or dict: each run fails
        builder.problems.append(
            (None, f"for_each over= takes a list or a reference to one, not {over!r}")
        )
    if isinstance(handler, WorkflowDef):
        return _for_each_child(
            handler, over, max_parallel, max_bytes, max_items, after=after, options=options
        )
    if not isinstance(handler, StepDef):
        builder.problems.append(
            (None, f"for_each needs a @step, @action or @workflow, not {handler!r}")
        )
        return None
    ref = handler.with_options(**{**options, "after": after})(over)
    assert isinstance(ref, NodeRef)
    ref.node.fan_out = FanOutSpec(
        max_parallel=max_parallel,
        max_bytes=max_bytes if handler.keep_output else None,
        max_items=max_items,
    )
    if ref.node.binding.value not in ("single", "static"):
        builder.problems.append((None, f"for_each over= takes one reference, not {over!r}"))
    return ref


def _for_each_child(
    workflow: WorkflowDef,
    over: object,
    max_parallel: int,
    max_bytes: int,
    max_items: int | None,
    *,
    after: Any,
    options: dict[str, Any],
) -> NodeRef[Any]:
    """for_each over a workflow: one child run per item, started at most ``max_parallel``
    at a time; the node's output is the children's results in item order."""
    builder = require_builder("for_each")
    node_id = options.pop("node_id", None)
    branching = {k: options.pop(k, None) for k in ("when", "otherwise", "on_skip")}
    ref = child(workflow, over, after=after, **branching)
    if options:
        ref.node.problems.append(
            f"for_each over workflow {workflow.name!r} takes no step options "
            f"({', '.join(sorted(options))}): set them on the child workflow's steps"
        )
    needs_result = ref.node.child is not None and ref.node.child.needs_result
    ref.node.fan_out = FanOutSpec(
        max_parallel=max_parallel,
        max_bytes=max_bytes if needs_result else None,
        max_items=max_items,
    )
    if ref.node.binding.value not in ("single", "static"):
        builder.problems.append((None, f"for_each over= takes one reference, not {over!r}"))
    if node_id is not None:
        ref.named(node_id)
    return ref


def child(
    workflow: WorkflowDef,
    input: object = None,
    *,
    after: After = None,
    when: Condition | None = None,
    otherwise: NodeRef[object] | None = None,
    on_skip: OnSkip | None = None,
) -> NodeRef[Any]:
    """Start a run of ``workflow`` with ``input``; the node completes when that run does.

    If ``workflow`` defines a result, the node's output is that result.
    """
    builder = require_builder("child")
    given: object = workflow  # untyped callers may pass anything
    if not isinstance(given, WorkflowDef):
        builder.problems.append((None, f"child() needs a @workflow, not {given!r}"))
        return None  # type: ignore[return-value]  # the problem fails the build
    try:
        needs_result = workflow.has_result
    except InvalidGraph as exc:
        builder.problems.append((None, f"child workflow {workflow.name!r}: {exc.problems[0]}"))
        needs_result = False
    builder.children[workflow.name] = workflow
    args = () if input is None else (input,)
    return builder.add(
        workflow.name,
        KIND_CHILD,
        args,
        after=after,
        child=ChildSpec(workflow.name, needs_result),
        when=when,
        otherwise=otherwise,
        on_skip=on_skip,
    )


def define_result(ref: NodeRef[object]) -> None:
    """Mark ``ref``'s output as the run's result (the same as returning it from the builder)."""
    builder = require_builder("define_result")
    given: object = ref  # untyped callers may pass anything
    if not isinstance(given, NodeRef) or given.builder is not builder:
        builder.problems.append((None, f"define_result() needs a node of this workflow: {ref!r}"))
        return
    if builder.result is not None and builder.result is not given:
        builder.problems.append(
            (None, f"define_result() names {given!r} after {builder.result!r}: name one node")
        )
        return
    builder.result = given
