"""The context a handler receives when it declares a ``ctx`` parameter."""

from __future__ import annotations

import threading
from collections.abc import Callable

import attrs


@attrs.define
class StepContext:
    """What a running handler may know and do.

    ``idempotency_key`` is stable across retries and reclaims of the same
    step (``"<run_id>:<node>"``): pass it to external systems so that a
    re-executed handler does not repeat an effect.
    """

    run_id: int
    node: str
    step_id: int
    attempt: int
    kind: str
    item_index: int | None
    _cancelled: threading.Event = attrs.field(factory=threading.Event, alias="cancelled_event")
    _heartbeat: Callable[[], bool] = attrs.field(default=lambda: True, alias="heartbeat_fn")

    @property
    def idempotency_key(self) -> str:
        return f"{self.run_id}:{self.node}"

    @property
    def cancelled(self) -> bool:
        """True once the step's lease is lost, its run cancelled, or its timeout passed."""
        return self._cancelled.is_set()

    def heartbeat(self) -> bool:
        """Extend the lease now; False when it is lost (stop working: the result is ignored)."""
        return self._heartbeat()
