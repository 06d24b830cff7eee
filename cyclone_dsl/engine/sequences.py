"""Sequence keys: standalone steps of one key run one at a time, in (scheduled_at, id)
order (the claim checks it). A step of a key that stops running (it completes, fails, is
cancelled, or its lease is reclaimed) frees the next one with no write of its own, so its
queue's claimers are woken here: the next step may wait in another queue, or be of a kind
the freeing worker does not serve."""

from __future__ import annotations

from collections.abc import Iterable

from cyclone_dsl.db.tx import Row, Tx
from cyclone_dsl.engine import notify
from cyclone_dsl.sql import Q


def wake_next(tx: Tx, stopped: Iterable[Row]) -> None:
    """These steps (rows with ``sequence_key`` and ``queue``) stopped running or left their
    key's order: wake the queue of each key's next available step, and their own queues.
    A next step enqueued while this transaction commits is not seen here (it did not exist
    yet), and its own wake-up found this step still running: it is woken by its queue's
    wake-up at this commit, when it waits in the same queue."""
    sequenced = [r for r in stopped if r.get("sequence_key") is not None]
    if sequenced:
        keys = sorted({r["sequence_key"] for r in sequenced})
        rows = tx.rows(Q.queues_next_in_sequences, keys=keys)
        notify.wake_queues(tx, [*(r["queue"] for r in rows), *(r["queue"] for r in sequenced)])
