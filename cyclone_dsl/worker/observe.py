"""The worker's observer seam: what metrics and tracing plug into.

A :class:`WorkerObserver` hears what a worker does with its steps. Every method is a
no-op here: an observer overrides the ones it needs. A worker given no observer calls
none of them (it checks once per call site), so observing costs nothing when unused.

Methods are called from the worker's threads (the fetch loop, handler threads, the event
loop, completers, the heartbeater, the listener, the scanner): they must be quick and
thread-safe. One that raises is logged and skipped (see :class:`Observers`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from typing import Any

import attrs

from cyclone_dsl.engine import Claimed

log = logging.getLogger("cyclone.worker")


@attrs.frozen
class EndedRun:
    """A run that a worker's own outcome ended (committed)."""

    id: int
    workflow: str
    state: str  # completed, failed or cancelled
    created_at: datetime
    finished_at: datetime

    @property
    def duration_s(self) -> float:
        return (self.finished_at - self.created_at).total_seconds()

    @classmethod
    def from_row(cls, row: Mapping[str, Any], state: str) -> EndedRun:
        return cls(row["id"], row["workflow"], state, row["created_at"], row["finished_at"])


class WorkerObserver:
    """No-op observer; subclass and override what you need (see the module docstring).

    Outcomes of :meth:`on_finished`: ``returned`` (the handler returned a value that is
    recorded), ``failed`` (it raised, or its output could not be stored), ``timeout``,
    ``abandoned`` (decided elsewhere: cancelled, lease lost, or timed out meanwhile).
    """

    def on_claimed(self, steps: Sequence[Claimed]) -> None:
        """A claim leased these steps to this worker."""

    def on_started(self, step: Claimed, claim_to_start_s: float) -> None:
        """The step's handler starts (on the handler's own thread or task)."""

    def on_failure(self, step: Claimed, error_kind: str, error: str) -> None:
        """The attempt failed (``error_kind``: error, timeout, invalid_output, ...); its
        failure is about to be recorded (then :meth:`on_failed` or :meth:`on_fenced`)."""

    def on_finished(self, step: Claimed, outcome: str, duration_s: float) -> None:
        """The step's handler ended, ``duration_s`` after it started."""

    def on_completed(self, step_ids: Collection[int]) -> None:
        """These steps' completions committed."""

    def on_failed(self, step_ids: Collection[int], *, retried: bool) -> None:
        """These steps' failures committed: they will retry, or (``retried`` False) failed
        for good."""

    def on_fenced(self, step_ids: Collection[int]) -> None:
        """These steps' outcomes were refused or dropped: their lease was lost (reclaimed,
        cancelled, or their run ended) before the outcome was recorded."""

    def on_released(self, step_ids: Collection[int]) -> None:
        """These steps' leases were given back unfinished at shutdown."""

    def on_runs_ended(self, runs: Sequence[EndedRun]) -> None:
        """This worker's committed outcomes ended these runs."""

    def on_reclaimed(self, count: int) -> None:
        """This worker's scanner reclaimed ``count`` expired leases (of any worker)."""

    def on_listener(self, connected: bool) -> None:
        """The LISTEN connection came up or went down."""


class Observers(WorkerObserver):
    """Several observers as one, called in order.

    An observer that raises is logged (once per observer and method) and the others are
    still called: the worker calls observers on its outcome paths, where an exception
    would leave a step held or stop an internal thread.
    """

    def __init__(self, observers: Sequence[WorkerObserver]) -> None:
        self.observers = list(observers)
        self._reported: set[tuple[int, str]] = set()

    def _each(self, method: str, *args: Any, **kwargs: Any) -> None:
        for observer in self.observers:
            try:
                getattr(observer, method)(*args, **kwargs)
            except Exception:
                key = (id(observer), method)
                if key not in self._reported:  # a set's add is atomic under the GIL
                    self._reported.add(key)
                    log.exception(
                        "observer %s raised in %s (logged once; it is skipped each time)",
                        type(observer).__name__,
                        method,
                    )

    def on_claimed(self, steps: Sequence[Claimed]) -> None:
        self._each("on_claimed", steps)

    def on_started(self, step: Claimed, claim_to_start_s: float) -> None:
        self._each("on_started", step, claim_to_start_s)

    def on_failure(self, step: Claimed, error_kind: str, error: str) -> None:
        self._each("on_failure", step, error_kind, error)

    def on_finished(self, step: Claimed, outcome: str, duration_s: float) -> None:
        self._each("on_finished", step, outcome, duration_s)

    def on_completed(self, step_ids: Collection[int]) -> None:
        self._each("on_completed", step_ids)

    def on_failed(self, step_ids: Collection[int], *, retried: bool) -> None:
        self._each("on_failed", step_ids, retried=retried)

    def on_fenced(self, step_ids: Collection[int]) -> None:
        self._each("on_fenced", step_ids)

    def on_released(self, step_ids: Collection[int]) -> None:
        self._each("on_released", step_ids)

    def on_runs_ended(self, runs: Sequence[EndedRun]) -> None:
        self._each("on_runs_ended", runs)

    def on_reclaimed(self, count: int) -> None:
        self._each("on_reclaimed", count)

    def on_listener(self, connected: bool) -> None:
        self._each("on_listener", connected)
