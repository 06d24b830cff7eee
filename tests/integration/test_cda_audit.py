"""Audit: users steering child runs directly, and parents with children in every state.

Each test operates on a child run (cancel, pause, resume, signal, retry, replay, fork,
deadline) or on its parent while the other side is in a given state, and checks through
the client that no run is left waiting for ever and none completes with a wrong result.
The child runs wait on signals, so the test decides when each one moves on."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from cyclone_dsl import (
    AlreadyTerminal,
    Client,
    InvalidTransition,
    PassedDeadline,
    Registry,
    RunFailed,
    RunFilter,
    RunNotFound,
    RunState,
    StepContext,
    StepState,
    Worker,
    child,
    for_each,
    step,
    wait_signal,
    workflow,
)
from tests.waiting import wait_until

StartWorker = Callable[..., Worker]

_lock = threading.Lock()
calls: Counter[tuple[int, str]] = Counter()
broken: set[str] = set()


@pytest.fixture(autouse=True)
def _fresh() -> None:
    with _lock:
        calls.clear()
        broken.clear()


def _record(ctx: StepContext) -> None:
    with _lock:
        calls[(ctx.run_id, ctx.node)] += 1


def ran(run_id: int, node: str) -> int:
    with _lock:
        return calls[(run_id, node)]


# -- steps ------------------------------------------------------------------------------


@step(name="cda_double")
def double(x: int, *, ctx: StepContext) -> int:
    _record(ctx)
    return 2 * x


@step(name="cda_add")
def add(a: int, b: int, *, ctx: StepContext) -> int:
    _record(ctx)
    return a + b


@step(name="cda_tag")
def tag(x: object, *, ctx: StepContext) -> str:
    _record(ctx)
    return f"tag:{x}"


@step(name="cda_pair")
def pair(a: object, b: object, *, ctx: StepContext) -> list[object]:
    _record(ctx)
    return [a, b]


@step(name="cda_flaky", max_attempts=1)
def flaky(x: int, *, ctx: StepContext) -> int:
    """Fails for good while the test lists it as broken."""
    _record(ctx)
    with _lock:
        if "flaky" in broken:
            raise ValueError("cda flaky is broken")
    return x + 100


@step(name="cda_twice", max_attempts=2)
def twice(x: int, *, ctx: StepContext) -> int:
    """Fails its first attempt; the second returns a value naming its attempt."""
    _record(ctx)
    if ctx.attempt < 2:
        raise ValueError(f"cda twice attempt {ctx.attempt}")
    return x * 1000 + ctx.attempt


@step(name="cda_never", max_attempts=2)
def never(x: int, *, ctx: StepContext) -> int:
    _record(ctx)
    raise ValueError(f"cda never, attempt {ctx.attempt}")


STEPS = [double, add, tag, pair, flaky, twice, never]


# -- workflows --------------------------------------------------------------------------


@workflow(name="cda_leaf")
def leaf(x):  # type: ignore[no-untyped-def]
    return add(double(x), wait_signal("cda_go"))  # 2x + the signal


@workflow(name="cda_parent")
def parent(x):  # type: ignore[no-untyped-def]
    return tag(child(leaf, x))


@workflow(name="cda_top")
def top(x):  # type: ignore[no-untyped-def]
    return tag.named("outer")(child(parent, x))


@workflow(name="cda_flaky_leaf")
def flaky_leaf(x):  # type: ignore[no-untyped-def]
    return flaky(wait_signal("cda_go"))


@workflow(name="cda_flaky_parent")
def flaky_parent(x):  # type: ignore[no-untyped-def]
    return tag(child(flaky_leaf, x))


@workflow(name="cda_contained")
def contained(x):  # type: ignore[no-untyped-def]
    got = child(leaf, x)
    tag(got, on_dep_failure="cancel_branch")
    return double.named("own")(x)


@workflow(name="cda_two_branches")
def two_branches(x):  # type: ignore[no-untyped-def]
    return pair(child(leaf, x), flaky(x))


@workflow(name="cda_then_wait")
def then_wait(x):  # type: ignore[no-untyped-def]
    return pair(child(leaf, x), wait_signal("cda_done"))


@workflow(name="cda_fan")
def fan(xs):  # type: ignore[no-untyped-def]
    return for_each(leaf, over=xs)


@workflow(name="cda_twice_leaf")
def twice_leaf(x):  # type: ignore[no-untyped-def]
    return twice(x)


@workflow(name="cda_twice_parent")
def twice_parent(x):  # type: ignore[no-untyped-def]
    return tag(child(twice_leaf, x))


@workflow(name="cda_never_leaf")
def never_leaf(x):  # type: ignore[no-untyped-def]
    return never(x)


@workflow(name="cda_never_parent")
def never_parent(x):  # type: ignore[no-untyped-def]
    return tag(child(never_leaf, x))


WORKFLOWS = [
    leaf,
    parent,
    top,
    flaky_leaf,
    flaky_parent,
    contained,
    two_branches,
    then_wait,
    fan,
    twice_leaf,
    twice_parent,
    never_leaf,
    never_parent,
]


def workers(start_worker: StartWorker) -> Worker:
    return start_worker(*STEPS, *WORKFLOWS, concurrency=8)


# -- helpers ----------------------------------------------------------------------------


def kids(client: Client, run_id: int, n: int = 1) -> dict[str, int]:
    """The child runs of ``run_id`` by parent node, once there are ``n``."""

    def found() -> list[dict[str, Any]]:
        rows = client.children_of(run_id)
        return rows if len(rows) == n else []

    rows = wait_until(found, timeout=10, what=f"{n} child run(s) of run {run_id}")
    return {r["parent_node_id"]: r["id"] for r in rows}


def the_kid(client: Client, run_id: int) -> int:
    (only,) = kids(client, run_id).values()
    return only


def node_state(client: Client, run_id: int, node: str) -> StepState:
    return client.get_run(run_id).step(node).state


def wait_node(client: Client, run_id: int, node: str, state: StepState) -> None:
    wait_until(
        lambda: node_state(client, run_id, node) is state,
        timeout=10,
        what=f"run {run_id}'s {node} to be {state.value}",
    )


def waiting(client: Client, run_id: int) -> None:
    wait_node(client, run_id, "cda_go", StepState.WAITING_SIGNAL)


def state_of(client: Client, run_id: int) -> RunState:
    return client.get_run(run_id).state


def failure(handle: Any) -> RunFailed:
    with pytest.raises(RunFailed) as caught:
        handle.result(timeout=10)
    return caught.value


# -- a child operated on while its parent is paused -------------------------------------


def test_cancelling_a_child_inside_a_paused_parent_fails_it_and_a_retry_completes_it(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(parent, 1)
    kid = the_kid(client, run.id)
    waiting(client, kid)
    client.pause(run.id)
    assert state_of(client, kid) is RunState.PAUSED  # paused with its parent
    with pytest.raises(InvalidTransition, match="already paused"):
        client.pause(kid)
    client.cancel(kid)
    failed = failure(run)  # the parent does not stay paused on a node that cannot end
    assert (failed.state, failed.node, failed.error_kind) == ("failed", "cda_leaf", "child_failed")
    with pytest.raises(AlreadyTerminal):
        client.resume(run.id)
    with pytest.raises(AlreadyTerminal):
        client.resume(kid)
    with pytest.raises(InvalidTransition, match=f"retry run {run.id}"):
        client.retry(kid, "cda_go")
    client.retry(run.id, "cda_leaf")
    assert kids(client, run.id) == {"cda_leaf": kid}  # the same child run, reopened
    assert state_of(client, run.id) is RunState.RUNNING
    assert state_of(client, kid) is RunState.RUNNING
    waiting(client, kid)
    client.signal(kid, "cda_go", 5)
    assert run.result(timeout=10) == "tag:7"


def test_a_child_resumed_alone_that_fails_in_a_paused_parent_is_retried_through_it(
    client: Client, start_worker: StartWorker
) -> None:
    broken.add("flaky")
    workers(start_worker)
    run = client.submit(flaky_parent, 0)
    kid = the_kid(client, run.id)
    waiting(client, kid)
    client.pause(run.id)
    client.signal(kid, "cda_go", 5)  # the wait takes it; cda_flaky is held by the pause
    assert state_of(client, kid) is RunState.PAUSED
    assert ran(kid, "cda_flaky") == 0
    client.resume(kid)
    failed = failure(run)
    assert (failed.node, failed.error_kind) == ("cda_flaky_leaf", "child_failed")
    assert state_of(client, kid) is RunState.FAILED
    with _lock:
        broken.clear()
    client.retry(run.id, "cda_flaky_leaf")  # the parent ended: it is no longer paused
    assert run.result(timeout=10) == "tag:105"
    assert ran(kid, "cda_flaky") == 2
    assert kids(client, run.id) == {"cda_flaky_leaf": kid}


def test_a_child_resumed_alone_that_completes_in_a_paused_parent_waits_for_its_resume(
    client: Client, start_worker: StartWorker
) -> None:
    """Documented (fan-out-and-children.md, Pause): the parent node settles with the
    child's result, and nothing downstream of it starts until the parent is resumed."""
    workers(start_worker)
    run = client.submit(parent, 1)
    kid = the_kid(client, run.id)
    waiting(client, kid)
    client.pause(run.id)
    client.signal(kid, "cda_go", 5)
    client.resume(kid)
    assert client.wait(kid, timeout=10).state is RunState.COMPLETED
    wait_node(client, run.id, "cda_leaf", StepState.COMPLETED)
    assert state_of(client, run.id) is RunState.PAUSED
    assert node_state(client, run.id, "cda_tag") is StepState.PAUSED
    assert ran(run.id, "cda_tag") == 0
    client.resume(run.id)
    assert run.result(timeout=10) == "tag:7"


