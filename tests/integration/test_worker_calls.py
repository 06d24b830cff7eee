"""How the worker calls handlers: the binding the workflow compiled, never the input's shape."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from cyclone_dsl import Client, StepContext, Worker, step, workflow


@step(name="wc_variants")
def variants() -> dict[str, str]:
    return {"a": "apple", "b": "banana"}


@step(name="wc_describe")
def describe(variants: dict[str, str], verbose: bool = False) -> list[Any]:
    return [variants, verbose]


@step(name="wc_pair")
def pair(first: object, second: object) -> list[object]:
    return [first, second]


@workflow(name="wc_single_dict")
def single_dict():  # type: ignore[no-untyped-def]
    literal = describe.named("literal")({"a": 1, "b": 2})
    upstream = describe.named("upstream")(variants())
    both = pair(upstream, literal)
    return pair.named("with_input")(both, "x")


def test_a_single_dict_argument_is_never_spread(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(single_dict)
    handle = client.submit(single_dict)
    result = handle.result(timeout=20)
    run = handle.get()
    assert run.step("upstream").output == [{"a": "apple", "b": "banana"}, False]
    assert run.step("literal").output == [{"a": 1, "b": 2}, False]
    # A real tuple binding (two arguments) is still spread over the parameters.
    assert result == [[run.step("upstream").output, run.step("literal").output], "x"]


@step(name="wc_standalone")
def standalone(value: dict[str, int]) -> dict[str, int]:
    return value


def test_standalone_work_gets_its_input_as_one_argument(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(standalone)
    assert client.enqueue(standalone, {"a": 1, "b": 2}).result(timeout=20) == {"a": 1, "b": 2}


seen: list[StepContext] = []


@step(name="wc_context", max_attempts=4)
def context(x: int, *, ctx: StepContext) -> int:
    seen.append(ctx)
    if ctx.attempt < 2:
        raise RuntimeError("the first attempt fails")
    return x


@workflow(name="wc_context_flow")
def context_flow(x):  # type: ignore[no-untyped-def]
    return context(x)


def test_the_context_tells_the_run_the_version_the_attempt_and_the_deadline(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    from cyclone_dsl.engine import backoff

    seen.clear()
    start_worker(context_flow)
    original = backoff.BASE_SECONDS
    backoff.BASE_SECONDS = 0.01
    try:
        handle = client.submit(context_flow, 5, deadline=timedelta(hours=1))
        assert handle.result(timeout=20) == 5
    finally:
        backoff.BASE_SECONDS = original
    run = handle.get()
    assert [c.attempt for c in seen] == [1, 2]  # from 1, as the CLI and dashboard show
    last = seen[-1]
    assert (last.workflow, last.def_version) == ("wc_context_flow", run.def_version)
    assert last.max_attempts == 4
    assert last.deadline == run.deadline_at
    assert run.step("wc_context").attempt == 1  # the column counts failed executions
