"""Flow control with four worker processes: limits counted on the database hold across
workers and through SIGKILLs, a rate holds over a window, and claims are fair across keys.

The limits are checked from the database while the work runs (a sampler reads how many
steps of each key are running) and afterwards (every step completed once).
"""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest

from cyclone_dsl import Client
from cyclone_dsl.states import RunState
from tests.faults import handlers
from tests.faults.conftest import wait_for, working

Spawn = Callable[..., subprocess.Popen[str]]

RUNNING_PER_KEY = """
SELECT g.step_key, count(*) FROM cyclone_ext_gates AS g
JOIN cyclone_steps AS s ON s.id = g.step_id
WHERE s.state = 'running' AND g.step_scope = 'step:fault_keyed'
GROUP BY g.step_key
"""


@contextmanager
def sampling(dsn: str) -> Iterator[list[int]]:
    """Sample the most steps of one key running at once, every 10 ms, while the block runs."""
    peaks: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                rows = conn.execute(RUNNING_PER_KEY).fetchall()
                peaks.append(max((count for _, count in rows), default=0))
                stop.wait(0.01)

    thread = threading.Thread(target=sample)
    thread.start()
    try:
        yield peaks
    finally:
        stop.set()
        thread.join()


def all_done(client: Client, count: int) -> bool:
    return client.run_counts().get(RunState.COMPLETED.value, 0) == count


def test_concurrency_keys_hold_across_four_workers(
    client: Client, cyclone_dsn: str, spawn_worker: Spawn, fault_log: Path
) -> None:
    jobs = [{"tenant": f"t{i % 10}", "n": i} for i in range(200)]
    handles = client.enqueue_many(handlers.keyed, jobs)
    with sampling(cyclone_dsn) as peaks:
        for _ in range(4):
            spawn_worker(CYCLONE_FAULT_SLEEP="0.05")
        wait_for(lambda: all_done(client, 200), timeout=90)
    assert max(peaks) == 3, f"the most running per key was {max(peaks)}"
    assert [h.result(timeout=5) for h in handles] == list(range(200))


def test_slots_come_back_after_sigkills(
    client: Client, cyclone_dsn: str, spawn_worker: Spawn, fault_log: Path
) -> None:
    jobs = [{"tenant": f"t{i % 10}", "n": i} for i in range(200)]
    handles = client.enqueue_many(handlers.keyed, jobs)
    rng = random.Random(7)
    with sampling(cyclone_dsn) as peaks:
        workers = [spawn_worker(CYCLONE_FAULT_SLEEP="0.1") for _ in range(4)]
        for _ in range(5):  # a worker dies holding slots; a new one takes its place
            time.sleep(rng.uniform(0.3, 0.8))
            victim = rng.choice(working(fault_log, workers))
            workers.remove(victim)
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
            workers.append(spawn_worker(CYCLONE_FAULT_SLEEP="0.1"))
        wait_for(lambda: all_done(client, 200), timeout=120)
    assert max(peaks) <= 3, f"the most running per key was {max(peaks)}"
    assert [h.result(timeout=5) for h in handles] == list(range(200))
    with psycopg.connect(cyclone_dsn) as conn:
        reclaims = conn.execute(
            "SELECT sum(reclaims) FROM cyclone_steps WHERE kind = 'fault_keyed'"
        ).fetchone()
    assert reclaims is not None and reclaims[0] > 0, "no slot was ever held by a killed worker"


@pytest.mark.timeout(180)
def test_a_rate_limit_holds_over_a_window_with_four_workers(
    client: Client, cyclone_dsn: str, spawn_worker: Spawn, fault_log: Path
) -> None:
    handles = client.enqueue_many(handlers.rated, list(range(300)))
    for _ in range(4):
        spawn_worker()
    wait_for(lambda: all_done(client, 300), timeout=60)
    assert [h.result(timeout=5) for h in handles] == list(range(300))
    with psycopg.connect(cyclone_dsn) as conn:
        starts = [
            row[0]
            for row in conn.execute(
                "SELECT started_at FROM cyclone_steps WHERE kind = 'fault_rated' ORDER BY 1"
            )
        ]
    window_start = starts[0] + timedelta(seconds=2)
    in_window = [s for s in starts if window_start <= s < window_start + timedelta(seconds=10)]
    assert 180 <= len(in_window) <= 220, f"{len(in_window)} starts in 10 s at 20/s"
    for index, start in enumerate(starts):
        assert (
            len([s for s in starts[index : index + 25] if s < start + timedelta(seconds=1)]) <= 20
        )


@pytest.mark.timeout(240)
def test_a_small_tenant_is_not_starved_by_a_big_one(
    client: Client, cyclone_dsn: str, spawn_worker: Spawn, fault_log: Path
) -> None:
    client.enqueue_many(handlers.fair, [{"tenant": "big", "n": n} for n in range(5000)])
    client.enqueue_many(handlers.fair, [{"tenant": "small", "n": n} for n in range(10)])
    for _ in range(4):
        spawn_worker()
    wait_for(lambda: all_done(client, 5010), timeout=200)
    with psycopg.connect(cyclone_dsn) as conn:
        order = [
            row[0]
            for row in conn.execute(
                "SELECT s.input->>'tenant' FROM cyclone_steps AS s"
                " WHERE s.kind = 'fault_fair' ORDER BY s.completed_at, s.id"
            )
        ]
    last_small = max(i for i, tenant in enumerate(order) if tenant == "small")
    big_before = order[:last_small].count("big")
    assert big_before <= 500, f"the small tenant finished after {big_before} big steps"
