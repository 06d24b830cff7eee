"""A slot freed without a write wakes the claimers of the steps waiting on it.

A step-level ``Concurrency`` slot is the kind's and key's in every queue; it frees when its
holder stops running, which writes nothing to the slot. Whatever ends the holder (it
returns, it fails, its worker stops and gives its lease back, its lease expires and it is
reclaimed), the claimers of every queue with a step waiting on that slot must be woken:
their workers here poll once a minute, so a step that starts within a few seconds was
woken, not polled. (A timed-out attempt ends as a failure: the worker's timeout goes the
"fails" way; the scanner's, for a stuck worker, wakes them the same way.)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import pytest

from cyclone_dsl import Client, Concurrency, RunState, Worker, step
from tests.waiting import LONG_POLL, PROMPT, expire_leases_until, wait_idle, wait_until

QA = f"ksw_qa_{os.getpid()}"  # NOTIFY is database-wide: no other process wakes it
QB = f"ksw_qb_{os.getpid()}"
QC = f"ksw_qc_{os.getpid()}"  # capped
#: How long the waiting step may take to start once its slot is free (lost: a 60 s poll).
STALL = 6.0

started: set[str] = set()
release = threading.Event()


@pytest.fixture(autouse=True)
def _fresh(start_worker: Callable[..., Worker]) -> Iterator[None]:
    """Torn down before the workers stop (it needs start_worker): held handlers return
    first, instead of holding each stop for its grace."""
    started.clear()
    release.clear()
    yield
    release.set()  # before the workers stop: a held handler returns


@step(name="ksw_keyed", concurrency=Concurrency(key="tenant", limit=1), max_attempts=1)
def ksw_keyed(job: dict[str, Any]) -> str:
    started.add(job["name"])
    if job.get("hold"):
        release.wait(timeout=60)
    if job.get("fail"):
        raise ValueError("the holder fails")
    return str(job["name"])


@step(name="ksw_plain", max_attempts=1)
def ksw_plain(job: dict[str, Any]) -> str:
    return ksw_keyed(job)


@pytest.mark.parametrize("ending", ["returns", "fails", "is_given_back", "is_reclaimed"])
def test_a_holder_ending_in_one_queue_starts_its_key_s_step_waiting_in_another(
    client: Client,
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    clock: Callable[[datetime], None],
    ending: str,
) -> None:
    holder_worker = start_worker(
        ksw_keyed,
        queues=[QA],
        concurrency=1,
        poll_interval=LONG_POLL,
        grace=0.1,
        max_reclaims=0,
        lease=30.0,
    )
    job = {"tenant": "t", "name": "holder", "hold": True, "fail": ending == "fails"}
    holder = client.enqueue(ksw_keyed, job, queue=QA)
    wait_until(lambda: "holder" in started, timeout=PROMPT, what="the holder to start")
    waiter_worker = start_worker(
        ksw_keyed, queues=[QB], concurrency=2, poll_interval=LONG_POLL, max_reclaims=0
    )
    waiting = client.enqueue(ksw_keyed, {"tenant": "t", "name": "waiting"}, queue=QB)
    wait_until(
        lambda: "concurrency slot" in " ".join(client.why_waiting(waiting.id).values()),
        timeout=PROMPT,
        what="the step to wait for the holder's slot",
    )
    wait_idle(cyclone_dsn, waiter_worker, listeners=2)

    if ending in ("returns", "fails"):
        release.set()
    elif ending == "is_given_back":
        holder_worker.stop()  # the handler outlives the grace: its lease is given back
    else:
        expire_leases_until(
            lambda: holder.get().state is RunState.FAILED, what="the holder's reclaim"
        )

    assert waiting.result(timeout=STALL) == "waiting"
    assert "holder" in started


def test_a_reclaim_that_discards_a_capped_queue_s_step_starts_the_one_waiting_for_the_cap(
    client: Client,
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    clock: Callable[[datetime], None],
) -> None:
    """A queue capped at 1: its running step's worker stalls, the lease is reclaimed past
    ``max_reclaims`` (the step is discarded, not made available): the cap's slot is free,
    and the step waiting for it starts on the other worker."""
    client.set_queue_limit(QC, 1)
    try:
        options: dict[str, Any] = {"queues": [QC], "poll_interval": LONG_POLL, "max_reclaims": 0}
        start_worker(ksw_plain, concurrency=1, lease=30.0, **options)
        holder = client.enqueue(ksw_plain, {"name": "holder", "hold": True}, queue=QC)
        wait_until(lambda: "holder" in started, timeout=PROMPT, what="the holder to start")
        other = start_worker(ksw_plain, concurrency=2, **options)
        waiting = client.enqueue(ksw_plain, {"name": "waiting"}, queue=QC)
        wait_until(
            lambda: "queue" in " ".join(client.why_waiting(waiting.id).values()),
            timeout=PROMPT,
            what="the step to wait for the queue's cap",
        )
        wait_idle(cyclone_dsn, other, listeners=2)
        expire_leases_until(
            lambda: holder.get().state is RunState.FAILED, what="the holder's reclaim"
        )
        assert waiting.result(timeout=STALL) == "waiting"
    finally:
        client.set_queue_limit(QC, None)
