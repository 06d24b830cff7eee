"""Trace context carried with runs (extension 8), for a process that traces.

The engine knows nothing of OpenTelemetry: a :class:`TraceHook` (given to the
:class:`~cyclone_dsl.engine.Engine` by a client or worker built with ``tracing=``) turns
spans into W3C carriers (``traceparent``, ``tracestate``) and back. Without a hook the
engine reads and writes nothing here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar

from cyclone_dsl.db.tx import Row, Tx
from cyclone_dsl.sql import Q

log = logging.getLogger("cyclone.engine")
T = TypeVar("T")

#: A W3C trace context: ``traceparent`` and, when there is one, ``tracestate``.
Carrier = Mapping[str, str]


class TraceHook(Protocol):
    """What the engine asks of a process that traces (called inside its transactions)."""

    def current(self) -> Carrier | None:
        """The carrier of the span current in the caller (a submit's), or None."""

    def child_run(
        self, parent: Carrier, *, run_id: int, node: str, child_run_id: int, child_workflow: str
    ) -> Carrier | None:
        """A child run starts under node ``node`` of run ``run_id`` (whose trace context is
        ``parent``): the carrier the child run's steps are traced under."""

    def reclaimed(self, steps: Sequence[Row], contexts: Mapping[int, Carrier]) -> None:
        """These steps' leases expired and were taken back (``contexts``: by run id)."""


def _asked(what: str, call: Callable[[], T]) -> T | None:
    """A trace hook's answer, or None when it raised: it runs inside the engine's
    transactions, and tracing must never fail a submit, a completion or a scan."""
    try:
        return call()
    except Exception:
        log.exception("the trace hook failed (%s); the work goes on without it", what)
        return None


def record(tx: Tx, run_ids: Sequence[int], carrier: Carrier | None) -> None:
    """Carry ``carrier`` with these runs (nothing without one)."""
    if carrier is None or not run_ids or "traceparent" not in carrier:
        return
    tx.rows(
        Q.insert_trace_contexts,
        run_ids=list(run_ids),
        traceparent=carrier["traceparent"],
        tracestate=carrier.get("tracestate"),
    )


def read(tx: Tx, run_ids: Sequence[int]) -> dict[int, dict[str, str]]:
    """The trace context of each of these runs that has one."""
    if not run_ids:
        return {}
    found: dict[int, dict[str, str]] = {}
    for row in tx.rows(Q.trace_contexts_of, run_ids=sorted(set(run_ids))):
        carrier = {"traceparent": row["traceparent"]}
        if row["tracestate"]:
            carrier["tracestate"] = row["tracestate"]
        found[row["run_id"]] = carrier
    return found


def on_insert(
    tx: Tx, hook: TraceHook, run_id: int, workflow: str, parent: tuple[int, str] | None
) -> None:
    """A run was inserted: carry the submitter's trace context with it, or for a child run
    the context of its parent node's span (none when the parent run is not traced)."""
    if parent is None:
        record(tx, [run_id], _asked("a submit", hook.current))
        return
    parent_context = read(tx, [parent[0]]).get(parent[0])
    if parent_context is not None:
        carrier = _asked(
            "a child run",
            lambda: hook.child_run(
                parent_context,
                run_id=parent[0],
                node=parent[1],
                child_run_id=run_id,
                child_workflow=workflow,
            ),
        )
        record(tx, [run_id], carrier)


def on_insert_many(tx: Tx, hook: TraceHook, run_ids: Sequence[int]) -> None:
    """Runs of one bulk submit were inserted: carry the submitter's trace context."""
    record(tx, run_ids, _asked("a submit", hook.current))


def on_reclaim(tx: Tx, hook: TraceHook, rows: Sequence[Row]) -> None:
    if rows:
        contexts = read(tx, [r["run_id"] for r in rows])
        _asked("a reclaim", lambda: hook.reclaimed(rows, contexts))
