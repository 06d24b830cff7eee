"""Audit of what a handler returns or raises, and of retries.

Each test runs a handler (sync and async where it matters) on a worker of its own and
checks the outcome the step gets: its state, ``error`` and ``error_kind``, how many times
the handler was called (``CALLS``), the attempt numbers it saw (``SEEN``), the attempt
history and the ``RunFailed`` it raises. Tests marked ``xfail(strict=True)`` show a bug.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from cyclone_dsl import (
    Client,
    EventLimitExceeded,
    InvalidArgument,
    InvalidPayload,
    PayloadTooLarge,
    Permanent,
    RunFailed,
    RunHandle,
    Step,
    StepContext,
    StepState,
    Worker,
    action,
    step,
    workflow,
)
from tests.waiting import wait_until

CALLS: Counter[str] = Counter()
SEEN: defaultdict[str, list[int]] = defaultdict(list)
NOTES: dict[str, Any] = {}
_lock = threading.Lock()


@pytest.fixture(autouse=True)
def _reset() -> None:
    CALLS.clear()
    SEEN.clear()
    NOTES.clear()


def _called(tag: str, ctx: StepContext | None = None) -> None:
    with _lock:
        CALLS[tag] += 1
        if ctx is not None:
            SEEN[tag].append(ctx.attempt)


def failed_row(handle: RunHandle, timeout: float = 10) -> tuple[RunFailed, Step]:
    with pytest.raises(RunFailed) as info:
        handle.result(timeout=timeout)
    run = handle.get()
    return info.value, run.steps[0]


# -- outputs that are not JSON ------------------------------------------------------------


def _deep(levels: int) -> object:
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


BAD_OUTPUTS: dict[str, Callable[[], object]] = {
    "set": lambda: {1, 2},
    "object": lambda: object(),
    "nan": lambda: float("nan"),
    "inf_nested": lambda: {"a": [1, (2, float("inf"))]},
    "huge_int": lambda: 2**63,
    "huge_negative_int": lambda: -(2**63) - 1,
    "int_key": lambda: {1: "a"},
    "tuple_key": lambda: {(1, 2): "a"},
    "nul_text": lambda: "a" + chr(0) + "b",
    "nul_key": lambda: {"k" + chr(0): 1},
    "lone_surrogate": lambda: ["x" + chr(0xD800)],
    "deep_257": lambda: _deep(257),
    "deep_100k": lambda: _deep(100_000),
    "bytes": lambda: b"abc",
    "generator": lambda: (i for i in range(3)),
}


@step(name="oa_bad_output_sync", max_attempts=3)
def bad_output_sync(which: str) -> object:
    _called(f"sync-{which}")
    return BAD_OUTPUTS[which]()


@step(name="oa_bad_output_async", max_attempts=3)
async def bad_output_async(which: str) -> object:
    _called(f"async-{which}")
    await asyncio.sleep(0)
    return BAD_OUTPUTS[which]()


@pytest.mark.parametrize("which", sorted(BAD_OUTPUTS))
def test_a_non_json_output_fails_the_step_for_good_with_invalid_output(
    client: Client, start_worker: Callable[..., Worker], which: str
) -> None:
    start_worker(bad_output_sync, bad_output_async)
    for handler, tag in ((bad_output_sync, "sync"), (bad_output_async, "async")):
        error, row = failed_row(client.enqueue(handler, which))
        assert error.error_kind == "invalid_output"
        assert row.error_kind == "invalid_output"
        assert row.state is StepState.DISCARDED
        assert row.output is None
        assert CALLS[f"{tag}-{which}"] == 1  # no retry: the same value would come back
        assert [(a.number, a.outcome, a.error_kind) for a in row.attempts] == [
            (1, "failed", "invalid_output")
        ]


@step(name="oa_deep_ok")
def deep_ok(levels: int) -> object:
    return _deep(levels)


def test_nesting_up_to_the_limit_is_kept(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(deep_ok)
    assert client.enqueue(deep_ok, 256).result(timeout=10) == _deep(256)


@step(name="oa_sized", max_attempts=3)
def sized(n: int) -> str:
    _called("sized")
    return "x" * n


@pytest.mark.parametrize(("n", "ok"), [(998, True), (999, False), (200_000, False)])
def test_the_output_limit_is_exact_and_over_it_fails_for_good(
    client: Client, start_worker: Callable[..., Worker], n: int, ok: bool
) -> None:
    start_worker(sized, max_output_bytes=1000)  # "x" * 998 is 1,000 bytes of JSON
    handle = client.enqueue(sized, n)
    if ok:
        assert handle.result(timeout=10) == "x" * n
        return
    error, row = failed_row(handle)
    assert (error.error_kind, row.error_kind) == ("output_limit", "output_limit")
    assert CALLS["sized"] == 1


@step(name="oa_float")
def as_float(x: float) -> float:
    return x * 1.0


@step(name="oa_echo")
def echo(value: object) -> object:
    return value


@workflow(name="oa_float_then_echo")
def float_then_echo(x):  # type: ignore[no-untyped-def]
    return echo(as_float(x))


def test_a_large_float_output_passed_on_unchanged_keeps_the_run_going(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(float_then_echo)
    result = client.submit(float_then_echo, 1e20).result(timeout=10)
    assert result == 1e20
    assert isinstance(result, float)


@action(name="oa_action_returns", max_attempts=3)
def action_returns(which: str) -> object:
    _called(f"action-{which}")
    if which == "big":
        return "x" * 5000
    return BAD_OUTPUTS[which]()


@pytest.mark.parametrize("which", ["set", "nan", "huge_int", "big", "object"])
def test_an_action_may_return_anything_its_output_is_not_kept(
    client: Client, start_worker: Callable[..., Worker], which: str
) -> None:
    start_worker(action_returns, max_output_bytes=1000)
    run = client.enqueue(action_returns, which).wait(timeout=10)
    assert run.state.value == "completed"
    row = run.steps[0]
    assert row.state is StepState.COMPLETED
    assert row.output is None
    assert CALLS[f"action-{which}"] == 1


# -- exceptions ---------------------------------------------------------------------------


class Boom(Exception):
    pass


class PermanentSub(Permanent):
    pass


class StrReturnsInt(Exception):
    def __str__(self) -> str:
        return 42  # type: ignore[return-value]


class Fatal(BaseException):
    """A BaseException that is neither SystemExit nor KeyboardInterrupt."""


def _raise(which: str) -> None:
    if which == "plain":
        raise RuntimeError("plain failure")
    if which == "custom":
        raise Boom("custom failure")
    if which == "empty":
        raise Boom()
    if which == "multiline":
        raise Boom("first line\nsecond line\nthird line")
    if which == "huge":
        raise Boom("y" * 1_000_000)
    if which == "odd_text":
        raise Boom("nul" + chr(0) + "lone" + chr(0xDC80) + "rtl" + chr(0x202E) + chr(0x1F600))
    if which == "str_returns_int":
        raise StrReturnsInt()
    if which == "keyboard_interrupt":
        raise KeyboardInterrupt
    if which == "system_exit":
        raise SystemExit(2)
    if which == "base_exception":
        raise Fatal("fatal")
    if which == "chained":
        try:
            raise KeyError("inner")
        except KeyError as exc:
            raise Boom("outer") from exc
    raise AssertionError(which)


@step(name="oa_raise_sync", max_attempts=2)
def raise_sync(which: str, *, ctx: StepContext) -> int:
    _called(f"sync-{which}", ctx)
    _raise(which)
    return 0


@step(name="oa_raise_async", max_attempts=2)
async def raise_async(which: str, *, ctx: StepContext) -> int:
    _called(f"async-{which}", ctx)
    await asyncio.sleep(0)
    _raise(which)
    return 0


@step(name="oa_ok_async")
async def ok_async(n: int) -> int:
    return n + 1


@step(name="oa_ok_sync")
def ok_sync(n: int) -> int:
    return n + 2


EXPECTED_PREFIX = {
    "plain": "RuntimeError: plain failure",
    "custom": "Boom: custom failure",
    "empty": "Boom",
    "multiline": "Boom: first line",
    "huge": "Boom: yyyy",
    "odd_text": "Boom: nul",
    "str_returns_int": "StrReturnsInt: <str() raised TypeError>",
    "keyboard_interrupt": "KeyboardInterrupt",
    "system_exit": "SystemExit: 2",
    "base_exception": "Fatal: fatal",
    "chained": "Boom: outer",
}


@pytest.mark.parametrize("which", sorted(EXPECTED_PREFIX))
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_raised_exception_is_retried_then_fails_and_the_worker_goes_on(
    client: Client, start_worker: Callable[..., Worker], which: str, kind: str
) -> None:
    start_worker(raise_sync, raise_async, ok_async, ok_sync, concurrency=2)
    handler = raise_sync if kind == "sync" else raise_async
    error, row = failed_row(client.enqueue(handler, which))
    tag = f"{kind}-{which}"
    assert CALLS[tag] == 2
    assert SEEN[tag] == [1, 2]
    assert row.attempt == 2
    assert row.error_kind == "error" == error.error_kind
    assert row.error is not None and row.error.startswith(EXPECTED_PREFIX[which]), row.error
    assert error.error == row.error
    assert "\n" not in row.error
    assert len(row.error) <= 2000
    assert row.panic_stack is not None and len(row.panic_stack) <= 64 * 1024
    assert [(a.number, a.outcome, a.error_kind) for a in row.attempts] == [
        (1, "retried", "error"),
        (2, "failed", "error"),
    ]
    assert all(a.error == row.error for a in row.attempts)
    # both kinds of handler are still served by the same worker
    assert client.enqueue(ok_async, 1).result(timeout=10) == 2
    assert client.enqueue(ok_sync, 1).result(timeout=10) == 3


def _permanent(which: str) -> None:
    if which == "sub":
        raise PermanentSub("a subclass")
    if which == "from":
        try:
            raise OSError("disk")
        except OSError as exc:
            raise Permanent("gave up") from exc
    raise Permanent("no " + chr(0) + " retry")


@step(name="oa_permanent_sync", max_attempts=5)
def permanent_sync(which: str, *, ctx: StepContext) -> int:
    _called(f"sync-{which}", ctx)
    _permanent(which)
    return 0


@step(name="oa_permanent_async", max_attempts=5)
async def permanent_async(which: str, *, ctx: StepContext) -> int:
    _called(f"async-{which}", ctx)
    await asyncio.sleep(0)
    _permanent(which)
    return 0


@pytest.mark.parametrize("which", ["plain", "sub", "from"])
def test_permanent_fails_at_once_without_retry(
    client: Client, start_worker: Callable[..., Worker], which: str
) -> None:
    start_worker(permanent_sync, permanent_async)
    for handler in (permanent_sync, permanent_async):
        error, row = failed_row(client.enqueue(handler, which))
        assert error.error_kind == "permanent" == row.error_kind
        assert row.state is StepState.DISCARDED
        assert row.attempt == 1
        assert [(a.number, a.outcome) for a in row.attempts] == [(1, "failed")]
        assert row.error is not None and row.error.startswith("Permanent")
    assert CALLS[f"sync-{which}"] == 1
    assert CALLS[f"async-{which}"] == 1


# -- asyncio.CancelledError and TimeoutError raised by the handler itself ---------------


@step(name="oa_own_cancel_sync", max_attempts=1)
def own_cancel_sync(n: int) -> int:
    _called("own-cancel-sync")
    raise asyncio.CancelledError()


@step(name="oa_own_cancel_async", max_attempts=1)
async def own_cancel_async(n: int) -> int:
    _called("own-cancel-async")
    loop = asyncio.get_running_loop()
    future: asyncio.Future[int] = loop.create_future()
    loop.call_soon(future.cancel)  # a future a library cancels: nobody cancelled the task
    return await future


def test_a_sync_handler_raising_cancelled_error_fails_its_step(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(own_cancel_sync)
    _error, row = failed_row(client.enqueue(own_cancel_sync, 1), timeout=4)
    assert row.error_kind == "error"
    assert CALLS["own-cancel-sync"] == 1


def test_an_async_handler_raising_cancelled_error_fails_its_step(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(own_cancel_async)
    _error, row = failed_row(client.enqueue(own_cancel_async, 1), timeout=4)
    assert row.error_kind == "error"
    assert CALLS["own-cancel-async"] == 1


@step(name="oa_own_timeout_sync", max_attempts=1)
def own_timeout_sync(n: int) -> int:
    raise TimeoutError("the upstream API did not answer")


@step(name="oa_own_timeout_async", max_attempts=1)
async def own_timeout_async(n: int) -> int:
    raise TimeoutError("the upstream API did not answer")


@pytest.mark.parametrize("handler", [own_timeout_sync, own_timeout_async], ids=["sync", "async"])
def test_a_handler_raising_timeout_error_without_a_step_timeout_is_an_error(
    client: Client, start_worker: Callable[..., Worker], handler: Any
) -> None:
    start_worker(handler)
    _error, row = failed_row(client.enqueue(handler, 1))
    assert row.error_kind == "error"
    assert row.error == "TimeoutError: the upstream API did not answer"


@pytest.mark.parametrize("handler", [own_timeout_sync, own_timeout_async], ids=["sync", "async"])
def test_a_handler_raising_timeout_error_within_its_step_timeout_is_an_error(
    client: Client, start_worker: Callable[..., Worker], handler: Any
) -> None:
    start_worker(handler)
    _error, row = failed_row(client.enqueue(handler, 1, timeout=30))
    assert row.error == "TimeoutError: the upstream API did not answer"
    assert row.error_kind == "error"


# -- max_attempts, ctx.attempt, backoff and the attempt history -------------------------


@step(name="oa_flaky", max_attempts=3)
def flaky(succeed_on: int, *, ctx: StepContext) -> dict[str, int]:
    _called("flaky", ctx)
    if ctx.attempt < succeed_on:
        raise Boom(f"attempt {ctx.attempt}")
    return {"attempt": ctx.attempt, "max": ctx.max_attempts}


@step(name="oa_flaky_async", max_attempts=3)
async def flaky_async(succeed_on: int, *, ctx: StepContext) -> dict[str, int]:
    _called("flaky", ctx)
    await asyncio.sleep(0)
    if ctx.attempt < succeed_on:
        raise Boom(f"attempt {ctx.attempt}")
    return {"attempt": ctx.attempt, "max": ctx.max_attempts}


@pytest.mark.parametrize("handler", [flaky, flaky_async], ids=["sync", "async"])
def test_max_attempts_is_exact_and_the_history_is_in_order_with_backoff_on_the_db_clock(
    client: Client, start_worker: Callable[..., Worker], handler: Any
) -> None:
    start_worker(handler)
    error, row = failed_row(client.enqueue(handler, 99), timeout=15)
    assert CALLS["flaky"] == 3
    assert SEEN["flaky"] == [1, 2, 3]
    assert row.attempt == 3 and row.max_attempts == 3
    assert row.error == "Boom: attempt 3" == error.error
    attempts = row.attempts
    assert [(a.number, a.outcome, a.error) for a in attempts] == [
        (1, "retried", "Boom: attempt 1"),
        (2, "retried", "Boom: attempt 2"),
        (3, "failed", "Boom: attempt 3"),
    ]
    for a in attempts:
        assert a.started_at is not None and a.started_at <= a.ended_at
        assert a.worker
        assert a.panic_stack is not None and "Boom" in a.panic_stack
    # jittered exponential backoff from 1 s, on the database clock: [0.5, 1] s before
    # the first retry, [1, 2] s before the second (plus the worker's poll to claim it)
    for i, (low, high) in enumerate(((0.5, 1.0), (1.0, 2.0))):
        started = attempts[i + 1].started_at
        assert started is not None
        gap = (started - attempts[i].ended_at).total_seconds()
        assert low - 0.05 <= gap <= high + 1.0, (i, gap)


@pytest.mark.parametrize("handler", [flaky, flaky_async], ids=["sync", "async"])
def test_a_step_that_succeeds_on_a_retry_keeps_its_history_and_no_error(
    client: Client, start_worker: Callable[..., Worker], handler: Any
) -> None:
    start_worker(handler)
    handle = client.enqueue(handler, 2)
    assert handle.result(timeout=10) == {"attempt": 2, "max": 3}
    row = handle.get().steps[0]
    assert row.state is StepState.COMPLETED
    assert row.error is None and row.error_kind is None
    assert row.attempt == 1  # counts the failed executions
    assert [(a.number, a.outcome) for a in row.attempts] == [(1, "retried")]
    assert SEEN["flaky"] == [1, 2]


def test_max_attempts_one_means_no_retry(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(flaky)
    _error, row = failed_row(client.enqueue(flaky, 5, max_attempts=1))
    assert CALLS["flaky"] == 1
    assert row.max_attempts == 1
    assert [(a.number, a.outcome) for a in row.attempts] == [(1, "failed")]


@workflow(name="oa_override")
def override(n):  # type: ignore[no-untyped-def]
    return flaky(n, max_attempts=2, node_id="twice")


def test_a_node_override_of_max_attempts_is_honoured_and_run_failed_names_the_node(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(override)
    handle = client.submit(override, 9)
    with pytest.raises(RunFailed) as info:
        handle.result(timeout=10)
    assert info.value.node == "twice"
    assert info.value.error == "Boom: attempt 2"
    assert info.value.error_kind == "error"
    assert info.value.state == "failed"
    assert CALLS["flaky"] == 2
    assert handle.get().step("twice").attempt == 2


# -- timeouts -------------------------------------------------------------------------------


# A timeout of 0.3 s, for attempts that overrun it; a test whose attempt must return within
# it enqueues with a longer one (a handler thread may start late on a loaded machine).
ON_TIME = 1.5


@step(name="oa_slow_sync", max_attempts=2, timeout=0.3)
def slow_sync(n: int, *, ctx: StepContext) -> str:
    _called("slow-sync", ctx)
    if ctx.attempt == 1 or n == 1:
        ctx.wait_cancelled(30)  # past its timeout (whatever it is), then returns all the same
        time.sleep(0.1)
        NOTES[f"returned-{ctx.attempt}"] = True
        return "late"
    return "on time"


@step(name="oa_slow_async", max_attempts=2, timeout=0.3)
async def slow_async(n: int, *, ctx: StepContext) -> str:
    _called("slow-async", ctx)
    if ctx.attempt == 1 or n == 1:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            NOTES[f"cancelled-{ctx.attempt}"] = True
            return "swallowed"  # a value returned after the timeout is never kept
    return "on time"


@pytest.mark.parametrize(("handler", "tag"), [(slow_sync, "slow-sync"), (slow_async, "slow-async")])
def test_a_timed_out_attempt_is_retried_and_its_late_value_is_not_kept(
    client: Client,
    start_worker: Callable[..., Worker],
    clock: Callable[[datetime], None],
    handler: Any,
    tag: str,
) -> None:
    start_worker(handler)
    handle = client.enqueue(handler, 0, timeout=ON_TIME)  # attempt 2 returns within it
    wait_until(lambda: handle.get().steps[0].attempt == 1, timeout=15, what="attempt 1 to fail")
    clock(datetime.now(UTC) + timedelta(seconds=5))  # past the retry's backoff: no wait for it
    assert handle.result(timeout=15) == "on time"
    row = handle.get().steps[0]
    assert SEEN[tag] == [1, 2]
    assert [(a.number, a.outcome, a.error_kind) for a in row.attempts] == [
        (1, "retried", "timeout")
    ]


@pytest.mark.parametrize(("handler", "tag"), [(slow_sync, "slow-sync"), (slow_async, "slow-async")])
def test_a_timeout_on_the_last_attempt_fails_the_run_even_if_the_handler_returns_later(
    client: Client,
    start_worker: Callable[..., Worker],
    clock: Callable[[datetime], None],
    handler: Any,
    tag: str,
) -> None:
    start_worker(handler)
    handle = client.enqueue(handler, 1)
    wait_until(lambda: handle.get().steps[0].attempt == 1, timeout=15, what="attempt 1 to fail")
    clock(datetime.now(UTC) + timedelta(seconds=5))  # past the retry's backoff: no wait for it
    error, row = failed_row(handle)
    assert error.error_kind == "timeout" == row.error_kind
    assert [(a.number, a.outcome, a.error_kind) for a in row.attempts] == [
        (1, "retried", "timeout"),
        (2, "failed", "timeout"),
    ]
    if handler is slow_sync:
        wait_until(lambda: NOTES.get("returned-2"), timeout=5, what="the late handler to return")
    else:
        wait_until(lambda: NOTES.get("cancelled-2"), timeout=5, what="the task to be cancelled")
    time.sleep(0.3)
    after = handle.get()
    assert after.state.value == "failed"
    assert after.steps[0].output is None
    assert after.steps[0].error_kind == "timeout"
    assert SEEN[tag] == [1, 2]


# -- progress events ------------------------------------------------------------------------

ODD_EVENTS: list[object] = [
    {"emoji": chr(0x1F600), "rtl": chr(0x202E), "line_sep": chr(0x2028), "bom": chr(0xFEFF)},
    [1, 2.5, -0.5, True, None, "", {}],
    2**63 - 1,
    -(2**63),
    "plain text",
    None,
]


@step(name="oa_emitter", max_attempts=2)
def emitter(n: int, *, ctx: StepContext) -> str:
    _called("emitter", ctx)
    problems: list[str] = []
    for bad, expected in (
        ({1, 2}, InvalidPayload),
        (float("nan"), InvalidPayload),
        (2**63, InvalidPayload),
        ({1: "a"}, InvalidPayload),
        ("x" + chr(0), InvalidPayload),
        ("y" * 70_000, PayloadTooLarge),
    ):
        try:
            ctx.emit(bad)
        except expected:
            continue
        except Exception as exc:
            problems.append(f"emit {type(bad).__name__}: {type(exc).__name__}")
        else:
            problems.append(f"emit {type(bad).__name__} was accepted")
    for args, expected_p in (
        ((2, 1), InvalidArgument),
        ((-1, 1), InvalidArgument),
        ((True, 2), InvalidArgument),
        ((1, 2, 3), InvalidArgument),
        ((1, 2, "m" + chr(0)), InvalidPayload),
    ):
        try:
            ctx.progress(*args)  # type: ignore[arg-type]
        except expected_p:
            continue
        except Exception as exc:
            problems.append(f"progress {args!r}: {type(exc).__name__}")
        else:
            problems.append(f"progress {args!r} was accepted")
    if ctx.attempt == 1:
        ctx.progress(0, 2, "first try")
        raise Boom("retry me")
    for event in ODD_EVENTS:
        ctx.emit(event)
    ctx.progress(2, 2, chr(0x1F600))
    return "; ".join(problems) or "ok"


def test_events_refuse_bad_values_keep_odd_ones_and_carry_the_attempt(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(emitter)
    handle = client.enqueue(emitter, 1)
    assert handle.result(timeout=10) == "ok"
    events = list(handle.events(timeout=10))
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert [(e.kind, e.attempt, e.data) for e in events] == [
        ("progress", 1, {"done": 0, "total": 2, "message": "first try"}),
        *[("event", 2, data) for data in ODD_EVENTS],
        ("progress", 2, {"done": 2, "total": 2, "message": chr(0x1F600)}),
    ]
    assert not any(e.fenced for e in events)
    assert [e.data for e in client.events_of(handle.id)] == [e.data for e in events]


@step(name="oa_emitter_async", max_attempts=1)
async def emitter_async(n: int, *, ctx: StepContext) -> int:
    for i in range(3):
        await ctx.progress_async(i + 1, 3, f"item {i}")
    try:
        await ctx.emit_async({"bad": float("inf")})
    except InvalidPayload:
        await ctx.emit_async({"refused": "inf"})
    return 3


def test_async_events_in_order(client: Client, start_worker: Callable[..., Worker]) -> None:
    start_worker(emitter_async)
    handle = client.enqueue(emitter_async, 0)
    assert handle.result(timeout=10) == 3
    assert [e.data for e in handle.events(timeout=10)] == [
        {"done": 1, "total": 3, "message": "item 0"},
        {"done": 2, "total": 3, "message": "item 1"},
        {"done": 3, "total": 3, "message": "item 2"},
        {"refused": "inf"},
    ]


@step(name="oa_late_emitter", max_attempts=1, timeout=1.0)
def late_emitter(pause: float, *, ctx: StepContext) -> int:
    ctx.emit("before")
    NOTES["started"] = True
    ctx.wait_cancelled(5)
    time.sleep(pause)
    ctx.emit("after the timeout")
    NOTES["late-emitted"] = True
    return 1


def _late_events(client: Client, handle: RunHandle) -> list[tuple[object, bool]]:
    error, _row = failed_row(handle)
    assert error.error_kind == "timeout"
    wait_until(lambda: NOTES.get("late-emitted"), timeout=5, what="the late emit")
    events = wait_until(
        lambda: len(got := client.events_of(handle.id)) == 2 and got,
        timeout=5,
        what="both events",
    )
    return [(e.data, e.fenced) for e in events]


def test_an_event_written_well_after_the_timeout_is_kept_and_fenced(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(late_emitter)
    handle = client.enqueue(late_emitter, 0.5)
    assert _late_events(client, handle) == [("before", False), ("after the timeout", True)]


def test_an_event_written_right_after_the_timeout_is_fenced(
    client: Client, start_worker: Callable[..., Worker], cyclone_dsn: str
) -> None:
    start_worker(late_emitter)
    handle = client.enqueue(late_emitter, 0.0)
    wait_until(lambda: NOTES.get("started"), timeout=5, what="the handler to start")
    # Hold the run's row (as a slow commit would) so that the worker's timeout failure
    # waits: the handler, told its timeout passed, emits meanwhile.
    with psycopg.connect(cyclone_dsn) as conn:
        conn.execute("SELECT 1 FROM cyclone_runs WHERE id = %s FOR NO KEY UPDATE", (handle.id,))
        wait_until(lambda: NOTES.get("late-emitted"), timeout=5, what="the late emit")
    assert _late_events(client, handle) == [("before", False), ("after the timeout", True)]


@step(name="oa_event_cap", max_attempts=1)
def event_cap(n: int, *, ctx: StepContext) -> int:
    stored = 0
    for i in range(n):
        try:
            ctx.emit(i)
        except EventLimitExceeded as exc:
            NOTES["cap"] = (exc.cap, exc.node, exc.run_id == ctx.run_id)
            return stored
        stored += 1
    return stored


def test_the_event_cap_stops_at_the_cap(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(event_cap, max_events_per_step=3)
    handle = client.enqueue(event_cap, 10)
    assert handle.result(timeout=10) == 3
    assert NOTES["cap"] == (3, "oa_event_cap", True)
    assert [e.data for e in client.events_of(handle.id)] == [0, 1, 2]
