"""What the client returns for a schedule, and how it reads the options it is given."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import attrs

from cyclone_dsl.dsl.schedule import ScheduleSpec, schedule_duration
from cyclone_dsl.errors import ScheduleError
from cyclone_dsl.payload import JSONValue


@attrs.frozen
class Schedule:
    id: str
    kind: str
    input: JSONValue
    cron_spec: str
    location: str
    next_run_at: datetime
    enabled: bool
    lease_owner: str | None
    lease_expiry: datetime | None
    last_run_id: int | None
    last_error: str | None
    consecutive_failures: int
    max_attempts: int
    timeout_s: float | None
    queue: str
    priority: int
    retention_s: float | None
    def_version: str | None
    created_at: datetime
    updated_at: datetime


def schedule_from_row(row: dict[str, Any]) -> Schedule:
    return Schedule(**row)


def spec_for(
    cron: str,
    *,
    schedule_id: str | None,
    location: str | None,
    enabled: bool,
    input_value: JSONValue,
    queue: str | None,
    priority: int | None,
    max_attempts: int | None,
    timeout: timedelta | float | None,
    retention: timedelta | float | None,
) -> ScheduleSpec:
    if not isinstance(enabled, bool):
        raise ScheduleError("enabled must be True or False")
    return ScheduleSpec(
        cron,
        schedule_id,
        location,
        enabled,
        input_value,
        queue,
        priority,
        max_attempts,
        schedule_duration("timeout", timeout),
        schedule_duration("retention", retention),
    )
