"""Audit: a limit's room that frees where the waiting work's claimers are not woken.

Workers poll once a minute (``LONG_POLL``): work that starts within a few seconds of its
slot (or its queue cap's room) freeing was woken, not polled. Each test waits until the
waiting worker is idle and its LISTEN is connected, frees the room, and times the start.
Tests marked ``xfail(strict=True)`` show a finding.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from cyclone_dsl import (
    Client,
    Concurrency,
    Permanent,
    Registry,
    RunState,
    StepContext,
    Worker,
    for_each,
    step,
    wait_signal,
    workflow,
)
from cyclone_dsl.dsl.step import StepDef
from tests.waiting import LONG_POLL, PROMPT, wait_idle, wait_until

# NOTIFY is database-wide: queue names of this process only, so that no test running at
# the same time (another xdist process) wakes these workers by notifying the same names.
QA = f"lwa_qa_{os.getpid()}"
QB = f"lwa_qb_{os.getpid()}"
QC = f"lwa_qc_{os.getpid()}"  # capped by the tests that use it
QD = f"lwa_qd_{os.getpid()}"  # served by no worker
#: How long waiting work may take to start once its room is free (lost: a 60 s poll).
STALL = 4.0

started: dict[str, float] = {}
gates: dict[str, threading.Event] = {}
lock = threading.Lock()


@pytest.fixture(autouse=True)
def _fresh(start_worker: Callable[..., Worker]) -> Iterator[None]:
    """Torn down before the workers stop (it needs start_worker): held handlers return
    first, instead of holding each stop for its grace."""
    started.clear()
    gates.clear()
    yield
    with lock:
        for event in gates.values():
            event.set()  # before the workers stop: a held handler returns


def _gate(name: str) -> threading.Event:
    with lock:
        return gates.setdefault(name, threading.Event())


def _behave(job: dict[str, Any], ctx: StepContext | None = None, suffix: str = "") -> str:
    name = str(job["name"]) + suffix
    with lock:
        started.setdefault(name, time.monotonic())
    if "hold" in job:
        gate = _gate(str(job["hold"]))
        while not gate.wait(0.02):
            if job.get("coop") and ctx is not None and ctx.cancelled:
                raise RuntimeError("stopped")
    if job.get("fail"):
        raise Permanent(f"{name} fails")
    return name


def _started_within(name: str, since: float, timeout: float) -> float:
    """Wait until ``name`` started; return how long after ``since``."""
    wait_until(lambda: name in started, timeout=timeout, what=f"{name} to start")
    took = started[name] - since
    print(f"{name} started {took:.2f}s after its room freed")
    return took


def _waits(client: Client, run_id: int, words: str) -> None:
    wait_until(
        lambda: words in " ".join(client.why_waiting(run_id).values()),
        timeout=PROMPT,
        what=f"the step to wait ({words})",
    )


def _opts(**more: Any) -> dict[str, Any]:
    return {"poll_interval": LONG_POLL, "max_reclaims": 0, "grace": 0.5, **more}


# -- run slots: the holder run ends in queue A, the next run's first step waits in queue B --


@step(name="lwa_first", queue=QB)
def lwa_first(job: dict[str, Any]) -> dict[str, Any]:
    with lock:
        started.setdefault(f"{job['name']}:first", time.monotonic())
    return job


@step(name="lwa_last", queue=QA, max_attempts=1)
def lwa_last(job: dict[str, Any], ctx: StepContext) -> str:
    return _behave(job, ctx)


@workflow(name="lwa_runs", concurrency=Concurrency(key="tenant", limit=1))
def lwa_runs(job):  # type: ignore[no-untyped-def]
    return lwa_last(lwa_first(job))


@workflow(name="lwa_sig_runs", concurrency=Concurrency(key="tenant", limit=1))
def lwa_sig_runs(job):  # type: ignore[no-untyped-def]
    first = lwa_first(job)
    go = wait_signal("go", timeout=timedelta(hours=1), after=[first])
    return lwa_last(first, after=[go])


@pytest.mark.parametrize("ending", ["completes", "fails", "cancel", "deadline", "signal_timeout"])
def test_lwa_a_run_ending_in_queue_a_starts_the_next_run_waiting_in_queue_b(
    client: Client,
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    clock: Callable[[datetime], None],
    ending: str,
) -> None:
    """ "However a run ends (its last step, a signal, a cancel, its deadline), its end wakes
    the claimers of the queues where runs of its key wait"."""
    wf = lwa_sig_runs if ending == "signal_timeout" else lwa_runs
    job: dict[str, Any] = {"tenant": "t", "name": "holder", "hold": "h"}
    job["fail"] = ending == "fails"
    deadline = timedelta(hours=1) if ending == "deadline" else None
    holder = client.submit(wf, job, deadline=deadline)
    start_worker(wf, queues=[QA], concurrency=2, **_opts())
    b = start_worker(wf, queues=[QB], concurrency=2, **_opts())
    if ending == "signal_timeout":
        wait_until(lambda: "holder:first" in started, timeout=PROMPT, what="the holder's first")
    else:
        wait_until(lambda: "holder" in started, timeout=PROMPT, what="the holder's last step")
    nxt = client.submit(wf, {"tenant": "t", "name": "next"})
    _waits(client, nxt.id, "run slot")
    wait_idle(cyclone_dsn, b, listeners=2)
    since = time.monotonic()
    if ending in ("completes", "fails"):
        _gate("h").set()
    elif ending == "cancel":
        client.cancel(holder.id)
    else:
        clock(datetime.now(UTC) + timedelta(hours=2))
    _started_within("next:first", since, STALL)
    expected = RunState.COMPLETED if ending == "completes" else None
    state = holder.wait(timeout=PROMPT).state
    assert state is expected or (expected is None and state is not RunState.COMPLETED)


