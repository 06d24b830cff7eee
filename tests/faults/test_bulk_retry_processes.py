"""``retry_many`` over 10,000 failed runs (1,000 unless ``CYCLONE_FULL=1``) while four
worker processes run.

Each run's one step fails for good (one attempt) until a flag file exists. Once all
have failed, the flag is set and ``retry_many`` retries them, batch after batch,
while the workers take the runs of the batches already committed. Afterwards every
run has completed, and its handler ran exactly twice (the failure, then the
success): nothing retried was lost, nothing ran twice.
"""

from __future__ import annotations

import subprocess
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from cyclone_dsl import BulkResult, Client, RunFilter
from tests.faults import handlers
from tests.faults.conftest import FULL, read_log, wait_for

Spawn = Callable[..., subprocess.Popen[str]]
#: The issue's size at ``CYCLONE_FULL=1``; CI runs it bounded (each retried run costs about
#: a dozen statements, the workers' failures and completions come on top).
RUNS = 10_000 if FULL else 1_000
BATCH = 500


def run_states(client: Client) -> Counter[str]:
    return Counter(client.run_counts())


@pytest.mark.slow
@pytest.mark.timeout(900 if FULL else 180)
def test_retry_many_loses_and_duplicates_nothing_while_workers_run(
    client: Client, spawn_worker: Spawn, fault_log: Path, tmp_path: Path, cyclone_dsn: str
) -> None:
    flag = tmp_path / "flag"
    workers = [spawn_worker(CYCLONE_FAULT_FLAG=str(flag)) for _ in range(4)]
    ids: list[int] = []
    for start in range(0, RUNS, 2_000):
        inputs = list(range(start, min(start + 2_000, RUNS)))
        ids += [h.id for h in client.submit_many(handlers.flagged, inputs)]
    wait_for(lambda: run_states(client)["failed"] == RUNS, timeout=600 if FULL else 120)

    flag.touch()
    where = RunFilter(workflows="fault_flagged")
    assert client.retry_many(where, dry_run=True).matched == RUNS
    seen: list[BulkResult] = []
    result = client.retry_many(where, progress=seen.append)
    assert (result.matched, result.acted, result.skipped) == (RUNS, RUNS, 0)
    # One report per batch (and one for the empty page that ends a multiple of BATCH).
    assert [p.acted for p in seen][: RUNS // BATCH] == list(range(BATCH, RUNS + 1, BATCH))
    assert seen[-1] == result
    wait_for(lambda: run_states(client)["completed"] == RUNS, timeout=600 if FULL else 120)
    assert client.retry_many(where).matched == 0
    assert all(proc.poll() is None for proc in workers)

    events: dict[int, list[str]] = defaultdict(list)
    for _, run_id, _, event in read_log(fault_log):
        events[run_id].append(event)
    assert set(events) == set(ids)
    wrong = {run_id: got for run_id, got in events.items() if got != ["fail", "ok"]}
    assert wrong == {}
    with psycopg.connect(cyclone_dsn) as conn:
        rows = conn.execute(
            "SELECT state, count(*), count(output) FROM cyclone_steps GROUP BY state"
        ).fetchall()
    assert rows == [("completed", RUNS, RUNS)]
