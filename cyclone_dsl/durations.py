"""The durations Cyclone stores (timeouts, retention, deadlines, waits, delays).

A stored duration is added to a timestamp in SQL (``started_at + timeout``, ``now() +
deadline``): past PostgreSQL's last timestamp (year 294276) that raises, and a scanner pass
that met one such row failed for every run. So a duration is positive and at most
:data:`MAX_DURATION`.
"""

from __future__ import annotations

from datetime import timedelta

MAX_DURATION = timedelta(days=365_000)
"""The longest duration accepted: a thousand years."""


def as_timedelta(value: object) -> timedelta | object:
    """A timedelta from a timedelta or a number of seconds; anything else (and a number no
    timedelta holds: NaN, infinity, too large) is returned as it is, for the caller's
    check (:func:`is_duration`) to refuse."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return timedelta(seconds=value)
        except (ValueError, OverflowError):
            return value
    return value


def is_duration(value: object) -> bool:
    """Whether ``value`` is a positive timedelta of at most :data:`MAX_DURATION`."""
    return isinstance(value, timedelta) and timedelta(0) < value <= MAX_DURATION


def refusal(what: str, value: object) -> str:
    """The message for a ``what`` that is not :func:`is_duration`."""
    return f"{what} must be a positive duration of at most 1000 years, not {value!r}"
