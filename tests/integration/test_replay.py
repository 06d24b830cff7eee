"""Operator replay, ``client.retry(run_id, node, force=True)``: a node that completed and
everything downstream of it run again; the rest keeps its outcome."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from cyclone_dsl import (
    Client,
    InvalidTransition,
    StepContext,
    Worker,
    child,
    for_each,
    step,
    workflow,
)
from cyclone_dsl.states import RunState, StepState

StartWorker = Callable[..., Worker]

calls: Counter[tuple[int, str]] = Counter()
lock = threading.Lock()
#: What rp_size returns: the test changes it between the first run and the replay.
sizes = {"n": 2}
release = threading.Event()


@pytest.fixture(autouse=True)
def _fresh() -> None:
    with lock:
        calls.clear()
    sizes["n"] = 2
    release.set()


def count(ctx: StepContext) -> None:
    with lock:
        calls[(ctx.run_id, ctx.node)] += 1


@step(name="rp_first")
def first(x: int, *, ctx: StepContext) -> int:
    count(ctx)
    return x + 1


@step(name="rp_size")
def size(x: int, *, ctx: StepContext) -> int:
    count(ctx)
    return x * sizes["n"]


@step(name="rp_last")
def last(x: int, *, ctx: StepContext) -> int:
    count(ctx)
    return x + 100


@step(name="rp_items")
def items(n: int, *, ctx: StepContext) -> list[int]:
    count(ctx)
    return list(range(n))


@step(name="rp_item")
def item(x: int, *, ctx: StepContext) -> int:
    count(ctx)
    return x * 10


@step(name="rp_blocks")
def blocks(x: int, *, ctx: StepContext) -> int:
    count(ctx)
    release.wait(20)
    return x


@workflow(name="rp_chain")
def chain(x):  # type: ignore[no-untyped-def]
    return last(size(first(x)))


@workflow(name="rp_fan")
def fan(x):  # type: ignore[no-untyped-def]
    return for_each(item, over=items(size(x)))


@workflow(name="rp_parallel")
def parallel(x):  # type: ignore[no-untyped-def]
    a = first(x)
    slow = blocks(x)
    return last(a, after=[slow])


@workflow(name="rp_inner")
def inner(x):  # type: ignore[no-untyped-def]
    return first(x)


@workflow(name="rp_parent")
def parent(x):  # type: ignore[no-untyped-def]
    return last(child(inner, size(x)))


def test_a_replay_reruns_the_node_and_its_downstream_only(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(chain)
    run = client.submit(chain, 1)
    assert run.result(timeout=30) == 104  # (1 + 1) * 2 + 100
    sizes["n"] = 3  # the "fixed" handler
    client.retry(run.id, "rp_size", force=True)
    assert run.result(timeout=30) == 106  # (1 + 1) * 3 + 100
    with lock:
        assert calls[(run.id, "rp_first")] == 1
        assert calls[(run.id, "rp_size")] == 2
        assert calls[(run.id, "rp_last")] == 2
    steps = {s.node: s for s in client.get_run(run.id).steps}
    assert [a.outcome for a in steps["rp_size"].attempts] == ["replayed"]
    assert [a.outcome for a in steps["rp_last"].attempts] == ["replayed"]
    assert steps["rp_first"].attempts == ()


def test_a_replayed_fan_out_expands_again_from_its_new_input(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(fan)
    run = client.submit(fan, 2)
    assert run.result(timeout=30) == [0, 10, 20, 30]
    sizes["n"] = 1
    client.retry(run.id, "rp_size", force=True)
    assert run.result(timeout=30) == [0, 10]
    nodes = {s.node for s in client.get_run(run.id).steps}
    assert {"rp_item[0]", "rp_item[1]"} <= nodes
    assert "rp_item[2]" not in nodes


def test_a_replay_is_refused_while_its_part_is_under_way(
    client: Client, start_worker: StartWorker
) -> None:
    release.clear()
    start_worker(parallel)
    run = client.submit(parallel, 1)
    try:
        _wait_for_state(client, run.id, "rp_blocks", StepState.RUNNING)
        with pytest.raises(InvalidTransition, match="under way"):
            client.retry(run.id, "rp_blocks", force=True)
        _wait_for_state(client, run.id, "rp_first", StepState.COMPLETED)
        with pytest.raises(InvalidTransition, match="did not complete"):
            client.retry(run.id, "rp_first", force=True)
    finally:
        release.set()
    assert run.wait(timeout=30).state is RunState.COMPLETED


def test_a_replay_of_a_child_node_is_refused_with_the_way_out(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(parent, inner)
    run = client.submit(parent, 1)
    assert run.result(timeout=30) == 103
    with pytest.raises(InvalidTransition, match="fork"):
        client.retry(run.id, "rp_size", force=True)
    with pytest.raises(InvalidTransition, match="item task"):
        client.retry(run.id, "x[1]", force=True)
    client.retry(run.id, "rp_last", force=True)  # below the child node: fine
    assert run.result(timeout=30) == 103
    assert client.get_run(run.id).state is RunState.COMPLETED


def test_a_plain_retry_still_refuses_a_completed_node(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(chain)
    run = client.submit(chain, 1)
    run.wait(timeout=30)
    with pytest.raises(InvalidTransition, match="only a discarded or cancelled"):
        client.retry(run.id, "rp_size")


def _wait_for_state(client: Client, run_id: int, node: str, state: StepState) -> None:
    from tests.waiting import wait_until

    wait_until(
        lambda: {s.node: s.state for s in client.get_run(run_id).steps}.get(node) is state,
        timeout=20,
        what=f"{node} to be {state.value}",
    )


scores = {"big": False}


@step(name="rp_score")
def score(x: int) -> int:
    return 10 if scores["big"] else x


@step(name="rp_double")
def double(x: int | None) -> int:
    return 0 if x is None else x * 2  # None: the output of a skipped child node


@workflow(name="rp_doubled")
def doubled(x):  # type: ignore[no-untyped-def]
    return double(x)


@workflow(name="rp_skip_child")
def skip_child(x):  # type: ignore[no-untyped-def]
    s = score(x)
    c = child(doubled, s, when=s.gt(5))
    return double.named("after")(c, on_skip="run")


def test_a_replay_judges_a_skipped_child_node_again(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A child node its condition skipped started no child run, yet the replay was refused
    as if it had ("'rp_doubled' started a child run ... fork the run")."""
    scores["big"] = False
    start_worker(score, double, doubled, skip_child)
    run = client.submit(skip_child, 1)
    run.wait(timeout=20)
    assert client.get_run(run.id).step("rp_doubled").state is StepState.SKIPPED
    scores["big"] = True
    client.retry(run.id, "rp_score", force=True)
    assert run.result(timeout=20) == 40


