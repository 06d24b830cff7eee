"""The worker's observer seam: what metrics and tracing plug into.

A :class:`WorkerObserver` hears what a worker does with its steps. Every method is a
no-op here: an observer overrides the ones it needs. A worker given no observer calls
none of them (it checks once per call site), so observing costs nothing when unused.

Methods are called from the worker's threads (the fetch loop, handler threads, the event
loop, completers, the heartbeater, the listener, the scanner): they must be quick,
thread-safe and never raise.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from typing import Any

import attrs

from cyclone_dsl.engine import Claimed


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
    """Several observers as one, called in order."""

    def __init__(self, observers: Sequence[WorkerObserver]) -> None:
        self.observers = list(observers)

    def on_claimed(self, steps: Sequence[Claimed]) -> None:
        for o in self.observers:
            o.on_claimed(steps)

    def on_started(self, step: Claimed, claim_to_start_s: float) -> None:
        for o in self.observers:
            o.on_started(step, claim_to_start_s)

    def on_failure(self, step: Claimed, error_kind: str, error: str) -> None:
        for o in self.observers:
            o.on_failure(step, error_kind, error)

    def on_finished(self, step: Claimed, outcome: str, duration_s: float) -> None:
        for o in self.observers:
            o.on_finished(step, outcome, duration_s)

    def on_completed(self, step_ids: Collection[int]) -> None:
        for o in self.observers:
            o.on_completed(step_ids)

    def on_failed(self, step_ids: Collection[int], *, retried: bool) -> None:
        for o in self.observers:
            o.on_failed(step_ids, retried=retried)

    def on_fenced(self, step_ids: Collection[int]) -> None:
        for o in self.observers:
            o.on_fenced(step_ids)

    def on_released(self, step_ids: Collection[int]) -> None:
        for o in self.observers:
            o.on_released(step_ids)

    def on_runs_ended(self, runs: Sequence[EndedRun]) -> None:
        for o in self.observers:
            o.on_runs_ended(runs)

    def on_reclaimed(self, count: int) -> None:
        for o in self.observers:
            o.on_reclaimed(count)

    def on_listener(self, connected: bool) -> None:
        for o in self.observers:
            o.on_listener(connected)
