"""Audit of ``wait_n``, ``wait_any`` and ``wait_timer``: quorum shape and mailbox counts,
which name wins, timeouts and ``on_dep_failure``, and timers across pause, resume, cancel,
operator retry, replay, fork and child runs.

Time is moved with the ``clock`` fixture (the database clock of this process, which the
workers started here share), not waited out: the waits use hours, the clock jumps them.
A scanner pass is known to have run when a 1 µs timer of a sentinel run has fired.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from cyclone_dsl import (
    AlreadyTerminal,
    Client,
    Delivery,
    InvalidGraph,
    MailboxFull,
    RunFailed,
    RunState,
    SignalNotDeliverable,
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
CALLS: Counter[str] = Counter()
_lock = threading.Lock()
gate = threading.Event()

Clock = Callable[[datetime], None]


@pytest.fixture(autouse=True)
def _reset() -> None:
    CALLS.clear()
    gate.set()


def _count(tag: str) -> None:
    with _lock:
        CALLS[tag] += 1


# -- handlers ------------------------------------------------------------------------------


@step(name="wta_echo")
def wta_echo(value: object) -> object:
    _count("echo")
    return value


@step(name="wta_gate")
def wta_gate(value: object) -> object:
    gate.wait(10)
    return value


@step(name="wta_pair")
def wta_pair(a: object, b: object) -> object:
    return [a, b]


@step(name="wta_items")
def wta_items(n: int) -> list[int]:
    return list(range(n))


@step(name="wta_after")
def wta_after(value: object) -> object:
    _count("after")
    return {"after": value}


# -- helpers ---------------------------------------------------------------------------------


@workflow(name="wta_sentinel")
def wta_sentinel(x):  # type: ignore[no-untyped-def]
    return wait_timer(timedelta(microseconds=1))


def _scanned(client: Client) -> None:
    """Return once a scanner pass that began after this call has fired timers."""
    handle = client.submit(wta_sentinel, 0)
    handle.wait(timeout=15)


_shift = timedelta(0)


def _later(clock: Clock, by: timedelta) -> None:
    """Move the database clock forward by ``by`` (from where the test moved it so far)."""
    global _shift
    _shift += by
    clock(datetime.now(UTC) + _shift)


@pytest.fixture(autouse=True)
def _no_shift() -> None:
    global _shift
    _shift = timedelta(0)


# -- wait_n: shape and counts ------------------------------------------------------------------


@workflow(name="wta_n1")
def wta_n1(x):  # type: ignore[no-untyped-def]
    return wta_echo(wait_n("wta_n1_sig", 1))


def test_wait_n_of_one_outputs_a_list_of_one(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    handle = client.submit(wta_n1, 0)
    assert client.signal(handle.id, "wta_n1_sig", {"v": 1}) is Delivery.CONSUMED
    assert client.signal(handle.id, "wta_n1_sig", {"v": 2}) is Delivery.NOT_STORED
    start_worker(wta_echo)
    assert handle.result(timeout=10) == [{"v": 1}]
    assert [r["payload"] for r in client.signals_of(handle.id)] == [{"v": 1}]


@workflow(name="wta_n3")
def wta_n3(x):  # type: ignore[no-untyped-def]
    return wta_echo(wait_n("wta_n3_sig", 3))


def test_wait_n_shows_its_partial_quorum_and_drops_signals_past_n(client: Client) -> None:
    handle = client.submit(wta_n3, 0)
    assert client.signal(handle.id, "wta_n3_sig", "a") is Delivery.CONSUMED
    assert client.signal(handle.id, "wta_n3_sig", None) is Delivery.CONSUMED
    wait = handle.get().step("wta_n3_sig")
    assert (wait.state, wait.output, wait.wait_count) == (StepState.WAITING_SIGNAL, ["a", None], 3)
    assert client.signal(handle.id, "wta_n3_sig", ["c"]) is Delivery.CONSUMED
    for extra in ("d", "e"):
        assert client.signal(handle.id, "wta_n3_sig", extra) is Delivery.NOT_STORED
    wait = handle.get().step("wta_n3_sig")
    assert (wait.state, wait.output) == (StepState.COMPLETED, ["a", None, ["c"]])
    rows = client.signals_of(handle.id)
    assert [(r["payload"], r["consumed_by"]) for r in rows] == [
        ("a", "wta_n3_sig"),
        (None, "wta_n3_sig"),
        (["c"], "wta_n3_sig"),
    ]


@workflow(name="wta_n_later")
def wta_n_later(x):  # type: ignore[no-untyped-def]
    first = wta_gate(x)
    return wta_echo(wait_n("wta_nl_sig", 3, after=[first]))


def test_wait_n_takes_its_buffered_signals_first_then_live_ones(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    gate.clear()
    start_worker(wta_echo, wta_gate)
    handle = client.submit(wta_n_later, 0)
    assert client.signal(handle.id, "wta_nl_sig", "b1") is Delivery.BUFFERED
    assert client.signal(handle.id, "wta_nl_sig", "b2") is Delivery.BUFFERED
    gate.set()
    wait_until(
        lambda: handle.get().step("wta_nl_sig").output == ["b1", "b2"],
        what="the wait to take its two buffered signals",
    )
    assert handle.get().step("wta_nl_sig").state is StepState.WAITING_SIGNAL
    # The wait is active: a third is consumed (no capacity check applies any more).
    assert client.signal(handle.id, "wta_nl_sig", "live") is Delivery.CONSUMED
    assert handle.result(timeout=10) == ["b1", "b2", "live"]
    assert [r["consumed_by"] for r in client.signals_of(handle.id)] == ["wta_nl_sig"] * 3


def test_mailbox_full_names_the_run_the_signal_and_the_quorum(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    gate.clear()
    start_worker(wta_echo, wta_gate)
    handle = client.submit(wta_n_later, 0)
    for v in range(3):
        assert client.signal(handle.id, "wta_nl_sig", v) is Delivery.BUFFERED
    with pytest.raises(MailboxFull) as full:
        client.signal(handle.id, "wta_nl_sig", 99)
    assert (full.value.run_id, full.value.name, full.value.capacity) == (
        handle.id,
        "wta_nl_sig",
        3,
    )
    assert [r["payload"] for r in client.signals_of(handle.id)] == [0, 1, 2]
    gate.set()
    assert handle.result(timeout=10) == [0, 1, 2]


# -- wait_any ----------------------------------------------------------------------------------


@workflow(name="wta_any3")
def wta_any3(x):  # type: ignore[no-untyped-def]
    return wta_echo(wait_any(["wta_a", "wta_b", "wta_c"]).named("wta_any3_wait"))


def test_wait_any_names_its_winner_and_drops_the_other_names(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    handle = client.submit(wta_any3, 0)
    assert client.signal(handle.id, "wta_c", [1, 2]) is Delivery.CONSUMED
    assert client.signal(handle.id, "wta_a", "late a") is Delivery.NOT_STORED
    assert client.signal(handle.id, "wta_c", "late c") is Delivery.NOT_STORED
    with pytest.raises(SignalNotDeliverable):
        client.signal(handle.id, "wta_d", 1)
    start_worker(wta_echo)
    assert handle.result(timeout=10) == {"name": "wta_c", "payload": [1, 2]}
    rows = client.signals_of(handle.id)
    assert [(r["name"], r["consumed_by"]) for r in rows] == [("wta_c", "wta_any3_wait")]


# -- timeouts ----------------------------------------------------------------------------------


@workflow(name="wta_any_timeout")
def wta_any_timeout(x):  # type: ignore[no-untyped-def]
    got = wait_any(["wta_at_yes", "wta_at_no"], timeout=HOUR)
    return wta_echo(got)


def test_a_wait_any_timeout_fails_the_run_at_the_wait(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    start_worker(wta_echo, wta_sentinel, scan_interval=0.05)
    handle = client.submit(wta_any_timeout, 0)
    _scanned(client)
    assert handle.get().step("any_wta_at_yes_wta_at_no").state is StepState.WAITING_SIGNAL
    _later(clock, 2 * HOUR)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=15)
    assert failed.value.node == "any_wta_at_yes_wta_at_no"
    assert failed.value.error_kind == "signal_timeout"
    wait = handle.get().step("any_wta_at_yes_wta_at_no")
    assert wait.state is StepState.DISCARDED and wait.error_kind == "signal_timeout"
    assert "wta_at_yes" in (wait.error or "") and "wta_at_no" in (wait.error or "")
    assert handle.get().step("wta_echo").state is StepState.CANCELLED
    with pytest.raises(AlreadyTerminal):
        client.signal(handle.id, "wta_at_yes", 1)


@workflow(name="wta_n_mixed")
def wta_n_mixed(x):  # type: ignore[no-untyped-def]
    got = wait_n("wta_nm_sig", 2, timeout=HOUR)
    wta_echo(got, on_dep_failure="cancel_branch")
    wta_after(got)
    return wta_pair(x, x)


def test_a_timed_out_quorum_with_one_dependent_that_does_not_contain_it_fails_the_run(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    start_worker(wta_echo, wta_after, wta_pair, wta_sentinel, scan_interval=0.05)
    handle = client.submit(wta_n_mixed, 0)
    assert client.signal(handle.id, "wta_nm_sig", "only") is Delivery.CONSUMED
    _later(clock, 2 * HOUR)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=15)
    assert (failed.value.node, failed.value.error_kind) == ("wta_nm_sig", "signal_timeout")
    run = handle.get()
    assert run.state is RunState.FAILED
    assert run.step("wta_echo").state is StepState.CANCELLED
    assert run.step("wta_after").state is StepState.CANCELLED
    assert CALLS["echo"] == 0 and CALLS["after"] == 0


@workflow(name="wta_n_paused_timeout")
def wta_n_paused_timeout(x):  # type: ignore[no-untyped-def]
    return wta_echo(wait_n("wta_npt_sig", 2, timeout=HOUR))


def test_a_quorum_timeout_stands_still_while_paused_and_the_quorum_completes_after_resume(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    start_worker(wta_echo, wta_sentinel, scan_interval=0.05)
    handle = client.submit(wta_n_paused_timeout, 0)
    assert client.signal(handle.id, "wta_npt_sig", "first") is Delivery.CONSUMED
    due = handle.get().step("wta_npt_sig").scheduled_at
    client.pause(handle.id)
    _later(clock, 2 * HOUR)
    _scanned(client)
    wait = handle.get().step("wta_npt_sig")
    assert (wait.state, wait.output) == (StepState.WAITING_SIGNAL, ["first"])
    client.resume(handle.id)
    assert handle.get().step("wta_npt_sig").scheduled_at - due >= 2 * HOUR
    _scanned(client)
    assert handle.get().step("wta_npt_sig").state is StepState.WAITING_SIGNAL
    assert client.signal(handle.id, "wta_npt_sig", "second") is Delivery.CONSUMED
    assert handle.result(timeout=10) == ["first", "second"]


# -- timers ------------------------------------------------------------------------------------


@workflow(name="wta_hour")
def wta_hour(x):  # type: ignore[no-untyped-def]
    t = wait_timer(HOUR).named("wta_hour_timer")
    return wta_after(wta_echo(x, after=[t]))


def test_a_timer_fires_when_the_clock_passes_it_and_not_before(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    start_worker(wta_echo, wta_after, wta_sentinel, scan_interval=0.05)
    handle = client.submit(wta_hour, 7)
    _later(clock, HOUR - timedelta(minutes=1))
    _scanned(client)
    timer = handle.get().step("wta_hour_timer")
    assert timer.state is StepState.WAITING_TIMER
    _later(clock, timedelta(minutes=2))
    assert handle.result(timeout=10) == {"after": 7}
    timer = handle.get().step("wta_hour_timer")
    assert (timer.state, timer.output) == (StepState.COMPLETED, None)


def test_a_paused_timer_does_not_fire_and_resume_moves_it_by_the_pause(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    start_worker(wta_echo, wta_after, wta_sentinel, scan_interval=0.05)
    handle = client.submit(wta_hour, 1)
    due = handle.get().step("wta_hour_timer").scheduled_at
    client.pause(handle.id)
    _later(clock, 3 * HOUR)
    _scanned(client)
    assert handle.get().step("wta_hour_timer").state is StepState.WAITING_TIMER
    client.resume(handle.id)
    moved = handle.get().step("wta_hour_timer").scheduled_at
    assert moved - due >= 3 * HOUR
    _scanned(client)
    assert handle.get().step("wta_hour_timer").state is StepState.WAITING_TIMER
    _later(clock, 2 * HOUR)
    assert handle.result(timeout=10) == {"after": 1}


def test_an_operator_retry_of_a_cancelled_timer_waits_its_full_duration_again(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    start_worker(wta_echo, wta_after, wta_sentinel, scan_interval=0.05)
    handle = client.submit(wta_hour, 2)
    _later(clock, timedelta(minutes=40))
    client.cancel(handle.id)
    assert handle.get().step("wta_hour_timer").state is StepState.CANCELLED
    client.retry(handle.id, "wta_hour_timer")
    timer = handle.get().step("wta_hour_timer")
    assert timer.state is StepState.WAITING_TIMER
    _later(clock, timedelta(minutes=40))  # past the first due time, not the new one
    _scanned(client)
    assert handle.get().step("wta_hour_timer").state is StepState.WAITING_TIMER
    _later(clock, timedelta(minutes=30))
    assert handle.result(timeout=10) == {"after": 2}


def test_a_replayed_timer_waits_again_and_its_downstream_runs_again(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    start_worker(wta_echo, wta_after, wta_sentinel, scan_interval=0.05)
    handle = client.submit(wta_hour, 3)
    _later(clock, 2 * HOUR)
    assert handle.result(timeout=10) == {"after": 3}
    client.retry(handle.id, "wta_hour_timer", force=True)
    run = handle.get()
    assert run.state is RunState.RUNNING
    assert run.step("wta_hour_timer").state is StepState.WAITING_TIMER
    assert run.step("wta_after").state is StepState.PENDING
    _scanned(client)
    assert handle.get().step("wta_hour_timer").state is StepState.WAITING_TIMER
    _later(clock, 2 * HOUR)
    assert handle.result(timeout=10) == {"after": 3}
    assert (CALLS["echo"], CALLS["after"]) == (2, 2)


def test_a_fork_downstream_of_a_timer_copies_it_and_a_fork_from_it_waits_again(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    start_worker(wta_echo, wta_after, wta_sentinel, scan_interval=0.05)
    handle = client.submit(wta_hour, 4)
    _later(clock, 2 * HOUR)
    assert handle.result(timeout=10) == {"after": 4}
    downstream = client.fork(handle.id, "wta_echo", input=5)
    assert downstream.result(timeout=10) == {"after": 5}
    assert downstream.get().step("wta_hour_timer").copied
    again = client.fork(handle.id, "wta_hour_timer")
    assert again.get().step("wta_hour_timer").state is StepState.WAITING_TIMER
    _scanned(client)
    assert again.get().state is RunState.RUNNING
    _later(clock, 2 * HOUR)
    assert again.result(timeout=10) == {"after": 4}


def test_positive_durations_below_a_microsecond_are_refused_at_build() -> None:
    def timer_body(x):  # type: ignore[no-untyped-def]
        return wta_echo(x, after=[wait_timer(1e-7)])

    def timeout_body(x):  # type: ignore[no-untyped-def]
        return wta_echo(wait_n("wta_tiny_sig", 2, timeout=1e-7))

    for name, body in (("wta_tiny_timer", timer_body), ("wta_tiny_timeout", timeout_body)):
        with pytest.raises(InvalidGraph):
            workflow(name=name)(body).graph  # noqa: B018 - building the graph is the point


# -- child runs ----------------------------------------------------------------------------------


@workflow(name="wta_kid_timer")
def wta_kid_timer(x):  # type: ignore[no-untyped-def]
    t = wait_timer(HOUR / 2).named("wta_kid_t")
    return wta_echo(x, after=[t])


@workflow(name="wta_fan_timers")
def wta_fan_timers(n):  # type: ignore[no-untyped-def]
    return for_each(wta_kid_timer, over=wta_items(n))


def test_timers_of_fan_out_child_runs_stand_still_while_the_parent_is_paused(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    start_worker(
        wta_echo, wta_items, wta_fan_timers, wta_kid_timer, wta_sentinel, scan_interval=0.05
    )
    handle = client.submit(wta_fan_timers, 2)
    kids = wait_until(
        lambda: (k := client.children_of(handle.id)) and len(k) == 2 and k, what="2 child runs"
    )
    ids = [k["id"] for k in kids]
    client.pause(handle.id)
    assert all(client.get_run(i).state is RunState.PAUSED for i in ids)
    _later(clock, 2 * HOUR)
    _scanned(client)
    assert all(client.get_run(i).step("wta_kid_t").state is StepState.WAITING_TIMER for i in ids)
    client.resume(handle.id)
    assert all(client.get_run(i).state is RunState.RUNNING for i in ids)
    _scanned(client)
    assert all(client.get_run(i).step("wta_kid_t").state is StepState.WAITING_TIMER for i in ids)
    _later(clock, 2 * HOUR)
    assert handle.result(timeout=15) == [0, 1]


@workflow(name="wta_parent_of_timer")
def wta_parent_of_timer(x):  # type: ignore[no-untyped-def]
    return child(wta_kid_timer, x)


def test_cancelling_the_parent_cancels_a_child_run_waiting_on_its_timer(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    start_worker(wta_echo, wta_kid_timer, wta_parent_of_timer, wta_sentinel, scan_interval=0.05)
    handle = client.submit(wta_parent_of_timer, 0)
    (kid,) = wait_until(lambda: client.children_of(handle.id), what="the child run")
    client.cancel(handle.id)
    _later(clock, 2 * HOUR)
    _scanned(client)
    run = client.get_run(kid["id"])
    assert run.state is RunState.CANCELLED
    assert run.step("wta_kid_t").state is StepState.CANCELLED
    assert run.step("wta_echo").state is StepState.CANCELLED
    assert CALLS["echo"] == 0


@workflow(name="wta_kid_any")
def wta_kid_any(x):  # type: ignore[no-untyped-def]
    return wait_any(["wta_k_vote", "wta_k_veto"])


@workflow(name="wta_parent_deadline")
def wta_parent_deadline(x):  # type: ignore[no-untyped-def]
    return child(wta_kid_timer, x)


def test_a_parent_deadline_beats_a_child_timer_that_was_due_first(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    """No worker across both times (the child's 30-minute timer, then the parent's 1-hour
    deadline): the deadline wins, the timer does not fire and nothing after it runs."""
    handle = client.submit(wta_parent_deadline, 0, deadline=HOUR)
    (kid,) = wait_until(lambda: client.children_of(handle.id), what="the child run")
    timer = client.get_run(kid["id"]).step("wta_kid_t")
    assert timer.scheduled_at < handle.get().deadline_at  # type: ignore[operator]
    _later(clock, 3 * HOUR)
    start_worker(wta_echo, wta_kid_timer, wta_parent_deadline, scan_interval=0.05)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=15)
    assert failed.value.error_kind == "deadline"
    run = client.get_run(kid["id"])
    assert run.state is RunState.CANCELLED
    assert run.step("wta_kid_t").state is StepState.CANCELLED
    assert run.step("wta_echo").state is StepState.CANCELLED
    assert CALLS["echo"] == 0


@workflow(name="wta_kid_any_timeout")
def wta_kid_any_timeout(x):  # type: ignore[no-untyped-def]
    return wta_echo(wait_any(["wta_kt_yes", "wta_kt_no"], timeout=HOUR).named("wta_kt"))


@workflow(name="wta_parent_any_timeout")
def wta_parent_any_timeout(x):  # type: ignore[no-untyped-def]
    return wta_after(child(wta_kid_any_timeout, x).named("wta_kt_child"))


def test_a_child_wait_any_timeout_fails_the_parent_and_its_retry_waits_afresh(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    start_worker(
        wta_echo,
        wta_after,
        wta_kid_any_timeout,
        wta_parent_any_timeout,
        wta_sentinel,
        scan_interval=0.05,
    )
    handle = client.submit(wta_parent_any_timeout, 0)
    (kid,) = wait_until(lambda: client.children_of(handle.id), what="the child run")
    _later(clock, 2 * HOUR)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=15)
    assert (failed.value.node, failed.value.error_kind) == ("wta_kt_child", "child_failed")
    assert client.get_run(kid["id"]).step("wta_kt").error_kind == "signal_timeout"
    with pytest.raises(AlreadyTerminal):
        client.signal(kid["id"], "wta_kt_no", "too late")
    client.retry(handle.id, "wta_kt_child")  # retries the child run: a fresh timeout
    assert client.get_run(kid["id"]).step("wta_kt").state is StepState.WAITING_SIGNAL
    _later(clock, HOUR / 2)
    _scanned(client)
    assert client.get_run(kid["id"]).step("wta_kt").state is StepState.WAITING_SIGNAL
    with pytest.raises(SignalNotDeliverable):
        client.signal(handle.id, "wta_kt_no", "to the parent")
    assert client.signal(kid["id"], "wta_kt_no", "no") is Delivery.CONSUMED
    assert handle.result(timeout=10) == {"after": {"name": "wta_kt_no", "payload": "no"}}
    assert [r["payload"] for r in client.signals_of(kid["id"])] == ["no"]


@workflow(name="wta_parent_votes")
def wta_parent_votes(x):  # type: ignore[no-untyped-def]
    mine = wait_n("wta_k_vote", 2).named("wta_votes")
    theirs = child(wta_kid_any, x)
    return wta_pair(mine, theirs)


def test_a_parent_quorum_and_a_child_wait_any_on_one_name_each_count_their_own(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(wta_pair, wta_kid_any, wta_parent_votes)
    handle = client.submit(wta_parent_votes, 0)
    (kid,) = wait_until(lambda: client.children_of(handle.id), what="the child run")
    wait_until(
        lambda: (
            client.get_run(kid["id"]).step("any_wta_k_vote_wta_k_veto").state
            is StepState.WAITING_SIGNAL
        ),
        what="the child's wait",
    )
    with pytest.raises(SignalNotDeliverable):
        client.signal(handle.id, "wta_k_veto", "to the parent")
    assert client.signal(handle.id, "wta_k_vote", "p1") is Delivery.CONSUMED
    assert client.signal(kid["id"], "wta_k_vote", "k1") is Delivery.CONSUMED
    wait_until(lambda: client.get_run(kid["id"]).state is RunState.COMPLETED, what="the child")
    with pytest.raises(AlreadyTerminal):  # its wait_any was its last node
        client.signal(kid["id"], "wta_k_veto", "k2")
    assert handle.get().step("wta_votes").output == ["p1"]
    assert client.signal(handle.id, "wta_k_vote", "p2") is Delivery.CONSUMED
    assert handle.result(timeout=10) == [["p1", "p2"], {"name": "wta_k_vote", "payload": "k1"}]


# -- replay and fork of waits ------------------------------------------------------------------


@workflow(name="wta_replay_quorum")
def wta_replay_quorum(x):  # type: ignore[no-untyped-def]
    first = wta_echo(x)
    return wta_after(wait_n("wta_rq_sig", 2, after=[first]))


def test_replaying_upstream_of_a_quorum_buffers_new_signals_and_ignores_the_old(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker(wta_echo, wta_after)
    handle = client.submit(wta_replay_quorum, 0)
    wait_until(
        lambda: handle.get().step("wta_rq_sig").state is StepState.WAITING_SIGNAL, what="the wait"
    )
    client.signal(handle.id, "wta_rq_sig", "old1")
    client.signal(handle.id, "wta_rq_sig", "old2")
    assert handle.result(timeout=10) == {"after": ["old1", "old2"]}
    worker.stop()
    client.retry(handle.id, "wta_echo", force=True)
    assert handle.get().step("wta_rq_sig").state is StepState.PENDING
    assert client.signal(handle.id, "wta_rq_sig", "new1") is Delivery.BUFFERED
    assert client.signal(handle.id, "wta_rq_sig", "new2") is Delivery.BUFFERED
    with pytest.raises(MailboxFull):
        client.signal(handle.id, "wta_rq_sig", "new3")
    start_worker(wta_echo, wta_after)
    assert handle.result(timeout=10) == {"after": ["new1", "new2"]}
    rows = client.signals_of(handle.id)
    assert [r["payload"] for r in rows] == ["old1", "old2", "new1", "new2"]
    assert all(r["consumed_by"] == "wta_rq_sig" for r in rows)


def test_a_replayed_wait_any_waits_for_a_new_winner(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(wta_echo)
    handle = client.submit(wta_any3, 0)
    client.signal(handle.id, "wta_a", "first")
    assert handle.result(timeout=10) == {"name": "wta_a", "payload": "first"}
    client.retry(handle.id, "wta_any3_wait", force=True)
    wait = handle.get().step("wta_any3_wait")
    assert (wait.state, wait.output) == (StepState.WAITING_SIGNAL, None)
    assert client.signal(handle.id, "wta_b", "second") is Delivery.CONSUMED
    assert handle.result(timeout=10) == {"name": "wta_b", "payload": "second"}


def test_a_fork_from_a_quorum_waits_in_the_fork_only(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(wta_echo)
    handle = client.submit(wta_n3, 0)
    for v in "abc":
        client.signal(handle.id, "wta_n3_sig", v)
    assert handle.result(timeout=10) == ["a", "b", "c"]
    fork = client.fork(handle.id, "wta_n3_sig")
    wait = fork.get().step("wta_n3_sig")
    assert (wait.state, wait.output, wait.copied) == (StepState.WAITING_SIGNAL, None, False)
    assert client.signals_of(fork.id) == []
    with pytest.raises(AlreadyTerminal):
        client.signal(handle.id, "wta_n3_sig", "to the source")
    for v in "xyz":
        assert client.signal(fork.id, "wta_n3_sig", v) is Delivery.CONSUMED
    assert fork.result(timeout=10) == ["x", "y", "z"]
    assert [r["payload"] for r in client.signals_of(handle.id)] == ["a", "b", "c"]


# -- findings ------------------------------------------------------------------------------------


@pytest.mark.parametrize("names", [None, 5], ids=["none", "int"])
def test_wait_any_of_something_that_is_not_a_list_is_refused_with_invalid_graph(
    names: object,
) -> None:
    def body(x):  # type: ignore[no-untyped-def]
        return wta_echo(wait_any(names))  # type: ignore[arg-type]

    with pytest.raises(InvalidGraph):
        workflow(name=f"wta_any_not_list_{names}")(body).graph  # noqa: B018


@workflow(name="wta_n_none")
def wta_n_none(x):  # type: ignore[no-untyped-def]
    return wta_echo(wait_n("wta_nn_sig", None))  # type: ignore[arg-type]


def test_wait_n_without_a_count_is_refused() -> None:
    """It was accepted as a wait_signal: its output the bare payload, not a list."""
    with pytest.raises(InvalidGraph, match="needs a count"):
        wta_n_none.graph  # noqa: B018


WTA_SET_NAMES = [f"wta_set_{i}" for i in range(8)]


def test_wait_any_over_a_set_is_refused_or_does_not_depend_on_its_order() -> None:
    def in_order(x):  # type: ignore[no-untyped-def]
        return wta_echo(wait_any(WTA_SET_NAMES))

    def as_set(x):  # type: ignore[no-untyped-def]
        return wta_echo(wait_any(set(WTA_SET_NAMES)))  # type: ignore[arg-type]

    """A set's order (so the node id and def_version) followed the hash seed: processes
    disagreed on the definition. Unordered collections are refused; lists keep theirs."""
    listed = workflow(name="wta_set_listed")(in_order)
    assert listed.graph.nodes  # a list is fine
    unordered = workflow(name="wta_set_unordered")(as_set)
    with pytest.raises(InvalidGraph, match="a list"):
        unordered.graph  # noqa: B018


def test_a_timed_out_partial_quorum_does_not_claim_that_no_signal_arrived(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    start_worker(wta_echo, wta_sentinel, scan_interval=0.05)
    handle = client.submit(wta_n_paused_timeout, 0)
    assert client.signal(handle.id, "wta_npt_sig", "one") is Delivery.CONSUMED
    _later(clock, 2 * HOUR)
    with pytest.raises(RunFailed):
        handle.result(timeout=15)
    wait = handle.get().step("wta_npt_sig")
    assert (wait.state, wait.error_kind, wait.output) == (
        StepState.DISCARDED,
        "signal_timeout",
        ["one"],
    )
    assert (wait.error or "").startswith("only 1 of 2 signals 'wta_npt_sig' arrived"), wait.error


# -- a timeout or a timer that came due while no scanner looked ---------------------------------
# The same rule as a run's deadline: what came due first wins, however late the scanner is.


@workflow(name="wta_any_late")
def wta_any_late(x):  # type: ignore[no-untyped-def]
    return wta_echo(wait_any(["wta_yes", "wta_no"], timeout=HOUR))


@pytest.mark.parametrize("kind", ["wait_n", "wait_any"])
def test_a_signal_after_its_waits_timeout_is_not_consumed_though_no_scanner_came(
    client: Client, clock: Clock, kind: str
) -> None:
    """No worker runs here. The wait's timeout passed first: the call records it there and
    then, as the scanner would have, and meets the run that leaves: failed (the timeout is
    not contained), so the signal is refused as to any ended run, and not stored."""
    workflow_, name = (
        (wta_n_paused_timeout, "wta_npt_sig") if kind == "wait_n" else (wta_any_late, "wta_yes")
    )
    handle = client.submit(workflow_, 0)
    node = handle.get().steps[0].node
    if kind == "wait_n":
        assert client.signal(handle.id, name, "one") is Delivery.CONSUMED
    _later(clock, 2 * HOUR)
    with pytest.raises(AlreadyTerminal):
        client.signal(handle.id, name, "late")
    run = handle.get()
    wait = run.step(node)
    assert (run.state, wait.state, wait.error_kind) == (
        RunState.FAILED,
        StepState.DISCARDED,
        "signal_timeout",
    )
    assert wait.output == (["one"] if kind == "wait_n" else None)
    assert [s["payload"] for s in client.signals_of(handle.id)] == (
        ["one"] if kind == "wait_n" else []
    )


@workflow(name="wta_contained_late")
def wta_contained_late(x):  # type: ignore[no-untyped-def]
    got = wait_n("wta_cl_sig", 2, timeout=HOUR)
    wta_echo(got, on_dep_failure="cancel_branch")
    return wta_after(wait_signal("wta_cl_end"))


def test_a_pause_after_a_signal_timeout_passed_meets_the_run_a_prompt_scanner_left(
    client: Client, clock: Clock
) -> None:
    """No worker runs here. The timeout came due while no scanner looked: the pause applies
    it first. Not contained, it failed the run, which the pause then refuses; contained,
    the branch is cancelled, the run is paused, and a signal for the timed-out wait is not
    stored."""
    failing = client.submit(wta_n_paused_timeout, 0)
    contained = client.submit(wta_contained_late, 0)
    _later(clock, 2 * HOUR)
    with pytest.raises(AlreadyTerminal):
        client.pause(failing.id)
    assert failing.get().step("wta_npt_sig").error_kind == "signal_timeout"
    client.pause(contained.id)
    run = contained.get()
    assert (run.state, run.step("wta_cl_sig").error_kind) == (RunState.PAUSED, "signal_timeout")
    assert run.step("wta_echo").state is StepState.CANCELLED
    assert client.signal(contained.id, "wta_cl_sig", "while paused") is Delivery.NOT_STORED


def test_a_timer_due_before_a_pause_fires_at_the_resume_not_a_pause_later(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    handle = client.submit(wta_hour, 3)
    due = handle.get().step("wta_hour_timer").scheduled_at
    _later(clock, 2 * HOUR)  # due; no scanner has fired it
    client.pause(handle.id)
    _later(clock, 3 * HOUR)
    client.resume(handle.id)
    assert handle.get().step("wta_hour_timer").scheduled_at == due
    start_worker(wta_echo, wta_after, wta_sentinel, scan_interval=0.05)
    assert handle.result(timeout=15) == {"after": 3}


def test_a_signal_while_paused_past_the_waits_timeout_is_taken_the_clock_stood_still(
    client: Client, clock: Clock
) -> None:
    """The run was paused before its wait's timeout: the timeout's clock stands still while
    paused, so a signal sent when the timeout would have passed is still in time."""
    handle = client.submit(wta_n_paused_timeout, 0)
    client.pause(handle.id)
    _later(clock, 2 * HOUR)
    assert client.signal(handle.id, "wta_npt_sig", "while paused") is Delivery.CONSUMED
    wait = handle.get().step("wta_npt_sig")
    assert (wait.state, wait.output) == (StepState.WAITING_SIGNAL, ["while paused"])
