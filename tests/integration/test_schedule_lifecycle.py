"""Cron schedules through the public API: firing once per tick, catch-up, DST,
update/enable/disable/delete, redeploys, bad input, and the later life of fired runs.

Ticks are driven with :func:`cyclone_dsl.testing.set_clock_shift` (the database clock of
this process) and real background workers; nothing waits for a real minute.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from cyclone_dsl import Client, Registry, Worker, schedule, step, workflow
from cyclone_dsl.cli.main import run as cli_run
from cyclone_dsl.errors import CycloneError, InvalidArgument, ScheduleError
from cyclone_dsl.states import RunState
from cyclone_dsl.testing.failpoints import arm, disarm


@step(name="audit_sc_echo")
def audit_echo(x: object) -> object:
    return x


@workflow(name="audit_sc_flow")
def audit_flow(x):  # type: ignore[no-untyped-def]
    return audit_echo(x)


@step(name="audit_sc_sleepy")
def audit_sleepy(x: object) -> object:
    time.sleep(30)
    return x


@workflow(name="audit_sc_slow_flow")
def audit_slow_flow(x):  # type: ignore[no-untyped-def]
    return audit_sleepy(x)


@schedule("0 3 * * *", id="audit_sc_deployed", location="UTC", input={"from": "code"})
@workflow(name="audit_sc_deployed_flow")
def audit_deployed(x):  # type: ignore[no-untyped-def]
    return audit_echo(x)


# -- helpers ---------------------------------------------------------------------------


def runs_of(client: Client, workflow_name: str) -> list[Any]:
    return client.list_runs(workflow=workflow_name, limit=500)


def wait_until(predicate: Callable[[], bool], timeout: float = 6.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def the_schedule(client: Client, schedule_id: str) -> Any:
    return next(s for s in client.list_schedules() if s.id == schedule_id)


# -- DST ---------------------------------------------------------------------------------

# Europe/Paris 2027: spring forward on 2027-03-28 (02:00 CET -> 03:00 CEST, 01:00 UTC),
# fall back on 2027-10-31 (03:00 CEST -> 02:00 CET, 01:00 UTC).


def test_a_daily_slot_in_the_repeated_autumn_hour_fires_once(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    """docs/concepts/schedules.md: "a time repeated in autumn fires once"."""
    clock(datetime(2027, 10, 30, 12, tzinfo=UTC))
    created = client.schedule(
        audit_flow, "30 2 * * *", id="audit_sc_autumn", location="Europe/Paris", input=1
    )
    assert created.next_run_at == datetime(2027, 10, 31, 0, 30, tzinfo=UTC)  # 02:30 CEST
    start_worker(audit_flow)
    clock(datetime(2027, 10, 31, 0, 31, tzinfo=UTC))
    assert wait_until(lambda: len(runs_of(client, "audit_sc_flow")) == 1)
    clock(datetime(2027, 10, 31, 1, 31, tzinfo=UTC))  # 02:31 CET: the same wall time again
    time.sleep(1.5)
    assert len(runs_of(client, "audit_sc_flow")) == 1, "02:30 fired twice on the DST day"
    assert the_schedule(client, "audit_sc_autumn").next_run_at == datetime(
        2027, 11, 1, 1, 30, tzinfo=UTC
    )


def test_a_daily_slot_skipped_in_spring_fires_once_at_the_first_valid_instant(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    clock(datetime(2027, 3, 27, 12, tzinfo=UTC))
    created = client.schedule(
        audit_flow, "30 2 * * *", id="audit_sc_spring", location="Europe/Paris"
    )
    assert created.next_run_at == datetime(2027, 3, 28, 1, 0, tzinfo=UTC)  # 03:00 CEST
    start_worker(audit_flow)
    clock(datetime(2027, 3, 28, 1, 1, tzinfo=UTC))
    assert wait_until(lambda: len(runs_of(client, "audit_sc_flow")) == 1)
    clock(datetime(2027, 3, 28, 12, tzinfo=UTC))
    time.sleep(1.0)
    assert len(runs_of(client, "audit_sc_flow")) == 1
    assert the_schedule(client, "audit_sc_spring").next_run_at == datetime(
        2027, 3, 29, 0, 30, tzinfo=UTC
    )


# -- exactly once, catch-up --------------------------------------------------------------


def test_two_workers_with_both_catch_up_policies_fire_each_tick_once(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    base = datetime(2027, 6, 1, 12, 0, 30, tzinfo=UTC)
    clock(base)
    client.schedule(audit_flow, "* * * * *", id="audit_sc_two", location="UTC", input={"k": 1})
    start_worker(audit_flow, catch_up="all")
    start_worker(audit_flow, catch_up="latest")
    for minute in range(1, 4):
        clock(base + timedelta(minutes=minute))
        assert wait_until(lambda n=minute: len(runs_of(client, "audit_sc_flow")) >= n)
        time.sleep(0.5)  # both scanners have passed at least twice over this tick
        assert len(runs_of(client, "audit_sc_flow")) == minute
    runs = runs_of(client, "audit_sc_flow")
    assert all(client.get_run(r.id).input == {"k": 1} for r in runs)


def test_downtime_with_catch_up_all_fires_each_missed_slot_once_then_stops(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    base = datetime(2027, 6, 2, 12, 0, 30, tzinfo=UTC)
    clock(base)
    client.schedule(audit_flow, "* * * * *", id="audit_sc_downtime", location="UTC")
    clock(base + timedelta(minutes=4))  # slots 12:01, 12:02, 12:03, 12:04 were missed
    start_worker(audit_flow, catch_up="all")
    start_worker(audit_flow, catch_up="all")
    assert wait_until(lambda: len(runs_of(client, "audit_sc_flow")) >= 4)
    time.sleep(1.0)
    assert len(runs_of(client, "audit_sc_flow")) == 4
    assert the_schedule(client, "audit_sc_downtime").next_run_at == datetime(
        2027, 6, 2, 12, 5, tzinfo=UTC
    )


# -- update / enable / disable / delete --------------------------------------------------


def test_a_cron_update_during_a_fire_is_not_overwritten_by_the_old_cron(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    """An operator changes the cron while a scanner fires the schedule. The scanner's
    ``schedule_fired`` then writes the next slot of the OLD cron over the new one."""
    base = datetime(2027, 6, 3, 12, 0, 30, tzinfo=UTC)
    clock(base)
    client.schedule(audit_flow, "* * * * *", id="audit_sc_race", location="UTC")
    updated: list[Any] = []

    def update_now() -> None:
        if updated:
            return
        updated.append(None)
        worker_thread = threading.Thread(
            target=lambda: updated.append(
                client.schedule(audit_flow, "0 0 1 1 *", id="audit_sc_race", location="UTC")
            )
        )
        worker_thread.start()  # it waits for the fire to commit (its row is locked)
        worker_thread.join(0.5)

    arm("schedule.after_fire_record", update_now)
    try:
        clock(base + timedelta(minutes=1))
        start_worker(audit_flow)
        assert wait_until(lambda: len(runs_of(client, "audit_sc_flow")) == 1)
        assert wait_until(lambda: len(updated) == 2), "the update did not complete"
    finally:
        disarm("schedule.after_fire_record")
    after = the_schedule(client, "audit_sc_race")
    assert after.cron_spec == "0 0 1 1 *"
    assert after.next_run_at == datetime(2028, 1, 1, tzinfo=UTC), (
        f"next_run_at {after.next_run_at} is a slot of the old cron"
    )
    clock(base + timedelta(minutes=2))
    time.sleep(1.0)
    assert len(runs_of(client, "audit_sc_flow")) == 1, "fired at a time its cron does not match"


def test_enabling_after_a_disabled_stretch_does_not_replay_every_slot_missed_while_disabled(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    """cli `schedules disable`: "enable fires at most the latest slot it missed" - one slot,
    not every slot of the disabled stretch (with catch_up="all" a month off would start
    ~43,000 runs of a per-minute schedule at once)."""
    base = datetime(2027, 6, 4, 12, 0, 30, tzinfo=UTC)
    clock(base)
    client.schedule(audit_flow, "* * * * *", id="audit_sc_paused", location="UTC")
    client.enable_schedule("audit_sc_paused", False)
    start_worker(audit_flow, catch_up="all")
    clock(base + timedelta(minutes=10))
    time.sleep(0.5)
    assert runs_of(client, "audit_sc_flow") == []  # disabled: nothing fires
    client.enable_schedule("audit_sc_paused", True)
    wait_until(lambda: len(runs_of(client, "audit_sc_flow")) >= 10, timeout=4)
    fired = len(runs_of(client, "audit_sc_flow"))
    assert fired <= 1, f"enabling replayed {fired} slots of the disabled stretch"


def test_a_redeploy_does_not_re_enable_a_schedule_an_operator_disabled(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """`cyclone schedules disable` during an incident; the next worker start (a deploy of the
    same code) silently turns the schedule back on (upsert sets enabled = EXCLUDED.enabled)."""
    with Client(cyclone_dsn, registry=Registry.from_objects([audit_deployed])) as deploy:
        assert deploy.register_schedules() == ["audit_sc_deployed"]
    client.enable_schedule("audit_sc_deployed", False)
    start_worker(audit_deployed)  # the redeploy: same code, same @schedule
    assert the_schedule(client, "audit_sc_deployed").enabled is False


def test_a_redeploy_with_new_input_keeps_the_slot_and_fires_the_new_input(
    client: Client,
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    clock: Callable[[datetime], None],
) -> None:
    base = datetime(2027, 6, 5, 12, 0, 30, tzinfo=UTC)
    clock(base)
    first = client.schedule(
        audit_flow, "*/5 * * * *", id="audit_sc_redeploy", location="UTC", input={"v": 1}
    )
    clock(base + timedelta(minutes=1))
    second = client.schedule(
        audit_flow,
        "*/5 * * * *",
        id="audit_sc_redeploy",
        location="UTC",
        input={"v": 2},
        queue="audit_sc_q",
    )
    assert second.next_run_at == first.next_run_at == datetime(2027, 6, 5, 12, 5, tzinfo=UTC)
    start_worker(audit_flow, queues=["audit_sc_q"])
    clock(base + timedelta(minutes=5))
    assert wait_until(lambda: len(runs_of(client, "audit_sc_flow")) == 1)
    (run,) = runs_of(client, "audit_sc_flow")
    got = client.get_run(run.id)
    assert got.input == {"v": 2}
    assert {s.queue for s in got.steps} == {"audit_sc_q"}
    # a changed cron recomputes the slot from now
    third = client.schedule(audit_flow, "0 * * * *", id="audit_sc_redeploy", location="UTC")
    assert third.next_run_at == datetime(2027, 6, 5, 13, tzinfo=UTC)
    # a changed zone recomputes too
    fourth = client.schedule(
        audit_flow, "0 * * * *", id="audit_sc_redeploy", location="Asia/Kolkata"
    )
    assert fourth.next_run_at == datetime(2027, 6, 5, 12, 30, tzinfo=UTC)


def test_unschedule_stops_firing_and_keeps_the_runs_it_fired(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    base = datetime(2027, 6, 6, 12, 0, 30, tzinfo=UTC)
    clock(base)
    client.schedule(audit_flow, "* * * * *", id="audit_sc_gone", location="UTC")
    start_worker(audit_flow)
    clock(base + timedelta(minutes=1))
    assert wait_until(lambda: len(runs_of(client, "audit_sc_flow")) == 1)
    client.unschedule("audit_sc_gone")
    clock(base + timedelta(minutes=3))
    time.sleep(1.0)
    assert len(runs_of(client, "audit_sc_flow")) == 1
    assert client.list_schedules() == []
    # a schedule created again with the same id starts from now, not from the old slots
    again = client.schedule(audit_flow, "* * * * *", id="audit_sc_gone", location="UTC")
    assert again.next_run_at == datetime(2027, 6, 6, 12, 4, tzinfo=UTC)


def test_a_schedule_created_disabled_never_fires_until_enabled(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    base = datetime(2027, 6, 7, 12, 0, 30, tzinfo=UTC)
    clock(base)
    made = client.schedule(
        audit_flow, "* * * * *", id="audit_sc_off", location="UTC", enabled=False
    )
    assert made.enabled is False
    start_worker(audit_flow)
    clock(base + timedelta(minutes=1))
    time.sleep(1.0)
    assert runs_of(client, "audit_sc_flow") == []
    client.enable_schedule("audit_sc_off")
    assert wait_until(lambda: len(runs_of(client, "audit_sc_flow")) == 1)


# -- later life of fired runs --------------------------------------------------------------


def test_a_cancelled_or_purged_fired_run_does_not_stop_the_next_ticks(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    base = datetime(2027, 6, 8, 12, 0, 30, tzinfo=UTC)
    clock(base)
    client.schedule(audit_slow_flow, "* * * * *", id="audit_sc_cancel", location="UTC")
    start_worker(audit_slow_flow, grace=0.5)
    clock(base + timedelta(minutes=1))
    assert wait_until(lambda: len(runs_of(client, "audit_sc_slow_flow")) == 1)
    (first,) = runs_of(client, "audit_sc_slow_flow")
    assert the_schedule(client, "audit_sc_cancel").last_run_id == first.id
    client.cancel(first.id)
    assert client.get_run(first.id).state is RunState.CANCELLED
    clock(base + timedelta(minutes=2))
    assert wait_until(lambda: len(runs_of(client, "audit_sc_slow_flow")) == 2)
    newest = runs_of(client, "audit_sc_slow_flow")[0]
    assert the_schedule(client, "audit_sc_cancel").last_run_id == newest.id
    client.cancel(newest.id)
    assert client.purge(older_than=timedelta(0)) == 2
    after = the_schedule(client, "audit_sc_cancel")
    assert after.last_run_id is None  # ON DELETE SET NULL
    clock(base + timedelta(minutes=3))
    assert wait_until(lambda: len(runs_of(client, "audit_sc_slow_flow")) == 1)
    for run in runs_of(client, "audit_sc_slow_flow"):
        client.cancel(run.id)


def test_a_schedule_retention_expires_its_fired_runs_and_the_schedule_keeps_firing(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    base = datetime(2027, 6, 10, 12, 0, 30, tzinfo=UTC)
    clock(base)
    client.schedule(
        audit_flow,
        "*/10 * * * *",
        id="audit_sc_kept",
        location="UTC",
        retention=timedelta(minutes=2),
    )
    start_worker(audit_flow, retention=timedelta(days=7))
    clock(base + timedelta(minutes=10))
    assert wait_until(
        lambda: [r.state for r in runs_of(client, "audit_sc_flow")] == [RunState.COMPLETED]
    )
    (first,) = runs_of(client, "audit_sc_flow")
    clock(base + timedelta(minutes=15))  # past the run's 2-minute retention, before 12:20
    assert wait_until(lambda: runs_of(client, "audit_sc_flow") == [])
    kept = the_schedule(client, "audit_sc_kept")
    assert kept.last_run_id is None and kept.enabled and kept.last_error is None
    assert kept.next_run_at == datetime(2027, 6, 10, 12, 20, tzinfo=UTC)
    clock(base + timedelta(minutes=20))
    assert wait_until(lambda: len(runs_of(client, "audit_sc_flow")) == 1)
    assert runs_of(client, "audit_sc_flow")[0].id != first.id


def test_schedule_input_reaches_the_fired_run_unchanged(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    value = {
        "text": "été ✓ 日本",
        "big": 2**62,
        "neg": -17,
        "float": 0.1,
        "list": [None, True, False, [], {}],
        "nested": {"z": 1, "a": [1.5, "x"]},
    }
    base = datetime(2027, 6, 9, 12, 0, 30, tzinfo=UTC)
    clock(base)
    client.schedule(audit_echo, "* * * * *", id="audit_sc_input", location="UTC", input=value)
    assert the_schedule(client, "audit_sc_input").input == value
    start_worker(audit_echo)
    clock(base + timedelta(minutes=1))
    assert wait_until(lambda: the_schedule(client, "audit_sc_input").last_run_id is not None)
    run_id = the_schedule(client, "audit_sc_input").last_run_id
    assert client.result(run_id, timeout=5) == value


# -- bad input -----------------------------------------------------------------------------


def _throwaway(x: object) -> object:
    """What the decorator tests decorate: a spec the decorator accepts sticks to its target,
    so it must not be a definition other tests register."""
    return x


@pytest.mark.parametrize(
    "cron",
    ["", "* * * *", "61 * * * *", "@reboot", "every minute", "* * * * * * * *", None, 5, ["*"]],
    ids=repr,
)
def test_bad_crons_are_schedule_errors_and_write_nothing(client: Client, cron: object) -> None:
    with pytest.raises(ScheduleError):
        client.schedule(audit_flow, cron, id="audit_sc_badcron")  # type: ignore[arg-type]
    with pytest.raises(ScheduleError):
        schedule(cron)(_throwaway)  # type: ignore[arg-type]
    assert client.list_schedules() == []


def test_a_cron_whose_only_dates_are_past_is_refused_by_the_decorator_too(
    client: Client,
) -> None:
    """croniter's 7th field is a year: ``0 0 1 1 * 0 2020`` has no date left. The client
    refuses it; ``@schedule`` checks from a fixed instant in 2000, so it accepts it and the
    worker then fails to start."""
    past = "0 0 1 1 * 0 2020"
    with pytest.raises(ScheduleError):
        client.schedule(audit_flow, past, id="audit_sc_past")
    assert client.list_schedules() == []
    with pytest.raises(ScheduleError):
        schedule(past)(_throwaway)  # not a shared definition: an accepted spec sticks to it


@pytest.mark.parametrize(
    "options",
    [
        {"queue": ""},
        {"queue": 5},
        {"priority": "high"},
        {"priority": 2**40},
        {"max_attempts": 0},
        {"max_attempts": True},
        {"id": ""},
        {"id": 7},
        {"input": {"x": float("nan")}},
        {"input": {1: "non-text key"}},
        {"input": object()},
        {"enabled": "no"},
    ],
    ids=lambda o: "-".join(f"{k}={type(v).__name__}" for k, v in o.items()),  # no addresses
)
@pytest.mark.parametrize("target", ["workflow", "step"])
def test_bad_schedule_options_are_typed_errors_and_write_nothing(
    client: Client, options: dict[str, object], target: str
) -> None:
    obj = audit_flow if target == "workflow" else audit_echo
    with pytest.raises(InvalidArgument):
        client.schedule(obj, "* * * * *", **options)  # type: ignore[arg-type]
    assert client.list_schedules() == []


@pytest.mark.parametrize(
    "options",
    [{"queue": ""}, {"priority": "high"}, {"max_attempts": 0}, {"max_attempts": True}],
    ids=repr,
)
def test_bad_options_are_refused_when_schedule_decorates_like_a_bad_timeout_is(
    options: dict[str, object],
) -> None:
    """``@schedule(timeout=-1)`` raises at decoration; ``@schedule(max_attempts=0)`` is
    accepted and only the worker's start (or register_schedules) refuses it."""
    with pytest.raises(InvalidArgument):
        schedule("* * * * *", **options)(_throwaway)  # type: ignore[arg-type]


