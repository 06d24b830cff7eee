"""Property: random conditional DAGs with random outputs end exactly as a reference
evaluator says: every node completed with its output, or skipped.

Each node's handler returns the value the run input gives for it; conditions compare
those values (or test their truthiness), combined with ``&``, ``|``, ``~``, through
``when=``, ``otherwise=`` and ``on_skip=``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from cyclone_dsl import Client, StepContext, Worker, step, workflow
from cyclone_dsl.states import RunState, StepState

names = itertools.count()


@step(name="cp_value")
def value(table: dict[str, int], *, ctx: StepContext) -> int:
    return table[ctx.node]


@attrs.frozen
class Cond:
    """A condition on the value of node ``source`` (an index): op is gt, le, eq, isin,
    truthy; or a combination."""

    op: str
    source: int = 0
    arg: Any = None
    parts: tuple[Cond, ...] = ()


@attrs.frozen
class NodeSpec:
    deps: tuple[int, ...]
    when: Cond | None
    otherwise: int | None  # an earlier conditional node whose else branch this is
    on_skip: str


def leaf(draw: st.DrawFn, index: int) -> Cond:
    source = draw(st.integers(0, index - 1))
    op = draw(st.sampled_from(["gt", "le", "eq", "isin", "truthy"]))
    arg: Any = None
    if op in ("gt", "le", "eq"):
        arg = draw(st.integers(0, 3))
    elif op == "isin":
        arg = tuple(draw(st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True)))
    return Cond(op, source, arg)


def condition(draw: st.DrawFn, index: int, depth: int = 0) -> Cond:
    shape = draw(st.sampled_from(["leaf", "leaf", "not", "and", "or"] if depth < 2 else ["leaf"]))
    if shape == "leaf":
        return leaf(draw, index)
    if shape == "not":
        return Cond("not", parts=(condition(draw, index, depth + 1),))
    return Cond(shape, parts=(condition(draw, index, depth + 1), condition(draw, index, depth + 1)))


@st.composite
def graphs(draw: st.DrawFn) -> tuple[list[NodeSpec], dict[str, int]]:
    count = draw(st.integers(2, 8))
    specs: list[NodeSpec] = []
    for index in range(count):
        deps = (
            tuple(draw(st.lists(st.integers(0, index - 1), max_size=3, unique=True)))
            if index
            else ()
        )
        when = otherwise = None
        kind = draw(st.sampled_from(["plain", "when", "otherwise"])) if index else "plain"
        conditional = [i for i, s in enumerate(specs) if s.when is not None]
        if kind == "when":
            when = condition(draw, index)
        elif kind == "otherwise" and conditional:
            otherwise = draw(st.sampled_from(conditional))
        specs.append(NodeSpec(deps, when, otherwise, draw(st.sampled_from(["skip", "run"]))))
    table = {f"n{i}": draw(st.integers(0, 3)) for i in range(count)}
    return specs, table


def to_condition(cond: Cond, refs: list[Any]) -> Any:
    if cond.op == "not":
        return ~to_condition(cond.parts[0], refs)
    if cond.op == "and":
        return to_condition(cond.parts[0], refs) & to_condition(cond.parts[1], refs)
    if cond.op == "or":
        return to_condition(cond.parts[0], refs) | to_condition(cond.parts[1], refs)
    ref = refs[cond.source]
    if cond.op == "truthy":
        return ref.truthy()
    if cond.op == "isin":
        return ref.isin(list(cond.arg))
    return getattr(ref, cond.op)(cond.arg)


def holds(cond: Cond, values: list[int | None]) -> bool:
    """The reference semantics: a comparison with a skipped node's null is false."""
    if cond.op == "not":
        return not holds(cond.parts[0], values)
    if cond.op == "and":
        return holds(cond.parts[0], values) and holds(cond.parts[1], values)
    if cond.op == "or":
        return holds(cond.parts[0], values) or holds(cond.parts[1], values)
    seen = values[cond.source]
    if cond.op == "truthy":
        return bool(seen)
    if seen is None:
        return False
    if cond.op == "gt":
        return seen > cond.arg
    if cond.op == "le":
        return seen <= cond.arg
    if cond.op == "eq":
        return seen == cond.arg
    return seen in cond.arg


def sources(cond: Cond) -> set[int]:
    if cond.parts:
        return set().union(*(sources(p) for p in cond.parts))
    return {cond.source}


def reference(specs: list[NodeSpec], table: dict[str, int]) -> list[int | None | str]:
    """Each node's output, or "skipped"."""
    results: list[int | None | str] = []
    values: list[int | None] = []
    for index, spec in enumerate(specs):
        when = spec.when
        if spec.otherwise is not None:
            other = specs[spec.otherwise].when
            assert other is not None
            when = Cond("not", parts=(other,))
        deps = set(spec.deps) | (sources(when) if when else set())
        if deps and all(results[d] == "skipped" for d in deps) and spec.on_skip == "skip":
            outcome: int | None | str = "skipped"
        elif when is not None and not holds(when, values):
            outcome = "skipped"
        else:
            outcome = table[f"n{index}"]
        results.append(outcome)
        values.append(None if outcome == "skipped" else outcome)  # type: ignore[arg-type]
    return results


def build(specs: list[NodeSpec]) -> Any:
    @workflow(name=f"cp_flow_{next(names)}")
    def flow(table):  # type: ignore[no-untyped-def]
        refs: list[Any] = []
        for index, spec in enumerate(specs):
            options: dict[str, Any] = {"on_skip": spec.on_skip}
            if spec.when is not None:
                options["when"] = to_condition(spec.when, refs)
            if spec.otherwise is not None:
                options["otherwise"] = refs[spec.otherwise]
            after = [refs[d] for d in spec.deps]
            refs.append(value.named(f"n{index}")(table, after=after, **options))
        return None

    return flow


@settings(max_examples=30)
@given(graph=graphs())
def test_conditional_graphs_end_as_the_reference_says(
    client: Client,
    start_worker: Callable[..., Worker],
    graph: tuple[list[NodeSpec], dict[str, int]],
) -> None:
    specs, table = graph
    flow = build(specs)
    _worker_for(start_worker)
    run = client.submit(flow, table)
    assert run.wait(timeout=30).state is RunState.COMPLETED
    expected = reference(specs, table)
    shown = {s.node: s for s in client.get_run(run.id).steps}
    for index, outcome in enumerate(expected):
        got = shown[f"n{index}"]
        if outcome == "skipped":
            assert got.state is StepState.SKIPPED, (index, specs)
        else:
            assert (got.state, got.output) == (StepState.COMPLETED, outcome), (index, specs)


_started: dict[int, Worker] = {}


def _worker_for(start_worker: Callable[..., Worker]) -> None:
    """One worker per test (hypothesis reuses the function-scoped fixtures)."""
    key = id(start_worker)
    if key not in _started:
        _started[key] = start_worker(value, concurrency=8)
