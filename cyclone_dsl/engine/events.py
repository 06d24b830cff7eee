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

from cyclone_dsl.db.tx import Tx
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


def record(
    tx: Tx,
    *,
    step_id: int,
    generation: int,
    attempt: int,
    kind: str,
    payload_text: str,
    cap: int,
    decided: bool = False,
) -> Recorded | None:
    """Store one event of the execution (``step_id``, ``generation``) and wake followers
    (the same statement sends the NOTIFY).

    None when the step no longer exists (its run was purged): there is nowhere to keep it.
    """
    if kind not in EVENT_KINDS:
        raise InvalidArgument(f"event kind must be one of {EVENT_KINDS}, not {kind!r}")
    if cap < 1:
        raise InvalidArgument(f"the event cap must be at least 1, not {cap}")
    row = tx.one(
        Q.record_event,
        step_id=step_id,
        generation=generation,
        attempt=attempt,
        kind=kind,
        payload=payload_text,
        decided=decided,
        cap=cap,
    )
    if row is None:
        return None
    if row["seq"] is None:
        raise EventLimitExceeded(row["run_id"], row["node"], cap)
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
