"""The context a handler receives when it declares a ``ctx`` parameter."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any

import attrs

from cyclone_dsl import payload
from cyclone_dsl.errors import InvalidArgument

#: The largest event (its JSON text, in bytes) ``ctx.emit`` and ``ctx.progress`` store.
MAX_EVENT_BYTES = 64 * 1024

#: Stores one event: (kind, JSON text).
EventWriter = Callable[[str, str], None]


def _stores_nothing(kind: str, text: str) -> None:
    """The event writer of a context made by hand (a unit test): nothing is stored."""


class CancelFlag:
    """A :class:`threading.Event` made only when someone waits: every step gets a flag,
    few handlers wait on it, and an Event (a Condition and its lock) cost more than the
    rest of a no-op step's dispatch."""

    __slots__ = ("_event", "_set")

    def __init__(self) -> None:
        self._set = False
        self._event: threading.Event | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        event = self._event  # read after the write: a waiter that made it is woken
        if event is not None:
            event.set()

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        with _FLAG_LOCK:
            if self._event is None:
                self._event = threading.Event()
        if self.is_set():  # set before the Event existed: set() did not see it
            self._event.set()
        return self._event.wait(timeout)


_FLAG_LOCK = threading.Lock()


@attrs.define
class StepContext:
    """What a running handler may know and do.

    ``attempt`` is the number of this execution, from 1: the first try is
    attempt 1 of ``max_attempts``, the first retry attempt 2. A reclaim (the
    worker died or lost its lease) runs the same attempt again. The CLI and the
    dashboard show the same number (``attempt 2/5``).

    ``idempotency_key`` is stable across retries and reclaims of the same
    step (``"<run_id>:<node>"``): pass it to external systems so that a
    re-executed handler does not repeat an effect.

    ``deadline`` is the run's deadline (``None`` without one), from the
    database clock.

    :meth:`emit` and :meth:`progress` report what the handler is doing while it runs:
    each event is stored at once (durably, in its own transaction) and followers of the
    run (``RunHandle.events()``, ``cyclone run ID --follow``) see it live.

    ``rate_limit_units``: a handler whose kind has a :class:`RateLimit` and that
    learns its real cost while it runs (tokens of an API call) sets the units it
    used; what exceeds the units its claim took (``RateLimit.units``) is charged
    to the budget when the step completes, so later starts wait for it.
    """

    run_id: int
    node: str
    step_id: int
    attempt: int
    max_attempts: int
    kind: str
    item_index: int | None
    workflow: str
    def_version: str
    deadline: datetime | None = None
    rate_limit_units: int | None = None
    _emit: EventWriter = attrs.field(default=_stores_nothing, alias="emit_fn")
    _connection: Any = attrs.field(default=None, alias="connection")
    _cancelled: CancelFlag = attrs.field(factory=CancelFlag, alias="cancelled_event")
    _heartbeat: Callable[[], bool] = attrs.field(default=lambda: True, alias="heartbeat_fn")

    @property
    def idempotency_key(self) -> str:
        return f"{self.run_id}:{self.node}"

    @property
    def cancelled(self) -> bool:
        """True once the step should stop: its run or branch was cancelled, its timeout
        passed, or its lease was lost (the result would be ignored).

        A sync handler cannot be interrupted from outside: one that runs long should
        check this between units of work and return (or raise) when it is set. Its
        worker slot stays busy until it does. An async handler is cancelled instead
        (``asyncio.CancelledError`` at its next ``await``).
        """
        return self._cancelled.is_set()

    def wait_cancelled(self, timeout: float | None = None) -> bool:
        """Block up to ``timeout`` seconds until :attr:`cancelled` is set; return it."""
        return self._cancelled.wait(timeout)

    @property
    def connection(self) -> Any:
        """The connection of a transactional step's transaction (``@step(transactional=True)``):
        a ``psycopg.Connection`` for a sync handler, a ``psycopg.AsyncConnection`` for an async
        one. What the handler writes on it commits with the step's completion, or not at all.
        Do not commit, roll back or close it; savepoints (``conn.transaction()``) are fine.
        """
        if self._connection is None:
            raise InvalidArgument(
                f"step {self.node!r} is not transactional: declare "
                "@step(transactional=True) to get ctx.connection"
            )
        return self._connection

    def heartbeat(self) -> bool:
        """Extend the lease now; False when it is lost (stop working: the result is ignored)."""
        return self._heartbeat()

    # -- live events -------------------------------------------------------------------

    def emit(self, event: object) -> None:
        """Store ``event`` (any JSON value) as an event of this step, and wake followers.

        Stored at once in its own transaction (a transactional step's rollback keeps
        it), numbered after the run's earlier events. Raises
        :class:`~cyclone_dsl.errors.InvalidPayload` for a value that is not strict JSON,
        :class:`~cyclone_dsl.errors.PayloadTooLarge` over :data:`MAX_EVENT_BYTES`, and
        :class:`~cyclone_dsl.errors.EventLimitExceeded` past the step's cap (the worker's
        ``max_events_per_step``); nothing is stored then. It blocks for one short write:
        an async handler uses :meth:`emit_async`.
        """
        self._emit("event", _encoded(event, self.node))

    def progress(self, done: int, total: int, message: str | None = None) -> None:
        """Store a progress event: ``done`` of ``total`` units, with an optional message.

        ``done`` and ``total`` are integers with ``0 <= done <= total``, ``message`` a
        string or None (:class:`~cyclone_dsl.errors.InvalidArgument` otherwise); stored
        as ``{"done": done, "total": total, "message": message}`` like :meth:`emit`.
        """
        self._emit("progress", _progress_text(done, total, message, self.node))

    async def emit_async(self, event: object) -> None:
        """:meth:`emit` without blocking the event loop (the write runs on a thread)."""
        text = _encoded(event, self.node)
        await asyncio.to_thread(self._emit, "event", text)

    async def progress_async(self, done: int, total: int, message: str | None = None) -> None:
        """:meth:`progress` without blocking the event loop."""
        text = _progress_text(done, total, message, self.node)
        await asyncio.to_thread(self._emit, "progress", text)


def _encoded(event: object, node: str) -> str:
    return payload.encode(event, what=f"an event of step {node!r}", max_bytes=MAX_EVENT_BYTES)


def _progress_text(done: int, total: int, message: str | None, node: str) -> str:
    for name, value in (("done", done), ("total", total)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgument(f"progress {name} must be an integer >= 0, not {value!r}")
    if done > total:
        raise InvalidArgument(f"progress done ({done}) is more than total ({total})")
    if message is not None and not isinstance(message, str):
        raise InvalidArgument(f"progress message must be a string or None, not {message!r}")
    return _encoded({"done": done, "total": total, "message": message}, node)
