"""The graph model: frozen nodes and a graph, pure data, produced by the DSL builder."""

from __future__ import annotations

from datetime import timedelta
from enum import StrEnum

import attrs

from cyclone_dsl.graph.conditions import Condition
from cyclone_dsl.payload import JSONValue


class Binding(StrEnum):
    """How a node's handler input is built."""

    NONE = "none"  # no argument
    STATIC = "static"  # one literal, or the run input
    SINGLE = "single"  # one upstream output (input_from)
    TUPLE = "tuple"  # 2..4 arguments, assembled as {a, b, c, d}
    ARRAY = "array"  # one list of upstream outputs


class ArgKind(StrEnum):
    REF = "ref"
    INPUT = "input"
    STATIC = "static"


@attrs.frozen
class Arg:
    """One argument of a call: an upstream node, the run input, or a literal."""

    kind: ArgKind
    ref: str | None = None
    value: JSONValue = None


@attrs.frozen
class NodeOptions:
    """Per-node execution options (``None`` means: use the default)."""

    queue: str = "default"
    priority: int = 0
    max_attempts: int = 5
    timeout: timedelta | None = None
    retention: timedelta | None = None
    on_dep_failure: str = "fail_run"


@attrs.frozen
class WaitSpec:
    signal_name: str | None = None  # wait_signal / wait_n
    signal_names: tuple[str, ...] | None = None  # wait_any
    count: int | None = None  # wait_n quorum
    duration: timedelta | None = None  # a signal wait's timeout, or a timer's duration
    timer: bool = False


@attrs.frozen
class FanOutSpec:
    max_parallel: int = 0
    max_bytes: int | None = 0  # None for an action fan-out (no output collected)
    max_items: int | None = None


@attrs.frozen
class ChildSpec:
    workflow: str
    needs_result: bool


@attrs.frozen
class Node:
    id: str
    kind: str
    binding: Binding
    args: tuple[Arg, ...]
    control_deps: tuple[str, ...] = ()
    options: NodeOptions = NodeOptions()
    wait: WaitSpec | None = None
    fan_out: FanOutSpec | None = None
    child: ChildSpec | None = None
    keep_output: bool = True
    #: Run only when this holds on the recorded outputs (sources: node ids, None for the
    #: run input); otherwise the node ends skipped.
    when: Condition | None = None
    #: With every dependency skipped: ``skip`` this node too, or ``run`` it (with Nones).
    on_skip: str = "skip"

    @property
    def data_deps(self) -> tuple[str, ...]:
        """Upstream nodes whose outputs feed this node, in argument order, without repeats."""
        return tuple(dict.fromkeys(a.ref for a in self.args if a.kind is ArgKind.REF and a.ref))

    @property
    def deps(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.data_deps, *self.control_deps)))


@attrs.frozen
class Graph:
    workflow: str
    nodes: tuple[Node, ...]
    result: str | None = None

    def node(self, node_id: str) -> Node:
        for node in self.nodes:
            if node.id == node_id:
                return node
        raise KeyError(node_id)

    @property
    def has_fan_out(self) -> bool:
        return any(n.fan_out is not None for n in self.nodes)
