"""Move the database clock in tests, without sleeping.

Every time-sensitive statement of Cyclone compares with the database's
``now()`` plus a shift, zero in production. Inside :func:`shifted_clock`, every
client, worker and scanner of this process sees the database clock moved by
``shift`` (from their next transaction on): timers, signal timeouts,
deadlines, leases, backoffs and cron slots come due as if that time had
passed. It does not change the server's clock, and other processes do not
see it::

    with shifted_clock(timedelta(hours=2)):
        scanner.scan_once()  # a 1-hour wait_timer fires now
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from cyclone_dsl.db import clock


@contextmanager
def shifted_clock(shift: timedelta) -> Iterator[None]:
    """Shift the database clock of this process by ``shift`` inside the block."""
    before = clock.current_shift()
    clock.set_shift(shift)
    try:
        yield
    finally:
        clock.set_shift(before)


def set_clock_shift(shift: timedelta) -> None:
    """Shift the database clock of this process by ``shift`` until changed again (for a
    worker process started by a test, say)."""
    clock.set_shift(shift)
