"""Audit: several scanners at once (every worker's, and ``cyclone scan --once``) racing on
the same due work while clients act at the same moment: timers, signal timeouts,
deadlines, expired leases, step timeouts, schedules and retention. Every effect must
happen once and every run must end as docs/concepts/*.md and docs/guarantees.md say.
Time is moved with the ``clock`` fixture (this process's database clock), never waited
out. Every name is prefixed ``scr_``."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import pytest
from click.testing import CliRunner

from cyclone_dsl import (
    AlreadyTerminal,
    Client,
    Delivery,
    InvalidTransition,
    PassedDeadline,
    RunFailed,
    RunHandle,
    RunNotFound,
    RunState,
    StepContext,
    StepState,
    Worker,
    child,
    step,
    wait_n,
    wait_signal,
    wait_timer,
    workflow,
)
from cyclone_dsl.cli.main import cli
from cyclone_dsl.testing import set_clock_shift
from tests.waiting import expire_leases_until, scanner_passes, wait_until

HOUR = timedelta(hours=1)
MINUTE = timedelta(minutes=1)
Clock = Callable[[datetime | timedelta], None]
StartWorker = Callable[..., Worker]

_lock = threading.Lock()
CALLS: Counter[str] = Counter()
GATES: dict[str, threading.Event] = {}
FAIL: dict[str, bool] = {}


def count(tag: str) -> int:
    with _lock:
        CALLS[tag] += 1
        return CALLS[tag]


def gate(name: str) -> threading.Event:
    with _lock:
        return GATES.setdefault(name, threading.Event())


@pytest.fixture(autouse=True)
def _fresh(start_worker: StartWorker) -> Iterator[None]:
    """Asks for start_worker first, so this teardown (opening every gate) runs before the
    workers are stopped: a handler held on a gate must not hold a worker's stop."""
    CALLS.clear()
    GATES.clear()
    FAIL.clear()
    yield
    set_clock_shift(timedelta(0))
    with _lock:
        events = list(GATES.values())
    for event in events:
        event.set()


# -- steps ------------------------------------------------------------------------------------


@step(name="scr_echo")
def scr_echo(value: object) -> object:
    count(f"echo:{value}")
    return value


@step(name="scr_pair")
def scr_pair(a: object, b: object) -> object:
    count(f"pair:{a}")
    return [a, b]


@step(name="scr_hold", max_reclaims=20)
def scr_hold(key: str) -> str:
    """Its first execution of each key is held on a gate (a worker that froze); the later
    ones return at once, numbered."""
    n = count(f"hold:{key}")
    if n == 1:
        gate(f"hold:{key}").wait(20)
    return f"{key}#{n}"


@step(name="scr_stuck", timeout=timedelta(seconds=1), max_attempts=2)
def scr_stuck(key: str) -> str:
    """Its first execution of each key ignores its timeout and is held on a gate."""
    n = count(f"stuck:{key}")
    if n == 1:
        gate(f"stuck:{key}").wait(20)
    return f"{key}#{n}"


@step(name="scr_flaky", max_attempts=1)
def scr_flaky(value: int) -> int:
    """Fails for good while FAIL["flaky"] is set (by default); once it is not, is held on a
    gate while FAIL["flaky_held"] is set."""
    count(f"flaky:{value}")
    if FAIL.get("flaky", True):
        raise RuntimeError("scr flaky fails")
    if FAIL.get("flaky_held", False):
        gate("flaky").wait(20)
    return value


@step(name="scr_ctx_attempt")
def scr_ctx_attempt(value: int, ctx: StepContext) -> int:
    count(f"ctx:{value}:{ctx.attempt}")
    return value


STEPS = (scr_echo, scr_pair, scr_hold, scr_stuck, scr_flaky, scr_ctx_attempt)


# -- workflows --------------------------------------------------------------------------------


@workflow(name="scr_timer_flow")
def scr_timer_flow(x):  # type: ignore[no-untyped-def]
    t = wait_timer(HOUR)
    return scr_echo(x, after=[t])


@workflow(name="scr_timer_only")
def scr_timer_only(x):  # type: ignore[no-untyped-def]
    return wait_timer(HOUR)


@workflow(name="scr_wait_timeout")
def scr_wait_timeout(x):  # type: ignore[no-untyped-def]
    return scr_echo(wait_signal("scr_go", timeout=HOUR))


@workflow(name="scr_contained_timeout")
def scr_contained_timeout(x):  # type: ignore[no-untyped-def]
    ok = wait_signal("scr_ok", timeout=HOUR)
    scr_echo(ok, on_dep_failure="cancel_branch")
    return scr_pair(x, wait_signal("scr_end"))


@workflow(name="scr_wait_plain")
def scr_wait_plain(x):  # type: ignore[no-untyped-def]
    return scr_pair(x, wait_signal("scr_go"))


@workflow(name="scr_flaky_flow")
def scr_flaky_flow(x):  # type: ignore[no-untyped-def]
    return scr_flaky(x)


