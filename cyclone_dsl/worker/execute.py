"""Runs one handler with its input and turns what happens into a completion or a failure."""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from cyclone_dsl import payload
from cyclone_dsl.dsl.flow import MAX_LIMIT
from cyclone_dsl.engine import Claimed, Failure, Success, backoff_seconds
from cyclone_dsl.errors import InvalidPayload, PayloadTooLarge, Permanent
from cyclone_dsl.states import ErrorKind
from cyclone_dsl.worker.context import EventWriter, StepContext
from cyclone_dsl.worker.serving import STANDALONE, Serving, arguments, standalone_arguments


def call_arguments(serving: Serving, fn: Callable[..., Any], step: Claimed) -> list[Any]:
    """The positional arguments of a handler call, from the binding the workflow compiled.

    The node's binding (no argument, one value, a tuple of 2..4 arguments
    assembled as ``{"a": .., "b": ..}``, or a list) comes from this worker's
    definition of the run's ``(workflow, def_version)``, never from the
    input's shape: a single dict argument with keys ``a`` and ``b`` stays one
    argument.
    """
    if step.def_version == STANDALONE:
        return standalone_arguments(fn, step.input)
    call = serving.call_of(step.workflow, step.def_version, step.node, step.item_of)
    return arguments(call, step.input)


T = TypeVar("T")


class Exited(Exception):
    """A ``SystemExit`` or ``KeyboardInterrupt`` an async handler raised (its ``__cause__``),
    carried out of its task as an ordinary failure: raised out of a task, asyncio lets them
    stop the event loop, and with it the worker."""


async def contained(awaitable: Awaitable[T]) -> T:
    try:
        return await awaitable
    except (SystemExit, KeyboardInterrupt) as exc:
        raise Exited() from exc


# Turning a handler's end into an outcome never raises: if it did, the step would stay in
# flight, its lease renewed by the worker, and its run would wait for ever. User objects
# (an exception's ``__str__``, an output's methods) can raise anything.


def one_line(exc: BaseException) -> str:
    name = type(exc).__name__
    try:
        text = str(exc).strip().splitlines()
    except Exception as broken:  # noqa: BLE001 - see above
        text = [f"<str() raised {type(broken).__name__}>"]
    message = text[0] if text else ""
    return payload.sanitize_text(f"{name}: {message}" if message else name, limit=2000)


def stack_text(exc: BaseException) -> str:
    """The exception's traceback; a plain frame list when the formatter itself fails
    (CPython 3.11.0-3.11.7 can raise ``SystemError`` in it when threads parse code at once)."""
    try:
        text = "".join(traceback.format_exception(exc))
    except Exception:  # noqa: BLE001 - see above
        frames = traceback.extract_tb(exc.__traceback__)
        lines = [f'  File "{f.filename}", line {f.lineno}, in {f.name}\n' for f in frames]
        text = "Traceback (most recent call last):\n" + "".join(lines) + one_line(exc) + "\n"
    return payload.sanitize_text(text, limit=64 * 1024)


def failure_from_exception(step: Claimed, exc: BaseException, *, kind: ErrorKind) -> Failure:
    if isinstance(exc, Exited) and exc.__cause__ is not None:
        exc = exc.__cause__
    stack = stack_text(exc)
    permanent = isinstance(exc, Permanent)
    return Failure(
        step_id=step.id,
        generation=step.generation,
        error=one_line(exc),
        error_kind=(ErrorKind.PERMANENT if permanent else kind).value,
        panic_stack=stack,
        retry=not permanent,
        delay_s=backoff_seconds(step.attempt + 1),
    )


def timeout_failure(step: Claimed) -> Failure:
    return Failure(
        step_id=step.id,
        generation=step.generation,
        error=f"the step ran longer than its timeout of {step.timeout_s:g}s",
        error_kind=ErrorKind.TIMEOUT.value,
        delay_s=backoff_seconds(step.attempt + 1),
    )


def success_from_result(
    step: Claimed, result: object, *, keep_output: bool, max_bytes: int, extra_units: int = 0
) -> Success | Failure:
    """Encode the handler's result; a value that is not strict JSON fails the step for good.

    ``extra_units`` are rate-limit units the handler used beyond its claim's.
    """
    never_ran = _never_ran(result)
    if never_ran is not None:
        return _invalid_output(step, never_ran)
    if not keep_output:
        return Success(step.id, step.generation, None, extra_units)
    try:
        text = payload.encode(result, what=f"the output of {step.node!r}", max_bytes=max_bytes)
    except PayloadTooLarge as exc:
        return Failure(
            step.id,
            step.generation,
            payload.sanitize_text(str(exc), limit=2000),  # it names the node
            ErrorKind.OUTPUT_LIMIT.value,
            retry=False,
        )
    except InvalidPayload as exc:
        return _invalid_output(step, f"the handler returned a value that is not JSON: {exc}")
    except Exception as exc:  # noqa: BLE001 - the output's own methods raised while read
        reason = f"the handler's output raised while it was encoded: {one_line(exc)}"
        return _invalid_output(step, reason)
    return Success(step.id, step.generation, text, extra_units)


def _never_ran(result: object) -> str | None:
    """Why a handler's result shows its body never ran (a coroutine nobody awaited, a
    generator nobody iterated): an action's effect would be lost silently, and a step's
    output is no JSON either."""
    if inspect.iscoroutine(result):
        result.close()  # no "never awaited" warning: the failure says it
        return "the handler returned a coroutine, never awaited: declare it async def"
    if inspect.isasyncgen(result) or inspect.isgenerator(result):
        return (
            "the handler returned a generator, never iterated: its body did not run "
            "(an action runs a function or a coroutine function, not a generator)"
        )
    return None


def _invalid_output(step: Claimed, reason: str) -> Failure:
    return Failure(
        step.id,
        step.generation,
        payload.sanitize_text(reason, limit=2000),  # it may quote the output (a key)
        ErrorKind.INVALID_OUTPUT.value,
        panic_stack=None,
        retry=False,
    )


def extra_units(ctx: StepContext, reserved: int) -> int:
    """The rate-limit units a handler reported beyond the ``reserved`` its claim took (no
    budget has more than ``MAX_LIMIT``: a larger report takes the whole budget)."""
    used = ctx.rate_limit_units
    if used is None or isinstance(used, bool) or not isinstance(used, int):
        return 0
    return max(0, min(used, MAX_LIMIT) - reserved)


def make_context(
    step: Claimed, heartbeat: Callable[[], bool], emit: EventWriter | None = None
) -> StepContext:
    extra: dict[str, Any] = {} if emit is None else {"emit_fn": emit}
    return StepContext(
        run_id=step.run_id,
        node=step.node,
        step_id=step.id,
        attempt=step.attempt + 1,
        max_attempts=step.max_attempts,
        kind=step.kind,
        item_index=step.item_index,
        workflow=step.workflow,
        def_version=step.def_version,
        deadline=step.deadline_at,
        heartbeat_fn=heartbeat,
        **extra,
    )
