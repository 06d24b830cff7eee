"""``@schedule``: cron registration metadata stacked on a workflow, step or action."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import attrs
from croniter import CroniterError, croniter

from cyclone_dsl import payload
from cyclone_dsl.durations import as_timedelta, is_duration, refusal
from cyclone_dsl.errors import InvalidPayload, ScheduleError
from cyclone_dsl.graph.model import NodeOptions
from cyclone_dsl.graph.validate import check_options

T = TypeVar("T")
_PENDING_ATTR = "__cyclone_schedules__"
#: How ``location`` names the machine's local zone (the default, stored as such).
LOCAL = "Local"


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


def schedule_duration(what: str, value: timedelta | float | None) -> timedelta | None:
    """A schedule's ``timeout`` or ``retention``: None, or a duration given as a timedelta
    or seconds; :class:`ScheduleError` for anything else."""
    if value is None:
        return None
    converted = as_timedelta(value)
    if not isinstance(converted, timedelta) or not is_duration(converted):
        raise ScheduleError(refusal(what, value))
    return converted


def check_schedule(spec: ScheduleSpec) -> None:
    if not isinstance(spec.cron, str) or not croniter.is_valid(spec.cron):
        raise ScheduleError(f"{spec.cron!r} is not a valid cron expression")
    # Whether some date is left, not when (a 7th field is a year: all may be past). The
    # machine's clock is close enough for that; slots are computed on the database's.
    now = datetime.now(UTC)  # noqa: TID251
    try:
        croniter(spec.cron, now).get_next(datetime)
    except CroniterError as exc:  # February 30th: valid syntax, no date ever matches
        raise ScheduleError(f"{spec.cron!r} never fires: {exc}") from None
    if spec.location is not None and not isinstance(spec.location, str):
        raise ScheduleError(f"location must be an IANA time zone name, not {spec.location!r}")
    if spec.location is not None and spec.location != LOCAL:
        try:
            ZoneInfo(spec.location)
        except (ZoneInfoNotFoundError, ValueError):
            raise ScheduleError(f"{spec.location!r} is not an IANA time zone") from None
    if spec.id is not None and (
        wrong := payload.text_problem("a schedule id", spec.id, payload.MAX_WORKFLOW_NAME_BYTES)
    ):
        raise ScheduleError(wrong)
    try:
        payload.check(spec.input)
    except InvalidPayload as exc:
        raise ScheduleError(f"schedule input: {exc}") from None
    options: dict[str, Any] = {
        "queue": spec.queue,
        "priority": spec.priority,
        "max_attempts": spec.max_attempts,
        "timeout": spec.timeout,
        "retention": spec.retention,
    }
    given = attrs.evolve(NodeOptions(), **{k: v for k, v in options.items() if v is not None})
    problems = check_options(given)
    if problems:
        raise ScheduleError("; ".join(problems))


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
    spec = ScheduleSpec(
        cron,
        id,
        location,
        enabled,
        input,
        queue,
        priority,
        max_attempts,
        schedule_duration("timeout", timeout),
        schedule_duration("retention", retention),
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
