"""Every client method that takes a run id refuses anything else with InvalidArgument,
before any statement: a RunHandle (``client.result(client.submit(...))``), a string, a
bool. The methods are found by their ``run_id`` parameter, so a new one is covered too."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest

from cyclone_dsl import AsyncClient, Client, InvalidArgument, RunNotFound, step


@step(name="rid_work")
def work(x: object) -> object:
    return x


def methods_taking_a_run_id(cls: type) -> list[str]:
    return sorted(
        name
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_") and "run_id" in inspect.signature(member).parameters
    )


def call_arguments(method: Any) -> dict[str, Any]:
    """Filler values for the other required parameters."""
    filler: dict[str, Any] = {}
    for name, parameter in inspect.signature(method).parameters.items():
        if name in ("self", "run_id") or parameter.default is not inspect.Parameter.empty:
            continue
        filler[name] = "x"
    return filler


async def awaited(result: Any) -> Any:
    """``handle()`` is a plain method: its error is raised before there is anything to
    await; the others are coroutines."""
    return await result if inspect.isawaitable(result) else result


SYNC = methods_taking_a_run_id(Client)
ASYNC = methods_taking_a_run_id(AsyncClient)


def test_the_methods_are_found() -> None:
    assert {"result", "cancel", "signal", "get_run", "why_waiting"} <= set(SYNC)
    assert SYNC == ASYNC


@pytest.mark.parametrize("name", SYNC)
def test_a_sync_method_refuses_what_is_not_a_run_id(client: Client, name: str) -> None:
    handle = client.enqueue(work, 1)
    method = getattr(client, name)
    for wrong in (handle, str(handle.id), True, 1.0):
        with pytest.raises(InvalidArgument, match="run id"):
            method(wrong, **call_arguments(method))


@pytest.mark.parametrize("name", SYNC)
def test_a_run_id_past_the_bigint_range_is_no_run(client: Client, name: str) -> None:
    """cancel, pause, resume, retry... sent it to the database, which refused it with a raw
    NumericValueOutOfRange ("bigint out of range")."""
    method = getattr(client, name)
    for wrong in (2**63, -(2**63) - 1):
        with pytest.raises(RunNotFound):
            method(wrong, **call_arguments(method))


#: Methods that do not read the run when called: a handle is made without a read, and
#: events() reads on the first next().
LAZY = {"handle", "events"}


@pytest.mark.parametrize("name", SYNC)
def test_a_run_that_does_not_exist_is_run_not_found(client: Client, name: str) -> None:
    """signals_of, children_of, dependencies and progress answered [], {} or (0, 0) for a
    run that never existed or was purged, as if it had no signals, edges or steps."""
    missing = client.enqueue(work, 1).id + 1000
    method = getattr(client, name)

    def read() -> None:
        answer = method(missing, **call_arguments(method))
        if name in LAZY:
            next(iter(answer.events() if name == "handle" else answer))

    with pytest.raises(RunNotFound):
        read()


@pytest.mark.parametrize("name", ASYNC)
def test_an_async_method_refuses_what_is_not_a_run_id(cyclone_dsn: str, name: str) -> None:
    async def check() -> None:
        async with AsyncClient(cyclone_dsn) as client:
            handle = await client.enqueue(work, 1)
            method = getattr(client, name)
            for wrong in (handle, str(handle.id), True, 1.0):
                with pytest.raises(InvalidArgument, match="run id"):
                    await awaited(method(wrong, **call_arguments(method)))

    asyncio.run(check())
