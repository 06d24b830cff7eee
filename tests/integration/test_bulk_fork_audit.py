"""Audit: operations in bulk, forks, purge/retention and step events in
combinations the other suites do not cover (parents with failed children in one bulk
batch, paused runs across deadlines, forks of runs with contained failures, fan-outs,
buffered signals and due timers, events across retries, replays and forks, purges of
parent/child trees of different ages through the CLI)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest

from cyclone_dsl import (
    Client,
    Delivery,
    Permanent,
    RunFailed,
    RunFilter,
    RunState,
    StepContext,
    StepState,
    Worker,
    child,
    for_each,
    step,
    wait_signal,
    wait_timer,
    workflow,
)
from tests.cli.runner import in_process
from tests.waiting import scanner_passes, wait_until

StartWorker = Callable[..., Worker]
HOUR = timedelta(hours=1)

FAILING: set[str] = set()
calls: Counter[str] = Counter()
lock = threading.Lock()


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    FAILING.clear()
    with lock:
        calls.clear()
    yield
    FAILING.clear()


def _count(key: str) -> None:
    with lock:
        calls[key] += 1


# -- handlers ------------------------------------------------------------------------------


@step(name="xbf_task", max_attempts=1)
def xbf_task(tag: str, *, ctx: StepContext) -> str:
    _count(f"{ctx.node}:{tag}")
    if tag in FAILING:
        raise Permanent(f"{tag} is set to fail")
    return tag


@step(name="xbf_after")
def xbf_after(value: object) -> str:
    return f"after {value}"


@step(name="xbf_echo")
def xbf_echo(value: object, *, ctx: StepContext) -> object:
    _count(ctx.node)
    return value


@step(name="xbf_bad", max_attempts=1)
def xbf_bad(value: object, *, ctx: StepContext) -> object:
    _count(ctx.node)
    if "bad" in FAILING:
        raise Permanent("bad is set to fail")
    return f"bad ok {value}"


@step(name="xbf_item", max_attempts=1)
def xbf_item(x: int, *, ctx: StepContext) -> int:
    _count(f"item{x}")
    ctx.emit({"item": x, "attempt": ctx.attempt})
    if f"item{x}" in FAILING:
        raise Permanent(f"item {x} is set to fail")
    return x * 10


@step(name="xbf_list")
def xbf_list(n: int) -> list[int]:
    return list(range(n))


@step(name="xbf_sum")
def xbf_sum(values: list[int], *, ctx: StepContext) -> int:
    _count(ctx.node)
    return sum(values)


@step(name="xbf_emitter", max_attempts=2)
def xbf_emitter(tag: str, *, ctx: StepContext) -> str:
    _count(f"emit:{tag}")
    for i in range(3):
        ctx.emit({"tag": tag, "attempt": ctx.attempt, "i": i})
    if tag in FAILING:
        raise RuntimeError(f"{tag} fails on attempt {ctx.attempt}")
    return tag


# -- workflows -----------------------------------------------------------------------------


@workflow(name="xbf_kid")
def xbf_kid(tag):  # type: ignore[no-untyped-def]
    return xbf_task(tag)


@workflow(name="xbf_parent")
def xbf_parent(tag):  # type: ignore[no-untyped-def]
    return xbf_after(child(xbf_kid, tag))


@workflow(name="xbf_wait")
def xbf_wait(tag):  # type: ignore[no-untyped-def]
    return xbf_after(wait_signal("go"))


@workflow(name="xbf_contained")
def xbf_contained(x):  # type: ignore[no-untyped-def]
    a = xbf_echo.named("a")(x)
    b = xbf_bad(a)
    xbf_echo.named("c")(b, on_dep_failure="cancel_branch")
    return xbf_echo.named("d")(a)


@workflow(name="xbf_fan")
def xbf_fan(n):  # type: ignore[no-untyped-def]
    return xbf_sum(for_each(xbf_item, over=xbf_list(n)))


@workflow(name="xbf_signal_after_step")
def xbf_signal_after_step(x):  # type: ignore[no-untyped-def]
    first = xbf_echo.named("first")(x)
    return xbf_after(wait_signal("go", after=first))


@workflow(name="xbf_timer")
def xbf_timer(x):  # type: ignore[no-untyped-def]
    t = wait_timer(HOUR)
    return xbf_echo.named("late")(x, after=t)


@workflow(name="xbf_emits")
def xbf_emits(tag):  # type: ignore[no-untyped-def]
    return xbf_emitter(tag)


HANDLERS = [xbf_task, xbf_after, xbf_echo, xbf_bad, xbf_item, xbf_list, xbf_sum, xbf_emitter]


def states(client: Client, ids: list[int]) -> list[RunState]:
    return [client.get_run(r).state for r in ids]


def ended(client: Client, ids: list[int]) -> None:
    wait_until(
        lambda: all(s.is_terminal for s in states(client, ids)),
        what=f"runs {ids} to end",
    )


def kid_of(client: Client, parent_id: int) -> int:
    return int(wait_until(lambda: client.children_of(parent_id), what="the child run")[0]["id"])


def counts(result: object) -> tuple[int, int, int]:
    return (result.matched, result.acted, result.skipped)  # type: ignore[attr-defined]


# -- bulk ----------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 500])
def test_retry_many_of_a_failed_parent_and_its_failed_child(
    client: Client, start_worker: StartWorker, batch_size: int
) -> None:
    """The child run failed (its step), which failed the parent: both are failed. A
    retry_many of failed runs retries the parent, which retries the child in place."""
    start_worker(*HANDLERS)
    FAILING.add("p")
    parent = client.submit(xbf_parent, "p")
    with pytest.raises(RunFailed):
        parent.result(timeout=20)
    kid = kid_of(client, parent.id)
    ended(client, [kid])
    assert states(client, [parent.id, kid]) == [RunState.FAILED, RunState.FAILED]
    FAILING.clear()
    where = RunFilter(states="failed")
    assert client.retry_many(where, dry_run=True).matched == 2
    result = client.retry_many(where, batch_size=batch_size)
    if batch_size == 1:
        # The parent (batch 1) reopened the child: batch 2 no longer selects it.
        assert counts(result) == (1, 1, 0)
    else:
        assert counts(result) == (2, 1, 1)
        assert result.skipped_runs[0][0] == kid
    assert parent.result(timeout=20) == "after p"
    assert client.get_run(kid).state == RunState.COMPLETED
    assert [c["id"] for c in client.children_of(parent.id)] == [kid]
    assert calls["xbf_task:p"] == 2
    assert counts(client.retry_many(where)) == (0, 0, 0)


def test_resume_many_of_a_run_paused_across_its_deadline(client: Client, clock: Callable) -> None:
    """A deadline's clock stops while the run is paused: resume_many resumes it."""
    run = client.submit(xbf_wait, "d", deadline=HOUR)
    client.pause(run.id)
    clock(2 * HOUR)
    where = RunFilter(workflows="xbf_wait")
    assert client.resume_many(where, dry_run=True).matched == 1
    result = client.resume_many(where)
    assert counts(result) == (1, 1, 0), result.skipped_runs
    got = client.get_run(run.id)
    assert got.state == RunState.RUNNING
    assert got.deadline_at is not None