# -- unique keys --------------------------------------------------------------------------


@step(name="rp_unique")
def unique(x: int) -> int:
    return x


def test_replay_of_a_completed_unique_step_while_another_holds_its_key_is_refused(
    client: Client, start_worker: StartWorker
) -> None:
    """docs/concepts/runs-and-steps.md: a unique key is unique among active work; a replay
    while another active step holds it is refused (InvalidTransition naming the key, nothing
    changed), as a plain retry is. It was a raw psycopg UniqueViolation."""
    worker = start_worker(unique)
    first = client.enqueue(unique, 1, unique_key="rp-k")
    assert first.result(timeout=20) == 1
    worker.stop()
    later = datetime.now(UTC) + timedelta(days=365)
    second = client.enqueue(unique, 2, unique_key="rp-k", scheduled_at=later)
    assert second.created and second.id != first.id
    (node,) = [s.node for s in client.get_run(first.id).steps]
    before = client.get_run(first.id)
    with pytest.raises(InvalidTransition, match=f"cannot replay {node!r}.*'rp-k'"):
        client.retry(first.id, node, force=True)
    after = client.get_run(first.id)
    assert after.state is RunState.COMPLETED
    assert [(s.state, s.attempt, s.attempts) for s in after.steps] == [
        (s.state, s.attempt, s.attempts) for s in before.steps
    ]  # nothing changed: no 'replayed' attempt recorded either
    assert client.enqueue(unique, 3, unique_key="rp-k").id == second.id  # still the second's