# -- step slots: the holder's run ends while the holder runs in queue A ----------------------


@step(name="lwa_keyed", queue=QA, concurrency=Concurrency(key="tenant", limit=1), max_attempts=1)
def lwa_keyed(job: dict[str, Any], ctx: StepContext) -> str:
    return _behave(job, ctx)


@workflow(name="lwa_keyed_wf")
def lwa_keyed_wf(job):  # type: ignore[no-untyped-def]
    return lwa_keyed(job)


@pytest.mark.parametrize("ending", ["cancel_own_queue", "cancel_queue_b", "deadline_queue_b"])
def test_lwa_a_run_ending_under_its_running_limited_step_starts_the_key_s_waiting_step(
    client: Client,
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    clock: Callable[[datetime], None],
    ending: str,
) -> None:
    """ "A slot is free again when its holder stopped running (completed, failed, reclaimed
    or cancelled), its run ended" and the claim "takes it as soon as the limit has room".
    The holder's handler checks ``ctx.cancelled`` and returns, as the docs advise."""
    job = {"tenant": "t", "name": "holder", "hold": "h", "coop": True}
    deadline = timedelta(hours=1) if ending.startswith("deadline") else None
    holder = client.submit(lwa_keyed_wf, job, deadline=deadline)
    a = start_worker(lwa_keyed_wf, lwa_keyed, queues=[QA], concurrency=3, **_opts())
    wait_until(lambda: "holder" in started, timeout=PROMPT, what="the holder to start")
    workers, waiter, queue = [a], a, QA
    if ending.endswith("queue_b"):
        waiter, queue = start_worker(lwa_keyed, queues=[QB], concurrency=2, **_opts()), QB
        workers.append(waiter)
    waiting = client.enqueue(lwa_keyed, {"tenant": "t", "name": "waiting"}, queue=queue)
    _waits(client, waiting.id, "concurrency slot")
    wait_idle(cyclone_dsn, waiter, listeners=len(workers))
    since = time.monotonic()
    if ending.startswith("cancel"):
        client.cancel(holder.id)
    else:
        clock(datetime.now(UTC) + timedelta(hours=2))
    try:
        _started_within("waiting", since, STALL)
    finally:
        _gate("h").set()
    assert holder.wait(timeout=PROMPT).state in (RunState.CANCELLED, RunState.FAILED)


