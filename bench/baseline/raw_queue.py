"""The raw PostgreSQL ceiling: claim-and-complete with FOR UPDATE SKIP LOCKED, no library.

A table of jobs, one CTE claim that marks them done in the same statement,
one transaction per claim: ``batch=1`` is one job per transaction,
``batch=100`` a hundred. This is what a pgbench script of the same shape
measures; running it here, on the same server in the same process, gives the
ratio the targets are written against.
"""

from __future__ import annotations

import time

import psycopg

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


def noop_throughput(dsn: str, jobs: int, batch: int = 1) -> float:
    """Jobs per second through claim-and-complete transactions of ``batch`` jobs."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SETUP)
        conn.execute(FILL, {"n": jobs})
        conn.execute("VACUUM ANALYZE bench_jobs")
        started = time.perf_counter()
        done = 0
        while done < jobs:
            with conn.transaction():
                done += len(conn.execute(CLAIM_AND_COMPLETE, {"batch": batch}).fetchall())
        elapsed = time.perf_counter() - started
        conn.execute("DROP TABLE bench_jobs")
    return jobs / elapsed
