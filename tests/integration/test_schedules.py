"""Cron schedules, retention, purge and stats through the public API."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import attrs
import psycopg
import pytest
from croniter import croniter

from cyclone_dsl import Client, Registry, child, schedule, step, workflow
from cyclone_dsl.db.connect import make_pool
from cyclone_dsl.dsl.runs import child_compiler, compiler_for
from cyclone_dsl.engine import Engine, schedules
from cyclone_dsl.errors import ScheduleError
from cyclone_dsl.states import RunState
from cyclone_dsl.testing import set_clock_shift
from cyclone_dsl.worker.scanner import Scanner


@step(name="sc_tick")
def tick(x: object) -> object:
    return x


@workflow(name="sc_nightly")
def nightly(x):  # type: ignore[no-untyped-def]
    return tick(x)


def scanner_for(dsn: str, registry: Registry, shift: timedelta, **options: object) -> Scanner:
    """A scanner of ``registry``'s schedules; this process's database clock moves by ``shift``
    (until the ``scanners`` fixture puts it back)."""
    set_clock_shift(shift)
    pool = make_pool(dsn, name="test-scanner")
    engine = Engine(compile_child=child_compiler(registry), compile_schedule=compiler_for(registry))
    return Scanner(
        pool,
        engine,
        interval=1,
        max_reclaims={},
        default_max_reclaims=3,
        stopping=threading.Event(),
        owner=f"scanner-{id(pool)}",
        **options,  # type: ignore[arg-type]
    )


@pytest.fixture
def scanners(cyclone_dsn: str) -> Iterator[list[Scanner]]:
    made: list[Scanner] = []
    yield made
    set_clock_shift(timedelta(0))
    for scanner in made:
        scanner.pool.close()


def fires(dsn: str) -> list[tuple[str, datetime, int]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT schedule_id, scheduled_for, run_id FROM cyclone_schedule_fires ORDER BY 2"
        ).fetchall()


def test_a_due_slot_fires_exactly_once_with_four_racing_scanners(
    client: Client, cyclone_dsn: str, scanners: list[Scanner]
) -> None:
    schedule = client.schedule(nightly, "*/5 * * * *", id="race", input={"n": 1}, location="UTC")
    assert schedule.def_version == nightly.def_version
    registry = Registry.from_objects([nightly])
    shift = schedule.next_run_at - datetime.now(UTC) + timedelta(seconds=1)
    scanners.extend(scanner_for(cyclone_dsn, registry, shift) for _ in range(4))
    barrier = threading.Barrier(4)
    counts: list[int] = []

    def race(scanner: Scanner) -> None:
        barrier.wait()
        counts.append(scanner.fire_schedules())

    threads = [threading.Thread(target=race, args=(s,)) for s in scanners]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(counts) == 1
    (fire,) = fires(cyclone_dsn)
    assert fire[1] == schedule.next_run_at
    after = next(s for s in client.list_schedules() if s.id == "race")
    assert after.next_run_at == schedule.next_run_at + timedelta(minutes=5)
    assert after.last_run_id == fire[2]
    assert client.get_run(fire[2]).input == {"n": 1}


def test_a_slot_recorded_before_a_crash_is_not_fired_again(
    client: Client, cyclone_dsn: str, scanners: list[Scanner]
) -> None:
    schedule = client.schedule(tick, "0 * * * *", id="crashy", location="UTC")
    earlier = client.enqueue(tick, "fired before the crash")
    with psycopg.connect(cyclone_dsn) as conn:  # the fire row committed, next_run_at did not
        conn.execute(
            "INSERT INTO cyclone_schedule_fires (schedule_id, scheduled_for, run_id) "
            "VALUES ('crashy', %s, %s)",
            (schedule.next_run_at, earlier.id),
        )
    shift = schedule.next_run_at - datetime.now(UTC) + timedelta(seconds=1)
    scanners.append(scanner_for(cyclone_dsn, Registry.from_objects([tick]), shift))
    assert scanners[0].fire_schedules() == 0
    assert len(fires(cyclone_dsn)) == 1
    assert [r.workflow for r in client.list_runs()] == ["sc_tick"]
    after = client.list_schedules()[0]
    assert after.next_run_at == schedule.next_run_at + timedelta(hours=1)


def test_a_changed_definition_is_refused_until_registered_again(
    client: Client, cyclone_dsn: str, scanners: list[Scanner]
) -> None:
    schedule = client.schedule(nightly, "* * * * *", id="pinned", location="UTC")

    @workflow(name="sc_nightly_v2")
    def changed(x):  # type: ignore[no-untyped-def]
        return tick(tick(x))

    registry = Registry()
    registry.workflows["sc_nightly"] = changed  # this process has another definition
    registry.register(tick)
    shift = schedule.next_run_at - datetime.now(UTC) + timedelta(seconds=1)
    scanners.append(scanner_for(cyclone_dsn, registry, shift))
    assert scanners[0].fire_schedules() == 0
    refused = client.list_schedules()[0]
    assert refused.last_error is not None and "pins definition" in refused.last_error
    assert refused.next_run_at == schedule.next_run_at  # the slot is left for another process
    assert client.list_runs() == []
    good = scanner_for(cyclone_dsn, Registry.from_objects([nightly]), shift)
    scanners.append(good)
    assert good.fire_schedules() == 1
    assert client.list_schedules()[0].last_error is None


def test_missed_slots_fire_the_latest_once(
    client: Client, cyclone_dsn: str, scanners: list[Scanner]
) -> None:
    schedule = client.schedule(tick, "* * * * *", id="every-minute", location="UTC")
    shift = schedule.next_run_at - datetime.now(UTC) + timedelta(minutes=30)
    latest = scanner_for(cyclone_dsn, Registry.from_objects([tick]), shift)
    scanners.append(latest)
    assert latest.fire_schedules() == 1
    assert latest.fire_schedules() == 0
    (fire,) = fires(cyclone_dsn)
    assert fire[1] >= schedule.next_run_at + timedelta(minutes=29)


def test_catch_up_all_fires_each_missed_slot(
    client: Client, cyclone_dsn: str, scanners: list[Scanner]
) -> None:
    schedule = client.schedule(tick, "* * * * *", id="each", location="UTC")
    shift = schedule.next_run_at - datetime.now(UTC) + timedelta(minutes=2, seconds=30)
    every = scanner_for(cyclone_dsn, Registry.from_objects([tick]), shift, catch_up="all")
    scanners.append(every)
    assert sum(every.fire_schedules() for _ in range(5)) == 3
    slots = [f[1] for f in fires(cyclone_dsn)]
    assert slots == [schedule.next_run_at + timedelta(minutes=i) for i in range(3)]


@pytest.mark.parametrize(
    ("cron", "start"),
    [
        ("30 2 * * *", datetime(2026, 3, 28, 12, tzinfo=UTC)),  # spring forward in Paris
        ("30 2 * * *", datetime(2026, 10, 24, 12, tzinfo=UTC)),  # fall back in Paris
        ("0 */6 * * 1-5", datetime(2026, 1, 1, tzinfo=UTC)),
    ],
)
def test_slots_follow_croniter_in_the_schedule_zone(cron: str, start: datetime) -> None:
    from zoneinfo import ZoneInfo

    paris = ZoneInfo("Europe/Paris")
    theirs = croniter(cron, start.astimezone(paris))
    expected: list[datetime] = []
    while len(expected) < 4:  # croniter's, but a wall time repeated in autumn fires once
        slot = theirs.get_next(datetime)
        if slot.astimezone(paris).replace(tzinfo=None) not in {
            e.astimezone(paris).replace(tzinfo=None) for e in expected
        }:
            expected.append(slot)
    ours = start
    for slot in expected:
        ours = schedules.next_slot(cron, "Europe/Paris", ours)
        assert ours == slot


def test_schedule_errors_and_unschedule(client: Client) -> None:
    with pytest.raises(ScheduleError):
        client.schedule(tick, "every day")
    with pytest.raises(ScheduleError):
        client.schedule(tick, "* * * * *", location="Atlantis/Capital")
    client.schedule("sc_tick", "* * * * *", id="by-name")
    client.enable_schedule("by-name", False)
    assert client.list_schedules()[0].enabled is False
    client.unschedule("by-name")
    assert client.list_schedules() == []
    with pytest.raises(ScheduleError):
        client.unschedule("by-name")


@workflow(name="sc_parent")
def parent(x):  # type: ignore[no-untyped-def]
    return child(nightly, x)


def test_purge_deletes_terminal_runs_keeps_live_parents_children_and_frees_keys(
    client: Client, cyclone_dsn: str, start_worker: object
) -> None:
    done = client.submit_once(nightly, 1, key="k")
    with psycopg.connect(cyclone_dsn) as conn:
        conn.execute("UPDATE cyclone_runs SET state = 'completed', finished_at = now()")
    live = client.submit(parent, 2)
    with psycopg.connect(cyclone_dsn) as conn:  # a finished child of a live parent
        conn.execute(
            "UPDATE cyclone_runs SET state = 'completed', finished_at = now() "
            "WHERE parent_run_id = %s",
            (live.id,),
        )
    assert client.purge() == 1
    remaining = {r.id for r in client.list_runs()}
    assert done.id not in remaining and live.id in remaining and len(remaining) == 2
    assert client.submit_once(nightly, 1, key="k").created
    with pytest.raises(ValueError, match="terminal"):
        client.purge(states=("running",))


def test_purge_works_in_batches(client: Client, cyclone_dsn: str) -> None:
    with psycopg.connect(cyclone_dsn) as conn:
        conn.execute(
            "INSERT INTO cyclone_runs (workflow, def_version, state, finished_at) "
            "SELECT 'bulk', 'v', 'completed', now() - interval '2 days' "
            "FROM generate_series(1, 5000)"
        )
    assert client.purge(older_than=timedelta(days=1), batch_size=700) == 5000
    assert client.list_runs() == []


def test_retention_scanner_respects_step_overrides(
    client: Client, cyclone_dsn: str, scanners: list[Scanner]
) -> None:
    short = client.enqueue(tick, 1, retention=timedelta(minutes=1))
    default = client.enqueue(tick, 2)
    with psycopg.connect(cyclone_dsn) as conn:
        conn.execute(
            "UPDATE cyclone_runs SET state = 'completed', finished_at = now() - interval '1 hour'"
        )
    scanner = scanner_for(
        cyclone_dsn, Registry.from_objects([tick]), timedelta(0), retention=timedelta(days=1)
    )
    scanners.append(scanner)
    assert scanner.expire_runs() == 1
    assert [r.id for r in client.list_runs()] == [default.id]
    assert short.id != default.id


def test_stats_read_the_views(client: Client) -> None:
    client.enqueue(tick, 1, queue="stats-q")
    stats = client.stats()
    (queue,) = [q for q in stats["queues"] if q["queue"] == "stats-q"]
    assert queue["available"] == 1
    assert queue["expired_leases"] == 0
    assert any(k["kind"] == "sc_tick" and k["state"] == "available" for k in stats["kinds"])
    assert RunState.RUNNING in {r.state for r in client.list_runs()}


@step(name="sc_routed", queue="sc_own_queue", priority=9, max_attempts=7)
def routed(x: object) -> object:
    return x


@workflow(name="sc_two_steps")
def two_steps(x):  # type: ignore[no-untyped-def]
    return tick(routed(x))


def test_a_workflow_schedule_applies_its_options_to_every_step_it_fires(
    client: Client, cyclone_dsn: str, scanners: list[Scanner]
) -> None:
    schedule = client.schedule(
        two_steps,
        "* * * * *",
        id="routed",
        location="UTC",
        queue="sc_night",
        priority=4,
        max_attempts=2,
        timeout=timedelta(seconds=30),
        retention=timedelta(days=2),
    )
    plain = client.schedule(two_steps, "* * * * *", id="plain", location="UTC")
    shift = max(schedule.next_run_at, plain.next_run_at) - datetime.now(UTC)
    registry = Registry.from_objects([two_steps])
    scanners.append(scanner_for(cyclone_dsn, registry, shift + timedelta(seconds=1)))
    assert scanners[0].fire_schedules() == 2
    by_schedule = {s.id: s.last_run_id for s in client.list_schedules()}
    fired = client.get_run(by_schedule["routed"]).steps
    assert {(s.queue, s.priority, s.max_attempts) for s in fired} == {("sc_night", 4, 2)}
    with psycopg.connect(cyclone_dsn) as conn:
        rows = conn.execute(
            "SELECT DISTINCT timeout, retention FROM cyclone_steps WHERE run_id = %s",
            (by_schedule["routed"],),
        ).fetchall()
    assert rows == [(timedelta(seconds=30), timedelta(days=2))]
    unchanged = {
        (s.node, s.queue, s.priority, s.max_attempts)
        for s in client.get_run(by_schedule["plain"]).steps
    }
    assert unchanged == {("sc_routed", "sc_own_queue", 9, 7), ("sc_tick", "default", 0, 5)}


NEVER = "0 0 30 2 *"  # February 30th: croniter accepts it, and no date matches it


def test_a_cron_that_never_fires_is_refused_and_nothing_is_written(client: Client) -> None:
    with pytest.raises(ScheduleError, match="never"):
        client.schedule(tick, NEVER, id="never")
    assert client.list_schedules() == []
    with pytest.raises(ScheduleError, match="never"):
        schedule(NEVER)(tick)


@pytest.mark.parametrize(("cron", "location"), [(NEVER, "UTC"), ("* * * * *", "Atlantis/Capital")])
def test_a_stored_schedule_that_cannot_fire_is_disabled_and_the_others_fire(
    client: Client, cyclone_dsn: str, scanners: list[Scanner], cron: str, location: str
) -> None:
    """A row this build would refuse (written by another implementation sharing the
    database, or by hand) is disabled with its reason; the due schedules after it fire."""
    good = client.schedule(tick, "* * * * *", id="z-good", location="UTC")
    with psycopg.connect(cyclone_dsn) as conn:
        conn.execute(
            "INSERT INTO cyclone_schedules (id, kind, cron_spec, location, next_run_at) "
            "VALUES ('a-bad', 'sc_tick', %s, %s, %s)",
            (cron, location, good.next_run_at - timedelta(minutes=5)),
        )
    shift = good.next_run_at - datetime.now(UTC) + timedelta(seconds=30)
    scanner = scanner_for(cyclone_dsn, Registry.from_objects([tick]), shift)
    scanners.append(scanner)
    assert scanner.fire_schedules() == 1
    assert [f[0] for f in fires(cyclone_dsn)] == ["z-good"]
    bad = next(s for s in client.list_schedules() if s.id == "a-bad")
    assert bad.enabled is False
    assert bad.last_error is not None and "disabled" in bad.last_error
    assert scanner.fire_schedules() == 0  # and it stays out of the way


def test_a_scan_pass_that_raises_does_not_keep_the_later_passes_from_running(
    client: Client, cyclone_dsn: str, scanners: list[Scanner], monkeypatch: pytest.MonkeyPatch
) -> None:
    good = client.schedule(tick, "* * * * *", id="after-the-timers", location="UTC")
    shift = good.next_run_at - datetime.now(UTC) + timedelta(seconds=30)
    scanner = scanner_for(cyclone_dsn, Registry.from_objects([tick]), shift)
    scanners.append(scanner)

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("the timers pass has a bug")

    monkeypatch.setattr(scanner.engine, "fire_timers", broken)
    with pytest.raises(RuntimeError, match="timers pass"):
        scanner.scan_once()
    assert [f[0] for f in fires(cyclone_dsn)] == ["after-the-timers"]  # a later pass ran


def test_rows_with_durations_past_timestamp_range_do_not_break_the_scanner(
    client: Client, cyclone_dsn: str, scanners: list[Scanner]
) -> None:
    """Rows this build refuses to write (another implementation or a hand may have):
    ``started_at + timeout`` and ``finished_at + retention`` overflowed, and the timeout
    and retention passes failed for every run."""
    running, ended = client.enqueue(tick, 1), client.enqueue(tick, 2)
    with psycopg.connect(cyclone_dsn) as conn:
        conn.execute(
            "UPDATE cyclone_steps SET state = 'running', started_at = now(), "
            "lease_owner = 'elsewhere', lease_expiry = now() + interval '1 hour', "
            "timeout = interval '100000000 years' WHERE run_id = %s",
            (running.id,),
        )
        conn.execute(
            "UPDATE cyclone_steps SET state = 'completed', completed_at = now(), "
            "retention = interval '100000000 years' WHERE run_id = %s",
            (ended.id,),
        )
        conn.execute(
            "UPDATE cyclone_runs SET state = 'completed', finished_at = now() WHERE id = %s",
            (ended.id,),
        )
    scanner = scanner_for(
        cyclone_dsn, Registry.from_objects([tick]), timedelta(0), retention=timedelta(days=1)
    )
    scanners.append(scanner)
    scanner.scan_once()  # raised DatetimeFieldOverflow
    assert client.get_run(running.id).state is RunState.RUNNING
    assert client.get_run(ended.id).state is RunState.COMPLETED


@pytest.mark.parametrize(
    "options",
    [{"timeout": float("inf")}, {"retention": 1e15}, {"timeout": -1}, {"location": 5}],
    ids=repr,
)
def test_bad_schedule_options_are_schedule_errors(
    client: Client, options: dict[str, object]
) -> None:
    """Each raised a raw OverflowError or TypeError."""
    with pytest.raises(ScheduleError):
        client.schedule(tick, "* * * * *", id="bad", **options)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError):
        schedule("* * * * *", **options)(tick)  # type: ignore[arg-type]
    assert client.list_schedules() == []


def row_versions(dsn: str) -> dict[str, str]:
    """Each schedule's xmin: it changes with every write of the row."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT id, xmin::text FROM cyclone_schedules").fetchall()
    return {str(row[0]): str(row[1]) for row in rows}


