"""Database faults under load: killed backends and a restarted server lose nothing.

These use a private PostgreSQL in a temporary folder, so that restarting it
cannot disturb other tests.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from cyclone_dsl import Client, Worker, migrate, step
from cyclone_dsl.db.embedded import EmbeddedServer
from cyclone_dsl.states import RunState
from tests.waiting import wait_until


@step(name="df_work", max_attempts=10)
def work(x: int) -> int:
    time.sleep(0.005)
    return x * 2


@pytest.fixture
def private_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    folder: Path = tmp_path_factory.mktemp("pg") / "data"
    server = EmbeddedServer(folder)
    server.start()
    migrate(server.url)
    yield server
    server.stop("immediate")


def all_completed(client: Client, ids: list[int]) -> bool:
    return all(client.get_run(run_id).state is RunState.COMPLETED for run_id in ids)


def test_killed_backends_are_replaced_and_nothing_is_lost(private_server: EmbeddedServer) -> None:
    dsn = private_server.url
    with (
        Client(dsn) as client,
        Worker(dsn, [work], concurrency=8, poll_interval=0.2, scan_interval=0.2, lease=2),
    ):
        handles = client.enqueue_many(work, list(range(300)))
        stop = threading.Event()
        kills = 0

        def killer() -> None:
            nonlocal kills
            until = time.monotonic() + 6
            with psycopg.connect(dsn, autocommit=True) as admin:
                while not stop.is_set() and time.monotonic() < until:
                    # This process's worker only: the other test processes share the server.
                    killed = admin.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE application_name IN (%s, %s)",
                        (f"cyclone-worker-{os.getpid()}", f"cyclone-listen-{os.getpid()}"),
                    ).fetchall()
                    kills += len(killed)
                    time.sleep(1.0)

        thread = threading.Thread(target=killer)
        thread.start()
        try:
            deadline = time.monotonic() + 90
            while not all_completed(client, [h.id for h in handles[-5:]]):
                assert time.monotonic() < deadline, "work stalled under backend kills"
                time.sleep(0.2)
        finally:
            stop.set()
            thread.join()
        for handle in handles:
            run = handle.wait(timeout=60)
            assert run.state is RunState.COMPLETED
        outputs = [client.get_run(h.id).step("df_work").output for h in handles]
        assert outputs == [i * 2 for i in range(300)]
        assert kills > 0


def test_a_server_restart_under_load_loses_nothing(private_server: EmbeddedServer) -> None:
    dsn = private_server.url
    with Client(dsn) as client:
        handles = client.enqueue_many(work, list(range(200)))
    worker = Worker(dsn, [work], concurrency=8, poll_interval=0.2, scan_interval=0.2, lease=2)
    worker.start()
    try:
        wait_until(lambda: worker.completed_count > 0, what="the worker to be under load")
        private_server.restart("immediate")
        time.sleep(1.0)
        private_server.restart("fast")
        with Client(dsn) as client:
            for handle in handles:
                run = client.handle(handle.id).wait(timeout=120)
                assert run.state is RunState.COMPLETED
                assert run.step("df_work").output == run.input * 2  # type: ignore[operator]
    finally:
        worker.stop()
