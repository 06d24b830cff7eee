"""Checks of arguments shared by the client and the worker, which cannot import each other."""

from __future__ import annotations

import math
import threading

from cyclone_dsl.durations import MAX_DURATION
from cyclone_dsl.errors import InvalidArgument


def checked_flag(name: str, value: object) -> bool:
    """``value`` if it is a bool: a truthy string (``"no"``) must not pass for True."""
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name} must be True or False, not {value!r}")
    return value


#: The longest duration option: what a thread can wait (``threading.TIMEOUT_MAX``, about
#: 292 years), within the durations Cyclone takes.
MAX_SECONDS = min(MAX_DURATION.total_seconds(), threading.TIMEOUT_MAX)


def check_seconds(option: str, seconds: object, *, positive: bool) -> None:
    """A duration option in seconds: a finite number up to :data:`MAX_SECONDS`, at least a
    microsecond (``positive``: a shorter one is 0 as a ``timedelta``) or >= 0."""
    # Compared, never converted: an int past the float range (10**400) is just too long.
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or (isinstance(seconds, float) and math.isnan(seconds))
        or seconds < 0
        or (positive and seconds < 1e-6)
        or seconds > MAX_SECONDS
    ):
        bound = "> 0 (a microsecond at least)" if positive else ">= 0"
        raise InvalidArgument(
            f"{option} must be a finite number of seconds {bound}, up to {MAX_SECONDS:.0f} "
            f"(what a thread can wait), not {seconds!r}"
        )
