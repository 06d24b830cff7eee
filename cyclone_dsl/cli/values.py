"""How the CLI reads durations and prints values: ``7d`` in, ISO 8601 out."""

from __future__ import annotations

import json
import re
from datetime import date, datetime, timedelta
from enum import Enum
from typing import Any, cast

import attrs
import click

from cyclone_dsl.durations import is_duration, refusal

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_UNITS = {
    "ms": timedelta(milliseconds=1),
    "s": timedelta(seconds=1),
    "m": timedelta(minutes=1),
    "h": timedelta(hours=1),
    "d": timedelta(days=1),
    "w": timedelta(weeks=1),
}


def parse_duration(text: str) -> timedelta:
    """``30s``, ``15m``, ``12h``, ``7d``, ``2w`` (a bare number is seconds)."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(
            f"{text!r} is not a duration: write a number and a unit, as in 30s, 15m, 12h, 7d or 2w"
        )
    try:
        return float(match.group(1)) * _UNITS[match.group(2) or "s"]
    except OverflowError:
        raise ValueError(f"{text!r} is longer than any duration Cyclone takes") from None


class Duration(click.ParamType[timedelta]):
    """A click parameter type for :func:`parse_duration`."""

    name = "duration"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> timedelta:
        if isinstance(value, timedelta):
            return value
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class Retention(click.ParamType[timedelta | None]):
    """A retention: a :func:`parse_duration` duration, or ``none`` (keep ended runs)."""

    name = "duration|none"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> timedelta | None:
        if value is None or isinstance(value, timedelta):
            return value
        if str(value).strip().lower() == "none":
            return None
        try:
            kept_for = parse_duration(str(value))
        except ValueError as exc:
            self.fail(f"{exc}, or none", param, ctx)
        if not is_duration(kept_for):  # 0 would delete every run as soon as it ended
            self.fail(f"{refusal('retention', value)} (or none)", param, ctx)
        return kept_for


def _plain(value: object) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Enum):
        return value.value
    if attrs.has(type(value)):
        return attrs.asdict(cast(Any, value), recurse=False)
    raise TypeError(f"{type(value).__name__} is not JSON")


def to_json(data: object) -> str:
    """JSON with ISO 8601 timestamps, durations in seconds and enums as their values."""
    return json.dumps(data, default=_plain, indent=2)


def to_json_line(data: object) -> str:
    """:func:`to_json` on one line (JSON Lines, for streams)."""
    return json.dumps(data, default=_plain, ensure_ascii=False)


def human_duration(value: timedelta) -> str:
    """``7d``, ``12h``, ``15m``, ``30s``: the largest unit that divides it."""
    seconds = value.total_seconds()
    if seconds == 0:
        return "0s"
    if seconds % 86400 == 0:
        return f"{int(seconds // 86400)}d"
    if seconds % 3600 == 0:
        return f"{int(seconds // 3600)}h"
    if seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    return f"{seconds:g}s"
