"""The limit of async handlers (no database): it grows with a backlog like the sync one,
but a busy event loop holds it where it is rather than halving it; the loop's CPU is
read from its thread."""

from __future__ import annotations

import threading
import time

from cyclone_dsl.worker.adaptive import LOOP_BUSY, Sample, SlotController
from cyclone_dsl.worker.lanes import thread_cpu_clock


def waiting_with_a_backlog(loop_cpu: float) -> Sample:
    """An interval where every claim came back full and the fetch loop waited for slots
    most of the time; the loop's thread used ``loop_cpu`` of its 0.1 s."""
    return Sample(
        seconds=0.1,
        returned=0,
        claims=2,
        asked=200,
        claimed=200,
        slot_wait=0.08,
        peak=100,
        handler_cpu=loop_cpu,
        process_cpu=0.1,
    )


def test_a_backlog_doubles_the_async_limit_while_the_loop_is_idle() -> None:
    controller = SlotController(100, 10_000, 100, busy=LOOP_BUSY)
    assert [controller.update(waiting_with_a_backlog(0.01)) for _ in range(3)] == [
        200,
        400,
        800,
    ]


def test_a_busy_loop_holds_the_async_limit() -> None:
    controller = SlotController(100, 10_000, 100, busy=LOOP_BUSY)
    controller.update(waiting_with_a_backlog(0.01))
    assert controller.update(waiting_with_a_backlog(0.09)) == 200
    # The sync rule for the same sample: handlers took all the CPU, so it halves.
    sync = SlotController(100, 10_000, 100, floor=2)
    assert sync.update(waiting_with_a_backlog(0.09)) == 50


def test_the_clock_reads_another_threads_cpu() -> None:
    done = threading.Event()
    spinning = threading.Event()

    def spin() -> None:
        spinning.set()
        while not done.is_set():
            pass

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    spinning.wait()
    clock = thread_cpu_clock(thread)
    assert clock is not None
    before = clock()
    deadline = time.monotonic() + 5
    while clock() <= before and time.monotonic() < deadline:
        time.sleep(0.01)
    used = clock() - before
    done.set()
    thread.join()
    assert used > 0
    assert clock() == 0.0  # the thread is gone
