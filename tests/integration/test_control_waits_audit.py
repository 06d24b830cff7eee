"""Audit: run control (pause, resume, cancel, retry, deadlines) crossed with waits,
timers and retried steps, through the public API. Time is moved with the ``clock``
fixture, never waited out."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from cyclone_dsl import (
    AlreadyTerminal,
    Client,
    Delivery,
    InvalidTransition,
    MailboxFull,
    NoOutput,
    RunFailed,
    RunFilter,
    RunState,
    StepContext,
    StepState,
    Worker,
    define_result,
    step,
    wait_any,
    wait_n,
    wait_signal,
    wait_timer,
    workflow,
)
from cyclone_dsl.testing import set_clock_shift
from tests.waiting import scanner_passes, wait_until

HOUR = timedelta(hours=1)
CALLS: Counter[str] = Counter()
_lock = threading.Lock()
GATES: dict[str, threading.Event] = {}
FAIL: dict[str, bool] = {}

Clock = Callable[[timedelta], None]


def gate(name: str) -> threading.Event:
    return GATES.setdefault(name, threading.Event())


def count(tag: str) -> None:
    with _lock:
        CALLS[tag] += 1


@pytest.fixture(autouse=True)
def _fresh(start_worker: Callable[..., Worker]) -> Iterator[None]:
    CALLS.clear()
    GATES.clear()
    FAIL.clear()
    yield
    set_clock_shift(timedelta(0))
    for event in list(GATES.values()):
        event.set()


class Later:
    """Cumulative moves of the database clock."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.shift = timedelta(0)

    def __call__(self, by: timedelta) -> None:
        self.shift += by
        self.clock(self.shift)


@pytest.fixture
def later(clock: Clock) -> Later:
    return Later(clock)


# -- steps ------------------------------------------------------------------------------------


@step(name="xcw_echo")
def xcw_echo(value: object) -> object:
    count("echo")
    return value


@step(name="xcw_pair")
def xcw_pair(a: object, b: object) -> object:
    count("pair")
    return [a, b]


@step(name="xcw_hold")
def xcw_hold(value: object) -> object:
    count("hold")
    gate("hold").wait(15)
    return value


@step(name="xcw_flaky", max_attempts=1)
def xcw_flaky(value: object) -> object:
    """Fails for good while FAIL["flaky"] is set (after its gate opens)."""
    count("flaky")
    gate("flaky").wait(15)
    if FAIL.get("flaky", True):
        raise RuntimeError("xcw flaky fails")
    return value


@step(name="xcw_backoff", max_attempts=3)
def xcw_backoff(value: int, ctx: StepContext) -> int:
    count(f"backoff:{ctx.attempt}")
    if ctx.attempt == 1:
        raise RuntimeError("xcw first attempt fails")
    return value + 1


ALL = (xcw_echo, xcw_pair, xcw_hold, xcw_flaky, xcw_backoff)

# -- workflows --------------------------------------------------------------------------------


@workflow(name="xcw_timer")
def xcw_timer(x):  # type: ignore[no-untyped-def]
    t = wait_timer(HOUR)
    return xcw_echo(x, after=[t])


@workflow(name="xcw_last_wait")
def xcw_last_wait(x):  # type: ignore[no-untyped-def]
    first = xcw_echo(x)
    got = wait_signal("xcw_last", after=[first])
    define_result(got)


@workflow(name="xcw_last_quorum")
def xcw_last_quorum(x):  # type: ignore[no-untyped-def]
    return wait_n("xcw_q", 2, timeout=HOUR)


@workflow(name="xcw_contained_timeout")
def xcw_contained_timeout(x):  # type: ignore[no-untyped-def]
    ok = wait_signal("xcw_ok", timeout=HOUR)
    xcw_echo(ok, on_dep_failure="cancel_branch")
    t = wait_timer(2 * HOUR)
    return xcw_pair(x, t)


@workflow(name="xcw_fail_with_quorum")
def xcw_fail_with_quorum(x):  # type: ignore[no-untyped-def]
    votes = wait_n("xcw_vote", 2)
    done = xcw_flaky(x)
    t = wait_timer(HOUR)
    both = xcw_pair(votes, done)
    return xcw_pair(both, t)


