"""NOTIFY wake-ups, sent inside the transaction so they arrive only if it commits."""

from __future__ import annotations

from collections.abc import Iterable

from cyclone_dsl.db.tx import Tx
from cyclone_dsl.sql import Q

WORK_CHANNEL = "cyclone_work"
RUN_DONE_CHANNEL = "cyclone_run_done"


def wake_queues(tx: Tx, queues: Iterable[str]) -> None:
    distinct = sorted(set(queues))
    if distinct:
        tx.rows(Q.notify_queues, queues=distinct)


#: NOTIFY payloads must stay under 8,000 bytes: ids are sent in chunks well below that.
IDS_PER_NOTIFICATION = 300


def runs_finished(tx: Tx, run_ids: Iterable[int]) -> None:
    """One notification per chunk of ended runs (not one per run: NOTIFY costs at commit)."""
    distinct = sorted(set(run_ids))
    if distinct:
        chunks = [
            ",".join(map(str, distinct[i : i + IDS_PER_NOTIFICATION]))
            for i in range(0, len(distinct), IDS_PER_NOTIFICATION)
        ]
        tx.rows(Q.notify_runs_finished, payloads=chunks)


def names_run(payload: str, run_id: int) -> bool:
    """Whether a ``cyclone_run_done`` payload includes ``run_id``."""
    return str(run_id) in payload.split(",")
