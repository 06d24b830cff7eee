"""Audit of the testing helpers Cyclone ships for its users (cyclone_dsl.testing: the pytest
plugin's fixtures, shifted_clock / set_clock_shift, failpoints, strategies) and of
standalone work ordering keys (enqueue with unique_key, sequence_key, priority and
scheduled_at).

The plugin is exercised the way a user's suite meets it: a test file run by pytest in a
subprocess (pytest's ``pytester``), against this session's server.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from cyclone_dsl import (
    Client,
    InvalidArgument,
    RunState,
    StepContext,
    StepState,
    Worker,
    action,
    for_each,
    step,
    wait_signal,
    wait_timer,
    workflow,
)
from cyclone_dsl.testing import set_clock_shift, shifted_clock
from cyclone_dsl.testing.failpoints import POINTS, FailpointError, arm, armed, disarm
from tests.waiting import expire_leases_until, wait_until

pytest_plugins = ["pytester"]

StartWorker = Callable[..., Worker]

#: What the recording handlers saw, in the order they ran: (label, value).
seen: list[tuple[str, object]] = []
seen_lock = threading.Lock()


def note(label: str, value: object) -> None:
    with seen_lock:
        seen.append((label, value))


def seen_for(label: str) -> list[object]:
    with seen_lock:
        return [v for k, v in seen if k == label]


@pytest.fixture(autouse=True)
def _clear_seen() -> None:
    with seen_lock:
        seen.clear()


@action(name="tha_seq", queue="tha_seq")
def seq(x: object) -> None:
    note("seq", x)


@action(name="tha_seq_other", queue="tha_seq")
def seq_other(x: object) -> None:
    note("seq", x)


@step(name="tha_seq_fail", queue="tha_seq", max_attempts=1)
def seq_fail(x: object) -> object:
    note("seq", x)
    raise RuntimeError(f"tha_seq_fail {x}")


@step(name="tha_seq_block", queue="tha_seq")
def seq_block(x: object, ctx: StepContext) -> object:
    note("seq", x)
    ctx.wait_cancelled(10)
    return x


@action(name="tha_prio", queue="tha_prio")
def prio(x: object) -> None:
    note("prio", x)


@step(name="tha_echo", queue="tha_echo")
def echo(x: object) -> object:
    return x


def far_future() -> datetime:
    return datetime.now(UTC) + timedelta(days=3650)


def seq_worker(start_worker: StartWorker, *kinds: object) -> Worker:
    return start_worker(*(kinds or (seq,)), queues=["tha_seq"], concurrency=1)


# -- sequence keys: a head that ends badly releases the ones behind it --------------------


def test_a_sequence_runs_on_after_its_head_fails_for_good(
    client: Client, start_worker: StartWorker
) -> None:
    head = client.enqueue(seq_fail, "head", sequence_key="tha-fail")
    nxt = client.enqueue(seq, "next", sequence_key="tha-fail")
    seq_worker(start_worker, seq, seq_fail)
    nxt.wait(timeout=10)
    assert client.get_run(head.id).state is RunState.FAILED
    assert client.get_run(nxt.id).state is RunState.COMPLETED
    assert seen_for("seq") == ["head", "next"]


def test_a_sequence_runs_on_after_its_waiting_head_is_cancelled(
    client: Client, start_worker: StartWorker
) -> None:
    head = client.enqueue(seq, "head", sequence_key="tha-cancel-wait")
    nxt = client.enqueue(seq, "next", sequence_key="tha-cancel-wait")
    client.cancel(head.id)
    seq_worker(start_worker)
    nxt.wait(timeout=10)
    assert seen_for("seq") == ["next"]
    assert client.get_run(head.id).state is RunState.CANCELLED


def test_a_sequence_runs_on_after_its_running_head_is_cancelled(
    client: Client, start_worker: StartWorker
) -> None:
    head = client.enqueue(seq_block, "head", sequence_key="tha-cancel-run")
    nxt = client.enqueue(seq, "next", sequence_key="tha-cancel-run")
    start_worker(seq, seq_block, queues=["tha_seq"], concurrency=2)
    wait_until(lambda: seen_for("seq") == ["head"], timeout=10, what="the head running")
    time.sleep(0.5)
    assert seen_for("seq") == ["head"], "a running head holds the rest of its sequence"
    client.cancel(head.id)
    nxt.wait(timeout=10)
    assert seen_for("seq") == ["head", "next"]


def test_a_sequence_key_holds_across_kinds_and_is_ordered_by_scheduled_at_then_id(
    client: Client, start_worker: StartWorker
) -> None:
    now = datetime.now(UTC)
    c = client.enqueue(seq, "c", sequence_key="tha-order", scheduled_at=now - timedelta(seconds=1))
    a = client.enqueue(
        seq_other, "a", sequence_key="tha-order", scheduled_at=now - timedelta(seconds=3)
    )
    b1 = client.enqueue(
        seq, "b1", sequence_key="tha-order", scheduled_at=now - timedelta(seconds=2)
    )
    b2 = client.enqueue(
        seq_other, "b2", sequence_key="tha-order", scheduled_at=now - timedelta(seconds=2)
    )
    start_worker(seq, seq_other, queues=["tha_seq"], concurrency=4)
    for h in (a, b1, b2, c):
        h.wait(timeout=10)
    assert seen_for("seq") == ["a", "b1", "b2", "c"]


def test_priority_does_not_let_a_later_step_jump_its_sequence(
    client: Client, start_worker: StartWorker
) -> None:
    client.enqueue(seq, "first-low", sequence_key="tha-prio", priority=-10)
    client.enqueue(seq, "second-high", sequence_key="tha-prio", priority=10)
    client.enqueue(seq, "free-mid", priority=0)
    seq_worker(start_worker)
    wait_until(lambda: len(seen_for("seq")) == 3, timeout=10, what="all three ran")
    got = seen_for("seq")
    assert got.index("first-low") < got.index("second-high")


def test_a_delayed_head_of_a_sequence_lets_the_due_steps_behind_it_wait(
    client: Client, start_worker: StartWorker
) -> None:
    """(scheduled_at, id) order: the delayed step is last; a step enqueued before it with an
    earlier start runs, one scheduled later waits behind it."""
    soon = datetime.now(UTC) + timedelta(hours=1)
    early = client.enqueue(seq, "early", sequence_key="tha-delay")
    delayed = client.enqueue(seq, "delayed", sequence_key="tha-delay", scheduled_at=soon)
    after = client.enqueue(
        seq, "after", sequence_key="tha-delay", scheduled_at=soon + timedelta(minutes=1)
    )
    seq_worker(start_worker)
    early.wait(timeout=10)
    time.sleep(0.5)
    assert seen_for("seq") == ["early"]
    assert client.get_run(delayed.id).steps[0].state is StepState.AVAILABLE
    assert client.get_run(after.id).steps[0].state is StepState.AVAILABLE


# -- unique keys ---------------------------------------------------------------------------


def test_unique_and_sequence_keys_together(client: Client, start_worker: StartWorker) -> None:
    first = client.enqueue(seq, "u1", unique_key="tha-u", sequence_key="tha-us")
    dup = client.enqueue(seq, "u1-again", unique_key="tha-u", sequence_key="tha-us")
    other = client.enqueue(seq, "o1", sequence_key="tha-us")
    assert first.created and not dup.created and dup.id == first.id
    seq_worker(start_worker)
    other.wait(timeout=10)
    assert seen_for("seq") == ["u1", "o1"]
    third = client.enqueue(seq, "u2", unique_key="tha-u", sequence_key="tha-us")
    assert third.created and third.id != first.id
    third.wait(timeout=10)
    assert seen_for("seq") == ["u1", "o1", "u2"]


def test_a_duplicate_unique_enqueue_changes_nothing_of_the_holder(client: Client) -> None:
    when = far_future()
    first = client.enqueue(echo, {"v": 1}, unique_key="tha-dup", priority=1, scheduled_at=when)
    again = client.enqueue(echo, {"v": 2}, unique_key="tha-dup", priority=9, sequence_key="s")
    assert not again.created and again.id == first.id
    (s,) = client.get_run(first.id).steps
    assert (s.input, s.priority, s.scheduled_at) == ({"v": 1}, 1, when)
    assert len(client.list_runs()) == 1


# -- bad key values: typed errors, nothing written ------------------------------------------

BAD_KEYS = [
    pytest.param("", id="empty"),
    pytest.param("k" * 1025, id="1025-bytes"),
    pytest.param("é" * 513, id="1026-utf8-bytes"),
    pytest.param("a\x00b", id="nul"),
    pytest.param("\ud800", id="lone-surrogate"),
    pytest.param(5, id="int"),
    pytest.param(b"key", id="bytes"),
    pytest.param(["k"], id="list"),
]


@pytest.mark.parametrize("option", ["unique_key", "sequence_key"])
@pytest.mark.parametrize("value", BAD_KEYS)
def test_bad_key_values_raise_invalid_argument_and_write_nothing(
    client: Client, option: str, value: object
) -> None:
    with pytest.raises(InvalidArgument):
        client.enqueue(echo, 1, **{option: value})  # type: ignore[arg-type]
    assert client.list_runs() == []


def test_the_largest_key_is_accepted(client: Client) -> None:
    key = "é" * 512  # 1,024 bytes of UTF-8
    h = client.enqueue(echo, 1, unique_key=key, sequence_key=key)
    assert h.created
    assert client.enqueue(echo, 2, unique_key=key).id == h.id


@pytest.mark.parametrize(
    "priority", [pytest.param("high", id="str"), 1.5, True, 2**31, -(2**31) - 1, float("nan")]
)
def test_bad_priorities_raise_invalid_argument(client: Client, priority: object) -> None:
    with pytest.raises(InvalidArgument):
        client.enqueue(echo, 1, priority=priority)  # type: ignore[arg-type]
    assert client.list_runs() == []


# -- the movable clock ------------------------------------------------------------------


@step(name="tha_clock_echo", queue="tha_clock")
def clock_echo(x: object) -> object:
    return x


@workflow(name="tha_timer_wf")
def timer_wf(x):  # type: ignore[no-untyped-def]
    return clock_echo(x, after=[wait_timer(timedelta(hours=1))])


@workflow(name="tha_signal_timeout_wf")
def signal_timeout_wf(x):  # type: ignore[no-untyped-def]
    return clock_echo(wait_signal("tha_go", timeout=timedelta(hours=1)))


@workflow(name="tha_deadline_wf")
def deadline_wf(x):  # type: ignore[no-untyped-def]
    return clock_echo(wait_signal("tha_never"))


def clock_worker(start_worker: StartWorker) -> Worker:
    return start_worker(clock_echo, timer_wf, signal_timeout_wf, deadline_wf, queues=["tha_clock"])


def test_shifted_clock_restores_the_shift_when_its_block_raises(client: Client) -> None:
    with (  # noqa: PT012
        pytest.raises(RuntimeError, match="inner"),
        shifted_clock(timedelta(hours=5)),
        shifted_clock(timedelta(hours=2)),
    ):
        inner = client.enqueue(echo, 1)
        raise RuntimeError("inner")
    after = client.enqueue(echo, 2)
    at_inner = client.get_run(inner.id).steps[0].scheduled_at
    at_after = client.get_run(after.id).steps[0].scheduled_at
    assert timedelta(hours=1, minutes=59) < at_inner - at_after < timedelta(hours=2, minutes=1)
    assert abs(at_after - datetime.now(UTC)) < timedelta(minutes=1)


def test_a_delayed_start_is_never_claimed_before_its_time_on_the_shifted_clock(
    client: Client, start_worker: StartWorker
) -> None:
    when = datetime.now(UTC) + timedelta(hours=1)
    handle = client.enqueue(clock_echo, "later", scheduled_at=when, priority=100)
    due = client.enqueue(clock_echo, "due", priority=-100)
    clock_worker(start_worker)
    assert due.result(timeout=10) == "due"  # the top priority is no head start
    with shifted_clock(timedelta(minutes=55)):
        time.sleep(0.8)  # four polls of the worker
        (s,) = client.get_run(handle.id).steps
        assert s.state is StepState.AVAILABLE and s.started_at is None
    with shifted_clock(timedelta(minutes=65)):
        assert handle.result(timeout=10) == "later"
    (s,) = client.get_run(handle.id).steps
    assert s.started_at is not None and s.started_at >= when


def test_the_shifted_clock_moves_timers_signal_timeouts_and_deadlines_together(
    client: Client, start_worker: StartWorker
) -> None:
    timer = client.submit(timer_wf, "t")
    timeout = client.submit(signal_timeout_wf, "s")
    deadline = client.submit(deadline_wf, "d", deadline=timedelta(hours=1))
    clock_worker(start_worker)
    with shifted_clock(timedelta(minutes=50)):
        time.sleep(0.8)  # four scanner passes: nothing is due yet
        assert [client.get_run(h.id).state for h in (timer, timeout, deadline)] == [
            RunState.RUNNING
        ] * 3
    with shifted_clock(timedelta(minutes=70)):
        assert timer.result(timeout=10) == "t"
        wait_until(
            lambda: (
                client.get_run(timeout.id).state is RunState.FAILED
                and client.get_run(deadline.id).state is RunState.FAILED
            ),
            timeout=10,
            what="the signal timeout and the deadline",
        )
    kinds = {s.error_kind for s in client.get_run(timeout.id).steps} - {None}
    assert "signal_timeout" in kinds


#: Set by the test once it saw the first execution's lease reclaimed.
first_hold_reclaimed = threading.Event()


@step(name="tha_hold", queue="tha_clock")
def hold(x: object, ctx: StepContext) -> object:
    note("hold", ctx.attempt)
    if len(seen_for("hold")) == 1:
        # The first execution runs until the test saw its lease reclaimed: ended sooner,
        # it could complete before a scanner on a loaded machine got to it.
        first_hold_reclaimed.wait(20)
    else:
        ctx.wait_cancelled(1.5)
    return x


def test_the_shifted_clock_expires_a_running_steps_lease(
    client: Client, start_worker: StartWorker
) -> None:
    """A lease of 30 s, heartbeated every few seconds, expires at once for a clock two
    hours ahead: the scanner reclaims the step (a crash, not a failure) and it runs again."""
    first_hold_reclaimed.clear()
    handle = client.enqueue(hold, "held")
    start_worker(hold, queues=["tha_clock"], lease=30.0, concurrency=2)
    try:
        wait_until(lambda: seen_for("hold") == [1], timeout=10, what="the first execution")
        with shifted_clock(timedelta(hours=2)):
            expire_leases_until(
                lambda: client.get_run(handle.id).steps[0].reclaims >= 1,
                what="the lease reclaimed",
            )
            first_hold_reclaimed.set()
            assert handle.result(timeout=10) == "held"
    finally:
        first_hold_reclaimed.set()
    (s,) = client.get_run(handle.id).steps
    assert s.attempt == 0, "a reclaim does not count as a failed attempt"
    assert len(seen_for("hold")) >= 2


# -- failpoints ----------------------------------------------------------------------------

#: The failpoints docs/howto/testing.md names.
DOCUMENTED_POINTS = {
    "complete.before_commit",
    "fail.before_commit",
    "child.after_insert",
    "fanout.after_expand",
    "schedule.after_fire_record",
    "scan.leader",
    "claim.between_queues",
    "claim.after_gate_look",
    "worker.before_start",
}


@step(name="tha_item", queue="tha_fan")
def item(x: int) -> int:
    return x * 10


@workflow(name="tha_fan_wf")
def fan_wf(x):  # type: ignore[no-untyped-def]
    return for_each(item, over=[1, 2, 3])


def test_the_documented_failpoints_are_the_ones_that_exist() -> None:
    assert set(POINTS) == DOCUMENTED_POINTS
    page = (Path(__file__).resolve().parents[2] / "docs" / "howto" / "testing.md").read_text()
    assert {p for p in DOCUMENTED_POINTS if f"`{p}`" not in page} == set()


def test_arm_and_disarm_by_name_and_all_at_once() -> None:
    assert armed() == []
    try:
        arm("scan.leader", "raise")
        arm("claim.between_queues", lambda: None)
        assert armed() == ["claim.between_queues", "scan.leader"]
        disarm("scan.leader")
        disarm("scan.leader")  # twice: a no-op
        assert armed() == ["claim.between_queues"]
        with pytest.raises(ValueError, match="unknown failpoint"):
            arm("complete.after_commit", "raise")
        with pytest.raises(ValueError, match="failpoint action"):
            arm("scan.leader", "explode")
        assert armed() == ["claim.between_queues"]
    finally:
        disarm()
    assert armed() == []


def test_the_documented_fan_out_failpoint_rolls_the_submit_back_whole(
    client: Client, start_worker: StartWorker
) -> None:
    """docs/howto/testing.md: armed with ``raise`` at ``fanout.after_expand``, a run whose
    fan-out activates rolls back whole (a root fan-out activates in the submit)."""
    arm("fanout.after_expand", "raise")
    try:
        with pytest.raises(FailpointError):
            client.submit(fan_wf, None)
        assert client.list_runs() == []
    finally:
        disarm()
    start_worker(item, fan_wf, queues=["tha_fan"])
    assert client.submit(fan_wf, None).result(timeout=10) == [10, 20, 30]


ARMED_IN_CHILD = "from cyclone_dsl.testing.failpoints import armed; print(','.join(armed()))"


@pytest.mark.parametrize(
    ("setting", "armed_names", "error"),
    [
        ("child.after_insert=exit, scan.leader", "child.after_insert,scan.leader", None),
        ("", "", None),
        ("complete.after_commit=exit", None, "unknown failpoint 'complete.after_commit'"),
        ("scan.leader=explode", None, "a failpoint action is"),
    ],
    ids=["two", "empty", "unknown-name", "unknown-action"],
)
def test_failpoints_armed_from_the_environment_of_a_subprocess(
    setting: str, armed_names: str | None, error: str | None
) -> None:
    env = {**os.environ, "CYCLONE_FAILPOINTS": setting}
    out = subprocess.run(
        [sys.executable, "-c", ARMED_IN_CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if error is None:
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == armed_names
    else:  # a typo in the setting fails the process loudly rather than arming nothing
        assert out.returncode != 0
        assert "ValueError" in out.stderr and error in out.stderr, out.stderr


# -- the pytest plugin, as a user's suite meets it -----------------------------------------


@pytest.fixture
def user_suite(pytester: pytest.Pytester, cyclone_admin_dsn: str, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Run a user's test files with only the installed plugin (none of this repo's conftest),
    against this session's server."""
    monkeypatch.setenv("CYCLONE_DATABASE_URL", cyclone_admin_dsn)

    def run(**files: str) -> pytest.RunResult:
        pytester.makepyfile(**files)
        return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", "-s", timeout=60)

    return run


