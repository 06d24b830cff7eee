"""The flow control of one run, from its definitions and its input (no I/O).

Each handler node of a run gets a :class:`~cyclone_dsl.graph.rows.GateRow` when a
limit applies to it: its kind's :class:`Concurrency` or :class:`RateLimit`, or its
workflow's :class:`Concurrency`. Keys are evaluated here, at submit, on the run
input; a key that cannot be evaluated refuses the submit with
:class:`~cyclone_dsl.errors.InvalidArgument`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cyclone_dsl.dsl.flow import Concurrency, RateLimit, checked_key, key_of
from cyclone_dsl.errors import InvalidArgument
from cyclone_dsl.graph.rows import SPECIAL_KINDS, GateRow, LimitRow, RunFlow, StepRow

#: A run's limit: its scope and key (None: the workflow declares no limit), and the share
#: its steps are made fair by (the workflow's scope and key: also without a limit).
RunGate = tuple[str | None, str | None, tuple[str, str] | None]


def step_scope(kind: str) -> str:
    return f"step:{kind}"


def run_scope(workflow: str) -> str:
    return f"run:{workflow}"


def rate_scope(name: str) -> str:
    return f"rate:{name}"


def queue_scope(queue: str) -> str:
    return f"queue:{queue}"


def fair_key(*shares: tuple[str, str | None] | None) -> str | None:
    """The key gated claims take in turn: every (scope, key) a step is limited or made
    fair by, together (None: none). Claims pick each fair key's first steps, so steps of
    one fair key must wait for the same slots: with the bare key value, a step of a kind
    whose slot for tenant t is free waited behind another kind's step of t at its limit."""
    parts = [f"{scope}\x1f{key}" for scope, key in filter(None, shares) if key is not None]
    return "\x1e".join(parts) if parts else None


def workflow_flow(
    workflow: str,
    concurrency: Concurrency | None,
    handlers: Mapping[str, Any],
    steps: tuple[StepRow, ...],
    run_input: object,
) -> RunFlow | None:
    """The gates of a workflow run; ``handlers`` maps kinds to their step definitions."""
    run_gate: RunGate = (None, None, None)
    limits: dict[str, LimitRow] = {}
    if concurrency is not None:
        key = key_of(f"workflow {workflow!r} concurrency", concurrency.key, run_input)
        scope = run_scope(workflow) if concurrency.limit is not None else None
        if concurrency.limit is not None:
            limits[run_scope(workflow)] = LimitRow(run_scope(workflow), concurrency.limit)
        run_gate = (scope, key if scope else None, (run_scope(workflow), key))
    gates: list[GateRow] = []
    keys: dict[str, tuple[GateRow | None, dict[str, LimitRow]]] = {}
    for row in steps:
        if row.kind in SPECIAL_KINDS:
            continue
        if row.kind not in keys:
            definition = handlers.get(row.kind)
            keys[row.kind] = _kind_gate(row.kind, definition, run_input, run_gate)
        template, kind_limits = keys[row.kind]
        limits.update(kind_limits)
        if template is not None:
            gates.append(GateRow(row.node, **_fields(template)))
    if not gates:
        return None
    return RunFlow(tuple(gates), tuple(limits[s] for s in sorted(limits)))


def standalone_flow(
    definition: Any, run_input: object, *, concurrency_key: str | None = None
) -> RunFlow | None:
    """The gate of standalone work (one node, named as its kind); ``concurrency_key``
    replaces the key its kind's :class:`Concurrency` would give."""
    concurrency: Concurrency | None = definition.concurrency
    if concurrency_key is not None:
        if concurrency is None:
            raise InvalidArgument(
                f"concurrency_key given, but {definition.name!r} declares no Concurrency: "
                "declare @step(concurrency=Concurrency(...)) to limit it"
            )
        if not isinstance(concurrency_key, str):
            raise InvalidArgument(f"concurrency_key must be a string, not {concurrency_key!r}")
        concurrency_key = checked_key("concurrency_key", concurrency_key, "it is")
    gate, limits = _kind_gate(
        definition.name, definition, run_input, (None, None, None), concurrency_key
    )
    if gate is None:
        return None
    return RunFlow((GateRow(definition.name, **_fields(gate)),), tuple(limits.values()))


def _kind_gate(
    kind: str,
    definition: Any,
    run_input: object,
    run_gate: RunGate,
    concurrency_key: str | None = None,
) -> tuple[GateRow | None, dict[str, LimitRow]]:
    """The gate every node of ``kind`` gets in this run (None: no limit), and its limits."""
    run_scope_, run_key, run_fair = run_gate
    concurrency: Concurrency | None = getattr(definition, "concurrency", None)
    rate: RateLimit | None = getattr(definition, "rate_limit", None)
    limits: dict[str, LimitRow] = {}
    step_scope_ = step_key = step_fair = None
    if concurrency is not None:
        step_fair = concurrency_key or key_of(f"{kind!r} concurrency", concurrency.key, run_input)
        if concurrency.limit is not None:
            step_scope_, step_key = step_scope(kind), step_fair
            limits[step_scope_] = LimitRow(step_scope_, concurrency.limit)
    rate_scope_ = rate_key = None
    units = 1
    if rate is not None:
        rate_scope_ = rate_scope(rate.name or kind)
        rate_key = key_of(f"{kind!r} rate limit", rate.key, run_input)
        units = rate.units
        limits[rate_scope_] = LimitRow(rate_scope_, rate.limit, rate.per)
    fair = fair_key(
        (step_scope(kind), step_fair),
        run_fair,
        (rate_scope_, rate_key) if rate_scope_ is not None else None,
    )
    if fair is None:
        return None, limits
    gate = GateRow(
        node="",
        fair_key=fair,
        step_scope=step_scope_,
        step_key=step_key,
        run_scope=run_scope_,
        run_key=run_key,
        rate_scope=rate_scope_,
        rate_key=rate_key,
        rate_units=units,
    )
    return gate, limits


def _fields(gate: GateRow) -> dict[str, Any]:
    return {
        "fair_key": gate.fair_key,
        "step_scope": gate.step_scope,
        "step_key": gate.step_key,
        "run_scope": gate.run_scope,
        "run_key": gate.run_key,
        "rate_scope": gate.rate_scope,
        "rate_key": gate.rate_key,
        "rate_units": gate.rate_units,
    }
