"""OpenTelemetry traces (the ``otel`` extra: ``opentelemetry-api`` only).

``Client(dsn, tracing=True)`` and ``Worker(dsn, [flows], tracing=True)`` turn them on (or
``tracing=provider`` for a :class:`~opentelemetry.trace.TracerProvider` other than the
global one). A submit is a span; its W3C trace context (``traceparent``, ``tracestate``)
is written with the run in the submit transaction; each step attempt is a span under it,
on whichever worker runs it (see :mod:`cyclone_dsl.observability.step_spans`). This module
is imported only when tracing is asked for: ``import cyclone_dsl`` does not import
OpenTelemetry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from typing import TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from cyclone_dsl._version import __version__
from cyclone_dsl.db.tx import Row
from cyclone_dsl.engine import Carrier

log = logging.getLogger("cyclone.tracing")
T = TypeVar("T")

#: The instrumentation scope of Cyclone's spans.
TRACER_NAME = "cyclone_dsl"

#: Attribute names (the ``cyclone.`` prefix).
RUN_ID = "cyclone.run_id"
RUN_IDS = "cyclone.run_ids"
STEP_ID = "cyclone.step_id"
WORKFLOW = "cyclone.workflow"
NODE = "cyclone.node"
KIND = "cyclone.kind"
ATTEMPT = "cyclone.attempt"
MAX_ATTEMPTS = "cyclone.max_attempts"
QUEUE = "cyclone.queue"
DEF_VERSION = "cyclone.def_version"
ITEM_INDEX = "cyclone.item_index"
WORKER = "cyclone.worker"
OUTCOME = "cyclone.outcome"
ERROR_KIND = "cyclone.error_kind"
CHILD_RUN_ID = "cyclone.child_run_id"
CHILD_WORKFLOW = "cyclone.child_workflow"

_PROPAGATOR = TraceContextTextMapPropagator()


def carrier_of(ctx: otel_context.Context | None = None) -> dict[str, str] | None:
    """The W3C carrier of ``ctx`` (default: the current context), or None without a span."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier if "traceparent" in carrier else None


def context_of(carrier: Carrier | None) -> otel_context.Context | None:
    """The context a stored carrier describes (None: start a new trace)."""
    if carrier is None:
        return None
    return _PROPAGATOR.extract(dict(carrier))


def ns(moment: datetime | None) -> int | None:
    """A database timestamp as an OpenTelemetry time (ns since the epoch)."""
    return None if moment is None else int(moment.timestamp() * 1_000_000_000)


def _exit_quietly(
    manager: AbstractContextManager[trace.Span], exc: BaseException | None, operation: str
) -> None:
    try:
        if exc is None:
            manager.__exit__(None, None, None)
        else:
            manager.__exit__(type(exc), exc, exc.__traceback__)
    except Exception:
        log.exception("could not end the span of a %s (the %s is done)", operation, operation)


class Tracing:
    """Cyclone's spans for one tracer provider, and the engine's trace hook
    (:class:`~cyclone_dsl.engine.TraceHook`): submits, child runs, reclaimed attempts."""

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self.tracer = trace.get_tracer(TRACER_NAME, __version__, tracer_provider=tracer_provider)

    # -- submits (the client) ------------------------------------------------------------

    def around(
        self,
        operation: str,
        workflow: str,
        write: Callable[[], T],
        runs_of: Callable[[T], Sequence[int]],
    ) -> T:
        """Run a submit's ``write`` in its span. The span never changes the write's outcome:
        one that cannot start (a span processor's error) is logged and the write goes on
        untraced; one that cannot end is logged, and the committed write returns."""
        try:
            manager = self.span(operation, workflow)
            span = manager.__enter__()
        except Exception:
            log.exception("could not start the span of a %s; it goes on untraced", operation)
            return write()
        try:
            result = write()
        except BaseException as exc:
            _exit_quietly(manager, exc, operation)
            raise
        try:
            self.note_runs(span, runs_of(result))
        except Exception:
            log.exception("could not name the runs on the span of a %s", operation)
        _exit_quietly(manager, None, operation)
        return result

    def span(self, operation: str, workflow: str) -> AbstractContextManager[trace.Span]:
        """A current span ``cyclone.<operation> <workflow>`` around a submit."""
        return self.tracer.start_as_current_span(
            f"cyclone.{operation} {workflow}",
            kind=SpanKind.PRODUCER,
            attributes={WORKFLOW: workflow},
        )

    @staticmethod
    def note_runs(span: trace.Span, run_ids: Sequence[int]) -> None:
        """Name the runs a submit made (or found) on its span."""
        if len(run_ids) == 1:
            span.set_attribute(RUN_ID, run_ids[0])
        else:
            span.set_attribute(RUN_IDS, list(run_ids))

    # -- the engine's hook ---------------------------------------------------------------

    def current(self) -> Carrier | None:
        return carrier_of()

    def child_run(
        self, parent: Carrier, *, run_id: int, node: str, child_run_id: int, child_workflow: str
    ) -> Carrier | None:
        """The child node's span: it starts the child run, whose steps nest under it (like
        a submit's span, it ends once the child run is written)."""
        span = self.tracer.start_span(
            f"cyclone.child {node}",
            context=context_of(parent),
            kind=SpanKind.PRODUCER,
            attributes={
                RUN_ID: run_id,
                NODE: node,
                KIND: "child",
                CHILD_RUN_ID: child_run_id,
                CHILD_WORKFLOW: child_workflow,
            },
        )
        try:
            return carrier_of(trace.set_span_in_context(span))
        finally:
            span.end()

    def reclaimed(self, steps: Sequence[Row], contexts: Mapping[int, Carrier]) -> None:
        """A lost attempt (its worker died with its span): the reclaiming scanner records
        it, from the lease's start to now, with a ``cyclone.reclaimed`` event."""
        for row in steps:
            attributes: dict[str, str | int] = {
                RUN_ID: row["run_id"],
                STEP_ID: row["id"],
                WORKFLOW: row["workflow"],
                NODE: row["node"],
                KIND: row["kind"],
                QUEUE: row["queue"],
                ATTEMPT: row["attempt"] + 1,
                MAX_ATTEMPTS: row["max_attempts"],
                DEF_VERSION: row["def_version"],
                WORKER: row["worker"] or "",
                OUTCOME: "reclaimed",
                ERROR_KIND: "reclaimed",
            }
            if row["item_index"] is not None:
                attributes[ITEM_INDEX] = row["item_index"]
            span = self.tracer.start_span(
                f"cyclone.step {row['node']}",
                context=context_of(contexts.get(row["run_id"])),
                kind=SpanKind.CONSUMER,
                start_time=ns(row.get("started_at")),
                attributes=attributes,
            )
            span.add_event(
                "cyclone.reclaimed",
                {WORKER: row["worker"] or "", "cyclone.next_state": row["state"]},
            )
            span.set_status(
                Status(StatusCode.ERROR, "the lease expired: its worker crashed or stalled")
            )
            span.end()


def tracing_of(option: object) -> Tracing | None:
    """``tracing=`` of a client: False/None (off), True (the global provider) or a
    TracerProvider."""
    if option is None or option is False:
        return None
    return Tracing(None if option is True else option)  # type: ignore[arg-type]