MYAPP = """
from cyclone_dsl import step, wait_signal, workflow


@step(name="tha_user_charge")
def charge(approval):
    return {"charged": 140, "by": approval["by"]}


@workflow(name="tha_user_orders")
def orders(order_id):
    return charge(wait_signal("approved"))
"""

DOC_EXAMPLE = """
import myapp
from cyclone_dsl import Client, Worker


def test_order_flow(cyclone_dsn: str) -> None:
    with Worker(cyclone_dsn, [myapp]), Client(cyclone_dsn) as client:
        handle = client.submit(myapp.orders, "o-1")
        client.signal(handle.id, "approved", {"by": "test"})
        assert handle.result(timeout=10)["charged"] == 140


def test_a_second_test_starts_empty(cyclone_dsn: str) -> None:
    with Client(cyclone_dsn) as client:
        assert client.list_runs() == []
"""


def test_the_documented_user_test_runs_and_the_next_test_starts_empty(user_suite) -> None:  # type: ignore[no-untyped-def]
    result = user_suite(myapp=MYAPP, test_user=DOC_EXAMPLE)
    result.assert_outcomes(passed=2)


LEAKED_WORKER = """
import time

from cyclone_dsl import Client, RunState, Worker, action


@action(name="tha_user_mark")
def mark(x):
    pass


def test_1_starts_a_worker_and_forgets_it(cyclone_dsn):
    Worker(cyclone_dsn, [mark], poll_interval=0.05, scan_interval=0.1).start()


def test_2_nobody_here_runs_a_worker(cyclone_dsn):
    with Client(cyclone_dsn) as client:
        handle = client.enqueue(mark, 1)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert client.get_run(handle.id).state is RunState.RUNNING, "a leaked worker ran it"
            time.sleep(0.05)
"""


