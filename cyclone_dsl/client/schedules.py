"""Schedule registration and the compiler a scanner fires with (shared by Client and Worker)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import attrs

from cyclone_dsl.client import base
from cyclone_dsl.db.tx import Row, Tx
from cyclone_dsl.dsl.registry import Registry
from cyclone_dsl.dsl.schedule import ScheduleSpec, check_schedule
from cyclone_dsl.dsl.step import StepDef
from cyclone_dsl.dsl.workflow import WorkflowDef
from cyclone_dsl.engine import schedules
from cyclone_dsl.errors import ScheduleError
from cyclone_dsl.graph.rows import CompiledRun
from cyclone_dsl.payload import JSONValue, encode


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


def register(tx: Tx, target: StepDef[Any, Any] | WorkflowDef, spec: ScheduleSpec) -> str:
    """Upsert the schedule ``spec`` of ``target``; a workflow's definition is pinned."""
    check_schedule(spec)
    if isinstance(target, WorkflowDef):
        kind, def_version = target.name, target.def_version
        options = None
    else:
        kind, def_version = target.name, None
        options = base.step_options(
            target,
            queue=spec.queue,
            priority=spec.priority,
            max_attempts=spec.max_attempts,
            timeout=spec.timeout,
            retention=spec.retention,
        )
    schedule_id = spec.id or kind
    schedules.register(
        tx,
        schedule_id=schedule_id,
        kind=kind,
        cron=spec.cron,
        location=spec.location,
        enabled=spec.enabled,
        input_text=encode(spec.input, what="the schedule input"),
        def_version=def_version,
        queue=options.queue if options else (spec.queue or "default"),
        priority=options.priority if options else (spec.priority or 0),
        max_attempts=options.max_attempts if options else (spec.max_attempts or 5),
        timeout=options.timeout if options else spec.timeout,
        retention=options.retention if options else spec.retention,
    )
    return schedule_id


def register_all(tx: Tx, registry: Registry) -> list[str]:
    """Register every ``@schedule`` of the registry's workflows and handlers."""
    ids = []
    targets: list[StepDef[Any, Any] | WorkflowDef] = [
        *registry.workflows.values(),
        *registry.kinds.values(),
    ]
    for target in targets:
        for spec in target.schedules:
            ids.append(register(tx, target, spec))
    return ids


def compiler_for(registry: Registry) -> schedules.Compiler:
    """How a scanner of this process turns a due schedule into a run."""

    def compile_target(kind: str, run_input: JSONValue, row: Row) -> tuple[CompiledRun, str | None]:
        if kind in registry.workflows:
            definition = registry.workflows[kind]
            return base.compile_workflow(registry, definition, run_input), definition.def_version
        compiled = base.compile_standalone(
            registry,
            kind,
            run_input,
            queue=row["queue"],
            priority=row["priority"],
            max_attempts=row["max_attempts"],
            timeout=timedelta(seconds=row["timeout_s"]) if row["timeout_s"] else None,
            retention=timedelta(seconds=row["retention_s"]) if row["retention_s"] else None,
        )
        return compiled, None

    return compile_target


def schedule_from_row(row: Row) -> Schedule:
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
    def seconds(value: timedelta | float | None) -> timedelta | None:
        if value is None or isinstance(value, timedelta):
            return value
        return timedelta(seconds=value)

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
        seconds(timeout),
        seconds(retention),
    )
