"""Audit of run deadlines (``client.submit(..., deadline=...)``): how a deadline meets the
scanner's other passes, signals, completions, operator actions, forks, debounce, the
async client and transactional steps. Public API only, on real PostgreSQL.

A deadline that passed first wins, whichever transition comes next and however late the
scanner is."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

from cyclone_dsl import (
    AsyncClient,
    Client,
    Debounce,
    RateLimit,
    Registry,
    RunFilter,
    StepContext,
    Worker,
    child,
    step,
    wait_signal,
    wait_timer,
    workflow,
)
from cyclone_dsl.durations import MAX_DURATION
from cyclone_dsl.errors import (
    AlreadyTerminal,
    InvalidArgument,
    InvalidTransition,
    PassedDeadline,
    RunFailed,
)
from cyclone_dsl.states import RunState, StepState
from cyclone_dsl.testing import set_clock_shift
from tests.waiting import PROMPT, wait_until

# -- shared state the handlers report into ------------------------------------------------

_lock = threading.Lock()
calls: dict[str, int] = {}
seen: dict[str, Any] = {}


def _count(name: str) -> int:
    with _lock:
        calls[name] = calls.get(name, 0) + 1
        return calls[name]


def _reset(*names: str) -> None:
    with _lock:
        for n in names:
            calls.pop(n, None)
            seen.pop(n, None)


@pytest.fixture
def clock_shift() -> Iterator[Callable[[timedelta], None]]:
    """Move this process's database clock; always moved back at the end of the test."""
    yield set_clock_shift
    set_clock_shift(timedelta(0))


# -- steps ---------------------------------------------------------------------------------


@step(name="dla_echo")
def echo(value: object) -> object:
    _count("echo")
    return value


@step(name="dla_slow", max_attempts=1)
def slow(x: int) -> int:
    """Returns after 0.8 s whatever happens (a handler that never looks at ctx)."""
    _count("slow")
    time.sleep(0.8)
    return x


@step(name="dla_late_raise", max_attempts=3)
def late_raise(x: int, ctx: StepContext) -> int:
    """Waits to be told to stop, then raises: a late failure must not be retried."""
    _count("late_raise")
    seen["late_raise"] = ctx.wait_cancelled(15)
    raise RuntimeError("failed after the deadline")


@step(name="dla_tx_write", transactional=True, max_attempts=1)
def tx_write(x: int, ctx: StepContext) -> int:
    """Writes a row in its transaction, then waits to be told to stop."""
    ctx.connection.execute("INSERT INTO dla_written (x) VALUES (%s)", (x,))
    _count("tx_write")
    seen["tx_write"] = ctx.wait_cancelled(15)
    return x


@step(name="dla_ctx_deadline")
def ctx_deadline(x: int, ctx: StepContext) -> str | None:
    return None if ctx.deadline is None else ctx.deadline.isoformat()


STEPS = (echo, slow, late_raise, tx_write, ctx_deadline)

# -- workflows -----------------------------------------------------------------------------


@workflow(name="dla_timer_result")
def timer_result(x):  # type: ignore[no-untyped-def]
    return wait_timer(timedelta(hours=2))


@workflow(name="dla_signal_timeout")
def signal_timeout(x):  # type: ignore[no-untyped-def]
    return echo(wait_signal("dla_go", timeout=timedelta(hours=2)))


@workflow(name="dla_signal_result")
def signal_result(x):  # type: ignore[no-untyped-def]
    return wait_signal("dla_go")


@workflow(name="dla_signal_then_echo")
def signal_then_echo(x):  # type: ignore[no-untyped-def]
    return echo(wait_signal("dla_go"))


@workflow(name="dla_parent")
def parent(x):  # type: ignore[no-untyped-def]
    return echo(child(signal_then_echo, x), node_id="after_child")


@workflow(name="dla_slow_then_echo")
def slow_then_echo(x):  # type: ignore[no-untyped-def]
    return echo(slow(x), node_id="after_slow")


@workflow(name="dla_late_raise_wf")
def late_raise_wf(x):  # type: ignore[no-untyped-def]
    return late_raise(x)


@workflow(name="dla_tx_write_wf")
def tx_write_wf(x):  # type: ignore[no-untyped-def]
    return tx_write(x)


@workflow(name="dla_echo_wf")
def echo_wf(x):  # type: ignore[no-untyped-def]
    return echo(x)


