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


def runs_finished(tx: Tx, run_ids: Iterable[int]) -> None:
    distinct = sorted(set(run_ids))
    if distinct:
        tx.rows(Q.notify_runs_finished, run_ids=distinct)
