"""The context a handler receives when it declares a ``ctx`` parameter."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any

import attrs

from cyclone_dsl.errors import InvalidArgument


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
    _connection: Any = attrs.field(default=None, alias="connection")
    _cancelled: threading.Event = attrs.field(factory=threading.Event, alias="cancelled_event")
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
