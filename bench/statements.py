"""``python -m bench.statements [STEPS]``: where the server's time goes, per statement.

Needs a server with ``pg_stat_statements`` loaded (``shared_preload_libraries``); the
embedded server's binaries do not ship it, so point ``CYCLONE_DATABASE_URL`` at one
that does (as a role that may call ``pg_stat_statements_reset()``). For standalone
no-op steps and for 3-step chains it drains the work with the bench's tuned worker and
prints, per statement: calls, server time and WAL records per step, and the share of
the total.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import psycopg

from bench import cyclone_bench as cy
from bench import flows
from cyclone_dsl import Client
from cyclone_dsl.db.embedded import embedded_database

TOP = """
SELECT calls, total_exec_time + total_plan_time AS ms, wal_records,
       left(regexp_replace(query, '\\s+', ' ', 'g'), 90) AS query
FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND query NOT LIKE '%%pg_stat_statements%%'
ORDER BY 2 DESC
LIMIT 12
"""


def profile(admin: str, label: str, load: Callable[[Client], None], steps: int) -> None:
    with cy.fresh(admin) as dsn, Client(dsn) as client:
        load(client)
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute("SELECT pg_stat_statements_reset()")
        elapsed = cy._drain(cy._worker(dsn), steps)
        with psycopg.connect(admin, autocommit=True) as conn:
            rows = conn.execute(TOP).fetchall()
    total = sum(r[1] for r in rows) or 1.0
    print(f"\n{label}: {steps / elapsed:,.0f} steps/s, {total * 1000 / steps:.0f} us per step")
    print(f"{'calls/step':>10} {'us/step':>8} {'share':>6} {'WAL/step':>8}  statement")
    for calls, ms, wal, query in rows:
        print(
            f"{calls / steps:>10.3f} {ms * 1000 / steps:>8.1f} {ms / total:>6.0%} "
            f"{wal / steps:>8.1f}  {query}"
        )


def main() -> int:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 6000
    runs = steps // 3
    with embedded_database() as admin:
        with psycopg.connect(admin, autocommit=True) as conn:
            try:
                conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                conn.execute("SELECT pg_stat_statements_reset()")
            except psycopg.Error as exc:
                print(f"this server has no pg_stat_statements: {exc}".strip())
                return 1
        profile(
            admin,
            "standalone no-op steps",
            lambda c: [c.enqueue_many(flows.noop, [None] * 1000) for _ in range(steps // 1000)],
            steps // 1000 * 1000,
        )
        profile(
            admin,
            "3-step chains",
            lambda c: [
                c.submit_many(flows.chain, list(range(i, min(runs, i + 500))))
                for i in range(0, runs, 500)
            ],
            runs * 3,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
