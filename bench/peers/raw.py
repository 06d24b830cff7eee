"""The raw PostgreSQL ceiling: claim-and-complete with FOR UPDATE SKIP LOCKED, no library.

Database ``bench_raw``. ``noop_throughput(batch=1)`` is one job per transaction,
``batch=100`` a hundred. ``wakeup_latency`` is LISTEN/NOTIFY: the enqueue
transaction inserts and notifies; an idle worker thread blocked in
``notifies()`` claims on wake-up and records when it got the row.
"""

from __future__ import annotations

import threading
import time

import psycopg

from bench.peers import peer_url

DB = "bench_raw"

SETUP = """
DROP TABLE IF EXISTS bench_jobs;
CREATE TABLE bench_jobs (
    id bigserial PRIMARY KEY,
    state text NOT NULL DEFAULT 'available',
    payload jsonb
);
CREATE INDEX bench_jobs_available ON bench_jobs (id) WHERE state = 'available';
"""

FILL = "INSERT INTO bench_jobs (payload) SELECT '{}'::jsonb FROM generate_series(1, %(n)s)"

CLAIM_AND_COMPLETE = """
WITH c AS (
    SELECT id FROM bench_jobs WHERE state = 'available'
    ORDER BY id LIMIT %(batch)s FOR UPDATE SKIP LOCKED
)
UPDATE bench_jobs AS j SET state = 'done' FROM c WHERE j.id = c.id RETURNING j.id
"""


def _reset(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(SETUP)


def noop_throughput(admin_url: str, jobs: int, batch: int = 1) -> float:
    """Jobs per second through claim-and-complete transactions of ``batch`` jobs."""
    url = peer_url(admin_url, DB)
    _reset(url)
    with psycopg.connect(url, autocommit=True) as conn:
        for start in range(0, jobs, 10_000):
            conn.execute(FILL, {"n": min(10_000, jobs - start)})
        conn.execute("VACUUM ANALYZE bench_jobs")
        started = time.perf_counter()
        while True:
            with conn.transaction():
                if not conn.execute(CLAIM_AND_COMPLETE, {"batch": batch}).fetchall():
                    break
        return jobs / (time.perf_counter() - started)


def wakeup_latency(admin_url: str, samples: int) -> list[float]:
    """Seconds from the enqueue call to the worker holding the claimed row (LISTEN/NOTIFY)."""
    url = peer_url(admin_url, DB)
    _reset(url)
    got = threading.Event()
    stop = threading.Event()
    seen: list[float] = []

    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute("LISTEN bench_jobs")

        def worker() -> None:
            with psycopg.connect(url, autocommit=True) as conn:
                while not stop.is_set():
                    for _ in listener.notifies(timeout=0.5, stop_after=1):
                        with conn.transaction():
                            if conn.execute(CLAIM_AND_COMPLETE, {"batch": 1}).fetchall():
                                seen.append(time.perf_counter())
                                got.set()

        thread = threading.Thread(target=worker, daemon=True)
        thread.start()
        time.sleep(0.2)
        latencies: list[float] = []
        with psycopg.connect(url, autocommit=True) as producer:
            for _ in range(samples + 1):  # the first is a discarded warm-up
                got.clear()
                started = time.perf_counter()
                with producer.transaction():
                    producer.execute("INSERT INTO bench_jobs (payload) VALUES ('{}')")
                    producer.execute("NOTIFY bench_jobs")
                if not got.wait(10):
                    raise TimeoutError("raw worker did not wake up within 10 s")
                latencies.append(seen[-1] - started)
                time.sleep(0.02)
        stop.set()
        thread.join(5)
    return latencies[1:]
