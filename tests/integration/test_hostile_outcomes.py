"""What a handler raises or returns never leaves its step held, nor stops its worker.

A worker turns each handler's end into a completion or a failure. If building that outcome
raised (an exception whose ``str()`` raises, an output whose walk raises something other than
``InvalidPayload``, an observer told about it that raises), the step stayed in flight: the
worker kept renewing its lease and the run waited for ever. A ``SystemExit`` raised by an async
handler stopped the worker's event loop, and the worker. Every such handler now fails its
step, for good when retrying cannot help, and the worker goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from cyclone_dsl import Client, RunFailed, Step, StepContext, Worker, step, workflow
from cyclone_dsl.worker.observe import WorkerObserver


class Unprintable(Exception):
    """An exception whose ``str()`` raises, as a broken ``__str__`` in user code does."""

    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")


class UnwalkableOutput(dict[str, int]):
    """An output that raises while it is read (a lazy mapping whose backend has gone)."""

    def items(self):  # type: ignore[no-untyped-def]
        raise ConnectionError("the mapping's backend is gone")


class BadKey:
    def __repr__(self) -> str:
        raise RuntimeError("__repr__ is broken")


@step(name="ho_raise_sync", max_attempts=2)
def raise_sync(n: int) -> int:
    raise Unprintable()


@step(name="ho_raise_async", max_attempts=2)
async def raise_async(n: int) -> int:
    await asyncio.sleep(0)
    raise Unprintable()


@step(name="ho_raise_tx", max_attempts=2, transactional=True)
def raise_tx(n: int, *, ctx: StepContext) -> int:
    raise Unprintable()


@step(name="ho_unwalkable_sync", max_attempts=2)
def unwalkable_sync(n: int) -> object:
    return UnwalkableOutput(a=1)


@step(name="ho_unwalkable_async", max_attempts=2)
async def unwalkable_async(n: int) -> object:
    return UnwalkableOutput(a=1)


@step(name="ho_bad_key_sync", max_attempts=2)
def bad_key_sync(n: int) -> object:
    return {BadKey(): 1}


@step(name="ho_unwalkable_tx", max_attempts=2, transactional=True)
def unwalkable_tx(n: int, *, ctx: StepContext) -> object:
    return UnwalkableOutput(a=1)


RAISING = [raise_sync, raise_async, raise_tx]
RETURNING = [unwalkable_sync, unwalkable_async, bad_key_sync, unwalkable_tx]


def failed_step(
    client: Client, start_worker: Callable[..., Worker], handler: object, *also: object
) -> Step:
    """Run ``handler`` as a standalone step on a new worker (serving ``also`` too); its
    step's row once the run has failed."""
    start_worker(handler, *also)
    handle = client.enqueue(handler, 1)  # type: ignore[call-overload]
    with pytest.raises(RunFailed):
        handle.result(timeout=15)
    return handle.get().steps[0]


@pytest.mark.parametrize("handler", RAISING, ids=lambda h: h.name)
def test_an_exception_whose_str_raises_fails_its_step_with_every_attempt(
    client: Client, start_worker: Callable[..., Worker], handler: object
) -> None:
    row = failed_step(client, start_worker, handler)
    assert row.attempt == 2  # an ordinary error: retried like any other
    assert row.error is not None and row.error.startswith("Unprintable")
    assert row.error_kind == "error"


@pytest.mark.parametrize("handler", RETURNING, ids=lambda h: h.name)
def test_an_output_that_raises_while_it_is_encoded_fails_its_step_for_good(
    client: Client, start_worker: Callable[..., Worker], handler: object
) -> None:
    row = failed_step(client, start_worker, handler)
    assert row.error_kind == "invalid_output"
    assert row.attempt == 1  # the same output would be returned again


class RaisingObserver(WorkerObserver):
    """An observer with a bug in every method."""

    def __getattribute__(self, name: str) -> object:
        if name.startswith("on_"):

            def broken(*args: object, **kwargs: object) -> None:
                raise RuntimeError(f"{name} is broken")

            return broken
        return super().__getattribute__(name)


@step(name="ho_ok")
def ok(n: int) -> int:
    return n + 1


@step(name="ho_ok_async")
async def ok_async(n: int) -> int:
    return n + 2


@step(name="ho_fails_once", max_attempts=2)
def fails_once(n: int, *, ctx: StepContext) -> int:
    if ctx.attempt == 1:
        raise ValueError("first attempt")
    return n


@workflow(name="ho_observed")
def observed(n):  # type: ignore[no-untyped-def]
    return fails_once(ok_async(ok(n)))


def test_an_observer_that_raises_is_logged_and_the_runs_go_on(
    client: Client, start_worker: Callable[..., Worker], caplog: pytest.LogCaptureFixture
) -> None:
    start_worker(observed, observers=[RaisingObserver()])
    handles = [client.submit(observed, n) for n in range(5)]
    assert [h.result(timeout=20) for h in handles] == [n + 3 for n in range(5)]
    reported = [r for r in caplog.records if "observer" in r.getMessage()]
    assert reported, "the observer's errors are logged"
    # once per method, not once per call
    assert len(reported) == len({r.getMessage() for r in reported})


@step(name="ho_exit_sync", max_attempts=2)
def exit_sync(n: int) -> int:
    raise SystemExit(3)


@step(name="ho_exit_async", max_attempts=2)
async def exit_async(n: int) -> int:
    await asyncio.sleep(0)
    raise SystemExit(3)


@step(name="ho_interrupt_async", max_attempts=2)
async def interrupt_async(n: int) -> int:
    raise KeyboardInterrupt


@step(name="ho_exit_async_tx", max_attempts=2, transactional=True)
async def exit_async_tx(n: int, *, ctx: StepContext) -> int:
    raise SystemExit(3)


@step(name="ho_exit_sync_tx", max_attempts=2, transactional=True)
def exit_sync_tx(n: int, *, ctx: StepContext) -> int:
    raise SystemExit(3)


EXITING = [exit_sync, exit_async, interrupt_async, exit_async_tx, exit_sync_tx]


@pytest.mark.parametrize("handler", EXITING, ids=lambda h: h.name)
def test_a_handler_that_raises_systemexit_fails_its_step_and_the_worker_goes_on(
    client: Client, start_worker: Callable[..., Worker], handler: object
) -> None:
    row = failed_step(client, start_worker, handler, ok_async)
    assert row.attempt == 2
    assert row.error is not None
    assert row.error.split(":")[0] in {"SystemExit", "KeyboardInterrupt"}
    # the worker (and its event loop) still serves
    assert client.enqueue(ok_async, 1).result(timeout=15) == 3
