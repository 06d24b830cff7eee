"""Storing handlers' events in batches: the events of a worker's handlers that emit at the
same moment are written by one statement, in one transaction.

Each ``ctx.emit`` still returns once its own event is committed, or raises its own error.
The first caller with nothing being written writes the queue (its own event included);
callers that come meanwhile queue theirs and wait. When a batch is written, the oldest
event still queued is woken to write the next batch (its own included): every handler
writes at most one batch, and a lone emitter writes its own event at once, with no
hand-over to another thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import attrs

from cyclone_dsl.db.errors import own_copy
from cyclone_dsl.engine import NewEvent, Outcome, Recorded
from cyclone_dsl.errors import EventLimitExceeded

#: At most this many events per batch...
MAX_BATCH_EVENTS = 500
#: ...and about this many bytes of payload (one event is written whatever its size).
MAX_BATCH_BYTES = 1 << 20

Write = Callable[[Sequence[NewEvent]], list[Outcome]]


@attrs.define(eq=False)
class _Pending:
    event: NewEvent
    woken: threading.Event = attrs.Factory(threading.Event)
    #: Set (under the batcher's lock) when this caller is to write the next batch.
    leads: bool = False
    written: bool = False
    outcome: Outcome = None
    error: BaseException | None = None


class EventBatcher:
    """Writes events with ``write`` (one statement for a batch), from any number of threads."""

    def __init__(self, write: Write) -> None:
        self._write = write
        self._lock = threading.Lock()
        self._queue: list[_Pending] = []
        self._writing = False

    def record(self, event: NewEvent) -> Recorded | None:
        """Store ``event`` (blocks until it is committed); its seq and fence, or None when
        its step no longer exists. Raises :class:`EventLimitExceeded` past the cap, or the
        error that failed its batch."""
        pending = _Pending(event)
        with self._lock:
            self._queue.append(pending)
            if not self._writing:
                self._writing = pending.leads = True
        while True:
            if pending.leads:
                self._write_batch()
            if pending.written:
                break
            pending.woken.wait()
        if pending.error is not None:
            raise pending.error
        if isinstance(pending.outcome, EventLimitExceeded):
            raise pending.outcome
        return pending.outcome

    def _write_batch(self) -> None:
        """Write the oldest queued events (the caller's among them), then hand the writing
        to the oldest event left, if any (whatever happened: a caller never waits on a
        writer that is gone)."""
        with self._lock:
            batch = _take(self._queue)
        outcomes: list[Outcome] | None = None
        failure: Exception = RuntimeError("the batch of events was interrupted")
        try:
            outcomes = self._write([p.event for p in batch])
        except Exception as exc:  # noqa: BLE001 - each caller raises it (a copy each)
            failure = exc
        finally:
            if outcomes is not None and len(outcomes) == len(batch):
                for pending, outcome in zip(batch, outcomes, strict=True):
                    pending.outcome = outcome
            else:
                for pending in batch:
                    pending.error = own_copy(failure)
            self._hand_over(batch)

    def _hand_over(self, batch: list[_Pending]) -> None:
        with self._lock:
            for pending in batch:
                pending.written, pending.leads = True, False
            following = self._queue[0] if self._queue else None
            if following is None:
                self._writing = False
            else:
                following.leads = True
        for pending in batch:
            pending.woken.set()
        if following is not None:
            following.woken.set()


def _take(queue: list[_Pending]) -> list[_Pending]:
    """The oldest events of ``queue`` that make a batch (at least one), taken out of it."""
    size = 0
    count = 0
    for pending in queue:
        size += len(pending.event.payload_text)
        count += 1
        if count >= MAX_BATCH_EVENTS or size >= MAX_BATCH_BYTES:
            break
    batch = queue[:count]
    del queue[:count]
    return batch