def test_a_worker_leaked_by_a_passing_test_does_not_reach_the_next_test(user_suite) -> None:  # type: ignore[no-untyped-def]
    result = user_suite(test_user=LEAKED_WORKER)
    # Isolation holds if the leak is reported (an error) or the next test is untouched.
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0, result.stdout.str()


TEARDOWN_ERROR = """
import pytest

seen = []


@pytest.fixture
def users_worker(cyclone_schema):
    yield
    raise RuntimeError("the user's teardown failed (say, before it stopped its worker)")


def test_1_errors_in_teardown(users_worker, cyclone_schema):
    seen.append(cyclone_schema)


def test_2_gets_a_schema(cyclone_schema):
    assert cyclone_schema not in seen, "the schema of a test that did not pass was reused"
"""


def test_the_schema_of_a_test_that_errored_in_teardown_is_not_reused(user_suite) -> None:  # type: ignore[no-untyped-def]
    result = user_suite(test_user=TEARDOWN_ERROR)
    result.assert_outcomes(passed=2, errors=1)


# -- the clock helper's argument --------------------------------------------------------


@pytest.mark.parametrize("shift", [1.5, None], ids=["float", "none"])
def test_a_shift_that_is_not_a_timedelta_is_refused_at_once(client: Client, shift: object) -> None:
    try:
        with pytest.raises((TypeError, InvalidArgument)):
            set_clock_shift(shift)  # type: ignore[arg-type]
        client.enqueue(echo, 1)  # the process's clock still works
    finally:
        set_clock_shift(timedelta(0))
