"""The compiled form of a run: plain rows the engine inserts in one round trip per table.

This module is the contract between the graph layer (which produces
:class:`CompiledRun`) and the engine (which inserts it). It holds data only.

Conventions the engine relies on:

* ``StepRow.kind`` is the registered handler name for a handler node (a step,
  an action, a fan-out node and its item tasks), :data:`KIND_SIGNAL` for
  ``wait_signal`` / ``wait_n`` / ``wait_any``, :data:`KIND_TIMER` for
  ``wait_timer`` and :data:`KIND_CHILD` for ``child``.
* ``StepRow.state`` is ``available`` for a handler node that has no
  dependencies and is not a fan-out node; every other node starts
  ``pending``. The engine activates the remaining roots (waits, timers,
  children, fan-outs with no dependencies) in the submit transaction.
* Input binding, exactly one of:
  - nothing: ``input`` is ``None``, ``input_from`` is ``None`` and there are
    no :class:`InputRow` for the node (the handler takes no argument);
  - static: ``input`` holds the JSON text of the value (a literal or the run
    input, known at compile time);
  - single upstream: ``input_from`` names the upstream node;
  - tuple (2..4 arguments): one :class:`InputRow` per upstream argument with
    ``assembly_mode='tuple'`` and ``slot`` = the argument position (0..3 ->
    keys ``a``..``d``); static arguments of the same call are stored in
    ``input`` as a JSON object under their letters. At claim time the engine
    assembles ``{**input, a: out_a, ...}``;
  - array (a list argument): one :class:`InputRow` per list element with
    ``assembly_mode='array'`` and ``slot`` = the element position; every
    element must be an upstream reference.
* A :class:`RunTemplate` is the same rows before the run input is known (for
  bulk submits, where every run shares one graph): a step whose static input is
  the run input has ``input_is_run_input``; a tuple step whose static arguments
  include the run input lists their letters in ``run_input_keys``, and its
  ``input`` holds only the other static arguments.
* ``DepRow.dep_type`` is ``data`` for an edge that carries input and
  ``control`` for an ``after=`` edge. Every edge, data or control, has a
  ``DepRow``: a node is ready when all of its ``DepRow`` upstreams completed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import attrs

from cyclone_dsl.payload import JSONValue

KIND_SIGNAL = "@signal"
KIND_TIMER = "@timer"
KIND_CHILD = "@child"
SPECIAL_KINDS = frozenset({KIND_SIGNAL, KIND_TIMER, KIND_CHILD})

TUPLE_KEYS = ("a", "b", "c", "d")


@attrs.frozen
class StepRow:
    node: str
    kind: str
    state: str
    input: str | None = None  # JSON text
    input_from: str | None = None
    queue: str = "default"
    priority: int = 0
    max_attempts: int = 5
    timeout: timedelta | None = None
    signal_name: str | None = None
    signal_names: tuple[str, ...] | None = None
    wait_for: timedelta | None = None
    wait_count: int | None = None
    on_dep_failure: str | None = None  # None means fail_run
    fan_out_parallel: int | None = None
    fan_out_max_bytes: int | None = None
    fan_out_max_items: int | None = None  # stored on the extension track, not in cyclone_steps
    child_workflow: str | None = None
    child_needs_result: bool | None = None
    retention: timedelta | None = None
    input_is_run_input: bool = False  # templates only
    run_input_keys: tuple[str, ...] = ()  # templates only


@attrs.frozen
class DepRow:
    node: str
    dep_node: str
    dep_type: str  # "data" or "control"


@attrs.frozen
class InputRow:
    node: str
    slot: int
    dep_node: str
    assembly_mode: str  # "tuple" or "array"


@attrs.frozen
class GuardRow:
    """A node the engine judges when it activates it (stored per definition on the
    extension track): one with a condition, or one downstream of a conditional node,
    which is skipped when every one of its dependencies was (``on_skip`` ``skip``).

    ``condition`` is a SQL/JSON path predicate over ``{"nodes": {id: output, ...},
    "input": run input}`` holding the outputs of ``sources``; ``variables`` (JSON text)
    are the values it compares with.
    """

    node: str
    condition: str | None
    variables: str
    sources: tuple[str, ...]
    on_skip: str


@attrs.frozen
class CompiledRun:
    workflow: str
    def_version: str
    input: str | None  # JSON text of the run input
    result_node: str | None
    has_fan_out: bool
    steps: tuple[StepRow, ...]
    deps: tuple[DepRow, ...]
    inputs: tuple[InputRow, ...]
    flow: RunFlow | None = None  # the limits that apply to this run's steps, if any
    guards: tuple[GuardRow, ...] = ()  # the nodes judged at activation (conditional graphs)


#: (kind, input, schedule row) -> the rows of the run. Raises UnknownDefinition when this
#: process has not the kind, or not the definition the schedule pins (its ``def_version``).
ScheduleCompiler = Callable[[str, JSONValue, Mapping[str, Any]], CompiledRun]


@attrs.frozen
class GateRow:
    """The limits that apply to one node of a run (stored on the extension track).

    A scope names what a limit counts: ``step:<kind>``, ``run:<workflow>``,
    ``rate:<name>``; the key says which share of it (the empty string: all).
    ``fair_key`` is the key claims take in turn.
    """

    node: str
    fair_key: str
    step_scope: str | None = None
    step_key: str | None = None
    run_scope: str | None = None
    run_key: str | None = None
    rate_scope: str | None = None
    rate_key: str | None = None
    rate_units: int = 1


@attrs.frozen
class LimitRow:
    """A limit: at most ``max_count`` at once per key (``per`` None), or ``max_count``
    starts per ``per`` per key (a rate)."""

    scope: str
    max_count: int
    per: timedelta | None = None


@attrs.frozen
class RunFlow:
    """The flow control of one run: the gates of its nodes and the limits they use."""

    gates: tuple[GateRow, ...]
    limits: tuple[LimitRow, ...]

    def slot_keys(self) -> list[tuple[str, str]]:
        """(scope, key) of every limited share this run uses."""
        limited = {limit.scope for limit in self.limits}
        found: set[tuple[str, str]] = set()
        for gate in self.gates:
            for scope, key in (
                (gate.step_scope, gate.step_key),
                (gate.run_scope, gate.run_key),
                (gate.rate_scope, gate.rate_key),
            ):
                if scope is not None and key is not None and scope in limited:
                    found.add((scope, key))
        return sorted(found)


@attrs.frozen
class RunTemplate:
    """The rows of every run of one graph, the run input left out (see the module doc)."""

    workflow: str
    def_version: str
    result_node: str | None
    has_fan_out: bool
    steps: tuple[StepRow, ...]
    deps: tuple[DepRow, ...]
    inputs: tuple[InputRow, ...]
    guards: tuple[GuardRow, ...] = ()


@attrs.frozen
class ScheduleRow:
    """A ``cyclone_schedules`` row as registration writes it (the engine computes the slot).

    For a workflow schedule, ``queue``, ``priority``, ``max_attempts``, ``timeout``
    and ``retention`` hold what the schedule set (the column defaults otherwise):
    set ones replace the options of every step of each run it fires.
    """

    id: str
    kind: str
    cron: str
    location: str | None
    enabled: bool
    input: str  # JSON text
    def_version: str | None  # pinned workflow definition; None for a step or action
    queue: str = "default"
    priority: int = 0
    max_attempts: int = 5
    timeout: timedelta | None = None
    retention: timedelta | None = None