@workflow(name="xcw_buffer_then_fail")
def xcw_buffer_then_fail(x):  # type: ignore[no-untyped-def]
    done = xcw_flaky(x)
    got = wait_signal("xcw_buf", after=[done])
    return xcw_pair(done, got)


@workflow(name="xcw_any_timer")
def xcw_any_timer(x):  # type: ignore[no-untyped-def]
    choice = wait_any(["xcw_yes", "xcw_no"])
    t = wait_timer(HOUR)
    return xcw_pair(choice, t)


@workflow(name="xcw_signal_only")
def xcw_signal_only(x):  # type: ignore[no-untyped-def]
    return xcw_echo(wait_signal("xcw_go"))


@workflow(name="xcw_hold_then_quorum")
def xcw_hold_then_quorum(x):  # type: ignore[no-untyped-def]
    h = xcw_hold(x)
    return xcw_echo(wait_n("xcw_hq", 3, after=[h]))


@workflow(name="xcw_backoff_wf")
def xcw_backoff_wf(x):  # type: ignore[no-untyped-def]
    return xcw_echo(xcw_backoff(x))


@workflow(name="xcw_timeout_any")
def xcw_timeout_any(x):  # type: ignore[no-untyped-def]
    choice = wait_any(["xcw_ta", "xcw_tb"], timeout=HOUR)
    xcw_echo(choice, on_dep_failure="cancel_branch")
    return xcw_pair(x, wait_signal("xcw_tend"))


@workflow(name="xcw_two_timers")
def xcw_two_timers(x):  # type: ignore[no-untyped-def]
    a = wait_timer(HOUR).named("xcw_t1")
    b = wait_timer(3 * HOUR).named("xcw_t2")
    return xcw_pair(xcw_echo(x, after=[a]), xcw_echo(x, after=[b]).named("xcw_e2"))


# -- scenarios --------------------------------------------------------------------------------


def test_timer_and_deadline_both_passed_while_paused_resume_then_timer_completes_in_time(
    client: Client, later: Later, start_worker: Callable[..., Worker]
) -> None:
    """Deadline 2 h, timer 1 h. Paused at once; 3 h pass. Both clocks stood still: after the
    resume the timer fires an hour later and the run completes (its deadline is 2 h away)."""
    worker = start_worker(*ALL)
    handle = client.submit(xcw_timer, 5, deadline=2 * HOUR)
    client.pause(handle.id)
    later(3 * HOUR)
    scanner_passes(worker)
    assert handle.get().state is RunState.PAUSED
    client.resume(handle.id)
    scanner_passes(worker)
    run = handle.get()
    assert run.state is RunState.RUNNING
    assert run.step("timer").state is StepState.WAITING_TIMER
    later(timedelta(minutes=90))  # past the moved timer, before the moved deadline
    assert handle.result(timeout=20) == 5
    assert CALLS["echo"] == 1


def test_a_signal_to_a_paused_run_past_its_nominal_deadline_is_taken(
    client: Client, later: Later
) -> None:
    """The deadline's clock stops while paused: a signal sent when the deadline would have
    passed is in time; the run completes (while paused), with the payload as result."""
    handle = client.submit(xcw_last_quorum, 0, deadline=HOUR)
    client.pause(handle.id)
    later(2 * HOUR)
    assert client.signal(handle.id, "xcw_q", "a") is Delivery.CONSUMED
    assert client.signal(handle.id, "xcw_q", "b") is Delivery.CONSUMED
    run = handle.wait(timeout=20)
    assert run.state is RunState.COMPLETED
    assert run.paused_at is not None
    assert handle.result(timeout=5) == ["a", "b"]


def test_the_last_wait_of_a_paused_run_completes_it_on_a_signal(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL)
    handle = client.submit(xcw_last_wait, 1)
    wait_until(
        lambda: handle.get().step("xcw_last").state is StepState.WAITING_SIGNAL,
        what="the wait to activate",
    )
    client.pause(handle.id)
    assert client.signal(handle.id, "xcw_last", {"v": 2}) is Delivery.CONSUMED
    run = handle.wait(timeout=20)
    assert run.state is RunState.COMPLETED
    assert handle.result(timeout=5) == {"v": 2}
    with pytest.raises(AlreadyTerminal):
        client.resume(handle.id)


