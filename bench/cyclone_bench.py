"""Cyclone's side of each benchmark scenario, each on a fresh schema."""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import attrs
import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from bench import flows
from bench.cpu import Meter
from cyclone_dsl import AsyncClient, Client, Worker, migrate
from cyclone_dsl.db.connect import Pool, make_pool
from cyclone_dsl.engine import WORK_CHANNEL, Engine
from cyclone_dsl.testing.schemas import create_schema, drop_schema, with_search_path
from cyclone_dsl.worker.adaptive import WorkerSettings
from cyclone_dsl.worker.processes import Supervisor, worker_spec
from cyclone_dsl.worker.scanner import Scanner

HANDLERS = [flows.noop, flows.mark, flows.inc, flows.add, flows.total, flows.items]


@contextmanager
def fresh(admin: str) -> Iterator[str]:
    name = create_schema(admin)
    try:
        yield with_search_path(admin, name)
    finally:
        drop_schema(admin, name)


def _worker(dsn: str, handlers: list[object] | None = None, **options: object) -> Worker:
    """A worker of the benchmark's handlers; the limited ones only where a scenario asks,
    so that the others measure workers that serve no limited work."""
    options.setdefault("concurrency", 100)
    options.setdefault("batch_size", 100)
    options.setdefault("poll_interval", 0.05)
    return Worker(dsn, handlers or HANDLERS, scanners=False, **options)  # type: ignore[arg-type]


@attrs.define
class Peaks:
    """The most handlers in flight and threads in the process while a worker drained."""

    in_flight: int = 0
    threads: int = 0


def _drain(
    worker: Worker,
    expected: int,
    limit_s: float = 600,
    settings: list[WorkerSettings] | None = None,
    peaks: Peaks | None = None,
    meter: Meter | None = None,
) -> float:
    """Start the worker, wait until it completed ``expected`` steps; return the seconds
    (and append to ``settings`` the worker's effective settings at the end; ``peaks``
    notes the most handlers in flight and threads seen; ``meter`` reads the CPU the
    draining cost)."""
    if meter is not None:
        meter.start()
    started = time.perf_counter()
    worker.start()
    while worker.completed_count < expected:
        if time.perf_counter() - started > limit_s:
            raise TimeoutError(f"{worker.completed_count}/{expected} steps in {limit_s}s")
        if peaks is not None:
            peaks.in_flight = max(peaks.in_flight, worker.slots_in_use)
            peaks.threads = max(peaks.threads, threading.active_count())
        time.sleep(0.005)
    elapsed = time.perf_counter() - started
    if meter is not None:
        meter.stop()
    if settings is not None:
        settings.append(worker.settings())
    worker.stop()
    return elapsed


def noop_throughput(admin: str, jobs: int, meter: Meter | None = None) -> float:
    """Standalone no-op steps per second (enqueued beforehand in batches)."""
    with fresh(admin) as dsn, Client(dsn) as client:
        for start in range(0, jobs, 2000):
            client.enqueue_many(flows.noop, [None] * min(2000, jobs - start))
        return jobs / _drain(_worker(dsn), jobs, meter=meter)


def defaults_throughput(
    admin: str, jobs: int, handler: object, *, tuned: bool, peaks: Peaks | None = None
) -> tuple[float, WorkerSettings]:
    """Standalone steps of ``handler`` per second, by the bench's tuned worker (100
    handlers at once, claims of 100) or by ``Worker(dsn, [handler])`` with no tuning
    option; and the worker's effective settings when the last step completed."""
    with fresh(admin) as dsn, Client(dsn) as client:
        for start in range(0, jobs, 2000):
            client.enqueue_many(handler, [None] * min(2000, jobs - start))  # type: ignore[call-overload]
        worker = _worker(dsn, [handler]) if tuned else Worker(dsn, [handler])
        seen: list[WorkerSettings] = []
        rate = jobs / _drain(worker, jobs, settings=seen, peaks=peaks)
        return rate, seen[0]


def emit_throughput(admin: str, jobs: int) -> float:
    """Standalone steps that each store ``flows.EVENTS_PER_STEP`` progress events."""
    with fresh(admin) as dsn, Client(dsn) as client:
        for start in range(0, jobs, 2000):
            client.enqueue_many(flows.emitter, [None] * min(2000, jobs - start))
        return jobs / _drain(_worker(dsn, [flows.emitter]), jobs)


def keyed_throughput(admin: str, jobs: int, keys: int = 10) -> float:
    """Standalone no-op steps under a concurrency key (``keys`` keys, 100 each at once):
    every claim takes the gated path and a slot per step."""
    with fresh(admin) as dsn, Client(dsn) as client:
        for start in range(0, jobs, 2000):
            count = min(2000, jobs - start)
            client.enqueue_many(flows.keyed, [{"k": f"k{i % keys}"} for i in range(count)])
        return jobs / _drain(_worker(dsn, [flows.keyed]), jobs)