def test_cancel_many_of_a_run_paused_across_its_deadline_cancels_it(
    client: Client, clock: Callable
) -> None:
    run = client.submit(xbf_wait, "d", deadline=HOUR)
    client.pause(run.id)
    clock(2 * HOUR)
    result = client.cancel_many(RunFilter(workflows="xbf_wait"))
    assert counts(result) == (1, 1, 0), result.skipped_runs
    assert client.get_run(run.id).state == RunState.CANCELLED


def test_bulk_ops_on_a_running_run_past_its_deadline_fail_it_by_its_deadline(
    client: Client, clock: Callable
) -> None:
    run = client.submit(xbf_wait, "d", deadline=HOUR)
    other = client.submit(xbf_wait, "e")
    clock(2 * HOUR)
    result = client.cancel_many(RunFilter(workflows="xbf_wait"))
    # The deadline came first: the run failed by it (not cancelled).
    got = client.get_run(run.id)
    assert got.state == RunState.FAILED
    assert any(s.error_kind == "deadline" for s in got.steps)
    assert client.get_run(other.id).state == RunState.CANCELLED
    assert result.acted == 1
    # retry_many skips it: past its deadline.
    retried = client.retry_many(RunFilter(workflows="xbf_wait"))
    assert (retried.matched, retried.acted) == (1, 0)
    assert "deadline" in retried.skipped_runs[0][1]


