"""Property: random DAGs on several workers, with random handler failures, end correctly.

Every run ends completed, every step completed exactly once in the database,
and every output equals an in-memory evaluation of the same DAG.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cyclone_dsl import Client, StepContext, Worker, step, workflow
from cyclone_dsl.states import RunState, StepState

failures_planned: dict[str, int] = {}
successes: list[tuple[int, str]] = []
lock = threading.Lock()
names = itertools.count()


def maybe_fail(ctx: StepContext) -> None:
    with lock:
        if ctx.attempt <= failures_planned.get(ctx.node, 0):  # attempts count from 1
            raise RuntimeError(f"planned failure of {ctx.node} at attempt {ctx.attempt}")


def succeeded(ctx: StepContext) -> None:
    with lock:
        successes.append((ctx.run_id, ctx.node))


@step(name="p_const", max_attempts=3)
def const(*, ctx: StepContext) -> int:
    maybe_fail(ctx)
    succeeded(ctx)
    return 1


@step(name="p_one", max_attempts=3)
def one(x: int, *, ctx: StepContext) -> int:
    maybe_fail(ctx)
    succeeded(ctx)
    return x * 2 + 1


@step(name="p_pair", max_attempts=3)
def pair(a: int, b: int, *, ctx: StepContext) -> int:
    maybe_fail(ctx)
    succeeded(ctx)
    return a * 3 + b


@step(name="p_sum", max_attempts=3)
def total(values: list[int], *, ctx: StepContext) -> int:
    maybe_fail(ctx)
    succeeded(ctx)
    return sum(values) + 1


@st.composite
def dag_specs(draw: st.DrawFn) -> list[list[int]]:
    """For each node, the indices of the earlier nodes it consumes."""
    count = draw(st.integers(1, 9))
    spec: list[list[int]] = []
    for index in range(count):
        deps = draw(st.lists(st.integers(0, index - 1), max_size=4, unique=True)) if index else []
        spec.append(deps)
    return spec


def reference(spec: list[list[int]], run_input: int) -> list[int]:
    values: list[int] = []
    for index, deps in enumerate(spec):
        inputs = [values[d] for d in deps]
        if not deps:
            values.append(1 if index % 2 == 0 else run_input * 2 + 1)
        elif len(deps) == 1:
            values.append(inputs[0] * 2 + 1)
        elif len(deps) == 2:
            values.append(inputs[0] * 3 + inputs[1])
        else:
            values.append(sum(inputs) + 1)
    return values


def build(spec: list[list[int]]) -> tuple[object, list[str]]:
    ids = [f"n{i}" for i in range(len(spec))]

    def builder(x):  # type: ignore[no-untyped-def]
        refs: list[object] = []
        for index, deps in enumerate(spec):
            args = [refs[d] for d in deps]
            if not deps:
                ref = const() if index % 2 == 0 else one(x)  # type: ignore[call-arg]
            elif len(deps) == 1:
                ref = one(args[0])  # type: ignore[call-arg, arg-type]
            elif len(deps) == 2:
                ref = pair(args[0], args[1])  # type: ignore[call-arg, arg-type]
            else:
                ref = total(args)  # type: ignore[call-arg, arg-type]
            refs.append(ref.named(ids[index]))  # type: ignore[attr-defined]
        return refs[-1]

    builder.__name__ = f"prop_{next(names)}"
    return workflow(builder), ids


started: set[int] = set()


@given(spec=dag_specs(), run_input=st.integers(0, 100), data=st.data())
@settings(max_examples=12, deadline=None)
def test_random_dags_end_with_reference_outputs(
    client: Client,
    start_worker: Callable[..., Worker],
    monkeypatch: pytest.MonkeyPatch,
    spec: list[list[int]],
    run_input: int,
    data: st.DataObject,
) -> None:
    if id(start_worker) not in started:  # one set of workers for all examples of this test
        started.add(id(start_worker))
        for _ in range(3):
            start_worker(const, one, pair, total, concurrency=4)
    from cyclone_dsl.engine import backoff

    monkeypatch.setattr(backoff, "BASE_SECONDS", 0.01)
    wf, ids = build(spec)
    plan = {node: data.draw(st.integers(0, 2), label=f"fail {node}") for node in ids}
    with lock:
        failures_planned.clear()
        failures_planned.update(plan)
        successes.clear()
    handle = client.submit(wf, run_input)
    expected = reference(spec, run_input)
    assert handle.result(timeout=60) == expected[-1]
    run = handle.get()
    assert run.state is RunState.COMPLETED
    for index, node in enumerate(ids):
        row = run.step(node)
        assert row.state is StepState.COMPLETED
        assert row.output == expected[index]
        assert row.attempt == plan[node]
    with lock:
        assert sorted(n for r, n in successes if r == handle.id) == sorted(ids)
