"""Audit: pause and resume against every kind of node at every moment of its life
(docs/concepts/waits.md "Pause and resume", fan-out-and-children.md, flow-control.md,
docs/workflows.md).

The shape looked for: a node that was not yet activated when its run was paused, whose
dependency completed inside the pause, must be activated at the resume exactly as it
would have been without the pause (a wait takes its buffered signals and counts its
timeout from then, a timer counts from then, a child run starts, a fan-out expands, a
condition is judged), with the same result and each handler run the expected number of
times.

Tests marked ``xfail(strict=True)`` show a finding: they fail today and pass once fixed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import pytest

from cyclone_dsl import (
    AlreadyTerminal,
    Client,
    Concurrency,
    Delivery,
    InvalidTransition,
    MailboxFull,
    Registry,
    Run,
    RunFailed,
    RunState,
    StepState,
    Worker,
    action,
    child,
    define_result,
    for_each,
    step,
    wait_any,
    wait_n,
    wait_signal,
    wait_timer,
    workflow,
)
from cyclone_dsl.testing import set_clock_shift
from tests.waiting import wait_until

StartWorker = Callable[..., Worker]
Clock = Callable[[datetime], None]

# -- handler controls -------------------------------------------------------------------------

GATES: dict[str, threading.Event] = {}
CALLS: Counter[str] = Counter()
CALLS_LOCK = threading.Lock()
RUNNING: Counter[str] = Counter()
MOST: Counter[str] = Counter()


def gate(name: str) -> threading.Event:
    with CALLS_LOCK:
        return GATES.setdefault(name, threading.Event())


def called(name: str) -> None:
    with CALLS_LOCK:
        CALLS[name] += 1


@pytest.fixture
def start_worker(start_worker: StartWorker) -> StartWorker:
    """Workers that poll and scan every 0.2 s: ``settle`` gives them a few passes."""

    def start(*objects: Any, **options: Any) -> Worker:
        options.setdefault("poll_interval", 0.2)
        options.setdefault("scan_interval", 0.2)
        return start_worker(*objects, **options)

    return start


@pytest.fixture(autouse=True)
def _fresh_gates(start_worker: StartWorker) -> Iterator[None]:
    """Set up after start_worker, so torn down before it: blocked handlers are released
    before the workers stop, and the clock shift is back to zero."""
    GATES.clear()
    CALLS.clear()
    RUNNING.clear()
    MOST.clear()
    yield
    set_clock_shift(timedelta(0))
    for event in list(GATES.values()):
        event.set()


# -- steps ------------------------------------------------------------------------------------


@step(name="pra_echo")
def echo(value: object) -> object:
    called("pra_echo")
    return value


@step(name="pra_last")
def last(value: object) -> object:
    called("pra_last")
    return value


@step(name="pra_gated")
def gated(value: Any) -> Any:
    """Blocks on the gate "gated" (the test opens it)."""
    called("pra_gated")
    gate("gated").wait(15)
    return value


@step(name="pra_list")
def make_list(n: int) -> list[int]:
    called("pra_list")
    return list(range(n))


@step(name="pra_gated_list")
def gated_list(value: Any) -> Any:
    """The fan-out's source, blocked on the gate "list": returns its input as it is."""
    called("pra_gated_list")
    gate("list").wait(15)
    return value


@step(name="pra_item")
def item(x: int) -> int:
    called(f"pra_item[{x}]")
    return x * 10


@step(name="pra_held_item")
def held_item(x: int) -> int:
    """An item that holds its slot until the gate "items" opens (the test opens it)."""
    called(f"pra_item[{x}]")
    gate("items").wait(15)
    return x * 10


@step(name="pra_kstep")
def kstep(x: int) -> int:
    called(f"pra_kstep[{x}]")
    return x + 100


@step(name="pra_collect")
def collect(values: list[Any]) -> list[Any]:
    called("pra_collect")
    return values


@action(name="pra_side")
def side(value: object) -> None:
    called("pra_side")


@step(name="pra_one_step")
def one_step(value: str) -> str:
    with CALLS_LOCK:
        CALLS[f"pra_one:{value}"] += 1
        RUNNING["one"] += 1
        MOST["one"] = max(MOST["one"], RUNNING["one"])
    try:
        if value == "a":
            gate("one").wait(15)
        return value
    finally:
        with CALLS_LOCK:
            RUNNING["one"] -= 1


# -- workflows --------------------------------------------------------------------------------


@workflow(name="pra_wait_after")
def wait_after(x):  # type: ignore[no-untyped-def]
    first = gated(x)
    return echo(wait_signal("pra_go", timeout=timedelta(hours=1), after=[first]))


@workflow(name="pra_any_after")
def any_after(x):  # type: ignore[no-untyped-def]
    first = echo(x)
    return last(wait_any(["pra_yes", "pra_no"], after=[first]))


@workflow(name="pra_n_after")
def n_after(x):  # type: ignore[no-untyped-def]
    first = echo(x)
    return last(wait_n("pra_vote", 3, timeout=timedelta(hours=1), after=[first]))