def test_cancel_many_of_a_filter_only_the_child_run_matches(
    client: Client,
) -> None:
    """A filter that selects the child run alone cancels it as client.cancel would: its
    parent node fails (child_failed), and the parent with it."""
    parent = client.submit(xbf_parent, "q")
    kid = kid_of(client, parent.id)
    result = client.cancel_many(RunFilter(workflows="xbf_kid"))
    assert counts(result) == (1, 1, 0)
    assert client.get_run(kid).state == RunState.CANCELLED
    got = client.get_run(parent.id)
    assert got.state == RunState.FAILED
    assert got.step("xbf_kid").error_kind == "child_failed"


# -- fork ----------------------------------------------------------------------------------


def test_fork_of_a_completed_run_with_a_contained_failure_reruns_the_failed_branch(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS)
    FAILING.add("bad")
    source = client.submit(xbf_contained, 1)
    assert source.result(timeout=20) == 1
    got = source.get()
    assert got.state == RunState.COMPLETED
    assert got.step("xbf_bad").state == StepState.DISCARDED
    assert got.step("c").state == StepState.CANCELLED
    FAILING.clear()
    fork = client.fork(source.id, "d")
    assert fork.result(timeout=20) == 1
    f = fork.get()
    assert f.step("a").copied
    assert f.step("xbf_bad").state == StepState.COMPLETED and not f.step("xbf_bad").copied
    assert f.step("c").state == StepState.COMPLETED
    assert f.step("c").output == "bad ok 1"
    assert calls["a"] == 1  # copied, never run again
    assert calls["xbf_bad"] == 2
    assert calls["d"] == 2
    assert f.forked_from == source.id and f.fork_node == "d"


def test_fork_of_a_run_failed_in_its_fan_out_from_the_node_after_it(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS)
    FAILING.add("item2")
    source = client.submit(xbf_fan, 4)
    with pytest.raises(RunFailed):
        source.result(timeout=20)
    FAILING.clear()
    before = dict(calls)
    fork = client.fork(source.id, "xbf_sum")
    assert fork.result(timeout=20) == 60
    f = fork.get()
    assert f.step("xbf_list").copied
    fan = f.step("xbf_item")
    assert fan.state == StepState.COMPLETED and not fan.copied
    assert fan.output == [0, 10, 20, 30]
    # The fan-out did not complete in the source: it runs again as new, every item.
    for i in range(4):
        assert calls[f"item{i}"] == before.get(f"item{i}", 0) + 1
    # The source is left as it was.
    assert source.get().state == RunState.FAILED


def test_fork_from_the_fan_out_node_of_a_completed_run_reruns_its_items(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS)
    source = client.submit(xbf_fan, 3)
    assert source.result(timeout=20) == 30
    fork = client.fork(source.id, "xbf_item", input=2)
    # The input changed, but xbf_list was copied: the fan-out still has 3 items.
    assert fork.result(timeout=20) == 30
    assert [calls[f"item{i}"] for i in range(3)] == [2, 2, 2]


def test_a_fork_does_not_take_the_signal_buffered_in_its_source(
    client: Client, start_worker: StartWorker
) -> None:
    source = client.submit(xbf_signal_after_step, 1)
    # No worker yet: "first" has not run, the wait has not started: the signal is buffered.
    assert client.signal(source.id, "go", "for the source") == Delivery.BUFFERED
    fork = client.fork(source.id, "first")
    start_worker(*HANDLERS)
    assert source.result(timeout=20) == "after for the source"
    wait_until(
        lambda: any(s.state == StepState.WAITING_SIGNAL for s in fork.get().steps),
        what="the fork to wait for its own signal",
    )
    assert fork.get().state == RunState.RUNNING
    assert client.signal(fork.id, "go", "for the fork") == Delivery.CONSUMED
    assert fork.result(timeout=20) == "after for the fork"


