"""Differential audit: the outcome of a run does not depend on how late the scanner is.

Each scenario runs twice, on its own schema: ``prompt``, with a worker whose scanner runs
every 50 ms and has handled what came due after each move of the clock, and ``late``,
with the same events and the same clock moves but no scanner at all (a worker started
with ``scanners=False``, which the docs allow) until a scanning worker starts at the end.
Both must end alike (docs/concepts/waits.md: "A deadline that passed first wins, even
when the scanner is late", the signal table's row for a wait whose timeout passed, and
"Pause and resume"), except where the docs say they differ.

Time is moved with the ``clock`` fixture (this process's database clock, which the
workers started here share). A scanner pass is known to have run in full once two
sentinel runs (a 1 us timer each), submitted one after the other, have ended.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from cyclone_dsl import (
    AlreadyTerminal,
    Client,
    Delivery,
    InvalidTransition,
    RunFailed,
    RunFilter,
    RunState,
    StepState,
    Worker,
    child,
    for_each,
    step,
    wait_any,
    wait_n,
    wait_signal,
    wait_timer,
    workflow,
)
from tests.waiting import wait_until

HOUR = timedelta(hours=1)
MODES = ["prompt", "late"]
ROOT = Path(__file__).resolve().parents[2]
Clock = Callable[[datetime], None]


# -- handlers ------------------------------------------------------------------------------


@step(name="lsc_echo")
def lsc_echo(value: object) -> object:
    return value


@step(name="lsc_pair")
def lsc_pair(a: object, b: object) -> object:
    return [a, b]


@step(name="lsc_items")
def lsc_items(n: int) -> list[int]:
    return list(range(n))


@step(name="lsc_hang", timeout=timedelta(minutes=1), max_attempts=1)
def lsc_hang(value: object) -> object:
    """Hangs in the worker process started with ``LSC_HANG=1`` (killed there); returns at
    once anywhere else."""
    if os.environ.get("LSC_HANG") == "1":
        time.sleep(600)
    return value


@workflow(name="lsc_sentinel")
def lsc_sentinel(x):  # type: ignore[no-untyped-def]
    return wait_timer(timedelta(microseconds=1))


HANDLERS = (lsc_echo, lsc_pair, lsc_items, lsc_hang, lsc_sentinel)


# -- the two timelines -----------------------------------------------------------------------


class Timeline:
    """The events of one scenario, with the scanner prompt or late."""

    def __init__(
        self,
        mode: str,
        client: Client,
        start_worker: Callable[..., Worker],
        clock: Clock,
        *objects: object,
        **options: Any,
    ) -> None:
        self.prompt = mode == "prompt"
        self.client = client
        self.start_worker = start_worker
        self.clock = clock
        self.objects = (*HANDLERS, *objects)
        self.options = options
        self.shift = timedelta(0)
        self.scanning = self.prompt
        if self.prompt:
            start_worker(*self.objects, scan_interval=0.05, **options)
        else:
            start_worker(*self.objects, scanners=False, **options)

    def later(self, by: timedelta) -> None:
        """Move the database clock forward by ``by``; a prompt scanner then handles what
        came due before the next event."""
        self.shift += by
        self.clock(datetime.now(UTC) + self.shift)
        if self.prompt:
            self.scanned()

    def scanned(self) -> None:
        """Return once a whole scanner pass ran after this call."""
        assert self.scanning
        for _ in range(2):
            self.client.submit(lsc_sentinel, 0).wait(timeout=15)

    def settle(self, **options: Any) -> None:
        """The late scanner comes at last (a scanning worker starts); then a whole pass."""
        if not self.scanning:
            self.start_worker(*self.objects, scan_interval=0.05, **{**self.options, **options})
            self.scanning = True
        self.scanned()


def outcome(client: Client, run_id: int) -> tuple[RunState, object]:
    """The run's end: its state and its result, or the failing node and error kind."""
    run = client.wait(run_id, timeout=15)
    try:
        return run.state, client.result(run_id, timeout=5)
    except RunFailed as failed:
        return run.state, (failed.node, failed.error_kind)


# -- timers and signal timeouts --------------------------------------------------------------


@workflow(name="lsc_race")
def lsc_race(x):  # type: ignore[no-untyped-def]
    t = wait_timer(2 * HOUR).named("lsc_race_t")
    w = wait_signal("lsc_race_s", timeout=HOUR)
    return lsc_echo(w, after=[t])