@workflow(name="pra_timer_after")
def timer_after(x):  # type: ignore[no-untyped-def]
    first = gated(x)
    t = wait_timer(timedelta(hours=1), after=[first])
    return echo(x, after=[t])


@workflow(name="pra_kid")
def kid(x):  # type: ignore[no-untyped-def]
    return kstep(x)


@workflow(name="pra_parent_late")
def parent_late(x):  # type: ignore[no-untyped-def]
    first = echo(x)
    return last(child(kid, first))


@workflow(name="pra_kid_sig")
def kid_sig(x):  # type: ignore[no-untyped-def]
    return wait_signal("pra_kid_go")


@workflow(name="pra_parent_sig")
def parent_sig(x):  # type: ignore[no-untyped-def]
    return last(child(kid_sig, x))


@workflow(name="pra_parent_sig_tail")
def parent_sig_tail(x):  # type: ignore[no-untyped-def]
    return child(kid_sig, x)


@workflow(name="pra_kid_late_sig")
def kid_late_sig(x):  # type: ignore[no-untyped-def]
    first = kstep(x)
    return collect([first, wait_signal("pra_kid_late", after=[first])])


@workflow(name="pra_parent_late_sig")
def parent_late_sig(x):  # type: ignore[no-untyped-def]
    return last(child(kid_late_sig, x))


@workflow(name="pra_fan_kids")
def fan_kids(x):  # type: ignore[no-untyped-def]
    return last(for_each(kid, over=gated_list(x), max_parallel=2))


@workflow(name="pra_fan_steps_guarded")
def fan_steps_guarded(x):  # type: ignore[no-untyped-def]
    return last(for_each(held_item, over=gated_list(x), max_parallel=2, max_items=3))


@workflow(name="pra_fan_kids_tail")
def fan_kids_tail(x):  # type: ignore[no-untyped-def]
    return for_each(kid, over=gated_list(x), max_parallel=2)


@workflow(name="pra_cond")
def cond(x):  # type: ignore[no-untyped-def]
    v = gated(x)
    big = child(kid, v, when=v.gt(5))
    small = wait_signal("pra_small", when=v.le(5))
    many = for_each(item, over=make_list(v, when=v.gt(5)), max_parallel=1)
    return collect([big, small, many])


@workflow(name="pra_cond_tail")
def cond_tail(x):  # type: ignore[no-untyped-def]
    v = gated(x)
    child(kid, v, when=v.gt(5))
    return for_each(item, over=v, when=v.gt(5))


@workflow(name="pra_defres")
def defres(x):  # type: ignore[no-untyped-def]
    a = gated(x)
    r = echo(a)
    define_result(r)
    side(r)
    last(x, after=[r])


@workflow(name="pra_one", concurrency=Concurrency(limit=1))
def one(x):  # type: ignore[no-untyped-def]
    return one_step(x)


@workflow(name="pra_mid")
def mid(x):  # type: ignore[no-untyped-def]
    return echo(child(kid, x))


@workflow(name="pra_top")
def top(x):  # type: ignore[no-untyped-def]
    return last(child(mid, x))


@workflow(name="pra_fan_sig_kids")
def fan_sig_kids(xs):  # type: ignore[no-untyped-def]
    return for_each(kid_sig, over=xs, max_parallel=1)


@workflow(name="pra_kid_skip")
def kid_skip(x):  # type: ignore[no-untyped-def]
    return kstep(x, when=x.gt(1000))  # skipped at submit for small inputs: ends at once


@workflow(name="pra_parent_skip_kid")
def parent_skip_kid(x):  # type: ignore[no-untyped-def]
    return child(kid_skip, gated(x))


@workflow(name="pra_fan_skip_kids")
def fan_skip_kids(x):  # type: ignore[no-untyped-def]
    return for_each(kid_skip, over=gated_list(x), max_parallel=1)


STEPS = (echo, last, gated, make_list, gated_list, item, held_item, kstep, collect, side, one_step)
WORKFLOWS = (
    wait_after,
    any_after,
    n_after,
    timer_after,
    kid,
    parent_late,
    kid_sig,
    parent_sig,
    parent_sig_tail,
    kid_late_sig,
    parent_late_sig,
    fan_kids,
    fan_steps_guarded,
    fan_kids_tail,
    cond,
    cond_tail,
    defres,
    one,
    mid,
    top,
    fan_sig_kids,
    kid_skip,
    parent_skip_kid,
    fan_skip_kids,
)
EVERYTHING = (*STEPS, *WORKFLOWS)


# -- helpers ----------------------------------------------------------------------------------


def run_of(client: Client, run_id: int) -> Run:
    return client.get_run(run_id)


def state(client: Client, run_id: int, node: str) -> StepState:
    return client.get_run(run_id).step(node).state


def wait_state(client: Client, run_id: int, node: str, wanted: StepState, what: str) -> None:
    wait_until(lambda: state(client, run_id, node) is wanted, what=what, timeout=20)


