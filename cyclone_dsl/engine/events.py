"""Step events: what a running handler reports (``ctx.emit``, ``ctx.progress``).

Each event is one row of ``cyclone_ext_events``, numbered per run (``seq``) in commit
order, and announced on :data:`~cyclone_dsl.engine.notify.EVENTS_CHANNEL` so that
followers wake up at once (they read by ``seq``, so a lost notification only delays
them).

An event is written by one execution of its step: a claim, known by its lease
generation. The write is not refused when that claim no longer holds the lease (a
handler that goes on after its lease was lost): the event is kept and stored *fenced*.
A reclaim or a release marks the events of the claim it ends fenced too, since the step
runs again. So ``fenced`` means "this execution's work may be repeated by another".

A step stores at most ``cap`` events, across all its attempts; past it,
:class:`~cyclone_dsl.errors.EventLimitExceeded` and nothing is stored.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from cyclone_dsl.db.tx import Row, Tx
from cyclone_dsl.errors import EventLimitExceeded, InvalidArgument
from cyclone_dsl.sql import Q

#: ``ctx.emit`` stores kind ``event``, ``ctx.progress`` kind ``progress``.
EVENT_KINDS = ("event", "progress")

#: How many events one step may store, across its attempts (``Worker(max_events_per_step=)``).
DEFAULT_MAX_EVENTS_PER_STEP = 10_000


@attrs.frozen
class Recorded:
    """A stored event: its number in the run, and whether it was stored fenced."""

    seq: int
    fenced: bool


@attrs.frozen
class NewEvent:
    """An event an execution (``step_id``, ``generation``) reports; ``decided``: the worker
    has decided the execution's end already (it is stored fenced)."""

    step_id: int
    generation: int
    attempt: int
    kind: str
    payload_text: str
    decided: bool = False


#: What storing one event gave: its number and fence, the cap it hit (nothing stored), or
#: None when its step no longer exists (its run was purged: there is nowhere to keep it).
Outcome = Recorded | EventLimitExceeded | None


def record_many(tx: Tx, events: Sequence[NewEvent], *, cap: int) -> list[Outcome]:
    """Store the events, in order, in one statement (which also wakes the runs' followers
    with a NOTIFY); one outcome per event, in the same order."""
    for event in events:
        if event.kind not in EVENT_KINDS:
            raise InvalidArgument(f"event kind must be one of {EVENT_KINDS}, not {event.kind!r}")
    if cap < 1:
        raise InvalidArgument(f"the event cap must be at least 1, not {cap}")
    if not events:
        return []
    if len(events) == 1:  # the common case, at half the cost of a batch's statement
        (event,) = events
        rows = tx.rows(
            Q.record_event,
            step_id=event.step_id,
            generation=event.generation,
            attempt=event.attempt,
            kind=event.kind,
            payload=event.payload_text,
            decided=event.decided,
            cap=cap,
        )
        return [_outcome(rows[0], cap) if rows else None]
    rows = tx.rows(
        Q.record_events,
        step_ids=[e.step_id for e in events],
        generations=[e.generation for e in events],
        attempts=[e.attempt for e in events],
        kinds=[e.kind for e in events],
        payloads=[e.payload_text for e in events],
        decided=[e.decided for e in events],
        cap=cap,
    )
    return [_outcome(row, cap) for row in rows]  # one per event, in order (by ord)


def _outcome(row: Row, cap: int) -> Outcome:
    if row["run_id"] is None:
        return None
    if row["seq"] is None:
        return EventLimitExceeded(row["run_id"], row["node"], cap)
    return Recorded(row["seq"], row["fenced"])


def fence(tx: Tx, leases: Sequence[tuple[int, int]]) -> None:
    """Mark the events of these executions (step id, lease generation) fenced: their
    lease was taken back and the step runs again. Call it after the step update, in a
    statement of its own (see ``fence_events``)."""
    if leases:
        tx.run(
            Q.fence_events,
            ids=[step_id for step_id, _ in leases],
            generations=[generation for _, generation in leases],
        )
