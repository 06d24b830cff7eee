"""Prometheus metrics (the ``metrics`` extra): a worker's, and the database-wide gauges.

Imported only when metrics are asked for (``Worker(metrics_port=)``, ``cyclone worker
--metrics-port``, the dashboard's ``/metrics``): importing :mod:`cyclone_dsl` does not
import ``prometheus_client``. Each worker has a registry of its own, so that several
workers of one process serve their own figures.

Labels are bounded: ``queue`` and ``kind`` for steps, ``workflow`` and ``state`` for
runs; never a run or step id.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from cyclone_dsl.engine import Claimed
from cyclone_dsl.worker.observe import EndedRun, WorkerObserver

log = logging.getLogger("cyclone.metrics")

STEP_LABELS = ("queue", "kind")
#: Claim-to-start latency: a worker normally starts a claimed step within milliseconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: Handler and run durations: from milliseconds to hours.
DURATION_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    900.0,
    3600.0,
    4 * 3600.0,
)
#: How long the database-wide gauges are reused between scrapes.
DATABASE_GAUGES_TTL_S = 5.0


def new_registry() -> CollectorRegistry:
    """A registry of its own (not the process-wide default)."""
    return CollectorRegistry(auto_describe=True)


class _StepSeries:
    """The series of one (queue, kind), looked up once."""

    __slots__ = ("claim_to_start", "claimed", "completed", "failed", "fenced", "handler", "retried")

    def __init__(self, metrics: WorkerMetrics, queue: str, kind: str) -> None:
        self.claimed = metrics.claimed.labels(queue, kind)
        self.completed = metrics.completed.labels(queue, kind)
        self.failed = metrics.failed.labels(queue, kind)
        self.retried = metrics.retried.labels(queue, kind)
        self.fenced = metrics.fenced.labels(queue, kind)
        self.claim_to_start = metrics.claim_to_start.labels(queue, kind)
        self.handler = metrics.handler.labels(queue, kind)


class WorkerMetrics(WorkerObserver):
    """A worker's metrics, fed through the observer seam."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        slots_in_use: Callable[[], int],
        slots: Callable[[], int],
    ) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, STEP_LABELS, registry=registry)

        self.claimed = counter("cyclone_steps_claimed", "Steps this worker claimed.")
        self.completed = counter("cyclone_steps_completed", "Step completions committed.")
        self.failed = counter("cyclone_steps_failed", "Step failures committed for good.")
        self.retried = counter(
            "cyclone_steps_retried", "Step failures committed with a retry to come."
        )
        self.fenced = counter(
            "cyclone_steps_fenced",
            "Step outcomes dropped: the lease was lost (reclaimed, cancelled, run ended).",
        )
        self.reclaimed = Counter(
            "cyclone_leases_reclaimed",
            "Expired leases (of any worker) this worker's scanner reclaimed.",
            registry=registry,
        )
        self.claim_to_start = Histogram(
            "cyclone_step_claim_to_start_seconds",
            "From the claim to the handler's start.",
            STEP_LABELS,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.handler = Histogram(
            "cyclone_step_handler_seconds",
            "How long handlers ran.",
            STEP_LABELS,
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.run_duration = Histogram(
            "cyclone_run_duration_seconds",
            "From submit to end, of the runs this worker's outcomes ended.",
            ("workflow", "state"),
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        in_use = Gauge("cyclone_worker_slots_in_use", "Handler slots taken now.", registry=registry)
        in_use.set_function(lambda: float(slots_in_use()))
        Gauge(
            "cyclone_worker_slots",
            "Handler slots: the concurrency limit now (it moves when adaptive).",
            registry=registry,
        ).set_function(lambda: float(slots()))
        self.listener = Gauge(
            "cyclone_worker_listener_connected",
            "1 while the LISTEN connection is up.",
            registry=registry,
        )
        self._series: dict[tuple[str, str], _StepSeries] = {}
        self._series_lock = threading.Lock()
        # Claimed and not yet settled, by step id: one series per attempt held. A step
        # reclaimed and claimed here again is held twice until its first attempt is fenced,
        # and the settle events name step ids only; both attempts count in the same series.
        self._steps: dict[int, list[_StepSeries]] = {}
        self._steps_lock = threading.Lock()

    def _of(self, queue: str, kind: str) -> _StepSeries:
        series = self._series.get((queue, kind))
        if series is None:
            with self._series_lock:
                series = self._series.get((queue, kind))
                if series is None:
                    series = self._series[(queue, kind)] = _StepSeries(self, queue, kind)
        return series

    def on_claimed(self, steps: Sequence[Claimed]) -> None:
        for step in steps:
            series = self._of(step.queue, step.kind)
            with self._steps_lock:
                self._steps.setdefault(step.id, []).append(series)
            series.claimed.inc()

    def on_started(self, step: Claimed, claim_to_start_s: float) -> None:
        self._of(step.queue, step.kind).claim_to_start.observe(claim_to_start_s)

    def on_finished(self, step: Claimed, outcome: str, duration_s: float) -> None:
        if outcome != "abandoned" or duration_s:
            self._of(step.queue, step.kind).handler.observe(duration_s)

    def _settled(self, step_ids: Collection[int]) -> Iterable[_StepSeries]:
        for step_id in step_ids:
            with self._steps_lock:
                held = self._steps.get(step_id)
                if not held:
                    continue
                series = held.pop()
                if not held:
                    del self._steps[step_id]
            yield series

    def on_completed(self, step_ids: Collection[int]) -> None:
        for series in self._settled(step_ids):
            series.completed.inc()

    def on_failed(self, step_ids: Collection[int], *, retried: bool) -> None:
        for series in self._settled(step_ids):
            (series.retried if retried else series.failed).inc()

    def on_fenced(self, step_ids: Collection[int]) -> None:
        for series in self._settled(step_ids):
            series.fenced.inc()

    def on_released(self, step_ids: Collection[int]) -> None:
        for _ in self._settled(step_ids):
            pass

    def on_runs_ended(self, runs: Sequence[EndedRun]) -> None:
        for run in runs:
            self.run_duration.labels(run.workflow, run.state).observe(max(0.0, run.duration_s))

    def on_reclaimed(self, count: int) -> None:
        self.reclaimed.inc(count)

    def on_listener(self, connected: bool) -> None:
        self.listener.set(1 if connected else 0)


class DatabaseGauges(Collector):
    """The database-wide gauges, read at scrape time in one statement (reused for
    ``ttl_s`` seconds): open steps per queue and state, the age of each queue's oldest due
    available step, open runs per state, runs waiting on a signal, timer or child run.

    ``read`` returns the rows of the ``database_gauges`` query (``Client.gauges``).
    """

    def __init__(
        self,
        read: Callable[[], Sequence[Mapping[str, Any]]],
        *,
        ttl_s: float = DATABASE_GAUGES_TTL_S,
    ) -> None:
        self._read = read
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._rows: Sequence[Mapping[str, Any]] = ()
        self._read_at = -1e9
        self._up = False

    def register(self, registry: CollectorRegistry) -> DatabaseGauges:
        registry.register(self)
        return self

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def _families(self) -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily(
                "cyclone_queue_steps",
                "Open steps per queue and state.",
                labels=["queue", "state"],
            ),
            GaugeMetricFamily(
                "cyclone_queue_oldest_runnable_age_seconds",
                "Age of the oldest due available step of each queue (0: none).",
                labels=["queue"],
            ),
            GaugeMetricFamily("cyclone_runs_open", "Open runs per state.", labels=["state"]),
            GaugeMetricFamily(
                "cyclone_runs_waiting",
                "Runs with a step waiting on a signal, a timer or a child run.",
            ),
            GaugeMetricFamily(
                "cyclone_database_gauges_up", "1 when the database gauges could be read."
            ),
        ]

    def _current(self) -> tuple[Sequence[Mapping[str, Any]], bool]:
        with self._lock:
            if time.monotonic() - self._read_at >= self._ttl_s:
                try:
                    self._rows, self._up = self._read(), True
                except Exception as exc:  # noqa: BLE001 - a scrape reports it, never fails
                    log.warning("reading the database gauges failed: %s", exc)
                    self._rows, self._up = (), False
                self._read_at = time.monotonic()
            return self._rows, self._up

    def collect(self) -> Iterable[Metric]:
        rows, up = self._current()
        steps, oldest, runs, waiting, healthy = self._families()
        waiting_runs = 0.0
        oldest_by_queue: dict[str, float] = {}
        for row in rows:
            gauge = row["gauge"]
            if gauge == "steps":
                steps.add_metric([row["queue"], row["state"]], float(row["value"]))
                age = row["oldest_s"]
                queue = row["queue"]
                oldest_by_queue[queue] = max(oldest_by_queue.get(queue, 0.0), float(age or 0.0))
            elif gauge == "runs":
                runs.add_metric([row["state"]], float(row["value"]))
            elif gauge == "waiting_runs":
                waiting_runs = float(row["value"])
        for queue, age in sorted(oldest_by_queue.items()):
            oldest.add_metric([queue], age)
        waiting.add_metric([], waiting_runs)
        healthy.add_metric([], 1.0 if up else 0.0)
        return [steps, oldest, runs, waiting, healthy] if up else [healthy]


def database_registry(read: Callable[[], Sequence[Mapping[str, Any]]]) -> CollectorRegistry:
    """A registry of the database-wide gauges alone (the dashboard's ``/metrics``)."""
    registry = new_registry()
    DatabaseGauges(read).register(registry)
    return registry


def exposition(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """The body and content type of a scrape of ``registry``, in the format asked for."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


class _QuietHandler(WSGIRequestHandler):
    """Keeps the HTTP server from logging every scrape to stderr."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress does not hold up the process's exit


def serve(registry: CollectorRegistry, port: int, host: str) -> WSGIServer:
    """Serve ``registry`` on ``http://host:port/metrics`` from a daemon thread; stop it with
    ``server.shutdown()`` then ``server.server_close()``."""
    server = make_server(
        host, port, make_wsgi_app(registry), server_class=_Server, handler_class=_QuietHandler
    )
    thread = threading.Thread(
        target=server.serve_forever, name="cyclone-metrics", kwargs={"poll_interval": 0.2}
    )
    thread.daemon = True
    thread.start()
    return server