def test_a_fork_copies_a_timer_that_came_due_in_its_source(
    client: Client, start_worker: StartWorker, clock: Callable
) -> None:
    source = client.submit(xbf_timer, 5)
    clock(2 * HOUR)
    # No scanner ran: the fork applies the due timer first, then copies it.
    fork = client.fork(source.id, "late")
    f = fork.get()
    timer = f.step("timer")
    assert timer.state == StepState.COMPLETED and timer.copied
    assert source.get().step(timer.node).state == StepState.COMPLETED
    start_worker(*HANDLERS)
    assert fork.result(timeout=20) == 5
    assert source.result(timeout=20) == 5


def test_a_fork_of_a_run_with_a_deadline_has_none(client: Client) -> None:
    source = client.submit(xbf_wait, "x", deadline=HOUR)
    fork = client.fork(source.id, "go")
    assert source.get().deadline_at is not None
    assert fork.get().deadline_at is None


def test_a_fork_of_a_parent_waiting_in_a_failed_child_starts_a_fresh_child(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS)
    FAILING.add("k")
    source = client.submit(xbf_parent, "k")
    with pytest.raises(RunFailed):
        source.result(timeout=20)
    old_kid = kid_of(client, source.id)
    FAILING.clear()
    fork = client.fork(source.id, "xbf_after")
    # The child node did not complete in the source: the fork starts its own child run.
    assert fork.result(timeout=20) == "after k"
    new_kid = kid_of(client, fork.id)
    assert new_kid != old_kid
    assert client.get_run(old_kid).state == RunState.FAILED


# -- events --------------------------------------------------------------------------------


def _events(client: Client, run_id: int) -> list[tuple[int, str, int, object, bool]]:
    return [(e.seq, e.node, e.attempt, e.data, e.fenced) for e in client.events(run_id, timeout=20)]


def test_events_across_a_retry_an_operator_retry_and_a_fork(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS)
    FAILING.add("e")
    run = client.submit(xbf_emits, "e")
    with pytest.raises(RunFailed):
        run.result(timeout=20)
    first = _events(client, run.id)
    assert [e[0] for e in first] == list(range(1, 7))
    assert [e[2] for e in first] == [1, 1, 1, 2, 2, 2]
    assert not any(e[4] for e in first)
    # An operator retry (via retry_many) with the handler still failing once.
    result = client.retry_many(RunFilter(workflows="xbf_emits"))
    assert result.acted == 1
    FAILING.clear()
    assert run.result(timeout=20) == "e"
    after = _events(client, run.id)
    assert [e[0] for e in after] == list(range(1, 1 + len(after)))
    assert after[:6] == first
    assert len(after) == 9
    # A fork of it: its own numbering from 1, the source's untouched.
    fork = client.fork(run.id, "xbf_emitter")
    assert fork.result(timeout=20) == "e"
    forked = _events(client, fork.id)
    assert [e[0] for e in forked] == [1, 2, 3]
    assert [e[2] for e in forked] == [1, 1, 1]
    assert _events(client, run.id) == after