def rated_throughput(admin: str, jobs: int) -> float:
    """Standalone no-op steps under a rate limit that never binds (50,000 per second): the
    cost of taking a rate slot per step."""
    with fresh(admin) as dsn, Client(dsn) as client:
        for start in range(0, jobs, 2000):
            client.enqueue_many(flows.rated, [None] * min(2000, jobs - start))
        return jobs / _drain(_worker(dsn, [flows.rated]), jobs)


def write_throughput(admin: str, jobs: int, *, transactional: bool) -> float:
    """Standalone steps that each insert one row: in their step's transaction, or (the
    peer) in a transaction of their own from a pool, committed before the completion."""
    with fresh(admin) as dsn, Client(dsn) as client:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE bench_ledger (step_id bigint)")
        handler = flows.tx_write if transactional else flows.own_write
        for start in range(0, jobs, 2000):
            client.enqueue_many(handler, [None] * min(2000, jobs - start))
        if transactional:
            return jobs / _drain(_worker(dsn, [handler], concurrency=WRITERS), jobs)
        with make_pool(dsn, name="bench-writes", max_size=WRITERS) as pool:
            flows.write_pool[:] = [pool]
            return jobs / _drain(_worker(dsn, [handler], concurrency=WRITERS), jobs)


#: Handlers writing at once in the write scenarios (each holds a connection meanwhile).
WRITERS = 32


PRELOAD_RUNS = """
WITH runs AS (
    INSERT INTO cyclone_runs (workflow, def_version, state, finished_at)
    SELECT 'bench_old', 'v', 'completed', now() - %(age)s::interval
    FROM generate_series(1, %(count)s)
    RETURNING id
)
INSERT INTO cyclone_steps (run_id, node, kind, state, output, completed_at)
SELECT id, 'bench_noop', 'bench_noop', 'completed', 'null', now() - %(age)s::interval FROM runs
"""


