"""Retry backoff: pure arithmetic, no clock (the delay is added to the database's now())."""

from __future__ import annotations

import random

BASE_SECONDS = 1.0
CAP_SECONDS = 300.0


def backoff_seconds(attempt: int, *, base: float | None = None, cap: float | None = None) -> float:
    """Delay before retry number ``attempt`` (1 for the first retry): capped exponential, jittered.

    The jitter keeps the result within [50%, 100%] of the capped exponential,
    so retries of many failed steps spread out instead of arriving together.
    """
    base = BASE_SECONDS if base is None else base
    cap = CAP_SECONDS if cap is None else cap
    exponential = min(cap, base * 2 ** max(0, attempt - 1))
    return float(exponential * (0.5 + random.random() / 2))