@workflow(name="dla_ctx_deadline_wf")
def ctx_deadline_wf(x):  # type: ignore[no-untyped-def]
    return ctx_deadline(x)


def _deadline_failure(client: Client, run_id: int, timeout: float = 8) -> RunFailed:
    with pytest.raises(RunFailed) as failed:
        client.handle(run_id).result(timeout=timeout)
    return failed.value


# -- the scanner's passes: a deadline that passed first must win ----------------------------


def test_timer_due_after_the_deadline_does_not_complete_the_run(
    client: Client,
    start_worker: Callable[..., Worker],
    clock_shift: Callable[[timedelta], None],
) -> None:
    handle = client.submit(timer_result, 1, deadline=timedelta(hours=1))
    # Three hours pass before any scanner looks (the workers were down): the deadline
    # (1 h) passed long before the timer (2 h) came due.
    clock_shift(timedelta(hours=3))
    start_worker(*STEPS)
    run = handle.wait(timeout=8)
    assert run.state is RunState.FAILED, f"the run ended {run.state.value} past its deadline"
    failure = _deadline_failure(client, handle.id, timeout=1)
    assert failure.error_kind == "deadline"


def test_signal_timeout_due_after_the_deadline_reports_the_deadline(
    client: Client,
    start_worker: Callable[..., Worker],
    clock_shift: Callable[[timedelta], None],
) -> None:
    handle = client.submit(signal_timeout, 1, deadline=timedelta(hours=1))
    clock_shift(timedelta(hours=3))
    start_worker(*STEPS)
    failure = _deadline_failure(client, handle.id)
    assert (failure.state, failure.error_kind) == ("failed", "deadline")


# -- transitions other than the scanner's on a run past its deadline -----------------------


def test_signal_after_the_deadline_does_not_complete_the_run(
    client: Client,
    start_worker: Callable[..., Worker],
    clock_shift: Callable[[timedelta], None],
) -> None:
    handle = client.submit(signal_result, 1, deadline=timedelta(hours=1))
    clock_shift(timedelta(hours=2))
    with contextlib.suppress(AlreadyTerminal):  # refusing the late signal is right too
        client.signal(handle.id, "dla_go", "late")
    start_worker(*STEPS)  # its scanner has its chance to fail the run
    run = handle.wait(timeout=8)
    assert run.state is RunState.FAILED, f"the run ended {run.state.value} past its deadline"


def test_a_late_signal_or_pause_is_refused_and_records_the_deadline_at_once(
    client: Client, clock_shift: Callable[[timedelta], None]
) -> None:
    """No scanner runs here: the refused call itself records the deadline's end."""
    for late_call in (
        lambda run_id: client.signal(run_id, "dla_go", "late"),
        client.pause,
        client.cancel,
    ):
        handle = client.submit(signal_result, 1, deadline=timedelta(hours=1))
        clock_shift(timedelta(hours=2))
        try:
            with pytest.raises(PassedDeadline, match="passed its deadline") as refused:
                late_call(handle.id)
            assert isinstance(refused.value, AlreadyTerminal)
            assert refused.value.deadline_run_id == handle.id
            run = handle.get()
            assert run.state is RunState.FAILED
            assert run.step("dla_go").error_kind == "deadline"
            assert client.signals_of(handle.id) == []
        finally:
            clock_shift(timedelta(0))


@pytest.mark.parametrize("late_call", ["cancel", "resume"])
def test_a_late_cancel_or_resume_of_a_child_records_its_parents_deadline(
    client: Client, clock_shift: Callable[[timedelta], None], late_call: str
) -> None:
    """No scanner runs here. The parent passed its deadline first: a cancel of its child
    (or a resume of a child paused on its own) is refused, and records the parent's end
    by its deadline, not a failure by the child."""
    handle = client.submit(parent, 1, deadline=timedelta(hours=1))
    (kid,) = [k["id"] for k in client.children_of(handle.id)]
    if late_call == "resume":
        client.pause(kid)
    clock_shift(timedelta(hours=2))
    with pytest.raises(PassedDeadline, match=f"parent run {handle.id} passed") as refused:
        getattr(client, late_call)(kid)
    assert refused.value.deadline_run_id == handle.id
    run = handle.get()
    assert run.state is RunState.FAILED
    assert {s.error_kind for s in run.steps if s.error_kind} == {"deadline"}
    assert client.get_run(kid).state is RunState.CANCELLED


