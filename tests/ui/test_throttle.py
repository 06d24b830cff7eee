"""The dashboard's shared reads: kept twenty times as long as they took, per client."""

from __future__ import annotations

import threading
import time

from cyclone_dsl import Client
from cyclone_dsl.ui.throttle import Throttled
from tests.waiting import wait_until


def test_a_read_is_kept_share_times_as_long_as_it_took(client: Client) -> None:
    took: list[float] = []

    def read(_: Client) -> int:
        started = time.monotonic()
        time.sleep(0.05)
        took.append(time.monotonic() - started)
        return len(took)

    shared = Throttled(read, fresh_for=0.0, share=20.0)
    first = time.monotonic()
    assert shared.get(client) == 1
    wait_until(lambda: shared.get(client) == 2, timeout=10, what="a second read")
    assert time.monotonic() - first >= 20 * took[0]


def test_callers_at_once_share_one_read_and_another_client_reads_its_own(
    client: Client, cyclone_dsn: str
) -> None:
    reads: list[Client] = []
    gate = threading.Event()

    def read(of: Client) -> int:
        gate.wait(5)
        reads.append(of)
        return len(reads)

    shared = Throttled(read, fresh_for=60.0)
    got: list[int] = []
    callers = [threading.Thread(target=lambda: got.append(shared.get(client))) for _ in range(8)]
    for caller in callers:
        caller.start()
    gate.set()
    for caller in callers:
        caller.join(10)
    assert got == [1] * 8 and reads == [client]
    with Client(cyclone_dsn) as other:
        assert shared.get(other) == 2
    assert reads[-1] is not client