def test_a_child_cancelled_in_a_paused_parent_that_contains_it(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(contained, 3)
    kid = the_kid(client, run.id)
    waiting(client, kid)
    wait_node(client, run.id, "own", StepState.COMPLETED)
    client.pause(run.id)
    client.cancel(kid)
    # Every step of the parent has ended: it is completed, paused or not.
    assert run.result(timeout=10) == 6
    got = client.get_run(run.id)
    assert got.step("cda_leaf").error_kind == "child_failed"
    assert got.step("cda_tag").state is StepState.CANCELLED
    client.retry(run.id, "cda_leaf")  # a contained failure reopens the completed run
    assert state_of(client, kid) is RunState.RUNNING
    waiting(client, kid)
    client.signal(kid, "cda_go", 4)
    assert run.wait(timeout=10).state is RunState.COMPLETED
    assert run.result(timeout=1) == 6
    assert client.get_run(run.id).step("cda_tag").output == "tag:10"
    assert ran(run.id, "own") == 1


# -- a child in a final state, operated on directly ---------------------------------------


def test_operations_on_a_completed_child_are_refused_and_change_nothing(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(then_wait, 2)
    kid = the_kid(client, run.id)
    waiting(client, kid)
    with pytest.raises(InvalidTransition, match="not paused"):
        client.resume(kid)
    client.signal(kid, "cda_go", 1)
    wait_node(client, run.id, "cda_leaf", StepState.COMPLETED)
    before = (client.run_counts(), client.get_run(kid), client.get_run(run.id).steps)
    with pytest.raises(AlreadyTerminal):
        client.cancel(kid)
    with pytest.raises(AlreadyTerminal):
        client.pause(kid)
    with pytest.raises(AlreadyTerminal):
        client.resume(kid)
    with pytest.raises(AlreadyTerminal):
        client.signal(kid, "cda_go", 99)
    with pytest.raises(InvalidTransition):
        client.retry(kid, "cda_add")
    for node in ("cda_add", "cda_double", "cda_go"):
        with pytest.raises(InvalidTransition):
            client.retry(kid, node, force=True)
    assert (client.run_counts(), client.get_run(kid), client.get_run(run.id).steps) == before
    client.signal(run.id, "cda_done", "ok")
    assert run.result(timeout=10) == [5, "ok"]
    with pytest.raises(InvalidTransition):
        client.retry(kid, "cda_add", force=True)
    assert client.get_run(kid) == before[1]
    assert ran(kid, "cda_add") == 1 and ran(kid, "cda_double") == 1


def test_the_refusal_of_a_replay_inside_a_child_run_names_a_way_out_that_works(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(parent, 1)
    kid = the_kid(client, run.id)
    waiting(client, kid)
    client.signal(kid, "cda_go", 1)
    assert run.result(timeout=10) == "tag:3"
    with pytest.raises(InvalidTransition) as refused:
        client.retry(kid, "cda_add", force=True)
    # What the message says to do must not be refused in turn.
    with pytest.raises(InvalidTransition, match="fork"):
        client.retry(run.id, "cda_leaf", force=True)
    assert "fork" in str(refused.value), str(refused.value)


def test_a_failed_child_is_revived_neither_alone_nor_by_its_fork(
    client: Client, start_worker: StartWorker
) -> None:
    broken.add("flaky")
    workers(start_worker)
    run = client.submit(flaky_parent, 0)
    kid = the_kid(client, run.id)
    waiting(client, kid)
    client.signal(kid, "cda_go", 5)
    assert failure(run).error_kind == "child_failed"
    with pytest.raises(InvalidTransition, match=f"retry run {run.id}'s node"):
        client.retry(kid, "cda_flaky")
    bulk = client.retry_many(RunFilter(workflows="cda_flaky_leaf"))
    assert (bulk.acted, bulk.skipped) == (0, 1)
    assert state_of(client, kid) is RunState.FAILED
    with _lock:
        broken.clear()
    fork = client.fork(kid, "cda_flaky")
    assert fork.result(timeout=10) == 105
    assert client.get_run(fork.id).parent_run_id is None
    # The fork's result reaches no parent: the parent stays failed on the old child.
    assert state_of(client, run.id) is RunState.FAILED
    assert node_state(client, run.id, "cda_flaky_leaf") is StepState.DISCARDED
    assert kids(client, run.id) == {"cda_flaky_leaf": kid}
    client.retry(run.id, "cda_flaky_leaf")
    assert run.result(timeout=10) == "tag:105"
    assert state_of(client, kid) is RunState.COMPLETED
    assert (ran(kid, "cda_flaky"), ran(fork.id, "cda_flaky")) == (2, 1)


def test_a_fork_of_a_waiting_child_does_not_settle_its_parent(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(parent, 1)
    kid = the_kid(client, run.id)
    waiting(client, kid)
    wait_node(client, kid, "cda_double", StepState.COMPLETED)
    fork = client.fork(kid, "cda_go")
    waiting(client, fork.id)
    client.signal(fork.id, "cda_go", 100)
    assert fork.result(timeout=10) == 102
    assert ran(fork.id, "cda_double") == 0  # copied
    assert state_of(client, run.id) is RunState.RUNNING
    assert node_state(client, run.id, "cda_leaf") is StepState.WAITING_CHILD
    assert node_state(client, kid, "cda_go") is StepState.WAITING_SIGNAL
    client.signal(kid, "cda_go", 5)
    assert run.result(timeout=10) == "tag:7"


# -- a parent ended while its child was open ----------------------------------------------


def test_retrying_the_parents_other_failed_node_reopens_its_cancelled_child(
    client: Client, start_worker: StartWorker
) -> None:
    broken.add("flaky")
    workers(start_worker)
    run = client.submit(two_branches, 1)
    failed = failure(run)
    assert (failed.node, failed.error_kind) == ("cda_flaky", "error")
    kid = the_kid(client, run.id)
    assert state_of(client, kid) is RunState.CANCELLED  # failing a parent cancels below
    with pytest.raises(AlreadyTerminal):
        client.signal(kid, "cda_go", 1)
    with pytest.raises(InvalidTransition, match=f"retry run {run.id}'s node 'cda_leaf'"):
        client.retry(kid, "cda_go")
    with _lock:
        broken.clear()
    client.retry(run.id, "cda_flaky")
    assert kids(client, run.id) == {"cda_leaf": kid}
    assert state_of(client, kid) is RunState.RUNNING
    waiting(client, kid)
    client.signal(kid, "cda_go", 5)
    assert run.result(timeout=10) == [7, 101]


def test_cancelling_the_parent_of_a_child_paused_on_its_own_then_retrying_it(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(parent, 1)
    kid = the_kid(client, run.id)
    waiting(client, kid)
    client.pause(kid)
    assert state_of(client, run.id) is RunState.RUNNING
    client.cancel(run.id)
    assert failure(run).state == "cancelled"
    assert state_of(client, kid) is RunState.CANCELLED
    with pytest.raises(AlreadyTerminal):
        client.resume(kid)
    with pytest.raises(AlreadyTerminal):
        client.pause(kid)
    with pytest.raises(AlreadyTerminal):
        client.cancel(kid)
    client.retry(run.id, "cda_leaf")
    assert state_of(client, kid) is RunState.RUNNING  # not left paused: it would never end
    waiting(client, kid)
    client.signal(kid, "cda_go", 5)
    assert run.result(timeout=10) == "tag:7"


def test_a_paused_tree_whose_middle_is_cancelled_is_retried_from_the_top(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(top, 1)
    middle = the_kid(client, run.id)
    bottom = the_kid(client, middle)
    waiting(client, bottom)
    client.pause(run.id)
    assert {state_of(client, r) for r in (run.id, middle, bottom)} == {RunState.PAUSED}
    client.cancel(middle)
    failed = failure(run)
    assert (failed.node, failed.error_kind) == ("cda_parent", "child_failed")
    assert state_of(client, bottom) is RunState.CANCELLED
    with pytest.raises(InvalidTransition):
        client.retry(middle, "cda_leaf")
    with pytest.raises(InvalidTransition):
        client.retry(bottom, "cda_go")
    client.retry(run.id, "cda_parent")
    assert kids(client, run.id) == {"cda_parent": middle}
    assert kids(client, middle) == {"cda_leaf": bottom}
    assert {state_of(client, r) for r in (run.id, middle, bottom)} == {RunState.RUNNING}
    waiting(client, bottom)
    client.signal(bottom, "cda_go", 5)
    assert run.result(timeout=10) == "tag:tag:7"


def test_cancelling_a_parent_whose_child_waits_for_a_worker_to_start_it(
    cyclone_dsn: str, start_worker: StartWorker
) -> None:
    only_parent = Registry()
    only_parent.register(parent)  # not its child workflow: a worker starts the child
    with Client(cyclone_dsn, registry=only_parent) as narrow:
        run = narrow.submit(parent, 1)
        assert narrow.children_of(run.id) == []
        narrow.cancel(run.id)
        probe = narrow.submit(parent, 2)
        workers(start_worker)
        kids(narrow, probe.id)  # the worker has started the children left to it
        assert narrow.children_of(run.id) == []
        assert narrow.get_run(run.id).state is RunState.CANCELLED
        narrow.retry(run.id, "cda_leaf")
        kid = the_kid(narrow, run.id)
        waiting(narrow, kid)
        narrow.signal(kid, "cda_go", 5)
        assert run.result(timeout=10) == "tag:7"
        narrow.cancel(probe.id)


def test_a_parent_cancelled_in_its_signal_wait_keeps_its_completed_child_and_its_result(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(then_wait, 2)
    kid = the_kid(client, run.id)
    waiting(client, kid)
    client.signal(kid, "cda_go", 1)
    wait_node(client, run.id, "cda_leaf", StepState.COMPLETED)
    wait_node(client, run.id, "cda_done", StepState.WAITING_SIGNAL)
    client.cancel(run.id)
    assert failure(run).state == "cancelled"
    assert state_of(client, kid) is RunState.COMPLETED  # an ended child is left as it is
    assert client.count_purgeable() == 2  # the cancelled parent, and its child with it
    client.retry(run.id, "cda_done")
    assert client.count_purgeable() == 0  # the parent is open again: the child is kept
    wait_node(client, run.id, "cda_done", StepState.WAITING_SIGNAL)
    assert node_state(client, run.id, "cda_leaf") is StepState.COMPLETED
    client.signal(run.id, "cda_done", "ok")
    assert run.result(timeout=10) == [5, "ok"]
    assert ran(kid, "cda_add") == 1
    assert client.purge() == 2
    for run_id in (run.id, kid):
        with pytest.raises(RunNotFound):
            client.get_run(run_id)


# -- a fan-out over a child workflow ------------------------------------------------------


def test_cancelling_one_child_of_a_workflow_fan_out_and_retrying_it_in_place(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(fan, [1, 2, 3])
    by_item = kids(client, run.id, 3)
    first, second, third = (by_item[f"cda_leaf[{i}]"] for i in range(3))
    for kid in (first, second, third):
        waiting(client, kid)
    client.signal(first, "cda_go", 10)
    wait_until(lambda: state_of(client, first) is RunState.COMPLETED, what="the first child")
    client.cancel(second)
    failed = failure(run)
    assert failed.node == "cda_leaf"
    assert state_of(client, third) is RunState.CANCELLED
    assert state_of(client, first) is RunState.COMPLETED
    with pytest.raises(InvalidTransition):
        client.retry(second, "cda_go")
    client.retry(run.id, "cda_leaf[1]")
    assert kids(client, run.id, 3) == by_item  # one child run per item, ever
    for kid in (second, third):
        assert state_of(client, kid) is RunState.RUNNING
        waiting(client, kid)
    client.signal(third, "cda_go", 30)
    client.signal(second, "cda_go", 20)
    assert run.result(timeout=10) == [12, 24, 36]
    assert ran(first, "cda_add") == 1


# -- failure and retries inside a child ---------------------------------------------------


def test_a_child_step_retrying_in_place_gives_its_last_attempts_result(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(twice_parent, 4)
    assert run.result(timeout=15) == "tag:4002"
    kid = the_kid(client, run.id)
    assert ran(kid, "cda_twice") == 2
    assert [a.outcome for a in client.get_run(kid).step("cda_twice").attempts] == ["retried"]


def test_a_child_failing_for_good_fails_the_parent_once_with_one_child_run(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(never_parent, 1)
    failed = failure(run)
    assert (failed.node, failed.error_kind) == ("cda_never_leaf", "child_failed")
    kid = the_kid(client, run.id)
    assert ran(kid, "cda_never") == 2
    assert ran(run.id, "cda_tag") == 0
    got = client.get_run(run.id)
    assert got.step("cda_never_leaf").output is None
    assert got.step("cda_tag").state is StepState.CANCELLED
    client.retry(run.id, "cda_never_leaf")  # runs the same child run again, and fails again
    assert failure(run).error_kind == "child_failed"
    assert kids(client, run.id) == {"cda_never_leaf": kid}
    assert ran(kid, "cda_never") == 4


# -- keys and deadlines ---------------------------------------------------------------------


def test_submit_once_of_a_parent_starts_one_child_run_in_any_state(client: Client) -> None:
    first = client.submit_once(parent, 1, key="cda-once")
    again = client.submit_once(parent, 1, key="cda-once")
    assert again.id == first.id and again.created is False
    kid = the_kid(client, first.id)
    client.cancel(kid)
    assert failure(first).error_kind == "child_failed"
    third = client.submit_once(parent, 1, key="cda-once")
    assert third.id == first.id and third.created is False
    assert kids(client, first.id) == {"cda_leaf": kid}
    assert len(client.list_runs(workflow="cda_leaf")) == 1


def test_a_pause_of_a_child_past_its_parents_deadline_ends_the_parent(
    client: Client, clock: Callable[[datetime], None]
) -> None:
    run = client.submit(parent, 1, deadline=timedelta(hours=1))
    kid = the_kid(client, run.id)
    clock(datetime.now(UTC) + timedelta(hours=2))  # no scanner runs in this test
    with pytest.raises(PassedDeadline):
        client.pause(kid)
    failed = failure(run)
    assert (failed.state, failed.error_kind) == ("failed", "deadline")
    assert state_of(client, kid) is RunState.CANCELLED


def test_a_cancel_of_a_child_past_its_parents_deadline_fails_the_parent_by_its_deadline(
    client: Client, clock: Callable[[datetime], None]
) -> None:
    run = client.submit(parent, 1, deadline=timedelta(hours=1))
    kid = the_kid(client, run.id)
    clock(datetime.now(UTC) + timedelta(hours=2))  # no scanner runs in this test
    with contextlib.suppress(AlreadyTerminal):  # refused past the deadline: recorded there
        client.cancel(kid)
    failed = failure(run)
    assert (failed.state, failed.error_kind) == ("failed", "deadline")
