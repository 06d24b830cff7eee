"""Wait for a condition instead of sleeping: the one polling helper the tests share.

A test that sleeps "to give it time" and then asserts is slow when the machine is
idle and flaky when it is busy. :func:`wait_until` polls a predicate (the
database, the public API, a counter the test owns) until it holds, and fails
with what it waited for once the deadline passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, TypeVar

import psycopg

from cyclone_dsl.db import clock

if TYPE_CHECKING:
    from cyclone_dsl import Client, Worker

T = TypeVar("T")

#: An idle worker's poll in tests of wake-ups: far longer than any wait, so work that starts
#: within seconds was woken (or found by a claim), not polled.
LONG_POLL = 60.0
#: How long work that a wake-up starts may take to finish on a loaded machine.
PROMPT = 8.0


#: The first pause of :func:`wait_until` between two looks, and the longest: the pauses
#: grow from one to the other. Each look is a query or more, and the suite is CPU-bound:
#: a look every 20 ms cost a waiting test about a tenth of a core, taken from the work it
#: waited for.
FIRST_PAUSE = 0.005
LONGEST_PAUSE = 0.1


def wait_until(
    predicate: Callable[[], T],
    *,
    timeout: float = 20.0,
    what: str,
    interval: float | None = None,
) -> T:
    """Call ``predicate`` until it returns a truthy value, and return that value.

    Raises AssertionError naming ``what`` (and the last value seen) if it is
    still falsy after ``timeout`` seconds. Exceptions from ``predicate`` are
    not swallowed: a broken condition fails at once, not at the deadline.
    ``interval``: a fixed pause between looks (by default, pauses that grow from
    :data:`FIRST_PAUSE` to :data:`LONGEST_PAUSE`).
    """
    deadline = time.monotonic() + timeout
    pauses = growing_pauses() if interval is None else itertools.repeat(interval)
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout:g}s for {what}; last seen: {value!r}")
        time.sleep(next(pauses))


def growing_pauses() -> Iterator[float]:
    """:data:`FIRST_PAUSE`, then half as long again each time, up to :data:`LONGEST_PAUSE`."""
    pause = FIRST_PAUSE
    while True:
        yield pause
        pause = min(pause * 1.5, LONGEST_PAUSE)


async def until(predicate: Callable[[], object], *, what: str, timeout: float = 20.0) -> None:
    """:func:`wait_until` for a coroutine: polls without blocking the event loop (the loop
    must run for asyncgen finalizers and closing tasks)."""
    deadline = asyncio.get_running_loop().time() + timeout
    pauses = growing_pauses()
    while not predicate():
        if asyncio.get_running_loop().time() >= deadline:
            raise AssertionError(f"waited {timeout:g}s for {what}")
        await asyncio.sleep(next(pauses))


def scanner_passes(worker: Worker, n: int = 2) -> None:
    """Until ``worker``'s scanner has ended ``n`` more passes: with 2, a whole pass began
    after the call and saw what the test did before it (a moved clock, a new row)."""
    scanner = worker._scanner
    assert scanner is not None
    target = scanner.passes + n
    wait_until(lambda: scanner.passes >= target, timeout=PROMPT, what=f"{n} scanner passes")


def seconds_until(dsn: str, at: datetime) -> float:
    """How long until ``at`` by the database clock, as this process has moved it: what
    decides when a deadline, a timer or a wait's timeout passes."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM %s - (now() + %s))", [at, clock.current_shift()]
        ).fetchone()
    assert row is not None
    return float(row[0])


def expire_leases_until(reclaimed: Callable[[], bool], *, what: str, timeout: float = 20.0) -> None:
    """Move this process's database clock ahead, one hour more at each look, until
    ``reclaimed()`` holds (read before each move), then leave it there.

    One move is not enough: a live worker's heartbeat can renew a lease under the moved
    clock before any scanner saw it expired, and the step then never is reclaimed. The
    caller moves the clock back (the ``clock`` fixture, or ``shifted_clock``).
    """

    def look() -> bool:
        if reclaimed():
            return True
        clock.set_shift(clock.current_shift() + timedelta(hours=1))
        return False

    wait_until(look, timeout=timeout, what=what, interval=0.1)


def wait_backends(dsn: str) -> set[int]:
    """The server backends of this process's wait connections (``cyclone-wait-<pid>``:
    one per client while any of its ``wait()`` / ``result()`` calls wait)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
            (f"cyclone-wait-{os.getpid()}",),
        ).fetchall()
    return {int(r[0]) for r in rows}


def open_sockets() -> int:
    """Sockets this process holds (a database connection is one, a socket pair two)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


def waits_in_flight(client: Client) -> int:
    """The ``wait()`` / ``result()`` calls in flight on ``client`` (its watcher's count; an
    ``AsyncClient``'s is ``waits_in_flight(aclient._client)``)."""
    return client._watcher.in_flight()


def listen_backends(dsn: str) -> int:
    """The LISTEN connections of this process's workers (``cyclone-listen-<pid>``)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
            (f"cyclone-listen-{os.getpid()}",),
        ).fetchone()
    assert row is not None
    return int(row[0])


def wait_idle(dsn: str, worker: Worker, *, listeners: int) -> None:
    """Until this process's workers hold ``listeners`` LISTEN connections and ``worker``'s
    claims stop for a while: it waits for a wake-up (or its poll). A test of a wake-up
    then makes its transition: work that starts within seconds was woken, not polled
    (with ``poll_interval=LONG_POLL``), and no LISTEN connecting later wakes it by chance."""
    wait_until(lambda: listen_backends(dsn) == listeners, timeout=PROMPT, what="the LISTENs")
    lane = worker._thread_lane
    last = -1

    def settled() -> bool:
        nonlocal last
        seen, last = last, lane.claims
        return seen == last

    wait_until(settled, interval=0.3, timeout=PROMPT, what="the worker to wait for work")


class HoldFirst:
    """A failpoint action (``arm(point, hold)``) that holds the first caller to reach the
    point, in its transaction, until :meth:`release` (or ``PROMPT`` seconds); later callers
    pass. ``reached`` is set when the first one is held."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self._go = threading.Event()

    def __call__(self) -> None:
        if not self.reached.is_set():
            self.reached.set()
            self._go.wait(PROMPT)

    def release(self) -> None:
        self._go.set()