def test_lwa_a_cancelled_holder_s_slot_is_free_while_its_handler_still_runs(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """What the docs promise for a cancelled holder: its slot is free at the cancel ("a slot
    is free again when its holder stopped running (completed, failed, reclaimed or
    cancelled)"), even while its sync handler, which cannot be interrupted, still runs: the
    next step of the key runs to its end beside it. (A worker polling every 0.5 s: the wake
    is the test above.)"""
    holder = client.submit(lwa_keyed_wf, {"tenant": "t", "name": "holder", "hold": "h"})
    start_worker(lwa_keyed_wf, lwa_keyed, queues=[QA], concurrency=3, grace=0.5)
    wait_until(lambda: "holder" in started, timeout=PROMPT, what="the holder to start")
    waiting = client.enqueue(lwa_keyed, {"tenant": "t", "name": "waiting"}, queue=QA)
    _waits(client, waiting.id, "concurrency slot")
    client.cancel(holder.id)
    assert waiting.result(timeout=PROMPT) == "waiting"
    assert not _gate("h").is_set()  # the cancelled handler still runs
    assert holder.get().state is RunState.CANCELLED


# -- fan-out items: one run's items hold the key in queue A, another's wait in queue B --------


@step(name="lwa_item", concurrency=Concurrency(key="tenant", limit=1), max_attempts=1)
def lwa_item(job: dict[str, Any], ctx: StepContext) -> str:
    return _behave(job, ctx)


@step(name="lwa_list", queue=QA)
def lwa_list(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [dict(job, name=f"{job['name']}[{i}]") for i in range(int(job["n"]))]


@workflow(name="lwa_fan_a")
def lwa_fan_a(job):  # type: ignore[no-untyped-def]
    return for_each(lwa_item, over=lwa_list(job), queue=QA)


@workflow(name="lwa_fan_b")
def lwa_fan_b(job):  # type: ignore[no-untyped-def]
    return for_each(lwa_item, over=lwa_list(job), queue=QB)


def test_lwa_a_fan_out_item_ending_in_queue_a_starts_another_run_s_item_in_queue_b(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """ "Fan-out items of such a step count one each" and a holder's end wakes the claimers
    of every queue where a step of its key waits."""
    holder = client.submit(lwa_fan_a, {"tenant": "t", "name": "h", "n": 1, "hold": "h"})
    start_worker(lwa_fan_a, lwa_fan_b, queues=[QA], concurrency=3, **_opts())
    wait_until(lambda: "h[0]" in started, timeout=PROMPT, what="the holder item to start")
    other = client.submit(lwa_fan_b, {"tenant": "t", "name": "w", "n": 2})
    b = start_worker(lwa_fan_a, lwa_fan_b, queues=[QB], concurrency=3, **_opts())
    wait_until(
        lambda: any("concurrency slot" in r for r in client.why_waiting(other.id).values()),
        timeout=PROMPT,
        what="the other run's items to wait",
    )
    wait_idle(cyclone_dsn, b, listeners=2)
    since = time.monotonic()
    _gate("h").set()
    _started_within("w[0]", since, STALL)
    assert other.result(timeout=PROMPT) == ["w[0]", "w[1]"]
    assert holder.result(timeout=PROMPT) == ["h[0]"]


# -- a paused run's limited step completes ---------------------------------------------------


def test_lwa_a_paused_run_s_limited_step_completing_starts_the_key_s_step_in_queue_b(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """ "Pause a running run: ready and pending steps wait; running steps finish": the step
    slot is the step's, not the run's, so its end frees it for the key's waiting step."""
    holder = client.submit(lwa_keyed_wf, {"tenant": "t", "name": "holder", "hold": "h"})
    start_worker(lwa_keyed_wf, queues=[QA], concurrency=2, **_opts())
    wait_until(lambda: "holder" in started, timeout=PROMPT, what="the holder to start")
    client.pause(holder.id)
    b = start_worker(lwa_keyed, queues=[QB], concurrency=2, **_opts())
    waiting = client.enqueue(lwa_keyed, {"tenant": "t", "name": "waiting"}, queue=QB)
    _waits(client, waiting.id, "concurrency slot")
    wait_idle(cyclone_dsn, b, listeners=2)
    since = time.monotonic()
    _gate("h").set()
    _started_within("waiting", since, STALL)


# -- queue caps --------------------------------------------------------------------------------


@step(name="lwa_plain", queue=QC, max_attempts=1)
def lwa_plain(job: dict[str, Any], ctx: StepContext) -> str:
    return _behave(job, ctx)


@workflow(name="lwa_plain_wf")
def lwa_plain_wf(job):  # type: ignore[no-untyped-def]
    return lwa_plain(job)


@pytest.fixture
def capped(client: Client) -> Iterator[None]:
    client.set_queue_limit(QC, 1)
    yield
    client.set_queue_limit(QC, None)


def test_lwa_raising_a_queue_cap_starts_a_step_waiting_for_it(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker], capped: None
) -> None:
    """`set_queue_limit` "caps them across all workers", and work over a limit starts "as
    soon as the limit has room". The queue stays capped, so no cap read ("workers read caps
    every few seconds") is needed: the claim counts the cap on the database."""
    a = start_worker(lwa_plain, queues=[QC], concurrency=3, **_opts())
    client.enqueue(lwa_plain, {"name": "holder", "hold": "h"})
    wait_until(lambda: "holder" in started, timeout=PROMPT, what="the holder to start")
    waiting = client.enqueue(lwa_plain, {"name": "waiting"})
    _waits(client, waiting.id, "queue")
    wait_idle(cyclone_dsn, a, listeners=1)
    since = time.monotonic()
    client.set_queue_limit(QC, 2)
    try:
        _started_within("waiting", since, STALL)
    finally:
        _gate("h").set()


def test_lwa_a_cancelled_run_s_running_step_frees_its_queue_cap_for_another_worker(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker], capped: None
) -> None:
    holder = client.submit(lwa_plain_wf, {"name": "holder", "hold": "h"})
    start_worker(lwa_plain_wf, lwa_plain, queues=[QC], concurrency=1, **_opts())
    wait_until(lambda: "holder" in started, timeout=PROMPT, what="the holder to start")
    b = start_worker(lwa_plain_wf, lwa_plain, queues=[QC], concurrency=2, **_opts())
    waiting = client.enqueue(lwa_plain, {"name": "waiting"})
    _waits(client, waiting.id, "queue")
    wait_idle(cyclone_dsn, b, listeners=2)
    since = time.monotonic()
    client.cancel(holder.id)
    try:
        _started_within("waiting", since, STALL)
    finally:
        _gate("h").set()


# -- a step with a key and a queue cap -------------------------------------------------------


@pytest.mark.parametrize("first_freed", ["cap", "key"])
def test_lwa_a_keyed_step_in_a_capped_queue_starts_when_both_have_room(
    client: Client,
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    capped: None,
    first_freed: str,
) -> None:
    """The waiting step (key t, queue C capped at 1) needs the key's slot (held in queue A)
    and the cap's (held by a plain step of queue C); whichever frees last starts it."""
    start_worker(lwa_keyed, lwa_plain, queues=[QA, QC], concurrency=3, **_opts())
    holders = {
        "key": client.enqueue(lwa_keyed, {"tenant": "t", "name": "key", "hold": "key"}, queue=QA),
        "cap": client.enqueue(lwa_plain, {"name": "cap", "hold": "cap"}),
    }
    wait_until(lambda: len(started) == 2, timeout=PROMPT, what="both holders to start")
    b = start_worker(lwa_keyed, lwa_plain, queues=[QC], concurrency=2, **_opts())
    waiting = client.enqueue(lwa_keyed, {"tenant": "t", "name": "waiting"}, queue=QC)
    _waits(client, waiting.id, "concurrency slot")
    wait_idle(cyclone_dsn, b, listeners=2)
    second = "key" if first_freed == "cap" else "cap"
    _gate(first_freed).set()
    assert holders[first_freed].result(timeout=PROMPT) == first_freed
    wait_idle(cyclone_dsn, b, listeners=2)
    assert "waiting" not in started
    since = time.monotonic()
    _gate(second).set()
    _started_within("waiting", since, STALL)


# -- a limit raised by a deploy --------------------------------------------------------------


def test_lwa_a_limit_raised_by_a_deploy_starts_the_key_s_step_waiting_in_queue_b(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """ "Raising a limit applies to every key at once, including keys whose work was queued
    before the deploy" (recorded by the new deploy's next submit)."""
    start_worker(lwa_keyed, queues=[QA], concurrency=2, **_opts())
    client.enqueue(lwa_keyed, {"tenant": "t", "name": "holder", "hold": "h"})
    wait_until(lambda: "holder" in started, timeout=PROMPT, what="the holder to start")
    b = start_worker(lwa_keyed, queues=[QB], concurrency=2, **_opts())
    waiting = client.enqueue(lwa_keyed, {"tenant": "t", "name": "waiting"}, queue=QB)
    _waits(client, waiting.id, "concurrency slot")
    wait_idle(cyclone_dsn, b, listeners=2)
    wider = StepDef(
        lwa_keyed.fn,
        "lwa_keyed",
        True,
        lwa_keyed.options,
        concurrency=Concurrency(key="tenant", limit=2),
    )
    registry = Registry()
    registry.register(wider)
    try:
        with Client(cyclone_dsn, registry=registry) as deploy_2:
            since = time.monotonic()
            deploy_2.enqueue("lwa_keyed", {"tenant": "u", "name": "other"}, queue=QD)
            _started_within("waiting", since, STALL)
        assert not _gate("h").is_set()  # the holder still runs: 2 of the new limit of 2
    finally:
        _gate("h").set()
