"""``@schedule``: cron registration metadata stacked on a workflow, step or action."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import attrs
from croniter import CroniterError, croniter

from cyclone_dsl import payload
from cyclone_dsl.errors import InvalidPayload, ScheduleError

T = TypeVar("T")
_PENDING_ATTR = "__cyclone_schedules__"
_ANY_INSTANT = datetime(2000, 1, 1, tzinfo=UTC)


@attrs.frozen
class ScheduleSpec:
    cron: str
    id: str | None = None
    location: str | None = None
    enabled: bool = True
    input: payload.JSONValue = None
    queue: str | None = None
    priority: int | None = None
    max_attempts: int | None = None
    timeout: timedelta | None = None
    retention: timedelta | None = None


def check_schedule(spec: ScheduleSpec) -> None:
    if not isinstance(spec.cron, str) or not croniter.is_valid(spec.cron):
        raise ScheduleError(f"{spec.cron!r} is not a valid cron expression")
    try:  # from any fixed instant: whether some date matches, not when
        croniter(spec.cron, _ANY_INSTANT).get_next(datetime)
    except CroniterError as exc:  # February 30th: valid syntax, no date ever matches
        raise ScheduleError(f"{spec.cron!r} never fires: {exc}") from None
    if spec.location is not None:
        try:
            ZoneInfo(spec.location)
        except (ZoneInfoNotFoundError, ValueError):
            raise ScheduleError(f"{spec.location!r} is not an IANA time zone") from None
    if spec.id is not None and (not isinstance(spec.id, str) or not spec.id or "\x00" in spec.id):
        raise ScheduleError(f"a schedule id must be a non-empty string, not {spec.id!r}")
    try:
        payload.check(spec.input)
    except InvalidPayload as exc:
        raise ScheduleError(f"schedule input: {exc}") from None


def schedule(
    cron: str,
    *,
    id: str | None = None,
    location: str | None = None,
    enabled: bool = True,
    input: payload.JSONValue = None,
    queue: str | None = None,
    priority: int | None = None,
    max_attempts: int | None = None,
    timeout: timedelta | float | None = None,
    retention: timedelta | float | None = None,
) -> Callable[[T], T]:
    """Register a cron schedule for the decorated ``@workflow``, ``@step`` or ``@action``."""

    def seconds(value: timedelta | float | None) -> timedelta | None:
        if value is None or isinstance(value, timedelta):
            return value
        return timedelta(seconds=value)

    spec = ScheduleSpec(
        cron,
        id,
        location,
        enabled,
        input,
        queue,
        priority,
        max_attempts,
        seconds(timeout),
        seconds(retention),
    )
    check_schedule(spec)

    def attach(target: T) -> T:
        existing: Any = getattr(target, "schedules", None)
        if isinstance(existing, list):
            existing.append(spec)
        else:
            pending = list(getattr(target, _PENDING_ATTR, []))
            pending.append(spec)
            setattr(target, _PENDING_ATTR, pending)
        return target

    return attach


def pending_schedules(fn: object) -> list[ScheduleSpec]:
    """Schedules attached to a plain function before it was decorated as a step or workflow."""
    return list(getattr(fn, _PENDING_ATTR, []))
