"""Audit: flow control (concurrency keys of steps and workflows, queue caps, sequence
keys) crossed with run control (cancel, pause/resume, retry, replay, fork, deadlines) and
failures (timeouts, worker stops), child runs and fan-out items under limits.

Workers here poll once a minute (LONG_POLL) where a test checks a wake-up: work that starts
within seconds was woken, not polled.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

from cyclone_dsl import (
    Client,
    Concurrency,
    Permanent,
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
from tests.waiting import LONG_POLL, wait_until

QX = f"xfc_qx_{os.getpid()}"  # NOTIFY is database-wide: no other process wakes it
QCAP = f"xfc_cap_{os.getpid()}"


class Board:
    """Per-test record of handler spans and named gates the test opens."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.gates: dict[str, threading.Event] = collections.defaultdict(threading.Event)
        self.spans: list[list[Any]] = []  # [name, start, end or None, group]
        self.calls: collections.Counter[str] = collections.Counter()

    def gate(self, name: str) -> threading.Event:
        with self.lock:
            return self.gates[name]

    def enter(self, name: str, group: str) -> list[Any]:
        span = [name, time.monotonic(), None, group]
        with self.lock:
            self.spans.append(span)
            self.calls[name] += 1
        return span

    def leave(self, span: list[Any]) -> None:
        with self.lock:
            span[2] = time.monotonic()

    def started(self, name: str) -> int:
        with self.lock:
            return self.calls[name]

    def peak(self, group: str) -> int:
        """The most spans of a group open at one time."""
        with self.lock:
            spans = [(s[1], s[2] or time.monotonic()) for s in self.spans if s[3] == group]
        return max(
            (sum(1 for b, e in spans if b <= start < e) for start, _ in spans),
            default=0,
        )


board = Board()


@pytest.fixture(autouse=True)
def fresh_board(start_worker: Callable[..., Worker]) -> Iterator[Board]:
    """Torn down before the workers stop: held handlers return first."""
    global board
    board = Board()
    yield board
    for event in list(board.gates.values()):
        event.set()


def _behave(job: dict[str, Any], group: str, ctx: StepContext | None = None) -> str:
    name = str(job["name"])
    span = board.enter(name, group)
    try:
        if ctx is not None and ctx.attempt <= int(job.get("fail_first", 0)):
            raise RuntimeError(f"{name} fails attempt {ctx.attempt}")
        if job.get("permanent"):
            raise Permanent(f"{name} fails for good")
        if "gate" in job:
            gate = board.gate(str(job["gate"]))
            while not gate.is_set() and not (ctx is not None and ctx.cancelled):
                gate.wait(0.02)
        if job.get("fail_after_gate"):
            raise Permanent(f"{name} fails for good after its gate")
        return name
    finally:
        board.leave(span)


# -- replay of a fan-out whose items are limited ---------------------------------------------