def _preload(dsn: str, history: int, age: timedelta = timedelta(0)) -> None:
    """Store ``history`` completed one-step runs that ended ``age`` ago, then vacuum."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for start in range(0, history, 100_000):
            conn.execute(PRELOAD_RUNS, {"count": min(100_000, history - start), "age": age})
        conn.execute("VACUUM ANALYZE cyclone_runs")
        conn.execute("VACUUM ANALYZE cyclone_steps")
        conn.execute("CHECKPOINT")  # flush the preload before measuring


def noop_throughput_with_history(admin: str, jobs: int, history: int) -> float:
    """Standalone no-op steps per second with ``history`` completed runs already stored."""
    with fresh(admin) as dsn, Client(dsn) as client:
        _preload(dsn, history)
        for start in range(0, jobs, 2000):
            client.enqueue_many(flows.noop, [None] * min(2000, jobs - start))
        return jobs / _drain(_worker(dsn), jobs)


def _retention_scanner(pool: Pool, every: timedelta | None = None) -> Scanner:
    """A scanner with the default 7-day retention (``every``: the span between its
    retention passes, by default the build's)."""
    return Scanner(
        pool,
        Engine(),
        interval=1.0,
        max_reclaims={},
        default_max_reclaims=3,
        stopping=threading.Event(),
        retention=timedelta(days=7),
        retention_every=every,
    )


def retention_rate(admin: str, expired: int) -> float:
    """Runs per second the retention pass deletes, ``expired`` runs past a 7-day retention."""
    with fresh(admin) as dsn:
        _preload(dsn, expired, age=timedelta(days=8))
        with make_pool(dsn, name="bench-retention") as pool:
            scanner = _retention_scanner(pool)
            started = time.perf_counter()
            deleted = scanner.expire_runs()
            elapsed = time.perf_counter() - started
        if deleted != expired:
            raise RuntimeError(f"retention deleted {deleted} of {expired} runs")
        return deleted / elapsed


def idle_look_cost(admin: str, kept: int, looks: int) -> tuple[float, float] | None:
    """Server CPU milliseconds per look of an idle scanner with ``kept`` ended runs kept
    (none past its retention): retention once a minute for all scanners (this build),
    and at every look (the walk of every kept run each look ran before). ``None`` when
    the server's CPU cannot be read (not a local server)."""
    with fresh(admin) as dsn:
        _preload(dsn, kept)
        meter = Meter(dsn)
        if meter.postmaster is None:
            return None
        with make_pool(dsn, name="bench-idle-look") as pool:
            figures = []
            for every in (None, timedelta(0)):  # this build's span, then none
                scanner = _retention_scanner(pool, every)
                scanner.scan_once()  # the first look: every pass, retention's walk included
                meter.start()
                for _ in range(looks):
                    scanner.scan_once()
                meter.stop()
                assert meter.server_s is not None
                figures.append(meter.server_s * 1000 / looks)
        return figures[0], figures[1]


def workflow_throughput(
    admin: str, workflow: object, runs: int, steps_per_run: int, meter: Meter | None = None
) -> float:
    """Steps per second of ``runs`` runs of ``workflow`` (submitted beforehand)."""
    with fresh(admin) as dsn, Client(dsn) as client:
        for start in range(0, runs, 1000):
            client.submit_many(workflow, list(range(start, min(runs, start + 1000))))
        steps = runs * steps_per_run
        return steps / _drain(_worker(dsn), steps, meter=meter)


def fan_out_throughput(admin: str, items: int) -> float:
    """Items per second of one for_each over ``items`` elements."""
    with fresh(admin) as dsn, Client(dsn) as client:
        client.submit(flows.fan, items)
        return items / _drain(_worker(dsn), items + 1)


@contextmanager
def _idle_worker(admin: str) -> Iterator[Client]:
    """A client of a fresh schema whose worker is started and idle (LISTEN, not polling)."""
    with fresh(admin) as dsn, Client(dsn) as client:
        worker = _worker(dsn, poll_interval=5.0, concurrency=4)
        worker.start()
        try:
            time.sleep(0.5)
            yield client
        finally:
            worker.stop()


def wakeup_latency(admin: str, samples: int) -> list[float]:
    """Seconds from enqueue to handler start, with an idle worker (LISTEN, not polling)."""
    latencies = []
    with _idle_worker(admin) as client:
        for _ in range(samples):
            flows.started.clear()
            before = time.perf_counter()
            client.enqueue(flows.mark, None)
            while not flows.started:
                time.sleep(0.0002)
            latencies.append(flows.started[0] - before)
            time.sleep(0.02)
    return latencies


def result_latency(admin: str, samples: int) -> list[float]:
    """Seconds from enqueue to ``result()`` returning, with an idle worker: the wake-up,
    the handler, the completion's commit and notification, and the client's read."""
    latencies = []
    with _idle_worker(admin) as client:
        for _ in range(samples):
            before = time.perf_counter()
            client.enqueue(flows.noop, None).result(timeout=30)
            latencies.append(time.perf_counter() - before)
            time.sleep(0.02)
    return latencies


def waits_at_once(admin: str, waits: int, *, follow: bool = False) -> tuple[float, int]:
    """``waits`` threads in ``result()`` of one client (``follow``: following the runs'
    events) while a worker drains their steps: seconds from the worker's start to the
    last return, and the client's wait connections seen while they all waited."""
    with fresh(admin) as dsn, Client(dsn) as client:
        handles = client.enqueue_many(flows.noop, [None] * waits)
        threads = [
            threading.Thread(
                target=(lambda h=h: list(h.events(timeout=60))) if follow else h.result,
                kwargs={} if follow else {"timeout": 60},
            )
            for h in handles
        ]
        for thread in threads:
            thread.start()
        time.sleep(0.5)
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                (f"cyclone-wait-{os.getpid()}",),
            ).fetchone()
        connections = int(row[0]) if row else 0
        worker = _worker(dsn)
        started = time.perf_counter()
        worker.start()
        try:
            for thread in threads:
                thread.join(60)
            return time.perf_counter() - started, connections
        finally:
            worker.stop()


@attrs.frozen
class StartCost:
    """A client's start and first call against a raw connection's: median wall ms, and the
    server sessions each start opened (counted by the server)."""

    client_ms: float
    raw_ms: float
    client_sessions: float
    worker_sessions: float


def start_cost(admin: str, starts: int) -> StartCost:
    """``Client(dsn)``, one read and ``close()``, against ``psycopg.connect``, one query and
    ``close()``, alternating, ``starts`` times each; then the sessions a client start and a
    worker start (with its defaults) and stop open, counted by the server for a database
    of their own (``pg_stat_database``: other users of the server are not counted)."""
    with own_database(admin) as (dsn, name):
        client_ms: list[float] = []
        raw_ms: list[float] = []
        for _ in range(starts):
            began = time.perf_counter()
            with Client(dsn) as client:
                client.list_runs(limit=1)
            client_ms.append((time.perf_counter() - began) * 1000)
            began = time.perf_counter()
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("SELECT count(*) FROM cyclone_runs").fetchone()
            raw_ms.append((time.perf_counter() - began) * 1000)
        with psycopg.connect(admin, autocommit=True) as counter:
            before = _sessions_ended(counter, name)
            for _ in range(starts):
                with Client(dsn) as client:
                    client.list_runs(limit=1)
            clients = _sessions_ended(counter, name, at_least=before + starts) - before
            before = _sessions_ended(counter, name)
            for _ in range(starts):
                worker = Worker(dsn, [flows.noop])  # as a user starts one: scanners on
                worker.start()
                worker.stop()
            workers = _sessions_ended(counter, name, at_least=before + starts) - before
    return StartCost(median(client_ms), median(raw_ms), clients / starts, workers / starts)


