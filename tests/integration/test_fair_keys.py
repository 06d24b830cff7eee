"""A limited step starts when every slot it needs is free, whatever waits beside it.

Gated claims take keys in turn and pick each key's first steps; a step whose own slots are
free must not wait behind a step of the same key value that waits for another slot (another
kind's, a workflow's run slot, another rate budget). Polls do not help such a step: each
claim picks the same blocked step first. (test_wpa_audit.py has the case of two kinds
limited by one field.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

from cyclone_dsl import Client, Concurrency, RateLimit, StepContext, Worker, step, workflow
from tests.waiting import PROMPT, wait_until

#: How long a free step may take to start (the workers poll every 0.2 s).
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