@pytest.mark.parametrize("mode", MODES)
def test_a_timer_due_after_a_signal_timeout_that_failed_the_run_is_cancelled(
    mode: str, client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    tl = Timeline(mode, client, start_worker, clock)
    handle = client.submit(lsc_race, 0)
    tl.later(1.5 * HOUR)  # the signal timeout is due
    tl.later(1.5 * HOUR)  # the timer too
    tl.settle()
    assert outcome(client, handle.id) == (RunState.FAILED, ("lsc_race_s", "signal_timeout"))
    assert handle.get().step("lsc_race_t").state is StepState.CANCELLED
    # The retry runs the cancelled timer again, its full duration.
    client.retry(handle.id, "lsc_race_s")
    assert client.signal(handle.id, "lsc_race_s", "ok") is Delivery.CONSUMED
    tl.scanned()
    assert handle.get().state is RunState.RUNNING
    tl.later(3 * HOUR)
    assert handle.result(timeout=15) == "ok"


@workflow(name="lsc_quorum")
def lsc_quorum(x):  # type: ignore[no-untyped-def]
    got = wait_n("lsc_quorum_s", 2, timeout=HOUR).named("lsc_quorum_w")
    lsc_echo(got, on_dep_failure="cancel_branch")
    return lsc_pair(x, wait_signal("lsc_quorum_end"))


@pytest.mark.parametrize("mode", MODES)
def test_a_partial_quorum_whose_timeout_passed_ends_alike_however_late_the_scanner(
    mode: str, client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    tl = Timeline(mode, client, start_worker, clock)
    handle = client.submit(lsc_quorum, 3)
    assert client.signal(handle.id, "lsc_quorum_s", "one") is Delivery.CONSUMED
    tl.later(2 * HOUR)
    assert client.signal(handle.id, "lsc_quorum_s", "two") is Delivery.NOT_STORED
    assert client.signal(handle.id, "lsc_quorum_end", "end") is Delivery.CONSUMED
    tl.settle()
    assert outcome(client, handle.id) == (RunState.COMPLETED, [3, "end"])
    run = handle.get()
    wait = run.step("lsc_quorum_w")
    assert (wait.state, wait.error_kind, wait.output) == (
        StepState.DISCARDED,
        "signal_timeout",
        ["one"],
    )
    assert "only 1 of 2" in (wait.error or "")
    assert run.step("lsc_echo").state is StepState.CANCELLED
    assert [r["payload"] for r in client.signals_of(handle.id)] == ["one", "end"]


@workflow(name="lsc_pr")
def lsc_pr(x):  # type: ignore[no-untyped-def]
    t = wait_timer(HOUR).named("lsc_pr_t")
    voted = wait_any(["lsc_pr_y", "lsc_pr_n"], timeout=HOUR).named("lsc_pr_any")
    lsc_echo(voted, on_dep_failure="cancel_branch")
    go = wait_signal("lsc_pr_go")
    return lsc_pair(go, x, after=[t])


@pytest.mark.parametrize("mode", MODES)
def test_a_timer_and_a_timeout_due_before_a_pause_come_first_after_the_resume(
    mode: str, client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    """Documented: what was due when the run was paused is not moved by the resume; the
    deadline is (4 h, paused 5 h: not passed at 6.5 h)."""
    tl = Timeline(mode, client, start_worker, clock)
    handle = client.submit(lsc_pr, 5, deadline=4 * HOUR)
    tl.later(1.5 * HOUR)
    client.pause(handle.id)
    tl.later(5 * HOUR)
    assert client.signal(handle.id, "lsc_pr_y", "late vote") is Delivery.NOT_STORED
    assert client.signal(handle.id, "lsc_pr_go", "go") is Delivery.CONSUMED
    client.resume(handle.id)
    tl.settle()
    assert outcome(client, handle.id) == (RunState.COMPLETED, ["go", 5])
    run = handle.get()
    assert run.step("lsc_pr_t").state is StepState.COMPLETED
    voted = run.step("lsc_pr_any")
    assert (voted.state, voted.error_kind) == (StepState.DISCARDED, "signal_timeout")
    assert run.step("lsc_echo").state is StepState.CANCELLED


@workflow(name="lsc_tonly")
def lsc_tonly(x):  # type: ignore[no-untyped-def]
    return wait_timer(HOUR).named("lsc_tonly_t")


@pytest.mark.parametrize("mode", MODES)
def test_cancelling_a_run_whose_last_timer_came_due_finds_it_completed(
    mode: str, client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    tl = Timeline(mode, client, start_worker, clock)
    handle = client.submit(lsc_tonly, 0)
    tl.later(2 * HOUR)
    with pytest.raises(AlreadyTerminal):
        client.cancel(handle.id)
    tl.settle()
    assert outcome(client, handle.id) == (RunState.COMPLETED, None)


@workflow(name="lsc_sig")
def lsc_sig(x):  # type: ignore[no-untyped-def]
    return lsc_echo(wait_signal("lsc_sig_s", timeout=HOUR).named("lsc_sig_w"))


@pytest.mark.parametrize("mode", MODES)
def test_cancelling_a_run_whose_signal_timeout_passed_finds_it_failed(
    mode: str, client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    tl = Timeline(mode, client, start_worker, clock)
    handle = client.submit(lsc_sig, 0)
    tl.later(2 * HOUR)
    with pytest.raises(AlreadyTerminal):
        client.cancel(handle.id)
    tl.settle()
    assert outcome(client, handle.id) == (RunState.FAILED, ("lsc_sig_w", "signal_timeout"))


@pytest.mark.parametrize("mode", MODES)
def test_retrying_a_signal_wait_whose_timeout_passed_waits_afresh(
    mode: str, client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    tl = Timeline(mode, client, start_worker, clock)
    handle = client.submit(lsc_sig, 0)
    tl.later(2 * HOUR)
    client.retry(handle.id, "lsc_sig_w")
    assert client.signal(handle.id, "lsc_sig_s", "again") is Delivery.CONSUMED
    tl.settle()
    assert outcome(client, handle.id) == (RunState.COMPLETED, "again")


@workflow(name="lsc_chain")
def lsc_chain(x):  # type: ignore[no-untyped-def]
    t = wait_timer(HOUR).named("lsc_chain_t")
    w = wait_signal("lsc_chain_s", timeout=HOUR / 2, after=[t]).named("lsc_chain_w")
    return lsc_echo(w)


@pytest.mark.parametrize("mode", MODES)
def test_a_wait_behind_a_long_due_timer_has_timed_out_when_its_signal_comes(
    mode: str, client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    """Documented difference (waits.md, Scanners): a wait counts from its activation, so a
    wait behind a timer that fired late (here when the signal came) starts late too."""
    tl = Timeline(mode, client, start_worker, clock)
    handle = client.submit(lsc_chain, 0)
    tl.later(2 * HOUR)  # the timer came due (at 1 h)
    tl.later(HOUR)  # the wait's 30 min timeout too, counted from a prompt firing
    if tl.prompt:
        with pytest.raises(AlreadyTerminal):
            client.signal(handle.id, "lsc_chain_s", "too late")
        tl.settle()
        assert outcome(client, handle.id) == (RunState.FAILED, ("lsc_chain_w", "signal_timeout"))
    else:  # the signal fires the timer first; the wait starts then, and takes it
        assert client.signal(handle.id, "lsc_chain_s", "late") is Delivery.CONSUMED
        tl.settle()
        assert outcome(client, handle.id) == (RunState.COMPLETED, "late")


# -- deadlines ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_deadline_beats_an_earlier_timer_only_when_no_scanner_ran_between(
    mode: str, client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    """Documented difference (waits.md, Deadlines: "When workers were down across both
    times, the deadline wins even if the timer was due first")."""
    tl = Timeline(mode, client, start_worker, clock)
    handle = client.submit(lsc_tonly, 0, deadline=2 * HOUR)
    tl.later(1.5 * HOUR)  # the timer
    tl.later(1.5 * HOUR)  # the deadline
    tl.settle()
    if tl.prompt:
        assert outcome(client, handle.id) == (RunState.COMPLETED, None)
    else:
        state, (_, kind) = outcome(client, handle.id)  # type: ignore[misc]
        assert (state, kind) == (RunState.FAILED, "deadline")
        assert handle.get().step("lsc_tonly_t").state is StepState.CANCELLED


@workflow(name="lsc_kid")
def lsc_kid(x):  # type: ignore[no-untyped-def]
    return lsc_echo(wait_signal("lsc_kid_s").named("lsc_kid_w"))


@workflow(name="lsc_parent")
def lsc_parent(x):  # type: ignore[no-untyped-def]
    return lsc_echo(child(lsc_kid, x).named("lsc_parent_kid"))


@pytest.mark.parametrize("mode", MODES)
def test_a_passed_parent_deadline_ends_the_family_whatever_reaches_it_first(
    mode: str, client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    """Signal to the child, pause, cancel and cancel_many after the parent's deadline: the
    parent fails by its deadline and the child is cancelled, in both timelines."""
    tl = Timeline(mode, client, start_worker, clock, lsc_kid, lsc_parent)
    handles = [client.submit(lsc_parent, i, deadline=HOUR) for i in range(4)]
    kids = [
        wait_until(lambda h=h: client.children_of(h.id), what="the child run")[0]["id"]
        for h in handles
    ]
    tl.later(2 * HOUR)
    with pytest.raises(AlreadyTerminal):
        client.signal(kids[0], "lsc_kid_s", "late")
    with pytest.raises(AlreadyTerminal):
        client.pause(handles[1].id)
    with pytest.raises(AlreadyTerminal):
        client.cancel(kids[2])
    bulk = client.cancel_many(RunFilter(workflows="lsc_parent"))
    assert bulk.acted == 0
    tl.settle()
    for handle, kid in zip(handles, kids, strict=True):
        state, (_, kind) = outcome(client, handle.id)  # type: ignore[misc]
        assert (state, kind) == (RunState.FAILED, "deadline")
        assert client.get_run(kid).state is RunState.CANCELLED
        assert client.get_run(kid).step("lsc_kid_w").state is StepState.CANCELLED


@workflow(name="lsc_kid_timer")
def lsc_kid_timer(x):  # type: ignore[no-untyped-def]
    return lsc_echo(x, after=[wait_timer(HOUR).named("lsc_kt")])


@workflow(name="lsc_fan")
def lsc_fan(n):  # type: ignore[no-untyped-def]
    return for_each(lsc_kid_timer, over=lsc_items(n), max_parallel=1)


@pytest.mark.parametrize("mode", MODES)
def test_child_runs_with_timers_one_after_another_meet_the_deadline_alike(
    mode: str, client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    tl = Timeline(mode, client, start_worker, clock, lsc_kid_timer, lsc_fan)
    handle = client.submit(lsc_fan, 2, deadline=3.5 * HOUR)
    wait_until(lambda: client.children_of(handle.id), what="the first child run")
    tl.later(1.5 * HOUR)
    if tl.prompt:  # the second child run has started (its handler ran)
        wait_until(lambda: len(client.children_of(handle.id)) == 2, what="2 child runs")
    tl.later(1.5 * HOUR)
    tl.settle()
    if tl.prompt:  # the second child's handler has run
        client.wait(handle.id, timeout=15)
    tl.later(HOUR)  # past the deadline
    tl.scanned()
    if tl.prompt:
        assert outcome(client, handle.id) == (RunState.COMPLETED, [0, 1])
    else:  # documented (waits.md, Scanners): the second child's timer started late
        state, (_, kind) = outcome(client, handle.id)  # type: ignore[misc]
        assert (state, kind) == (RunState.FAILED, "deadline")


# -- schedules ---------------------------------------------------------------------------------


@workflow(name="lsc_cron")
def lsc_cron(x):  # type: ignore[no-untyped-def]
    return lsc_echo(x)


@pytest.mark.parametrize(
    ("mode", "catch_up", "fired"),
    [("prompt", "latest", 3), ("late", "latest", 1), ("late", "all", 3)],
)
def test_missed_schedule_slots_fire_as_the_catch_up_policy_says(
    mode: str,
    catch_up: str,
    fired: int,
    client: Client,
    start_worker: Callable[..., Worker],
    clock: Clock,
) -> None:
    """Documented: a prompt scanner fires every slot; a late one the latest missed slot
    only (``catch_up="latest"``), or each of them (``catch_up="all"``)."""
    start = datetime(2031, 1, 6, 0, 1, tzinfo=UTC)
    clock(start)
    tl = Timeline(mode, client, start_worker, clock, lsc_cron, catch_up=catch_up)
    tl.shift = start - datetime.now(UTC)
    client.schedule(lsc_cron, "*/15 * * * *", id="lsc_q", location="UTC", input=1)
    for _ in range(3):  # 00:17, 00:33, 00:49: the slots of 00:15, 00:30 and 00:45 pass
        tl.later(timedelta(minutes=16))
    tl.settle()
    tl.scanned()  # catch_up="all" fires one slot per pass: three passes at least
    tl.scanned()
    runs = wait_until(
        lambda: (r := client.list_runs(workflow="lsc_cron")) and len(r) >= fired and r,
        what=f"{fired} fired runs",
    )
    tl.scanned()
    assert len(client.list_runs(workflow="lsc_cron")) == fired == len(runs)


# -- step timeouts and leases (a worker process that dies) --------------------------------------


def _dying_worker(dsn: str, lease: float) -> subprocess.Popen[bytes]:
    code = (
        "import sys; from cyclone_dsl import Worker; "
        "from tests.integration.test_lsc_audit import lsc_hang; "
        f"Worker(sys.argv[1], [lsc_hang], lease={lease}, scanners=False, "
        "poll_interval=0.1).run()"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, dsn],
        cwd=ROOT,
        env={**os.environ, "LSC_HANG": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _killed_while_running(client: Client, cyclone_dsn: str, run_id: int, lease: float) -> None:
    proc = _dying_worker(cyclone_dsn, lease)
    try:
        wait_until(
            lambda: client.get_run(run_id).step("lsc_hang").state is StepState.RUNNING,
            timeout=30,
            what="the step running in the worker process",
        )
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)


@workflow(name="lsc_hung")
def lsc_hung(x):  # type: ignore[no-untyped-def]
    return lsc_hang(x)


@pytest.mark.parametrize("mode", MODES)
def test_a_step_timeout_that_came_before_the_lease_expiry_fails_the_step(
    mode: str,
    client: Client,
    start_worker: Callable[..., Worker],
    clock: Clock,
    cyclone_dsn: str,
) -> None:
    handle = client.submit(lsc_hung, 7)
    _killed_while_running(client, cyclone_dsn, handle.id, lease=3600)
    tl = Timeline(mode, client, start_worker, clock)
    tl.later(timedelta(minutes=3))  # the timeout (and its 5 s grace), not the lease
    tl.later(2 * HOUR)  # the lease too
    tl.settle()
    assert outcome(client, handle.id) == (RunState.FAILED, ("lsc_hang", "timeout"))


@pytest.mark.parametrize("mode", MODES)
def test_a_deadline_that_came_before_a_reclaim_limit_ends_the_run(
    mode: str,
    client: Client,
    start_worker: Callable[..., Worker],
    clock: Clock,
    cyclone_dsn: str,
) -> None:
    handle = client.submit(lsc_hung, 8, deadline=HOUR)
    _killed_while_running(client, cyclone_dsn, handle.id, lease=3 * 3600)
    tl = Timeline(mode, client, start_worker, clock, max_reclaims=0)
    tl.later(2 * HOUR)  # the deadline, not the lease (nor the 1 min timeout's scanner:
    tl.later(2 * HOUR)  # the timeouts pass fails a run past its deadline by the deadline)
    tl.settle()
    state, (_, kind) = outcome(client, handle.id)  # type: ignore[misc]
    assert (state, kind) == (RunState.FAILED, "deadline")


def test_a_refused_retry_changes_nothing(client: Client) -> None:
    """Sanity for the retry test above: a wait still waiting is not retried."""
    handle = client.submit(lsc_sig, 0)
    with pytest.raises(InvalidTransition):
        client.retry(handle.id, "lsc_sig_w")
    assert handle.get().step("lsc_sig_w").state is StepState.WAITING_SIGNAL


# -- operations on many runs, and forks --------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_retry_many_of_failed_runs_takes_a_run_whose_signal_timeout_passed(
    mode: str, client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    tl = Timeline(mode, client, start_worker, clock)
    handle = client.submit(lsc_sig, 0)
    tl.later(2 * HOUR)
    where = RunFilter(workflows="lsc_sig", states="failed")
    assert client.retry_many(where, dry_run=True).matched == 1
    assert client.retry_many(where).acted == 1
    assert client.signal(handle.id, "lsc_sig_s", "again") is Delivery.CONSUMED
    tl.settle()
    assert outcome(client, handle.id) == (RunState.COMPLETED, "again")


@workflow(name="lsc_fork")
def lsc_fork(x):  # type: ignore[no-untyped-def]
    t = wait_timer(HOUR).named("lsc_fork_t")
    w = wait_signal("lsc_fork_s").named("lsc_fork_w")
    return lsc_pair(w, x, after=[t])


@pytest.mark.parametrize("mode", MODES)
def test_a_fork_copies_a_timer_that_came_due_in_its_source(
    mode: str, client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    tl = Timeline(mode, client, start_worker, clock)
    source = client.submit(lsc_fork, 1)
    tl.later(2 * HOUR)  # the timer came due at 1 h
    forked = client.fork(source.id, "lsc_fork_w")
    timer = forked.get().step("lsc_fork_t")
    assert (timer.state, timer.copied) == (StepState.COMPLETED, True)
    assert client.signal(forked.id, "lsc_fork_s", "go") is Delivery.CONSUMED
    tl.settle()
    assert outcome(client, forked.id) == (RunState.COMPLETED, ["go", 1])
