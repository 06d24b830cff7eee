"""Audit of cron schedules through the public API (docs/concepts/schedules.md,
docs/howto/versioning.md "Schedules pin the definition").

Slots come due by moving this process's database clock
(:func:`cyclone_dsl.testing.set_clock_shift`); the firing is done either by one
deterministic scanner pass (``cyclone scan --once`` through click's CliRunner, which
fires with the process-wide registry and ``catch_up="latest"``) or by background
workers (for ``catch_up="all"``, races and deploys with registries of their own).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import attrs
import pytest
from click.testing import CliRunner

from cyclone_dsl import (
    Client,
    Concurrency,
    CycloneError,
    InvalidArgument,
    Registry,
    Worker,
    WorkflowDef,
    schedule,
    step,
    wait_signal,
    workflow,
)
from cyclone_dsl.cli.main import cli

# -- definitions (every name prefixed sca_) ------------------------------------------------


@step(name="sca_echo")
def sca_echo(x: object) -> object:
    return x


@step(name="sca_noarg")
def sca_noarg() -> str:
    return "ran"


@step(name="sca_pair")
def sca_pair(a: object, b: object) -> object:
    return [a, b]


@workflow(name="sca_flow")
def sca_flow(x):  # type: ignore[no-untyped-def]
    return sca_echo(x)


@workflow(name="sca_waiting")
def sca_waiting(x):  # type: ignore[no-untyped-def]
    return sca_echo(wait_signal("sca_go"))


# -- helpers -------------------------------------------------------------------------------


def cyclone(dsn: str, *args: str) -> Any:
    result = CliRunner().invoke(cli, ["--dsn", dsn, *args])
    return result


def scan(dsn: str) -> None:
    """One scanner pass (process-wide registry, catch_up="latest")."""
    result = cyclone(dsn, "scan", "--once", "--retention", "none")
    assert result.exit_code == 0, (result.output, result.exception)


def runs_of(client: Client, name: str) -> list[Any]:
    return client.list_runs(workflow=name, limit=500)


def the_schedule(client: Client, schedule_id: str) -> Any:
    return next(s for s in client.list_schedules() if s.id == schedule_id)


def settle(seconds: float = 0.8) -> None:
    """Let background scanners (interval 0.05-0.2s) pass several times."""
    time.sleep(seconds)


def wait_for(predicate: Callable[[], bool], timeout: float = 6.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# -- findings ------------------------------------------------------------------------------


def test_the_last_slot_of_a_year_bounded_cron_fires(
    client: Client, cyclone_dsn: str, clock: Callable[[datetime], None]
) -> None:
    clock(datetime(2027, 12, 31, 12, tzinfo=UTC))
    made = client.schedule(sca_echo, "0 0 1 1 * 0 2028", id="sca_once", location="UTC", input=1)
    assert made.next_run_at == datetime(2028, 1, 1, tzinfo=UTC)
    clock(datetime(2028, 1, 1, 0, 0, 30, tzinfo=UTC))
    scan(cyclone_dsn)
    after = the_schedule(client, "sca_once")
    assert len(runs_of(client, "sca_echo")) == 1, f"not fired; last_error={after.last_error!r}"


def test_a_schedule_input_a_step_cannot_take_is_refused_and_nothing_written(
    client: Client,
) -> None:
    with pytest.raises(InvalidArgument):
        client.enqueue(sca_noarg, 5)  # what enqueue says of the same input
    with pytest.raises(InvalidArgument):
        client.schedule(sca_noarg, "* * * * *", id="sca_noarg_in", location="UTC", input=5)
    assert client.list_schedules() == []


def test_a_schedule_of_a_step_standalone_work_cannot_call_is_refused(client: Client) -> None:
    with pytest.raises(InvalidArgument):
        client.enqueue(sca_pair, [1, 2])
    with pytest.raises(InvalidArgument):
        client.schedule(sca_pair, "* * * * *", id="sca_pair_s", location="UTC", input=[1, 2])
    assert client.list_schedules() == []


# Two deploys of one workflow (pinning): each deploy is a Registry of its own.


def _pinned_v1(x):  # type: ignore[no-untyped-def]
    return sca_echo(x)


def _pinned_v2(x):  # type: ignore[no-untyped-def]
    return sca_echo(sca_echo(x))


PINNED_V1 = WorkflowDef(_pinned_v1, "sca_pinned")
PINNED_V2 = WorkflowDef(_pinned_v2, "sca_pinned")
# v2 also caps runs per tenant, a key it reads from the input (which v1 does not need)
KEYED_V1 = WorkflowDef(_pinned_v1, "sca_keyed")
KEYED_V2 = WorkflowDef(_pinned_v2, "sca_keyed", concurrency=Concurrency(key="tenant"))


def deploy(*definitions: WorkflowDef) -> Registry:
    registry = Registry()
    for definition in definitions:
        registry.add_workflow_tree(definition)
    return registry


def test_a_slot_is_left_for_the_pinned_deploy_even_when_another_deploy_cannot_compile_it(
    cyclone_dsn: str, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    assert KEYED_V1.def_version != KEYED_V2.def_version
    base = datetime(2027, 7, 1, 12, 0, 30, tzinfo=UTC)
    clock(base)
    with Client(cyclone_dsn, registry=deploy(KEYED_V1)) as old:
        made = old.schedule(KEYED_V1, "*/5 * * * *", id="sca_keyed_s", location="UTC", input="x")
        slot = made.next_run_at
        assert slot == datetime(2027, 7, 1, 12, 5, tzinfo=UTC)
        start_worker(registry=deploy(KEYED_V2), name="sca-new", scan_interval=0.05)
        clock(slot + timedelta(seconds=30))
        assert wait_for(lambda: the_schedule(old, "sca_keyed_s").last_error is not None)
        settle(0.3)
        after = the_schedule(old, "sca_keyed_s")
        assert runs_of(old, "sca_keyed") == []
        assert after.next_run_at == slot, f"slot consumed; last_error={after.last_error!r}"
        start_worker(registry=deploy(KEYED_V1), name="sca-old", scan_interval=0.05)
        assert wait_for(lambda: len(runs_of(old, "sca_keyed")) == 1)
        assert old.get_run(runs_of(old, "sca_keyed")[0].id).def_version == KEYED_V1.def_version


def test_a_schedule_input_the_workflow_cannot_take_is_refused_and_nothing_written(
    cyclone_dsn: str,
) -> None:
    with Client(cyclone_dsn, registry=deploy(KEYED_V2)) as client:
        with pytest.raises(InvalidArgument):
            client.submit(KEYED_V2, "no tenant here")
        with pytest.raises(InvalidArgument):
            client.schedule(KEYED_V2, "* * * * *", id="sca_keyed_bad", input="no tenant here")
        assert client.list_schedules() == []


# -- DST --------------------------------------------------------------------------------------

DST_CASES = [
    # zone, cron, the day before, the slot of the change day, the slot of the day after,
    # and a later instant of the change day with the same wall time (or None)
    pytest.param(
        "Europe/Berlin",
        "30 2 * * *",
        datetime(2027, 3, 27, 12, tzinfo=UTC),
        datetime(2027, 3, 28, 1, 0, tzinfo=UTC),  # 02:30 is skipped: 03:00 CEST
        datetime(2027, 3, 29, 0, 30, tzinfo=UTC),
        None,
        id="berlin-spring",
    ),
    pytest.param(
        "Europe/Berlin",
        "30 2 * * *",
        datetime(2027, 10, 30, 12, tzinfo=UTC),
        datetime(2027, 10, 31, 0, 30, tzinfo=UTC),  # 02:30 CEST
        datetime(2027, 11, 1, 1, 30, tzinfo=UTC),
        datetime(2027, 10, 31, 1, 30, tzinfo=UTC),  # 02:30 CET
        id="berlin-autumn",
    ),
    pytest.param(
        "America/New_York",
        "30 2 * * *",
        datetime(2027, 3, 13, 12, tzinfo=UTC),
        datetime(2027, 3, 14, 7, 0, tzinfo=UTC),  # 02:30 is skipped: 03:00 EDT
        datetime(2027, 3, 15, 6, 30, tzinfo=UTC),
        None,
        id="new-york-spring",
    ),
    pytest.param(
        "America/New_York",
        "30 1 * * *",
        datetime(2027, 11, 6, 12, tzinfo=UTC),
        datetime(2027, 11, 7, 5, 30, tzinfo=UTC),  # 01:30 EDT
        datetime(2027, 11, 8, 6, 30, tzinfo=UTC),
        datetime(2027, 11, 7, 6, 30, tzinfo=UTC),  # 01:30 EST
        id="new-york-autumn",
    ),
]


@pytest.mark.parametrize(("zone", "cron", "before", "slot", "following", "repeat"), DST_CASES)
def test_a_daily_slot_on_a_dst_change_day_fires_exactly_once(
    client: Client,
    cyclone_dsn: str,
    clock: Callable[[datetime], None],
    zone: str,
    cron: str,
    before: datetime,
    slot: datetime,
    following: datetime,
    repeat: datetime | None,
) -> None:
    clock(before)
    sid = f"sca_dst_{zone}_{slot:%m}"
    made = client.schedule(sca_echo, cron, id=sid, location=zone, input="dst")
    assert made.next_run_at == slot
    clock(slot - timedelta(seconds=30))
    scan(cyclone_dsn)
    assert runs_of(client, "sca_echo") == []
    for at in (slot + timedelta(seconds=30), slot + timedelta(minutes=40)):
        clock(at)
        scan(cyclone_dsn)
        assert len(runs_of(client, "sca_echo")) == 1
    if repeat is not None:
        for at in (repeat - timedelta(seconds=1), repeat + timedelta(seconds=30)):
            clock(at)
            scan(cyclone_dsn)
            assert len(runs_of(client, "sca_echo")) == 1, "the repeated wall time fired again"
    clock(following - timedelta(minutes=1))
    scan(cyclone_dsn)
    assert len(runs_of(client, "sca_echo")) == 1
    assert the_schedule(client, sid).next_run_at == following
    clock(following + timedelta(seconds=30))
    scan(cyclone_dsn)
    assert len(runs_of(client, "sca_echo")) == 2


def test_downtime_across_the_repeated_autumn_hour_fires_once_with_catch_up_latest(
    client: Client, cyclone_dsn: str, clock: Callable[[datetime], None]
) -> None:
    clock(datetime(2027, 10, 30, 12, tzinfo=UTC))
    client.schedule(sca_echo, "30 2 * * *", id="sca_dst_down", location="Europe/Berlin")
    clock(datetime(2027, 10, 31, 3, tzinfo=UTC))  # no scanner ran over both 02:30s
    scan(cyclone_dsn)
    scan(cyclone_dsn)
    assert len(runs_of(client, "sca_echo")) == 1
    assert the_schedule(client, "sca_dst_down").next_run_at == datetime(
        2027, 11, 1, 1, 30, tzinfo=UTC
    )


def test_downtime_across_the_repeated_autumn_hour_fires_once_with_catch_up_all(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    clock(datetime(2027, 10, 30, 12, tzinfo=UTC))
    client.schedule(sca_flow, "30 2 * * *", id="sca_dst_down_all", location="Europe/Berlin")
    clock(datetime(2027, 10, 31, 3, tzinfo=UTC))
    start_worker(sca_flow, catch_up="all", scan_interval=0.05)
    assert wait_for(lambda: len(runs_of(client, "sca_flow")) >= 1)
    settle()
    assert len(runs_of(client, "sca_flow")) == 1
    assert the_schedule(client, "sca_dst_down_all").next_run_at == datetime(
        2027, 11, 1, 1, 30, tzinfo=UTC
    )


def test_an_hourly_cron_fires_in_both_repeated_autumn_hours(
    client: Client, cyclone_dsn: str, clock: Callable[[datetime], None]
) -> None:
    """docs: a cron that fires every hour fires in both hours (they are different hours)."""
    clock(datetime(2027, 10, 30, 23, 30, tzinfo=UTC))
    client.schedule(sca_echo, "0 * * * *", id="sca_dst_hourly", location="Europe/Berlin")
    for hour, expected in ((0, 1), (1, 2), (2, 3)):  # 02:00 CEST, 02:00 CET, 03:00 CET
        clock(datetime(2027, 10, 31, hour, 0, 30, tzinfo=UTC))
        scan(cyclone_dsn)
        scan(cyclone_dsn)
        assert len(runs_of(client, "sca_echo")) == expected


# -- catch-up and races ------------------------------------------------------------------------


def test_catch_up_latest_fires_the_latest_missed_slot_once_then_keeps_the_cadence(
    client: Client, cyclone_dsn: str, clock: Callable[[datetime], None]
) -> None:
    base = datetime(2027, 6, 1, 12, 0, 30, tzinfo=UTC)
    clock(base)
    client.schedule(sca_echo, "*/10 * * * *", id="sca_latest", location="UTC")
    clock(base + timedelta(minutes=65))  # 12:10 ... 13:00 were missed
    scan(cyclone_dsn)
    scan(cyclone_dsn)
    assert len(runs_of(client, "sca_echo")) == 1
    assert the_schedule(client, "sca_latest").next_run_at == datetime(
        2027, 6, 1, 13, 10, tzinfo=UTC
    )
    clock(datetime(2027, 6, 1, 13, 10, 30, tzinfo=UTC))
    scan(cyclone_dsn)
    assert len(runs_of(client, "sca_echo")) == 2


def test_catch_up_all_with_two_workers_fires_each_missed_slot_once(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    base = datetime(2027, 6, 2, 12, 0, 30, tzinfo=UTC)
    clock(base)
    client.schedule(sca_flow, "*/10 * * * *", id="sca_all", location="UTC", input={"k": 1})
    clock(base + timedelta(minutes=65))  # 12:10, 12:20, 12:30, 12:40, 12:50, 13:00
    start_worker(sca_flow, catch_up="all", scan_interval=0.05)
    start_worker(sca_flow, catch_up="all", scan_interval=0.05)
    assert wait_for(lambda: len(runs_of(client, "sca_flow")) >= 6)
    settle()
    assert len(runs_of(client, "sca_flow")) == 6
    assert the_schedule(client, "sca_all").next_run_at == datetime(2027, 6, 2, 13, 10, tzinfo=UTC)


def test_racing_scanners_fire_each_slot_exactly_once(
    client: Client,
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    clock: Callable[[datetime], None],
) -> None:
    base = datetime(2027, 6, 3, 12, 0, 30, tzinfo=UTC)
    clock(base)
    client.schedule(sca_flow, "* * * * *", id="sca_race", location="UTC")
    start_worker(sca_flow, catch_up="all", scan_interval=0.02)
    start_worker(sca_flow, catch_up="latest", scan_interval=0.02)
    start_worker(sca_flow, catch_up="all", scan_interval=0.02)
    for minute in range(1, 4):
        clock(base + timedelta(minutes=minute))
        scan(cyclone_dsn)  # a fourth scanner, `cyclone scan`
        assert wait_for(lambda n=minute: len(runs_of(client, "sca_flow")) >= n)
        settle(0.3)
        assert len(runs_of(client, "sca_flow")) == minute


# -- re-registration ---------------------------------------------------------------------------


def test_re_registering_a_changed_cron_or_input_recomputes_without_doubling(
    client: Client, cyclone_dsn: str, clock: Callable[[datetime], None]
) -> None:
    day = datetime(2027, 6, 4, tzinfo=UTC)
    clock(day + timedelta(hours=12, seconds=30))
    client.schedule(sca_echo, "0 * * * *", id="sca_rereg", location="UTC", input={"v": 1})
    clock(day + timedelta(hours=13, seconds=30))
    scan(cyclone_dsn)
    assert len(runs_of(client, "sca_echo")) == 1
    clock(day + timedelta(hours=13, seconds=40))  # the 13:00 slot has fired
    again = client.schedule(sca_echo, "*/15 * * * *", id="sca_rereg", location="UTC")
    assert again.next_run_at == day + timedelta(hours=13, minutes=15)
    scan(cyclone_dsn)
    assert len(runs_of(client, "sca_echo")) == 1
    clock(day + timedelta(hours=13, minutes=20))
    back = client.schedule(sca_echo, "0 * * * *", id="sca_rereg", location="UTC", input={"v": 1})
    assert back.next_run_at == day + timedelta(hours=14)
    scan(cyclone_dsn)
    assert len(runs_of(client, "sca_echo")) == 1  # 13:15 is not a slot any more
    clock(day + timedelta(hours=13, minutes=30))
    new_input = client.schedule(
        sca_echo, "0 * * * *", id="sca_rereg", location="UTC", input={"v": 2}
    )
    assert new_input.next_run_at == day + timedelta(hours=14)
    clock(day + timedelta(hours=14, seconds=30))
    scan(cyclone_dsn)
    scan(cyclone_dsn)
    runs = runs_of(client, "sca_echo")
    assert len(runs) == 2
    assert client.get_run(runs[0].id).input == {"v": 2}
    # a changed zone recomputes too, from now
    moved = client.schedule(sca_echo, "0 * * * *", id="sca_rereg", location="Asia/Kolkata")
    assert moved.next_run_at == day + timedelta(hours=14, minutes=30)


def _coded(x):  # type: ignore[no-untyped-def]
    return sca_echo(x)


def test_a_redeploy_of_the_same_schedule_keeps_a_due_slot_and_fires_it_once(
    cyclone_dsn: str, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    coded = schedule("*/5 * * * *", id="sca_coded", location="UTC", input="code")(
        WorkflowDef(_coded, "sca_coded_flow")
    )
    base = datetime(2027, 6, 5, 12, 0, 30, tzinfo=UTC)
    clock(base)
    with Client(cyclone_dsn, registry=deploy(coded)) as client:
        assert client.register_schedules() == ["sca_coded"]
        slot = the_schedule(client, "sca_coded").next_run_at
        assert slot == datetime(2027, 6, 5, 12, 5, tzinfo=UTC)
        clock(slot + timedelta(seconds=30))  # due, not fired yet: a deploy comes
        assert client.register_schedules() == ["sca_coded"]
        assert the_schedule(client, "sca_coded").next_run_at == slot
        start_worker(registry=deploy(coded), scan_interval=0.05)  # registers it once more
        assert wait_for(lambda: len(runs_of(client, "sca_coded_flow")) == 1)
        settle(0.5)
        assert len(runs_of(client, "sca_coded_flow")) == 1
        assert the_schedule(client, "sca_coded").next_run_at == slot + timedelta(minutes=5)
        assert client.get_run(runs_of(client, "sca_coded_flow")[0].id).input == "code"


# -- step vs workflow --------------------------------------------------------------------------


def test_a_step_schedule_fires_standalone_work_with_the_schedule_options(
    client: Client, cyclone_dsn: str, clock: Callable[[datetime], None]
) -> None:
    base = datetime(2027, 6, 6, 12, 0, 30, tzinfo=UTC)
    clock(base)
    client.schedule(
        sca_echo,
        "* * * * *",
        id="sca_step_s",
        location="UTC",
        input=[1, "two"],
        queue="sca_q",
        priority=7,
        max_attempts=2,
    )
    client.schedule(
        sca_flow, "* * * * *", id="sca_flow_s", location="UTC", input={"w": 1}, queue="sca_q"
    )
    clock(base + timedelta(minutes=1))
    scan(cyclone_dsn)
    (standalone,) = runs_of(client, "sca_echo")
    (flow,) = runs_of(client, "sca_flow")
    got = client.get_run(standalone.id)
    assert got.input == [1, "two"]
    assert [(s.kind, s.queue, s.priority, s.max_attempts) for s in got.steps] == [
        ("sca_echo", "sca_q", 7, 2)
    ]
    assert the_schedule(client, "sca_step_s").def_version is None  # a step is not pinned
    whole = client.get_run(flow.id)
    assert whole.def_version == sca_flow.def_version
    assert whole.input == {"w": 1}
    assert {s.queue for s in whole.steps} == {"sca_q"}


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"cron": "0 0 31 4 *"},  # April 31st: never
        {"cron": "0 0 30 2 *"},
        {"cron": "0 0 * * 8"},
        {"cron": "0 0 1 1 * 0 2020"},  # only past dates
        {"location": "Mars/Olympus"},
        {"location": ""},
        {"location": "Europe/Berlin "},
        {"location": "../etc/passwd"},
        {"input": {"x": float("nan")}},
        {"input": {"x": float("inf")}},
    ],
    ids=repr,
)
def test_a_bad_schedule_is_a_typed_error_and_leaves_the_existing_row_untouched(
    client: Client, clock: Callable[[datetime], None], options: dict[str, Any]
) -> None:
    clock(datetime(2027, 6, 7, 12, 0, 30, tzinfo=UTC))
    good = client.schedule(sca_echo, "0 3 * * *", id="sca_bad", location="UTC", input=1)
    given = {"cron": "* * * * *", "location": "UTC", "input": 1} | options
    cron = given.pop("cron")
    with pytest.raises(CycloneError) as raised:
        client.schedule(sca_echo, cron, id="sca_bad", **given)
    assert isinstance(raised.value, InvalidArgument)
    assert client.list_schedules() == [good]
    with pytest.raises(InvalidArgument):
        schedule(cron, **given)(_coded)


# -- delete, pause, overlap --------------------------------------------------------------------


def test_a_schedule_deleted_between_its_slot_and_the_scan_does_not_fire(
    client: Client, cyclone_dsn: str, clock: Callable[[datetime], None]
) -> None:
    base = datetime(2027, 6, 8, 12, 0, 30, tzinfo=UTC)
    clock(base)
    client.schedule(sca_echo, "*/5 * * * *", id="sca_gone", location="UTC")
    clock(base + timedelta(minutes=5))
    client.unschedule("sca_gone")
    scan(cyclone_dsn)
    assert runs_of(client, "sca_echo") == []
    assert client.list_schedules() == []


def test_a_schedule_disabled_between_its_slot_and_the_scan_fires_that_slot_once_when_enabled(
    client: Client, cyclone_dsn: str, clock: Callable[[datetime], None]
) -> None:
    base = datetime(2027, 6, 9, 12, 0, 30, tzinfo=UTC)
    clock(base)
    client.schedule(sca_echo, "*/5 * * * *", id="sca_paused", location="UTC")
    clock(base + timedelta(minutes=5))
    result = cyclone(cyclone_dsn, "schedules", "disable", "sca_paused")
    assert result.exit_code == 0, result.output
    scan(cyclone_dsn)
    assert runs_of(client, "sca_echo") == []
    assert the_schedule(client, "sca_paused").next_run_at == datetime(2027, 6, 9, 12, 5, tzinfo=UTC)
    clock(base + timedelta(minutes=7))
    result = cyclone(cyclone_dsn, "schedules", "enable", "sca_paused")
    assert result.exit_code == 0, result.output
    scan(cyclone_dsn)
    scan(cyclone_dsn)
    assert len(runs_of(client, "sca_echo")) == 1
    assert the_schedule(client, "sca_paused").next_run_at == datetime(
        2027, 6, 9, 12, 10, tzinfo=UTC
    )


def test_a_slot_fires_while_the_previous_run_is_still_running(
    client: Client, cyclone_dsn: str, clock: Callable[[datetime], None]
) -> None:
    """There is no overlap policy: each slot starts its run."""
    base = datetime(2027, 6, 10, 12, 0, 30, tzinfo=UTC)
    clock(base)
    client.schedule(sca_waiting, "* * * * *", id="sca_overlap", location="UTC")
    clock(base + timedelta(minutes=1))
    scan(cyclone_dsn)
    (first,) = runs_of(client, "sca_waiting")
    clock(base + timedelta(minutes=2))
    scan(cyclone_dsn)
    runs = runs_of(client, "sca_waiting")
    assert len(runs) == 2
    assert not client.get_run(first.id).is_terminal


# -- pinning -----------------------------------------------------------------------------------


def test_a_schedule_pins_its_definition_across_a_deploy(
    cyclone_dsn: str, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    assert PINNED_V1.def_version != PINNED_V2.def_version
    base = datetime(2027, 6, 11, 12, 0, 30, tzinfo=UTC)
    clock(base)
    with (
        Client(cyclone_dsn, registry=deploy(PINNED_V1)) as old,
        Client(cyclone_dsn, registry=deploy(PINNED_V2)) as new,
    ):
        made = old.schedule(PINNED_V1, "*/5 * * * *", id="sca_pin", location="UTC", input=3)
        assert made.def_version == PINNED_V1.def_version
        slot = made.next_run_at
        start_worker(registry=deploy(PINNED_V2), name="sca-v2", scan_interval=0.05)
        clock(slot + timedelta(seconds=30))
        assert wait_for(lambda: the_schedule(old, "sca_pin").last_error is not None)
        settle(0.3)
        refused = the_schedule(old, "sca_pin")
        assert runs_of(old, "sca_pinned") == []
        assert refused.next_run_at == slot
        assert refused.last_error is not None and "pins definition" in refused.last_error
        start_worker(registry=deploy(PINNED_V1), name="sca-v1", scan_interval=0.05)
        assert wait_for(lambda: len(runs_of(old, "sca_pinned")) == 1)
        (first,) = runs_of(old, "sca_pinned")
        assert old.get_run(first.id).def_version == PINNED_V1.def_version
        # the new deploy registers the schedule again: the pin moves
        repinned = new.schedule(PINNED_V2, "*/5 * * * *", id="sca_pin", location="UTC", input=3)
        assert repinned.def_version == PINNED_V2.def_version
        assert repinned.next_run_at == slot + timedelta(minutes=5)
        clock(slot + timedelta(minutes=5, seconds=30))
        assert wait_for(lambda: len(runs_of(old, "sca_pinned")) == 2)
        settle(0.5)
        runs = runs_of(old, "sca_pinned")
        assert len(runs) == 2
        assert old.get_run(runs[0].id).def_version == PINNED_V2.def_version


def test_a_worker_without_the_workflow_leaves_its_slot(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    base = datetime(2027, 6, 12, 12, 0, 30, tzinfo=UTC)
    clock(base)
    made = client.schedule(sca_flow, "*/5 * * * *", id="sca_elsewhere", location="UTC")
    start_worker(sca_noarg, scan_interval=0.05)  # another service's worker
    clock(made.next_run_at + timedelta(seconds=30))
    assert wait_for(lambda: the_schedule(client, "sca_elsewhere").last_error is not None)
    settle(0.3)
    assert runs_of(client, "sca_flow") == []
    assert the_schedule(client, "sca_elsewhere").next_run_at == made.next_run_at
    start_worker(sca_flow, scan_interval=0.05)
    assert wait_for(lambda: len(runs_of(client, "sca_flow")) == 1)


# -- the CLI -----------------------------------------------------------------------------------


def test_cli_schedules_add_list_disable_enable_rm(
    client: Client, cyclone_dsn: str, clock: Callable[[datetime], None]
) -> None:
    base = datetime(2027, 6, 13, 12, 0, 30, tzinfo=UTC)
    clock(base)
    target = f"{__name__}:sca_flow"
    added = cyclone(
        cyclone_dsn,
        "schedules",
        "add",
        target,
        "30 2 * * *",
        "--id",
        "sca_cli",
        "--location",
        "Europe/Berlin",
        "--input",
        '{"c": 1}',
        "--disabled",
        "--json",
    )
    assert added.exit_code == 0, added.output
    listed = cyclone(cyclone_dsn, "schedules", "--json")
    assert listed.exit_code == 0, listed.output
    (row,) = json.loads(listed.output)
    assert (row["id"], row["cron_spec"], row["location"], row["enabled"]) == (
        "sca_cli",
        "30 2 * * *",
        "Europe/Berlin",
        False,
    )
    clock(datetime(2027, 6, 14, 0, 31, tzinfo=UTC))  # 02:31 CEST: its slot passed, disabled
    scan(cyclone_dsn)
    assert runs_of(client, "sca_flow") == []
    assert cyclone(cyclone_dsn, "schedules", "enable", "sca_cli").exit_code == 0
    scan(cyclone_dsn)
    scan(cyclone_dsn)
    (run,) = runs_of(client, "sca_flow")
    assert client.get_run(run.id).input == {"c": 1}
    assert cyclone(cyclone_dsn, "schedules", "rm", "sca_cli").exit_code == 0
    assert client.list_schedules() == []
    bad = cyclone(cyclone_dsn, "schedules", "add", target, "0 0 31 4 *", "--id", "sca_cli2")
    assert bad.exit_code != 0
    assert isinstance(bad.exception, InvalidArgument)  # `cyclone` itself exits 2 on it
    assert client.list_schedules() == []


def test_an_unknown_catch_up_policy_is_refused(cyclone_dsn: str) -> None:
    for policy in ("ALL", "every", "", None):
        with pytest.raises(InvalidArgument):
            Worker(cyclone_dsn, [sca_flow], catch_up=policy)  # type: ignore[arg-type]


def test_enabling_again_through_client_schedule_fires_one_missed_slot_with_catch_up_all(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    base = datetime(2027, 6, 14, 12, 0, 30, tzinfo=UTC)
    clock(base)
    client.schedule(sca_flow, "*/10 * * * *", id="sca_reenable", location="UTC", enabled=False)
    start_worker(sca_flow, catch_up="all", scan_interval=0.05)
    clock(base + timedelta(minutes=65))  # six slots passed while it was disabled
    settle(0.3)
    assert runs_of(client, "sca_flow") == []
    again = client.schedule(sca_flow, "*/10 * * * *", id="sca_reenable", location="UTC")
    assert again.enabled
    assert wait_for(lambda: len(runs_of(client, "sca_flow")) >= 1)
    settle()
    assert len(runs_of(client, "sca_flow")) == 1
    assert the_schedule(client, "sca_reenable").next_run_at == datetime(
        2027, 6, 14, 13, 10, tzinfo=UTC
    )


# -- who fires: schedules a worker cannot fire ------------------------------------------------
# (moved from test_explore_deploys_schedules.py)


@step(name="sca_sched_echo")
def sca_sched_echo(x: object) -> object:
    return x


def _mine(x):  # type: ignore[no-untyped-def]
    return sca_sched_echo(x)


def _others(x):  # type: ignore[no-untyped-def]
    return sca_sched_echo(x)


MINE = WorkflowDef(_mine, "sca_mine")
OTHERS = WorkflowDef(_others, "sca_others")


@pytest.mark.parametrize("others", [10, 60])
def test_many_due_schedules_this_worker_cannot_fire_do_not_starve_the_one_it_can(
    others: int,
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    clock: Callable[[datetime], None],
) -> None:
    """schedules.md "Who fires": a worker leaves another application's (or deploy's) slot
    and fires its own. Here 10 or 60 due schedules of a workflow the worker does not have came
    due before the worker's own one (a scanner pass leases at most 50)."""
    base = datetime(2027, 7, 1, 12, 0, 30, tzinfo=UTC)
    clock(base)
    with (
        Client(cyclone_dsn, registry=deploy(OTHERS)) as other,
        Client(cyclone_dsn, registry=deploy(MINE)) as mine,
    ):
        for i in range(others):
            other.schedule(OTHERS, "* * * * *", id=f"sca-other-{i:02}", location="UTC")
        clock(base + timedelta(minutes=1))
        made = mine.schedule(MINE, "*/5 * * * *", id="sca-mine", location="UTC", input=7)
        assert made.next_run_at == datetime(2027, 7, 1, 12, 5, tzinfo=UTC)
        clock(base + timedelta(minutes=6))
        start_worker(registry=deploy(MINE), name="sca-mine-worker", scan_interval=0.1)
        assert wait_for(lambda: bool(runs_of(mine, "sca_mine")), timeout=20)
        # The others are left, each saying why, their slots kept.
        assert wait_for(
            lambda: all(
                s.last_error is not None and "refused here" in s.last_error
                for s in mine.list_schedules()
                if s.id.startswith("sca-other-")
            )
        )
        assert runs_of(mine, "sca_others") == []
        slot = datetime(2027, 7, 1, 12, 1, tzinfo=UTC)
        assert {s.next_run_at for s in mine.list_schedules() if s.id != "sca-mine"} == {slot}


