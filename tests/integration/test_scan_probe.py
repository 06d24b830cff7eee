"""The scanner's probe: a pass runs when the probe finds its work, not only on a full pass.

Every test here makes the full passes (all passes, whatever the probe says) run at the
start only, then gives the scanner one kind of work and expects it handled within a few
passes: a probe that missed it would leave it for good.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta

import psycopg
import pytest

from cyclone_dsl import (
    Client,
    Concurrency,
    RunFailed,
    StepContext,
    StepState,
    Worker,
    child,
    step,
    wait_signal,
    wait_timer,
    workflow,
)
from cyclone_dsl.db.tx import ConnectionTx
from cyclone_dsl.engine import PROBED_PASSES, Engine
from cyclone_dsl.worker import scanner
from tests.waiting import PROMPT, expire_leases_until, scanner_passes, wait_until

Clock = Callable[[datetime | timedelta], None]
StartWorker = Callable[..., Worker]

release = threading.Event()


@pytest.fixture(autouse=True)
def _probed_passes_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(scanner, "FULL_PASS_EVERY", 10**9)  # the start's pass only
    release.clear()
    yield
    release.set()


def probing_worker(start_worker: StartWorker, *objects: object, **options: object) -> Worker:
    """A worker whose scanner passes often and has ended its full pass at start."""
    worker = start_worker(*objects, scan_interval=0.1, **options)
    scanner_passes(worker, 1)
    return worker


@step(name="spr_echo")
def spr_echo(value: object) -> object:
    return value


@step(name="spr_hold", max_attempts=1)
def spr_hold(value: object, ctx: StepContext) -> object:
    while not release.is_set() and not ctx.cancelled:
        release.wait(0.02)
    return value


@workflow(name="spr_timer")
def spr_timer(x):  # type: ignore[no-untyped-def]
    return spr_echo(x, after=[wait_timer(timedelta(hours=1))])


@workflow(name="spr_signal_timeout")
def spr_signal_timeout(x):  # type: ignore[no-untyped-def]
    got = wait_signal("spr_sig", timeout=timedelta(hours=1))
    spr_echo(got, on_dep_failure="cancel_branch")
    return spr_echo(x)


@workflow(name="spr_waits")
def spr_waits(x):  # type: ignore[no-untyped-def]
    return spr_echo(wait_signal("spr_never"))


def test_an_empty_schema_has_only_its_first_retention_pass_to_run(cyclone_dsn: str) -> None:
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        assert Engine().scan_passes_with_work(ConnectionTx(conn)) == {"retention"}


def timer_fires_after_the_full_pass(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    probing_worker(start_worker, spr_timer)
    handle = client.submit(spr_timer, 3)
    wait_until(
        lambda: handle.get().step("timer").state is StepState.WAITING_TIMER, what="the timer"
    )
    clock(timedelta(hours=2))
    assert handle.result(timeout=PROMPT) == 3


def test_a_timer_due_after_the_full_pass_fires(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    timer_fires_after_the_full_pass(client, start_worker, clock)


def test_a_probe_that_fails_lets_every_pass_run(
    client: Client, start_worker: StartWorker, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A look whose probe raises runs every pass (and the look reports the error)."""

    def broken(self: Engine, tx: ConnectionTx, **_: object) -> frozenset[str]:
        raise RuntimeError("the probe failed")

    monkeypatch.setattr(Engine, "scan_passes_with_work", broken)
    timer_fires_after_the_full_pass(client, start_worker, clock)


