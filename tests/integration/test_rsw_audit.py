"""Audit: a workflow's run slot (``@workflow(concurrency=Concurrency(key, limit=N))``) and
how promptly the next queued run of its key starts when a run frees its slot.

Flow control (docs/concepts/flow-control.md, "Concurrency keys"): a run takes a slot with
its first claimed step and keeps it until it ends; a run beyond the limit is queued and
"starts when a run of its key ends, in submit order". "However a run ends (its last step,
a signal, a cancel, its deadline), its end wakes the claimers of the queues where runs of
its key wait, so the next one starts at once, not at its workers' next poll."

Workers here poll every 60 s, so a next run that starts within a few seconds was woken,
not polled: each test times out if the wake-up were lost. Where a step ends the holder,
that step runs in another queue (rsw_qb, its own worker) than the next run's first step
(rsw_qa): the step's own end wakes only rsw_qb, so only the run's end can wake rsw_qa.
Runs under way are checked from the first handler's start (after its claim) to the run's
``finished_at`` (the time of the transaction that ended it, before any claim it allows):
at most the limit overlap. Tests marked ``xfail(strict=True)`` show a finding.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from cyclone_dsl import (
    Client,
    Concurrency,
    RunFilter,
    RunHandle,
    StepContext,
    Worker,
    child,
    for_each,
    step,
    wait_signal,
    workflow,
)
from tests.waiting import LONG_POLL, PROMPT, wait_until

#: How long the next run may take to start once its key's slot is free (lost: 60 s).
STALL = 5.0

QA = "rsw_qa"  # the runs' first steps
QB = "rsw_qb"  # the steps that end the runs

#: run id -> when its first handler started (the run took its slot before that).
starts: dict[int, datetime] = {}
#: run id -> its slow step is running (set) / saw its cancel (the value).
slow_running: dict[int, threading.Event] = {}
slow_saw_cancel: dict[int, bool] = {}
#: run ids whose rsw_flaky step failed (a run whose input says "fail" fails once).
failed_once: set[int] = set()
#: run id -> when each of its rsw_flaky handlers started.
flaky_starts: dict[int, list[datetime]] = {}
lock = threading.Lock()


@pytest.fixture(autouse=True)
def _fresh() -> None:
    with lock:
        starts.clear()
        slow_running.clear()
        slow_saw_cancel.clear()
        failed_once.clear()
        flaky_starts.clear()


def _event(run_id: int) -> threading.Event:
    with lock:
        return slow_running.setdefault(run_id, threading.Event())


# -- handlers ----------------------------------------------------------------------------


@step(name="rsw_start")
def rsw_start(job: dict[str, Any], *, ctx: StepContext) -> dict[str, Any]:
    with lock:
        starts.setdefault(ctx.run_id, datetime.now(UTC))
    return job


@step(name="rsw_end")
def rsw_end(job: dict[str, Any]) -> dict[str, Any]:
    return {**job, "ended": True}


@step(name="rsw_boom", max_attempts=1)
def rsw_boom(job: dict[str, Any]) -> dict[str, Any]:
    raise RuntimeError(f"boom {job.get('n')}")


@step(name="rsw_flaky", max_attempts=1)
def rsw_flaky(job: dict[str, Any], *, ctx: StepContext) -> dict[str, Any]:
    with lock:
        flaky_starts.setdefault(ctx.run_id, []).append(datetime.now(UTC))
        if job.get("fail") and ctx.run_id not in failed_once:
            failed_once.add(ctx.run_id)
            raise RuntimeError("fails once")
    return {**job, "flaky": "ok"}


@step(name="rsw_slow")
def rsw_slow(job: dict[str, Any], *, ctx: StepContext) -> dict[str, Any]:
    _event(ctx.run_id).set()
    saw = ctx.wait_cancelled(timeout=30)
    with lock:
        slow_saw_cancel[ctx.run_id] = saw
    return job


@step(name="rsw_list")
def rsw_list(job: dict[str, Any]) -> list[int]:
    return [int(job["n"]) * 10 + i for i in range(3)]


@step(name="rsw_item")
def rsw_item(x: int) -> int:
    return x + 1


# -- workflows (one run of a tenant at a time, unless said) ------------------------------

ONE = Concurrency(key="tenant", limit=1)


@workflow(name="rsw_fail_last", concurrency=ONE)
def rsw_fail_last(job):  # type: ignore[no-untyped-def]
    return rsw_boom(rsw_start(job, queue=QA), queue=QB)


@workflow(name="rsw_fail_branch", concurrency=ONE)
def rsw_fail_branch(job):  # type: ignore[no-untyped-def]
    first = rsw_start(job, queue=QA)
    rsw_slow(first, queue=QB)  # still running when the other branch fails the run
    return rsw_boom(rsw_end(first, queue=QB), queue=QB)


@workflow(name="rsw_contained", concurrency=ONE)
def rsw_contained(job):  # type: ignore[no-untyped-def]
    """A failure contained to its branch: the run completes once the rest has ended."""
    first = rsw_start(job, queue=QA)
    failed = rsw_boom(first, queue=QB)
    rsw_end(failed, queue=QB, on_dep_failure="cancel_branch")
    return rsw_end(first, queue=QB, node_id="other")


@workflow(name="rsw_slow_tail", concurrency=ONE)
def rsw_slow_tail(job):  # type: ignore[no-untyped-def]
    return rsw_slow(rsw_start(job, queue=QA), queue=QB)


@workflow(name="rsw_waits", concurrency=ONE)
def rsw_waits(job):  # type: ignore[no-untyped-def]
    return wait_signal("rsw_go", after=[rsw_start(job, queue=QA)])


@workflow(name="rsw_times_out", concurrency=ONE)
def rsw_times_out(job):  # type: ignore[no-untyped-def]
    return wait_signal("rsw_go", timeout=timedelta(seconds=2), after=[rsw_start(job, queue=QA)])


@workflow(name="rsw_two_waits", concurrency=Concurrency(key="tenant", limit=2))
def rsw_two_waits(job):  # type: ignore[no-untyped-def]
    return wait_signal("rsw_go", after=[rsw_start(job, queue=QA)])


@workflow(name="rsw_fans", concurrency=ONE)
def rsw_fans(job):  # type: ignore[no-untyped-def]
    return for_each(rsw_item, over=rsw_list(rsw_start(job, queue=QA), queue=QA), queue=QB)


@workflow(name="rsw_kid")
def rsw_kid(job):  # type: ignore[no-untyped-def]
    return rsw_end(job, queue=QB)


@workflow(name="rsw_parent", concurrency=ONE)
def rsw_parent(job):  # type: ignore[no-untyped-def]
    return child(rsw_kid, rsw_start(job, queue=QA))


@workflow(name="rsw_retried", concurrency=ONE)
def rsw_retried(job):  # type: ignore[no-untyped-def]
    return wait_signal("rsw_go", after=[rsw_flaky(rsw_start(job, queue=QA), queue=QB)])


@workflow(name="rsw_limited_kid", concurrency=ONE)
def rsw_limited_kid(job):  # type: ignore[no-untyped-def]
    return wait_signal("rsw_go", after=[rsw_start(job, queue=QA)])


@workflow(name="rsw_free_parent")
def rsw_free_parent(job):  # type: ignore[no-untyped-def]
    return child(rsw_limited_kid, job)


# -- helpers -----------------------------------------------------------------------------


def _workers(start_worker: Callable[..., Worker]) -> None:
    """One worker per queue: rsw_qa runs the first steps, rsw_qb the steps that end runs."""
    start_worker(rsw_start, rsw_list, queues=[QA], concurrency=4, poll_interval=LONG_POLL)
    start_worker(
        rsw_end,
        rsw_boom,
        rsw_flaky,
        rsw_slow,
        rsw_item,
        queues=[QB],
        concurrency=4,
        poll_interval=LONG_POLL,
    )


def _started(run: RunHandle[Any], timeout: float = PROMPT) -> None:
    wait_until(lambda: run.id in starts, timeout=timeout, what=f"run {run.id}'s first step")


def _queued(client: Client, run: RunHandle[Any], used: str = "1/1") -> None:
    """The run waits for a run slot of its key (and has not started)."""
    wait_until(
        lambda: f"{used} runs under way" in " ".join(client.why_waiting(run.id).values()),
        timeout=PROMPT,
        what=f"run {run.id} to wait for a run slot",
    )
    assert run.id not in starts


def _ended(run: RunHandle[Any]) -> str:
    return str(run.wait(timeout=PROMPT).state.value)


def _peak(client: Client, runs: Sequence[RunHandle[Any]], shift: timedelta = timedelta(0)) -> int:
    """The most runs under way at once among ``runs`` (from first handler start to end);
    ``shift``: how far the database clock was moved before they ended."""
    spans = []
    for run in runs:
        if run.id in starts:
            finished = client.get_run(run.id).finished_at
            end = finished - shift if finished else datetime.max.replace(tzinfo=UTC)
            spans.append((starts[run.id], end))
    return max((sum(1 for b, e in spans if b <= at < e) for at, _ in spans), default=0)


def _three(client: Client, workflow_: Any, tenant: str = "t") -> list[RunHandle[Any]]:
    return [client.submit(workflow_, {"tenant": tenant, "n": n}) for n in range(3)]


# -- a step ends the holder (in another queue than the next run's first step) -------------


@pytest.mark.parametrize(
    ("wf", "state"),
    [
        (rsw_fail_last, "failed"),
        (rsw_fail_branch, "failed"),
        (rsw_contained, "completed"),
        (rsw_fans, "completed"),
        (rsw_parent, "completed"),
    ],
    ids=["last_step_fails", "failure_cancels_a_running_branch", "contained", "fan_out", "child"],
)
def test_a_run_ended_by_a_step_in_another_queue_starts_the_next_run_promptly(
    client: Client, start_worker: Callable[..., Worker], wf: Any, state: str
) -> None:
    _workers(start_worker)
    runs = _three(client, wf)
    for run in runs:
        _started(run, timeout=STALL)  # the one before ended: its end woke rsw_qa
        assert _ended(run) == state
    assert _peak(client, runs) == 1
    if wf is rsw_fail_branch:
        # The slow branch's handler learns of its cancel after the run has ended (the last
        # run's may not have yet when its end returns).
        wait_until(
            lambda: all(slow_saw_cancel.get(r.id) for r in runs),
            timeout=PROMPT,
            what="each slow branch to see its cancel",
        )


# -- the holder ends off any worker's step -------------------------------------------------


def test_a_holder_cancelled_while_its_step_runs_frees_its_slot_promptly(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    _workers(start_worker)
    first, second = _three(client, rsw_slow_tail)[:2]
    wait_until(_event(first.id).is_set, timeout=PROMPT, what="the first run's slow step")
    _queued(client, second)
    client.cancel(first.id)
    _started(second, timeout=STALL)
    wait_until(lambda: slow_saw_cancel.get(first.id), timeout=PROMPT, what="the handler's stop")
    wait_until(_event(second.id).is_set, timeout=PROMPT, what="the second run's slow step")
    client.cancel(second.id)
    assert _ended(first) == _ended(second) == "cancelled"
    assert _peak(client, [first, second]) == 1


@pytest.mark.parametrize("how", ["cancel", "cancel_many", "deadline", "signal_timeout"])
def test_a_holder_waiting_on_a_signal_ended_off_the_worker_starts_the_next_run(
    client: Client,
    start_worker: Callable[..., Worker],
    clock: Callable[[datetime], None],
    how: str,
) -> None:
    _workers(start_worker)
    wf = rsw_times_out if how == "signal_timeout" else rsw_waits
    deadline = timedelta(seconds=2) if how == "deadline" else None
    first = client.submit(wf, {"tenant": "t", "n": 0}, deadline=deadline)
    second = client.submit(wf, {"tenant": "t", "n": 1})
    other = client.submit(wf, {"tenant": "u", "n": 2})  # another key: left alone
    _started(first)
    _started(other)
    wait_until(
        lambda: first.get().step("rsw_go").state.value == "waiting_signal",
        timeout=PROMPT,
        what="the first run's wait",
    )
    _queued(client, second)
    shift = timedelta(0)
    if how == "cancel":
        client.cancel(first.id)
    elif how == "cancel_many":
        # the runs created before the second one: the first alone
        result = client.cancel_many(RunFilter(workflows="rsw_waits", until=second.get().created_at))
        assert result.acted == 1
    else:  # the deadline or the wait's timeout passes: the scanner ends the run
        shift = timedelta(seconds=10)
        clock(datetime.now(UTC) + shift)
    want = {"cancel": "cancelled", "cancel_many": "cancelled"}.get(how, "failed")
    assert _ended(first) == want
    _started(second, timeout=STALL)
    assert _peak(client, [first, second], shift) == 1


@pytest.mark.parametrize("end", ["cancel", "signal"])
def test_a_paused_holder_keeps_its_slot_until_it_ends(
    client: Client, start_worker: Callable[..., Worker], end: str
) -> None:
    """Paused, the holder keeps its slot; cancelled, or ended by the signal of its last wait
    (a run may end while paused), it frees it and the next run starts at once."""
    _workers(start_worker)
    first, second = _three(client, rsw_waits)[:2]
    _started(first)
    # Its wait active before the pause: a wait that becomes ready in a paused run is paused
    # too, and buffers the signal until the resume (on a loaded machine the first step
    # could still run when the signal came, and the run stayed paused).
    wait_until(
        lambda: first.get().step("rsw_go").state.value == "waiting_signal",
        timeout=PROMPT,
        what="the first run's wait",
    )
    _queued(client, second)
    client.pause(first.id)
    probe = client.submit(rsw_waits, {"tenant": "other", "n": 9})
    _started(probe)  # rsw_qa's worker claimed since the pause
    _queued(client, second)  # the paused holder keeps its slot
    if end == "cancel":
        client.cancel(first.id)
    else:
        client.signal(first.id, "rsw_go", "last")
    assert _ended(first) == ("cancelled" if end == "cancel" else "completed")
    _started(second, timeout=STALL)
    client.signal(second.id, "rsw_go", "b")
    assert second.result(timeout=PROMPT) == "b"
    assert _peak(client, [first, second]) == 1


# -- several keys, and a limit of two ----------------------------------------------------


def test_only_the_key_whose_run_ended_starts_its_next_run(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    _workers(start_worker)
    x1 = client.submit(rsw_waits, {"tenant": "x", "n": 1})
    y1 = client.submit(rsw_waits, {"tenant": "y", "n": 1})
    _started(x1)
    _started(y1)
    x2 = client.submit(rsw_waits, {"tenant": "x", "n": 2})
    y2 = client.submit(rsw_waits, {"tenant": "y", "n": 2})
    _queued(client, x2)
    _queued(client, y2)
    client.signal(x1.id, "rsw_go", "x1")
    _started(x2, timeout=STALL)
    _queued(client, y2)  # y's holder still runs
    client.signal(y1.id, "rsw_go", "y1")
    _started(y2, timeout=STALL)
    for run, tag in [(x2, "x2"), (y2, "y2")]:
        client.signal(run.id, "rsw_go", tag)
    assert [r.result(timeout=PROMPT) for r in (x1, y1, x2, y2)] == ["x1", "y1", "x2", "y2"]
    assert _peak(client, [x1, x2]) == _peak(client, [y1, y2]) == 1


def test_a_limit_of_two_starts_the_queued_runs_one_by_one_in_submit_order(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    _workers(start_worker)
    runs = [client.submit(rsw_two_waits, {"tenant": "t", "n": n}) for n in range(5)]
    _started(runs[0])
    _started(runs[1])
    for queued in runs[2:]:
        _queued(client, queued, "2/2")
    # the holders end one by one, the later holder first: each end starts the next queued
    order = [1, 0, 2, 3, 4]
    for i, ending in enumerate(order):
        client.signal(runs[ending].id, "rsw_go", ending)
        assert runs[ending].result(timeout=PROMPT) == ending
        if i + 2 < len(runs):
            _started(runs[i + 2], timeout=STALL)
            for later in runs[i + 3 :]:
                _queued(client, later, "2/2")
    assert sorted(starts, key=starts.__getitem__) == [r.id for r in runs]
    assert _peak(client, runs) == 2


# -- an operator retry of an ended run --------------------------------------------------


def test_a_retried_run_queues_for_a_slot_and_starts_when_the_holder_ends(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """The retried run ended failed; a later run of its key holds the slot (waiting for a
    signal) when the operator retries it: it waits under the limit, then starts at once
    when the holder ends."""
    _workers(start_worker)
    retried = client.submit(rsw_retried, {"tenant": "t", "n": 0, "fail": True})
    assert _ended(retried) == "failed"
    holder = client.submit(rsw_retried, {"tenant": "t", "n": 1})
    _started(holder)
    wait_until(
        lambda: holder.get().step("rsw_go").state.value == "waiting_signal",
        timeout=PROMPT,
        what="the holder's wait",
    )
    client.retry(retried.id, "rsw_flaky")
    assert retried.get().state.value == "running"
    wait_until(
        lambda: "1/1 runs under way" in client.why_waiting(retried.id).get("rsw_flaky", ""),
        timeout=PROMPT,
        what="the retried run to wait for the slot",
    )
    client.signal(holder.id, "rsw_go", "h")
    assert holder.result(timeout=PROMPT) == "h"
    wait_until(
        lambda: retried.get().step("rsw_go").state.value == "waiting_signal",
        timeout=STALL,
        what="the retried run's step (the holder's end frees the slot)",
    )
    # The handler's start, not the step's started_at: that is its claim's now(), taken as
    # the claim began, which was once seen 12 ms before the holder's finished_at (a claim
    # that began first and took the slot once the holder's end freed it). The handler runs
    # after its claim committed, so after the holder's end committed.
    ended = holder.get().finished_at
    with lock:
        started = flaky_starts[retried.id][-1]
    assert ended is not None and started > ended
    client.signal(retried.id, "rsw_go", "r")
    assert retried.result(timeout=PROMPT) == "r"


# -- fair claims among blocked keys ------------------------------------------------------


@pytest.mark.parametrize(("keys", "freed"), [(3, 1), (40, 20), (40, 35)])
def test_a_freed_key_starts_its_next_run_though_other_keys_wait_before_it(
    client: Client, start_worker: Callable[..., Worker], keys: int, freed: int
) -> None:
    """One free claim slot (concurrency=1), keys whose holders wait for signals, each with a
    run queued behind its holder. One key's holder ends: its queued run must start ("starts
    when a run of its key ends"; fair claims take the keys in turn), however many blocked
    keys a claim looks at before it (40: more than one claim's window of keys)."""
    start_worker(rsw_start, queues=[QA], concurrency=1, poll_interval=LONG_POLL)
    names = [f"k{i:02d}" for i in range(keys)]
    holders = {}
    for key in names:  # one by one: the worker's last claim was of the last key
        holders[key] = client.submit(rsw_waits, {"tenant": key, "n": 1})
        _started(holders[key])
    queued = {key: client.submit(rsw_waits, {"tenant": key, "n": 2}) for key in names}
    for run in queued.values():
        _queued(client, run)
    key = names[freed]
    client.signal(holders[key].id, "rsw_go", "done")
    assert holders[key].result(timeout=PROMPT) == "done"
    _started(queued[key], timeout=STALL)
    for other in (names[0], names[-1]):
        _queued(client, queued[other])


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_limited_child_ended_with_its_parent_starts_the_next_child_of_its_key(
    client: Client,
    start_worker: Callable[..., Worker],
    clock: Callable[[datetime], None],
    how: str,
) -> None:
    """The child runs hold the slots (their workflow is limited, their parents' is not); a
    parent's cancel, or its deadline, ends its child: the next child of the key starts."""
    _workers(start_worker)
    deadline = timedelta(seconds=2) if how == "deadline" else None
    first = client.submit(rsw_free_parent, {"tenant": "t", "n": 0}, deadline=deadline)
    second = client.submit(rsw_free_parent, {"tenant": "t", "n": 1})

    def kid(parent: RunHandle[Any]) -> int | None:
        rows = client.list_runs(parent_run_id=parent.id)
        return rows[0].id if rows else None

    wait_until(lambda: kid(first) in starts, timeout=PROMPT, what="the first child's step")
    second_kid = wait_until(lambda: kid(second), timeout=PROMPT, what="the second child")
    wait_until(
        lambda: "1/1 runs under way" in " ".join(client.why_waiting(second_kid).values()),
        timeout=PROMPT,
        what="the second child to wait for the slot",
    )
    shift = timedelta(0)
    if how == "cancel":
        client.cancel(first.id)
    else:
        shift = timedelta(seconds=10)
        clock(datetime.now(UTC) + shift)
    assert _ended(first) == ("cancelled" if how == "cancel" else "failed")
    first_kid = kid(first)
    assert first_kid is not None and client.get_run(first_kid).state.value == "cancelled"
    wait_until(lambda: second_kid in starts, timeout=STALL, what="the second child's step")
    ended = client.get_run(first_kid).finished_at
    assert ended is not None and starts[second_kid] > ended - shift
