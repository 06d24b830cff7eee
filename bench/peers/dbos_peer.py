"""DBOS Transact 3.4 as a peer (database ``bench_dbos``, system schema ``dbos``).

Jobs are workflows on a queue registered with ``DBOS.register_queue`` (no
concurrency limits). DBOS queues are polled: the worker thread checks each
queue every ``polling_interval_sec`` (documented default 1.0 s); there is no
LISTEN/NOTIFY wake-up for queues.

- ``noop_throughput``: ``DBOSClient.enqueue_in_transaction`` in transactions of
  100 before the worker launches; timed from the first workflow start to the
  last SUCCESS row (the idle wait for the first poll is excluded).
- ``chain_throughput``: workflows of 3 ``@DBOS.step`` no-ops, submitted with
  ``queue.enqueue`` (``queued=True``) or ``DBOS.start_workflow`` (runs at once
  in this process, no queue), timed from first submit to last SUCCESS.
- ``wakeup_latency``: ``queue.enqueue`` of one workflow at a time to an idle,
  launched DBOS; the latency is dominated by the poll interval.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any

from bench.peers import peer_url, reset_database, wait_count

DB = "bench_dbos"
QUEUE = "bench"
POLL = 1.0  # DBOS's default polling_interval_sec
_first: list[float] = []
_lock = threading.Lock()


def available() -> bool:
    try:
        import dbos  # noqa: F401
    except ImportError:
        return False
    return True


def _mark() -> None:
    now = time.perf_counter()
    with _lock:
        _first.append(now)


try:
    from dbos import DBOS

    @DBOS.workflow(name="bench_noop")
    def bench_noop() -> None:
        _mark()

    @DBOS.step(name="bench_step")
    def bench_step() -> None:
        return None

    @DBOS.workflow(name="bench_chain")
    def bench_chain() -> None:
        bench_step()
        bench_step()
        bench_step()

except ImportError:  # pragma: no cover - peer not installed
    pass


DONE = "SELECT count(*) FROM dbos.workflow_status WHERE name = %s AND status = 'SUCCESS'"


def _launch(url: str, poll: float) -> Any:
    from dbos import DBOS

    logging.getLogger("dbos").setLevel(logging.WARNING)
    DBOS(config={"name": "bench", "system_database_url": url, "log_level": "WARNING"})
    DBOS.launch()
    return DBOS.register_queue(QUEUE, polling_interval_sec=poll)


def _destroy() -> None:
    from dbos import DBOS

    DBOS.destroy(destroy_registry=False)


def noop_throughput(admin_url: str, jobs: int, poll: float = POLL) -> float:
    """Workflows per second, first workflow start to last SUCCESS."""
    import sqlalchemy as sa
    from dbos import DBOS, DBOSClient

    url = peer_url(admin_url, DB)
    reset_database(url)
    DBOS.migrate(url)
    client = DBOSClient(system_database_url=url)
    engine = sa.create_engine(sa.make_url(url).set(drivername="postgresql+psycopg"))
    try:
        for start in range(0, jobs, 100):
            with engine.begin() as conn:
                for _ in range(min(100, jobs - start)):
                    client.enqueue_in_transaction(
                        conn, {"queue_name": QUEUE, "workflow_name": "bench_noop"}
                    )
    finally:
        engine.dispose()
        client.destroy()
    _first.clear()
    _launch(url, poll)
    try:
        finished = wait_count(url, DONE, jobs, timeout=120, params=("bench_noop",))
        return jobs / (finished - min(_first))
    finally:
        _destroy()


def chain_throughput(admin_url: str, runs: int, poll: float = POLL, queued: bool = True) -> float:
    """Steps per second (3 per workflow), first submit to last SUCCESS."""
    from dbos import DBOS

    url = peer_url(admin_url, DB)
    reset_database(url)
    queue = _launch(url, poll)
    try:
        started = time.perf_counter()
        for _ in range(runs):
            if queued:
                queue.enqueue(bench_chain)
            else:
                DBOS.start_workflow(bench_chain)
        finished = wait_count(url, DONE, runs, timeout=120, params=("bench_chain",))
        return 3 * runs / (finished - started)
    finally:
        _destroy()


def wakeup_latency(admin_url: str, samples: int, poll: float = POLL) -> list[float]:
    """Seconds from ``queue.enqueue`` to the workflow body's start, one at a time."""
    url = peer_url(admin_url, DB)
    reset_database(url)
    queue = _launch(url, poll)
    try:
        time.sleep(0.2)
        latencies = []
        rng = random.Random(0)
        for _ in range(samples + 1):  # the first is a discarded warm-up
            _first.clear()
            sent = time.perf_counter()
            queue.enqueue(bench_noop)
            deadline = sent + 10 + 2 * poll
            while not _first:
                if time.perf_counter() > deadline:
                    raise TimeoutError("DBOS did not start the workflow in time")
                time.sleep(0.0005)
            latencies.append(_first[0] - sent)
            time.sleep(rng.uniform(0.02, 0.02 + poll))  # random phase against the poll
        return latencies[1:]
    finally:
        _destroy()
