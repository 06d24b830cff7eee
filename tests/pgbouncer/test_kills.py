"""Four worker processes going through PgBouncer (transaction mode, LISTEN direct), some
SIGKILLed while they work: every run completes and every step completes once."""

from __future__ import annotations

import random
import signal
import time
from collections import Counter
from pathlib import Path

import psycopg
import pytest

from cyclone_dsl import Client
from tests.faults import handlers
from tests.faults.conftest import read_log, worker_processes
from tests.faults.test_load_and_kills import counts, server_log_tail
from tests.pgbouncer.conftest import PgBouncer
from tests.waiting import wait_until

STANDALONE = 400
RUNS = 40
KILLS = 3


@pytest.mark.timeout(120)
def test_sigkilled_workers_through_pgbouncer_lose_nothing(
    pooled_dsn: str,
    cyclone_dsn: str,
    cyclone_admin_dsn: str,
    pgbouncer: PgBouncer,
    alias: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fault_log = tmp_path / "invocations.log"
    fault_log.touch()
    monkeypatch.setenv("CYCLONE_FAULT_LOG", str(fault_log))
    log_before = len(server_log_tail(cyclone_admin_dsn))
    with Client(pooled_dsn, pooled=True) as client:
        client.enqueue_many(handlers.work, list(range(STANDALONE)))
        client.submit_many(handlers.five, list(range(RUNS)))
    total = STANDALONE + RUNS
    env = {
        "CYCLONE_POOLED": "1",
        "CYCLONE_LISTEN_URL": cyclone_dsn,
        "CYCLONE_FAULT_LEASE": "1",
        "CYCLONE_FAULT_SLEEP": "0.01",
    }
    outputs: list[str] = []
    kills = 0
    rng = random.Random(11)
    with worker_processes(pooled_dsn) as spawn:
        workers = [spawn(**env) for _ in range(4)]
        deadline = time.monotonic() + 90
        while counts(cyclone_dsn)[0] < total:
            assert time.monotonic() < deadline, f"stalled at {counts(cyclone_dsn)}"
            time.sleep(rng.uniform(0.3, 0.6))
            if kills < KILLS:
                victim = workers.pop(rng.randrange(len(workers)))
                victim.send_signal(signal.SIGKILL)
                victim.wait(10)
                kills += 1
                assert victim.stdout is not None
                outputs.append(victim.stdout.read())
                workers.append(spawn(**env))
        # A process spawned after the last kill may still be importing, before its SIGTERM
        # handler: the signal would end it as signals end any process (-15), not stop it.
        # A worker installs its handler before it registers.
        with Client(cyclone_dsn) as watcher:
            wait_until(
                lambda: (
                    {p.pid for p in workers} <= {w["pid"] for w in watcher.workers() if w["live"]}
                ),
                what="every worker process to register",
                timeout=30,
            )
        for proc in workers:
            proc.send_signal(signal.SIGTERM)
        for proc in workers:
            assert proc.wait(30) == 0
            assert proc.stdout is not None
            outputs.append(proc.stdout.read())
    with psycopg.connect(cyclone_dsn) as conn:
        runs = dict(conn.execute("SELECT state, count(*) FROM cyclone_runs GROUP BY 1").fetchall())
        steps = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE state = 'completed' AND output IS NOT NULL),"
            " count(*) FILTER (WHERE state = 'running') FROM cyclone_steps"
        ).fetchone()
        keys = set(conn.execute("SELECT run_id, node FROM cyclone_steps").fetchall())
    assert runs == {"completed": total}
    assert steps == (STANDALONE + 5 * RUNS, STANDALONE + 5 * RUNS, 0)
    assert kills == KILLS
    started = Counter((run_id, node) for _, run_id, node, event in read_log(fault_log))
    assert set(started) == keys  # every handler ran
    assert pgbouncer.stats(alias)["total_xact_count"] > total
    text = "\n".join(outputs)
    assert "prepared statement" not in text
    assert "Traceback" not in text
    assert "no LISTEN connection" not in text  # CYCLONE_LISTEN_URL reached the workers
    assert "prepared statement" not in server_log_tail(cyclone_admin_dsn)[log_before:]
