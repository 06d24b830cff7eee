"""Values as people read them: ``3 min ago``, ``1.2 s``, exact times on hover.

The page's script (``static/cyclone.js``, ``agoText``) re-renders the relative times
with the same rules as :func:`ago` as the page stays open.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from markupsafe import Markup


def _trim(value: float) -> str:
    """One decimal, without a trailing ``.0``."""
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text


def duration(value: timedelta | float | None) -> str:
    """A length of time: ``850 ms``, ``1.2 s``, ``42 s``, ``3 min``, ``3.5 min``, ``30 h``,
    ``3 d``."""
    if value is None:
        return ""
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds < 0:
        return "-" + duration(-seconds)
    if seconds < 0.01:
        return f"{_trim(seconds * 1000)} ms"
    if seconds < 1:
        return f"{round(seconds * 1000)} ms"
    if seconds < 10:
        return f"{_trim(seconds)} s"
    if seconds < 60:
        return f"{round(seconds)} s"
    for unit, size, cap in (("min", 60, 3600), ("h", 3600, 48 * 3600), ("d", 86400, None)):
        if cap is None or seconds < cap:
            amount = seconds / size
            return f"{_trim(amount) if amount < 10 else round(amount)} {unit}"
    raise AssertionError("unreachable")


def ago(when: datetime, now: datetime) -> str:
    """``just now``, ``42 s ago``, ``3 min ago``, ``5 h ago``, ``3 days ago``; ``in 3 min``
    for a time still to come. Whole units, rounded down."""
    seconds = (now - when).total_seconds()
    future = seconds < 0
    seconds = abs(seconds)
    if seconds < 5:
        return "just now"
    if seconds < 60:
        text = f"{int(seconds)} s"
    elif seconds < 3600:
        text = f"{int(seconds // 60)} min"
    elif seconds < 48 * 3600:
        text = f"{int(seconds // 3600)} h"
    else:
        text = f"{int(seconds // 86400)} days"
    return f"in {text}" if future else f"{text} ago"


def exact(when: datetime) -> str:
    """The exact instant, in UTC to the millisecond: ``2026-12-03 10:00:03.120 UTC``."""
    utc = when.astimezone(UTC)
    return f"{utc:%Y-%m-%d %H:%M:%S}.{utc.microsecond // 1000:03d} UTC"


def clock(when: datetime) -> str:
    """The time of day in UTC, to the millisecond: ``10:00:03.120``."""
    utc = when.astimezone(UTC)
    return f"{utc:%H:%M:%S}.{utc.microsecond // 1000:03d}"


def when_html(when: datetime | None, now: datetime) -> Markup:
    """A relative time with the exact one on hover, as a ``<time>`` element."""
    if when is None:
        return Markup("")
    return Markup('<time datetime="{}" title="{}" data-ago>{}</time>').format(
        when.astimezone(UTC).isoformat(), exact(when), ago(when, now)
    )


def took(start: datetime | None, end: datetime | None) -> str:
    """The duration from ``start`` to ``end``, or nothing when one is missing."""
    if start is None or end is None:
        return ""
    return duration(end - start)
