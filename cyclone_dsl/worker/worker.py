"""The worker: claims steps, runs their handlers, commits outcomes, keeps leases alive.

Threads, each with one job:

* the fetch loop (the caller's thread in :meth:`Worker.run`) claims batches
  while slots are free and sleeps on NOTIFY wake-ups or the poll interval; a worker
  serving both sync and async handlers has one fetch loop for each (see
  :mod:`cyclone_dsl.worker.lanes`), taking turns to claim;
* a thread pool runs sync handlers, one event loop thread runs async ones (each
  claim's in one call; their outputs are encoded by the completers, off the loop);
* two completers commit outcomes in batches (one transaction each; while one
  waits for its commit's disk flush, the other fills and sends the next batch);
* the heartbeater extends leases on its own connection, and fails or drops
  steps whose timeout passed, whose lease was lost or whose run or branch was
  cancelled (at once when the listener hears of a cancel);
* the listener holds the LISTEN connection (new work, cancellations), on ``dsn``, or on
  ``listen_dsn`` when ``dsn`` goes through a transaction-mode pooler; with neither, the
  worker polls at ``poll_interval`` and says so once in the log;
* the housekeeper records the worker as live in the worker registry and warns
  about work on its queues that no live worker serves;
* the scanner runs the maintenance passes (expired leases, timeouts, timers…)
  under a per-pass advisory lock so that many workers do not repeat them.

A handler slot is free only once its handler has returned: a sync handler
past its timeout is failed at once (its step retries elsewhere), but its
thread keeps its slot until it ends, so no step is ever claimed without a
thread ready to run it. An internal thread that fails unexpectedly stops the
whole worker with :class:`~cyclone_dsl.errors.WorkerCrashed`, never silently.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import functools
import logging
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any, TypeVar

import attrs

from cyclone_dsl import payload
from cyclone_dsl.arguments import check_seconds, checked_flag
from cyclone_dsl.db.callers import Connection
from cyclone_dsl.db.connect import (
    connect,
    listen_target,
    make_pool,
    resolve_listen_dsn,
    resolve_pooled,
)
from cyclone_dsl.db.diagnose import parse_dsn, require_writable
from cyclone_dsl.db.errors import ConnectionFailure, DatabaseError
from cyclone_dsl.db.handler_tx import interrupt
from cyclone_dsl.db.listener import ConnectionLost, Listener, poke, wake_pair
from cyclone_dsl.db.pool import PooledDatabase
from cyclone_dsl.db.tx import ConnectionTx, Tx, in_autocommit, in_transaction
from cyclone_dsl.dsl import runs
from cyclone_dsl.dsl.registry import Registry, default_registry, object_list
from cyclone_dsl.dsl.step import StepDef
from cyclone_dsl.durations import as_timedelta, is_duration, refusal
from cyclone_dsl.engine import (
    CANCEL_CHANNEL,
    CHILD_WAKE,
    DEFAULT_MAX_EVENTS_PER_STEP,
    DEFAULT_MAX_RECLAIMS,
    DEFAULT_RETENTION,
    WORK_CHANNEL,
    Claimed,
    Engine,
    Failure,
    NewEvent,
    Outcome,
    Success,
    run_ids_of,
)
from cyclone_dsl.errors import (
    ClientClosed,
    EventLimitExceeded,
    InvalidArgument,
    InvalidTransition,
    WorkerCrashed,
)
from cyclone_dsl.failpoints import failpoint
from cyclone_dsl.graph.rows import KIND_CHILD
from cyclone_dsl.graph.validate import INT32_MAX, queue_problem
from cyclone_dsl.migrate import checked_connection
from cyclone_dsl.observability import logs
from cyclone_dsl.payload import MAX_NAME_BYTES, text_problem
from cyclone_dsl.states import ErrorKind, RunState
from cyclone_dsl.worker import adaptive, execute
from cyclone_dsl.worker.adaptive import SlotController, Slots, WorkerSettings
from cyclone_dsl.worker.context import StepContext
from cyclone_dsl.worker.emitter import EventBatcher
from cyclone_dsl.worker.lanes import Lane, thread_cpu_clock
from cyclone_dsl.worker.observe import EndedRun, Observers, WorkerObserver
from cyclone_dsl.worker.processes import Supervisor, worker_spec
from cyclone_dsl.worker.scanner import Scanner
from cyclone_dsl.worker.serving import serving_of
from cyclone_dsl.worker.threads import DaemonThreadPool, Settled
from cyclone_dsl.worker.transactional import COMMITTED, DROPPED, Call, TransactionalRunner

log = logging.getLogger("cyclone.worker")

T = TypeVar("T")

#: When every slot was busy, wait this long for more slots before claiming again.
CLAIM_SETTLE_S = 0.002

#: How often a worker serving rate-limited kinds claims without a wake-up (a rate window
#: frees its slots without any event; other limits wake claimers when a slot frees).
RATED_POLL_S = 0.2

#: Completion threads. Their transactions lock runs in id order, so they never deadlock.
COMPLETERS = 2

#: How often a worker tells the registry it is alive (see engine.workers.LIVE_FOR).
REGISTRY_BEAT_S = 5.0
#: How often a worker looks for work on its queues that no live worker serves.
UNSERVED_CHECK_S = 60.0
#: A sync handler still running this long past its timeout is reported (once).
STUCK_REPORT_S = 10.0
#: Connections of the pool that stores handlers' events (opened at the first event): one
#: batch of events is written at a time (see cyclone_dsl.worker.emitter).
EVENT_CONNECTIONS = 1

#: Collects the runs the current transaction ended, while an observer wants them.
_ENDED_RUNS: contextvars.ContextVar[list[EndedRun] | None] = contextvars.ContextVar(
    "cyclone_ended_runs", default=None
)


def _checked_retention(retention: object) -> timedelta | None:
    """How long ended runs are kept, from a timedelta or seconds (None: forever)."""
    if retention is None:
        return None
    kept_for = as_timedelta(retention)
    if not isinstance(kept_for, timedelta) or not is_duration(kept_for):
        raise InvalidArgument(f"{refusal('retention', retention)} (or None: keep ended runs)")
    return kept_for


#: The most worker processes one supervisor runs (each holds its own connections).
MAX_PROCESSES = 1024


def _check_text(option: str, value: object, *, optional: bool) -> None:
    """A string option: non-empty, or (``optional``) any string or None, "" meaning none."""
    if isinstance(value, str) and (value or optional):
        return
    if value is None and optional:
        return
    what = "a string or None" if optional else "a non-empty string"
    raise InvalidArgument(f"{option} must be {what}, not {value!r}")


@attrs.define
class _Inflight:
    step: Claimed
    ctx: StepContext
    deadline: float | None  # monotonic time the handler's timeout passes
    lane: Lane  # whose slot it holds
    claimed_at: float = 0.0  # monotonic time its claim returned
    # Monotonic time until which its lease surely holds: the lease from the moment its
    # claim (or last renewal) was sent, which is before the server's clock started it.
    lease_until: float = float("inf")
    started_at: float = 0.0  # monotonic time its handler started (kept when observed)
    decided_here: bool = False  # a transactional step's own transaction took the decision
    # Its lease is held by its handler's open transaction (repeatable read, serializable),
    # not by heartbeats, which would update the row that transaction's completion updates.
    lease_in_transaction: bool = False
    ended_runs: list[EndedRun] | None = None  # runs its own transaction ended (observed)
    settled: bool = False  # the outcome is decided (or abandoned): nothing more to record
    returned: bool = False  # the handler has returned: its slot is free
    task: asyncio.Task[Any] | None = None  # an async handler's task, to cancel it
    stuck_reported: bool = False
    timed_out: bool = False  # failed by its timeout while the handler still ran
    # A sync transactional handler's connection while it runs, to interrupt it; the lock
    # keeps an interrupt from reaching the connection once it is back in the pool.
    connection: object = None
    connection_lock: threading.Lock = attrs.field(factory=threading.Lock)

    def attach(self, connection: object) -> None:
        with self.connection_lock:
            self.connection = connection


def _cancel_timer(timer: asyncio.TimerHandle, _task: asyncio.Task[Any]) -> None:
    timer.cancel()


def _claim_key(step: Claimed) -> tuple[int, int]:
    """One claim of a step: its id and the lease generation the claim took."""
    return (step.id, step.generation)


def _late(entry: _Inflight) -> bool:
    """Whether the handler's timeout has passed: what it returns now is not kept (the
    heartbeat loop, which fails such steps, may not have seen it yet)."""
    return entry.deadline is not None and time.monotonic() > entry.deadline


#: An async handler to start: its entry, function, arguments and whether to keep its output.
_Start = tuple[_Inflight, Callable[..., Any], list[Any], dict[str, Any], bool]


class _NotStarted(Exception):
    """A claimed step's handler was not started (see ``Worker._may_start``)."""


@attrs.frozen
class _Returned:
    """An async handler's return, decided on the loop's thread; a completer encodes the
    output (JSON encoding a large output would hold up every handler on the loop)."""

    entry: _Inflight
    result: object
    keep_output: bool
    at: float  # monotonic time it returned