@pytest.mark.parametrize("schedule_id", [5, None, 1.5, b"audit_sc_bytes"], ids=repr)
def test_unschedule_and_enable_with_a_non_text_id_are_typed_errors(
    client: Client, schedule_id: object
) -> None:
    client.schedule(audit_flow, "* * * * *", id="audit_sc_keep", location="UTC")
    for call in (
        lambda: client.unschedule(schedule_id),  # type: ignore[arg-type]
        lambda: client.enable_schedule(schedule_id, False),  # type: ignore[arg-type]
    ):
        with pytest.raises(CycloneError):
            call()
    assert [s.id for s in client.list_schedules()] == ["audit_sc_keep"]


def test_the_location_list_schedules_reports_can_be_given_back(client: Client) -> None:
    """The default zone is stored and listed as ``Local``; copying a listed schedule
    (``location=s.location``) must not be refused."""
    made = client.schedule(audit_flow, "0 3 * * *", id="audit_sc_local")
    assert made.location == "Local"
    again = client.schedule(audit_flow, "0 3 * * *", id="audit_sc_local", location=made.location)
    assert again.location == "Local"
    assert again.next_run_at == made.next_run_at


def test_two_schedules_without_ids_on_one_workflow_are_not_silently_merged(
    cyclone_dsn: str,
) -> None:
    """Both default to the workflow's name as id: the second upsert overwrites the first
    and the 03:00 schedule is lost without a word."""

    @schedule("0 3 * * *", location="UTC")
    @schedule("0 15 * * *", location="UTC")
    @workflow(name="audit_sc_twice")
    def twice(x):  # type: ignore[no-untyped-def]
        return audit_echo(x)

    with Client(cyclone_dsn, registry=Registry.from_objects([twice])) as client:
        try:
            client.register_schedules()
        except ScheduleError:
            assert client.list_schedules() == []  # refused whole: acceptable
            return
        crons = sorted(s.cron_spec for s in client.list_schedules())
        assert crons == ["0 15 * * *", "0 3 * * *"], f"only {crons} registered"


