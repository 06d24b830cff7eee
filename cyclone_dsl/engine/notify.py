"""NOTIFY wake-ups, sent inside the transaction so they arrive only if it commits."""

from __future__ import annotations

from collections.abc import Iterable

from cyclone_dsl.db.tx import Tx
from cyclone_dsl.sql import Q

WORK_CHANNEL = "cyclone_work"
RUN_DONE_CHANNEL = "cyclone_run_done"
CANCEL_CHANNEL = "cyclone_cancel"


def wake_queues(tx: Tx, queues: Iterable[str]) -> None:
    distinct = sorted(set(queues))
    if distinct:
        tx.rows(Q.notify_queues, queues=distinct)


#: NOTIFY payloads must stay under 8,000 bytes: ids are sent in chunks well below that.
IDS_PER_NOTIFICATION = 300


def _chunks(run_ids: Iterable[int]) -> list[str]:
    distinct = sorted(set(run_ids))
    return [
        ",".join(map(str, distinct[i : i + IDS_PER_NOTIFICATION]))
        for i in range(0, len(distinct), IDS_PER_NOTIFICATION)
    ]


def runs_finished(tx: Tx, run_ids: Iterable[int]) -> None:
    """One notification per chunk of ended runs (not one per run: NOTIFY costs at commit)."""
    chunks = _chunks(run_ids)
    if chunks:
        tx.rows(Q.notify_runs_finished, payloads=chunks)


def steps_cancelled(tx: Tx, run_ids: Iterable[int]) -> None:
    """Running steps of these runs were cancelled: their workers stop them at once."""
    chunks = _chunks(run_ids)
    if chunks:
        tx.rows(Q.notify_steps_cancelled, payloads=chunks)


def run_ids_of(payload: str) -> set[int]:
    """The run ids of a ``cyclone_run_done`` or ``cyclone_cancel`` payload."""
    return {int(part) for part in payload.split(",") if part.strip().isdigit()}


def names_run(payload: str, run_id: int) -> bool:
    """Whether a ``cyclone_run_done`` payload includes ``run_id``."""
    return str(run_id) in payload.split(",")
