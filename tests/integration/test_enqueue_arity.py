"""Standalone work calls its handler with the input as its one argument, or with none.

``enqueue`` and ``enqueue_many`` refuse, with nothing written, a handler that
requires two or more positional arguments and an input for a handler that
takes no positional parameter (the worker would drop it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from cyclone_dsl import AsyncClient, Client, Worker, action, step
from cyclone_dsl.errors import InvalidArgument


@step(name="ea_pair")
def pair(a: int, b: int) -> int:
    return a + b


@step(name="ea_pair_ctx")
def pair_ctx(a: int, b: int, *, ctx: object) -> int:
    return a + b


@step(name="ea_tick")
def tick() -> str:
    return "tick"


@action(name="ea_tick_ctx")
def tick_ctx(ctx: object) -> None:
    return None


@step(name="ea_one")
def one(value: object, ctx: object = None) -> object:
    return value


@step(name="ea_optional")
def optional(value: object = "default", extra: object = None) -> object:
    return value


@step(name="ea_star")
def star(*values: object) -> int:
    return len(values)


@step(name="ea_kwonly")
def kwonly(value: object, *, flag: bool) -> object:
    return value


def test_a_handler_of_two_positional_arguments_is_refused(client: Client) -> None:
    for handler in (pair, pair_ctx, "ea_pair"):
        with pytest.raises(InvalidArgument) as caught:
            client.enqueue(handler, {"a": 1, "b": 2})
        message = str(caught.value)
        assert "takes 2 positional arguments (a, b)" in message
        assert "one positional argument" in message
        with pytest.raises(InvalidArgument, match="takes 2 positional arguments"):
            client.enqueue_many(handler, [1, 2])
    assert client.list_runs() == []


def test_an_input_for_a_handler_without_a_positional_parameter_is_refused(
    client: Client,
) -> None:
    for handler in (tick, tick_ctx):
        with pytest.raises(InvalidArgument) as caught:
            client.enqueue(handler, {"x": 1})
        message = str(caught.value)
        assert "takes no positional argument" in message
        assert "input" in message
        with pytest.raises(InvalidArgument, match="takes no positional argument"):
            client.enqueue(handler, 0)
        with pytest.raises(InvalidArgument, match="takes no positional argument"):
            client.enqueue(handler, False)
    assert client.list_runs() == []


def test_enqueue_many_refuses_inputs_for_a_handler_without_a_positional_parameter(
    client: Client,
) -> None:
    with pytest.raises(InvalidArgument, match="takes no positional argument"):
        client.enqueue_many(tick, [None, {"x": 1}])
    assert client.list_runs() == []


def test_a_required_keyword_only_parameter_is_refused(client: Client) -> None:
    with pytest.raises(InvalidArgument, match="flag"):
        client.enqueue(kwonly, 1)
    assert client.list_runs() == []


def test_handlers_that_fit_are_enqueued_and_run(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(tick, tick_ctx, one, optional, star)
    assert client.enqueue(tick).result(timeout=10) == "tick"
    assert client.enqueue(tick, None).result(timeout=10) == "tick"
    client.enqueue(tick_ctx).wait(timeout=10)
    assert client.enqueue(one, {"k": [1]}).result(timeout=10) == {"k": [1]}
    assert client.enqueue(one).result(timeout=10) is None
    assert client.enqueue(optional, "given").result(timeout=10) == "given"
    assert client.enqueue(star, [1, 2, 3]).result(timeout=10) == 1
    handles = client.enqueue_many(tick, [None, None])
    assert [h.result(timeout=10) for h in handles] == ["tick", "tick"]
    handles = client.enqueue_many(one, [1, None])
    assert [h.result(timeout=10) for h in handles] == [1, None]
    assert all(run.state == "completed" for run in client.list_runs())


def test_the_async_client_refuses_the_same(cyclone_dsn: str) -> None:
    async def scenario() -> list[object]:
        async with AsyncClient(cyclone_dsn) as client:
            with pytest.raises(InvalidArgument, match="takes 2 positional arguments"):
                await client.enqueue(pair, 1)
            with pytest.raises(InvalidArgument, match="takes no positional argument"):
                await client.enqueue(tick, 1)
            with pytest.raises(InvalidArgument, match="takes 2 positional arguments"):
                await client.enqueue_many(pair, [1])
            return list(await client.list_runs())

    assert asyncio.run(scenario()) == []
