"""NOTIFY wake-ups, sent inside the transaction so they arrive only if it commits (or,
through :class:`AfterCommit`, right after it commits)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable
from typing import LiteralString

from cyclone_dsl.db.tx import Row, Tx
from cyclone_dsl.sql import Q

_RUN_ID = re.compile(r"[0-9]{1,19}")

WORK_CHANNEL = "cyclone_work"
RUN_DONE_CHANNEL = "cyclone_run_done"
CANCEL_CHANNEL = "cyclone_cancel"
#: Step events (payload: the run id); sent by the statement that stores the event.
EVENTS_CHANNEL = "cyclone_events"


class AfterCommit:
    """A transaction whose notifications are held, to be sent once it has committed.

    A transaction that sends NOTIFY takes a database-wide lock at commit and holds it
    through the commit's disk flush: such transactions commit one at a time. That is cheap
    for the worker's batched completions, not for one transaction per step (a
    transactional handler's). Its notifications are sent by :meth:`send` after the
    commit, in a statement that writes nothing; were the process to die between the two,
    they would be lost, and every listener also polls.
    """

    def __init__(self, tx: Tx) -> None:
        self._tx = tx
        self._held: list[tuple[LiteralString, dict[str, object]]] = []

    def rows(self, query: LiteralString, **params: object) -> list[Row]:
        return self._tx.rows(query, **params)

    def one(self, query: LiteralString, **params: object) -> Row | None:
        return self._tx.one(query, **params)

    def run(self, query: LiteralString, **params: object) -> int:
        return self._tx.run(query, **params)

    def savepoint(self) -> contextlib.AbstractContextManager[None]:
        return self._tx.savepoint()

    @property
    def commits_each_statement(self) -> bool:
        return self._tx.commits_each_statement

    def hold(self, query: LiteralString, params: dict[str, object]) -> None:
        self._held.append((query, params))

    def send(self, tx: Tx) -> None:
        """Send the held notifications on ``tx`` (after the commit)."""
        held, self._held = self._held, []
        for query, params in held:
            tx.rows(query, **params)


class Coalesced(AfterCommit):
    """A transaction whose notifications are held, then sent merged by :meth:`flush`, in
    the same transaction: one statement per channel for a batch of transitions (a bulk
    operation's page) instead of one or two per run. Listeners see the same thing: the
    same queues woken, the same run ids, delivered at the commit."""

    def flush(self) -> None:
        held, self._held = self._held, []
        queues: set[str] = set()
        finished: set[int] = set()
        cancelled: set[int] = set()
        for query, params in held:
            if query == Q.notify_queues:
                queues.update(_texts(params["queues"]))
            elif query == Q.notify_runs_finished:
                finished.update(*(run_ids_of(p) for p in _texts(params["payloads"])))
            elif query == Q.notify_steps_cancelled:
                cancelled.update(*(run_ids_of(p) for p in _texts(params["payloads"])))
            else:
                self._tx.rows(query, **params)
        wake_queues(self._tx, queues)
        runs_finished(self._tx, finished)
        steps_cancelled(self._tx, cancelled)


def _texts(value: object) -> list[str]:
    assert isinstance(value, list)
    return [str(v) for v in value]


def _notify(tx: Tx, query: LiteralString, **params: object) -> None:
    if isinstance(tx, AfterCommit):
        tx.hold(query, params)
    else:
        tx.rows(query, **params)


def wake_queues(tx: Tx, queues: Iterable[str]) -> None:
    distinct = sorted(set(queues))
    if distinct:
        _notify(tx, Q.notify_queues, queues=distinct)


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
        _notify(tx, Q.notify_runs_finished, payloads=chunks)


def steps_cancelled(tx: Tx, run_ids: Iterable[int]) -> None:
    """Running steps of these runs were cancelled: their workers stop them at once."""
    chunks = _chunks(run_ids)
    if chunks:
        _notify(tx, Q.notify_steps_cancelled, payloads=chunks)


def run_ids_of(payload: str) -> set[int]:
    """The run ids of a ``cyclone_run_done`` or ``cyclone_cancel`` payload; anything else in
    it is ignored (any role that may connect can NOTIFY, and ``"²".isdigit()`` is true)."""
    return {int(part) for part in payload.split(",") if _RUN_ID.fullmatch(part.strip())}


def names_run(payload: str, run_id: int) -> bool:
    """Whether a ``cyclone_run_done`` payload includes ``run_id``."""
    return str(run_id) in payload.split(",")
