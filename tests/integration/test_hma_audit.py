"""Audit of unusual handler shapes and of ``StepContext`` misuse, with real workers.

Handlers as users write them: partials, callable objects, static methods, lambdas,
``*args``/``**kwargs``, keyword-only parameters and defaults, ``ctx`` in odd places, sync
functions that return coroutines or generators; contexts used from threads that outlive
their handler, from another step, after a cancel or after the worker stopped; handlers
that start threads that never end, touch signal handlers, logging, ``sys.stdout`` or the
working directory; names registered twice, and a workflow whose steps no worker serves.
Tests marked ``xfail(strict=True)`` show a bug.
"""

from __future__ import annotations

import asyncio
import functools
import io
import logging
import os
import signal
import sys
import threading
import time
import types
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cyclone_dsl import (
    Client,
    InvalidArgument,
    InvalidGraph,
    RegistryConflict,
    RunFailed,
    StepContext,
    StepDef,
    StepEvent,
    Worker,
    action,
    step,
    workflow,
)
from cyclone_dsl.dsl.registry import default_registry
from tests.waiting import wait_until

NOTES: dict[str, Any] = {}
RELEASE = threading.Event()


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    NOTES.clear()
    RELEASE.clear()
    yield
    RELEASE.set()  # a thread a handler left behind ends with its test


# -- handler shapes that work ---------------------------------------------------------


def _add(base: int, x: int) -> int:
    return base + x


async def _add_async(base: int, x: int) -> int:
    await asyncio.sleep(0)
    return base + x


partial_sync = step(name="hma_partial")(functools.partial(_add, 100))
partial_async = step(name="hma_partial_async")(functools.partial(_add_async, 200))


class Doubler:
    """A callable object whose ``__call__`` takes ``ctx``."""

    def __call__(self, x: int, *, ctx: StepContext) -> list[object]:
        return [x * 2, ctx.kind]


instance_step = step(name="hma_instance")(Doubler())


class Holder:
    @step(name="hma_static")
    @staticmethod
    def inner(x: int) -> int:
        return x + 1


lambda_step = step(name="hma_lambda")(lambda x: x * 3)


class Account:
    def __init__(self, balance: int) -> None:
        self.balance = balance

    def credit(self, amount: int) -> int:
        return self.balance + amount

    @step(name="hma_unbound")
    def unbound(self, amount: int) -> int:  # @step inside a class: self is not bound
        return amount


bound_step = step(name="hma_bound")(Account(1000).credit)


@step(name="hma_typed")
def typed(x: int) -> list[object]:
    return [type(x).__name__, x]