def only_child(client: Client, run_id: int) -> int:
    (row,) = client.children_of(run_id)
    return int(row["id"])


def item_child(client: Client, run_id: int, index: int) -> int:
    """The child run of fan-out item ``index`` of ``run_id``; 0 while it has not started."""
    for row in client.children_of(run_id):
        if str(row["parent_node_id"]).endswith(f"[{index}]"):
            return int(row["id"])
    return 0


def pause_while_gated_runs(client: Client, run_id: int) -> None:
    """Pause the run while pra_gated runs, then let pra_gated complete inside the pause."""
    wait_state(client, run_id, "pra_gated", StepState.RUNNING, "pra_gated to run")
    client.pause(run_id)
    gate("gated").set()
    wait_state(client, run_id, "pra_gated", StepState.COMPLETED, "pra_gated to end in the pause")


def settle() -> None:
    """Give workers and scanners a few passes (they poll every 0.2 s) to do what they must
    not do."""
    time.sleep(0.8)


# -- wait_signal ------------------------------------------------------------------------------


def test_pra_signal_sent_during_the_pause_to_a_wait_not_yet_active_is_taken_on_resume(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    start_worker(*EVERYTHING)
    handle = client.submit(wait_after, "x")
    pause_while_gated_runs(client, handle.id)
    assert state(client, handle.id, "pra_go") is StepState.PAUSED
    assert client.signal(handle.id, "pra_go", {"ok": 1}) is Delivery.BUFFERED
    with pytest.raises(MailboxFull):
        client.signal(handle.id, "pra_go", {"ok": 2})
    clock(datetime.now(UTC) + timedelta(hours=3))  # longer than the wait's timeout
    settle()
    run = run_of(client, handle.id)
    assert run.state is RunState.PAUSED and CALLS["pra_echo"] == 0
    client.resume(handle.id)
    assert handle.result(timeout=20) == {"ok": 1}
    assert (CALLS["pra_gated"], CALLS["pra_echo"]) == (1, 1)


def test_pra_a_wait_activated_by_the_resume_counts_its_timeout_from_the_resume(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    start_worker(*EVERYTHING)
    handle = client.submit(wait_after, "x")
    pause_while_gated_runs(client, handle.id)
    resumed_at = datetime.now(UTC) + timedelta(hours=3)
    clock(resumed_at)  # the pause lasts 3 hours: three times the 1 h timeout
    client.resume(handle.id)
    wait_step = run_of(client, handle.id).step("pra_go")
    assert wait_step.state is StepState.WAITING_SIGNAL
    due = wait_step.scheduled_at - resumed_at
    assert timedelta(minutes=59) < due < timedelta(minutes=61), due
    clock(resumed_at + timedelta(minutes=30))
    settle()  # scanner passes: the timeout is not due
    assert state(client, handle.id, "pra_go") is StepState.WAITING_SIGNAL
    assert client.signal(handle.id, "pra_go", "late") is Delivery.CONSUMED
    assert handle.result(timeout=20) == "late"


def test_pra_a_wait_activated_by_the_resume_times_out_an_hour_after_the_resume(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    start_worker(*EVERYTHING)
    handle = client.submit(wait_after, "x")
    pause_while_gated_runs(client, handle.id)
    resumed_at = datetime.now(UTC) + timedelta(hours=3)
    clock(resumed_at)
    client.resume(handle.id)
    clock(resumed_at + timedelta(hours=1, minutes=5))
    with pytest.raises(RunFailed):
        handle.result(timeout=20)
    wait_step = run_of(client, handle.id).step("pra_go")
    assert wait_step.state is StepState.DISCARDED
    assert wait_step.error_kind == "signal_timeout"
    assert CALLS["pra_echo"] == 0


# -- wait_any and wait_n ----------------------------------------------------------------------


def test_pra_wait_any_paused_before_activation_takes_the_signal_buffered_in_the_pause(
    client: Client, start_worker: StartWorker
) -> None:
    handle = client.submit(any_after, 1)
    client.pause(handle.id)
    assert client.signal(handle.id, "pra_no", "nope") is Delivery.BUFFERED
    with pytest.raises(MailboxFull):
        client.signal(handle.id, "pra_yes", "yes")  # capacity 1 for wait_any
    start_worker(*EVERYTHING)
    settle()
    assert CALLS["pra_echo"] == 0
    client.resume(handle.id)
    assert handle.result(timeout=20) == {"name": "pra_no", "payload": "nope"}
    assert (CALLS["pra_echo"], CALLS["pra_last"]) == (1, 1)
    with pytest.raises(AlreadyTerminal):
        client.signal(handle.id, "pra_yes", "too late")


def test_pra_wait_n_paused_before_activation_fills_its_quorum_from_the_pause(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    handle = client.submit(n_after, 1)
    client.pause(handle.id)
    for vote in ("a", "b", "c"):
        assert client.signal(handle.id, "pra_vote", vote) is Delivery.BUFFERED
    with pytest.raises(MailboxFull):
        client.signal(handle.id, "pra_vote", "d")
    clock(datetime.now(UTC) + timedelta(hours=2))  # past the timeout, inside the pause
    start_worker(*EVERYTHING)
    settle()
    assert run_of(client, handle.id).state is RunState.PAUSED
    client.resume(handle.id)
    assert handle.result(timeout=20) == ["a", "b", "c"]
    assert (CALLS["pra_echo"], CALLS["pra_last"]) == (1, 1)


def test_pra_wait_n_with_part_of_its_quorum_buffered_waits_for_the_rest_after_resume(
    client: Client, start_worker: StartWorker
) -> None:
    handle = client.submit(n_after, 1)
    client.pause(handle.id)
    assert client.signal(handle.id, "pra_vote", "a") is Delivery.BUFFERED
    assert client.signal(handle.id, "pra_vote", "b") is Delivery.BUFFERED
    start_worker(*EVERYTHING)
    client.resume(handle.id)
    wait_state(client, handle.id, "pra_vote", StepState.WAITING_SIGNAL, "the quorum wait")
    wait_until(
        lambda: run_of(client, handle.id).step("pra_vote").output == ["a", "b"],
        what="the two buffered votes to be taken",
    )
    assert client.signal(handle.id, "pra_vote", "c") is Delivery.CONSUMED
    assert handle.result(timeout=20) == ["a", "b", "c"]
    assert CALLS["pra_last"] == 1


# -- wait_timer -------------------------------------------------------------------------------


def test_pra_a_timer_activated_by_the_resume_counts_from_the_resume(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    start_worker(*EVERYTHING)
    handle = client.submit(timer_after, 5)
    pause_while_gated_runs(client, handle.id)
    assert state(client, handle.id, "timer") is StepState.PAUSED
    resumed_at = datetime.now(UTC) + timedelta(hours=3)  # the timer would be long due
    clock(resumed_at)
    settle()
    assert state(client, handle.id, "timer") is StepState.PAUSED
    client.resume(handle.id)
    timer = run_of(client, handle.id).step("timer")
    assert timer.state is StepState.WAITING_TIMER
    due = timer.scheduled_at - resumed_at
    assert timedelta(minutes=59) < due < timedelta(minutes=61), due
    settle()
    assert state(client, handle.id, "timer") is StepState.WAITING_TIMER
    clock(resumed_at + timedelta(hours=1, minutes=1))
    assert handle.result(timeout=20) == 5
    assert CALLS["pra_echo"] == 1


# -- child runs -------------------------------------------------------------------------------


def test_pra_a_child_node_paused_before_its_run_started_starts_it_on_resume(
    client: Client, start_worker: StartWorker
) -> None:
    handle = client.submit(parent_late, 5)
    client.pause(handle.id)
    start_worker(*EVERYTHING)
    settle()
    assert client.children_of(handle.id) == []
    assert CALLS["pra_echo"] == 0
    client.resume(handle.id)
    assert handle.result(timeout=20) == 105
    assert len(client.children_of(handle.id)) == 1
    assert (CALLS["pra_echo"], CALLS["pra_kstep[5]"], CALLS["pra_last"]) == (1, 1, 1)


def test_pra_a_child_node_whose_dependency_completed_in_the_pause_starts_on_resume(
    client: Client, start_worker: StartWorker
) -> None:
    handle = client.submit(fan_kids, [3])  # the list step blocks; one child item
    start_worker(*EVERYTHING)
    wait_state(client, handle.id, "pra_gated_list", StepState.RUNNING, "the list step to run")
    client.pause(handle.id)
    gate("list").set()
    wait_state(
        client,
        handle.id,
        "pra_gated_list",
        StepState.COMPLETED,
        "the list step to end in the pause",
    )
    settle()
    assert client.children_of(handle.id) == [], "a child run started inside the pause"
    assert run_of(client, handle.id).step("pra_kid").state is StepState.PAUSED
    client.resume(handle.id)
    assert handle.result(timeout=20) == [103]
    assert CALLS["pra_kstep[3]"] == 1


def test_pra_a_child_run_completing_inside_the_pause_completes_its_node_and_holds_the_rest(
    client: Client, start_worker: StartWorker
) -> None:
    handle = client.submit(parent_sig, 0)
    kid_id = only_child(client, handle.id)
    client.pause(handle.id)
    assert run_of(client, kid_id).state is RunState.PAUSED
    # The child's wait was waiting when the pause came: the signal is consumed at once,
    # which ends the child run inside the pause.
    assert client.signal(kid_id, "pra_kid_go", {"v": 7}) is Delivery.CONSUMED
    kid_run = run_of(client, kid_id)
    assert kid_run.state is RunState.COMPLETED
    start_worker(*EVERYTHING)
    settle()
    run = run_of(client, handle.id)
    assert run.state is RunState.PAUSED
    assert run.step("pra_kid_sig").state is StepState.COMPLETED
    assert run.step("pra_kid_sig").output == {"v": 7}
    assert run.step("pra_last").state is StepState.PAUSED
    assert CALLS["pra_last"] == 0
    client.resume(handle.id)
    assert handle.result(timeout=20) == {"v": 7}
    assert CALLS["pra_last"] == 1


def test_pra_a_parent_whose_last_node_is_a_child_completing_in_the_pause_ends_in_it(
    client: Client,
) -> None:
    handle = client.submit(parent_sig_tail, 0)
    kid_id = only_child(client, handle.id)
    client.pause(handle.id)
    assert client.signal(kid_id, "pra_kid_go", "done") is Delivery.CONSUMED
    run = handle.wait(timeout=10)
    assert run.state is RunState.COMPLETED
    assert run.paused_at is not None  # documented: it keeps its paused_at
    assert handle.result(timeout=0) == "done"
    with pytest.raises(AlreadyTerminal):
        client.resume(handle.id)


def test_pra_a_signal_buffered_for_a_child_wait_in_a_paused_tree_is_taken_on_resume(
    client: Client, start_worker: StartWorker
) -> None:
    handle = client.submit(parent_late_sig, 4)
    kid_id = only_child(client, handle.id)
    client.pause(handle.id)
    assert run_of(client, kid_id).state is RunState.PAUSED
    assert client.signal(kid_id, "pra_kid_late", "s") is Delivery.BUFFERED
    start_worker(*EVERYTHING)
    settle()
    assert CALLS["pra_kstep[4]"] == 0
    client.resume(handle.id)
    assert handle.result(timeout=20) == [104, "s"]
    assert (CALLS["pra_kstep[4]"], CALLS["pra_collect"], CALLS["pra_last"]) == (1, 1, 1)


def test_pra_a_child_node_activated_by_a_resume_from_a_process_without_the_child_definition(
    cyclone_dsn: str, client: Client, start_worker: StartWorker
) -> None:
    handle = client.submit(parent_late, 6)
    client.pause(handle.id)
    narrow = Registry()
    narrow.register(parent_late)  # a CLI-like process: the child's start is left to a worker
    start_worker(*EVERYTHING)
    with Client(cyclone_dsn, registry=narrow) as other:
        other.resume(handle.id)
    assert handle.result(timeout=20) == 106
    assert len(client.children_of(handle.id)) == 1
    assert CALLS["pra_kstep[6]"] == 1


# -- for_each ---------------------------------------------------------------------------------


def test_pra_a_fan_out_of_child_runs_paused_before_it_expanded_runs_every_item(
    client: Client, start_worker: StartWorker
) -> None:
    gate("list").set()
    handle = client.submit(fan_kids, [0, 1, 2, 3, 4])
    client.pause(handle.id)
    client.resume(handle.id)
    client.pause(handle.id)  # twice, to be sure nothing counts on one round
    start_worker(*EVERYTHING)
    settle()
    assert CALLS["pra_gated_list"] == 0
    client.resume(handle.id)
    assert handle.result(timeout=30) == [100, 101, 102, 103, 104]
    assert all(CALLS[f"pra_kstep[{i}]"] == 1 for i in range(5))
    assert len(client.children_of(handle.id)) == 5


def test_pra_a_fan_out_of_child_runs_whose_list_came_in_the_pause_expands_on_resume(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*EVERYTHING)
    handle = client.submit(fan_kids, [7, 8, 9])
    wait_state(client, handle.id, "pra_gated_list", StepState.RUNNING, "the list step to run")
    client.pause(handle.id)
    gate("list").set()
    wait_state(client, handle.id, "pra_gated_list", StepState.COMPLETED, "the list in the pause")
    settle()
    assert client.children_of(handle.id) == []
    assert [s for s in run_of(client, handle.id).steps if s.item_of] == []
    client.resume(handle.id)
    assert handle.result(timeout=30) == [107, 108, 109]
    assert [CALLS[f"pra_kstep[{i}]"] for i in (7, 8, 9)] == [1, 1, 1]


def test_pra_an_empty_list_that_came_in_the_pause_completes_the_run_at_the_resume(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*EVERYTHING)
    handle = client.submit(fan_kids_tail, [])
    wait_state(client, handle.id, "pra_gated_list", StepState.RUNNING, "the list step to run")
    client.pause(handle.id)
    gate("list").set()
    wait_state(client, handle.id, "pra_gated_list", StepState.COMPLETED, "the list in the pause")
    assert run_of(client, handle.id).state is RunState.PAUSED
    client.resume(handle.id)
    run = run_of(client, handle.id)
    assert run.state is RunState.COMPLETED  # ended by the resume itself
    assert handle.result(timeout=0) == []


def test_pra_a_list_over_max_items_that_came_in_the_pause_fails_on_resume(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*EVERYTHING)
    handle = client.submit(fan_steps_guarded, [1, 2, 3, 4])
    wait_state(client, handle.id, "pra_gated_list", StepState.RUNNING, "the list step to run")
    client.pause(handle.id)
    gate("list").set()
    wait_state(client, handle.id, "pra_gated_list", StepState.COMPLETED, "the list in the pause")
    client.resume(handle.id)
    with pytest.raises(RunFailed):
        handle.result(timeout=20)
    node = run_of(client, handle.id).step("pra_held_item")
    assert (node.state, node.error_kind) == (StepState.DISCARDED, "item_limit")
    assert not any(k.startswith("pra_item[") for k in CALLS)
    assert CALLS["pra_last"] == 0


def test_pra_a_non_list_that_came_in_the_pause_fails_the_fan_out_on_resume(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*EVERYTHING)
    handle = client.submit(fan_steps_guarded, {"not": "a list"})
    wait_state(client, handle.id, "pra_gated_list", StepState.RUNNING, "the list step to run")
    client.pause(handle.id)
    gate("list").set()
    wait_state(client, handle.id, "pra_gated_list", StepState.COMPLETED, "the list in the pause")
    client.resume(handle.id)
    with pytest.raises(RunFailed):
        handle.result(timeout=20)
    node = run_of(client, handle.id).step("pra_held_item")
    assert (node.state, node.error_kind) == (StepState.DISCARDED, "invalid_input")


def test_pra_a_fan_out_of_steps_within_max_items_paused_mid_way_keeps_its_order(
    client: Client, start_worker: StartWorker
) -> None:
    gate("list").set()
    handle = client.submit(fan_steps_guarded, [3, 1, 2])
    start_worker(*EVERYTHING)
    # max_parallel=2: items 3 and 1 hold both slots, item 2 waits for one
    wait_until(lambda: CALLS["pra_item[3]"] + CALLS["pra_item[1]"] == 2, what="two items to run")
    client.pause(handle.id)
    gate("items").set()
    settle()  # the two running items complete inside the pause; item 2 must not start
    assert CALLS["pra_item[2]"] == 0, "an item started paused"
    assert run_of(client, handle.id).state is RunState.PAUSED
    client.resume(handle.id)
    assert handle.result(timeout=20) == [30, 10, 20]
    assert [CALLS[f"pra_item[{i}]"] for i in (1, 2, 3)] == [1, 1, 1]


# -- conditions -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("x", "expected"),
    [(9, [109, None, [0, 10, 20, 30, 40, 50, 60, 70, 80]]), (1, [None, "small!", None])],
)
def test_pra_conditional_nodes_are_judged_at_the_resume(
    client: Client, start_worker: StartWorker, x: int, expected: list[Any]
) -> None:
    start_worker(*EVERYTHING)
    handle = client.submit(cond, x)
    pause_while_gated_runs(client, handle.id)
    run = run_of(client, handle.id)
    assert run.step("pra_small").state is StepState.PAUSED
    assert run.step("pra_kid").state is StepState.PAUSED
    assert client.signal(handle.id, "pra_small", "small!") is Delivery.BUFFERED
    settle()
    assert client.children_of(handle.id) == []
    client.resume(handle.id)
    assert handle.result(timeout=30) == expected
    run = run_of(client, handle.id)
    if x > 5:
        assert run.step("pra_small").state is StepState.SKIPPED
        assert len(client.children_of(handle.id)) == 1
        assert CALLS["pra_list"] == 1
    else:
        assert run.step("pra_kid").state is StepState.SKIPPED
        assert run.step("pra_item").state is StepState.SKIPPED
        assert client.children_of(handle.id) == []
        assert CALLS["pra_list"] == 0
    assert CALLS["pra_collect"] == 1


def test_pra_a_paused_run_whose_child_and_fan_out_both_skip_completes_at_the_resume(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*EVERYTHING)
    handle = client.submit(cond_tail, 1)
    pause_while_gated_runs(client, handle.id)
    assert run_of(client, handle.id).state is RunState.PAUSED
    client.resume(handle.id)
    run = run_of(client, handle.id)
    assert run.state is RunState.COMPLETED
    assert run.step("pra_kid").state is StepState.SKIPPED
    assert run.step("pra_item").state is StepState.SKIPPED
    assert handle.result(timeout=0) is None
    assert client.children_of(handle.id) == []


# -- define_result and after= -----------------------------------------------------------------


def test_pra_define_result_and_after_steps_run_once_across_pauses(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*EVERYTHING)
    handle = client.submit(defres, "r")
    pause_while_gated_runs(client, handle.id)
    settle()
    run = run_of(client, handle.id)
    assert {run.step(n).state for n in ("pra_echo", "pra_side", "pra_last")} == {StepState.PAUSED}
    client.resume(handle.id)
    wait_state(client, handle.id, "pra_echo", StepState.COMPLETED, "the result node")
    try:
        client.pause(handle.id)  # may find the run ended already
    except AlreadyTerminal:
        pass
    else:
        settle()
        with contextlib.suppress(AlreadyTerminal):  # its last steps ended inside the pause
            client.resume(handle.id)
    assert handle.result(timeout=20) == "r"
    assert (CALLS["pra_gated"], CALLS["pra_echo"], CALLS["pra_side"], CALLS["pra_last"]) == (
        1,
        1,
        1,
        1,
    )


# -- flow control -----------------------------------------------------------------------------


def test_pra_a_queued_run_paused_behind_a_run_concurrency_limit_runs_after_resume(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*EVERYTHING, concurrency=4)
    first = client.submit(one, "a")
    wait_until(lambda: CALLS["pra_one:a"], what="the first run to hold the slot")
    queued = client.submit(one, "b")
    client.pause(queued.id)
    later = client.submit(one, "c")
    gate("one").set()
    assert first.result(timeout=20) == "a"
    assert later.result(timeout=20) == "c"  # the paused run does not hold the queue up
    assert CALLS["pra_one:b"] == 0
    assert run_of(client, queued.id).state is RunState.PAUSED
    client.resume(queued.id)
    assert queued.result(timeout=20) == "b"
    assert [CALLS[f"pra_one:{v}"] for v in "abc"] == [1, 1, 1]
    assert MOST["one"] == 1


# -- deadlines --------------------------------------------------------------------------------


def test_pra_a_deadline_stands_still_while_a_wait_is_activated_by_the_resume(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    start_worker(*EVERYTHING)
    handle = client.submit(wait_after, "d", deadline=timedelta(hours=1))
    before = run_of(client, handle.id).deadline_at
    assert before is not None
    pause_while_gated_runs(client, handle.id)
    assert client.signal(handle.id, "pra_go", "go") is Delivery.BUFFERED
    clock(datetime.now(UTC) + timedelta(hours=5))  # far past the deadline, inside the pause
    settle()
    assert run_of(client, handle.id).state is RunState.PAUSED
    client.resume(handle.id)
    after = run_of(client, handle.id).deadline_at
    assert after is not None and after - before > timedelta(hours=4, minutes=59)
    assert handle.result(timeout=20) == "go"


def test_pra_a_child_resumed_alone_past_its_paused_parents_first_deadline_goes_on(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    handle = client.submit(parent_sig, 0, deadline=timedelta(hours=1))
    kid_id = only_child(client, handle.id)
    client.pause(handle.id)
    clock(datetime.now(UTC) + timedelta(hours=3))  # the parent's clock stands still
    start_worker(*EVERYTHING)
    client.resume(kid_id)
    assert client.signal(kid_id, "pra_kid_go", "k") is Delivery.CONSUMED
    assert run_of(client, kid_id).state is RunState.COMPLETED
    settle()
    assert run_of(client, handle.id).state is RunState.PAUSED
    client.resume(handle.id)
    assert handle.result(timeout=20) == "k"


# -- nested trees -----------------------------------------------------------------------------


def tree(client: Client, x: int) -> tuple[int, int, int]:
    handle = client.submit(top, x)
    mid_id = only_child(client, handle.id)
    return handle.id, mid_id, only_child(client, mid_id)


def test_pra_a_grandchild_paused_alone_stays_paused_through_the_top_pause_and_resume(
    client: Client, start_worker: StartWorker
) -> None:
    top_id, mid_id, grand_id = tree(client, 1)
    client.pause(grand_id)
    client.pause(top_id)
    assert run_of(client, mid_id).state is RunState.PAUSED
    client.resume(top_id)
    assert run_of(client, mid_id).state is RunState.RUNNING
    assert run_of(client, grand_id).state is RunState.PAUSED
    start_worker(*EVERYTHING)
    settle()
    assert CALLS["pra_kstep[1]"] == 0
    client.resume(grand_id)
    assert client.handle(top_id).result(timeout=20) == 101
    assert (CALLS["pra_kstep[1]"], CALLS["pra_echo"], CALLS["pra_last"]) == (1, 1, 1)


def test_pra_resuming_the_middle_alone_resumes_the_grandchild_paused_with_the_top(
    client: Client, start_worker: StartWorker
) -> None:
    top_id, mid_id, grand_id = tree(client, 2)
    client.pause(top_id)
    with pytest.raises(InvalidTransition):
        client.pause(mid_id)  # already paused with its parent
    start_worker(*EVERYTHING)
    client.resume(mid_id)
    assert run_of(client, grand_id).state is RunState.RUNNING
    assert client.handle(mid_id).result(timeout=20) == 102
    settle()
    run = run_of(client, top_id)
    assert run.state is RunState.PAUSED
    assert run.step("pra_mid").state is StepState.COMPLETED
    assert CALLS["pra_last"] == 0
    client.resume(top_id)
    assert client.handle(top_id).result(timeout=20) == 102
    assert (CALLS["pra_kstep[2]"], CALLS["pra_echo"], CALLS["pra_last"]) == (1, 1, 1)


def test_pra_a_middle_paused_alone_keeps_the_grandchild_until_its_own_resume(
    client: Client, start_worker: StartWorker
) -> None:
    top_id, mid_id, grand_id = tree(client, 3)
    client.pause(mid_id)
    assert run_of(client, grand_id).state is RunState.PAUSED
    client.pause(top_id)
    client.resume(top_id)
    assert run_of(client, mid_id).state is RunState.PAUSED
    assert run_of(client, grand_id).state is RunState.PAUSED
    start_worker(*EVERYTHING)
    client.pause(top_id)
    client.resume(mid_id)  # while the top is paused: the middle and the grandchild go on
    assert client.handle(mid_id).result(timeout=20) == 103
    settle()
    assert run_of(client, top_id).state is RunState.PAUSED
    assert CALLS["pra_last"] == 0
    client.resume(top_id)
    assert client.handle(top_id).result(timeout=20) == 103
    assert (CALLS["pra_kstep[3]"], CALLS["pra_echo"], CALLS["pra_last"]) == (1, 1, 1)


def test_pra_the_grandchild_resumed_alone_completes_while_the_rest_stays_paused(
    client: Client, start_worker: StartWorker
) -> None:
    top_id, mid_id, grand_id = tree(client, 4)
    client.pause(top_id)
    start_worker(*EVERYTHING)
    client.resume(grand_id)
    assert client.handle(grand_id).result(timeout=20) == 104
    settle()
    assert run_of(client, mid_id).state is RunState.PAUSED
    assert run_of(client, mid_id).step("pra_echo").state is StepState.PAUSED
    assert run_of(client, top_id).state is RunState.PAUSED
    client.resume(top_id)
    assert client.handle(top_id).result(timeout=20) == 104
    assert (CALLS["pra_kstep[4]"], CALLS["pra_echo"], CALLS["pra_last"]) == (1, 1, 1)


# -- child runs that end inside the pause, or as the resume starts them -----------------------


def test_pra_fan_out_child_runs_ending_in_the_pause_resume_in_item_order(
    client: Client, start_worker: StartWorker
) -> None:
    handle = client.submit(fan_sig_kids, [0, 1, 2])
    first = only_child(client, handle.id)  # max_parallel=1: one child run open
    client.pause(handle.id)
    assert client.signal(first, "pra_kid_go", "r0") is Delivery.CONSUMED
    assert run_of(client, first).state is RunState.COMPLETED
    start_worker(*EVERYTHING)
    settle()
    assert len(client.children_of(handle.id)) == 1, "a child run started inside the pause"
    assert run_of(client, handle.id).state is RunState.PAUSED
    client.resume(handle.id)
    for index in (1, 2):
        kid_id = wait_until(
            partial(item_child, client, handle.id, index), what=f"child run {index}"
        )
        client.pause(handle.id)
        assert client.signal(kid_id, "pra_kid_go", f"r{index}") is Delivery.CONSUMED
        client.resume(handle.id)
    assert handle.result(timeout=20) == ["r0", "r1", "r2"]
    assert len(client.children_of(handle.id)) == 3


def test_pra_a_child_run_that_ends_as_the_resume_starts_it_completes_the_parent(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*EVERYTHING)
    handle = client.submit(parent_skip_kid, 3)
    pause_while_gated_runs(client, handle.id)
    settle()
    assert client.children_of(handle.id) == []
    client.resume(handle.id)
    run = run_of(client, handle.id)
    assert run.state is RunState.COMPLETED  # the child run ended inside the resume
    assert handle.result(timeout=0) is None
    (kid_row,) = client.children_of(handle.id)
    assert run_of(client, kid_row["id"]).state is RunState.COMPLETED
    assert CALLS["pra_kstep[3]"] == 0


def test_pra_a_fan_out_of_child_runs_that_end_as_they_start_completes_at_the_resume(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*EVERYTHING)
    handle = client.submit(fan_skip_kids, [1, 2, 3, 4])
    wait_state(client, handle.id, "pra_gated_list", StepState.RUNNING, "the list step to run")
    client.pause(handle.id)
    gate("list").set()
    wait_state(client, handle.id, "pra_gated_list", StepState.COMPLETED, "the list in the pause")
    client.resume(handle.id)
    run = run_of(client, handle.id)
    assert run.state is RunState.COMPLETED
    assert handle.result(timeout=0) == [None, None, None, None]
    assert len(client.children_of(handle.id)) == 4


def test_pra_a_fan_out_of_child_runs_expanded_by_a_resume_without_their_definition(
    cyclone_dsn: str, client: Client, start_worker: StartWorker
) -> None:
    start_worker(*EVERYTHING)
    handle = client.submit(fan_kids, [5, 6, 7])
    wait_state(client, handle.id, "pra_gated_list", StepState.RUNNING, "the list step to run")
    client.pause(handle.id)
    gate("list").set()
    wait_state(client, handle.id, "pra_gated_list", StepState.COMPLETED, "the list in the pause")
    narrow = Registry()
    narrow.register(fan_kids)
    with Client(cyclone_dsn, registry=narrow) as other:
        other.resume(handle.id)
    assert handle.result(timeout=30) == [105, 106, 107]
    assert [CALLS[f"pra_kstep[{i}]"] for i in (5, 6, 7)] == [1, 1, 1]