def test_a_signal_timeout_due_before_the_pause_fails_at_the_resume_and_the_signal_is_dropped(
    client: Client, later: Later, start_worker: Callable[..., Worker]
) -> None:
    handle = client.submit(xcw_contained_timeout, 4)
    later(timedelta(minutes=90))  # the 1 h timeout passed; no scanner runs yet
    # The pause first applies what came due: the wait fails, its branch is cancelled.
    client.pause(handle.id)
    run = handle.get()
    assert run.state is RunState.PAUSED
    assert run.step("xcw_ok").error_kind == "signal_timeout"
    assert client.signal(handle.id, "xcw_ok", "late") is Delivery.NOT_STORED
    later(timedelta(hours=5))
    client.resume(handle.id)
    run = handle.get()
    # The 2 h timer was not due at the pause (30 min left): moved by the pause.
    assert run.step("timer").state is StepState.WAITING_TIMER
    worker = start_worker(*ALL)
    scanner_passes(worker)
    assert handle.get().step("timer").state is StepState.WAITING_TIMER
    later(timedelta(minutes=40))
    assert handle.result(timeout=20) == [4, None]
    assert client.signals_of(handle.id) == [] or all(
        s["payload"] != "late" for s in client.signals_of(handle.id)
    )


def test_a_wait_any_timeout_stands_still_while_paused_and_takes_one_signal(
    client: Client, later: Later, start_worker: Callable[..., Worker]
) -> None:
    """Paused 30 min into a 1 h wait_any timeout; 3 h pass; a signal is still in time, the
    second name is then not stored, and the rest of the run completes after the resume."""
    handle = client.submit(xcw_timeout_any, 1)
    later(timedelta(minutes=30))
    client.pause(handle.id)
    later(timedelta(hours=3))
    assert client.signal(handle.id, "xcw_tb", "b") is Delivery.CONSUMED
    assert client.signal(handle.id, "xcw_ta", "a") is Delivery.NOT_STORED
    client.resume(handle.id)
    start_worker(*ALL)
    assert client.signal(handle.id, "xcw_tend", "end") is Delivery.CONSUMED
    assert handle.result(timeout=20) == [1, "end"]
    run = handle.get()
    assert run.step("xcw_echo").output == {"name": "xcw_tb", "payload": "b"}


def test_retry_of_a_run_failed_while_a_quorum_was_partial_restarts_the_quorum(
    client: Client, later: Later, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL)
    handle = client.submit(xcw_fail_with_quorum, 3)
    wait_until(
        lambda: handle.get().step("xcw_vote").state is StepState.WAITING_SIGNAL,
        what="the quorum to wait",
    )
    assert client.signal(handle.id, "xcw_vote", "old") is Delivery.CONSUMED
    gate("flaky").set()
    with pytest.raises(RunFailed):
        handle.result(timeout=20)
    run = handle.get()
    assert run.step("xcw_vote").state is StepState.CANCELLED
    assert run.step("timer").state is StepState.CANCELLED
    with pytest.raises(AlreadyTerminal):
        client.signal(handle.id, "xcw_vote", "to a failed run")
    later(2 * HOUR)
    FAIL["flaky"] = False
    client.retry(handle.id, "xcw_flaky")
    run = handle.get()
    assert run.state is RunState.RUNNING
    vote = run.step("xcw_vote")
    assert vote.state is StepState.WAITING_SIGNAL and vote.output is None
    assert run.step("timer").state is StepState.WAITING_TIMER
    assert client.signal(handle.id, "xcw_vote", "n1") is Delivery.CONSUMED
    assert client.signal(handle.id, "xcw_vote", "n2") is Delivery.CONSUMED
    wait_until(
        lambda: handle.get().step("xcw_pair").state is StepState.COMPLETED,
        what="the first pair",
    )
    assert handle.get().step("timer").state is StepState.WAITING_TIMER  # full hour again
    later(3 * HOUR + timedelta(minutes=1))
    assert handle.result(timeout=20) == [[["n1", "n2"], 3], None]


