"""Absurd 0.5.1 as a peer (database ``bench_absurd``, schema ``absurd``, queue ``bench``).

The schema is the ``absurd.sql`` bundled in ``absurdctl`` 0.5.1 (the SDK ships
none). The worker is the SDK's synchronous ``Absurd.start_worker`` in a thread;
it polls (``poll_interval``, default 0.25 s) and has no LISTEN/NOTIFY wake-up.

- ``noop_throughput``: ``spawn`` in transactions of 100, then
  ``start_worker(batch_size=100)``; timed from worker start to the last
  ``completed`` task row.
- ``chain_throughput``: tasks of 3 ``ctx.run_step`` no-ops (each a checkpoint),
  the worker already running; first spawn to last completed row.
- ``wakeup_latency``: one spawn at a time to the idle worker.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import psycopg

from bench.peers import peer_url, reset_database, wait_count

DB = "bench_absurd"
QUEUE = "bench"
POLL = 0.25  # the SDK's default poll_interval
BATCH = 100
DONE = "SELECT count(*) FROM absurd.t_bench WHERE state = 'completed'"


def available() -> bool:
    try:
        import absurd_sdk  # noqa: F401
        import absurdctl  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        return False
    return True


def _setup(admin_url: str) -> str:
    from absurdctl import BUNDLED_SCHEMA_SQL

    url = peer_url(admin_url, DB)
    reset_database(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(BUNDLED_SCHEMA_SQL)
        conn.execute("SELECT absurd.create_queue(%s)", (QUEUE,))
    return url


class _Worker:
    """An ``Absurd`` app with the bench tasks, its worker running in a thread."""

    def __init__(self, url: str, batch_size: int, poll: float) -> None:
        from absurd_sdk import Absurd

        self.app = Absurd(url, queue_name=QUEUE)
        self.started: list[float] = []

        @self.app.register_task(name="noop")
        def noop(params: Any, ctx: Any) -> None:
            self.started.append(time.perf_counter())

        @self.app.register_task(name="chain")
        def chain(params: Any, ctx: Any) -> None:
            for i in range(3):
                ctx.step(f"s{i}", lambda: None)

        self.thread = threading.Thread(
            target=self.app.start_worker,
            kwargs={"batch_size": batch_size, "poll_interval": poll, "worker_id": "bench"},
            daemon=True,
        )

    def __enter__(self) -> _Worker:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.app.stop_worker()
        self.thread.join(30)
        self.app.close()


def _spawn(url: str, task: str, count: int) -> None:
    from absurd_sdk import Absurd

    with psycopg.connect(url, autocommit=True) as conn:
        producer = Absurd(conn, queue_name=QUEUE)
        for start in range(0, count, 100):
            with conn.transaction():
                for _ in range(min(100, count - start)):
                    producer.spawn(task, {}, queue=QUEUE)


def noop_throughput(admin_url: str, jobs: int, batch_size: int = BATCH) -> float:
    """Tasks per second of the processing phase (spawning excluded)."""
    url = _setup(admin_url)
    _spawn(url, "noop", jobs)
    with _Worker(url, batch_size, POLL):
        started = time.perf_counter()
        finished = wait_count(url, DONE, jobs, timeout=120)
    return jobs / (finished - started)


def chain_throughput(admin_url: str, runs: int, batch_size: int = BATCH) -> float:
    """Steps per second (3 per task), first spawn to last completed task."""
    url = _setup(admin_url)
    with _Worker(url, batch_size, POLL):
        time.sleep(0.1)
        started = time.perf_counter()
        _spawn(url, "chain", runs)
        finished = wait_count(url, DONE, runs, timeout=120)
    return 3 * runs / (finished - started)


def wakeup_latency(admin_url: str, samples: int, poll: float = POLL) -> list[float]:
    """Seconds from ``spawn`` to the handler's start, one task at a time."""
    from absurd_sdk import Absurd

    url = _setup(admin_url)
    latencies = []
    rng = random.Random(0)
    with _Worker(url, 1, poll) as worker, psycopg.connect(url, autocommit=True) as conn:
        producer = Absurd(conn, queue_name=QUEUE)
        time.sleep(0.2)
        for _ in range(samples + 1):  # the first is a discarded warm-up
            worker.started.clear()
            sent = time.perf_counter()
            producer.spawn("noop", {}, queue=QUEUE)
            deadline = sent + 10 + 2 * poll
            while not worker.started:
                if time.perf_counter() > deadline:
                    raise TimeoutError("absurd did not start the task in time")
                time.sleep(0.0005)
            latencies.append(worker.started[0] - sent)
            time.sleep(rng.uniform(0.02, 0.02 + poll))  # random phase against the poll
    return latencies[1:]