# A step schedule across a deploy that changed the step's signature (same kind, same
# handler identity: a handler changed in place).


def _old_job() -> str:
    return "old"


def _new_job(x: int) -> str:
    return f"new {x}"


_new_job.__qualname__ = _old_job.__qualname__  # one identity: the same function, changed
OLD_JOB = step(name="sca_job")(_old_job)
# The new deploy's handler of the kind, not put in this process's default registry.
NEW_JOB = attrs.evolve(OLD_JOB, fn=_new_job)


def test_a_step_schedule_an_old_deploy_cannot_call_is_not_burnt_by_its_scanner(
    cyclone_dsn: str, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    """versioning.md: "No slot fires twice or with a definition nobody chose." A step
    schedule is not pinned; an old worker whose handler of the kind takes no argument
    cannot fire the new deploy's schedule with an input: it refuses it (saying why in
    last_error) and leaves the slot for a worker whose handler takes the input."""
    old_reg, new_reg = Registry(), Registry()
    old_reg.register(OLD_JOB)
    new_reg.register(NEW_JOB)
    base = datetime(2027, 7, 4, 12, 0, 30, tzinfo=UTC)
    clock(base)
    with Client(cyclone_dsn, registry=new_reg) as new:
        made = new.schedule(NEW_JOB, "*/5 * * * *", id="sca-job", location="UTC", input=4)
        clock(made.next_run_at + timedelta(seconds=30))
        start_worker(registry=old_reg, name="sca-old", scan_interval=0.05)
        assert wait_for(lambda: the_schedule(new, "sca-job").last_error is not None)
        settle(0.5)
        sched = the_schedule(new, "sca-job")
        # The slot is left for a process that can fire it, not spent on a failure.
        assert sched.next_run_at == made.next_run_at, (sched.last_error, sched.next_run_at)
        assert "refused here" in sched.last_error, sched.last_error
        assert sched.consecutive_failures == 0
        assert runs_of(new, "sca_job") == []
        start_worker(registry=new_reg, name="sca-new", scan_interval=0.05)
        assert wait_for(lambda: bool(runs_of(new, "sca_job")), timeout=10)
        settle(0.3)
        (run,) = runs_of(new, "sca_job")
        assert new.get_run(run.id).input == 4
        fired = the_schedule(new, "sca-job")
        assert fired.last_error is None
        assert fired.next_run_at == made.next_run_at + timedelta(minutes=5)
