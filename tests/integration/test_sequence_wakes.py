"""The end of a step of a sequence key wakes the claimers of the key's next step.

Steps of one ``sequence_key`` run one at a time; the next one becomes claimable when the
running one stops, which writes nothing to it. Wherever the next step waits (another
queue, a kind another worker serves, the same worker's queue) and however the running one
stops (it returns, it fails for good, its run is cancelled), its claimers must be woken:
the workers here poll once a minute, so a step that starts within seconds was woken.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cyclone_dsl import Client, RunState, Worker, step
from cyclone_dsl.testing.failpoints import arm, disarm
from tests.waiting import LONG_POLL, PROMPT, HoldFirst, wait_idle, wait_until

QA = f"sqw_qa_{os.getpid()}"  # NOTIFY is database-wide: no other process wakes these
QB = f"sqw_qb_{os.getpid()}"
#: How long the next step may take to start once the key is free (lost: a 60 s poll).
STALL = 6.0

started: dict[str, float] = {}
release = threading.Event()


@pytest.fixture(autouse=True)
def _fresh(start_worker: Callable[..., Worker]) -> Iterator[None]:
    """Torn down before the workers stop: a held handler returns first."""
    started.clear()
    release.clear()
    yield
    release.set()


def _behave(job: dict[str, Any]) -> str:
    started[job["name"]] = time.monotonic()
    if job.get("hold"):
        release.wait(timeout=60)
    if job.get("fail"):
        raise ValueError("the first of the key fails")
    return str(job["name"])


@step(name="sqw_first", max_attempts=1)
def sqw_first(job: dict[str, Any]) -> str:
    return _behave(job)


@step(name="sqw_next")
def sqw_next(job: dict[str, Any]) -> str:
    return _behave(job)


@pytest.mark.parametrize("ending", ["returns", "fails", "is_cancelled"])
@pytest.mark.parametrize("where", ["another_queue", "another_kind", "same_worker"])
def test_the_next_step_of_a_sequence_key_starts_when_the_running_one_stops(
    client: Client,
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    ending: str,
    where: str,
) -> None:
    key = f"sqw-{os.getpid()}-{where}-{ending}"
    options: dict[str, Any] = {"poll_interval": LONG_POLL, "concurrency": 2}
    if where == "same_worker":
        kind, queue = sqw_first, QA
        waiter = start_worker(sqw_first, queues=[QA], **options)
        listeners = 1
    else:
        kind, queue = sqw_next, (QB if where == "another_queue" else QA)
        start_worker(sqw_first, queues=[QA], **options)
        waiter = start_worker(sqw_next, queues=[queue], **options)
        listeners = 2
    job = {"name": "first", "hold": True, "fail": ending == "fails"}
    first = client.enqueue(sqw_first, job, queue=QA, sequence_key=key)
    wait_until(lambda: "first" in started, timeout=PROMPT, what="the first of the key")
    following = client.enqueue(kind, {"name": "next"}, queue=queue, sequence_key=key)
    wait_idle(cyclone_dsn, waiter, listeners=listeners)
    assert "next" not in started, "the key's next step ran beside the first"

    since = time.monotonic()
    if ending == "is_cancelled":
        client.cancel(first.id)
    else:
        release.set()
    wait_until(lambda: "next" in started, timeout=STALL, what="the next step of the key")
    assert started["next"] - since <= STALL
    assert following.result(timeout=PROMPT) == "next"
    expected = {"returns": RunState.COMPLETED, "fails": RunState.FAILED}
    assert first.wait(timeout=PROMPT).state is expected.get(ending, RunState.CANCELLED)


@pytest.mark.parametrize("ending", ["returns", "fails"])
def test_the_next_step_enqueued_while_the_running_one_s_end_commits_starts(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker], ending: str
) -> None:
    """The next step of the key is enqueued while the first's end is held just before its
    commit: its own wake-up finds the first still running, and the end's look for the
    key's next step ran before it existed. The end's commit must still wake it."""
    worker = start_worker(sqw_first, queues=[QA], poll_interval=LONG_POLL, concurrency=2)
    wait_idle(cyclone_dsn, worker, listeners=1)
    point = f"{'complete' if ending == 'returns' else 'fail'}.before_commit"
    hold = HoldFirst()
    key = f"sqw-race-{os.getpid()}-{ending}"
    arm(point, hold)
    try:
        first = client.enqueue(
            sqw_first, {"name": "first", "fail": ending == "fails"}, queue=QA, sequence_key=key
        )
        wait_until(hold.reached.is_set, timeout=PROMPT, what="the first step's end")
        following = client.enqueue(sqw_first, {"name": "next"}, queue=QA, sequence_key=key)
        wait_idle(cyclone_dsn, worker, listeners=1)  # its wake-up came, and found the first
        assert "next" not in started
    finally:
        hold.release()
        disarm(point)
    first.wait(timeout=PROMPT)
    since = time.monotonic()
    assert following.result(timeout=STALL) == "next"
    assert started["next"] - since <= STALL


def test_the_next_step_enqueued_in_another_queue_as_the_running_one_ends_starts_by_the_due_pass(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """As above, with the next step in another queue: the end's commit wakes only its own
    queue, and the scanner's due pass (the workers scan every second here, and poll once a
    minute) wakes the next step's queue soon after, as the docs say. (Without a scanner
    it waits for the poll: a known gap, docs/guarantees.md.)"""
    first_worker = start_worker(sqw_first, queues=[QA], poll_interval=LONG_POLL, scan_interval=1.0)
    next_worker = start_worker(sqw_next, queues=[QB], poll_interval=LONG_POLL, scan_interval=1.0)
    wait_idle(cyclone_dsn, first_worker, listeners=2)
    wait_idle(cyclone_dsn, next_worker, listeners=2)
    hold = HoldFirst()
    key = f"sqw-race-{os.getpid()}-queues"
    arm("complete.before_commit", hold)
    try:
        first = client.enqueue(sqw_first, {"name": "first"}, queue=QA, sequence_key=key)
        wait_until(hold.reached.is_set, timeout=PROMPT, what="the first step's end")
        following = client.enqueue(sqw_next, {"name": "next"}, queue=QB, sequence_key=key)
        time.sleep(0.3)  # its own wake-up came, and found the first running
        assert "next" not in started
    finally:
        hold.release()
        disarm("complete.before_commit")
    first.wait(timeout=PROMPT)
    since = time.monotonic()
    assert following.result(timeout=STALL) == "next"
    print(f"the next step started {started['next'] - since:.2f}s after the first ended")