def test_a_signal_buffered_before_a_failure_is_consumed_after_the_retry(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL)
    handle = client.submit(xcw_buffer_then_fail, 7)
    wait_until(lambda: CALLS["flaky"] == 1, what="flaky to start")
    assert client.signal(handle.id, "xcw_buf", "early") is Delivery.BUFFERED
    with pytest.raises(MailboxFull):
        client.signal(handle.id, "xcw_buf", "second")
    gate("flaky").set()
    with pytest.raises(RunFailed):
        handle.result(timeout=20)
    FAIL["flaky"] = False
    client.retry(handle.id, "xcw_flaky")
    assert handle.result(timeout=20) == [7, "early"]
    assert [s["payload"] for s in client.signals_of(handle.id)] == ["early"]


def test_cancel_during_wait_any_and_a_timer_then_retry_the_cancelled_run(
    client: Client, later: Later, start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker(*ALL)
    handle = client.submit(xcw_any_timer, 0)
    later(timedelta(minutes=50))
    client.cancel(handle.id)
    run = handle.wait(timeout=20)
    assert run.state is RunState.CANCELLED
    with pytest.raises(RunFailed):
        handle.result(timeout=5)
    with pytest.raises(AlreadyTerminal):
        client.signal(handle.id, "xcw_yes", 1)
    later(timedelta(minutes=70))  # the original timer would be due now
    result = client.retry_many(RunFilter(workflows="xcw_any_timer", states=["cancelled"]))
    assert result.acted == 1
    run = handle.get()
    assert run.state is RunState.RUNNING
    assert run.step("any_xcw_yes_xcw_no").state is StepState.WAITING_SIGNAL
    assert run.step("timer").state is StepState.WAITING_TIMER
    scanner_passes(worker)
    assert handle.get().step("timer").state is StepState.WAITING_TIMER  # a full hour again
    assert client.signal(handle.id, "xcw_no", "nope") is Delivery.CONSUMED
    assert client.signal(handle.id, "xcw_yes", "late") is Delivery.NOT_STORED
    later(timedelta(minutes=70) + HOUR + timedelta(minutes=1))
    assert handle.result(timeout=20) == [{"name": "xcw_no", "payload": "nope"}, None]
    assert CALLS["pair"] == 1


def test_signals_to_a_quorum_across_a_pause_are_counted_once(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL)
    handle = client.submit(xcw_hold_then_quorum, 0)
    wait_until(lambda: CALLS["hold"] == 1, what="hold to start")
    assert client.signal(handle.id, "xcw_hq", 1) is Delivery.BUFFERED
    client.pause(handle.id)
    assert client.signal(handle.id, "xcw_hq", 2) is Delivery.BUFFERED
    gate("hold").set()
    wait_until(
        lambda: handle.get().step("xcw_hold").state is StepState.COMPLETED,
        what="hold to complete in the pause",
    )
    assert handle.get().step("xcw_hq").state is StepState.PAUSED
    assert client.signal(handle.id, "xcw_hq", 3) is Delivery.BUFFERED
    with pytest.raises(MailboxFull):
        client.signal(handle.id, "xcw_hq", 4)
    client.resume(handle.id)
    assert handle.result(timeout=20) == [1, 2, 3]
    with pytest.raises(AlreadyTerminal):
        client.signal(handle.id, "xcw_hq", 5)
    assert [s["payload"] for s in client.signals_of(handle.id)] == [1, 2, 3]


def test_pause_during_backoff_past_the_nominal_deadline_then_resume_completes(
    client: Client, later: Later, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL)
    handle = client.submit(xcw_backoff_wf, 1, deadline=HOUR)
    wait_until(lambda: CALLS["backoff:1"] == 1, what="first attempt")
    wait_until(lambda: handle.get().step("xcw_backoff").attempt == 1, what="the failure recorded")
    client.pause(handle.id)
    later(3 * HOUR)
    client.resume(handle.id)
    assert handle.result(timeout=20) == 2
    assert CALLS["backoff:2"] == 1


def test_cancel_a_paused_run_with_a_due_timer_then_retry_waits_afresh(
    client: Client, later: Later, start_worker: Callable[..., Worker]
) -> None:
    handle = client.submit(xcw_timer, 8)
    later(2 * HOUR)  # due, no scanner
    client.pause(handle.id)  # applies what came due first: the timer fires, echo paused
    run = handle.get()
    assert run.step("timer").state is StepState.COMPLETED
    assert run.step("xcw_echo").state is StepState.PAUSED
    client.cancel(handle.id)
    assert handle.get().state is RunState.CANCELLED
    client.retry(handle.id, "xcw_echo")
    start_worker(*ALL)
    assert handle.result(timeout=20) == 8
    assert CALLS["echo"] == 1


def test_two_timers_one_due_before_the_pause_one_after(
    client: Client, later: Later, start_worker: Callable[..., Worker]
) -> None:
    """No scanner before the pause. Timer 1 (1 h) is due at the pause (fired by the pause
    itself), timer 2 (3 h) is not: it is moved by the 10 h pause."""
    handle = client.submit(xcw_two_timers, 2)
    later(2 * HOUR)
    client.pause(handle.id)
    run = handle.get()
    assert run.step("xcw_t1").state is StepState.COMPLETED
    t2_due = run.step("xcw_t2").scheduled_at
    later(10 * HOUR)
    client.resume(handle.id)
    moved = handle.get().step("xcw_t2").scheduled_at
    assert timedelta(hours=10) <= moved - t2_due < timedelta(hours=10, minutes=1)
    worker = start_worker(*ALL)
    wait_until(
        lambda: handle.get().step("xcw_echo").state is StepState.COMPLETED,
        what="echo after timer 1",
    )
    scanner_passes(worker)
    assert handle.get().step("xcw_t2").state is StepState.WAITING_TIMER
    later(13 * HOUR + timedelta(minutes=1))
    assert handle.result(timeout=20) == [2, 2]


def test_pause_and_resume_racing_a_prompt_scanner_fire_each_timer_once(
    client: Client, later: Later, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL, scan_interval=0.02)
    handles = [client.submit(xcw_timer, i) for i in range(12)]
    later(2 * HOUR)  # every timer is due: the scanner and the pauses race for them

    def pause_resume(h: object) -> None:
        run_id = h.id  # type: ignore[attr-defined]
        try:
            client.pause(run_id)
            # a running echo may end the run inside the pause: the resume then meets it ended
            client.resume(run_id)
        except AlreadyTerminal:
            return

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(pause_resume, handles))
    assert [h.result(timeout=20) for h in handles] == list(range(12))
    assert CALLS["echo"] == 12


