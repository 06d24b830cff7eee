"""``@workflow``: a builder function that, run once, describes the graph of every run."""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Callable
from typing import Any, TypeAlias, overload

import attrs

from cyclone_dsl.dsl.builder import NodeRef, Ref, RunInputRef, building
from cyclone_dsl.dsl.flow import Concurrency
from cyclone_dsl.dsl.schedule import ScheduleSpec, pending_schedules
from cyclone_dsl.errors import InvalidArgument, InvalidGraph
from cyclone_dsl.graph.compile import compile_template
from cyclone_dsl.graph.fingerprint import fingerprint
from cyclone_dsl.graph.model import Graph
from cyclone_dsl.graph.rows import RunTemplate
from cyclone_dsl.graph.validate import problems_of
from cyclone_dsl.payload import MAX_WORKFLOW_NAME_BYTES, text_problem

_building_now: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "cyclone_building_workflows", default=()
)

#: How deep child workflows may nest (a workflow's graph is built with its children's, a
#: few Python frames a level: far deeper, the build hit Python's recursion limit).
MAX_CHILD_DEPTH = 64


#: A builder takes the run input (as a reference) or nothing, and returns its result node or None.
BuilderFunction: TypeAlias = (
    Callable[[], NodeRef[Any] | None] | Callable[[Ref[Any]], NodeRef[Any] | None]
)


@attrs.define(eq=False, repr=False)
class WorkflowDef:
    """A workflow. ``.graph`` is built (and validated) once, on first use."""

    fn: Callable[..., Any]
    name: str
    schedules: list[ScheduleSpec] = attrs.field(factory=list)
    concurrency: Concurrency | None = None
    _graph: Graph | None = None
    _invalid: InvalidGraph | None = None
    _def_version: str | None = None
    _template: RunTemplate | None = None
    _steps: dict[str, Any] = attrs.field(factory=dict)
    _children: dict[str, WorkflowDef] = attrs.field(factory=dict)

    def __repr__(self) -> str:
        return f"<workflow {self.name}>"

    @property
    def graph(self) -> Graph:
        if self._invalid is not None:
            raise self._invalid.with_traceback(None)
        if self._graph is None:
            on_its_own = not _building_now.get()
            try:
                self._graph = self._build()
            except InvalidGraph as invalid:
                # Kept, as a graph is: a worker's start looks at every workflow of the
                # process and would build a broken one again each time (a chain of child
                # workflows nested too deep, each level walking every level below it).
                # Only a build of its own: as a child, the error may be the parent's
                # (nested too deep from there).
                if on_its_own:
                    self._invalid = invalid
                raise
        return self._graph

    @property
    def def_version(self) -> str:
        if self._def_version is None:
            self._def_version = fingerprint(self.graph)
        return self._def_version

    @property
    def template(self) -> RunTemplate:
        """The rows every run of this workflow shares (compiled once)."""
        if self._template is None:
            self._template = compile_template(self.graph, def_version=self.def_version)
        return self._template

    @property
    def has_result(self) -> bool:
        return self.graph.result is not None

    def step_defs(self) -> dict[str, Any]:
        """The step and action definitions this workflow's nodes run (by kind)."""
        _ = self.graph
        return dict(self._steps)

    def child_defs(self) -> dict[str, WorkflowDef]:
        _ = self.graph
        return dict(self._children)

    def _build(self) -> Graph:
        chain = _building_now.get()
        if self.name in chain:
            cycle = " -> ".join((*chain[chain.index(self.name) :], self.name))
            raise InvalidGraph(
                self.name, [(None, f"child() recurses into its own workflow: {cycle}")]
            )
        if len(chain) >= MAX_CHILD_DEPTH:
            path = " -> ".join((*chain[:2], "...", *chain[-2:], self.name))
            raise InvalidGraph(
                chain[0],
                [(None, f"child workflows nested deeper than {MAX_CHILD_DEPTH} levels: {path}")],
            )
        token = _building_now.set((*chain, self.name))
        try:
            with building(self.name) as builder:
                params = [
                    p
                    for p in inspect.signature(self.fn).parameters.values()
                    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                ]
                returned = self.fn(RunInputRef(builder)) if params else self.fn()
                graph = builder.finish(returned)
                self._steps = dict(builder.steps)
                self._children = dict(builder.children)
        finally:
            _building_now.reset(token)
        problems = [*builder.problems, *problems_of(graph)]
        if problems:
            raise InvalidGraph(self.name, problems)
        return graph


def _define(
    fn: Callable[..., Any], name: str | None, concurrency: Concurrency | None = None
) -> WorkflowDef:
    if not callable(fn):
        raise InvalidArgument(f"@workflow decorates a function, not {fn!r}")
    params = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    if len(params) > 1:
        raise InvalidArgument(
            f"a workflow builder takes one parameter (the run input) or none; "
            f"{fn.__name__} takes {len(params)}"
        )
    workflow_name = name or fn.__name__
    wrong = text_problem("a workflow name", workflow_name, MAX_WORKFLOW_NAME_BYTES)
    if wrong is not None:
        raise InvalidArgument(wrong)
    given: object = concurrency
    if given is not None and not isinstance(given, Concurrency):
        raise InvalidArgument(
            f"@workflow {workflow_name!r}: concurrency must be a Concurrency, not {concurrency!r}"
        )
    definition = WorkflowDef(
        fn, workflow_name, schedules=pending_schedules(fn), concurrency=concurrency
    )
    from cyclone_dsl.dsl.registry import default_registry

    default_registry().register(definition)
    return definition


@overload
def workflow(fn: BuilderFunction, /) -> WorkflowDef: ...
@overload
def workflow(
    *, name: str | None = None, concurrency: Concurrency | None = None
) -> Callable[[BuilderFunction], WorkflowDef]: ...
def workflow(
    fn: BuilderFunction | None = None,
    /,
    *,
    name: str | None = None,
    concurrency: Concurrency | None = None,
) -> WorkflowDef | Callable[[BuilderFunction], WorkflowDef]:
    """Declare a workflow; its function runs once, in a builder, to describe the graph.

    ``concurrency`` caps how many runs of each key are under way at once; a run
    beyond it waits, its steps unclaimed, until one of its key ends (see
    :class:`Concurrency`).
    """
    if fn is not None:
        return _define(fn, name, concurrency)
    return lambda inner: _define(inner, name, concurrency)