def test_a_registration_that_fails_half_way_writes_nothing(cyclone_dsn: str) -> None:
    """register_schedules registers every @schedule in one transaction: a refused one
    leaves none of the others behind."""

    @schedule("0 4 * * *", id="audit_sc_half_good", location="UTC")
    @workflow(name="audit_sc_half_good_flow")
    def good(x):  # type: ignore[no-untyped-def]
        return audit_echo(x)

    try:

        @schedule("0 0 1 1 * 0 2020", id="audit_sc_half_bad", location="UTC")
        @workflow(name="audit_sc_half_bad_flow")
        def bad(x):  # type: ignore[no-untyped-def]
            return audit_echo(x)

    except ScheduleError:
        return  # the decorator refused it already: nothing can be half-written

    with Client(cyclone_dsn, registry=Registry.from_objects([good, bad])) as client:
        with pytest.raises(ScheduleError):
            client.register_schedules()
        assert client.list_schedules() == []


# -- the CLI ---------------------------------------------------------------------------------


def cyclone(args: list[str]) -> int:
    """The ``cyclone`` entry point's exit code (``main`` is ``sys.exit(run(args))``; a usage
    error found inside a command exits at once)."""
    try:
        return cli_run(args)
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.mark.parametrize(
    "args",
    [
        ["not a cron"],
        ["0 0 30 2 *"],
        ["* * * * *", "--location", "Atlantis/Capital"],
        ["* * * * *", "--priority", "99999999999"],
        ["* * * * *", "--max-attempts", "0"],
        ["* * * * *", "--queue", ""],
        ["* * * * *", "--id", ""],
        ["* * * * *", "--timeout", "0s"],
        ["* * * * *", "--input", "{not json"],
        ["* * * * *", "--input", '{"x": NaN}'],
    ],
    ids=repr,
)
def test_cli_schedules_add_refuses_bad_input_with_exit_2_and_writes_nothing(
    client: Client, cyclone_dsn: str, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    target = f"{__name__}:audit_flow"
    code = cyclone(["--dsn", cyclone_dsn, "schedules", "add", target, *args])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("cyclone: ") and err.count("\n") == 1, err
    assert client.list_schedules() == []


def test_cli_enable_disable_rm_of_an_unknown_schedule_exit_2(
    client: Client, cyclone_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for command in ("enable", "disable", "rm"):
        assert cyclone(["--dsn", cyclone_dsn, "schedules", command, "audit_sc_nope"]) == 2
        err = capsys.readouterr().err
        assert "audit_sc_nope" in err and err.count("\n") == 1, err