@contextmanager
def own_database(admin: str) -> Iterator[tuple[str, str]]:
    """A new database, migrated, dropped after: its DSN and name."""
    name = f"cyclone_bench_{os.getpid()}"
    create = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(drop)
        conn.execute(create)
    dsn = make_conninfo(admin, dbname=name)
    try:
        migrate(dsn)
        yield dsn, name
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(drop)


def _sessions_ended(conn: psycopg.Connection[tuple[int]], database: str, at_least: int = 0) -> int:
    """The server's count of sessions of ``database``, once it reaches ``at_least`` and
    stops moving (a session is counted as its backend exits, just after its close)."""
    last = -1
    deadline = time.monotonic() + 5
    while True:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT sessions FROM pg_stat_database WHERE datname = %s", (database,)
        ).fetchone()
        count = int(row[0]) if row else 0
        if (count >= at_least and count == last) or time.monotonic() > deadline:
            return count
        last = count
        time.sleep(0.2)


def submit_rate(admin: str, runs: int) -> float:
    """Runs of a 5-node workflow submitted per second, one submit() per run."""
    with fresh(admin) as dsn, Client(dsn) as client:
        started = time.perf_counter()
        for i in range(runs):
            client.submit(flows.five, i)
        return runs / (time.perf_counter() - started)


def async_submit_rate(admin: str, runs: int) -> float:
    """Runs of a 5-node workflow submitted per second, one ``await submit()`` per run."""

    async def submit_all(dsn: str) -> float:
        async with AsyncClient(dsn) as client:
            started = time.perf_counter()
            for i in range(runs):
                await client.submit(flows.five, i)
            return runs / (time.perf_counter() - started)

    with fresh(admin) as dsn:
        return asyncio.run(submit_all(dsn))


def submit_many_rate(admin: str, runs: int) -> float:
    """Runs of a 5-node workflow per second with submit_many (batches of 1,000)."""
    with fresh(admin) as dsn, Client(dsn) as client:
        started = time.perf_counter()
        for start in range(0, runs, 1000):
            client.submit_many(flows.five, list(range(start, min(runs, start + 1000))))
        return runs / (time.perf_counter() - started)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def median(values: list[float]) -> float:
    return statistics.median(values)


#: Worker processes in the scaling scenario.
PROCESS_COUNTS = (1, 2, 4)

RELEASE_HELD = """
WITH moved AS (
    UPDATE cyclone_steps SET queue = 'default' WHERE queue = 'bench_held' RETURNING 1
)
SELECT count(*), pg_notify(%(channel)s, 'default') FROM moved
"""


def process_throughput(admin: str, jobs: int, processes: int) -> float:
    """Standalone no-op steps per second with ``processes`` worker processes under one
    supervisor (1 included: a single child process, so every count pays the same costs).

    The steps wait on a queue no worker serves until every process is registered; then
    one statement moves them to the served queue, and the clock runs until the database
    counts them all completed.
    """
    with fresh(admin) as dsn, Client(dsn) as client:
        for start in range(0, jobs, 2000):
            client.enqueue_many(flows.noop, [None] * min(2000, jobs - start), queue="bench_held")
        spec = worker_spec(
            dsn,
            HANDLERS,
            also=(),
            name=f"bench-{processes}",
            options={
                "queues": ["default"],
                "concurrency": 100,
                "batch_size": 100,
                "poll_interval": 0.05,
                "scanners": False,
                "retention": None,
                "metrics_port": None,
            },
        )
        supervisor = Supervisor(spec, processes, grace=5).start()
        try:
            deadline = time.perf_counter() + 120
            while sum(1 for w in client.workers() if w["live"]) < processes:
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"{processes} worker processes did not all start")
                time.sleep(0.05)
            with psycopg.connect(dsn, autocommit=True) as conn:
                started = time.perf_counter()
                conn.execute(RELEASE_HELD, {"channel": WORK_CHANNEL})
                while True:
                    row = conn.execute(
                        "SELECT count(*) FROM cyclone_steps WHERE state = 'completed'"
                    ).fetchone()
                    if row is not None and row[0] >= jobs:
                        break
                    if time.perf_counter() - started > 600:
                        raise TimeoutError(f"{row} of {jobs} steps done in 600 s")
                    time.sleep(0.01)
                elapsed = time.perf_counter() - started
        finally:
            supervisor.stop()
        return jobs / elapsed