def test_schedules_a_scanner_cannot_fire_are_refused_once_then_left_unwritten(
    client: Client, cyclone_dsn: str, scanners: list[Scanner]
) -> None:
    """60 due schedules of a workflow this scanner was not given: its own one fires on the
    first pass (they do not starve it); each of the others is refused once, saying why, and
    then no pass of it or of another such scanner writes it again."""
    for i in range(60):
        client.schedule(nightly, "0 * * * *", id=f"other-{i:02}", location="UTC")
    mine = client.schedule(tick, "0 * * * *", id="mine", input=1, location="UTC")
    shift = mine.next_run_at - datetime.now(UTC) + timedelta(seconds=1)
    own = Registry.from_objects([tick])  # another service's worker: only the step
    scanners.extend(scanner_for(cyclone_dsn, own, shift) for _ in range(2))
    assert scanners[0].fire_schedules() == 1
    assert [r.workflow for r in client.list_runs()] == ["sc_tick"]
    for _ in range(3):  # at most 50 a pass: the others are all refused within two
        scanners[0].fire_schedules()
    others = [s for s in client.list_schedules() if s.id != "mine"]
    assert len(others) == 60
    for other in others:
        assert other.last_error is not None and other.last_error.startswith("refused here: ")
        assert "not given workflow 'sc_nightly'" in other.last_error
        assert other.next_run_at == mine.next_run_at and other.consecutive_failures == 0
    before = row_versions(cyclone_dsn)
    for scanner in scanners:
        for _ in range(3):
            assert scanner.fire_schedules() == 0
    assert row_versions(cyclone_dsn) == before  # no pass wrote any of them again
    assert [r.workflow for r in client.list_runs()] == ["sc_tick"]
    # A scanner given the workflow fires each left slot once, and clears the refusal.
    good = scanner_for(cyclone_dsn, Registry.from_objects([nightly]), shift)
    scanners.append(good)
    assert good.fire_schedules() + good.fire_schedules() == 60
    assert all(s.last_error is None for s in client.list_schedules())
    assert len(fires(cyclone_dsn)) == 61