def test_a_signal_wait_timing_out_after_the_full_pass_is_timed_out(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    probing_worker(start_worker, spr_signal_timeout)
    handle = client.submit(spr_signal_timeout, 4)
    wait_until(lambda: handle.get().step("spr_sig").scheduled_at is not None, what="the wait")
    clock(timedelta(hours=2))
    assert handle.result(timeout=PROMPT) == 4
    assert handle.get().step("spr_sig").error_kind == "signal_timeout"


def test_a_deadline_passing_after_the_full_pass_fails_the_run(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    probing_worker(start_worker, spr_waits)
    handle = client.submit(spr_waits, 5, deadline=timedelta(hours=1))
    wait_until(lambda: handle.get().step("spr_never").state.value != "pending", what="the wait")
    clock(timedelta(hours=2))
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=PROMPT)
    assert failed.value.error_kind == "deadline"


def test_a_lease_expiring_after_the_full_pass_is_reclaimed(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    probing_worker(start_worker, spr_hold)
    handle = client.enqueue(spr_hold, 6)
    wait_until(lambda: handle.get().steps[0].state is StepState.RUNNING, what="the step")
    expire_leases_until(lambda: handle.get().steps[0].reclaims >= 1, what="a reclaim")
    release.set()
    assert handle.result(timeout=PROMPT) == 6


def test_a_step_past_its_timeout_after_the_full_pass_is_failed_by_the_scanner(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    """The worker running it times it out by its own clock, which the move does not pass;
    its lease outlasts the move: only the scanner's timeouts pass can fail it."""
    start_worker(spr_hold, scanners=False, lease=4 * 3600)
    probing_worker(start_worker, spr_echo)
    handle = client.enqueue(spr_hold, 7, timeout=3600)
    wait_until(lambda: handle.get().steps[0].state is StepState.RUNNING, what="the step")
    clock(timedelta(hours=1.5))
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=PROMPT)
    assert failed.value.error_kind == "timeout"


@step(name="spr_keyed", concurrency=Concurrency(key="tenant", limit=1))
def spr_keyed(job: dict[str, str]) -> str:
    return job["tenant"]


def test_a_gate_left_unparked_after_the_full_pass_is_parked(
    client: Client, start_worker: StartWorker, cyclone_dsn: str
) -> None:
    """A gate whose step ended but which its end did not park (a worker of an earlier
    version): the gates pass parks it."""
    worker = probing_worker(start_worker, spr_keyed)
    handle = client.enqueue(spr_keyed, {"tenant": "t"})
    assert handle.result(timeout=PROMPT) == "t"
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        unparked = conn.execute(
            "UPDATE cyclone_ext_gates SET queue = 'default' WHERE run_id = %s RETURNING step_id",
            [handle.id],
        ).fetchall()
        assert len(unparked) == 1
        scanner_passes(worker, 2)

        def parked() -> bool:
            row = conn.execute(
                "SELECT queue FROM cyclone_ext_gates WHERE run_id = %s", [handle.id]
            ).fetchone()
            return row is not None and row[0] == ""

        wait_until(parked, timeout=PROMPT, what="the gate to be parked")


@workflow(name="spr_parent")
def spr_parent(x):  # type: ignore[no-untyped-def]
    return spr_echo(child(spr_waits, x))


def test_a_child_run_ended_without_settling_its_parent_node_is_settled(
    client: Client, start_worker: StartWorker, cyclone_dsn: str
) -> None:
    """A child run ended by a writer that did not settle its parent's node (the children
    pass is a repair): the pass settles it, and the parent run ends."""
    probing_worker(start_worker, spr_parent, spr_waits)
    handle = client.submit(spr_parent, 8)
    kids = wait_until(lambda: client.children_of(handle.id), what="the child run")
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE cyclone_runs SET state = 'cancelled', finished_at = now() WHERE id = %s",
            [kids[0]["id"]],
        )
    with pytest.raises(RunFailed):
        handle.result(timeout=PROMPT)


@workflow(name="spr_scheduled")
def spr_scheduled(x):  # type: ignore[no-untyped-def]
    return spr_echo(x)


def test_a_schedule_due_after_the_full_pass_fires(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    worker = probing_worker(start_worker, spr_scheduled)
    client.schedule(spr_scheduled, "0 3 * * *", id="spr_nightly", location="UTC", input=9)
    scanner_passes(worker, 2)
    assert client.list_runs() == []  # not due yet
    clock(timedelta(hours=25))
    runs = wait_until(client.list_runs, timeout=PROMPT, what="the schedule to fire")
    assert client.handle(runs[0].id).result(timeout=PROMPT) == 9


def test_retention_due_after_the_full_pass_runs(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    probing_worker(start_worker, spr_echo, retention=timedelta(hours=1))
    handle = client.enqueue(spr_echo, 10)
    assert handle.result(timeout=PROMPT) == 10
    clock(timedelta(hours=2))
    wait_until(lambda: client.list_runs() == [], timeout=PROMPT, what="retention")


def test_the_probed_passes_are_those_tested_here() -> None:
    assert {
        "leases",
        "timeouts",
        "timers",
        "signal_timeouts",
        "deadlines",
        "children",
        "gates",
        "schedules",
        "retention",
    } == PROBED_PASSES