class Worker:
    """Runs the handlers of the given modules or objects.

    ``Worker(dsn, [myapp.flows]).run()`` blocks until SIGTERM/SIGINT, then
    stops gracefully: no new claims, running handlers get ``grace`` seconds,
    and leases still held after that are released (available again at once,
    the attempt not counted). ``with Worker(...):`` runs the same worker in
    background threads of this process and stops it the same way on exit.

    Transactional handlers (``@step(transactional=True)``) write on connections to
    ``transactional_dsn`` (by default ``dsn``): a database where both the application's
    tables and Cyclone's are reachable, since their step completes in the same
    transaction. The worker opens up to ``max_concurrency`` such connections.

    ``concurrency`` fixes how many sync (and transactional) handlers run at once. Without
    it the number adapts to the work, from 10 up to ``max_concurrency`` (default 256, or
    32 when the worker serves transactional handlers): it grows while the worker's own
    limit holds back a backlog, and shrinks when handlers take most of the CPU or the
    work runs out. Async handlers hold no thread: their own limit adapts the same way
    from 100 up to ``max_async`` (default 10,000), and stops growing while the event
    loop's thread is busy. Each claim takes at most ``batch_size`` steps and never more
    than the free slots. :meth:`settings` tells where it stands.

    ``pooled=True`` (default: ``$CYCLONE_POOLED``) says ``dsn`` (and
    ``transactional_dsn``) go through a transaction-mode pooler such as PgBouncer: no
    session state, no server-side prepared statements, and no LISTEN on them. Wake-ups
    then come over ``listen_dsn`` (default: ``$CYCLONE_LISTEN_URL``), a direct connection
    to the same database; without one the worker polls every ``poll_interval`` seconds.

    ``metrics_port`` serves Prometheus metrics on ``http://metrics_host:port/metrics``
    while the worker runs (port 0: any free port, see :attr:`metrics_port` once started);
    it needs the ``metrics`` extra. ``tracing=True`` (or a
    :class:`~opentelemetry.trace.TracerProvider`) makes each step attempt an OpenTelemetry
    span in its run's trace; it needs the ``otel`` extra. ``observers`` hear what the
    worker does with its steps (see :class:`~cyclone_dsl.worker.observe.WorkerObserver`).

    ``max_events_per_step`` caps the events (``ctx.emit``, ``ctx.progress``) one step may
    store, across its attempts; the events of handlers that emit at the same moment are
    written together, in one statement on one connection opened at the first event.

    Durations (``lease``, ``poll_interval``, ``scan_interval``, ``grace``) are finite
    seconds, from a microsecond up to what a thread can wait (about 292 years); ``grace``
    may be 0; ``max_reclaims`` (reclaims of a step whose worker died
    before it is discarded) and ``max_output_bytes`` (the largest encoded output kept; 0:
    no limit) are integers >= 0. ``name`` (by default ``<host>:<pid>:<hex>``) is at most
    256 bytes of UTF-8, without NUL. Anything else raises :class:`InvalidArgument`.

    ``processes=N`` (N > 1) runs N worker processes under a supervisor in this process
    (see :mod:`cyclone_dsl.worker.processes`): each imports the handler modules by name
    and registers as ``<name>/<i>``; a dead one is restarted. The default is 1 (this
    process) because handlers defined in a script or a test module cannot be imported
    by name in another process; ``cyclone worker`` defaults to the number of cores.
    """

    def __init__(
        self,
        dsn: str,
        objects: Iterable[object] = (),
        *,
        queues: Sequence[str] = ("default",),
        concurrency: int | None = None,
        max_concurrency: int | None = None,
        max_async: int | None = None,
        lease: float = 30.0,
        poll_interval: float = 1.0,
        grace: float = 30.0,
        scan_interval: float = 1.0,
        max_reclaims: int = DEFAULT_MAX_RECLAIMS,
        batch_size: int = 100,
        max_output_bytes: int = payload.DEFAULT_MAX_BYTES,
        scanners: bool = True,
        retention: timedelta | float | None = DEFAULT_RETENTION,
        catch_up: str = "latest",
        name: str | None = None,
        registry: Registry | None = None,
        queue_limits: Mapping[str, int] | None = None,
        transactional_dsn: str | None = None,
        pooled: bool | None = None,
        listen_dsn: str | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "0.0.0.0",  # noqa: S104 - Prometheus scrapes from another host
        observers: Sequence[WorkerObserver] = (),
        max_events_per_step: int = DEFAULT_MAX_EVENTS_PER_STEP,
        tracing: object = False,
        processes: int = 1,
    ) -> None:
        if (
            not isinstance(processes, int)
            or isinstance(processes, bool)
            or not 1 <= processes <= MAX_PROCESSES
        ):
            raise InvalidArgument(
                f"processes must be an integer from 1 to {MAX_PROCESSES}, not {processes!r}"
            )
        _check_text("dsn", dsn, optional=False)
        parse_dsn(dsn)  # a DSN libpq cannot parse is refused here, not at start()
        checked_flag("scanners", scanners)
        if pooled is not None:
            checked_flag("pooled", pooled)
        _check_text("listen_dsn", listen_dsn, optional=True)
        _check_text("transactional_dsn", transactional_dsn, optional=True)
        for other_dsn in (listen_dsn, transactional_dsn):
            if other_dsn:
                parse_dsn(other_dsn)  # refused here, its password masked, not at start()
        _check_text("metrics_host", metrics_host, optional=False)
        if registry is not None and not isinstance(registry, Registry):
            raise InvalidArgument(f"registry must be a Registry or None, not {registry!r}")
        if queue_limits is not None and not isinstance(queue_limits, Mapping):
            raise InvalidArgument(
                f"queue_limits maps queue names to limits ({{'emails': 5}}), not {queue_limits!r}"
            )
        given_observers: object = observers  # untyped callers may pass anything
        if isinstance(given_observers, str | bytes) or not isinstance(given_observers, Iterable):
            raise InvalidArgument(f"observers takes a list of observers, not {observers!r}")
        if (
            tracing is not None
            and not isinstance(tracing, bool)
            and not callable(getattr(tracing, "get_tracer", None))
        ):
            raise InvalidArgument(
                f"tracing is True, False or an OpenTelemetry TracerProvider, not {tracing!r}"
            )
        for option, value in (
            ("concurrency", concurrency),
            ("max_concurrency", max_concurrency),
            ("max_async", max_async),
        ):
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= INT32_MAX
            ):
                raise InvalidArgument(
                    f"{option} must be an integer from 1 to {INT32_MAX}, not {value!r}"
                )
        if concurrency is not None and max_concurrency is not None:
            raise InvalidArgument(
                "max_concurrency caps the adaptive default; with a fixed concurrency, leave "
                "it unset"
            )
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise InvalidArgument(f"batch_size must be an integer >= 1, not {batch_size!r}")
        for option, seconds, positive in (
            ("lease", lease, True),
            ("poll_interval", poll_interval, True),
            ("scan_interval", scan_interval, True),
            ("grace", grace, False),
        ):
            check_seconds(option, seconds, positive=positive)
        kept_for = _checked_retention(retention)
        for option, count in (
            ("max_reclaims", max_reclaims),
            ("max_output_bytes", max_output_bytes),
        ):
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise InvalidArgument(f"{option} must be an integer >= 0, not {count!r}")
        # An empty name: the default one.
        if name not in (None, "") and (wrong := text_problem("name", name, MAX_NAME_BYTES)):
            raise InvalidArgument(wrong)
        if isinstance(queues, str | bytes):
            raise InvalidArgument(
                f"queues takes a list of queue names: queues=[{queues!r}], not {queues!r}"
            )
        if not isinstance(queues, Iterable):
            raise InvalidArgument(f"queues takes a list of queue names, not {queues!r}")
        queues = list(dict.fromkeys(queues))
        if not queues:
            raise InvalidArgument("a worker needs at least one queue")
        for served in queues:
            wrong = queue_problem(served)
            if wrong is not None:
                raise InvalidArgument(wrong)
        if (
            isinstance(max_events_per_step, bool)
            or not isinstance(max_events_per_step, int)
            or max_events_per_step < 1
        ):
            raise InvalidArgument(
                f"max_events_per_step must be an integer >= 1, not {max_events_per_step!r}"
            )
        self.max_events_per_step = max_events_per_step
        self._events_db: PooledDatabase | None = None
        self._event_batcher: EventBatcher | None = None
        self._events_closed = False  # stopped: a handler that outlived it writes on its own
        self._events_lock = threading.Lock()
        self.queue_limits = dict(queue_limits or {})
        strays = [repr(q) for q in self.queue_limits if q not in queues]
        if strays:
            raise InvalidArgument(
                f"queue_limits names queues this worker does not serve: {', '.join(strays)} "
                f"(it serves {queues})"
            )
        for limited, cap in self.queue_limits.items():
            if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
                raise InvalidArgument(
                    f"queue_limits[{limited!r}] must be an integer >= 1, not {cap!r}"
                )
        objects = object_list(objects)  # read once: the registry and the processes' spec
        self.registry = registry if registry is not None else Registry.from_objects(objects)
        self.handlers = dict(self.registry.handlers())
        if not self.handlers:
            raise InvalidArgument(
                "this worker has no handlers: pass the modules (or the @workflow, @step and "
                "@action objects) whose steps it runs"
            )
        # A worker given objects also knows every workflow this process defined (a step
        # given alone serves the workflows that call it); an explicit registry is exact.
        self._also = default_registry() if registry is None else None
        self.serving = serving_of(self.registry, also=self._also)
        self._also_count = len(self._also.workflows) if self._also is not None else 0
        self.queues = list(queues)
        self._gated = self._has_limits()
        self._rated = any(h.rate_limit for h in self.handlers.values())
        self._capped: frozenset[str] = frozenset()  # queues capped across all workers
        self._gated_queues: frozenset[str] = frozenset()  # queues holding limited work
        self._cursors: dict[str, str] = {}  # per queue, the fair key its last claim ended on
        #: The fixed number of handlers at once; ``None``: it adapts (see :meth:`settings`).
        self.concurrency = concurrency
        if concurrency is not None:
            cap = concurrency
        elif max_concurrency is not None:
            cap = max_concurrency
        elif any(h.transactional for h in self.handlers.values()):
            cap = adaptive.MAX_TRANSACTIONAL
        else:
            cap = adaptive.MAX_CONCURRENCY
        #: The most sync (and transactional) handlers it runs at once (and transactional
        #: connections it opens).
        self.max_concurrency = cap
        #: The most async handlers it runs at once (they hold no thread: see lanes).
        self.max_async = max_async if max_async is not None else adaptive.MAX_ASYNC
        on_loop = {k for k, h in self.handlers.items() if h.is_async and not h.transactional}
        self._thread_lane = Lane(
            "threads",
            sorted(set(self.handlers) - on_loop),
            Slots(concurrency or min(adaptive.START, cap)),
            None if concurrency is not None else SlotController(adaptive.START, cap, batch_size),
        )
        async_start = min(adaptive.ASYNC_START, self.max_async)
        self._loop_lane = Lane(
            "loop",
            sorted(on_loop),
            Slots(async_start),
            SlotController(async_start, self.max_async, batch_size, busy=adaptive.LOOP_BUSY),
            min_returns=0,
        )
        self._lanes = [lane for lane in (self._thread_lane, self._loop_lane) if lane.kinds]
        self._lane_of = {kind: lane for lane in self._lanes for kind in lane.kinds}
        self._claim_lock = threading.Lock()  # the lanes claim one at a time
        self.lease = timedelta(seconds=lease)
        self.poll_interval = poll_interval
        self.grace = grace
        self.batch_size = batch_size
        self.max_output_bytes = max_output_bytes
        self.id = name or f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        watching = list(observers)
        #: The worker's own Prometheus registry (None without ``metrics_port``).
        self.metrics_registry: Any = None
        #: The port /metrics is served on (the one bound, once started with port 0).
        self.metrics_port = metrics_port
        self._metrics_host = metrics_host
        self._metrics_server: Any = None
        if metrics_port is not None:
            watching.append(self._metrics_observer(metrics_port))
        self._tracing: Any = None
        if tracing is not None and tracing is not False:
            self._tracing = self._tracing_observer(tracing)
            watching.append(self._tracing)
        self._observer: WorkerObserver | None = Observers(watching) if watching else None
        self._engine = Engine(
            compile_child=runs.child_compiler(self.registry, also=self._also),
            compile_schedule=runs.compiler_for(self.registry),
            on_runs_ended=self._runs_ended if self._observer is not None else None,
            tracing=self._tracing,
        )
        self._dsn = dsn
        self.pooled = resolve_pooled(pooled)
        #: Where the worker LISTENs for wake-ups; ``None``: nowhere, it polls.
        self.listen_dsn = listen_target(
            dsn, pooled=self.pooled, listen_dsn=resolve_listen_dsn(listen_dsn)
        )
        # Transactional handlers write the application's tables and Cyclone's in one
        # transaction: this database must hold both (by default, Cyclone's own).
        self._transactional_dsn = transactional_dsn or dsn
        self._runner: TransactionalRunner | None = None
        self._max_reclaims = {
            kind: step.max_reclaims
            for kind, step in self.handlers.items()
            if step.max_reclaims is not None
        }
        self._default_max_reclaims = max_reclaims
        self._scan_interval = scan_interval
        self._with_scanners = scanners
        self._retention = kept_for
        if catch_up not in ("latest", "all"):
            raise InvalidArgument("catch_up must be 'latest' or 'all'")
        self._catch_up: Any = catch_up
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        #: new (never started, or its start failed), running, stopped: a worker runs once.
        self._lifecycle = "new"
        self._lifecycle_lock = threading.Lock()
        self._closing = threading.Event()  # set once no lease is held: heartbeats end
        # Keyed by claim (step id, lease generation): a step retried and claimed again by
        # this worker while its cancelled execution runs on is another entry.
        self._inflight: dict[tuple[int, int], _Inflight] = {}  # claimed, not decided yet
        self._running: dict[tuple[int, int], _Inflight] = {}  # handler not returned yet
        self._inflight_lock = threading.Lock()
        self._heartbeat_conn: Connection | None = None  # opened at start, then the loop's
        self._outcomes: queue.Queue[Success | Failure | _Returned | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._fetchers: list[threading.Thread] = []  # fetch loops of lanes past the first
        self._pool: Any = None
        #: Wakes the LISTEN thread at the stop, which then closes its connection.
        self._listen_wake: tuple[socket.socket, socket.socket] | None = None
        self._executor: DaemonThreadPool | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scanner: Scanner | None = None
        self._takes_ctx: dict[str, bool] = {}
        self._queue_turn = 0
        self._completed = 0  # steps this process completed (see completed_count)
        self._count_lock = threading.Lock()
        self._check_now = threading.Event()  # a cancel was heard: check leases at once
        self._lease_lock = threading.Lock()  # heartbeat statements vs lease_in_transaction
        self._children_due = threading.Event()  # a child run was left for a worker to start
        self._cancel_runs: set[int] = set()
        self._crash: BaseException | None = None
        self._signalled = False  # a first SIGTERM or SIGINT came
        self._crash_reported = False
        self._registered = False
        self._unserved_reported: dict[tuple[str, str, str, str], float] = {}
        #: Worker processes (see :mod:`cyclone_dsl.worker.processes`); 1: this process.
        self.processes = processes
        self._supervisor: Supervisor | None = None
        self._spec: dict[str, Any] | None = None
        if processes > 1:
            if registry is not None or observers or not isinstance(tracing, bool):
                raise InvalidArgument(
                    "processes > 1: registry=, observers= and a tracer provider are objects "
                    "of this process, which the worker processes cannot share; use "
                    "processes=1 (or tracing=True: each process uses its global provider)"
                )
            if metrics_port and metrics_port + processes - 1 > 65535:
                # Each process serves its own /metrics, on the port plus its index - 1.
                raise InvalidArgument(
                    f"metrics_port {metrics_port} with processes={processes} needs ports up "
                    f"to {metrics_port + processes - 1}, past 65535: choose a lower port, "
                    f"or 0 (any free port for each process)"
                )
            self._spec = worker_spec(
                dsn,
                objects,
                also=self._also.workflows.values() if self._also is not None else (),
                name=name,
                options={
                    "queues": self.queues,
                    "concurrency": concurrency,
                    "max_concurrency": max_concurrency,
                    "max_async": max_async,
                    "max_events_per_step": max_events_per_step,
                    "tracing": tracing,
                    "lease": lease,
                    "poll_interval": poll_interval,
                    "grace": grace,
                    "scan_interval": scan_interval,
                    "max_reclaims": max_reclaims,
                    "batch_size": batch_size,
                    "max_output_bytes": max_output_bytes,
                    "scanners": scanners,
                    "retention": None if kept_for is None else kept_for.total_seconds(),
                    "catch_up": catch_up,
                    "queue_limits": self.queue_limits,
                    "transactional_dsn": transactional_dsn,
                    "pooled": self.pooled,
                    "listen_dsn": listen_dsn,
                    "metrics_port": metrics_port,
                    "metrics_host": metrics_host,
                },
            )
            self.id = self._spec["name"]  # the processes are <id>/1 to <id>/N

    def _metrics_observer(self, port: int) -> WorkerObserver:
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise InvalidArgument(f"metrics_port must be a port number (0-65535), not {port!r}")
        try:
            from cyclone_dsl.observability import metrics  # only when asked: prometheus_client
        except ImportError as exc:
            raise InvalidArgument(
                f"metrics_port needs prometheus_client: pip install 'cyclone-dsl[metrics]' ({exc})"
            ) from exc
        self.metrics_registry = metrics.new_registry()
        metrics.DatabaseGauges(lambda: self._tx(self._engine.database_gauges)).register(
            self.metrics_registry
        )
        return metrics.WorkerMetrics(
            self.metrics_registry,
            slots_in_use=lambda: self.slots_in_use,
            slots=lambda: sum(lane.slots.limit for lane in self._lanes),
        )

    def _tracing_observer(self, option: object) -> WorkerObserver:
        try:
            from cyclone_dsl.observability import step_spans  # only when asked: opentelemetry
        except ImportError as exc:
            raise InvalidArgument(
                f"tracing needs opentelemetry-api: pip install 'cyclone-dsl[otel]' ({exc})"
            ) from exc
        observer = step_spans.tracing_observer(option, self.id)
        assert observer is not None
        return observer

    def _trace_contexts(self, claimed: list[Claimed]) -> dict[int, dict[str, str]]:
        """The trace context of the claimed steps' runs (one read; none if it fails: the
        steps are claimed and run all the same)."""
        try:
            contexts: dict[int, dict[str, str]] = in_autocommit(
                self._pool,
                lambda tx: self._engine.trace_contexts(tx, [s.run_id for s in claimed]),
            )
        except DatabaseError as exc:
            log.warning("reading the trace context of claimed steps failed: %s", exc)
            return {}
        return contexts

    @property
    def slots_in_use(self) -> int:
        """Handler slots taken now (claimed steps whose handler has not returned)."""
        return len(self._running)

    @property
    def completed_count(self) -> int:
        """Steps this worker completed. With ``processes`` > 1: its worker processes, as
        they last reported (each reports every 0.2 s), those that exited included."""
        if self._supervisor is not None:
            return self._supervisor.completed_count
        return self._completed

    def settings(self) -> WorkerSettings:
        """The worker's effective settings now: the slot limits of sync handlers (which
        adapts unless ``concurrency`` was given) and of async ones, the claim size, the
        threads started.

        With ``processes`` > 1: the sums over the worker processes running now, as they
        last reported (every 0.2 s); ``claim_size`` is the largest of one process, and
        ``batch_size`` that of each."""
        if self._supervisor is not None:
            return self._summed_settings(self._supervisor.reports())
        threads, loop = self._thread_lane, self._loop_lane
        return WorkerSettings(
            adaptive=threads.controller is not None,
            concurrency=threads.slots.limit,
            max_concurrency=self.max_concurrency,
            claim_size=min(self.batch_size, max(lane.slots.limit for lane in self._lanes)),
            batch_size=self.batch_size,
            slots_in_use=self.slots_in_use,
            threads=self._executor.threads if self._executor is not None else 0,
            async_concurrency=loop.slots.limit,
            max_async=self.max_async,
            async_in_use=loop.running,
        )

    def _summed_settings(self, reports: list[dict[str, Any]]) -> WorkerSettings:
        def total(field: str) -> int:
            return sum(int(report[field]) for report in reports)

        return WorkerSettings(
            adaptive=self.concurrency is None,
            concurrency=total("concurrency"),
            max_concurrency=total("max_concurrency"),
            claim_size=max((int(report["claim_size"]) for report in reports), default=0),
            batch_size=self.batch_size,
            slots_in_use=total("slots_in_use"),
            threads=total("threads"),
            async_concurrency=total("async_concurrency"),
            max_async=total("max_async"),
            async_in_use=total("async_in_use"),
        )

    @property
    def error(self) -> BaseException | None:
        """Why the worker stopped on its own (an internal thread failed), or ``None``."""
        return self._crash

    # -- lifecycle -------------------------------------------------------------------

    def run(self) -> None:
        """Run until SIGTERM or SIGINT (a second signal stops at once), then stop gracefully
        (at once, without starting, when a stop was requested before)."""
        if not self._begin():
            return
        if self._spec is not None:
            try:
                self._supervisor = self._new_supervisor()
                if self._stopping.is_set():  # request_stop() while the supervisor was made
                    self._supervisor.request_stop()
                self._supervise(self._supervisor.run())
            finally:
                self._lifecycle = "stopped"
            return
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, self._on_signal)
        try:
            self._start_or_unbegin(self._start_services)
            try:
                self._fetch_lanes()
            except Exception as exc:  # noqa: BLE001 - any failure stops the worker, loudly
                self._crashed("fetch", exc)
            finally:
                self._shutdown()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self._raise_if_crashed()

    def start(self) -> Worker:
        """Run in background threads of this process (with ``processes`` > 1: the worker
        processes, supervised from a thread of this one); stop with :meth:`stop`.

        A worker runs once: starting it again, running or stopped, raises
        :class:`InvalidTransition` (make a new one); a start that failed may be retried. A
        worker asked to stop before it started (:meth:`request_stop`, a SIGTERM to a worker
        process still starting) does not start.
        """
        if not self._begin():
            return self
        if self._spec is not None:
            self._supervisor = self._start_or_unbegin(lambda: self._new_supervisor().start())
            return self
        self._start_or_unbegin(self._start_services)
        self._spawn(self._fetch_lanes_then_shutdown, "fetch")
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop claiming, let running handlers finish within the grace period, close the
        worker's connections, then return (at once for a worker that is not running).
        ``timeout`` (seconds, a finite number >= 0; None: the grace period and 30 s more)
        bounds the wait; anything else raises :class:`InvalidArgument` before the stop.
        Called by one of this worker's handlers, it begins the stop and returns at once,
        as :meth:`request_stop` does (the handler's result is kept)."""
        if timeout is not None:
            check_seconds("timeout", timeout, positive=False)
        if self._supervisor is not None:
            exit_code = self._supervisor.stop(timeout)
            if exit_code is None:
                return  # still stopping after ``timeout``, as a worker of one process may be
            self._supervise(exit_code)
            self._lifecycle = "stopped"
            return
        self._stopping.set()
        self._wake_lanes()
        if self._in_a_handler():
            # It would wait for the running handlers, its caller among them: for the whole
            # grace, and then the caller's own result would be dropped with its lease.
            log.info("stop() called by a handler of worker %s: stopping without waiting", self.id)
            return
        if self._lifecycle == "running":
            self._stopped.wait(timeout if timeout is not None else self.grace + 30)
        self._raise_if_crashed()

    def _in_a_handler(self) -> bool:
        """Whether the calling thread runs this worker's handlers (its handler threads or
        the async handlers' event loop)."""
        current = threading.current_thread()
        executor = self._executor
        if executor is not None and executor.owns(current):
            return True
        return current.name == "cyclone-asyncio" and current in self._threads

    def _begin(self) -> bool:
        """Whether to start: False (and stopped) when a stop was requested first."""
        with self._lifecycle_lock:
            if self._lifecycle != "new":
                where = "is running" if self._lifecycle == "running" else "has stopped"
                raise InvalidTransition(
                    f"worker {self.id} {where}: a Worker runs once; make a new one to run again"
                )
            if self._stopping.is_set():
                self._lifecycle = "stopped"
                log.info("worker %s was asked to stop before it started: not starting", self.id)
                return False
            self._lifecycle = "running"
            return True

    def _start_or_unbegin(self, start: Callable[[], T]) -> T:
        """``start()``; a start that failed (it leaves nothing open) may be retried."""
        try:
            return start()
        except BaseException:
            self._lifecycle = "new"
            raise

    def request_stop(self) -> None:
        """Begin a graceful stop (as a first SIGTERM does) and return at once."""
        self._stopping.set()
        self._wake_lanes()
        if self._supervisor is not None:
            self._supervisor.request_stop()

    def _new_supervisor(self) -> Supervisor:
        # The supervisor's one database check: a wrong DSN or schema fails here, once,
        # rather than in every worker process again and again.
        name = f"cyclone-supervisor-{os.getpid()}"
        with checked_connection(self._dsn, name=name, pooled=self.pooled) as conn:
            self._engine.check_handler_conflicts(
                ConnectionTx(conn), worker_id=self.id, identities=self.serving.identities
            )
        assert self._spec is not None
        return Supervisor(self._spec, self.processes, grace=self.grace)

    def _supervise(self, exit_code: int) -> None:
        if exit_code != 0:
            raise WorkerCrashed(
                f"worker {self.id}: a worker process did not stop cleanly (see the log)"
            )

    def _raise_if_crashed(self) -> None:
        """Raise :class:`WorkerCrashed` once, to the first caller of ``run`` or ``stop``."""
        if self._crash is not None and not self._crash_reported:
            self._crash_reported = True
            raise WorkerCrashed(
                f"worker {self.id} stopped: an internal thread failed: "
                f"{type(self._crash).__name__}: {self._crash}"
            ) from self._crash

    def _crashed(self, name: str, exc: BaseException) -> None:
        log.critical(
            "worker %s: internal thread %s failed; stopping the worker",
            self.id,
            name,
            exc_info=exc,
        )
        if self._crash is None:
            self._crash = exc
        self._stopping.set()
        self._wake_lanes()
        for lane in self._lanes:
            lane.slots.wake()  # a fetch loop waiting for a slot notices the stop

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _on_signal(self, signum: int, frame: object) -> None:
        # Signals are counted, not stops: a worker process whose supervisor closed its stop
        # pipe on a group signal gets that same signal too, which is no second one.
        if self._signalled:
            log.warning("second signal: exiting now; held leases will expire and be reclaimed")
            os._exit(1)
        self._signalled = True
        log.info("signal %s: stopping (grace %.0fs)", signum, self.grace)
        self.request_stop()

    def _spawn(self, target: Callable[[], object], name: str) -> None:
        def guarded() -> None:
            try:
                target()
            except BaseException as exc:  # noqa: BLE001 - no thread may die silently
                self._crashed(name, exc)

        thread = threading.Thread(target=guarded, name=f"cyclone-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _start_services(self) -> None:
        """Check the database, register, start every thread; on failure nothing is left open."""
        name = f"cyclone-worker-{os.getpid()}"
        checked = checked_connection(self._dsn, name=name, pooled=self.pooled)
        try:
            require_writable(checked, self._dsn)
        except BaseException:
            checked.close()
            raise
        self._pool = make_pool(
            self._dsn, name=name, max_size=3 + COMPLETERS, pooled=self.pooled, first=checked
        )
        registered_worker = False
        try:
            self._serve_metrics()  # first: an address in use must not leave a worker row
            self._register(refuse_conflicts=True)
            registered_worker = True
            registered = self._tx(self._register_schedules)
            self.refresh_queue_caps()
            # The heartbeat's connection is opened now, not at its first beat: handlers'
            # connections (transactional steps, their own clients) would otherwise take the
            # last sessions a role or server allows, and every lease would be lost.
            self._heartbeat_conn = connect(
                self._dsn, name=f"cyclone-heartbeat-{os.getpid()}", pooled=self.pooled
            )
            # Child runs left for a worker with their definition start now, before the
            # threads: the housekeeping's first beat comes a beat after the registration.
            try:
                self.start_deferred_children()
            except DatabaseError as exc:
                log.warning("starting deferred child runs failed (%s); retrying", exc)
                self._children_due.set()  # the housekeeping's first look, at once
        except BaseException:
            if registered_worker:  # listed as live, though it never ran
                with contextlib.suppress(Exception):
                    self._tx(lambda tx: self._engine.stop_worker(tx, self.id))
            self._stop_metrics()
            self._pool.close()
            if self._heartbeat_conn is not None:
                self._heartbeat_conn.close()
                self._heartbeat_conn = None
            raise
        if registered:
            log.info("registered schedules %s", registered)
        self._executor = DaemonThreadPool(self.max_concurrency, "cyclone-handler")
        self._takes_ctx = {kind: step.takes_ctx for kind, step in self.handlers.items()}
        if any(step.is_async for step in self.handlers.values()):
            self._loop = asyncio.new_event_loop()
            self._spawn(self._run_loop, "asyncio")
            self._loop_lane.cpu_clock = thread_cpu_clock(self._threads[-1])
        if any(step.transactional for step in self.handlers.values()):
            self._runner = TransactionalRunner(
                self._engine,
                self._transactional_dsn,
                name=f"cyclone-handler-{os.getpid()}",
                size=self.max_concurrency,
                max_bytes=self.max_output_bytes,
                idle_s=self.lease.total_seconds(),
                pooled=self.pooled,
            )
        for number in range(COMPLETERS):
            self._spawn(self._complete_loop, f"complete-{number}")
        self._spawn(self._heartbeat_loop, "heartbeat")
        if self.listen_dsn is not None:  # else the listener only says it polls, and ends
            self._listen_wake = wake_pair()
        self._spawn(self._listen_loop, "listen")
        self._spawn(self._housekeeping_loop, "housekeeping")
        if self._with_scanners:
            self._scanner = Scanner(
                self._pool,
                self._engine,
                interval=self._scan_interval,
                max_reclaims=self._max_reclaims,
                default_max_reclaims=self._default_max_reclaims,
                stopping=self._stopping,
                owner=self.id,
                catch_up=self._catch_up,
                retention=self._retention,
                on_reclaimed=self._observer.on_reclaimed if self._observer is not None else None,
            )
            self._spawn(self._scanner.run, "scan")
        log.info(
            "worker %s started: queues %s, %d kinds, %s",
            self.id,
            self.queues,
            len(self.handlers),
            ", ".join(self._describe(lane) for lane in self._lanes),
        )

    def _describe(self, lane: Lane) -> str:
        what = "sync handlers" if lane is self._thread_lane else "async handlers"
        if lane.controller is None:
            return f"{what}: {lane.slots.limit} at once"
        return f"{what}: adaptive, {lane.slots.limit} to {lane.cap} at once"

    def _wake_lanes(self) -> None:
        for lane in self._lanes:
            lane.wake.set()

    def _serve_metrics(self) -> None:
        if self.metrics_registry is None:
            return
        from cyclone_dsl.observability import metrics

        assert self.metrics_port is not None
        try:
            self._metrics_server = metrics.serve(
                self.metrics_registry, self.metrics_port, self._metrics_host
            )
        except OSError as exc:  # in use, not an address of this host, a name not found
            raise InvalidArgument(
                f"cannot serve metrics on {self._metrics_host}:{self.metrics_port}: "
                f"{exc.strerror or exc}"
            ) from None
        self.metrics_port = self._metrics_server.server_port
        log.info("serving metrics on %s:%d/metrics", self._metrics_host, self.metrics_port)

    def _stop_metrics(self) -> None:
        server, self._metrics_server = self._metrics_server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def _register_schedules(self, tx: Tx) -> list[str]:
        """Register every ``@schedule`` of the worker's registry; return their ids."""
        rows = runs.registry_schedules(self.registry)
        for row in rows:
            self._engine.register_schedule(tx, row, from_code=True)
        return [row.id for row in rows]

    def _fetch_lanes_then_shutdown(self) -> None:
        try:
            self._fetch_lanes()
        except Exception as exc:  # noqa: BLE001 - any failure stops the worker, loudly
            self._crashed("fetch", exc)
        finally:
            self._shutdown()

    def _fetch_lanes(self) -> None:
        """Run the first lane's fetch loop on this thread, the other's on a thread of its
        own (joined by the shutdown before it releases anything)."""
        for lane in self._lanes[1:]:
            self._spawn(functools.partial(self._fetch_loop, lane), f"fetch-{lane.name}")
            self._fetchers.append(self._threads[-1])
        self._fetch_loop(self._lanes[0])

    def _register(self, *, refuse_conflicts: bool) -> None:
        ignored = self._tx(
            lambda tx: self._engine.register_worker(
                tx,
                worker_id=self.id,
                host=socket.gethostname(),
                pid=os.getpid(),
                queues=self.queues,
                # the registry's column is an integer: two lanes at their largest caps
                concurrency=min(sum(lane.cap for lane in self._lanes), INT32_MAX),
                identities=self.serving.identities,
                versions=self.serving.versions,
                refuse_conflicts=refuse_conflicts,
            )
        )
        for row in ignored:
            log.error(
                "kind %r: this worker has %s, live worker %s serves %s: they will run each "
                "other's steps (see the versioning guide)",
                row["kind"],
                row["mine"],
                row["worker_id"],
                row["theirs"],
            )
        self._registered = True

    def _shutdown(self) -> None:
        self._stopping.set()
        deadline = time.monotonic() + self.grace
        self._wake_lanes()
        for fetcher in self._fetchers:  # no claim may land after the leases are released
            fetcher.join()
        while time.monotonic() < deadline:
            with self._inflight_lock:
                if not self._inflight and not self._committing():
                    break
            time.sleep(0.02)
        with self._inflight_lock:
            committing = self._committing()
            left = [f for f in self._inflight.values() if not f.settled]
            for entry in left:
                entry.settled = True
            self._inflight.clear()
        for entry in left:
            self._stop_handler(entry)
        if committing:
            log.warning(
                "%d transactional steps decided within the grace were still committing at "
                "its end; a commit that does not land leaves its lease to expire",
                len(committing),
            )
        if left:
            leases = [(f.step.id, f.step.generation) for f in left]
            try:
                released = self._tx(lambda tx: self._engine.release(tx, leases))
                log.info("released %d leases at shutdown", len(released))
                if self._observer is not None:
                    self._observer.on_released(released)
            except DatabaseError:
                log.exception("could not release leases; they will expire and be reclaimed")
        if self._registered:
            try:
                self._tx(lambda tx: self._engine.stop_worker(tx, self.id))
            except DatabaseError as exc:
                log.warning("could not record the stop in the worker registry: %s", exc)
        self._outcomes.put(None)
        self._closing.set()
        self._children_due.set()  # wakes the housekeeper, which then sees the close
        self._check_now.set()
        poke(self._listen_wake)  # the listener closes its connection before stop returns
        for thread in self._threads:
            if thread is not threading.current_thread() and thread.name != "cyclone-asyncio":
                # A listener inside a connect or a ping to an unreachable server (up to 10
                # s) is left to end on its own: it needs nothing of what is closed below.
                thread.join(timeout=1 if thread.name == "cyclone-listen" else 10)
        if self._observer is not None:
            self._observer.on_listener(False)  # stopped: no wake-up is acted on any more
        self._close_runner()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._executor is not None:
            self._executor.shutdown()
        if self._pool is not None:
            self._pool.close()
        self._stop_metrics()
        with self._events_lock:
            if self._events_db is not None:
                self._events_db.close()
            self._events_closed = True
        self._lifecycle = "stopped"
        self._stopped.set()
        log.info("worker %s stopped", self.id)

    def _committing(self) -> list[_Inflight]:
        """Transactional steps decided here whose transaction has not ended: their
        completion is in it (call with the in-flight lock held)."""
        return [e for e in self._running.values() if e.decided_here]

    def _run_loop(self) -> None:
        """The async handlers' event loop, closed once the stop ends it.

        A task that raises ``SystemExit`` or ``KeyboardInterrupt`` (a helper task a handler
        started, which :func:`execute.contained` cannot wrap) ends ``run_forever``: the
        task keeps the exception, so the handler awaiting it fails with it, and the loop
        runs on. (Signals reach the main thread only: nothing else stops this loop.)
        """
        loop = self._loop
        assert loop is not None
        try:
            while True:
                try:
                    loop.run_forever()
                    return
                except (SystemExit, KeyboardInterrupt) as exc:
                    log.error(
                        "a task on the async handlers' loop raised %s; the handler awaiting "
                        "it fails, the worker goes on",
                        type(exc).__name__,
                    )
        finally:
            loop.close()

    def _close_runner(self) -> None:
        runner, loop = self._runner, self._loop
        if runner is None:
            return
        runner.close()
        if loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(runner.aclose(), loop).result(timeout=10)
            except (concurrent.futures.TimeoutError, RuntimeError) as exc:
                log.warning("closing the async handlers' pool failed: %s", exc)

    # -- claiming and running ----------------------------------------------------------

    def _tx(self, work: Any) -> Any:
        return in_transaction(self._pool, work)

    def _fetch_loop(self, lane: Lane) -> None:
        """Claim the lane's kinds while its slots are free; dispatch what comes back."""
        backoff = 0.0
        slots = lane.slots
        lane.begin()
        while not self._stopping.is_set():
            self._adapt(lane)
            free = 0
            while free < self.batch_size and slots.acquire():
                free += 1
            if free == 0:
                waiting = time.monotonic()
                if not slots.acquire(timeout=adaptive.INTERVAL_S):
                    lane.slot_wait += time.monotonic() - waiting
                    continue  # still busy: adapt, and look at the stop
                free = 1
                if self._stopping.is_set():
                    slots.release()
                    break
                # Busy: let a few more slots free up so claims go in batches, not one by one.
                settle = time.monotonic() + CLAIM_SETTLE_S
                while free < min(self.batch_size, slots.limit // 2):
                    if slots.acquire(timeout=settle - time.monotonic()):
                        free += 1
                    else:
                        break
                lane.slot_wait += time.monotonic() - waiting
            lane.wake.clear()
            with self._claim_lock:
                if self._stopping.is_set():
                    slots.release(free)
                    break
                asked_at = time.monotonic()
                try:
                    claimed = in_autocommit(self._pool, self._claimer(lane.kinds, free))
                    backoff = 0.0
                except ConnectionFailure as exc:
                    claimed = []
                    backoff = min(5.0, max(0.2, backoff * 2))
                    log.warning("claim failed (%s); retrying in %.1fs", exc, backoff)
                lane.claims += 1
                lane.asked += free
                lane.claimed += len(claimed)
                lane.last_claim_full = len(claimed) >= free
                if len(claimed) < free:
                    slots.release(free - len(claimed))
                if claimed:
                    self._dispatch_claimed(claimed, asked_at + self.lease.total_seconds())
            if backoff:
                self._stopping.wait(backoff)
            elif not claimed or len(claimed) < free:
                # A rate window frees slots without any event: rated work is looked at often.
                lane.wake.wait(
                    min(self.poll_interval, RATED_POLL_S) if self._rated else self.poll_interval
                )

    def _dispatch_claimed(self, claimed: list[Claimed], lease_until: float) -> None:
        claimed_at = time.monotonic()
        if self._observer is not None:
            if self._tracing is not None:
                self._start_spans(claimed)
            self._observer.on_claimed(claimed)
        starts: list[_Start] = []
        for step in claimed:
            self._dispatch(step, claimed_at, lease_until, starts)
        if starts:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._start_async, starts)

    def _start_spans(self, claimed: list[Claimed]) -> None:
        """Start the attempts' spans; the steps run untraced if that fails (a span
        processor's error, a lost connection reading their trace contexts)."""
        try:
            self._tracing.start_attempts(claimed, self._trace_contexts(claimed))
        except Exception:
            log.exception("could not start the spans of %d claimed steps", len(claimed))

    def _adapt(self, lane: Lane) -> None:
        """Move the lane's slot limit, once per interval, from what the last one showed."""
        moved = lane.adapt()
        if moved is not None:
            before, limit, sample = moved
            log.debug(
                "worker %s: %s concurrency %d -> %d (%s)",
                self.id,
                lane.name,
                before,
                limit,
                sample,
            )

    def _refresh_serving(self) -> None:
        """Serve the workflows this process defined since the worker started, too."""
        if self._also is None or len(self._also.workflows) == self._also_count:
            return
        self._also_count = len(self._also.workflows)
        self.serving = serving_of(self.registry, also=self._also)
        self._gated = self._has_limits()
        self._register(refuse_conflicts=False)

    def _has_limits(self) -> bool:
        """Whether a limit (concurrency, rate) applies to work this worker may claim: then
        its claims take the gated path too."""
        workflows = [*self.registry.workflows.values()]
        if self._also is not None:
            served = {name for name, _ in self.serving.versions}
            workflows += [w for name, w in self._also.workflows.items() if name in served]
        return any(h.concurrency or h.rate_limit for h in self.handlers.values()) or any(
            w.concurrency for w in workflows
        )

    def _claimer(self, kinds: list[str], limit: int) -> Callable[[Tx], list[Claimed]]:
        self._refresh_serving()
        queues = self._rotated_queues()
        per_queue = self._queue_room()
        return lambda tx: self._engine.claim(
            tx,
            owner=self.id,
            queues=queues,
            kinds=kinds,
            versions=self.serving.versions,
            limit=limit,
            lease=self.lease,
            gated=self._gated or bool(self._gated_queues),
            capped=self._capped,
            per_queue=per_queue,
            cursors=self._cursors,
        )

    def _queue_room(self) -> dict[str, int] | None:
        """How many more steps each queue with a per-worker limit may start now."""
        if not self.queue_limits:
            return None
        with self._inflight_lock:
            busy = collections.Counter(e.step.queue for e in self._running.values())
        return {queue: max(0, cap - busy[queue]) for queue, cap in self.queue_limits.items()}

    def refresh_queue_caps(self) -> frozenset[str]:
        """Read which of this worker's queues have a cap across all workers (every few
        seconds: a cap set or removed with Client.set_queue_limit takes effect then), and
        whether they hold limited work: work queued under an earlier deploy's limits waits
        for the gated claim even when this deploy's definitions dropped them."""

        def read(tx: Tx) -> tuple[dict[str, int], set[str]]:
            return self._engine.queue_caps(tx), self._engine.queues_with_gates(tx, self.queues)

        caps, gated = self._tx(read)
        capped = frozenset(caps) & frozenset(self.queues)
        changed = (capped, frozenset(gated)) != (self._capped, self._gated_queues)
        self._capped, self._gated_queues = capped, frozenset(gated)
        if changed:  # a claim that found nothing under the old view may find work now
            self._wake_lanes()
        return self._capped

    def _rotated_queues(self) -> list[str]:
        """The queues, starting from the next one each claim, so none is starved."""
        self._queue_turn = (self._queue_turn + 1) % len(self.queues)
        return self.queues[self._queue_turn :] + self.queues[: self._queue_turn]

    def _dispatch(
        self, step: Claimed, claimed_at: float, lease_until: float, starts: list[_Start]
    ) -> None:
        """Start the step's handler (an async one: add it to ``starts``, which the loop
        starts together)."""
        handler = self.handlers[step.kind]
        deadline = time.monotonic() + step.timeout_s if step.timeout_s else None
        ctx = execute.make_context(
            step,
            lambda: self._beat(step),
            lambda kind, text: self._record_event(step, kind, text),
        )
        lane = self._lane_of[step.kind]
        entry = _Inflight(step, ctx, deadline, lane, claimed_at, lease_until)
        with self._inflight_lock:
            self._inflight[_claim_key(step)] = entry
            self._running[_claim_key(step)] = entry
            lane.running += 1
            lane.peak = max(lane.peak, lane.running)
        try:
            args = execute.call_arguments(self.serving, handler.fn, step)
        except (TypeError, ValueError, KeyError) as exc:  # cannot build the call
            if self._observer is not None:
                self._observer.on_finished(step, "failed", 0.0)
            self._settle(entry, execute.failure_from_exception(step, exc, kind=ErrorKind.ERROR))
            self._handler_returned(entry)
            return
        kwargs = {"ctx": entry.ctx} if self._takes_ctx[step.kind] else {}
        if handler.transactional:
            self._dispatch_transactional(entry, handler, args, kwargs)
            return
        keep = handler.keep_output
        if handler.is_async:
            starts.append((entry, handler.fn, args, kwargs, keep))
            return
        assert self._executor is not None
        self._executor.submit(
            lambda f: self._on_done(entry, f, keep), self._call, entry, handler.fn, args, kwargs
        )

    def _may_start(self, entry: _Inflight) -> bool:
        """Whether to start the step's handler now: not once the step was decided (timed
        out, cancelled, its lease lost). When its lease may have passed by this process's
        clock (the process was stopped, or its heartbeats failed, since the claim), the
        lease is renewed first: another worker may have taken the step over, and would
        see its side effects twice. A lease that is not ours any more (or that cannot be
        renewed) leaves the step to the lease scanner."""
        failpoint("worker.before_start")
        if entry.settled or time.monotonic() < entry.lease_until or self._still_held(entry):
            return not entry.settled
        if self._settle(entry, None):
            log.warning(
                "step %s (run %s, node %r): not started, its lease passed before the "
                "handler could start (claimed %.1fs ago: the process was stopped or its "
                "heartbeats failed); it runs again once the lease expires",
                entry.step.id,
                entry.step.run_id,
                entry.step.node,
                time.monotonic() - entry.claimed_at,
                extra=logs.step_fields(entry.step),
            )
            if self._observer is not None:
                self._observer.on_fenced([entry.step.id])
        return not entry.settled

    def _still_held(self, entry: _Inflight) -> bool:
        """Renew the lease of a step not started yet; whether it is still this worker's."""
        try:
            return self._renew_one(entry)
        except DatabaseError as exc:
            log.warning(
                "step %s: could not renew its lease before its start: %s", entry.step.id, exc
            )
            return False

    def _call(
        self, entry: _Inflight, fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]
    ) -> Any:
        """Run a sync handler on this handler thread, its step in scope of the logs."""
        if not self._may_start(entry):
            raise _NotStarted
        token = logs.enter(entry.step)
        try:
            if self._observer is not None:
                self._started(entry, self._observer)
            if entry.lane.controller is None:
                return fn(*args, **kwargs)
            cpu = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                entry.lane.handler_cpu.append(time.thread_time() - cpu)
        finally:
            logs.leave(token)

    @staticmethod
    def _started(entry: _Inflight, observer: WorkerObserver) -> None:
        entry.started_at = time.monotonic()
        observer.on_started(entry.step, entry.started_at - entry.claimed_at)

    def _finished(self, entry: _Inflight, outcome: str, at: float | None = None) -> None:
        if self._observer is not None:
            ended = at if at is not None else time.monotonic()
            duration = ended - entry.started_at if entry.started_at else 0.0
            self._observer.on_finished(entry.step, outcome, duration)

    def _runs_ended(self, rows: list[Any], state: RunState) -> None:
        """The engine's hook: note the runs a transaction of this worker ends."""
        ended = _ENDED_RUNS.get()
        if ended is not None:
            ended.extend(EndedRun.from_row(row, state.value) for row in rows if "workflow" in row)

    def _collecting(self, work: Callable[[Tx], Any]) -> tuple[Any, list[EndedRun]]:
        """Run ``work`` in a transaction; return its result and the runs it ended."""
        ended: list[EndedRun] = []
        token = _ENDED_RUNS.set(ended)
        try:
            return self._tx(work), ended
        finally:
            _ENDED_RUNS.reset(token)

    def _dispatch_transactional(
        self, entry: _Inflight, handler: StepDef[Any, Any], args: list[Any], kwargs: dict[str, Any]
    ) -> None:
        assert self._runner is not None
        runner = self._runner
        call = Call(
            step=entry.step,
            fn=handler.fn,
            args=args,
            kwargs=kwargs,
            ctx=entry.ctx,
            keep_output=handler.keep_output,
            reserved_units=handler.rate_limit.units if handler.rate_limit else None,
            isolation=handler.isolation,
            decide=lambda: self._decide(entry),
            attach=entry.attach,
            hold_lease=lambda held: self._hold_lease_in_transaction(entry, held),
            may_start=lambda: not entry.settled and not _late(entry),
        )
        if handler.is_async:
            assert self._loop is not None

            async def run_async() -> object:
                if not self._may_start(entry):
                    raise _NotStarted
                entry.task = task = asyncio.current_task()
                assert task is not None
                self._arm_timeout(entry, task)
                self._enter_transactional(entry)  # the task's own context: no reset
                return await runner.run_async(call)

            future = asyncio.run_coroutine_threadsafe(run_async(), self._loop)
            future.add_done_callback(lambda f: self._on_transaction_done(entry, f))
        else:
            assert self._executor is not None
            self._executor.submit(
                lambda f: self._on_transaction_done(entry, f),
                self._call_transactional,
                entry,
                runner,
                call,
            )

    def _enter_transactional(self, entry: _Inflight) -> None:
        """Put the step in scope of the logs, and collect the runs its transaction ends."""
        logs.enter(entry.step)
        if self._observer is not None:
            entry.ended_runs = []
            _ENDED_RUNS.set(entry.ended_runs)
            self._started(entry, self._observer)

    def _call_transactional(
        self, entry: _Inflight, runner: TransactionalRunner, call: Call
    ) -> object:
        return contextvars.copy_context().run(self._run_transactional, entry, runner, call)

    def _run_transactional(
        self, entry: _Inflight, runner: TransactionalRunner, call: Call
    ) -> object:
        if not self._may_start(entry):
            raise _NotStarted
        self._enter_transactional(entry)
        return runner.run(call)

    def _record_event(self, step: Claimed, kind: str, text: str) -> None:
        """Store one event of a running handler: with the events other handlers emit at the
        same moment, in one statement on the events connection (in autocommit: the batch
        commits, then its notifications go); returns once it is committed."""

        with self._inflight_lock:  # settled (timed out, cancelled, lease lost): fenced
            entry = self._inflight.get(_claim_key(step))
            decided = entry is None or entry.settled
        event = NewEvent(
            step_id=step.id,
            generation=step.generation,
            attempt=step.attempt + 1,
            kind=kind,
            payload_text=text,
            decided=decided,
        )
        with self._events_lock:
            closed = self._events_closed
            if not closed and self._events_db is None:
                db = PooledDatabase(
                    self._dsn,
                    name=f"cyclone-emit-{os.getpid()}",
                    max_size=EVENT_CONNECTIONS,
                    pooled=self.pooled,
                )
                self._events_db = db
                self._event_batcher = EventBatcher(functools.partial(self._write_events, db))
            batcher = self._event_batcher
        if closed or batcher is None:
            (outcome,) = self._write_events(None, [event])
            if isinstance(outcome, EventLimitExceeded):
                raise outcome
            return
        batcher.record(event)

    def _write_events(self, db: PooledDatabase | None, batch: Sequence[NewEvent]) -> list[Outcome]:
        """Write a batch of events on the events pool ``db``; once the worker's stop closed
        it (a handler that outlived the stop, or a batch queued when the stop came), on a
        connection of its own: the events are kept all the same (fenced: the stop released
        their leases)."""
        cap = self.max_events_per_step

        def write(tx: Tx) -> list[Outcome]:
            return self._engine.record_events(tx, batch, cap=cap)

        if db is not None and not db.is_closed():
            try:
                return db.transaction(write, one_statement=True)
            except ClientClosed:
                pass  # closed by the stop while this batch waited for its connection
        late = PooledDatabase(
            self._dsn, name=f"cyclone-emit-{os.getpid()}", max_size=1, pooled=self.pooled
        )
        try:
            return late.transaction(write, one_statement=True)
        finally:
            late.close()

    def _decide(self, entry: _Inflight) -> bool:
        """Take the decision of a transactional step for its own transaction (False: a
        timeout, a cancel or a lost lease decided it already)."""
        with self._inflight_lock:
            if entry.settled or _late(entry):  # late: the heartbeat loop times it out
                return False
            entry.settled = True
            entry.decided_here = True
            self._inflight.pop(_claim_key(entry.step), None)
        return True

    def _on_transaction_done(self, entry: _Inflight, future: Settled) -> None:
        """A transactional handler's transaction ended: count its commit, record the failure
        it left, or (when the handler raised) record that like any handler's failure."""
        try:
            if future.cancelled() or future.exception() is not None:
                self._on_done(entry, future, keep_output=False)
                return
            result = future.result()
            if self._observer is not None:
                self._transaction_observed(entry, result, self._observer)
            if result is COMMITTED:
                with self._count_lock:
                    self._completed += 1
            elif isinstance(result, Failure):
                if self._observer is not None:
                    self._observer.on_failure(entry.step, result.error_kind, result.error)
                self._outcomes.put(
                    attrs.evolve(result, wake_queue=entry.step.queue)
                    if entry.step.gated
                    else result
                )
        finally:
            self._handler_returned(entry)

    def _transaction_observed(
        self, entry: _Inflight, result: object, observer: WorkerObserver
    ) -> None:
        step_id = entry.step.id
        if result is COMMITTED:
            self._finished(entry, "returned")
            observer.on_completed([step_id])
            if entry.ended_runs:
                observer.on_runs_ended(entry.ended_runs)
        elif result is DROPPED:
            self._finished(entry, "abandoned")
            if entry.decided_here:  # fenced at completion (else counted where it was decided)
                observer.on_fenced([step_id])
        else:
            self._finished(entry, "failed")

    def _start_async(self, starts: list[_Start]) -> None:
        """Start the tasks of async handlers (on the loop's thread, one call per claim)."""
        assert self._loop is not None
        for entry, fn, args, kwargs, keep_output in starts:
            if not self._may_start(entry):
                self._finished(entry, "timeout" if entry.timed_out else "abandoned")
                self._handler_returned(entry)
                continue
            try:
                task = self._loop.create_task(self._run_async(entry, fn, args, kwargs))
            except Exception as exc:  # noqa: BLE001 - the step fails, the worker goes on
                self._settle(
                    entry, execute.failure_from_exception(entry.step, exc, kind=ErrorKind.ERROR)
                )
                self._handler_returned(entry)
                continue
            entry.task = task
            task.add_done_callback(functools.partial(self._on_async_done, entry, keep_output))
            self._arm_timeout(entry, task)

    def _arm_timeout(self, entry: _Inflight, task: asyncio.Task[Any]) -> None:
        """Fail the step of an async handler's ``task`` when its timeout passes, on time
        (the heartbeat loop looks every 0.1 s, and still fails the step if a handler blocks
        the loop past its timeout). No ``asyncio.wait_for``: it runs the handler in a task
        of its own, which outlives a cancellation the handler swallows."""
        if entry.deadline is None or self._loop is None:
            return
        timer = self._loop.call_later(
            max(0.0, entry.deadline - time.monotonic()), self._fail_by_timeout, entry
        )
        task.add_done_callback(functools.partial(_cancel_timer, timer))

    def _on_async_done(self, entry: _Inflight, keep_output: bool, task: asyncio.Task[Any]) -> None:
        """An async handler's task ended (on the loop's thread): decide and free its slot
        now; a completer encodes its output."""
        if task.cancelled() or task.exception() is not None:
            self._on_done(entry, task, keep_output)
            return
        try:
            if _late(entry):  # it swallowed its cancellation, or returned just past its timeout
                if self._settle(entry, execute.timeout_failure(entry.step)):
                    self._finished(entry, "timeout")
                else:
                    self._finished(entry, "abandoned")
            elif not self._settle(
                entry, _Returned(entry, task.result(), keep_output, time.monotonic())
            ):
                self._finished(entry, "abandoned")  # timed out, cancelled or lease lost
        finally:
            self._handler_returned(entry)

    def _outcome_of(self, item: Success | Failure | _Returned) -> Success | Failure:
        """The outcome to commit: an async handler's output encoded here, on a completer."""
        if not isinstance(item, _Returned):
            return item
        entry, step = item.entry, item.entry.step
        rate = self.handlers[step.kind].rate_limit
        try:
            outcome = execute.success_from_result(
                step,
                item.result,
                keep_output=item.keep_output,
                max_bytes=self.max_output_bytes,
                extra_units=execute.extra_units(entry.ctx, rate.units) if rate else 0,
            )
        except Exception as exc:  # noqa: BLE001 - an output that cannot be encoded fails its step
            outcome = execute.failure_from_exception(step, exc, kind=ErrorKind.ERROR)
        self._finished(entry, "returned" if isinstance(outcome, Success) else "failed", item.at)
        if isinstance(outcome, Failure) and self._observer is not None:
            self._observer.on_failure(step, outcome.error_kind, outcome.error)
        if step.gated:  # its end frees a slot: claimers of its queue look again
            outcome = attrs.evolve(outcome, wake_queue=step.queue)
        return outcome

    async def _run_async(
        self, entry: _Inflight, fn: Any, args: list[Any], kwargs: dict[str, Any]
    ) -> Any:
        entry.task = asyncio.current_task()
        logs.enter(entry.step)  # the task's own context: no reset
        if self._observer is not None:
            self._started(entry, self._observer)
        return await execute.contained(fn(*args, **kwargs))  # timed by _arm_timeout

    def _on_done(self, entry: _Inflight, future: Settled, keep_output: bool) -> None:
        """The handler returned (or raised, or its task was cancelled): record, free the slot."""
        try:
            if entry.settled:
                self._finished(entry, "timeout" if entry.timed_out else "abandoned")
                return  # timed out, cancelled or lease lost: already decided
            step = entry.step
            exc = asyncio.CancelledError() if future.cancelled() else future.exception()
            if isinstance(exc, asyncio.CancelledError) and entry.ctx.cancelled:
                outcome: Success | Failure | None = None  # cancelled by us: decided elsewhere
                self._finished(entry, "abandoned")
            elif _late(entry):
                # Its timeout passed, and the handler ended before the worker's timer or
                # heartbeat loop failed it. A TimeoutError raised before then is the
                # handler's own, an error like any other; so is a CancelledError the worker
                # did not cause (a library cancelled a future).
                outcome = execute.timeout_failure(step)
                self._finished(entry, "timeout")
            elif exc is not None:
                outcome = execute.failure_from_exception(step, exc, kind=ErrorKind.ERROR)
                self._finished(entry, "failed")
            else:
                rate = self.handlers[step.kind].rate_limit
                outcome = execute.success_from_result(
                    step,
                    future.result(),
                    keep_output=keep_output,
                    max_bytes=self.max_output_bytes,
                    extra_units=execute.extra_units(entry.ctx, rate.units) if rate else 0,
                )
                self._finished(entry, "returned" if isinstance(outcome, Success) else "failed")
            self._settle(entry, outcome)
        finally:
            self._handler_returned(entry)

    def _settle(self, entry: _Inflight, outcome: Success | Failure | _Returned | None) -> bool:
        """Decide a step's outcome once (``None``: abandon it, its lease is gone); False
        when it was decided already."""
        with self._inflight_lock:
            if entry.settled:
                return False
            entry.settled = True
            self._inflight.pop(_claim_key(entry.step), None)
        if isinstance(outcome, _Returned):
            self._outcomes.put(outcome)  # a completer makes it a Success or a Failure
        elif outcome is not None:
            if self._observer is not None and isinstance(outcome, Failure):
                self._observer.on_failure(entry.step, outcome.error_kind, outcome.error)
            if entry.step.gated:  # its end frees a slot: claimers of its queue look again
                outcome = attrs.evolve(outcome, wake_queue=entry.step.queue)
            self._outcomes.put(outcome)
        return True

    def _handler_returned(self, entry: _Inflight) -> None:
        """Free the handler's slot, exactly once, when it has really returned."""
        with self._inflight_lock:
            if entry.returned:
                return
            entry.returned = True
            self._running.pop(_claim_key(entry.step), None)
            entry.lane.running -= 1
            entry.lane.returned += 1
        if entry.stuck_reported:
            log.info(
                "step %s (kind %r): the handler returned after its timeout; its slot is free",
                entry.step.id,
                entry.step.kind,
                extra=logs.step_fields(entry.step),
            )
        entry.lane.slots.release()
        if entry.step.queue in self.queue_limits:
            # This worker's room in that queue is back: a claim that stopped at the limit
            # must not wait for the next poll.
            entry.lane.wake.set()

    def _stop_handler(self, entry: _Inflight) -> None:
        """Ask a handler to stop: set ``ctx.cancelled``; cancel an async handler's task;
        interrupt the statement a sync transactional handler runs (it rolls back)."""
        entry.ctx._cancelled.set()
        task, loop = entry.task, self._loop
        if task is not None and loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the task is gone
                loop.call_soon_threadsafe(task.cancel)
        with entry.connection_lock:
            if entry.connection is not None:
                interrupt(entry.connection)

    # -- completions -------------------------------------------------------------------

    def _complete_loop(self) -> None:
        while True:
            first = self._outcomes.get()
            if first is None:
                self._outcomes.put(None)  # for the other completers
                return
            batch = [self._outcome_of(first)]
            while len(batch) < self.batch_size:
                try:
                    item = self._outcomes.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._outcomes.put(None)
                    break
                batch.append(self._outcome_of(item))
            self._commit(batch)

    def _commit(self, batch: list[Success | Failure]) -> None:
        """Commit outcomes: successes then failures, each group in one transaction.

        A lost connection is retried until it works (replaying is safe: a
        step that did complete is no longer running at this generation, so
        the replay is fenced). Any other database error would poison the whole
        batch, so the batch is split and the offending outcome turned into a
        final failure of its own step instead of wedging the rest.
        """
        successes = [o for o in batch if isinstance(o, Success)]
        failures = [o for o in batch if isinstance(o, Failure)]
        for group in (successes, failures):
            if group:
                self._commit_group(group)

    def _commit_group(self, group: Sequence[Success | Failure]) -> None:
        delay = 0.2
        while True:
            try:
                self._apply(group)
                return
            except ConnectionFailure as exc:
                log.warning("committing outcomes failed (%s); retrying in %.1fs", exc, delay)
                time.sleep(delay)
                delay = min(10.0, delay * 2)
            except (DatabaseError, UnicodeError) as exc:
                # UnicodeError: a text psycopg cannot encode for the server, raised before
                # anything is sent; like a refusal, it is this outcome's, not the batch's.
                if len(group) > 1:
                    for outcome in group:
                        self._commit_group([outcome])
                    return
                self._apply_poisoned(group[0], exc)
                return

    def _apply(self, group: Sequence[Success | Failure]) -> None:
        successes = [o for o in group if isinstance(o, Success)]
        failures = [o for o in group if isinstance(o, Failure)]
        observer = self._observer
        ended: list[EndedRun] = []
        if successes:
            done: set[int]
            if observer is None:
                done = self._tx(lambda tx: self._engine.complete(tx, successes))
            else:
                done, ended = self._collecting(lambda tx: self._engine.complete(tx, successes))
            with self._count_lock:  # two completers: += is not atomic
                self._completed += len(done)
            if len(done) < len(successes):
                log.info(
                    "%d completions fenced out (lease lost or run ended)",
                    len(successes) - len(done),
                )
            if observer is not None:
                self._observe_outcomes(observer, successes, done, ended)
        if failures:
            if observer is None:
                self._tx(lambda tx: self._engine.fail(tx, failures))
            else:
                states, ended = self._collecting(lambda tx: self._engine.fail(tx, failures))
                self._observe_outcomes(observer, failures, states, ended)

    @staticmethod
    def _observe_outcomes(
        observer: WorkerObserver,
        outcomes: Sequence[Success | Failure],
        applied: set[int] | dict[int, str],
        ended: list[EndedRun],
    ) -> None:
        if isinstance(applied, dict):
            retried = [i for i, state in applied.items() if state != "discarded"]
            failed = [i for i, state in applied.items() if state == "discarded"]
            if retried:
                observer.on_failed(retried, retried=True)
            if failed:
                observer.on_failed(failed, retried=False)
        elif applied:
            observer.on_completed(applied)
        if len(applied) < len(outcomes):
            # Applied ids are matched one outcome each: a step reclaimed and claimed here
            # again may have both its claims' outcomes in a batch, and one was fenced.
            unmatched = set(applied)
            fenced = []
            for outcome in outcomes:
                if outcome.step_id in unmatched:
                    unmatched.discard(outcome.step_id)
                else:
                    fenced.append(outcome.step_id)
            observer.on_fenced(fenced)
        if ended:
            observer.on_runs_ended(ended)

    def _apply_poisoned(
        self, outcome: Success | Failure, exc: DatabaseError | UnicodeError
    ) -> None:
        """The database refused this outcome: fail its step for good, with the reason."""
        log.error("step %s: the database refused its outcome: %s", outcome.step_id, exc)
        final = Failure(
            step_id=outcome.step_id,
            generation=outcome.generation,
            error=payload.sanitize_text(f"the database refused the step's outcome: {exc}"),
            error_kind=ErrorKind.INVALID_OUTPUT.value,
            retry=False,
        )
        try:
            states = self._tx(lambda tx: self._engine.fail(tx, [final]))
            if self._observer is not None:
                self._observe_outcomes(self._observer, [final], states, [])
        except DatabaseError:
            log.exception(
                "step %s: could not record its failure; its lease will expire", final.step_id
            )
            if self._observer is not None:  # settled here: nothing else will
                self._observer.on_fenced([final.step_id])

    # -- leases --------------------------------------------------------------------------

    def _beat(self, step: Claimed) -> bool:
        """``ctx.heartbeat()``: False once the step was decided here (timed out, cancelled,
        lost: its result is ignored) or the worker stopped, else whether the lease is held."""
        entry = self._inflight.get(_claim_key(step))
        if entry is None or entry.settled or self._pool is None or self._pool.closed:
            return False
        return self._renew_one(entry)

    def _renew_one(self, entry: _Inflight) -> bool:
        """Renew one step's lease now; whether it is still this worker's."""
        held = self._tx(lambda tx: self._renew(tx, [entry], [entry.step]))
        return _claim_key(entry.step) in held

    def _renew(
        self, tx: Tx, entries: list[_Inflight], steps: list[Claimed]
    ) -> set[tuple[int, int]]:
        """Renew the leases of these steps (``entries`` are their in-flight entries, where
        known); return the claims (id, generation) still held: a step reclaimed and claimed
        here again is held by its new claim only, and its old one is lost. A lease held by
        its handler's open transaction is only checked: an update of its row would
        conflict with that transaction."""
        in_transaction = {_claim_key(e.step) for e in entries if e.lease_in_transaction}
        renewed = [_claim_key(s) for s in steps if _claim_key(s) not in in_transaction]
        checked = [_claim_key(s) for s in steps if _claim_key(s) in in_transaction]
        sent = time.monotonic()
        held = self._engine.heartbeat(tx, renewed, self.lease)
        until = sent + self.lease.total_seconds()
        for entry in entries:
            if _claim_key(entry.step) in held:
                entry.lease_until = max(entry.lease_until, until)
        return held | self._engine.leases_held(tx, checked)

    def _hold_lease_in_transaction(self, entry: _Inflight, held: bool) -> None:
        """Mark the step's lease as held by its handler's transaction (or no longer, once it
        ended: a renewal may then come at any time). Under the lease lock: a heartbeat that
        read the step as renewable has committed before the transaction takes its
        snapshot, and none starts after."""
        if not held:
            entry.lease_in_transaction = False
            return
        with self._lease_lock:
            entry.lease_in_transaction = True

    def _heartbeat_loop(self) -> None:
        interval = max(0.05, self.lease.total_seconds() / 3)
        conn, self._heartbeat_conn = self._heartbeat_conn, None
        next_beat = time.monotonic() + interval
        while not self._closing.is_set():
            woken = self._check_now.wait(min(0.1, interval))
            if woken:
                self._check_now.clear()
            now = time.monotonic()
            with self._inflight_lock:
                entries = [e for e in self._inflight.values() if not e.settled]
                running = list(self._running.values())
                cancelled_runs, self._cancel_runs = self._cancel_runs, set()
            self._time_out(entries, now)
            self._report_stuck(running, now)
            if now >= next_beat:
                next_beat = now + interval
                due = [e for e in entries if not e.settled]
            else:
                due = [e for e in entries if not e.settled and e.step.run_id in cancelled_runs]
            if not due:
                continue
            try:
                if conn is None or conn.closed:
                    conn = connect(
                        self._dsn, name=f"cyclone-heartbeat-{os.getpid()}", pooled=self.pooled
                    )
                tx = ConnectionTx(conn)
                with self._lease_lock:
                    held = self._renew(tx, due, [e.step for e in due])
                lost = [e for e in due if _claim_key(e.step) not in held and not e.settled]
                states = self._engine.lease_states(tx, [e.step.id for e in lost]) if lost else {}
            except DatabaseError as exc:
                log.warning("heartbeat failed: %s", exc)
                if conn is not None and conn.broken:  # else kept: its session is reserved
                    conn.close()
                    conn = None
                continue
            for entry in lost:
                self._lost(entry, states.get(entry.step.id))
        if conn is not None:
            conn.close()

    def _time_out(self, entries: list[_Inflight], now: float) -> None:
        """Fail steps whose timeout passed; their handlers are asked to stop."""
        for entry in entries:
            # Decide first: a transactional handler that took its decision is committing,
            # and must not be interrupted.
            if entry.deadline is not None and now > entry.deadline:
                self._fail_by_timeout(entry)

    def _fail_by_timeout(self, entry: _Inflight) -> None:
        """Fail a step whose timeout passed, and ask its handler to stop (``ctx.cancelled``
        first, then an async handler's task is cancelled). Its slot stays taken until the
        handler really returns (an async one that swallows the cancellation still runs)."""
        if self._settle(entry, execute.timeout_failure(entry.step)):
            entry.timed_out = True
            self._stop_handler(entry)

    def _report_stuck(self, running: list[_Inflight], now: float) -> None:
        for entry in running:
            late = entry.deadline is not None and now > entry.deadline + STUCK_REPORT_S
            if late and not entry.stuck_reported and not entry.returned:
                entry.stuck_reported = True
                log.warning(
                    "step %s (run %s, node %r, kind %r): the handler is still running %.0fs "
                    "past its timeout, and holds its slot until it returns. A sync handler "
                    "cannot be interrupted: check ctx.cancelled in long loops.",
                    entry.step.id,
                    entry.step.run_id,
                    entry.step.node,
                    entry.step.kind,
                    now - (entry.deadline or now),
                    extra=logs.step_fields(entry.step),
                )

    def _lost(self, entry: _Inflight, state: str | None) -> None:
        step = entry.step
        if state == "cancelled":
            log.info(
                "step %s (run %s, node %r) was cancelled: stopping its handler",
                step.id,
                step.run_id,
                step.node,
                extra=logs.step_fields(step),
            )
        else:
            log.warning(
                "lease lost for step %s (run %s, node %r, now %s): result will be ignored",
                step.id,
                step.run_id,
                step.node,
                state or "gone",
                extra=logs.step_fields(step),
            )
        if self._settle(entry, None):
            if self._observer is not None:
                self._observer.on_fenced([step.id])
            self._stop_handler(entry)

    # -- wake-ups --------------------------------------------------------------------------

    def _listen_loop(self) -> None:
        if self.listen_dsn is None:
            log.warning(
                "worker %s: no LISTEN connection (the DSN is pooled and no listen_dsn is "
                "set): polling for work every %gs; give listen_dsn (CYCLONE_LISTEN_URL) a "
                "direct connection for wake-ups",
                self.id,
                self.poll_interval,
            )
            return
        listener = Listener(
            self.listen_dsn,
            name=f"cyclone-listen-{os.getpid()}",
            channels=(WORK_CHANNEL, CANCEL_CHANNEL),
        )
        assert self._listen_wake is not None  # made before this thread starts
        wake = self._listen_wake[0]
        delay = 0.5
        pinged = time.monotonic()
        try:
            while not self._stopping.is_set():
                try:
                    if not listener.connected:
                        listener.open()
                        if self._observer is not None:
                            self._observer.on_listener(True)
                        self._wake_lanes()  # LISTEN first, then rescan: nothing slips between
                        self._check_now.set()  # and a cancel missed while away is seen now
                        delay, pinged = 0.5, time.monotonic()
                    heard, _ = listener.wait(1.0, wake)
                    for channel, payload in heard:
                        if channel == CANCEL_CHANNEL:
                            self._heard_cancel(payload)
                        elif payload == CHILD_WAKE:
                            self._children_due.set()
                        elif payload in self.queues:
                            self._wake_lanes()
                    if time.monotonic() - pinged >= 1.0:
                        listener.ping()  # a dead or half-open connection shows up here
                        pinged = time.monotonic()
                except (ConnectionLost, DatabaseError) as exc:
                    listener.close()  # a statement error leaves it open: start anew
                    if self._observer is not None:
                        self._observer.on_listener(False)
                    if self._stopping.is_set():
                        return
                    log.warning("LISTEN connection lost (%s); reconnecting in %.1fs", exc, delay)
                    self._stopping.wait(delay)
                    delay = min(30.0, delay * 2)
        finally:
            if listener.connected and self._observer is not None:
                self._observer.on_listener(False)  # stopping: the connection is closed
            listener.close()
            for sock in self._listen_wake:  # this thread's own: closed once it is done
                sock.close()

    def _heard_cancel(self, payload: str) -> None:
        """Steps of these runs were cancelled: check this worker's leases of them at once."""
        runs = run_ids_of(payload)
        with self._inflight_lock:
            mine = {e.step.run_id for e in self._inflight.values()} & runs
            if not mine:
                return
            self._cancel_runs |= mine
        self._check_now.set()

    # -- the registry ------------------------------------------------------------------

    def _housekeeping_loop(self) -> None:
        """Beat in the worker registry; start child runs other processes could not; warn
        about work on this worker's queues that no one serves.

        The first beat comes a beat after the start, which registered the worker, read
        its queues' caps and started the deferred children (at once, it took a pool
        connection of its own beside the first claim and the scanner's first look)."""
        next_beat = time.monotonic() + REGISTRY_BEAT_S
        next_check = time.monotonic() + REGISTRY_BEAT_S
        while not self._closing.is_set():
            self._children_due.wait(max(0.0, next_beat - time.monotonic()))
            if self._stopping.is_set():
                self._closing.wait(0.1)
                continue  # stopping: the shutdown records the stop
            try:
                if self._children_due.is_set():
                    self._children_due.clear()
                    self.start_deferred_children()
                if time.monotonic() < next_beat:
                    continue
                next_beat = time.monotonic() + REGISTRY_BEAT_S
                if not self._tx(lambda tx: self._engine.beat_worker(tx, self.id)):
                    log.warning("worker %s was missing from the registry: registering", self.id)
                    self._register(refuse_conflicts=False)
                self.start_deferred_children()  # in case a wake-up was missed
                self.refresh_queue_caps()
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + UNSERVED_CHECK_S
                    self.report_unserved()
            except DatabaseError as exc:
                log.warning("worker housekeeping failed (%s); retrying", exc)

    def start_deferred_children(self) -> int:
        """Start child runs whose parent node waits in a run this worker serves, left by a
        process that did not have the child's definition; return how many."""
        started: int = self._tx(
            lambda tx: self._engine.start_deferred_children(tx, versions=self.serving.versions)
        )
        if started:
            log.info("started %d child runs left for a worker with their definition", started)
        return started

    def report_unserved(self) -> list[dict[str, Any]]:
        """Log (at most every 10 minutes per kind) the due work of this worker's queues that
        no live worker serves; return it."""
        rows: list[dict[str, Any]] = self._tx(
            lambda tx: self._engine.unserved_work(tx, queues=self.queues)
        )
        now = time.monotonic()
        for row in rows:
            key = (row["queue"], row["kind"], row["workflow"], row["def_version"])
            if now - self._unserved_reported.get(key, -1e9) < 600:
                continue
            self._unserved_reported[key] = now
            what = (
                f"standalone {row['kind']!r}"
                if row["def_version"] == "standalone"
                else f"child runs to start in workflow {row['workflow']!r} at {row['def_version']}"
                if row["kind"] == KIND_CHILD
                else f"kind {row['kind']!r} of workflow {row['workflow']!r} at {row['def_version']}"
            )
            log.warning(
                "queue %r: %d due steps (%s) wait, and no live worker serves them (the oldest "
                "since %s). Start a worker with that definition; see the versioning guide.",
                row["queue"],
                row["steps"],
                what,
                row["oldest"],
            )
        return rows
