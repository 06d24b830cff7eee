"""Audit: two deploys at once, schedules, idempotent submits and unique keys, through the
public API.

Each deploy is a Registry of its own (as in test_deploys_audit.py). Every name is
prefixed xds_.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import attrs

from cyclone_dsl import (
    Client,
    Debounce,
    RunState,
    StepState,
    Worker,
    step,
)
from cyclone_dsl.dsl.workflow import WorkflowDef
from tests.integration.test_deploys_audit import deploy
from tests.waiting import wait_until


def runs_of(c: Client, name: str) -> list[Any]:
    return c.list_runs(workflow=name, limit=500)


def the_schedule(c: Client, schedule_id: str) -> Any:
    return next(s for s in c.list_schedules() if s.id == schedule_id)


def far_future() -> datetime:
    return datetime.now(UTC) + timedelta(days=365)


# -- definitions ---------------------------------------------------------------------------

CALLS: dict[str, list[Any]] = {"old": [], "new": []}


@step(name="xds_a")
def xds_a(x: int) -> int:
    return x + 1


@step(name="xds_b_old")
def xds_b_old(x: int) -> int:
    CALLS["old"].append(x)
    return x * 10


@step(name="xds_b_new")
def xds_b_new(x: int) -> int:
    CALLS["new"].append(x)
    return x * 100


FLAKY: dict[int, int] = {}


@step(name="xds_flaky_old", max_attempts=3)
def xds_flaky_old(x: int) -> int:
    FLAKY[x] = FLAKY.get(x, 0) + 1
    if FLAKY[x] == 1:
        raise RuntimeError("first attempt fails")
    return x


def _v1(x):  # type: ignore[no-untyped-def]
    return xds_b_old(xds_a(x))


def _v2(x):  # type: ignore[no-untyped-def]
    return xds_b_new(xds_a(x))


def _flaky_v1(x):  # type: ignore[no-untyped-def]
    return xds_flaky_old(x)


def _flaky_v2(x):  # type: ignore[no-untyped-def]
    return xds_b_new(x)


V1, V2 = WorkflowDef(_v1, "xds_wf"), WorkflowDef(_v2, "xds_wf")
FLAKY_V1, FLAKY_V2 = WorkflowDef(_flaky_v1, "xds_flaky"), WorkflowDef(_flaky_v2, "xds_flaky")


def test_definitions_differ() -> None:
    assert V1.def_version != V2.def_version
    assert FLAKY_V1.def_version != FLAKY_V2.def_version


# -- unique keys and replays ---------------------------------------------------------------


def test_a_unique_key_holder_in_retry_backoff_keeps_the_key(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    attempts: list[int] = []

    @step(name="xds_unique_flaky", max_attempts=2)
    def flaky(x: int) -> int:
        attempts.append(x)
        if len(attempts) == 1:
            raise RuntimeError("once")
        return x

    start_worker(flaky)
    first = client.enqueue(flaky, 1, unique_key="xds-b")
    wait_until(lambda: attempts, what="the first attempt")
    wait_until(
        lambda: client.get_run(first.id).steps[0].state == StepState.AVAILABLE,
        what="the backoff",
    )
    again = client.enqueue(flaky, 2, unique_key="xds-b")
    assert (again.id, again.created) == (first.id, False)
    assert first.result(timeout=20) == 1
    assert attempts == [1, 1]


# -- two deploys: claims -------------------------------------------------------------------


def test_an_old_runs_retry_is_never_taken_by_a_new_worker(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    old_registry, new_registry = deploy(FLAKY_V1), deploy(FLAKY_V2)
    FLAKY.clear()
    with (
        Client(cyclone_dsn, registry=old_registry) as old_client,
        Client(cyclone_dsn, registry=new_registry) as new_client,
    ):
        olds = [old_client.submit("xds_flaky", i) for i in range(5)]
        news = [new_client.submit("xds_flaky", i) for i in range(5)]
        old_worker = start_worker(registry=old_registry, name="xds-old")
        start_worker(registry=new_registry, name="xds-new")
        # Each old run fails its first attempt on the old worker; stop the old worker
        # while some are in backoff.
        wait_until(lambda: len(FLAKY) == 5, what="every old run's first attempt")
        old_worker.stop()
        assert [h.result(timeout=20) for h in news] == [i * 100 for i in range(5)]
        time.sleep(3.0)  # the backoffs (1-2 s) come due while only the new worker is live
        for h in olds:
            run = h.get()
            if run.state is RunState.RUNNING:
                st = run.step("xds_flaky_old")
                assert st.state == StepState.AVAILABLE, (h.id, st.state)
        start_worker(registry=old_registry, name="xds-old-2")
        assert [h.result(timeout=20) for h in olds] == list(range(5))
        assert all(n <= 2 for n in FLAKY.values()), FLAKY


def test_submit_once_racing_from_two_deploys_makes_one_run_of_one_definition(
    cyclone_dsn: str,
) -> None:
    old_registry, new_registry = deploy(V1), deploy(V2)
    with (
        Client(cyclone_dsn, registry=old_registry) as old_client,
        Client(cyclone_dsn, registry=new_registry) as new_client,
    ):
        for round_ in range(5):
            barrier = threading.Barrier(8)
            got: list[tuple[int, bool]] = []
            errors: list[BaseException] = []

            def go(
                c: Client,
                value: int,
                r: int = round_,
                barrier: threading.Barrier = barrier,
                got: list[tuple[int, bool]] = got,
                errors: list[BaseException] = errors,
            ) -> None:
                try:
                    barrier.wait()
                    h = c.submit_once("xds_wf", value, key=f"once-{r}")
                    got.append((h.id, h.created))
                except BaseException as exc:
                    errors.append(exc)

            threads = [
                threading.Thread(target=go, args=(old_client if i % 2 else new_client, i))
                for i in range(8)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert errors == []
            assert len({i for i, _ in got}) == 1
            assert sum(created for _, created in got) == 1
            run = old_client.get_run(got[0][0])
            assert run.def_version in (V1.def_version, V2.def_version)


def test_debounce_racing_from_two_deploys_never_mixes_definitions(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """flow-control.md: a submit from a deploy whose definition differs opens a new window;
    a joined run (created=False) must be of the submitter's definition."""
    old_registry, new_registry = deploy(V1), deploy(V2)
    debounce = Debounce(delay=timedelta(seconds=1.5))
    with (
        Client(cyclone_dsn, registry=old_registry) as old_client,
        Client(cyclone_dsn, registry=new_registry) as new_client,
    ):
        results: list[tuple[str, int, bool, int]] = []
        lock = threading.Lock()
        errors: list[BaseException] = []
        barrier = threading.Barrier(6)

        def go(which: str, c: Client, base: int) -> None:
            try:
                barrier.wait()
                for i in range(6):
                    h = c.submit("xds_wf", base + i, debounce=debounce)
                    with lock:
                        results.append((which, h.id, h.created, base + i))
            except BaseException as exc:
                errors.append(exc)

        threads = [
            threading.Thread(
                target=go,
                args=("old" if k % 2 else "new", old_client if k % 2 else new_client, k * 100),
            )
            for k in range(6)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        version = {"old": V1.def_version, "new": V2.def_version}
        for which, run_id, _created, _value in results:
            assert old_client.get_run(run_id).def_version == version[which], (which, run_id)
        created = [r for r in results if r[2]]
        ids = {r[1] for r in results}
        assert len(created) == len(ids)
        start_worker(registry=old_registry, name="xds-old")
        start_worker(registry=new_registry, name="xds-new")
        for run_id in ids:
            run = wait_until(
                lambda r=run_id: (x := old_client.get_run(r)).is_terminal and x,
                what=f"run {run_id}",
            )
            assert run.state is RunState.COMPLETED, (run_id, run.state)
            # Each run's result is computed from its own input by its own definition.
            factor = 10 if run.def_version == V1.def_version else 100
            assert old_client.result(run_id, timeout=5) == (run.input + 1) * factor


# -- schedules -----------------------------------------------------------------------------


@step(name="xds_sched_echo")
def xds_sched_echo(x: object) -> object:
    return x


def _mine(x):  # type: ignore[no-untyped-def]
    return xds_sched_echo(x)


def _others(x):  # type: ignore[no-untyped-def]
    return xds_sched_echo(x)


MINE = WorkflowDef(_mine, "xds_mine")
OTHERS = WorkflowDef(_others, "xds_others")


def _pin_v1(x):  # type: ignore[no-untyped-def]
    return xds_sched_echo(x)


def _pin_v2(x):  # type: ignore[no-untyped-def]
    return xds_sched_echo(xds_a(x))


PIN_V1, PIN_V2 = WorkflowDef(_pin_v1, "xds_pin"), WorkflowDef(_pin_v2, "xds_pin")


def test_two_deploys_scanning_with_both_catch_up_policies_fire_each_slot_once_pinned(
    cyclone_dsn: str, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    base = datetime(2027, 7, 2, 12, 0, 30, tzinfo=UTC)
    clock(base)
    with (
        Client(cyclone_dsn, registry=deploy(PIN_V1)) as old,
        Client(cyclone_dsn, registry=deploy(PIN_V2)) as new,
    ):
        new.schedule(PIN_V2, "*/10 * * * *", id="xds-pin", location="UTC", input=1)
        clock(base + timedelta(minutes=45))  # 12:10 .. 12:40: four missed slots
        start_worker(registry=deploy(PIN_V1), name="xds-old", catch_up="latest", scan_interval=0.05)
        start_worker(registry=deploy(PIN_V2), name="xds-new", catch_up="all", scan_interval=0.05)
        wait_until(lambda: len(runs_of(new, "xds_pin")) >= 4, what="the four missed slots")
        time.sleep(1.0)
        runs = runs_of(new, "xds_pin")
        assert len(runs) == 4
        assert {new.get_run(r.id).def_version for r in runs} == {PIN_V2.def_version}
        sched = the_schedule(new, "xds-pin")
        assert sched.next_run_at == datetime(2027, 7, 2, 12, 50, tzinfo=UTC)
        # The old deploy registers it again (say an old worker restarted): the pin moves,
        # and the next slot fires once, with the old definition.
        old.schedule(PIN_V1, "*/10 * * * *", id="xds-pin", location="UTC", input=1)
        clock(base + timedelta(minutes=50))
        wait_until(lambda: len(runs_of(new, "xds_pin")) >= 5, what="the fifth slot")
        time.sleep(1.0)
        runs = runs_of(new, "xds_pin")
        assert len(runs) == 5
        assert new.get_run(runs[0].id).def_version == PIN_V1.def_version


def test_a_schedule_whose_target_moved_to_another_workflow_is_left_by_the_old_deploy(
    cyclone_dsn: str, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    """The new deploy points schedule id "xds-moved" at another workflow: an old worker
    (which has only the old target) must not fire the old target any more, nor burn the
    slot; the new worker fires the new target."""
    base = datetime(2027, 7, 3, 12, 0, 30, tzinfo=UTC)
    clock(base)
    with (
        Client(cyclone_dsn, registry=deploy(PIN_V1)) as old,
        Client(cyclone_dsn, registry=deploy(MINE)) as new,
    ):
        old.schedule(PIN_V1, "*/5 * * * *", id="xds-moved", location="UTC", input=2)
        made = new.schedule(MINE, "*/5 * * * *", id="xds-moved", location="UTC", input=3)
        assert made.kind == "xds_mine"
        clock(made.next_run_at + timedelta(seconds=30))
        start_worker(registry=deploy(PIN_V1), name="xds-old", scan_interval=0.05)
        wait_until(
            lambda: the_schedule(new, "xds-moved").last_error is not None,
            what="the old worker's refusal",
        )
        assert runs_of(new, "xds_pin") == []
        assert the_schedule(new, "xds-moved").next_run_at == made.next_run_at
        start_worker(registry=deploy(MINE), name="xds-new", scan_interval=0.05)
        wait_until(lambda: runs_of(new, "xds_mine"), what="the new target fired")
        time.sleep(0.5)
        assert len(runs_of(new, "xds_mine")) == 1
        assert runs_of(new, "xds_pin") == []
        assert the_schedule(new, "xds-moved").last_error is None


# A step schedule across a deploy that changed the step's signature (same kind, same
# handler identity: a handler changed in place).


def _old_job() -> str:
    return "old"


def _new_job(x: int) -> str:
    return f"new {x}"


_new_job.__qualname__ = _old_job.__qualname__  # one identity: the same function, changed
OLD_JOB = step(name="xds_job")(_old_job)
# The new deploy's handler of the kind, not put in this process's default registry.
NEW_JOB = attrs.evolve(OLD_JOB, fn=_new_job)


# A handler fixed in place between deploys (same kind, same identity, same graph).


def _fix_old(x: int) -> str:
    return f"buggy {x}"


def _fix_new(x: int) -> str:
    return f"fixed {x}"


_fix_new.__qualname__ = _fix_old.__qualname__
FIX_OLD = step(name="xds_fix")(_fix_old)
FIX_NEW = attrs.evolve(FIX_OLD, fn=_fix_new)


def _fixwf(x):  # type: ignore[no-untyped-def]
    return FIX_OLD(x)


def _fixwf_new(x):  # type: ignore[no-untyped-def]
    return FIX_NEW(x)


FIXWF_OLD, FIXWF_NEW = WorkflowDef(_fixwf, "xds_fixwf"), WorkflowDef(_fixwf_new, "xds_fixwf")


def test_a_handler_fixed_in_place_keeps_the_version_and_both_deploys_serve_every_run(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    assert FIXWF_OLD.def_version == FIXWF_NEW.def_version
    old_reg, new_reg = deploy(FIXWF_OLD), deploy(FIXWF_NEW)
    with (
        Client(cyclone_dsn, registry=old_reg) as old_client,
        Client(cyclone_dsn, registry=new_reg) as new_client,
    ):
        olds = [old_client.submit("xds_fixwf", i) for i in range(4)]
        start_worker(registry=new_reg, name="xds-new")  # the old worker is gone
        assert [h.result(timeout=20) for h in olds] == [f"fixed {i}" for i in range(4)]
        start_worker(registry=old_reg, name="xds-old")  # both live: no HandlerConflict
        news = [new_client.submit("xds_fixwf", i) for i in range(6)]
        results = [h.result(timeout=20) for h in news]
        assert all(r in (f"buggy {i}", f"fixed {i}") for i, r in enumerate(results))