def _job_before() -> str:
    return "before"


def _job_after(x: int) -> str:
    return f"after {x}"


_job_after.__qualname__ = _job_before.__qualname__  # the same handler, changed in place
JOB_BEFORE = step(name="sc_job")(_job_before)
JOB_AFTER = attrs.evolve(JOB_BEFORE, fn=_job_after)


def test_a_step_schedule_whose_input_this_handler_cannot_take_keeps_its_slot_visibly(
    cyclone_dsn: str, scanners: list[Scanner]
) -> None:
    """A step schedule registered by a deploy whose handler takes an input, scanned by
    processes whose handler of the kind takes none: refused, its slot kept (no process
    burns it), the refusal in last_error; each such process writes it once, not on every
    pass; a process whose handler takes the input fires the slot."""
    after = Registry()
    after.register(JOB_AFTER)
    with Client(cyclone_dsn, registry=after) as client:
        made = client.schedule(JOB_AFTER, "0 * * * *", id="job", input=4, location="UTC")
        shift = made.next_run_at - datetime.now(UTC) + timedelta(seconds=1)
        before = Registry.from_objects([JOB_BEFORE])
        scanners.extend(scanner_for(cyclone_dsn, before, shift) for _ in range(2))
        assert scanners[0].fire_schedules() == 0
        (refused,) = client.list_schedules()
        assert refused.last_error is not None and refused.last_error.startswith("refused here: ")
        assert "cannot take the schedule's input" in refused.last_error
        assert refused.next_run_at == made.next_run_at and refused.consecutive_failures == 0
        versions = row_versions(cyclone_dsn)
        for _ in range(3):
            assert scanners[0].fire_schedules() == 0
        assert row_versions(cyclone_dsn) == versions
        # Another process of that deploy finds out for itself, once.
        assert scanners[1].fire_schedules() == 0
        versions = row_versions(cyclone_dsn)
        for scanner in scanners:
            for _ in range(3):
                assert scanner.fire_schedules() == 0
        assert row_versions(cyclone_dsn) == versions
        assert client.list_runs() == []
        assert client.list_schedules()[0].next_run_at == made.next_run_at
        good = scanner_for(cyclone_dsn, after, shift)
        scanners.append(good)
        assert good.fire_schedules() == 1
        (fired,) = client.list_schedules()
        assert fired.last_error is None
        assert fired.next_run_at == made.next_run_at + timedelta(hours=1)
        (fire,) = fires(cyclone_dsn)
        assert client.get_run(fire[2]).input == 4
