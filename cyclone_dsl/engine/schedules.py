"""Cron schedules: registration (with definition pinning) and firing (deduplicated per slot).

Slots are computed with croniter in the schedule's time zone from the
*database* clock. DST: a local time skipped in spring fires at the first valid
instant after the change (as croniter says); a local time repeated in autumn fires
once, at its first occurrence, unless the cron fires every hour.

Missed slots (the scanner was down): with the default ``catch_up="latest"``
only the most recent missed slot fires, once; ``catch_up="all"`` fires each
missed slot in turn, one per scanner pass.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Collection, Mapping
from datetime import datetime, timedelta, tzinfo
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable
from zoneinfo import ZoneInfo

from croniter import CroniterError, croniter

from cyclone_dsl.db.tx import Row, Tx
from cyclone_dsl.engine.submit import insert_run
from cyclone_dsl.engine.transitions import Hooks
from cyclone_dsl.errors import CycloneError, InvalidArgument, ScheduleError, UnknownDefinition
from cyclone_dsl.failpoints import failpoint
from cyclone_dsl.graph.rows import CompiledRun, ScheduleCompiler, ScheduleRow
from cyclone_dsl.payload import MAX_WORKFLOW_NAME_BYTES, JSONValue, text_problem
from cyclone_dsl.sql import Q

LOCAL = "Local"
CatchUp = Literal["latest", "all"]
#: How long a process leaves a schedule it refused for its input (its handler of the kind
#: cannot take it) before it looks at it again: it writes that refusal once per span, not
#: on every pass, while a process whose handler takes the input fires it at once.
REFUSED_INPUT_SPAN = timedelta(minutes=5)


@runtime_checkable
class TargetedCompiler(Protocol):
    """A :data:`ScheduleCompiler` that says what its process can fire (``compiler_for``'s):
    a scanner leases those schedules first, and leaves one it could only refuse once a
    refusal says why."""

    #: The schedules this process refused for their input, to the ``time.monotonic()`` at
    #: which it looks at each again (kept by :func:`lease_due` and :func:`fire`).
    refused_lately: dict[str, float]

    def __call__(self, kind: str, run_input: JSONValue, row: Mapping[str, Any]) -> CompiledRun: ...

    def targets(self) -> tuple[Collection[str], Mapping[str, str]]:
        """The kinds the process has (workflows, steps, actions) and the ``def_version``
        of each workflow (by name) whose definition it has."""
        ...


_refused_lock = threading.Lock()


def zone(location: str | None) -> tzinfo:
    """The IANA zone, or the machine's local zone for ``Local``."""
    if location in (None, "", LOCAL):
        localtime = Path("/etc/localtime")
        if localtime.exists():
            with localtime.open("rb") as handle:
                return ZoneInfo.from_file(handle, key="localtime")
        return ZoneInfo("UTC")
    try:
        return ZoneInfo(str(location))
    except (ValueError, KeyError, OSError):
        raise ScheduleError(f"{location!r} is not an IANA time zone") from None


def next_slot(cron: str, location: str | None, after: datetime) -> datetime:
    """The first slot strictly after ``after``; :class:`ScheduleError` if there is none.

    A local time repeated in autumn fires once (at its first occurrence) unless the cron
    fires every hour, whose repeated hour is an hour of its own."""
    tz = zone(location)
    local = after.astimezone(tz)
    try:
        iterator = croniter(cron, local)
        every_hour = iterator.expanded[1] == ["*"] or len(iterator.expanded[1]) == 24
        result: datetime = iterator.get_next(datetime)
        while not every_hour and _second_occurrence(result, tz):
            result = iterator.get_next(datetime)
    except CroniterError as exc:  # a date that never comes (February 30th), or bad syntax
        raise ScheduleError(f"{cron!r} never fires: {exc}") from None
    return result


def _second_occurrence(moment: datetime, tz: tzinfo) -> bool:
    """Whether ``moment`` is the second instant of a local wall time that occurs twice
    (the hour repeated when clocks go back)."""
    wall = moment.astimezone(tz).replace(tzinfo=None)
    first = wall.replace(fold=0, tzinfo=tz).utcoffset()
    second = wall.replace(fold=1, tzinfo=tz).utcoffset()
    return first != second and moment.utcoffset() == second and first != moment.utcoffset()


def latest_slot(cron: str, location: str | None, at: datetime) -> datetime:
    """The last slot at or before ``at``; :class:`ScheduleError` if there is none."""
    local = (at + timedelta(microseconds=1)).astimezone(zone(location))
    try:
        result: datetime = croniter(cron, local).get_prev(datetime)
    except CroniterError as exc:
        raise ScheduleError(f"{cron!r} never fires: {exc}") from None
    return result


def db_now(tx: Tx) -> datetime:
    row = tx.one(Q.db_now)
    assert row is not None
    now: datetime = row["now"]
    return now


def register(tx: Tx, schedule: ScheduleRow, *, from_code: bool = False) -> datetime:
    """Upsert a schedule (a changed cron or zone recomputes its next slot); return it.

    ``from_code``: an ``@schedule`` registered by a worker's start or
    ``register_schedules()``; it does not enable again a schedule that was disabled (by an
    operator, say), while ``enabled=False`` in the code disables it. A schedule enabled
    again fires at most the latest of the slots it missed while disabled."""
    if not croniter.is_valid(schedule.cron):
        raise ScheduleError(f"{schedule.cron!r} is not a valid cron expression")
    location = schedule.location or LOCAL
    now = db_now(tx)
    first = next_slot(schedule.cron, location, now)
    latest: datetime | None = None
    with contextlib.suppress(ScheduleError):  # no slot before now (a cron bound by year)
        latest = latest_slot(schedule.cron, location, now)
    row = tx.one(
        Q.upsert_schedule,
        id=schedule.id,
        kind=schedule.kind,
        input=schedule.input,
        cron_spec=schedule.cron,
        location=location,
        next_run_at=first,
        latest_run_at=latest,
        enabled=schedule.enabled,
        from_code=from_code,
        max_attempts=schedule.max_attempts,
        timeout=schedule.timeout,
        queue=schedule.queue,
        priority=schedule.priority,
        retention=schedule.retention,
        def_version=schedule.def_version,
    )
    assert row is not None
    next_run_at: datetime = row["next_run_at"]
    return next_run_at


def set_enabled(tx: Tx, schedule_id: str, enabled: bool) -> None:
    """Enable or disable a schedule. A schedule enabled again fires at most the latest of
    the slots it missed while disabled, whatever its scanners' ``catch_up``."""
    row = tx.one(Q.lock_schedule, id=_checked_id(schedule_id))
    if row is None:
        raise ScheduleError(f"there is no schedule {schedule_id!r}")
    next_run_at = row["next_run_at"]
    if enabled and not row["enabled"]:
        # A row this build refuses keeps its slot: the scanner disables it again, saying why.
        with contextlib.suppress(ScheduleError):
            next_run_at = max(
                next_run_at, latest_slot(row["cron_spec"], row["location"], row["now"])
            )
    tx.run(Q.set_schedule_enabled, id=schedule_id, enabled=enabled, next_run_at=next_run_at)


def delete(tx: Tx, schedule_id: str) -> None:
    if not tx.rows(Q.delete_schedule, id=_checked_id(schedule_id)):
        raise ScheduleError(f"there is no schedule {schedule_id!r}")


def _checked_id(schedule_id: str) -> str:
    wrong = text_problem("a schedule id", schedule_id, MAX_WORKFLOW_NAME_BYTES)
    if wrong is not None:
        raise ScheduleError(wrong)
    return schedule_id


def lease_due(
    tx: Tx,
    *,
    owner: str,
    limit: int,
    lease: timedelta,
    compile_target: ScheduleCompiler | None = None,
) -> list[Row]:
    """Lease up to ``limit`` due schedules. With a :class:`TargetedCompiler`, those its
    process can fire come first, and one it cannot fire is leased only while no refusal
    says why (so that it is refused once, not on every pass); with any other compiler, or
    none, by their slots alone."""
    kinds: list[str] | None = None
    workflows: list[tuple[str, str]] = []
    refused: list[str] = []
    if isinstance(compile_target, TargetedCompiler):
        names, versions = compile_target.targets()
        kinds, workflows = sorted(names), sorted(versions.items())
        now = time.monotonic()
        with _refused_lock:
            lately = compile_target.refused_lately
            for schedule_id in [key for key, until in lately.items() if until <= now]:
                del lately[schedule_id]
            refused = sorted(lately)
    rows = tx.rows(
        Q.lease_due_schedules,
        owner=owner,
        limit=limit,
        lease=lease,
        kinds=kinds,
        workflows=[name for name, _ in workflows],
        versions=[version for _, version in workflows],
        refused=refused,
    )
    # The UPDATE's rows come in no set order: fired in the order they came due.
    return sorted(rows, key=lambda r: (r["next_run_at"], r["id"]))


def fire(
    tx: Tx,
    leased: Row,
    *,
    owner: str,
    compile_target: ScheduleCompiler,
    hooks: Hooks,
    catch_up: CatchUp = "latest",
) -> int | None:
    """Fire one leased schedule's due slot; return the run id (None if refused or deduplicated).

    The schedule is read again, locked: an update, a disable or a delete that committed
    since the lease applies (a changed cron may have moved its slot), and one that comes
    later waits for this fire to commit."""
    schedule = tx.one(Q.lock_leased_schedule, id=leased["id"], owner=owner)
    if schedule is None:
        return None  # deleted, or its lease taken over
    if not schedule["enabled"] or schedule["next_run_at"] > schedule["now"]:
        tx.run(Q.release_schedule_lease, id=schedule["id"], owner=owner)
        return None
    cron, location = schedule["cron_spec"], schedule["location"]
    slot: datetime = schedule["next_run_at"]
    try:
        if not croniter.is_valid(cron):
            raise ScheduleError(f"{cron!r} is not a valid cron expression")
        zone(location)
        if catch_up == "latest":
            slot = max(slot, latest_slot(cron, location, schedule["now"]))
    except ScheduleError as exc:
        # A row this build would have refused (another implementation or a hand wrote it)
        # can never fire here: it is disabled, not retried on every pass.
        tx.run(Q.disable_failed_schedule, id=schedule["id"], owner=owner, error=f"disabled: {exc}")
        return None
    following: datetime | None
    try:
        following = next_slot(cron, location, slot)
    except ScheduleError:
        following = None  # the last slot of a cron bound by year: fire it, then retire it
    try:
        # Before anything is decided about the slot: a process without the pinned
        # definition leaves it, even one that could not compile its input.
        compiled = compile_target(schedule["kind"], schedule["input"], schedule)
    except UnknownDefinition as exc:
        tx.run(Q.schedule_refused, id=schedule["id"], owner=owner, error=str(exc))
        return None
    except CycloneError as exc:
        if isinstance(exc, InvalidArgument) and schedule["def_version"] is None:
            # A step's or action's schedule is not pinned, and registration checked its input
            # with the registering process's handler: this process's handler of the kind is
            # another (another deploy's). The slot is left for a process whose handler takes
            # the input, as for a workflow's pinned definition; this process leaves the
            # schedule for a span (a refusal on every pass would write it on every pass).
            if isinstance(compile_target, TargetedCompiler):
                with _refused_lock:
                    compile_target.refused_lately[schedule["id"]] = (
                        time.monotonic() + REFUSED_INPUT_SPAN.total_seconds()
                    )
            error = (
                f"this process's handler of {schedule['kind']!r} cannot take the schedule's "
                f"input ({exc}); a process whose handler takes it will fire it"
            )
            tx.run(Q.schedule_refused, id=schedule["id"], owner=owner, error=error)
            return None
        error = f"fire of {slot.isoformat()} failed: {exc}"
        if following is None:
            tx.run(Q.disable_failed_schedule, id=schedule["id"], owner=owner, error=error)
        else:
            tx.run(
                Q.schedule_failed,
                id=schedule["id"],
                owner=owner,
                error=error,
                next_run_at=following,
            )
        return None
    run_id: int | None = None
    try:
        with tx.savepoint():  # a savepoint: a slot recorded before rolls back this run
            candidate = insert_run(tx, compiled, hooks=hooks)
            if not tx.one(
                Q.record_fire, schedule_id=schedule["id"], scheduled_for=slot, run_id=candidate
            ):
                raise _AlreadyFired
            failpoint("schedule.after_fire_record")
            run_id = candidate
    except _AlreadyFired:
        run_id = None  # another scanner fired this slot (before a crash, say): no second run
    if following is None:
        tx.run(Q.schedule_retired, id=schedule["id"], owner=owner, run_id=run_id)
    else:
        tx.run(
            Q.schedule_fired, id=schedule["id"], owner=owner, next_run_at=following, run_id=run_id
        )
    return run_id


class _AlreadyFired(Exception):
    """Internal: the slot was recorded by an earlier fire; roll back this run."""