def test_resume_many_of_paused_runs_with_due_timers_fires_them(
    client: Client, later: Later, start_worker: Callable[..., Worker]
) -> None:
    handles = [client.submit(xcw_two_timers, i) for i in range(3)]
    for h in handles:
        client.pause(h.id)
    later(5 * HOUR)
    result = client.resume_many(RunFilter(workflows="xcw_two_timers"))
    assert result.acted == 3
    worker = start_worker(*ALL)
    scanner_passes(worker)
    for h in handles:
        assert h.get().step("xcw_t1").state is StepState.WAITING_TIMER
    later(8 * HOUR + timedelta(minutes=1))
    assert [h.result(timeout=20) for h in handles] == [[i, i] for i in range(3)]


def test_retry_of_a_contained_timeout_in_a_completed_run_with_a_paused_phase(
    client: Client, later: Later, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL)
    handle = client.submit(xcw_timeout_any, 6)
    later(2 * HOUR)
    assert client.signal(handle.id, "xcw_tend", "e") is Delivery.CONSUMED
    assert handle.result(timeout=20) == [6, "e"]
    run = handle.get()
    assert run.step("any_xcw_ta_xcw_tb").error_kind == "signal_timeout"
    client.retry(handle.id, "any_xcw_ta_xcw_tb")
    run = handle.get()
    assert run.state is RunState.RUNNING
    client.pause(handle.id)
    later(10 * HOUR)  # the fresh timeout's clock stands still
    assert client.signal(handle.id, "xcw_ta", "yes") is Delivery.CONSUMED
    client.resume(handle.id)
    run = handle.wait(timeout=20)
    assert run.state is RunState.COMPLETED
    assert run.step("xcw_echo").output == {"name": "xcw_ta", "payload": "yes"}
    assert handle.result(timeout=5) == [6, "e"]


