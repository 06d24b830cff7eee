"""A limited step starts when every slot it needs is free, whatever waits beside it.

Gated claims take keys in turn and pick each key's first steps; a step whose own slots are
free must not wait behind a step of the same key value that waits for another slot (another
kind's, a workflow's run slot, another rate budget). Polls do not help such a step: each
claim picks the same blocked step first. (test_wpa_audit.py has the case of two kinds
limited by one field.)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

from cyclone_dsl import Client, Concurrency, RateLimit, StepContext, Worker, step, workflow
from tests.waiting import LONG_POLL, PROMPT, wait_idle, wait_until

#: How long a free step may take to start (the workers poll every 0.5 s).
SOON = 5.0

started: set[str] = set()
release = threading.Event()


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    started.clear()
    release.clear()
    yield
    release.set()  # before the workers stop


def _work(job: dict[str, Any]) -> str:
    started.add(job["name"])
    if job.get("hold"):
        release.wait(30)
    return str(job["name"])


@step(name="fk_work", concurrency=Concurrency(key="tenant", limit=3))
def fk_work(job: dict[str, Any], ctx: StepContext) -> str:
    return _work(job)


@workflow(name="fk_flow", concurrency=Concurrency(key="tenant", limit=1))
def fk_flow(job):  # type: ignore[no-untyped-def]
    return fk_work(job)


@step(name="fk_one", concurrency=Concurrency(key="tenant", limit=1))
def fk_one(job: dict[str, Any], ctx: StepContext) -> str:
    return _work(job)


@step(name="fk_four", concurrency=Concurrency(key="tenant", limit=4))
def fk_four(job: dict[str, Any], ctx: StepContext) -> str:
    return _work(job)


@step(
    name="fk_rated",
    concurrency=Concurrency(key="tenant", limit=5),
    rate_limit=RateLimit(key="region", limit=1, per=timedelta(hours=1)),
)
def fk_rated(job: dict[str, Any], ctx: StepContext) -> str:
    return _work(job)


def test_a_step_is_not_held_behind_a_run_of_its_key_waiting_for_its_run_slot(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A run of ``fk_flow`` (limit 1 per tenant) holds its run slot for tenant t, and a
    second run of t waits for it. A standalone ``fk_work`` step of t needs only its kind's
    slot of t (3, one taken): it starts, with one free handler, while both runs wait."""
    start_worker(fk_flow, fk_work, concurrency=2)
    first = client.submit(fk_flow, {"tenant": "t", "name": "run-1", "hold": True})
    wait_until(lambda: "run-1" in started, timeout=PROMPT, what="the first run's step")
    queued = client.submit(fk_flow, {"tenant": "t", "name": "run-2"})
    wait_until(
        lambda: "run slot" in " ".join(client.why_waiting(queued.id).values()),
        timeout=PROMPT,
        what="the second run to wait for its run slot",
    )
    free = client.enqueue(fk_work, {"tenant": "t", "name": "free"})
    assert free.result(timeout=SOON) == "free"
    assert "run-2" not in started
    release.set()
    assert first.result(timeout=PROMPT) == "run-1"
    assert queued.result(timeout=PROMPT) == "run-2"


def test_a_step_is_not_held_behind_a_step_of_its_key_waiting_for_another_rate_budget(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """``fk_rated`` steps are limited per tenant (5 at once) and per region (1 an hour).
    Region r1's budget is spent and its next step of tenant t waits an hour; a step of t
    in region r2, whose budget is whole, starts (with one handler, one step per claim)."""
    start_worker(fk_rated, concurrency=1)
    job = {"tenant": "t"}
    assert client.enqueue(fk_rated, dict(job, region="r1", name="r1-a")).result(PROMPT) == "r1-a"
    spent = client.enqueue(fk_rated, dict(job, region="r1", name="r1-b"))
    wait_until(
        lambda: "rate limited" in " ".join(client.why_waiting(spent.id).values()),
        timeout=PROMPT,
        what="the second step of r1 to wait for its budget",
    )
    other = client.enqueue(fk_rated, dict(job, region="r2", name="r2-a"))
    assert other.result(timeout=SOON) == "r2-a"
    assert "r1-b" not in started


def test_one_wake_up_starts_every_free_step_of_a_key_among_keys_at_their_limit(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """20 tenants of ``fk_one`` (limit 1) run a step each and have another queued; then 4
    steps of tenant ``free`` of ``fk_four`` (limit 4) are enqueued at once. The worker has
    10 free handlers and polls (and scans) once a minute: the one wake-up of that enqueue must start
    all 4 (a claim shares its room among the keys it looks at, here 21, most at their
    limit; it claims again of the keys that had more)."""
    queue = f"fk_q_{os.getpid()}"
    worker = start_worker(
        fk_one,
        fk_four,
        queues=[queue],
        concurrency=30,
        batch_size=30,
        poll_interval=LONG_POLL,
        scan_interval=LONG_POLL,  # its due pass would wake the queue: only the enqueue may
        grace=0.5,
    )
    tenants = [f"t{n:02}" for n in range(20)]
    client.enqueue_many(
        fk_one,
        [{"tenant": t, "name": f"{t}-{n}", "hold": True} for n in (1, 2) for t in tenants],
        queue=queue,
    )
    wait_until(lambda: len(started) == 20, timeout=PROMPT, what="one step of each tenant")
    wait_idle(cyclone_dsn, worker, listeners=1)
    client.enqueue_many(
        fk_four,
        [{"tenant": "free", "name": f"free-{n}", "hold": True} for n in range(4)],
        queue=queue,
    )
    wait_until(
        lambda: {f"free-{n}" for n in range(4)} <= started,
        timeout=SOON,
        what="the 4 steps of the free tenant",
    )
    assert len(started) == 24, "a tenant at its limit started a second step"
