"""The scanner parks the gate rows of ended steps (flow control): it must not park the gate
of a step that a concurrent transaction (an operator retry) brings back, or no claim would
ever walk to that step again."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg

from cyclone_dsl import Client, Concurrency, step
from cyclone_dsl.sql import Q


@step(name="gp_limited", concurrency=Concurrency(limit=1))
def gp_limited(x: int) -> int:
    return x


def test_a_step_brought_back_while_the_scanner_parks_keeps_its_gate(
    client: Client, cyclone_dsn: str
) -> None:
    handle = client.enqueue(gp_limited, 1)
    with psycopg.connect(cyclone_dsn, autocommit=True) as setup:
        (step_id,) = setup.execute(
            "SELECT id FROM cyclone_steps WHERE run_id = %s", (handle.id,)
        ).fetchone() or (None,)
        # Ended, its gate not parked yet (what a failure leaves for the scanner).
        setup.execute("UPDATE cyclone_steps SET state = 'discarded' WHERE id = %s", (step_id,))
    outcome: dict[str, Any] = {}
    with (
        psycopg.connect(cyclone_dsn) as retry,
        psycopg.connect(cyclone_dsn, autocommit=True) as scanner,
        psycopg.connect(cyclone_dsn, autocommit=True) as watcher,
    ):
        retry.execute("UPDATE cyclone_steps SET state = 'available' WHERE id = %s", (step_id,))
        scanner_pid = scanner.info.backend_pid

        def park() -> None:
            outcome["row"] = scanner.execute(
                Q.park_ended_gates, {"after_id": 0, "limit": 100}
            ).fetchone()

        parking = threading.Thread(target=park)
        parking.start()
        deadline = time.monotonic() + 10
        while parking.is_alive() and watcher.execute(
            "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s",
            (scanner_pid,),
        ).fetchone() != (True,):
            assert time.monotonic() < deadline, "the parking statement neither ended nor waited"
            time.sleep(0.01)
        retry.commit()  # the step is back: its gate must stay open
        parking.join(10)
        queue = watcher.execute(
            "SELECT queue FROM cyclone_ext_gates WHERE step_id = %s", (step_id,)
        ).fetchone()
    assert outcome["row"] is not None
    assert queue is not None and queue[0] != "", "the gate of a step brought back was parked"