@pytest.mark.parametrize("action", ["cancel_many", "resume_many"])
def test_a_bulk_cancel_or_resume_past_a_deadline_records_the_deadline_first(
    client: Client, clock_shift: Callable[[timedelta], None], action: str
) -> None:
    """The bulk operation applies what came due first (the parent's deadline, which ends
    the family), then selects: the child run has ended, and is not selected."""
    handle = client.submit(parent, 1, deadline=timedelta(hours=1))
    (kid,) = [k["id"] for k in client.children_of(handle.id)]
    if action == "resume_many":
        client.pause(kid)
    clock_shift(timedelta(hours=2))
    assert (
        getattr(client, action)(RunFilter(workflows="dla_signal_then_echo"), dry_run=True).matched
        == 0
    )
    result = getattr(client, action)(RunFilter(workflows="dla_signal_then_echo"))
    assert (result.matched, result.acted, result.skipped) == (0, 0, 0)
    run = handle.get()
    assert run.state is RunState.FAILED
    assert {s.error_kind for s in run.steps if s.error_kind} == {"deadline"}
    assert client.get_run(kid).state is RunState.CANCELLED


def test_work_after_the_deadline_does_not_complete_the_run(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    _reset("slow", "echo")
    start_worker(*STEPS, scan_interval=30)  # one scan at start, then none in this test
    time.sleep(0.3)  # let that first scan pass
    handle = client.submit(slow_then_echo, 5, deadline=timedelta(seconds=0.3))
    run = handle.wait(timeout=8)
    assert run.state is RunState.FAILED, (
        f"the run ended {run.state.value}; after_slow was "
        f"{run.step('after_slow').state.value}, started past the deadline"
    )


@workflow(name="dla_slow_wf")
def slow_wf(x):  # type: ignore[no-untyped-def]
    return slow(x)


@workflow(name="dla_parent_of_slow")
def parent_of_slow(x):  # type: ignore[no-untyped-def]
    return echo(child(slow_wf, x), node_id="after_child")


def test_a_child_step_ending_after_its_parents_deadline_ends_the_parent(
    client: Client,
    start_worker: Callable[..., Worker],
    clock_shift: Callable[[timedelta], None],
) -> None:
    """The child run has no deadline of its own; its step's end locks the parent, finds it
    past its deadline, fails it, and the child run is cancelled with it."""
    _reset("slow", "echo")
    start_worker(*STEPS, scan_interval=30)  # one scan at start, then none in this test
    time.sleep(0.3)
    handle = client.submit(parent_of_slow, 7, deadline=timedelta(hours=1))
    # The deadline passes while the child's step runs (by the clock, not by waiting for it:
    # on a loaded machine the child may start late).
    wait_until(lambda: calls.get("slow", 0) >= 1, timeout=PROMPT, what="the child's step")
    clock_shift(timedelta(hours=2))
    failure = _deadline_failure(client, handle.id)
    assert (failure.state, failure.error_kind) == ("failed", "deadline")
    (kid,) = client.children_of(handle.id)
    assert client.get_run(kid["id"]).state is RunState.CANCELLED
    assert calls.get("echo", 0) == 0, "the parent's next step ran past its deadline"


@workflow(name="dla_parent_of_echo")
def parent_of_echo(x):  # type: ignore[no-untyped-def]
    return echo(child(echo_wf, x), node_id="after_child")


def test_a_child_left_for_a_worker_is_not_started_past_its_parents_deadline(
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    clock_shift: Callable[[timedelta], None],
) -> None:
    _reset("echo")
    only_parent = Registry()
    only_parent.register(parent_of_echo)  # not its child workflow: a worker starts the child
    with Client(cyclone_dsn, registry=only_parent) as narrow:
        handle = narrow.submit(parent_of_echo, 3, deadline=timedelta(hours=1))
        assert narrow.children_of(handle.id) == []
        clock_shift(timedelta(hours=2))
        start_worker(*STEPS, echo_wf, parent_of_echo, scanners=False)  # no deadline scanner
        failure = _deadline_failure(narrow, handle.id)
        assert (failure.state, failure.error_kind) == ("failed", "deadline")
        assert narrow.children_of(handle.id) == []
        assert calls.get("echo", 0) == 0


@workflow(name="dla_grandparent_of_echo")
def grandparent_of_echo(x):  # type: ignore[no-untyped-def]
    return echo(child(parent_of_echo, x), node_id="after_grandchild")


@pytest.mark.parametrize("levels", [1, 2])
def test_a_child_runs_step_is_not_claimed_past_an_ancestors_deadline(
    client: Client,
    start_worker: Callable[..., Worker],
    clock_shift: Callable[[timedelta], None],
    levels: int,
) -> None:
    """A child run has no deadline of its own; its steps were claimed (and their handlers
    run) past its parent's or grandparent's deadline when no scanner had failed it yet."""
    _reset("echo")
    top = parent_of_echo if levels == 1 else grandparent_of_echo
    handle = client.submit(top, 3, deadline=timedelta(hours=1))
    leaf = handle.id
    for _ in range(levels):
        (kid,) = client.children_of(leaf)
        leaf = kid["id"]
    assert client.get_run(leaf).step("dla_echo").state is StepState.AVAILABLE
    clock_shift(timedelta(hours=2))  # the workers were down past the deadline
    start_worker(*STEPS, echo_wf, parent_of_echo, grandparent_of_echo, scanners=False)
    # A run without a deadline, queued after the child's step: once it has run, the worker
    # has had the child's step in reach of its claims.
    assert client.submit(echo_wf, 4).result(timeout=PROMPT) == 4
    assert calls.get("echo", 0) == 1, "a child run's step ran past its ancestor's deadline"
    assert client.get_run(leaf).step("dla_echo").state is StepState.AVAILABLE
    start_worker(*STEPS, echo_wf, parent_of_echo, grandparent_of_echo)  # with a scanner
    failure = _deadline_failure(client, handle.id)
    assert (failure.state, failure.error_kind) == ("failed", "deadline")
    assert client.get_run(leaf).state is RunState.CANCELLED
    assert calls.get("echo", 0) == 1


@step(name="dla_rated", rate_limit=RateLimit(limit=1, per=timedelta(days=1)))
def rated(value: object) -> object:
    _count("rated")
    return value


@workflow(name="dla_rated_wf")
def rated_wf(x):  # type: ignore[no-untyped-def]
    return rated(x)


@workflow(name="dla_parent_of_rated")
def parent_of_rated(x):  # type: ignore[no-untyped-def]
    return echo(child(rated_wf, x), node_id="after_child")


def test_a_rated_child_step_left_past_an_ancestors_deadline_spends_no_unit(
    client: Client,
    start_worker: Callable[..., Worker],
    clock_shift: Callable[[timedelta], None],
) -> None:
    """A rate-limited step of a child run whose parent is past its deadline is left by the
    claim; it spent its budget's unit all the same, so the budget's other work waited the
    whole window (a day here) after the scanner had ended the run."""
    _reset("rated", "echo")
    handle = client.submit(parent_of_rated, 1, deadline=timedelta(hours=1))
    clock_shift(timedelta(hours=2))  # the workers were down past the deadline
    start_worker(*STEPS, rated, rated_wf, parent_of_rated, scanners=False)
    other = client.submit(rated_wf, 2)
    # A run queued after the child's step: once it has run, the worker's claims have had
    # the child's step in reach; rate-limited work is looked for every 0.2 s.
    assert client.submit(echo_wf, 3).result(timeout=PROMPT) == 3
    time.sleep(1.0)
    assert client.get_run(other.id).step("dla_rated").state is StepState.AVAILABLE
    start_worker(*STEPS, rated, rated_wf, parent_of_rated)  # a scanner ends the parent
    failure = _deadline_failure(client, handle.id)
    assert (failure.state, failure.error_kind) == ("failed", "deadline")
    assert other.result(timeout=PROMPT) == 2
    assert calls.get("rated", 0) == 1


def test_submit_tx_counts_the_deadline_from_the_submit(client: Client, cyclone_dsn: str) -> None:
    def db_clock(conn: psycopg.Connection[Any]) -> datetime:
        row = conn.execute("SELECT clock_timestamp()").fetchone()
        assert row is not None and isinstance(row[0], datetime)
        return row[0]

    with psycopg.connect(cyclone_dsn) as conn:
        conn.execute("SELECT pg_sleep(1.0)")  # the caller's transaction has work before
        before = db_clock(conn)
        handle = client.submit_tx(conn, signal_then_echo, 1, deadline=timedelta(seconds=5))
        after = db_clock(conn)
        conn.commit()
    run = handle.get()
    assert run.deadline_at is not None
    # Asked for 5 s from the submit (the database's clock while submit_tx ran), not from
    # the transaction's start a second earlier, and the transaction's age counted once.
    five = timedelta(seconds=5)
    assert before + five <= run.deadline_at <= after + five, (
        f"deadline_at {run.deadline_at} is not 5 s after the submit, which ran between "
        f"{before} and {after}"
    )
    client.cancel(handle.id)


# -- a run failed by its deadline: what the operator can and cannot do ---------------------


def test_operations_on_a_deadline_failed_run_are_typed(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(signal_then_echo, 1, deadline=timedelta(seconds=0.4))
    failure = _deadline_failure(client, handle.id)
    assert (failure.state, failure.error_kind) == ("failed", "deadline")
    # RunFailed names the first step the deadline cancelled (documented on RunFailed).
    assert failure.node == "dla_go"
    assert failure.error == "the run passed its deadline"
    run = handle.get()
    assert run.step("dla_go").state is StepState.CANCELLED
    assert run.step("dla_go").error_kind == "deadline"
    assert run.finished_at is not None and run.deadline_at is not None
    assert run.finished_at >= run.deadline_at
    with pytest.raises(AlreadyTerminal):
        client.signal(handle.id, "dla_go", "too late")
    with pytest.raises(AlreadyTerminal):
        client.resume(handle.id)
    with pytest.raises(AlreadyTerminal):
        client.pause(handle.id)
    with pytest.raises(AlreadyTerminal):
        client.cancel(handle.id)
    with pytest.raises(InvalidTransition, match="deadline"):
        client.retry(handle.id, "dla_go")
    # retry_many skips it, with the reason, and changes nothing.
    result = client.retry_many(RunFilter(workflows="dla_signal_then_echo", error_kinds="deadline"))
    assert (result.matched, result.acted, result.skipped) == (1, 0, 1)
    assert result.skipped_runs[0][0] == handle.id
    assert "deadline" in result.skipped_runs[0][1]
    assert handle.get().state is RunState.FAILED


def test_child_of_a_deadline_failed_parent_cannot_be_retried_alone(
    client: Client,
    start_worker: Callable[..., Worker],
    clock_shift: Callable[[timedelta], None],
) -> None:
    start_worker(*STEPS)
    handle = client.submit(parent, 1, deadline=timedelta(hours=1))
    kids = wait_until(lambda: client.children_of(handle.id), timeout=5, what="the child run")
    assert client.get_run(kids[0]["id"]).deadline_at is None  # a child run has none
    clock_shift(timedelta(hours=2))  # the parent's deadline passes
    failure = _deadline_failure(client, handle.id)
    assert failure.error_kind == "deadline"
    kid = client.handle(kids[0]["id"]).wait(timeout=5)
    assert kid.state is RunState.CANCELLED
    with pytest.raises(InvalidTransition):
        client.retry(kid.id, "dla_go")
    with pytest.raises(InvalidTransition, match="deadline"):
        client.retry(handle.id, "dla_signal_then_echo")
    with pytest.raises(AlreadyTerminal):
        client.signal(kid.id, "dla_go", "late")
    assert client.get_run(kid.id).state is RunState.CANCELLED


def test_fork_of_a_deadline_failed_run_runs_without_a_deadline(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Documented: "the run's deadline has passed -> submit a new run". A fork is a new
    run: it does not inherit the source's (passed) deadline, so it neither fails at once
    nor hangs."""
    start_worker(*STEPS)
    handle = client.submit(signal_then_echo, 1, deadline=timedelta(seconds=0.4))
    _deadline_failure(client, handle.id)
    fork = client.fork(handle.id, "dla_go")
    assert fork.get().deadline_at is None
    assert fork.get().forked_from == handle.id
    client.signal(fork.id, "dla_go", "forked")
    assert fork.result(timeout=8) == "forked"


def test_a_late_failure_after_the_deadline_is_not_retried(
    client: Client,
    start_worker: Callable[..., Worker],
    clock_shift: Callable[[timedelta], None],
) -> None:
    _reset("late_raise")
    start_worker(*STEPS)
    handle = client.submit(late_raise_wf, 1, deadline=timedelta(hours=1))
    wait_until(lambda: calls.get("late_raise") == 1, what="the handler to start")
    clock_shift(timedelta(hours=2))  # the deadline passes while the handler runs
    failure = _deadline_failure(client, handle.id)
    assert failure.error_kind == "deadline"
    assert failure.node == "dla_late_raise"
    wait_until(lambda: "late_raise" in seen, timeout=20, what="the handler to be told")
    assert seen["late_raise"] is True
    time.sleep(0.5)  # time for a (wrong) retry to be claimed
    s = handle.get().step("dla_late_raise")
    assert s.state is StepState.CANCELLED
    assert s.error_kind == "deadline"
    assert calls["late_raise"] == 1
    assert handle.get().state is RunState.FAILED


def test_deadline_rolls_back_a_transactional_step(
    client: Client,
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    clock_shift: Callable[[timedelta], None],
) -> None:
    _reset("tx_write")
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS dla_written (x int)")
        conn.execute("TRUNCATE dla_written")
    start_worker(*STEPS)
    handle = client.submit(tx_write_wf, 7, deadline=timedelta(hours=1))
    wait_until(lambda: calls.get("tx_write") == 1, what="the handler to write")
    clock_shift(timedelta(hours=2))  # the deadline passes while the handler's write is open
    failure = _deadline_failure(client, handle.id)
    assert failure.error_kind == "deadline"
    wait_until(lambda: "tx_write" in seen, timeout=20, what="the handler to be told")
    assert seen["tx_write"] is True
    time.sleep(0.3)
    with psycopg.connect(cyclone_dsn) as conn:
        rows = conn.execute("SELECT x FROM dla_written").fetchall()
    assert rows == [], "the writes of a step its run's deadline cancelled were committed"
    assert handle.get().step("dla_tx_write").state is StepState.CANCELLED


# -- entry points: debounce, submit_once, the async client, the largest deadline ------------


def test_debounce_deadline_shorter_than_the_delay_fails_before_the_start(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Documented: the deadline counts from the submit, the start is delay after it."""
    _reset("echo")
    start_worker(*STEPS)
    handle = client.submit(
        echo_wf,
        {"doc": "d1"},
        deadline=timedelta(seconds=0.3),
        debounce=Debounce(key="doc", delay=timedelta(seconds=2)),
    )
    failure = _deadline_failure(client, handle.id)
    assert failure.error_kind == "deadline"
    assert calls.get("echo", 0) == 0
    # The window's run ended: the next submit of the key opens a new window and run.
    again = client.submit(
        echo_wf, {"doc": "d1"}, debounce=Debounce(key="doc", delay=timedelta(seconds=0.1))
    )
    assert (again.created, again.id != handle.id) == (True, True)
    assert again.result(timeout=8) == {"doc": "d1"}


def test_a_debounced_submit_after_the_windows_deadline_passed_does_not_revive_its_run(
    client: Client, clock_shift: Callable[[timedelta], None]
) -> None:
    """No scanner runs here. The window's run passed its deadline before the next submit
    of its key: that run ended at its deadline (first wins); the submit does not give it
    a new deadline and input, it opens a new window and run."""
    debounce = Debounce(key="doc", delay=timedelta(hours=2))
    one: dict[str, Any] = {"doc": "late", "v": 1}
    two: dict[str, Any] = {"doc": "late", "v": 2}
    first = client.submit(echo_wf, one, deadline=timedelta(hours=1), debounce=debounce)
    clock_shift(timedelta(hours=1, minutes=30))
    again = client.submit(echo_wf, two, deadline=timedelta(hours=1), debounce=debounce)
    assert (again.created, again.id != first.id) == (True, True)
    ended = first.get()
    assert ended.state is RunState.FAILED and ended.input == one
    assert {s.error_kind for s in ended.steps if s.error_kind} == {"deadline"}
    assert again.get().input == two
    client.cancel(again.id)


def test_debounce_takes_the_last_submits_deadline(client: Client) -> None:
    debounce = Debounce(key="doc", delay=timedelta(seconds=30))
    first = client.submit(echo_wf, {"doc": "d2"}, deadline=timedelta(hours=1), debounce=debounce)
    assert first.get().deadline_at is not None
    second = client.submit(echo_wf, {"doc": "d2"}, debounce=debounce)
    assert (second.id, second.created) == (first.id, False)
    assert first.get().deadline_at is None  # the last submit gave none
    third = client.submit(echo_wf, {"doc": "d2"}, deadline=timedelta(minutes=5), debounce=debounce)
    assert third.id == first.id
    run = first.get()
    assert run.deadline_at is not None
    assert run.deadline_at - run.updated_at <= timedelta(minutes=5, seconds=1)
    with pytest.raises(InvalidArgument):
        client.submit(echo_wf, {"doc": "d2"}, deadline=timedelta(0), debounce=debounce)
    assert first.get().deadline_at == run.deadline_at  # the refused submit changed nothing
    client.cancel(first.id)


def test_submit_once_of_a_held_key_keeps_the_first_deadline(client: Client) -> None:
    first = client.submit_once(signal_then_echo, 1, key="dla_once", deadline=timedelta(hours=1))
    again = client.submit_once(signal_then_echo, 1, key="dla_once", deadline=timedelta(days=3))
    none = client.submit_once(signal_then_echo, 1, key="dla_once")
    assert (again.id, again.created, none.id, none.created) == (first.id, False, first.id, False)
    run = first.get()
    assert run.deadline_at is not None
    # The first submit's hour (counted from its statement), not the second's three days.
    assert timedelta(hours=1) <= run.deadline_at - run.created_at < timedelta(hours=1, seconds=1)
    client.cancel(first.id)


def test_the_largest_deadline_is_accepted_and_survives_pause_and_resume(client: Client) -> None:
    handle = client.submit(signal_then_echo, 1, deadline=MAX_DURATION)
    client.pause(handle.id)
    client.resume(handle.id)
    run = handle.get()
    assert run.state is RunState.RUNNING
    assert run.deadline_at is not None
    assert run.deadline_at - run.created_at >= MAX_DURATION
    with pytest.raises(InvalidArgument):
        client.submit(signal_then_echo, 1, deadline=MAX_DURATION + timedelta(microseconds=1))
    client.cancel(handle.id)


class _Span(timedelta):
    """A timedelta subclass (as some libraries hand out)."""


def test_a_timedelta_subclass_is_a_deadline(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    handle = client.submit(signal_then_echo, 1, deadline=_Span(seconds=0.4))
    (many,) = client.submit_many(signal_then_echo, [2], deadline=_Span(seconds=0.4))
    for h in (handle, many):
        assert _deadline_failure(client, h.id).error_kind == "deadline"


def test_enqueue_takes_no_deadline(client: Client) -> None:
    """Standalone work has a step timeout, not a run deadline: the keyword is refused."""
    with pytest.raises(TypeError):
        client.enqueue(echo, 1, deadline=timedelta(seconds=1))  # type: ignore[call-arg]


def test_async_client_applies_and_checks_the_deadline(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)

    async def scenario() -> None:
        async with AsyncClient(cyclone_dsn) as aclient:
            one = await aclient.submit(signal_then_echo, 1, deadline=timedelta(seconds=0.4))
            many = await aclient.submit_many(
                signal_then_echo, [2, 3], deadline=timedelta(seconds=0.4)
            )
            once = await aclient.submit_once(
                signal_then_echo, 4, key="dla_async_once", deadline=timedelta(seconds=0.4)
            )
            for handle in [one, *many, once]:
                with pytest.raises(RunFailed) as failed:
                    await handle.result(timeout=8)
                assert failed.value.error_kind == "deadline"
            bads: tuple[Any, ...] = (timedelta(0), timedelta(seconds=-1), 1.5, timedelta.max)
            for bad in bads:
                with pytest.raises(InvalidArgument):
                    await aclient.submit(signal_then_echo, 1, deadline=bad)
                with pytest.raises(InvalidArgument):
                    await aclient.submit_many(signal_then_echo, [1], deadline=bad)
                with pytest.raises(InvalidArgument):
                    await aclient.submit_once(signal_then_echo, 1, key="dla_bad", deadline=bad)

    asyncio.run(scenario())


def test_a_handler_sees_the_run_deadline(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*STEPS)
    with_deadline = client.submit(ctx_deadline_wf, 1, deadline=timedelta(hours=1))
    without = client.submit(ctx_deadline_wf, 2)
    seen_deadline = with_deadline.result(timeout=8)
    run = with_deadline.get()
    assert run.deadline_at is not None
    assert seen_deadline == run.deadline_at.isoformat()
    assert without.result(timeout=8) is None
