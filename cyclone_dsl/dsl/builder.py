"""The builder session a ``@workflow`` function runs in: it records nodes instead of running.

A contextvar holds the active :class:`Builder`; step calls, waits, ``for_each``
and ``child`` add a :class:`PendingNode` to it and return a :class:`NodeRef`.
Node ids are settled when the session ends: explicit ``.named()`` ids first,
then default ids (the handler's name) made unique with ``_2``, ``_3``...
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import attrs

from cyclone_dsl import payload
from cyclone_dsl.errors import InvalidPayload
from cyclone_dsl.graph.model import (
    Arg,
    ArgKind,
    Binding,
    ChildSpec,
    FanOutSpec,
    Graph,
    Node,
    NodeOptions,
    WaitSpec,
)

if TYPE_CHECKING:
    from cyclone_dsl.dsl.step import StepDef
    from cyclone_dsl.dsl.workflow import WorkflowDef

_active: contextvars.ContextVar[Builder | None] = contextvars.ContextVar(
    "cyclone_builder", default=None
)

OPTION_NAMES = frozenset(
    {"queue", "priority", "max_attempts", "timeout", "retention", "on_dep_failure"}
)


def active_builder() -> Builder | None:
    return _active.get()


def duration(value: object, what: str) -> timedelta | object:
    """A timedelta from a timedelta or a number of seconds; anything else is kept for validation."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return timedelta(seconds=value)
    return value


@attrs.define(eq=False)
class PendingNode:
    default_id: str
    kind: str
    binding: Binding
    args: list[Arg | NodeRef]
    control: list[NodeRef]
    options: dict[str, Any]
    wait: WaitSpec | None = None
    fan_out: FanOutSpec | None = None
    child: ChildSpec | None = None
    keep_output: bool = True
    explicit_id: str | None = None
    final_id: str = ""


@attrs.define(eq=False, repr=False)
class NodeRef:
    """A symbolic reference to a node's output inside a workflow builder."""

    builder: Builder
    node: PendingNode

    def named(self, node_id: str) -> NodeRef:
        """Give the node an explicit id (unique within the workflow); returns the same ref."""
        self.node.explicit_id = node_id
        return self

    def __repr__(self) -> str:
        return f"<ref {self.node.explicit_id or self.node.default_id} of {self.builder.name}>"

    def __bool__(self) -> bool:
        raise TypeError(
            "a node reference has no value while the workflow is built: branch inside a step"
        )


@attrs.define(eq=False, repr=False)
class RunInputRef:
    """The run input as seen by the builder (it becomes a literal at submit)."""

    builder: Builder

    def __repr__(self) -> str:
        return f"<run input of {self.builder.name}>"


@attrs.define(eq=False)
class Builder:
    name: str
    nodes: list[PendingNode] = attrs.field(factory=list)
    problems: list[tuple[str | None, str]] = attrs.field(factory=list)
    result: NodeRef | None = None
    steps: dict[str, StepDef[Any, Any]] = attrs.field(factory=dict)
    children: dict[str, WorkflowDef] = attrs.field(factory=dict)

    def arg(self, value: object, where: str) -> Arg | NodeRef:
        if isinstance(value, NodeRef):
            if value.builder is not self:
                self.problems.append(
                    (None, f"{where}: {value!r} belongs to workflow {value.builder.name!r}")
                )
            return value
        if isinstance(value, RunInputRef):
            return Arg(ArgKind.INPUT)
        try:
            payload.check(value)
        except InvalidPayload as exc:
            self.problems.append((None, f"{where}: a literal argument is not JSON ({exc})"))
            return Arg(ArgKind.STATIC, value=None)
        return Arg(ArgKind.STATIC, value=value)  # type: ignore[arg-type]

    def add(
        self,
        default_id: str,
        kind: str,
        call_args: Sequence[object],
        *,
        after: object = None,
        options: dict[str, Any] | None = None,
        wait: WaitSpec | None = None,
        fan_out: FanOutSpec | None = None,
        child: ChildSpec | None = None,
        keep_output: bool = True,
    ) -> NodeRef:
        where = f"call of {default_id!r}"
        if len(call_args) == 1 and isinstance(call_args[0], list | tuple):
            binding = Binding.ARRAY
            args = [self.arg(v, where) for v in call_args[0]]
        else:
            args = [self.arg(v, where) for v in call_args]
            if not args:
                binding = Binding.NONE
            elif len(args) == 1:
                binding = Binding.SINGLE if isinstance(args[0], NodeRef) else Binding.STATIC
            else:
                binding = Binding.TUPLE
        control = self._control(after, where)
        node = PendingNode(
            default_id,
            kind,
            binding,
            args,
            control,
            dict(options or {}),
            wait,
            fan_out,
            child,
            keep_output,
        )
        self.nodes.append(node)
        return NodeRef(self, node)

    def _control(self, after: object, where: str) -> list[NodeRef]:
        if after is None:
            return []
        items = list(after) if isinstance(after, list | tuple) else [after]
        refs = []
        for item in items:
            if not isinstance(item, NodeRef):
                self.problems.append((None, f"{where}: after= takes node references, not {item!r}"))
            elif item.builder is not self:
                self.problems.append(
                    (None, f"{where}: {item!r} belongs to workflow {item.builder.name!r}")
                )
            else:
                refs.append(item)
        return refs

    def finish(self, returned: object) -> Graph:
        if isinstance(returned, NodeRef):
            if self.result is not None and self.result is not returned:
                self.problems.append((None, "define_result() and return name different nodes"))
            self.result = returned
        elif returned is not None:
            self.problems.append(
                (None, f"a workflow builder returns a node reference or None, not {returned!r}")
            )
        self._settle_ids()
        nodes = tuple(self._freeze(n) for n in self.nodes)
        result = self.result.node.final_id if self.result is not None else None
        return Graph(self.name, nodes, result)

    def _settle_ids(self) -> None:
        taken = {n.explicit_id for n in self.nodes if n.explicit_id}
        counts: dict[str, int] = {}
        for node in self.nodes:
            if node.explicit_id:
                node.final_id = node.explicit_id
                continue
            base = node.default_id
            number = counts.get(base, 0)
            candidate = base if number == 0 else f"{base}_{number + 1}"
            while candidate in taken:
                number += 1
                candidate = f"{base}_{number + 1}"
            counts[base] = number + 1
            taken.add(candidate)
            node.final_id = candidate

    def _freeze(self, node: PendingNode) -> Node:
        def to_arg(value: Arg | NodeRef) -> Arg:
            if isinstance(value, NodeRef):
                return Arg(ArgKind.REF, ref=value.node.final_id)
            return value

        options = NodeOptions(**node.options)
        return Node(
            id=node.final_id,
            kind=node.kind,
            binding=node.binding,
            args=tuple(to_arg(a) for a in node.args),
            control_deps=tuple(dict.fromkeys(r.node.final_id for r in node.control)),
            options=options,
            wait=node.wait,
            fan_out=node.fan_out,
            child=node.child,
            keep_output=node.keep_output,
        )


@contextmanager
def building(name: str) -> Iterator[Builder]:
    builder = Builder(name)
    token = _active.set(builder)
    try:
        yield builder
    finally:
        _active.reset(token)


def require_builder(what: str) -> Builder:
    builder = _active.get()
    if builder is None:
        raise RuntimeError(f"{what}() can only be called inside a @workflow builder")
    return builder