@workflow(name="scr_parent_of_flaky")
def scr_parent_of_flaky(x):  # type: ignore[no-untyped-def]
    return scr_pair(x, child(scr_flaky_flow, x))


@workflow(name="scr_echo_flow")
def scr_echo_flow(x):  # type: ignore[no-untyped-def]
    return scr_echo(x)


@workflow(name="scr_parent_waits")
def scr_parent_waits(x):  # type: ignore[no-untyped-def]
    c = child(scr_echo_flow, x)
    return scr_pair(c, wait_signal("scr_go", after=[c]))


@workflow(name="scr_timeout_then_timer")
def scr_timeout_then_timer(x):  # type: ignore[no-untyped-def]
    got = wait_signal("scr_go", timeout=HOUR)
    t = wait_timer(2 * HOUR)
    return scr_pair(got, t)


@workflow(name="scr_quorum")
def scr_quorum(x):  # type: ignore[no-untyped-def]
    return scr_echo(wait_n("scr_vote", 2, timeout=HOUR))


@workflow(name="scr_hold_flow")
def scr_hold_flow(x):  # type: ignore[no-untyped-def]
    return scr_hold(x)


@workflow(name="scr_parent_of_timer")
def scr_parent_of_timer(x):  # type: ignore[no-untyped-def]
    return child(scr_timer_only, x)


@workflow(name="scr_parent_of_wait")
def scr_parent_of_wait(x):  # type: ignore[no-untyped-def]
    return child(scr_wait_timeout, x)


@workflow(name="scr_parent_of_hold")
def scr_parent_of_hold(x):  # type: ignore[no-untyped-def]
    return child(scr_hold_flow, x)


@workflow(name="scr_sched_flow")
def scr_sched_flow(x):  # type: ignore[no-untyped-def]
    return scr_ctx_attempt(x)


WORKFLOWS = (
    scr_parent_of_timer,
    scr_parent_of_wait,
    scr_parent_of_hold,
    scr_timeout_then_timer,
    scr_quorum,
    scr_hold_flow,
    scr_timer_flow,
    scr_timer_only,
    scr_wait_timeout,
    scr_contained_timeout,
    scr_wait_plain,
    scr_flaky_flow,
    scr_parent_of_flaky,
    scr_echo_flow,
    scr_parent_waits,
    scr_sched_flow,
)
ALL = (*STEPS, *WORKFLOWS)


# -- helpers ----------------------------------------------------------------------------------


def scanners(start_worker: StartWorker, n: int = 3, **options: Any) -> list[Worker]:
    """``n`` workers serving everything, each scanning every 50 ms (they race)."""
    options.setdefault("scan_interval", 0.05)
    options.setdefault("retention", None)
    return [start_worker(*ALL, **options) for _ in range(n)]


def cli_scan(dsn: str, retention: str = "none") -> None:
    """``cyclone scan --once`` in this process (it sees the moved database clock)."""
    result = CliRunner().invoke(cli, ["--dsn", dsn, "scan", "--once", "--retention", retention])
    assert result.exit_code == 0, (result.output, result.exception)


def all_scanned(workers: list[Worker], n: int = 2) -> None:
    for worker in workers:
        scanner_passes(worker, n)


