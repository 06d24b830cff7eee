"""Step attempts as OpenTelemetry spans: the worker's tracing observer (``otel`` extra).

``Worker(..., tracing=True)`` adds a :class:`TracingObserver`. Each claimed step attempt is
a span ``cyclone.step <node>`` whose parent is its run's stored trace context (the submit's
span, or for a child run its parent node's span); a step of a run submitted without
tracing starts a trace of its own. The span is current while the handler runs (its own
spans nest under it), and ends once the handler has returned and its outcome is recorded:
a retry, a fenced outcome or a lease given back at shutdown is an event of it.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping, Sequence

import attrs
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from cyclone_dsl.engine import Carrier, Claimed
from cyclone_dsl.observability import tracing as t
from cyclone_dsl.worker.observe import WorkerObserver


@attrs.define
class _Open:
    span: Span
    generation: int
    finished: bool = False  # the handler has returned (or never started)
    recorded: bool = False  # the outcome is committed, fenced, or the lease given back
    outcome: str | None = None


class TracingObserver(t.Tracing, WorkerObserver):
    """Spans of step attempts, for ``tracer_provider`` (None: the global one)."""

    def __init__(
        self, tracer_provider: trace.TracerProvider | None = None, *, worker_id: str = ""
    ) -> None:
        super().__init__(tracer_provider)
        self.worker_id = worker_id
        self._open: dict[int, _Open] = {}
        # Attempts superseded by a new claim of their step here before their outcome was
        # recorded, by step id: that outcome can only be a fence (their lease is gone), and
        # it must not land on the new attempt's span (the settle events name step ids).
        self._superseded: dict[int, int] = {}
        self._lock = threading.Lock()

    def start_attempts(self, steps: Sequence[Claimed], contexts: Mapping[int, Carrier]) -> None:
        """Open a span per claimed step, under its run's trace context."""
        for step in steps:
            attributes: dict[str, str | int] = {
                t.RUN_ID: step.run_id,
                t.STEP_ID: step.id,
                t.WORKFLOW: step.workflow,
                t.NODE: step.node,
                t.KIND: step.kind,
                t.ATTEMPT: step.attempt + 1,
                t.MAX_ATTEMPTS: step.max_attempts,
                t.QUEUE: step.queue,
                t.DEF_VERSION: step.def_version,
                t.WORKER: self.worker_id,
            }
            if step.item_index is not None:
                attributes[t.ITEM_INDEX] = step.item_index
            span = self.tracer.start_span(
                f"cyclone.step {step.node}",
                context=t.context_of(contexts.get(step.run_id)),
                kind=SpanKind.CONSUMER,
                attributes=attributes,
            )
            with self._lock:
                stale = self._open.pop(step.id, None)
                self._open[step.id] = _Open(span, step.generation)
                if stale is not None and not stale.recorded:
                    self._superseded[step.id] = self._superseded.get(step.id, 0) + 1
            if stale is not None:  # reclaimed and claimed here again: the old one is over
                stale.span.add_event("cyclone.superseded")
                stale.span.end()

    def _entry(self, step_id: int, generation: int | None = None) -> _Open | None:
        entry = self._open.get(step_id)
        if entry is None or (generation is not None and entry.generation != generation):
            return None
        return entry

    def _settle(self, entry: _Open, step_id: int, *, finished: bool, recorded: bool) -> None:
        """End the span once both the handler returned and the outcome is recorded."""
        with self._lock:
            entry.finished |= finished
            entry.recorded |= recorded
            done = entry.finished and entry.recorded
            if done and self._open.get(step_id) is entry:
                del self._open[step_id]
        if done:
            entry.span.set_attribute(t.OUTCOME, entry.outcome or "abandoned")
            entry.span.end()

    # -- the observer seam -------------------------------------------------------------

    def on_started(self, step: Claimed, claim_to_start_s: float) -> None:
        entry = self._entry(step.id, step.generation)
        # Not detached: an async handler's task and a transactional handler run in a context
        # of their own, and a sync handler's thread makes the next step's span current
        # before its handler runs; an attempt without a span (its start failed) makes none
        # current, so that its handler's spans do not nest under the previous step's.
        span = entry.span if entry is not None else trace.INVALID_SPAN
        otel_context.attach(trace.set_span_in_context(span))

    def on_failure(self, step: Claimed, error_kind: str, error: str) -> None:
        entry = self._entry(step.id, step.generation)
        if entry is None:
            return
        if entry.outcome is None and error_kind == "timeout":
            entry.outcome = "timeout"
        entry.span.set_attribute(t.ERROR_KIND, error_kind)
        entry.span.set_status(Status(StatusCode.ERROR, error[:500]))

    def on_finished(self, step: Claimed, outcome: str, duration_s: float) -> None:
        entry = self._entry(step.id, step.generation)
        if entry is None:
            return
        if entry.outcome is None:
            entry.outcome = outcome
        self._settle(entry, step.id, finished=True, recorded=False)

    def _record(self, step_ids: Collection[int], event: str | None, **attributes: str) -> None:
        for step_id in step_ids:
            entry = self._entry(step_id)
            if entry is None:
                continue
            if event is not None:
                entry.span.add_event(event, attributes)
            self._settle(entry, step_id, finished=False, recorded=True)

    def on_completed(self, step_ids: Collection[int]) -> None:
        self._record(step_ids, None)

    def on_failed(self, step_ids: Collection[int], *, retried: bool) -> None:
        self._record(step_ids, "cyclone.retry" if retried else "cyclone.failed")

    def on_fenced(self, step_ids: Collection[int]) -> None:
        current = []
        for step_id in step_ids:
            with self._lock:
                left = self._superseded.get(step_id, 0)
                if left:
                    if left == 1:
                        del self._superseded[step_id]
                    else:
                        self._superseded[step_id] = left - 1
                    continue  # a superseded attempt's fence: its span already ended
            current.append(step_id)
        self._record(current, "cyclone.fenced")

    def on_released(self, step_ids: Collection[int]) -> None:
        self._record(step_ids, "cyclone.released")


def tracing_observer(option: object, worker_id: str) -> TracingObserver | None:
    """``tracing=`` of a worker: False/None (off), True (the global provider) or a
    TracerProvider."""
    if option is None or option is False:
        return None
    provider = None if option is True else option
    return TracingObserver(provider, worker_id=worker_id)  # type: ignore[arg-type]