def test_a_signal_to_a_run_reopened_by_retry_while_paused_is_refused_retry(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Retry of a paused run is refused; after the resume, the retried wait takes a signal."""
    handle = client.submit(xcw_timeout_any, 6)
    client.cancel(handle.id)
    with pytest.raises(AlreadyTerminal):
        client.pause(handle.id)
    client.retry(handle.id, "any_xcw_ta_xcw_tb")
    client.pause(handle.id)
    with pytest.raises(InvalidTransition):
        client.retry(handle.id, "any_xcw_ta_xcw_tb")
    assert client.signal(handle.id, "xcw_ta", 1) is Delivery.CONSUMED
    assert client.signal(handle.id, "xcw_tend", 2) is Delivery.CONSUMED
    client.resume(handle.id)
    start_worker(*ALL)
    assert handle.result(timeout=20) == [6, 2]


def test_a_contained_timeout_off_the_result_path_keeps_the_result_and_refuses_a_retry(
    client: Client, later: Later, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*ALL)

    handle = client.submit(xcw_contained_timeout, 9)
    later(3 * HOUR)
    run = handle.wait(timeout=20)
    assert run.state is RunState.COMPLETED
    assert handle.result(timeout=5) == [9, None]
    # The contained node is not the result: result stands; NoOutput only for a cut result.
    with pytest.raises((InvalidTransition, NoOutput)):
        client.retry(handle.id, "xcw_pair")


# -- races ---------------------------------------------------------------------------------------


@workflow(name="xcw_quorum5")
def xcw_quorum5(x):  # type: ignore[no-untyped-def]
    return xcw_echo(wait_n("xcw_q5", 5, timeout=HOUR))


@pytest.mark.parametrize("before_activation", [False, True])
def test_signals_racing_pause_and_resume_are_counted_exactly_once(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker], before_activation: bool
) -> None:
    start_worker(*ALL)
    wf = xcw_hold_then_quorum if before_activation else xcw_quorum5
    name, n = ("xcw_hq", 3) if before_activation else ("xcw_q5", 5)
    handle = client.submit(wf, 0)
    if before_activation:
        wait_until(lambda: CALLS["hold"] == 1, what="hold to start")
    else:
        wait_until(
            lambda: handle.get().step("xcw_q5").state is StepState.WAITING_SIGNAL,
            what="quorum waits",
        )
    stop = threading.Event()
    outcomes: list[tuple[int, str]] = []
    out_lock = threading.Lock()

    def toggler() -> None:
        with Client(cyclone_dsn) as own:
            while not stop.is_set():
                try:
                    own.pause(handle.id)
                    own.resume(handle.id)
                except (AlreadyTerminal, InvalidTransition):
                    return

    def sender(i: int) -> None:
        with Client(cyclone_dsn) as own:
            try:
                d = own.signal(handle.id, name, i)
                what = str(d)
            except MailboxFull:
                what = "full"
            except AlreadyTerminal:
                what = "terminal"
            with out_lock:
                outcomes.append((i, what))

    t = threading.Thread(target=toggler)
    t.start()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(sender, range(10)))
    stop.set()
    t.join(20)
    if handle.get().state is RunState.PAUSED:
        client.resume(handle.id)
    gate("hold").set()
    result = handle.result(timeout=20)
    accepted = sorted(i for i, what in outcomes if what in ("consumed", "buffered"))
    assert len(accepted) == n, outcomes
    assert sorted(result) == accepted  # type: ignore[arg-type]
    stored = [s["payload"] for s in client.signals_of(handle.id)]
    assert sorted(stored) == accepted