@step(name="xfc_lines")
def xfc_lines(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": f"{job['name']}-{i}"} for i in range(3)]


@step(name="xfc_item", concurrency=Concurrency(key="tenant", limit=1))
def xfc_item(item: dict[str, Any], ctx: StepContext) -> str:
    return _behave(item, "xfc_item", ctx)


@workflow(name="xfc_fan")
def xfc_fan(job):  # type: ignore[no-untyped-def]
    return for_each(xfc_item, over=xfc_lines(job))


def test_replaying_a_fan_out_of_limited_items_runs_its_items_again(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A replay deletes the fan-out's items (they expand again): the items were the
    holders of the key's slot. A slot whose holder no longer exists is not free to the
    claim until clear_lost_holders runs (purges and the scanner's slow pass, every 30
    passes). The replayed items must run, and other work of the key must too."""
    run = client.submit(xfc_fan, {"tenant": "t", "name": "r"})
    # scan_interval 60: the scanner's slow pass runs at its first pass only.
    start_worker(xfc_fan, concurrency=4, scan_interval=60)
    assert run.result(timeout=20) == ["r-0", "r-1", "r-2"]
    client.retry(run.id, "xfc_item", force=True)
    # Observed: the items stay available, the key's only slot names the deleted item
    # xfc_item[2] as its holder, and why_waiting says nothing ({}).
    wait_until(
        lambda: board.started("r-0") == 2,
        timeout=10,
        what="the replayed items to start",
    )
    assert run.result(timeout=20) == ["r-0", "r-1", "r-2"]
    other = client.enqueue(xfc_item, {"tenant": "t", "name": "other"})
    assert other.result(timeout=10) == "other"
    assert board.peak("xfc_item") == 1


@step(name="xfc_citem", queue=QCAP)
def xfc_citem(item: dict[str, Any], ctx: StepContext) -> str:
    return _behave(item, "xfc_citem", ctx)


@step(name="xfc_clines", queue=QCAP)
def xfc_clines(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": f"{job['name']}-{i}"} for i in range(3)]


@workflow(name="xfc_cfan")
def xfc_cfan(job):  # type: ignore[no-untyped-def]
    return for_each(xfc_citem, over=xfc_clines(job))


def test_replaying_a_fan_out_in_a_capped_queue_runs_its_items_again(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """The same with a queue cap: the items held the queue's slots, and a replay deletes
    them. Every step of the capped queue then waits for the slow pass."""
    client.set_queue_limit(QCAP, 2)
    run = client.submit(xfc_cfan, {"name": "c"})
    start_worker(xfc_cfan, queues=[QCAP], concurrency=4, scan_interval=60)
    assert run.result(timeout=20) == ["c-0", "c-1", "c-2"]
    client.retry(run.id, "xfc_citem", force=True)
    wait_until(lambda: board.started("c-0") == 2, timeout=10, what="the replayed items to start")
    assert run.result(timeout=20) == ["c-0", "c-1", "c-2"]


# -- child runs of a limited workflow ----------------------------------------------------------


@step(name="xfc_cwork")
def xfc_cwork(job: dict[str, Any], ctx: StepContext) -> str:
    return _behave(job, "xfc_cwork", ctx)


@workflow(name="xfc_kid", concurrency=Concurrency(key="tenant", limit=1))
def xfc_kid(job):  # type: ignore[no-untyped-def]
    return xfc_cwork(job)


@workflow(name="xfc_parent")
def xfc_parent(job):  # type: ignore[no-untyped-def]
    return child(xfc_kid, job)


@pytest.mark.parametrize("how", ["cancel_parent", "cancel_child"])
def test_a_cancelled_child_run_gives_its_run_slot_to_the_next_at_once(
    client: Client, start_worker: Callable[..., Worker], how: str
) -> None:
    parent = client.submit(xfc_parent, {"tenant": "t", "name": "a", "gate": "a"})
    start_worker(xfc_parent, xfc_kid, concurrency=4, poll_interval=LONG_POLL)
    wait_until(lambda: board.started("a"), what="the child's step to start")
    queued = client.submit(xfc_kid, {"tenant": "t", "name": "b"})
    wait_until(lambda: client.why_waiting(queued.id), what="the next run to wait for a slot")
    if how == "cancel_parent":
        client.cancel(parent.id)
    else:
        (kid,) = [r for r in client.list_runs() if r.workflow == "xfc_kid" and r.id != queued.id]
        client.cancel(kid.id)
    assert queued.result(timeout=8) == "b"
    assert parent.wait(timeout=10).state in (RunState.CANCELLED, RunState.FAILED)


# -- pause and resume of a run queued for a run slot -------------------------------------------


@step(name="xfc_rwork")
def xfc_rwork(job: dict[str, Any], ctx: StepContext) -> str:
    return _behave(job, "xfc_runs", ctx)


@step(name="xfc_rtail")
def xfc_rtail(name: str) -> str:
    return name


@workflow(name="xfc_runs", concurrency=Concurrency(key="tenant", limit=1))
def xfc_runs(job):  # type: ignore[no-untyped-def]
    return xfc_rtail(xfc_rwork(job))


def test_a_paused_queued_run_does_not_block_the_next_and_resumes_under_the_limit(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    a = client.submit(xfc_runs, {"tenant": "t", "name": "a", "gate": "a"})
    b = client.submit(xfc_runs, {"tenant": "t", "name": "b", "gate": "b"})
    c = client.submit(xfc_runs, {"tenant": "t", "name": "c", "gate": "c"})
    start_worker(xfc_runs, concurrency=4, poll_interval=LONG_POLL)
    wait_until(lambda: board.started("a"), what="a to start")
    client.pause(b.id)
    board.gate("a").set()
    assert a.result(timeout=10) == "a"
    wait_until(lambda: board.started("c"), timeout=8, what="c to start while b is paused")
    client.resume(b.id)
    time.sleep(0.5)
    assert board.started("b") == 0, "b started beside c under a limit of 1"
    board.gate("c").set()
    assert c.result(timeout=10) == "c"
    board.gate("b").set()
    assert b.result(timeout=8) == "b"
    assert board.peak("xfc_runs") == 1


def test_cancelling_a_paused_run_that_holds_the_slot_starts_the_next_at_once(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    a = client.submit(xfc_runs, {"tenant": "t", "name": "a", "gate": "a"})
    b = client.submit(xfc_runs, {"tenant": "t", "name": "b"})
    start_worker(xfc_runs, concurrency=4, poll_interval=LONG_POLL)
    wait_until(lambda: board.started("a"), what="a to start")
    client.pause(a.id)
    board.gate("a").set()
    wait_until(lambda: a.get().step("xfc_rwork").state is StepState.COMPLETED, what="a's step")
    assert board.started("b") == 0
    client.cancel(a.id)
    assert b.result(timeout=8) == "b"


def test_replaying_a_completed_limited_run_waits_for_the_slot(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    a = client.submit(xfc_runs, {"tenant": "t", "name": "a"})
    start_worker(xfc_runs, concurrency=4, poll_interval=LONG_POLL)
    assert a.result(timeout=10) == "a"
    b = client.submit(xfc_runs, {"tenant": "t", "name": "b", "gate": "b"})
    wait_until(lambda: board.started("b"), what="b to start")
    client.retry(a.id, "xfc_rwork", force=True)
    wait_until(lambda: client.why_waiting(a.id), what="the replay to wait for the run slot")
    time.sleep(0.5)
    assert board.started("a") == 1, "the replayed run started beside b under a limit of 1"
    board.gate("b").set()
    assert b.result(timeout=10) == "b"
    assert a.result(timeout=8) == "a"
    assert board.started("a") == 2
    assert board.peak("xfc_runs") == 1


def test_a_fork_of_the_run_holding_the_slot_waits_for_it(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    a = client.submit(xfc_runs, {"tenant": "t", "name": "a", "gate": "a"})
    start_worker(xfc_runs, concurrency=4, poll_interval=LONG_POLL)
    wait_until(lambda: board.started("a"), what="a to start")
    fork = client.fork(a.id, "xfc_rwork")
    wait_until(lambda: client.why_waiting(fork.id), what="the fork to wait")
    time.sleep(0.3)
    assert board.started("a") == 1
    board.gate("a").set()
    assert a.result(timeout=10) == "a"
    assert fork.result(timeout=8) == "a"
    assert board.peak("xfc_runs") == 1


# -- a step of a limited run that times out for good -----------------------------------------


@step(name="xfc_slow", timeout=0.3, max_attempts=1)
def xfc_slow(job: dict[str, Any], ctx: StepContext) -> str:
    return _behave(job, "xfc_truns", ctx)


@workflow(name="xfc_truns", concurrency=Concurrency(key="tenant", limit=1))
def xfc_truns(job):  # type: ignore[no-untyped-def]
    return xfc_slow(job)


def test_a_run_failing_by_its_steps_timeout_gives_its_slot_at_once(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    a = client.submit(xfc_truns, {"tenant": "t", "name": "a", "gate": "never"})
    b = client.submit(xfc_truns, {"tenant": "t", "name": "b"})
    start_worker(xfc_truns, concurrency=4, poll_interval=LONG_POLL)
    assert a.wait(timeout=10).state is RunState.FAILED
    assert b.result(timeout=8) == "b"


# -- a worker stopped mid-handler ------------------------------------------------------------


@step(name="xfc_keyed", concurrency=Concurrency(key="tenant", limit=1), queue=QX)
def xfc_keyed(job: dict[str, Any], ctx: StepContext) -> str:
    return _behave(job, "xfc_keyed", ctx)


def test_a_worker_stopped_mid_handler_lets_another_worker_run_the_key(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    held = client.enqueue(xfc_keyed, {"tenant": "t", "name": "held", "gate": "held"})
    first = start_worker(xfc_keyed, queues=[QX], concurrency=2, grace=0.5)
    wait_until(lambda: board.started("held"), what="held to start")
    waiting = client.enqueue(xfc_keyed, {"tenant": "t", "name": "waiting"})
    wait_until(lambda: client.why_waiting(waiting.id), what="the second step to wait")
    start_worker(xfc_keyed, queues=[QX], concurrency=2, poll_interval=LONG_POLL)
    first.stop()
    # The given-back step keeps its place (its id is lower): either may take the slot, at
    # once (the new worker polls once a minute).
    wait_until(
        lambda: board.started("held") == 2 or board.started("waiting") == 1,
        timeout=8,
        what="a step of the key to start on the other worker",
    )
    board.gate("held").set()
    assert held.result(timeout=8) == "held"
    assert waiting.result(timeout=8) == "waiting"


# -- sequence keys -------------------------------------------------------------------------


@step(name="xfc_seq", queue=QX)
def xfc_seq(job: dict[str, Any], ctx: StepContext) -> str:
    return _behave(job, "xfc_seq", ctx)


def test_pausing_then_cancelling_the_head_of_a_sequence_starts_the_next_at_once(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    head = client.enqueue(xfc_seq, {"name": "h", "gate": "h"}, sequence_key="s")
    start_worker(xfc_seq, queues=[QX], concurrency=4, poll_interval=LONG_POLL)
    wait_until(lambda: board.started("h"), what="the head to start")
    nxt = client.enqueue(xfc_seq, {"name": "n"}, sequence_key="s")
    time.sleep(0.3)
    assert board.started("n") == 0
    client.pause(head.id)
    client.cancel(head.id)
    assert nxt.result(timeout=8) == "n"


def test_a_paused_queued_head_of_a_sequence_cancelled_starts_the_next_at_once(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(xfc_seq, queues=[QX], concurrency=4, poll_interval=LONG_POLL)
    first = client.enqueue(xfc_seq, {"name": "f", "gate": "f"}, sequence_key="s")
    wait_until(lambda: board.started("f"), what="f to start")
    second = client.enqueue(xfc_seq, {"name": "s2"}, sequence_key="s")
    third = client.enqueue(xfc_seq, {"name": "s3"}, sequence_key="s")
    client.pause(second.id)
    board.gate("f").set()
    assert first.result(timeout=8) == "f"
    time.sleep(0.5)
    assert board.started("s3") == 0, "a step ran ahead of a paused earlier one of its sequence"
    client.cancel(second.id)
    assert third.result(timeout=8) == "s3"


def test_resuming_a_queued_run_after_the_slot_freed_starts_it_at_once(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    a = client.submit(xfc_runs, {"tenant": "t", "name": "a", "gate": "a"})
    b = client.submit(xfc_runs, {"tenant": "t", "name": "b"})
    start_worker(xfc_runs, concurrency=4, poll_interval=LONG_POLL)
    wait_until(lambda: board.started("a"), what="a to start")
    client.pause(b.id)
    board.gate("a").set()
    assert a.result(timeout=10) == "a"
    time.sleep(0.3)
    client.resume(b.id)
    assert b.result(timeout=8) == "b"


def test_a_paused_holder_that_fails_gives_its_slot_at_once(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    a = client.submit(xfc_runs, {"tenant": "t", "name": "a", "gate": "a", "fail_after_gate": True})
    b = client.submit(xfc_runs, {"tenant": "t", "name": "b"})
    start_worker(xfc_runs, concurrency=4, poll_interval=LONG_POLL)
    wait_until(lambda: board.started("a"), what="a to start")
    client.pause(a.id)
    board.gate("a").set()
    assert a.wait(timeout=10).state is RunState.FAILED
    assert b.result(timeout=8) == "b"


@step(name="xfc_flaky", max_attempts=5)
def xfc_flaky(job: dict[str, Any], ctx: StepContext) -> str:
    return _behave(job, "xfc_druns", ctx)


@workflow(name="xfc_druns", concurrency=Concurrency(key="tenant", limit=1))
def xfc_druns(job):  # type: ignore[no-untyped-def]
    return xfc_flaky(job)


def test_a_holder_past_its_deadline_in_a_retry_backoff_gives_its_slot(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[..., None]
) -> None:
    """The holder run has no step running (its step waits out a backoff) when its deadline
    passes: the scanner fails it, and the queued run starts."""
    a = client.submit(
        xfc_druns, {"tenant": "t", "name": "a", "fail_first": 5}, deadline=timedelta(hours=1)
    )
    b = client.submit(xfc_druns, {"tenant": "t", "name": "b"})
    start_worker(xfc_druns, concurrency=4, poll_interval=LONG_POLL)
    wait_until(lambda: a.get().steps[0].attempt >= 1, what="a to fail once")
    clock(timedelta(hours=2))
    assert a.wait(timeout=10).state is RunState.FAILED
    assert b.result(timeout=8) == "b"
    assert board.started("b") == 1


def test_a_worker_stopped_mid_handler_of_a_limited_run_gives_the_step_to_another(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """The run keeps its run slot (it is under way); its given-back step is claimed by the
    other worker at once, ahead of the queued run."""
    a = client.submit(xfc_runs, {"tenant": "t", "name": "a", "gate": "a"})
    b = client.submit(xfc_runs, {"tenant": "t", "name": "b"})
    first = start_worker(xfc_runs, concurrency=2, grace=0.5)
    wait_until(lambda: board.started("a"), what="a to start")
    start_worker(xfc_runs, concurrency=2, poll_interval=LONG_POLL)
    first.stop()
    wait_until(lambda: board.started("a") == 2, timeout=8, what="a to start again")
    assert board.started("b") == 0
    board.gate("a").set()
    assert a.result(timeout=8) == "a"
    assert b.result(timeout=8) == "b"


@workflow(name="xfc_sig", concurrency=Concurrency(key="tenant", limit=1))
def xfc_sig(job):  # type: ignore[no-untyped-def]
    got = wait_signal("go")
    return xfc_rtail(xfc_rwork(job, after=[got]))


def test_a_queued_run_that_took_its_signal_starts_when_the_holder_is_cancelled(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    a = client.submit(xfc_sig, {"tenant": "t", "name": "a", "gate": "a"})
    b = client.submit(xfc_sig, {"tenant": "t", "name": "b"})
    start_worker(xfc_sig, concurrency=4, poll_interval=LONG_POLL)
    client.signal(a.id, "go")
    wait_until(lambda: board.started("a"), what="a to start")
    client.signal(b.id, "go")
    wait_until(lambda: client.why_waiting(b.id), what="b's step to wait for the run slot")
    client.cancel(a.id)
    assert b.result(timeout=8) == "b"


@workflow(name="xfc_fan_kids")
def xfc_fan_kids(job):  # type: ignore[no-untyped-def]
    return for_each(xfc_kid, over=xfc_klines(job))


@step(name="xfc_klines")
def xfc_klines(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"tenant": job["tenant"], "name": f"{job['name']}-{i}", "gate": "k"} for i in range(3)]


def test_child_items_of_a_limited_workflow_run_one_at_a_time_and_free_on_cancel(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    parent = client.submit(xfc_fan_kids, {"tenant": "t", "name": "p"})
    start_worker(xfc_fan_kids, xfc_kid, concurrency=6, poll_interval=LONG_POLL)
    wait_until(lambda: board.started("p-0"), what="the first child run's step")
    time.sleep(0.4)
    assert board.peak("xfc_cwork") == 1
    other = client.submit(xfc_kid, {"tenant": "t", "name": "o"})
    client.cancel(parent.id)
    # The cancelled child's handler may still run beside "o" until it sees ctx.cancelled
    # (documented): no peak is asserted past the cancel.
    assert other.result(timeout=8) == "o"


# -- a queue cap set while steps of the queue run ----------------------------------------------

QSET = f"xfc_qset_{os.getpid()}"


@step(name="xfc_qstep", queue=QSET)
def xfc_qstep(job: dict[str, Any], ctx: StepContext) -> str:
    return _behave(job, "xfc_qstep", ctx)


def test_a_cap_set_while_steps_run_holds_new_ones_until_they_are_below_it(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Two steps run in an uncapped queue; a cap of 1 is set: 'caps the steps of a queue
    that run at once across all workers'. The two take its slot and one past it (as a
    lowered cap's excess), and a third step does not start beside them."""
    first = [client.enqueue(xfc_qstep, {"name": f"r{i}", "gate": "r"}) for i in range(2)]
    worker = start_worker(xfc_qstep, queues=[QSET], concurrency=4)
    wait_until(lambda: board.started("r0") and board.started("r1"), what="both to start")
    client.set_queue_limit(QSET, 1)
    (cap,) = [r for r in client.stats()["limits"] if r["scope"] == f"queue:{QSET}"]
    assert cap["in_use"] == 2, cap
    worker.refresh_queue_caps()  # as the worker does every few seconds
    third = client.enqueue(xfc_qstep, {"name": "third"})
    time.sleep(1.0)
    try:
        assert board.started("third") == 0, "a step started with two running under a cap of 1"
    finally:
        board.gate("r").set()
    assert [h.result(timeout=10) for h in first] == ["r0", "r1"]
    assert third.result(timeout=10) == "third"
