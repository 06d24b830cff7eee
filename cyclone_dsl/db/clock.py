"""The shift added to the database clock in every time-sensitive statement of this process.

Zero in production: every instant is the database's ``now()``. Tests move
time forward (timers, deadlines, leases, cron slots) without sleeping through
:func:`cyclone_dsl.testing.shifted_clock`, which sets it for every client,
worker and scanner of the process; it takes effect at their next transaction.
"""

from __future__ import annotations

from datetime import timedelta

from cyclone_dsl.errors import InvalidArgument

_shift = timedelta(0)


def current_shift() -> timedelta:
    return _shift


def set_shift(shift: timedelta) -> None:
    """Set the shift; anything but a timedelta is refused here, where the caller is (every
    later statement of the process would fail on it)."""
    if not isinstance(shift, timedelta):
        raise InvalidArgument(f"the clock shift must be a timedelta, not {shift!r}")
    global _shift  # one clock per process, by design (see the module docstring)
    _shift = shift