def test_events_of_a_replayed_fan_out_are_kept_and_numbered_without_gaps(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(*HANDLERS)
    run = client.submit(xbf_fan, 3)
    assert run.result(timeout=20) == 30
    before = _events(client, run.id)
    assert len(before) == 3
    client.retry(run.id, "xbf_item", force=True)
    assert run.result(timeout=20) == 30
    after = _events(client, run.id)
    assert [e[0] for e in after] == list(range(1, 7))
    assert after[:3] == before
    assert sorted(e[3]["item"] for e in after[3:]) == [0, 1, 2]  # type: ignore[index]


def test_events_of_a_step_forked_after_it_hit_the_cap(
    client: Client, start_worker: StartWorker
) -> None:
    """The cap counts a step's events across its attempts; a fork's step is a new one."""
    start_worker(*HANDLERS, max_events_per_step=4)
    FAILING.add("cap")
    run = client.submit(xbf_emits, "cap")
    with pytest.raises(RunFailed):
        run.result(timeout=20)
    got = _events(client, run.id)
    assert len(got) == 4  # 3 on the first attempt, 1 on the second: the cap
    FAILING.clear()
    fork = client.fork(run.id, "xbf_emitter")
    assert fork.result(timeout=20) == "cap"
    assert len(_events(client, fork.id)) == 3


# -- purge and retention -------------------------------------------------------------------


def test_cli_purge_of_a_parent_and_child_that_ended_hours_apart(
    client: Client, cyclone_dsn: str, start_worker: StartWorker, clock: Callable
) -> None:
    """The child completes at T, the parent fails at T+3h: a purge --older-than 2h at
    T+4h keeps both (the parent is too young, the child belongs to a failed parent); at
    T+6h a purge of failed runs takes the parent only and one of every state the child."""
    start_worker(*HANDLERS, xbf_fail_on_signal, retention=None)
    parent = client.submit(xbf_contained_parent, "t")
    kid = kid_of(client, parent.id)
    wait_until(lambda: client.get_run(kid).state == RunState.COMPLETED, what="the child")
    clock(3 * HOUR)
    client.signal(parent.id, "go", "x")
    with pytest.raises(RunFailed):
        parent.result(timeout=20)
    cli = in_process(cyclone_dsn)
    clock(4 * HOUR)
    dry = cli("purge", "--older-than", "2h", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["would_delete"] == 0
    done = cli("purge", "--older-than", "2h", "--yes", "--json")
    assert json.loads(done.stdout)["deleted"] == 0
    clock(6 * HOUR)
    dry = cli("purge", "--older-than", "2h", "--state", "failed", "--dry-run", "--json")
    assert json.loads(dry.stdout)["would_delete"] == 1
    done = cli("purge", "--older-than", "2h", "--state", "failed", "--yes", "--json")
    assert json.loads(done.stdout)["deleted"] == 1
    assert client.get_run(kid).state == RunState.COMPLETED  # kept: not a failed run
    dry = cli("purge", "--older-than", "2h", "--dry-run", "--json")
    assert json.loads(dry.stdout)["would_delete"] == 1
    done = cli("purge", "--older-than", "2h", "--yes", "--json")
    assert json.loads(done.stdout)["deleted"] == 1
    assert client.list_runs() == []


@step(name="xbf_fail_on_signal", max_attempts=1)
def xbf_fail_on_signal(value: object) -> object:
    raise Permanent(f"failing on {value}")


@workflow(name="xbf_contained_parent")
def xbf_contained_parent(tag):  # type: ignore[no-untyped-def]
    done = child(xbf_kid, tag)
    return xbf_fail_on_signal(wait_signal("go", after=done))


def test_retention_keeps_a_completed_child_while_its_parent_waits_then_takes_both(
    client: Client, start_worker: StartWorker, clock: Callable
) -> None:
    worker = start_worker(*HANDLERS, xbf_fail_on_signal, retention=HOUR)
    parent = client.submit(xbf_contained_parent, "r")
    kid = kid_of(client, parent.id)
    wait_until(lambda: client.get_run(kid).state == RunState.COMPLETED, what="the child")
    clock(5 * HOUR)
    scanner_passes(worker, 3)
    assert client.get_run(kid).state == RunState.COMPLETED  # kept: its parent waits
    client.signal(parent.id, "go", "x")
    with pytest.raises(RunFailed):
        parent.result(timeout=20)
    clock(7 * HOUR)
    wait_until(lambda: client.list_runs() == [], what="both runs to go")


# -- more bulk: trees ------------------------------------------------------------------------


@workflow(name="xbf_fan_kids")
def xbf_fan_kids(tags):  # type: ignore[no-untyped-def]
    return xbf_after(for_each(xbf_kid, over=tags))


@pytest.mark.parametrize("batch_size", [1, 500])
def test_retry_many_of_a_fan_out_parent_with_a_failed_and_cancelled_child_runs(
    client: Client, start_worker: StartWorker, batch_size: int
) -> None:
    FAILING.add("f1")
    parent = client.submit(xbf_fan_kids, ["f0", "f1", "f2"])
    kids = wait_until(
        lambda: (
            [c["id"] for c in client.children_of(parent.id)]
            if len(client.children_of(parent.id)) == 3
            else None
        ),
        what="the three child runs",
    )
    start_worker(*HANDLERS)
    with pytest.raises(RunFailed):
        parent.result(timeout=20)
    ended(client, kids)
    before = states(client, kids)
    assert RunState.FAILED in before
    FAILING.clear()
    where = RunFilter(states=["failed", "cancelled"])
    dry = client.retry_many(where, dry_run=True)
    assert dry.matched == 1 + sum(1 for s in before if s != RunState.COMPLETED)
    result = client.retry_many(where, batch_size=batch_size)
    assert result.acted == 1, result
    assert result.matched == result.acted + result.skipped
    assert all("does not wait" in why or "running" in why for _, why in result.skipped_runs)
    assert parent.result(timeout=20) == "after ['f0', 'f1', 'f2']"
    assert states(client, kids) == [RunState.COMPLETED] * 3
    assert sorted(c["id"] for c in client.children_of(parent.id)) == sorted(kids)


def test_retry_many_reopens_a_child_that_was_paused_on_its_own_when_its_parent_was_cancelled(
    client: Client, start_worker: StartWorker
) -> None:
    parent = client.submit(xbf_parent, "z")
    kid = kid_of(client, parent.id)
    client.pause(kid)
    client.cancel(parent.id)
    assert states(client, [parent.id, kid]) == [RunState.CANCELLED] * 2
    result = client.retry_many(RunFilter(workflows="xbf_parent", states="cancelled"))
    assert counts(result) == (1, 1, 0)
    start_worker(*HANDLERS)
    assert parent.result(timeout=20) == "after z"
    assert client.get_run(kid).state == RunState.COMPLETED


def test_resume_many_with_batches_of_one_over_a_paused_tree(client: Client) -> None:
    parent = client.submit(xbf_parent, "t")
    kid = kid_of(client, parent.id)
    client.pause(parent.id)
    assert states(client, [parent.id, kid]) == [RunState.PAUSED] * 2
    where = RunFilter(match_all=True)
    assert client.resume_many(where, dry_run=True).matched == 2
    result = client.resume_many(where, batch_size=1)
    assert result.acted == 1
    assert states(client, [parent.id, kid]) == [RunState.RUNNING] * 2


def test_a_fork_of_a_paused_run_runs_while_its_source_stays_paused(
    client: Client, start_worker: StartWorker
) -> None:
    source = client.submit(xbf_contained, 3)
    client.pause(source.id)
    fork = client.fork(source.id, "a")
    assert fork.get().state == RunState.RUNNING
    start_worker(*HANDLERS)
    assert fork.result(timeout=20) == 3
    assert source.get().state == RunState.PAUSED
    client.resume(source.id)
    assert source.result(timeout=20) == 3


def test_cancel_many_then_fork_of_each_cancelled_run(
    client: Client, start_worker: StartWorker
) -> None:
    runs = [client.submit(xbf_signal_after_step, i) for i in range(3)]
    start_worker(*HANDLERS)
    wait_until(
        lambda: all(any(s.state == StepState.WAITING_SIGNAL for s in r.get().steps) for r in runs),
        what="the waits",
    )
    assert client.cancel_many(RunFilter(workflows="xbf_signal_after_step")).acted == 3
    forks = [client.fork(r.id, "go") for r in runs]
    for i, f in enumerate(forks):
        assert f.get().step("first").copied
        assert client.signal(f.id, "go", i) == Delivery.CONSUMED
        assert f.result(timeout=20) == f"after {i}"
    assert calls["first"] == 3


@workflow(name="xbf_timed_wait")
def xbf_timed_wait(tag):  # type: ignore[no-untyped-def]
    return xbf_after(wait_signal("go", timeout=HOUR))


def test_retry_many_settles_a_signal_timeout_no_scanner_applied_then_retries_it(
    client: Client, start_worker: StartWorker, clock: Callable
) -> None:
    run = client.submit(xbf_timed_wait, "s")
    clock(2 * HOUR)
    where = RunFilter(workflows="xbf_timed_wait", error_kinds="signal_timeout")
    assert client.retry_many(where, dry_run=True).matched == 1
    result = client.retry_many(where)
    assert counts(result) == (1, 1, 0)
    got = client.get_run(run.id)
    assert got.state == RunState.RUNNING
    assert got.step("go").state == StepState.WAITING_SIGNAL
    worker = start_worker(*HANDLERS)
    scanner_passes(worker, 2)
    assert client.get_run(run.id).step("go").state == StepState.WAITING_SIGNAL
    assert client.signal(run.id, "go", 1) == Delivery.CONSUMED
    assert run.result(timeout=20) == "after 1"
