"""Audit of child runs and forks: nested children, failures and cancels across the
parent/child boundary, signals to grandchildren, purge, and client.fork in its cases."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from cyclone_dsl import (
    Client,
    Concurrency,
    CycloneError,
    InvalidArgument,
    InvalidTransition,
    Registry,
    RunFailed,
    RunNotFound,
    RunState,
    SignalNotDeliverable,
    StepContext,
    StepState,
    Worker,
    WorkflowDef,
    child,
    define_result,
    for_each,
    step,
    wait_signal,
    workflow,
)
from tests.waiting import wait_until

StartWorker = Callable[..., Worker]

lock = threading.Lock()
calls: Counter[tuple[int, str]] = Counter()
told: dict[str, bool] = {}
release = threading.Event()


@pytest.fixture(autouse=True)
def _fresh() -> None:
    with lock:
        calls.clear()
        told.clear()
    release.clear()


def record(ctx: StepContext) -> None:
    with lock:
        calls[(ctx.run_id, ctx.node)] += 1


def ran(run_id: int) -> dict[str, int]:
    with lock:
        return {node: n for (run, node), n in calls.items() if run == run_id}


# -- steps ---------------------------------------------------------------------------


@step(name="cfa_double")
def double(x: int, *, ctx: StepContext) -> int:
    record(ctx)
    return x * 2


@step(name="cfa_inc")
def inc(x: int, *, ctx: StepContext) -> int:
    record(ctx)
    return x + 1


@step(name="cfa_tag")
def tag(x: object, *, ctx: StepContext) -> str:
    record(ctx)
    return f"tag:{x}"


@step(name="cfa_boom", max_attempts=1)
def boom(x: object, *, ctx: StepContext) -> int:
    record(ctx)
    raise ValueError("cfa boom")


@step(name="cfa_slow", max_attempts=1, timeout=0.3)
def slow(x: object, *, ctx: StepContext) -> int:
    record(ctx)
    ctx.wait_cancelled(5)
    return 0


@step(name="cfa_hold", max_attempts=1)
def hold(x: object, *, ctx: StepContext) -> str:
    """Block until the test releases it or the step is cancelled; record which."""
    record(ctx)
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        if release.is_set():
            return f"held {x}"
        if ctx.cancelled:
            with lock:
                told[f"{ctx.run_id}:{ctx.node}"] = True
            return "cancelled"
        time.sleep(0.02)
    return "timed out"


@step(name="cfa_items")
def items(x: int, *, ctx: StepContext) -> list[int]:
    record(ctx)
    return list(range(x))


@step(name="cfa_sq")
def sq(x: int, *, ctx: StepContext) -> int:
    record(ctx)
    return x * x


@step(name="cfa_join")
def join(a: object, b: object, *, ctx: StepContext) -> list[object]:
    record(ctx)
    return [a, b]


@step(name="cfa_score")
def score(x: dict[str, Any], *, ctx: StepContext) -> float:
    record(ctx)
    return float(x["score"])


@step(name="cfa_escalate")
def escalate(x: dict[str, Any], *, ctx: StepContext) -> str:
    record(ctx)
    return "escalated"


@step(name="cfa_ship")
def ship(x: dict[str, Any], *, ctx: StepContext) -> str:
    record(ctx)
    return "shipped"


STEPS = [double, inc, tag, boom, slow, hold, items, sq, join, score, escalate, ship]


# -- workflows -------------------------------------------------------------------------


@workflow(name="cfa_leaf")
def leaf(x):  # type: ignore[no-untyped-def]
    return inc(double(x))


@workflow(name="cfa_mid")
def mid(x):  # type: ignore[no-untyped-def]
    return tag(child(leaf, x))


@workflow(name="cfa_top")
def top(x):  # type: ignore[no-untyped-def]
    return tag.named("outer")(child(mid, x))


@workflow(name="cfa_failing_leaf")
def failing_leaf(x):  # type: ignore[no-untyped-def]
    return boom(double(x))


@workflow(name="cfa_failing_parent")
def failing_parent(x):  # type: ignore[no-untyped-def]
    return tag(child(failing_leaf, x))


@workflow(name="cfa_timeout_leaf")
def timeout_leaf(x):  # type: ignore[no-untyped-def]
    return slow(x)


@workflow(name="cfa_timeout_parent")
def timeout_parent(x):  # type: ignore[no-untyped-def]
    return tag(child(timeout_leaf, x))


@workflow(name="cfa_contained_parent")
def contained_parent(x):  # type: ignore[no-untyped-def]
    got = child(failing_leaf, x)
    tag(got, on_dep_failure="cancel_branch")
    return double(x)


@workflow(name="cfa_cut_leaf")
def cut_leaf(x):  # type: ignore[no-untyped-def]
    failed = boom(x)
    double(x)
    define_result(inc(failed, on_dep_failure="cancel_branch"))


@workflow(name="cfa_cut_quiet_leaf")
def cut_quiet_leaf(x):  # type: ignore[no-untyped-def]
    failed = boom(x)
    inc(failed, on_dep_failure="cancel_branch")
    double(x)


@workflow(name="cfa_cut_parent")
def cut_parent(x):  # type: ignore[no-untyped-def]
    return tag(child(cut_leaf, x))


@workflow(name="cfa_cut_quiet_parent")
def cut_quiet_parent(x):  # type: ignore[no-untyped-def]
    got = child(cut_quiet_leaf, x)
    return double(x, after=[got])


@workflow(name="cfa_hold_leaf")
def hold_leaf(x):  # type: ignore[no-untyped-def]
    return hold(x)


@workflow(name="cfa_hold_mid")
def hold_mid(x):  # type: ignore[no-untyped-def]
    return tag(child(hold_leaf, x))


@workflow(name="cfa_hold_top")
def hold_top(x):  # type: ignore[no-untyped-def]
    return tag.named("outer")(child(hold_mid, x))


@workflow(name="cfa_signal_leaf")
def signal_leaf(x):  # type: ignore[no-untyped-def]
    return inc(wait_signal("cfa_go"), after=[double(x)])


@workflow(name="cfa_signal_mid")
def signal_mid(x):  # type: ignore[no-untyped-def]
    return tag(child(signal_leaf, x))


@workflow(name="cfa_signal_top")
def signal_top(x):  # type: ignore[no-untyped-def]
    return child(signal_mid, x)


@workflow(name="cfa_two_children")
def two_children(x):  # type: ignore[no-untyped-def]
    first = child(hold_leaf, x)
    second = child(signal_leaf, x)
    tag(first, on_dep_failure="cancel_branch")
    return tag.named("second_tag")(second)


# -- fork workflows --------------------------------------------------------------------


@workflow(name="cfa_chain")
def chain(x):  # type: ignore[no-untyped-def]
    a = double(x)
    b = inc(a)
    c = tag(b)
    double.named("side")(x)
    return join(c, b)


@workflow(name="cfa_fan")
def fan(x):  # type: ignore[no-untyped-def]
    listed = items(x)
    squares = for_each(sq, over=listed)
    return join(squares, listed)


@workflow(name="cfa_branchy")
def branchy(x):  # type: ignore[no-untyped-def]
    risk = score(x)
    review = escalate(x, when=risk.gt(0.5))
    shipped = ship(x, otherwise=review)
    return join(review, shipped)


@workflow(name="cfa_with_child")
def with_child(x):  # type: ignore[no-untyped-def]
    got = child(leaf, x)
    return tag(got, after=[double.named("pre")(x)])


@workflow(name="cfa_waiting")
def waiting(x):  # type: ignore[no-untyped-def]
    a = double(x)
    go = wait_signal("cfa_go")
    return join(a, inc(go))


@workflow(name="cfa_limited", concurrency=Concurrency(limit=1))
def limited(x):  # type: ignore[no-untyped-def]
    a = double(x)
    return tag(hold(a))


def workers(start_worker: StartWorker, **options: Any) -> Worker:
    options.setdefault("concurrency", 8)
    return start_worker(
        *STEPS,
        leaf,
        mid,
        failing_leaf,
        timeout_leaf,
        cut_leaf,
        cut_quiet_leaf,
        hold_leaf,
        hold_mid,
        signal_leaf,
        signal_mid,
        **options,
    )


def child_of(client: Client, run_id: int) -> dict[str, Any]:
    kids = client.children_of(run_id)
    assert len(kids) == 1, kids
    return kids[0]


# -- child runs ------------------------------------------------------------------------


def test_three_deep_result_and_introspection(client: Client, start_worker: StartWorker) -> None:
    workers(start_worker)
    run = client.submit(top, 5)
    assert run.result(timeout=20) == "tag:tag:11"
    middle = child_of(client, run.id)
    assert (middle["workflow"], middle["parent_node_id"]) == ("cfa_mid", "cfa_mid")
    bottom = child_of(client, middle["id"])
    assert bottom["workflow"] == "cfa_leaf" and bottom["state"] == "completed"
    assert client.children_of(bottom["id"]) == []
    assert client.get_run(bottom["id"]).parent_run_id == middle["id"]
    assert client.get_run(middle["id"]).parent_run_id == run.id
    assert client.progress(run.id) == (2, 2)
    assert client.progress(bottom["id"]) == (2, 2)
    assert client.dependencies(run.id) == {"outer": ["cfa_mid"]}
    assert client.dependencies(middle["id"]) == {"cfa_tag": ["cfa_leaf"]}
    assert client.dependencies(bottom["id"]) == {"cfa_inc": ["cfa_double"]}
    assert client.get_run(run.id).step("cfa_mid").output == "tag:11"


def test_a_failed_child_fails_the_parent_node_with_child_failed(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(failing_parent, 1)
    with pytest.raises(RunFailed) as caught:
        run.result(timeout=20)
    kid = child_of(client, run.id)
    assert kid["state"] == "failed"
    assert caught.value.state == "failed"
    assert caught.value.node == "cfa_failing_leaf"
    assert caught.value.error_kind == "child_failed"
    assert str(kid["id"]) in (caught.value.error or "")
    parent = client.get_run(run.id)
    assert parent.step("cfa_failing_leaf").state is StepState.DISCARDED
    assert parent.step("cfa_tag").state is StepState.CANCELLED
    assert ran(run.id) == {}


def test_a_child_whose_step_times_out_fails_the_parent(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(timeout_parent, 1)
    with pytest.raises(RunFailed) as caught:
        run.result(timeout=20)
    assert caught.value.error_kind == "child_failed"
    assert caught.value.node == "cfa_timeout_leaf"
    kid = client.get_run(child_of(client, run.id)["id"])
    assert kid.state is RunState.FAILED
    assert kid.step("cfa_slow").error_kind == "timeout"


def test_cancel_branch_contains_a_failed_child(client: Client, start_worker: StartWorker) -> None:
    workers(start_worker)
    run = client.submit(contained_parent, 4)
    assert run.result(timeout=20) == 8
    got = client.get_run(run.id)
    assert got.state is RunState.COMPLETED
    assert got.step("cfa_failing_leaf").state is StepState.DISCARDED
    assert got.step("cfa_failing_leaf").error_kind == "child_failed"
    assert got.step("cfa_tag").state is StepState.CANCELLED
    assert child_of(client, run.id)["state"] == "failed"


def test_a_child_whose_result_was_cut_off_fails_a_parent_that_needs_it(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(cut_parent, 3)
    with pytest.raises(RunFailed) as caught:
        run.result(timeout=20)
    kid = child_of(client, run.id)
    assert kid["state"] == "completed"  # the child contained its failure
    assert caught.value.error_kind == "child_failed"
    assert "without a result" in (caught.value.error or "")
    assert ran(run.id) == {}  # cfa_tag never took None


def test_a_child_without_result_whose_branch_was_cut_completes_the_parent_node(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(cut_quiet_parent, 3)
    assert run.result(timeout=20) == 6
    got = client.get_run(run.id)
    assert got.step("cfa_cut_quiet_leaf").state is StepState.COMPLETED
    assert got.step("cfa_cut_quiet_leaf").output is None


def test_cancelling_the_parent_cancels_every_descendant_and_tells_the_handler(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(hold_top, 1)
    middle = wait_until(lambda: client.children_of(run.id), what="the middle child")[0]
    bottom = wait_until(lambda: client.children_of(middle["id"]), what="the leaf child")[0]
    wait_until(lambda: ran(bottom["id"]).get("cfa_hold"), what="the leaf handler to start")
    client.cancel(run.id)
    assert client.get_run(run.id).state is RunState.CANCELLED
    assert client.get_run(middle["id"]).state is RunState.CANCELLED
    assert client.get_run(bottom["id"]).state is RunState.CANCELLED
    wait_until(lambda: told.get(f"{bottom['id']}:cfa_hold"), what="the handler to be told")
    with pytest.raises(RunFailed) as caught:
        run.result(timeout=5)
    assert caught.value.state == "cancelled"


def test_cancelling_a_child_fails_only_its_parent_node(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(two_children, 2)
    kids = wait_until(
        lambda: len(client.children_of(run.id)) == 2 and client.children_of(run.id),
        what="both children",
    )
    by_node = {k["parent_node_id"]: k for k in kids}
    held = by_node["cfa_hold_leaf"]["id"]
    waiting_kid = by_node["cfa_signal_leaf"]["id"]
    wait_until(lambda: ran(held).get("cfa_hold"), what="the held handler")
    client.cancel(held)
    parent = client.get_run(run.id)
    assert parent.state is RunState.RUNNING
    assert parent.step("cfa_hold_leaf").state is StepState.DISCARDED
    assert parent.step("cfa_hold_leaf").error_kind == "child_failed"
    assert parent.step("cfa_tag").state is StepState.CANCELLED
    assert client.get_run(waiting_kid).state is RunState.RUNNING
    wait_until(
        lambda: any(s.state is StepState.WAITING_SIGNAL for s in client.get_run(waiting_kid).steps),
        what="the signal wait",
    )
    client.signal(waiting_kid, "cfa_go", 9)
    assert run.result(timeout=20) == "tag:10"


def test_a_signal_reaches_the_grandchild_that_waits_for_it(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(signal_top, 1)
    middle = wait_until(lambda: client.children_of(run.id), what="the middle child")[0]
    bottom = wait_until(lambda: client.children_of(middle["id"]), what="the leaf child")[0]
    with pytest.raises(SignalNotDeliverable):
        client.signal(run.id, "cfa_go", 1)
    with pytest.raises(SignalNotDeliverable):
        client.signal(middle["id"], "cfa_go", 1)
    client.signal(bottom["id"], "cfa_go", 41)
    assert run.result(timeout=20) == "tag:42"
    assert [s["payload"] for s in client.signals_of(bottom["id"])] == [41]
    assert client.signals_of(run.id) == []


def test_purge_keeps_children_of_an_open_parent_and_deletes_them_with_it(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(two_children, 2)
    kids = wait_until(
        lambda: len(client.children_of(run.id)) == 2 and client.children_of(run.id),
        what="both children",
    )
    by_node = {k["parent_node_id"]: k["id"] for k in kids}
    release.set()
    wait_until(
        lambda: client.get_run(by_node["cfa_hold_leaf"]).state is RunState.COMPLETED,
        what="the first child to end",
    )
    client.purge()
    assert client.get_run(by_node["cfa_hold_leaf"]).state is RunState.COMPLETED  # kept
    wait_until(
        lambda: any(
            s.state is StepState.WAITING_SIGNAL
            for s in client.get_run(by_node["cfa_signal_leaf"]).steps
        ),
        what="the signal wait",
    )
    client.signal(by_node["cfa_signal_leaf"], "cfa_go", 1)
    assert run.result(timeout=20) == "tag:2"
    assert client.purge() == 3
    for run_id in (run.id, *by_node.values()):
        with pytest.raises(RunNotFound):
            client.get_run(run_id)
        with pytest.raises(RunNotFound):
            client.children_of(run_id)


# -- forks -----------------------------------------------------------------------------


def test_fork_of_a_completed_run_from_a_middle_node_copies_the_rest(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*STEPS)
    source = client.submit(chain, 3)
    assert source.result(timeout=20) == ["tag:7", 7]
    fork = client.fork(source.id, "cfa_inc")
    assert fork.result(timeout=20) == ["tag:7", 7]
    assert ran(fork.id) == {"cfa_inc": 1, "cfa_tag": 1, "cfa_join": 1}
    got = client.get_run(fork.id)
    assert {s.node for s in got.steps if s.copied} == {"cfa_double", "side"}
    assert got.step("cfa_double").output == 6 and got.step("side").output == 6
    assert (got.forked_from, got.fork_node) == (source.id, "cfa_inc")
    assert client.progress(fork.id) == (5, 5)


def test_fork_from_the_first_node_runs_everything_again(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*STEPS)
    source = client.submit(chain, 3)
    source.result(timeout=20)
    fork = client.fork(source.id, "cfa_double", input=10)
    assert fork.result(timeout=20) == ["tag:21", 21]
    assert ran(fork.id) == {"cfa_double": 1, "cfa_inc": 1, "cfa_tag": 1, "cfa_join": 1}
    # "side" does not depend on cfa_double: copied with the old input's output
    assert client.get_run(fork.id).step("side").output == 6


def test_fork_from_the_result_node_runs_only_it(client: Client, start_worker: StartWorker) -> None:
    start_worker(*STEPS)
    source = client.submit(chain, 1)
    source.result(timeout=20)
    fork = client.fork(source.id, "cfa_join")
    assert fork.result(timeout=20) == ["tag:3", 3]
    assert ran(fork.id) == {"cfa_join": 1}


def test_fork_from_a_fan_out_node_runs_its_items_again(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*STEPS)
    source = client.submit(fan, 3)
    assert source.result(timeout=20) == [[0, 1, 4], [0, 1, 2]]
    fork = client.fork(source.id, "cfa_sq")
    assert fork.result(timeout=20) == [[0, 1, 4], [0, 1, 2]]
    assert ran(fork.id) == {"cfa_sq[0]": 1, "cfa_sq[1]": 1, "cfa_sq[2]": 1, "cfa_join": 1}
    steps = client.get_run(fork.id).steps
    assert {s.node for s in steps if s.copied} == {"cfa_items"}


def test_fork_from_a_taken_conditional_node(client: Client, start_worker: StartWorker) -> None:
    start_worker(*STEPS)
    source = client.submit(branchy, {"score": 0.9})
    assert source.result(timeout=20) == ["escalated", None]
    fork = client.fork(source.id, "cfa_escalate")
    assert fork.result(timeout=20) == ["escalated", None]
    assert ran(fork.id) == {"cfa_escalate": 1, "cfa_join": 1}
    assert client.get_run(fork.id).step("cfa_ship").state is StepState.SKIPPED


def test_fork_from_a_skipped_conditional_node(client: Client, start_worker: StartWorker) -> None:
    start_worker(*STEPS)
    source = client.submit(branchy, {"score": 0.1})
    assert source.result(timeout=20) == [None, "shipped"]
    fork = client.fork(source.id, "cfa_escalate")
    assert fork.result(timeout=20) == [None, "shipped"]
    # cfa_ship hangs on cfa_score alone (otherwise= adds no edge): copied, not run again
    assert ran(fork.id) == {"cfa_join": 1}
    got = client.get_run(fork.id)
    assert got.step("cfa_escalate").state is StepState.SKIPPED
    assert {s.node for s in got.steps if s.copied} == {"cfa_score", "cfa_ship"}
    again = client.fork(source.id, "cfa_score", input={"score": 0.9})
    assert again.result(timeout=20) == ["escalated", None]
    assert ran(again.id) == {"cfa_score": 1, "cfa_escalate": 1, "cfa_join": 1}
    assert client.get_run(again.id).step("cfa_ship").state is StepState.SKIPPED


def test_fork_of_a_cancelled_run_waits_again(client: Client, start_worker: StartWorker) -> None:
    start_worker(*STEPS)
    source = client.submit(waiting, 2)
    wait_until(lambda: ran(source.id).get("cfa_double"), what="the first step")
    wait_until(
        lambda: client.get_run(source.id).step("cfa_double").state is StepState.COMPLETED,
        what="the first step to complete",
    )
    client.cancel(source.id)
    fork = client.fork(source.id, "cfa_inc")
    wait_until(
        lambda: client.get_run(fork.id).step("cfa_go").state is StepState.WAITING_SIGNAL,
        what="the fork's signal wait",
    )
    client.signal(fork.id, "cfa_go", 5)
    assert fork.result(timeout=20) == [4, 6]
    assert ran(fork.id) == {"cfa_inc": 1, "cfa_join": 1}
    assert client.get_run(source.id).state is RunState.CANCELLED


def test_fork_of_a_running_run_leaves_it_alone(client: Client, start_worker: StartWorker) -> None:
    start_worker(*STEPS)
    source = client.submit(waiting, 2)
    wait_until(
        lambda: client.get_run(source.id).step("cfa_double").state is StepState.COMPLETED,
        what="the first step to complete",
    )
    fork = client.fork(source.id, "cfa_join")
    assert {s.node for s in client.get_run(fork.id).steps if s.copied} == {"cfa_double"}
    client.signal(fork.id, "cfa_go", 1)
    assert fork.result(timeout=20) == [4, 2]
    assert client.get_run(source.id).state is RunState.RUNNING
    client.signal(source.id, "cfa_go", 7)
    assert source.result(timeout=20) == [4, 8]
    assert ran(fork.id) == {"cfa_inc": 1, "cfa_join": 1}


def test_fork_copies_a_completed_child_node_and_starts_none(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    source = client.submit(with_child, 2)
    assert source.result(timeout=20) == "tag:5"
    fork = client.fork(source.id, "cfa_tag")
    assert fork.result(timeout=20) == "tag:5"
    assert client.children_of(fork.id) == []
    assert ran(fork.id) == {"cfa_tag": 1}


def test_fork_from_a_child_node_starts_a_child_of_its_own(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    source = client.submit(with_child, 2)
    source.result(timeout=20)
    old = child_of(client, source.id)
    fork = client.fork(source.id, "cfa_leaf", input=4)
    assert fork.result(timeout=20) == "tag:9"
    new = child_of(client, fork.id)
    assert new["id"] != old["id"] and new["state"] == "completed"
    assert ran(fork.id) == {"cfa_tag": 1}  # "pre" was copied
    assert child_of(client, source.id) == old


def test_fork_of_a_child_run_is_a_top_level_run(client: Client, start_worker: StartWorker) -> None:
    workers(start_worker)
    source = client.submit(mid, 3)
    assert source.result(timeout=20) == "tag:7"
    kid = child_of(client, source.id)
    fork = client.fork(kid["id"], "cfa_inc")
    assert fork.result(timeout=20) == 7
    got = client.get_run(fork.id)
    assert got.parent_run_id is None and got.forked_from == kid["id"]
    assert client.children_of(source.id) == [kid]  # the parent did not get a second child
    assert ran(fork.id) == {"cfa_inc": 1}


def test_fork_of_a_fork(client: Client, start_worker: StartWorker) -> None:
    start_worker(*STEPS)
    source = client.submit(chain, 2)
    source.result(timeout=20)
    first = client.fork(source.id, "cfa_tag")
    first.result(timeout=20)
    second = client.fork(first.id, "cfa_join")
    assert second.result(timeout=20) == ["tag:5", 5]
    assert ran(second.id) == {"cfa_join": 1}
    got = client.get_run(second.id)
    assert got.forked_from == first.id
    assert {s.node for s in got.steps if s.copied} == {"cfa_double", "cfa_inc", "cfa_tag", "side"}
    assert got.step("cfa_tag").output == "tag:5"


def test_fork_under_a_run_concurrency_limit_waits_for_the_source(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*STEPS)
    source = client.submit(limited, 1)
    wait_until(lambda: ran(source.id).get("cfa_hold"), what="the source to hold its slot")
    fork = client.fork(source.id, "cfa_hold")
    time.sleep(1.0)
    assert ran(fork.id) == {}  # the source holds the only slot
    release.set()
    assert source.result(timeout=20) == "tag:held 2"
    assert fork.result(timeout=20) == "tag:held 2"
    assert ran(fork.id) == {"cfa_hold": 1, "cfa_tag": 1}


def test_fork_onto_a_changed_definition_is_refused_without_consent(
    cyclone_dsn: str, client: Client, start_worker: StartWorker
) -> None:
    start_worker(*STEPS)
    source = client.submit(chain, 1)
    source.result(timeout=20)

    def changed(x):  # type: ignore[no-untyped-def]
        return join(tag(inc(double(x))), x)

    newer = WorkflowDef(changed, "cfa_chain")
    registry = Registry()
    registry.add_workflow_tree(newer)
    before = client.run_counts()
    with Client(cyclone_dsn, registry=registry) as other:
        with pytest.raises(InvalidTransition, match="current_definition=True"):
            other.fork(source.id, "cfa_tag")
        assert client.run_counts() == before
        fork = other.fork(source.id, "cfa_tag", current_definition=True)
    got = client.get_run(fork.id)
    assert got.def_version == newer.def_version != source.get().def_version
    assert {s.node for s in got.steps if s.copied} == {"cfa_double", "cfa_inc"}
    assert got.step("cfa_inc").output == 3
    client.cancel(fork.id)  # no worker here serves the newer definition


def test_bad_forks_are_refused_and_write_nothing(client: Client, start_worker: StartWorker) -> None:
    start_worker(*STEPS)
    source = client.submit(fan, 2)
    source.result(timeout=20)
    before = client.run_counts()
    with pytest.raises(InvalidArgument, match="not a node"):
        client.fork(source.id, "cfa_sq[0]")
    with pytest.raises(InvalidArgument, match="not a node"):
        client.fork(source.id, "cfa_nope")
    with pytest.raises(RunNotFound):
        client.fork(source.id + 100, "cfa_sq")
    with pytest.raises(RunNotFound):
        client.fork(0, "cfa_sq")
    with pytest.raises(InvalidArgument):
        client.fork(source.id, "")  # type: ignore[arg-type]
    assert client.run_counts() == before
    assert len(client.list_runs()) == 1


# -- more child and fork cases -----------------------------------------------------------


@workflow(name="cfa_cut_fan")
def cut_fan(x):  # type: ignore[no-untyped-def]
    return for_each(cut_leaf, over=x)


@workflow(name="cfa_leaf_fan")
def leaf_fan(x):  # type: ignore[no-untyped-def]
    return tag(for_each(leaf, over=items(x)))


@workflow(name="cfa_signal_parent")
def signal_parent(x):  # type: ignore[no-untyped-def]
    return tag.named("outer")(child(signal_leaf, double.named("pre")(x)))


def test_cancelling_a_middle_child_reaches_down_and_fails_up(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(hold_top, 1)
    middle = wait_until(lambda: client.children_of(run.id), what="the middle child")[0]
    bottom = wait_until(lambda: client.children_of(middle["id"]), what="the leaf child")[0]
    wait_until(lambda: ran(bottom["id"]).get("cfa_hold"), what="the leaf handler to start")
    client.cancel(middle["id"])
    assert client.get_run(bottom["id"]).state is RunState.CANCELLED
    wait_until(lambda: told.get(f"{bottom['id']}:cfa_hold"), what="the handler to be told")
    with pytest.raises(RunFailed) as caught:
        run.result(timeout=10)
    assert caught.value.state == "failed"
    assert caught.value.node == "cfa_hold_mid"
    assert caught.value.error_kind == "child_failed"
    assert "cancelled" in (caught.value.error or "")
    assert client.get_run(middle["id"]).state is RunState.CANCELLED


def test_cancelling_the_leaf_of_three_fails_every_level_above(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(hold_top, 1)
    middle = wait_until(lambda: client.children_of(run.id), what="the middle child")[0]
    bottom = wait_until(lambda: client.children_of(middle["id"]), what="the leaf child")[0]
    client.cancel(bottom["id"])
    with pytest.raises(RunFailed) as caught:
        run.result(timeout=10)
    assert (caught.value.node, caught.value.error_kind) == ("cfa_hold_mid", "child_failed")
    mid_run = client.get_run(middle["id"])
    assert mid_run.state is RunState.FAILED
    assert mid_run.step("cfa_hold_leaf").error_kind == "child_failed"


def test_a_fan_out_item_whose_child_result_was_cut_fails(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(cut_fan, [1, 2])
    with pytest.raises(RunFailed) as caught:
        run.result(timeout=20)
    # the fan-out node fails as for any failed item; the item names the cut result
    assert (caught.value.node, caught.value.error_kind) == ("cfa_cut_leaf", "dep_failed")
    assert "without a result" in (caught.value.error or "")
    got = client.get_run(run.id)
    failed = [s for s in got.steps if s.node.startswith("cfa_cut_leaf[")]
    assert any(s.error_kind == "child_failed" for s in failed)  # a sibling may be cancelled
    assert all(s.output is None for s in failed)
    assert any(k["state"] == "completed" for k in client.children_of(run.id))


def test_purge_of_ended_runs_three_deep_takes_every_level(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    run = client.submit(hold_top, 1)
    middle = wait_until(lambda: client.children_of(run.id), what="the middle child")[0]
    bottom = wait_until(lambda: client.children_of(middle["id"]), what="the leaf child")[0]
    wait_until(lambda: ran(bottom["id"]).get("cfa_hold"), what="the leaf handler to start")
    client.cancel(run.id)
    wait_until(lambda: told.get(f"{bottom['id']}:cfa_hold"), what="the handler to be told")
    assert client.purge(states=("completed",)) == 0
    assert client.purge() == 3
    for run_id in (run.id, middle["id"], bottom["id"]):
        with pytest.raises(RunNotFound):
            client.progress(run_id)


def test_fork_of_a_failed_run_from_its_child_node(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    source = client.submit(failing_parent, 1)
    with pytest.raises(RunFailed):
        source.result(timeout=20)
    old = child_of(client, source.id)
    fork = client.fork(source.id, "cfa_failing_leaf")
    with pytest.raises(RunFailed) as caught:
        fork.result(timeout=20)
    assert caught.value.error_kind == "child_failed"
    new = child_of(client, fork.id)
    assert new["id"] != old["id"] and new["state"] == "failed"
    assert ran(new["id"]) == {"cfa_double": 1, "cfa_boom": 1}
    assert child_of(client, source.id) == old


def test_fork_from_a_fan_out_over_a_workflow_starts_new_child_runs(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    source = client.submit(leaf_fan, 2)
    assert source.result(timeout=20) == "tag:[1, 3]"
    fork = client.fork(source.id, "cfa_leaf", input=3)  # cfa_items is copied: still [0, 1]
    assert fork.result(timeout=20) == "tag:[1, 3]"
    assert sorted(k["parent_node_id"] for k in client.children_of(fork.id)) == [
        "cfa_leaf[0]",
        "cfa_leaf[1]",
    ]
    assert ran(fork.id) == {"cfa_tag": 1}
    assert len(client.children_of(source.id)) == 2


def test_a_fork_of_a_run_waiting_in_its_child_gets_its_own_child(
    client: Client, start_worker: StartWorker
) -> None:
    workers(start_worker)
    source = client.submit(signal_parent, 1)
    old = wait_until(lambda: client.children_of(source.id), what="the source's child")[0]
    fork = client.fork(source.id, "outer")
    new = wait_until(lambda: client.children_of(fork.id), what="the fork's child")[0]
    assert new["id"] != old["id"]
    assert ran(fork.id) == {}  # "pre" was copied
    client.signal(new["id"], "cfa_go", 10)
    assert fork.result(timeout=20) == "tag:11"
    assert client.get_run(source.id).state is RunState.RUNNING
    assert client.get_run(old["id"]).state is RunState.RUNNING
    client.signal(old["id"], "cfa_go", 20)
    assert source.result(timeout=20) == "tag:21"


def test_fork_with_an_input_that_is_not_json_writes_nothing(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*STEPS)
    source = client.submit(chain, 1)
    source.result(timeout=20)
    before = client.run_counts()
    with pytest.raises(CycloneError):
        client.fork(source.id, "cfa_double", input=object())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        client.fork(source.id, "cfa_double", current_definition="yes")  # type: ignore[arg-type]
    assert client.run_counts() == before