@step(name="hma_varargs")
def varargs(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return {"args": list(args), "kwargs": sorted(kwargs)}


@step(name="hma_defaults")
def defaults(x: int, y: int = 10, *, scale: int = 2, ctx: StepContext) -> list[int]:
    return [x, y, scale, ctx.attempt]


@step(name="hma_ctx_last")
def ctx_last(x: int, ctx: StepContext) -> list[object]:
    return [x, ctx.node]


@step(name="hma_other_name")
def other_name(x: int, context: StepContext | None = None) -> bool:
    return context is None


@step(name="hma_one")
def one(x: int) -> int:
    return x


@step(name="hma_two")
def two(x: int) -> int:
    return x + 1


@step(name="hma_gather")
def gather(parts: list[object]) -> list[object]:
    return parts


@workflow(name="hma_shapes_wf")
def shapes_wf(x):  # type: ignore[no-untyped-def]
    a = one(x)
    b = two(x)
    return gather(
        [
            varargs(a, b, x),
            defaults(a),
            defaults(a, b),
            ctx_last(b),
            partial_sync(a),
            partial_async(b),
            instance_step(a),
            Holder.inner(a),
            lambda_step(b),
            bound_step(a),
        ]
    )


def test_hma_unusual_but_valid_handler_shapes_run_in_a_workflow(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(shapes_wf)
    assert client.submit(shapes_wf, 5).result(timeout=20) == [
        {"args": [5, 6, 5], "kwargs": []},  # **kwargs gets no ctx: only a "ctx" parameter does
        [5, 10, 2, 1],
        [5, 6, 2, 1],
        [6, "hma_ctx_last"],
        105,
        206,
        [10, "hma_instance"],
        6,
        18,
        1005,
    ]


def test_hma_unusual_but_valid_handler_shapes_run_standalone(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    handlers: list[Any] = [
        varargs,
        defaults,
        ctx_last,
        other_name,
        partial_sync,
        partial_async,
        instance_step,
        Holder.inner,
        lambda_step,
        bound_step,
    ]
    start_worker(*handlers)
    results = [client.enqueue(h, 7).result(timeout=15) for h in handlers]
    assert results == [
        {"args": [7], "kwargs": []},
        [7, 10, 2, 1],
        [7, "hma_ctx_last"],
        True,  # a context under another name is not passed
        107,
        207,
        [14, "hma_instance"],
        8,
        21,
        1007,
    ]


def test_hma_type_hints_are_not_enforced_the_handler_gets_the_json_value(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(typed)
    assert client.enqueue(typed, "7").result(timeout=15) == ["str", "7"]
    assert client.enqueue(typed, 7.5).result(timeout=15) == ["float", 7.5]


# -- handler shapes refused before anything is written ------------------------------------


@step(name="hma_ctx_first")
def ctx_first(ctx: StepContext, x: int) -> int:
    return x


@step(name="hma_ctx_posonly")
def ctx_posonly(x: int, ctx: StepContext, /) -> int:
    return x


@step(name="hma_kwonly")
def kwonly(x: int, *, flag: bool) -> int:
    return x


@step(name="hma_context_required")
def context_required(x: int, context: StepContext) -> int:
    return x


@pytest.mark.parametrize(
    "handler",
    [ctx_first, ctx_posonly, kwonly, context_required, Account.unbound],
    ids=lambda h: h.name,
)
def test_hma_a_handler_that_cannot_be_called_is_refused_at_enqueue(
    client: Client, handler: Any
) -> None:
    with pytest.raises(InvalidArgument, match=handler.name):
        client.enqueue(handler, 1)
    assert client.list_runs() == []


@pytest.mark.parametrize(
    "handler",
    [ctx_first, ctx_posonly, kwonly, context_required, Account.unbound],
    ids=lambda h: h.name,
)
def test_hma_a_handler_that_cannot_be_called_is_refused_when_the_graph_is_built(
    client: Client, handler: Any
) -> None:
    def build(x):  # type: ignore[no-untyped-def]
        return handler(one(x))

    wf = workflow(name=f"hma_refused_{handler.name}")(build)
    try:
        with pytest.raises(InvalidGraph, match=handler.name):
            client.submit(wf, 1)
        assert client.list_runs() == []
    finally:  # later workers in this process would warn about it
        default_registry().workflows.pop(wf.name, None)


def test_hma_classmethod_is_refused_at_decoration() -> None:
    with pytest.raises(InvalidArgument, match="decorates a function"):
        step(name="hma_classmethod")(classmethod(_add))  # type: ignore[arg-type]


def _unnamed_callables() -> list[object]:
    return [functools.partial(_add, 1), Doubler()]


@pytest.mark.parametrize("fn", _unnamed_callables(), ids=["partial", "instance"])
def test_hma_an_unnamed_callable_without_name_is_refused_with_invalid_argument(
    fn: Any,
) -> None:
    with pytest.raises(InvalidArgument, match="name="):
        step(fn)


@pytest.mark.parametrize("make", [lambda: functools.partial(_add, 2), Doubler], ids=["p", "i"])
def test_hma_a_name_clash_between_unnamed_callables_is_a_registry_conflict(
    make: Callable[[], Any], request: pytest.FixtureRequest
) -> None:
    name = f"hma_clash_{request.node.callspec.id}"
    step(name=name)(make())
    with pytest.raises(RegistryConflict, match=name):
        step(name=name)(make())


# -- the same name in two modules -----------------------------------------------------------


@step(name="hma_dup")
def dup(x: int) -> int:
    return x


def test_hma_the_same_step_name_in_another_module_is_a_registry_conflict() -> None:
    other = types.ModuleType("hma_other_module")
    source = (
        "from cyclone_dsl import step\n"
        "@step(name='hma_dup')\n"
        "def dup(x: int) -> int:\n"
        "    return -x\n"
    )
    with pytest.raises(RegistryConflict) as info:
        exec(compile(source, "hma_other_module.py", "exec"), vars(other))
    message = str(info.value)
    assert "hma_other_module.dup" in message and f"{__name__}.dup" in message
    assert default_registry().kind("hma_dup") is dup  # the first definition stays


def test_hma_a_worker_given_two_kinds_of_one_name_refuses_to_start(cyclone_dsn: str) -> None:
    clash = step(name="hma_dup_local")(lambda x: x)
    # a second object under the same name, made without the default registry
    other = StepDef(lambda x: -x, "hma_dup_local", True, clash.options)
    with pytest.raises(RegistryConflict, match="hma_dup_local"):
        Worker(cyclone_dsn, [clash, other])


# -- handlers that are not what they seem -------------------------------------------------


async def _notify(x: int) -> int:
    NOTES["notified"] = x
    return x


@step(name="hma_forgot_async", max_attempts=3)
def forgot_async(x: int) -> Any:
    return _notify(x)  # a coroutine, never awaited


@step(name="hma_generator", max_attempts=3)
def generator(x: int) -> Iterator[int]:
    NOTES["generator_ran"] = True
    yield x


@step(name="hma_async_generator", max_attempts=3)
async def async_generator(x: int) -> AsyncIterator[int]:
    NOTES["generator_ran"] = True
    yield x


@pytest.mark.parametrize(
    "handler", [forgot_async, generator, async_generator], ids=lambda h: h.name
)
def test_hma_a_step_returning_a_coroutine_or_generator_fails_for_good_with_invalid_output(
    client: Client, start_worker: Callable[..., Worker], handler: Any
) -> None:
    start_worker(handler)
    handle = client.enqueue(handler, 3)
    with pytest.raises(RunFailed):
        handle.result(timeout=15)
    row = handle.get().steps[0]
    assert row.error_kind == "invalid_output"
    assert row.attempt == 1  # the same value would come back: no retry
    assert "notified" not in NOTES and "generator_ran" not in NOTES


class AsyncDoubler:
    """A callable object whose ``__call__`` is an ``async def``."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    async def __call__(self, x: int) -> int:
        await asyncio.sleep(0)
        NOTES[self.tag] = x
        return x * 2


async def _double(x: int) -> int:
    await asyncio.sleep(0)
    NOTES["static_async"] = x
    return x * 2


async_instance = step(name="hma_async_instance", max_attempts=1)(AsyncDoubler("instance"))
async_static = step(name="hma_async_static", max_attempts=1)(staticmethod(_double))


@pytest.mark.parametrize("handler", [async_instance, async_static], ids=lambda h: h.name)
def test_hma_an_async_callable_object_or_staticmethod_is_awaited(
    client: Client, start_worker: Callable[..., Worker], handler: Any
) -> None:
    start_worker(handler)
    assert client.enqueue(handler, 4).result(timeout=15) == 8


@action(name="hma_forgot_async_action", max_attempts=1)
def forgot_async_action(x: int) -> Any:
    return _notify(x)  # a coroutine, never awaited


@action(name="hma_async_generator_action", max_attempts=1)
async def async_generator_action(x: int) -> AsyncIterator[int]:
    NOTES["notified"] = x
    yield x


async_instance_action = action(name="hma_async_instance_action", max_attempts=1)(
    AsyncDoubler("notified")
)


@pytest.mark.parametrize(
    "handler",
    [forgot_async_action, async_generator_action, async_instance_action],
    ids=lambda h: h.name,
)
def test_hma_an_action_whose_body_never_ran_does_not_complete(
    client: Client, start_worker: Callable[..., Worker], handler: Any
) -> None:
    start_worker(handler)
    run = client.enqueue(handler, 5).wait(timeout=15)
    if run.state == "failed":
        return  # refused: the step failed, as it should
    assert NOTES.get("notified") == 5, f"the action {run.state} but its body never ran"


min_step = step(name="hma_min")(min)


def test_hma_a_builtin_without_a_signature_runs_standalone(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(min_step)
    assert client.enqueue(min_step, [3, 1, 2]).result(timeout=15) == 1


# -- StepContext used where it should not be ------------------------------------------------


def _try(outcome: dict[str, object], what: str, call: Callable[[], object]) -> None:
    try:
        outcome[what] = call()
    except Exception as exc:  # the audit records what each call does
        outcome[what] = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"


def _events(client: Client, run_id: int, count: int) -> list[StepEvent]:
    """The run's events, once there are ``count`` of them."""
    wait_until(lambda: len(client.events_of(run_id)) >= count, timeout=10, what="the events")
    return client.events_of(run_id)


def _misuse(ctx: StepContext, tag: str) -> None:
    outcome: dict[str, object] = {}
    _try(outcome, "emit", lambda: ctx.emit({"late": tag}))
    _try(outcome, "progress", lambda: ctx.progress(1, 2, tag))
    _try(outcome, "heartbeat", ctx.heartbeat)
    _try(outcome, "cancelled", lambda: ctx.cancelled)
    NOTES[tag] = outcome


@step(name="hma_leaky_thread")
def leaky_thread(x: int, *, ctx: StepContext) -> int:
    def later() -> None:
        RELEASE.wait(20)
        _misuse(ctx, "thread")

    threading.Thread(target=later, daemon=True).start()
    ctx.emit("inside")
    return x + 1


def test_hma_a_context_used_from_a_thread_after_its_handler_returned(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(leaky_thread)
    handle = client.enqueue(leaky_thread, 1)
    assert handle.result(timeout=15) == 2
    RELEASE.set()
    outcome = wait_until(lambda: NOTES.get("thread"), timeout=15, what="the late calls")
    assert outcome == {"emit": None, "progress": None, "heartbeat": False, "cancelled": False}
    events = _events(client, handle.id, 3)
    assert [(e.data, e.fenced) for e in events] == [
        ("inside", False),
        ({"late": "thread"}, True),
        ({"done": 1, "total": 2, "message": "thread"}, True),
    ]
    run = handle.get()
    assert run.state == "completed" and run.steps[0].output == 2


@step(name="hma_keeper")
def keeper(x: int, *, ctx: StepContext) -> int:
    NOTES["kept_ctx"] = ctx
    return x


@step(name="hma_borrower")
def borrower(x: int, *, ctx: StepContext) -> int:
    _misuse(NOTES["kept_ctx"], "borrowed")
    ctx.emit("own")
    return x


def test_hma_one_steps_context_used_inside_another_step(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(keeper, borrower)
    first = client.enqueue(keeper, 1)
    assert first.result(timeout=15) == 1
    second = client.enqueue(borrower, 2)
    assert second.result(timeout=15) == 2
    assert NOTES["borrowed"] == {
        "emit": None,
        "progress": None,
        "heartbeat": False,  # the first step's lease is long gone
        "cancelled": False,
    }
    # the borrowed context writes on its own (ended) step, fenced; never on the borrower's
    assert [(e.data, e.fenced) for e in client.events_of(second.id)] == [("own", False)]
    assert [(e.data, e.fenced) for e in client.events_of(first.id)] == [
        ({"late": "borrowed"}, True),
        ({"done": 1, "total": 2, "message": "borrowed"}, True),
    ]
    assert first.get().steps[0].output == 1


def test_hma_a_context_used_after_its_worker_stopped(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker(keeper)
    handle = client.enqueue(keeper, 3)
    assert handle.result(timeout=15) == 3
    worker.stop()
    _misuse(NOTES["kept_ctx"], "stopped")
    assert NOTES["stopped"] == {
        "emit": None,
        "progress": None,
        "heartbeat": False,
        "cancelled": False,
    }
    assert [e.fenced for e in client.events_of(handle.id)] == [True, True]


@step(name="hma_cancelled", max_attempts=1)
def cancelled_step(x: int, *, ctx: StepContext) -> int:
    NOTES["started"] = True
    ctx.wait_cancelled(20)
    _misuse(ctx, "cancelled")
    return x


def test_hma_context_calls_after_the_run_was_cancelled(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(cancelled_step)
    handle = client.enqueue(cancelled_step, 1)
    wait_until(lambda: NOTES.get("started"), timeout=15, what="the handler to start")
    client.cancel(handle.id)
    outcome = wait_until(lambda: NOTES.get("cancelled"), timeout=15, what="the late calls")
    assert outcome == {"emit": None, "progress": None, "heartbeat": False, "cancelled": True}
    assert handle.wait(timeout=10).state == "cancelled"
    events = _events(client, handle.id, 2)
    assert all(e.fenced for e in events)


@step(name="hma_timed_out", max_attempts=1, timeout=0.5)
def timed_out(x: int, *, ctx: StepContext) -> int:
    NOTES["started"] = True
    ctx.wait_cancelled(20)  # the timeout passed: the worker failed the step
    outcome: dict[str, object] = {}
    _try(outcome, "cancelled", lambda: ctx.cancelled)
    _try(outcome, "heartbeat", ctx.heartbeat)
    NOTES["timed_out"] = outcome
    return x


def test_hma_heartbeat_after_the_timeout_says_the_lease_is_lost(
    client: Client, start_worker: Callable[..., Worker], cyclone_dsn: str
) -> None:
    start_worker(timed_out)
    handle = client.enqueue(timed_out, 1)
    wait_until(lambda: NOTES.get("started"), timeout=15, what="the handler to start")
    # Hold the run's row (as a busy database would) so that the timeout failure, decided
    # by the worker, is not committed yet when the handler asks for a heartbeat.
    with psycopg.connect(cyclone_dsn) as conn:
        conn.execute("SELECT 1 FROM cyclone_runs WHERE id = %s FOR NO KEY UPDATE", (handle.id,))
        outcome = wait_until(lambda: NOTES.get("timed_out"), timeout=15, what="the late calls")
    with pytest.raises(RunFailed):
        handle.result(timeout=15)
    assert handle.get().steps[0].error_kind == "timeout"
    assert outcome == {"cancelled": True, "heartbeat": False}


def test_hma_connection_of_a_non_transactional_step_is_invalid_argument(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(keeper)
    client.enqueue(keeper, 1).result(timeout=15)
    with pytest.raises(InvalidArgument, match="transactional=True"):
        NOTES["kept_ctx"].connection  # noqa: B018


# -- handlers that touch the process --------------------------------------------------------


@step(name="hma_forever_thread")
def forever_thread(x: int) -> int:
    thread = threading.Thread(target=RELEASE.wait, name="hma-forever", daemon=False)
    thread.start()
    return x


def test_hma_a_non_daemon_thread_that_never_ends_does_not_hold_up_stop(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker(forever_thread, grace=2.0)
    assert client.enqueue(forever_thread, 1).result(timeout=15) == 1
    began = time.monotonic()
    worker.stop(timeout=30)
    assert time.monotonic() - began < 15
    assert worker.error is None
    assert any(t.name == "hma-forever" and t.is_alive() for t in threading.enumerate())


@step(name="hma_signals", max_attempts=1)
def signals(x: int) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return x


@step(name="hma_signals_async", max_attempts=1)
async def signals_async(x: int) -> int:
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, lambda: None)
    return x


@pytest.mark.parametrize("handler", [signals, signals_async], ids=lambda h: h.name)
def test_hma_a_handler_that_sets_a_signal_handler_fails_and_changes_nothing(
    client: Client, start_worker: Callable[..., Worker], handler: Any
) -> None:
    before = signal.getsignal(signal.SIGTERM)
    start_worker(handler, one)
    handle = client.enqueue(handler, 1)
    with pytest.raises(RunFailed):
        handle.result(timeout=15)
    row = handle.get().steps[0]
    assert row.error_kind == "error" and row.error is not None
    assert signal.getsignal(signal.SIGTERM) is before
    assert client.enqueue(one, 9).result(timeout=15) == 9  # the worker goes on


class _Closed(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.close()


@step(name="hma_rude")
def rude(x: int) -> int:
    sys.stdout = _Closed()
    root = logging.getLogger()
    root.addHandler(logging.StreamHandler(_Closed()))  # every record now fails to write
    root.setLevel(logging.DEBUG)
    logging.getLogger("cyclone").setLevel(logging.DEBUG)
    return x


def test_hma_a_handler_that_breaks_stdout_and_logging_does_not_break_the_worker(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    root = logging.getLogger()
    saved = (sys.stdout, list(root.handlers), root.level)
    cyclone_level = logging.getLogger("cyclone").level
    try:
        worker = start_worker(rude, one)
        assert client.enqueue(rude, 1).result(timeout=15) == 1
        assert [client.enqueue(one, n).result(timeout=15) for n in range(3)] == [0, 1, 2]
        worker.stop()  # no WorkerCrashed
        assert worker.error is None
    finally:
        sys.stdout = saved[0]
        root.handlers[:] = saved[1]
        root.setLevel(saved[2])
        logging.getLogger("cyclone").setLevel(cyclone_level)


@step(name="hma_chdir")
def chdir(path: str) -> str:
    os.chdir(path)
    return os.getcwd()


def test_hma_a_handler_that_changes_the_working_directory(
    client: Client, start_worker: Callable[..., Worker], tmp_path: Path
) -> None:
    cwd = os.getcwd()
    try:
        start_worker(chdir, one)
        assert client.enqueue(chdir, str(tmp_path)).result(timeout=15) == str(tmp_path)
        assert client.enqueue(one, 4).result(timeout=15) == 4
    finally:
        os.chdir(cwd)


# -- a workflow whose steps no worker serves ------------------------------------------------


@step(name="hma_unserved_step")
def unserved_step(x: int) -> int:
    return x * 10


@workflow(name="hma_unserved")
def unserved(x):  # type: ignore[no-untyped-def]
    return unserved_step(x)


def test_hma_a_run_no_worker_serves_waits_and_is_reported_unserved(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(one)  # does not run the workflow's step kind
    handle = client.submit(unserved, 2)
    rows = wait_until(
        lambda: [r for r in client.stats()["unserved"] if r["kind"] == "hma_unserved_step"],
        timeout=15,
        what="the unserved report",
    )
    assert rows[0]["workflow"] == "hma_unserved" and rows[0]["steps"] == 1
    run = handle.get()
    assert run.state == "running" and run.steps[0].state == "available"
    assert run.steps[0].attempt == 0  # nothing was spent
    start_worker(unserved)
    assert handle.result(timeout=15) == 20