def in_threads(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run every call at once; each result is its value or the exception it raised."""
    barrier = threading.Barrier(len(calls))

    def one(call: Callable[[], Any]) -> Any:
        barrier.wait(10)
        return outcome(call)

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(one, calls))


def outcome(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as exc:
        return exc


def around_a_move(calls: list[Callable[[], Any]], move: Callable[[], None]) -> list[Any]:
    """Run ``calls`` in order on four threads; the thread that takes the middle one first
    calls ``move`` (the clock), so the calls before it, the calls after it and the scanners
    race around that moment. Each result is the call's value or the exception it raised."""
    results: list[Any] = [None] * len(calls)
    taken = iter(range(len(calls)))
    lock = threading.Lock()

    def drain() -> None:
        while True:
            with lock:
                i = next(taken, None)
            if i is None:
                return
            if i == len(calls) // 2:
                move()
            results[i] = outcome(calls[i])

    with ThreadPoolExecutor(4) as pool:
        for future in [pool.submit(drain) for _ in range(4)]:
            future.result()
    return results


def fired_at_least(client: Client, n: int) -> bool:
    return len(client.list_runs(workflow="scr_sched_flow")) >= n


def _node_completed(handle: RunHandle, node: str) -> bool:
    return handle.get().step(node).state is StepState.COMPLETED


def outcome_of(client: Client, run_id: int, timeout: float = 20) -> tuple[str, Any]:
    """("completed", result) or (state, error_kind) once the run has ended."""
    try:
        return "completed", client.handle(run_id).result(timeout=timeout)
    except RunFailed as failed:
        return failed.state, failed.error_kind


# -- timers -----------------------------------------------------------------------------------


def test_scr_every_timer_fires_once_under_three_scanners_and_cli_scans(
    client: Client, cyclone_dsn: str, start_worker: StartWorker, clock: Clock
) -> None:
    workers = scanners(start_worker)
    handles = [client.submit(scr_timer_flow, i) for i in range(20)]
    clock(2 * HOUR)
    cli_scan(cyclone_dsn)
    cli_scan(cyclone_dsn)
    assert [h.result(timeout=20) for h in handles] == list(range(20))
    all_scanned(workers)
    for i, h in enumerate(handles):
        run = h.get()
        assert run.state is RunState.COMPLETED
        timer = run.step("timer")
        assert (timer.state, timer.attempt, timer.reclaims) == (StepState.COMPLETED, 0, 0)
        assert CALLS[f"echo:{i}"] == 1, f"run {i}: the step after the timer ran more than once"


def test_scr_a_cancel_racing_scanners_over_a_due_last_timer_finds_the_run_completed(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    """Documented: an operation first applies what came due in the run, so a cancel of a
    run whose last timer came due finds it completed (AlreadyTerminal), whether a scanner
    fired the timer first or the cancel did."""
    scanners(start_worker)
    handles = [client.submit(scr_timer_only, i) for i in range(16)]
    clock(2 * HOUR)
    results = in_threads([partial(client.cancel, h.id) for h in handles])
    for h, result in zip(handles, results, strict=True):
        assert isinstance(result, AlreadyTerminal), f"cancel of run {h.id} gave {result!r}"
        assert not isinstance(result, PassedDeadline)
        run = h.wait(timeout=10)
        assert run.state is RunState.COMPLETED
        assert run.step("timer").state is StepState.COMPLETED


def test_scr_pause_racing_timers_coming_due_then_resume_runs_each_step_once(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    """Pauses land before or after the scanners fire the timers. While paused nothing of a
    paused run moves (timers in a paused run do not fire); after the resume (and the time
    the pause moved the timers by) each run completes once with its input."""
    workers = scanners(start_worker)
    handles = [client.submit(scr_timer_flow, i) for i in range(16)]

    def move() -> None:
        clock(2 * HOUR)

    results = around_a_move([partial(client.pause, h.id) for h in handles], move)
    paused = []
    for h, result in zip(handles, results, strict=True):
        if result is None:
            paused.append(h)
        else:
            assert isinstance(result, AlreadyTerminal), f"pause of run {h.id} gave {result!r}"
    seen = {h.id: {s.node: s.state for s in h.get().steps} for h in paused}
    all_scanned(workers, 3)
    for h in paused:
        run = h.get()
        for s in run.steps:
            # A step running at the pause finishes (and may end the run, which keeps its
            # paused_at); nothing else of a paused run moves: no timer fires, nothing starts.
            if seen[h.id][s.node] is not StepState.RUNNING:
                assert s.state is seen[h.id][s.node], f"run {h.id}: {s.node} moved while paused"
        if run.state is RunState.PAUSED:
            client.resume(h.id)
        else:
            # Its echo was running at the pause (it may have ended before ``seen``).
            assert run.state is RunState.COMPLETED, run
            assert run.paused_at is not None, "a run that ended while paused keeps paused_at"
    clock(5 * HOUR)  # past any timer the pause moved by its length
    assert [h.result(timeout=20) for h in handles] == list(range(16))
    all_scanned(workers)
    for i in range(16):
        assert CALLS[f"echo:{i}"] == 1


# -- signal timeouts --------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["ends_run", "contained"])
def test_scr_signals_to_waits_whose_timeout_is_due_lose_to_the_timeout(
    client: Client, start_worker: StartWorker, clock: Clock, shape: str
) -> None:
    """Documented: a signal to a wait whose timeout passed (a scanner may or may not have
    failed it yet) is not stored: AlreadyTerminal when that failure ended the run, else
    NOT_STORED; the wait fails with signal_timeout, whichever of the scanners and the
    signal came first."""
    scanners(start_worker)
    flow, name = (
        (scr_wait_timeout, "scr_go") if shape == "ends_run" else (scr_contained_timeout, "scr_ok")
    )
    handles = [client.submit(flow, i) for i in range(16)]
    clock(2 * HOUR)
    results = in_threads([partial(client.signal, h.id, name, "late") for h in handles])
    for h, result in zip(handles, results, strict=True):
        if shape == "ends_run":
            assert isinstance(result, AlreadyTerminal), f"signal to {h.id} gave {result!r}"
            assert outcome_of(client, h.id) == ("failed", "signal_timeout")
        else:
            assert result is Delivery.NOT_STORED, f"signal to {h.id} gave {result!r}"
            assert client.signal(h.id, "scr_end", "end") is Delivery.CONSUMED
        run = h.wait(timeout=10)
        wait = run.step(name)
        assert (wait.state, wait.error_kind) == (StepState.DISCARDED, "signal_timeout")
        stored = [s for s in client.signals_of(h.id) if s.get("name") == name]
        assert stored == [], f"run {h.id}: a late signal was stored: {stored}"
    if shape == "contained":
        assert [h.result(timeout=10) for h in handles] == [[i, "end"] for i in range(16)]
    assert "echo:late" not in CALLS


@pytest.mark.parametrize("spread", ["all_at_once", "in_order"])
def test_scr_signals_racing_the_timeout_coming_due_are_consistent(
    client: Client, start_worker: StartWorker, clock: Clock, spread: str
) -> None:
    """The clock moves past the waits' timeout while signals are sent: a signal consumed
    completes its run with its payload, one refused leaves the run failed by the timeout.
    Never both, never neither."""
    scanners(start_worker)
    handles = [client.submit(scr_wait_timeout, i) for i in range(20)]

    def move() -> None:
        clock(2 * HOUR)

    calls: list[Callable[[], Any]] = [partial(client.signal, h.id, "scr_go", h.id) for h in handles]
    if spread == "all_at_once":
        results = in_threads([*calls[:10], move, *calls[10:]])
        del results[10]
    else:
        results = around_a_move(calls, move)
    for h, result in zip(handles, results, strict=True):
        got = outcome_of(client, h.id)
        if result is Delivery.CONSUMED:
            assert got == ("completed", h.id), f"run {h.id}: consumed but {got}"
        else:
            assert isinstance(result, AlreadyTerminal), f"signal to {h.id} gave {result!r}"
            assert got == ("failed", "signal_timeout"), f"run {h.id}: refused but {got}"
        echo = h.get().step("scr_echo")
        if result is Delivery.CONSUMED:
            # The clock's jump may expire a running echo's lease: each reclaim runs it again.
            reclaimed = [a for a in echo.attempts if a.outcome == "reclaimed"]
            assert echo.reclaims == len(reclaimed), echo
            assert CALLS[f"echo:{h.id}"] == 1 + echo.reclaims, (CALLS[f"echo:{h.id}"], echo)
        else:
            assert CALLS[f"echo:{h.id}"] == 0
            assert echo.state is StepState.CANCELLED


def test_scr_a_quorum_racing_its_timeout_keeps_exactly_the_signals_it_consumed(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    """Two signals to each wait_n(2, timeout=1 h) while the clock moves past the timeout:
    the run completes with both payloads when both were consumed, else fails with
    signal_timeout keeping as its output exactly the payloads consumed (none stored after
    the timeout, none lost before)."""
    scanners(start_worker)
    handles = [client.submit(scr_quorum, i) for i in range(12)]

    def move() -> None:
        clock(2 * HOUR)

    calls: list[Callable[[], Any]] = []
    for h in handles:
        calls += [partial(client.signal, h.id, "scr_vote", f"{h.id}:{v}") for v in "ab"]
    results = around_a_move(calls, move)
    for n, h in enumerate(handles):
        sent = {f"{h.id}:a": results[2 * n], f"{h.id}:b": results[2 * n + 1]}
        consumed = [p for p, r in sent.items() if r is Delivery.CONSUMED]
        for p, r in sent.items():
            assert r is Delivery.CONSUMED or isinstance(r, AlreadyTerminal), (p, r)
        got = outcome_of(client, h.id)
        vote = h.get().step("scr_vote")
        stored = [x["payload"] for x in client.signals_of(h.id) if x["name"] == "scr_vote"]
        assert sorted(stored) == consumed, (h.id, stored, sent)  # stored in arrival order
        if len(consumed) == 2:
            assert got == ("completed", stored), (h.id, got)
        else:
            assert got == ("failed", "signal_timeout"), (h.id, got, sent)
            assert (vote.output or []) == stored, (h.id, vote.output, sent)


def test_scr_a_late_timeout_due_before_a_timer_fails_the_run_before_the_timer_fires(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    """Documented: a late scanner applies what came due in due order. The timers pass and
    the signal timeouts pass of different scanners run at once; whichever meets a run first,
    the timeout (1 h) fails it and cancels the timer (2 h), which never fires."""
    scanners(start_worker)
    handles = [client.submit(scr_timeout_then_timer, i) for i in range(16)]
    clock(3 * HOUR)
    for h in handles:
        assert outcome_of(client, h.id) == ("failed", "signal_timeout")
        run = h.get()
        assert run.step("scr_go").state is StepState.DISCARDED
        assert run.step("timer").state is StepState.CANCELLED, run.step("timer")


# -- deadlines --------------------------------------------------------------------------------


def test_scr_cancel_and_pause_racing_a_deadline_end_each_run_once_as_documented(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    """Cancels and pauses race the clock moving past the runs' deadline and the scanners
    failing them. A cancel that returned left the run cancelled; one refused found it
    failed by its deadline. A pause that returned stopped the deadline's clock: the run
    completes when signalled after its resume; one refused found it failed by its
    deadline."""
    scanners(start_worker)
    handles = [client.submit(scr_wait_plain, i, deadline=HOUR) for i in range(20)]

    def move() -> None:
        clock(2 * HOUR)

    def act(h: Any, i: int) -> Callable[[], Any]:
        return (lambda: client.cancel(h.id)) if i % 2 == 0 else (lambda: client.pause(h.id))

    results = around_a_move([act(h, i) for i, h in enumerate(handles)], move)
    for i, (h, result) in enumerate(zip(handles, results, strict=True)):
        if result is None and i % 2 == 0:
            assert outcome_of(client, h.id) == ("cancelled", "cancelled"), h.id
        elif result is None:
            assert h.get().state is RunState.PAUSED, h.id
            client.resume(h.id)
            assert client.signal(h.id, "scr_go", "in time") is Delivery.CONSUMED
            assert outcome_of(client, h.id) == ("completed", [i, "in time"])
        else:
            assert isinstance(result, AlreadyTerminal), f"run {h.id}: {result!r}"
            assert outcome_of(client, h.id) == ("failed", "deadline"), h.id
        run = h.wait(timeout=10)
        assert all(s.state.is_terminal for s in run.steps), run.steps


def test_scr_retry_racing_a_deadline_never_leaves_a_run_open(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    """Failed runs with a deadline an hour away are retried while the clock moves past the
    deadline. A retry either is refused (the run stays failed by its step) or reopens the
    run, which then completes (before the deadline) or fails by its deadline: no run is
    left open, and the retried step runs at most once more."""
    scanners(start_worker)
    handles = [client.submit(scr_flaky_flow, i, deadline=HOUR) for i in range(12)]
    for h in handles:
        assert outcome_of(client, h.id) == ("failed", "error")
    FAIL["flaky"] = False

    def move() -> None:
        clock(2 * HOUR)

    results = around_a_move([partial(client.retry, h.id, "scr_flaky") for h in handles], move)
    for i, (h, result) in enumerate(zip(handles, results, strict=True)):
        got = outcome_of(client, h.id)
        if result is None:
            assert got in (("completed", i), ("failed", "deadline")), (h.id, got)
        else:
            assert isinstance(result, InvalidTransition | AlreadyTerminal), (h.id, result)
            assert got == ("failed", "error"), (h.id, got)
            assert CALLS[f"flaky:{i}"] == 1
        assert CALLS[f"flaky:{i}"] <= 2
        run = h.wait(timeout=10)
        assert all(s.state.is_terminal for s in run.steps), run.steps


# -- leases and step timeouts ------------------------------------------------------------------


def test_scr_expired_leases_are_reclaimed_once_each_by_racing_scanners(
    client: Client, start_worker: StartWorker
) -> None:
    """Handlers held (as if their worker froze) while the clock moves past their leases:
    each reclaim is counted once (reclaims, the attempt history and the executions agree),
    no attempt is spent, and the output is the last execution's, whatever the fenced first
    execution returns when it wakes."""
    scanners(start_worker, max_reclaims=20)
    keys = [f"k{i}" for i in range(4)]
    handles = {k: client.enqueue(scr_hold, k) for k in keys}
    wait_until(lambda: all(CALLS[f"hold:{k}"] >= 1 for k in keys), what="every handler held")

    def steps() -> dict[str, Any]:
        return {k: client.get_run(h.id).steps[0] for k, h in handles.items()}

    expire_leases_until(
        lambda: all(s.reclaims >= 1 for s in steps().values()), what="every step reclaimed"
    )
    results = {k: h.result(timeout=20) for k, h in handles.items()}
    for k in keys:
        gate(f"hold:{k}").set()  # the first executions return now: fenced
    wait_until(lambda: all(CALLS[f"hold:{k}"] >= 2 for k in keys), what="the reruns")
    for k, s in steps().items():
        reclaimed = [a for a in s.attempts if a.outcome == "reclaimed"]
        executions = CALLS[f"hold:{k}"]
        assert s.state is StepState.COMPLETED
        assert s.attempt == 0, f"{k}: a reclaim spent an attempt"
        assert s.reclaims == len(reclaimed) == executions - 1, (
            f"{k}: reclaims={s.reclaims}, history={len(reclaimed)}, executions={executions}"
        )
        assert results[k] == s.output == f"{k}#{executions}"


def test_scr_a_step_past_its_timeout_is_failed_once_by_its_worker_or_a_scanner(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    """The worker enforces a step's 1 s timeout, and the scanners (the clock moved an hour)
    find it past its timeout too: the attempt is counted once (one ``timeout`` in the
    history, no reclaim), and the retry completes."""
    scanners(start_worker)
    keys = [f"t{i}" for i in range(4)]
    handles = {k: client.enqueue(scr_stuck, k) for k in keys}
    wait_until(lambda: all(CALLS[f"stuck:{k}"] >= 1 for k in keys), what="every handler held")
    clock(HOUR)
    results = {k: h.result(timeout=20) for k, h in handles.items()}
    for k in keys:
        gate(f"stuck:{k}").set()
    for k, h in handles.items():
        s = client.get_run(h.id).steps[0]
        assert results[k] == s.output == f"{k}#2"
        assert (s.state, s.attempt, s.reclaims) == (StepState.COMPLETED, 1, 0), s
        assert [(a.number, a.outcome, a.error_kind) for a in s.attempts] == [
            (1, "retried", "timeout")
        ], s.attempts
        assert CALLS[f"stuck:{k}"] == 2


@pytest.mark.parametrize("inside", ["timer", "signal_timeout", "held_step"])
def test_scr_what_comes_due_in_a_child_after_its_parents_deadline_ends_the_parent_by_it(
    client: Client, start_worker: StartWorker, clock: Clock, inside: str
) -> None:
    """Documented: a deadline that passed first wins, however late the scanners are; a
    child run is cancelled with its parent at the parent's deadline. The parent (deadline
    1 h) waits for a child whose last node comes due after it (a 1 h timer counted from
    the child's start, a 1 h signal timeout, or a held step whose lease expires): the
    scanners' passes race over the family, and the parent fails by its deadline, its child
    cancelled, never completed nor failed by its own wait."""
    workers = scanners(start_worker)
    flow = {
        "timer": scr_parent_of_timer,
        "signal_timeout": scr_parent_of_wait,
        "held_step": scr_parent_of_hold,
    }[inside]
    keys = [f"{inside}{i}" for i in range(6)]
    handles = {k: client.submit(flow, k, deadline=HOUR - MINUTE) for k in keys}
    if inside == "held_step":
        wait_until(lambda: all(CALLS[f"hold:{k}"] >= 1 for k in keys), what="every handler held")
    clock(3 * HOUR)
    for k, h in handles.items():
        assert outcome_of(client, h.id) == ("failed", "deadline"), k
    all_scanned(workers, 3)
    for k, h in handles.items():
        (kid,) = client.children_of(h.id)
        assert kid["state"] == "cancelled", (k, kid)
        assert h.get().state is RunState.FAILED
        if inside == "held_step":
            assert CALLS[f"hold:{k}"] == 1, "a step of the child ran again past the deadline"


def test_scr_an_expired_lease_in_a_run_past_its_deadline_fails_the_run_not_reclaims(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    """Documented: a reclaim in a run past its deadline fails the run by its deadline. The
    held steps' leases and the runs' deadline pass together under three scanners: each run
    fails by its deadline, and no step runs again."""
    workers = scanners(start_worker)
    keys = [f"d{i}" for i in range(4)]
    handles = {k: client.submit(scr_hold_flow, k, deadline=HOUR) for k in keys}
    wait_until(lambda: all(CALLS[f"hold:{k}"] >= 1 for k in keys), what="every handler held")
    clock(2 * HOUR)
    for h in handles.values():
        assert outcome_of(client, h.id) == ("failed", "deadline")
    all_scanned(workers, 3)
    for k, h in handles.items():
        s = h.get().step("scr_hold")
        assert s.state is StepState.CANCELLED, s
        assert s.reclaims == 0, s
        assert CALLS[f"hold:{k}"] == 1


def test_scr_a_lease_expiring_in_a_paused_run_is_reclaimed_once_and_runs_at_the_resume(
    client: Client, start_worker: StartWorker
) -> None:
    """A held step's run is paused, then its lease expires under three scanners: it is
    reclaimed once (to paused: nothing starts in a paused run), runs again at the resume,
    and its run completes with that execution's output."""
    workers = scanners(start_worker, max_reclaims=20)
    keys = [f"p{i}" for i in range(4)]
    handles = {k: client.submit(scr_hold_flow, k) for k in keys}
    wait_until(lambda: all(CALLS[f"hold:{k}"] >= 1 for k in keys), what="every handler held")
    for h in handles.values():
        client.pause(h.id)

    def step_of(k: str) -> Any:
        return handles[k].get().step("scr_hold")

    expire_leases_until(
        lambda: all(step_of(k).reclaims >= 1 for k in keys), what="every step reclaimed"
    )
    all_scanned(workers, 3)
    for k, h in handles.items():
        s = step_of(k)
        assert (h.get().state, s.state, s.reclaims) == (RunState.PAUSED, StepState.PAUSED, 1), s
        assert CALLS[f"hold:{k}"] == 1, "a step ran in a paused run"
        client.resume(h.id)
    for k, h in handles.items():
        assert h.result(timeout=20) == f"{k}#2"
        gate(f"hold:{k}").set()
    all_scanned(workers)
    for k in keys:
        s = step_of(k)
        assert (s.output, s.reclaims, s.attempt) == (f"{k}#2", 1, 0), s
        assert [a.outcome for a in s.attempts] == ["reclaimed"]


# -- schedules --------------------------------------------------------------------------------


def test_scr_latest_catch_up_fires_one_run_per_jump_under_three_scanners_and_cli(
    client: Client, cyclone_dsn: str, start_worker: StartWorker, clock: Clock
) -> None:
    """catch_up="latest" (every worker's and the CLI's): a jump across several slots
    fires the latest one only, once, however many scanners see it."""
    base = datetime(2027, 7, 1, 12, 0, 30, tzinfo=UTC)
    clock(base)
    client.schedule(scr_sched_flow, "* * * * *", id="scr_latest", location="UTC", input=7)
    workers = scanners(start_worker)
    expected = 0
    for minutes, next_slot in ((5, 6), (8, 9), (9, 10)):
        clock(base + timedelta(minutes=minutes))
        cli_scan(cyclone_dsn)
        expected += 1
        wait_until(
            partial(fired_at_least, client, expected),
            what=f"{expected} fired runs",
        )
        all_scanned(workers)
        cli_scan(cyclone_dsn)
        runs = client.list_runs(workflow="scr_sched_flow")
        assert len(runs) == expected, f"jump to +{minutes} min fired {len(runs) - expected + 1}"
        made = next(s for s in client.list_schedules() if s.id == "scr_latest")
        assert made.next_run_at == datetime(2027, 7, 1, 12, next_slot, tzinfo=UTC)
    runs = client.list_runs(workflow="scr_sched_flow")
    assert [client.handle(r.id).result(timeout=20) for r in runs] == [7] * expected
    assert CALLS["ctx:7:1"] == expected


def test_scr_catch_up_all_fires_each_missed_slot_once_under_three_scanners(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    base = datetime(2027, 7, 2, 12, 0, 30, tzinfo=UTC)
    clock(base)
    client.schedule(scr_sched_flow, "* * * * *", id="scr_all", location="UTC", input=3)
    workers = scanners(start_worker, catch_up="all")
    for minutes, total in ((4, 4), (7, 7)):
        clock(base + timedelta(minutes=minutes))
        wait_until(
            partial(fired_at_least, client, total),
            what=f"{total} fired runs",
        )
        all_scanned(workers, 3)
        assert len(client.list_runs(workflow="scr_sched_flow")) == total
        made = next(s for s in client.list_schedules() if s.id == "scr_all")
        assert made.next_run_at == datetime(2027, 7, 2, 12, minutes + 1, tzinfo=UTC)
    runs = client.list_runs(workflow="scr_sched_flow")
    assert [client.handle(r.id).result(timeout=20) for r in runs] == [3] * 7


def test_scr_catch_up_all_with_the_clock_moving_under_the_scanners_fires_every_slot_once(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    """The clock moves 20 s at a time across ten minute slots while three catch_up="all"
    scanners fire: every slot fires exactly one run, none is skipped, none twice."""
    base = datetime(2027, 7, 4, 12, 0, 30, tzinfo=UTC)
    clock(base)
    client.schedule(scr_sched_flow, "* * * * *", id="scr_steps", location="UTC", input=5)
    workers = scanners(start_worker, catch_up="all")
    for n in range(1, 31):
        clock(base + n * timedelta(seconds=20))
        time.sleep(0.03)  # the scanners (every 50 ms) pass between some of the moves
    wait_until(partial(fired_at_least, client, 10), what="ten fired runs")
    all_scanned(workers, 3)
    runs = client.list_runs(workflow="scr_sched_flow")
    assert len(runs) == 10, f"{len(runs)} runs for 10 slots"
    made = next(s for s in client.list_schedules() if s.id == "scr_steps")
    assert made.next_run_at == datetime(2027, 7, 4, 12, 11, tzinfo=UTC)
    assert [client.handle(r.id).result(timeout=20) for r in runs] == [5] * 10


def test_scr_disable_and_unschedule_racing_due_fires_stop_every_later_slot(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    """Operators disable or delete schedules as their slot comes due under three scanners.
    A fire that committed first keeps its one run; after the call returns, no slot of the
    schedule fires, however far the clock moves."""
    base = datetime(2027, 7, 3, 12, 0, 30, tzinfo=UTC)
    clock(base)
    ids = [f"scr_stop_{i}" for i in range(10)]
    for n, schedule_id in enumerate(ids):
        client.schedule(scr_sched_flow, "* * * * *", id=schedule_id, location="UTC", input=n)
    workers = scanners(start_worker)

    def move() -> None:
        clock(base + timedelta(minutes=1))

    calls: list[Callable[[], Any]] = [
        partial(client.enable_schedule, i, False) if n % 2 == 0 else partial(client.unschedule, i)
        for n, i in enumerate(ids)
    ]
    results = around_a_move(calls, move)
    assert results == [None] * len(ids), results
    all_scanned(workers)
    fired = Counter(client.get_run(r.id).input for r in client.list_runs(workflow="scr_sched_flow"))
    assert all(c <= 1 for c in fired.values()), fired
    for minutes in (3, 6):
        clock(base + timedelta(minutes=minutes))
        all_scanned(workers, 3)
        later = Counter(
            client.get_run(r.id).input for r in client.list_runs(workflow="scr_sched_flow")
        )
        assert later == fired, f"a stopped schedule fired: {later} after {fired}"
    left = {s.id: s for s in client.list_schedules()}
    assert sorted(left) == ids[::2]
    assert not any(s.enabled for s in left.values())


# -- retention --------------------------------------------------------------------------------


def test_scr_retention_racing_retries_never_deletes_a_retried_run(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    """Failed runs (a lone run, and a parent failed by its child) pass their retention
    while operators retry them and three scanners expire runs. A retry that returned
    reopened a run nothing deletes (its retried step is held until the end, so it stays
    open): it runs its step once more and completes (its parent too); one refused as not
    found found the run deleted, its child with it."""
    workers = scanners(start_worker, retention=timedelta(minutes=10))
    lone = [client.submit(scr_flaky_flow, i) for i in range(8)]
    parents = [client.submit(scr_parent_of_flaky, 100 + i) for i in range(8)]
    for h in [*lone, *parents]:
        assert outcome_of(client, h.id)[0] == "failed"
    kids = {h.id: client.children_of(h.id)[0]["id"] for h in parents}
    FAIL["flaky"] = False
    FAIL["flaky_held"] = True

    def move() -> None:
        clock(HOUR)

    calls: list[Callable[[], Any]] = []
    for a, b in zip(lone, parents, strict=True):
        calls.append(partial(client.retry, a.id, "scr_flaky"))
        calls.append(partial(client.retry, b.id, "scr_flaky_flow"))
    results = around_a_move(calls, move)
    all_scanned(workers, 3)  # a retention pass of the moved clock ran
    gate("flaky").set()
    for i, (h, result) in enumerate(zip(lone, results[::2], strict=True)):
        if result is None:
            assert outcome_of(client, h.id) == ("completed", i), h.id
            _ran_once_more(client, h.id, "scr_flaky", f"flaky:{i}")
        else:
            assert isinstance(result, RunNotFound), (h.id, result)
            assert CALLS[f"flaky:{i}"] == 1
    orphans: list[int] = []
    for i, (h, result) in enumerate(zip(parents, results[1::2], strict=True)):
        x = 100 + i
        if result is None:
            assert outcome_of(client, h.id) == ("completed", [x, x]), h.id
            assert client.get_run(kids[h.id]).state is RunState.COMPLETED
            _ran_once_more(client, kids[h.id], "scr_flaky", f"flaky:{x}")
        else:
            assert isinstance(result, RunNotFound), (h.id, result)
            orphans.append(kids[h.id])
            assert CALLS[f"flaky:{x}"] == 1
    # A child goes with its parent, or at the next retention look (once a minute) when a
    # lock kept it out of that pass; the runs retried completed less than 10 min ago.
    clock(HOUR + 2 * MINUTE)
    for kid in orphans:
        wait_until(partial(_gone, client, kid), what=f"child run {kid} after its parent")
    all_scanned(workers)
    for h, result in zip([*lone, *parents], [*results[::2], *results[1::2]], strict=True):
        if result is None:
            assert h.get().state is RunState.COMPLETED  # not deleted after it completed


def _ran_once_more(client: Client, run_id: int, node: str, tag: str) -> None:
    """The retried step ran once more, plus once per reclaim (the clock's jump may expire
    the lease of the held execution)."""
    s = client.get_run(run_id).step(node)
    reclaimed = [a for a in s.attempts if a.outcome == "reclaimed"]
    assert s.reclaims == len(reclaimed), s
    assert CALLS[tag] == 2 + s.reclaims, (CALLS[tag], s)


def _gone(client: Client, run_id: int) -> bool:
    try:
        client.get_run(run_id)
    except RunNotFound:
        return True
    return False


def test_scr_retention_keeps_the_ended_child_of_a_running_parent_under_three_scanners(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    """A child run that completed long past its retention is kept while its parent runs,
    by every scanner; once the parent ends and its retention passes, both go."""
    workers = scanners(start_worker, retention=timedelta(minutes=10))
    parents = [client.submit(scr_parent_waits, i) for i in range(6)]
    kids = {}
    for h in parents:
        wait_until(
            partial(_node_completed, h, "scr_echo_flow"),
            what="the child run",
        )
        kids[h.id] = client.children_of(h.id)[0]["id"]
    clock(HOUR)
    all_scanned(workers, 3)
    for h in parents:
        assert client.get_run(kids[h.id]).state is RunState.COMPLETED
    for i, h in enumerate(parents):
        assert client.signal(h.id, "scr_go", "go") is Delivery.CONSUMED
        assert h.result(timeout=20) == [i, "go"]
    clock(3 * HOUR)
    for h in parents:
        wait_until(partial(_gone, client, h.id), what="the parent past its retention")
        wait_until(partial(_gone, client, kids[h.id]), what="its child")
