"""Limits across deploys, and limits that leave work waiting behind work they hold back: each
test here ran forever (a run that never ended) or ran under the wrong limit before its fix."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from cyclone_dsl import (
    Client,
    Concurrency,
    RateLimit,
    Registry,
    Worker,
    for_each,
    step,
    workflow,
)
from cyclone_dsl.dsl.step import StepDef
from cyclone_dsl.dsl.workflow import WorkflowDef
from tests.waiting import wait_until

# -- a deploy that drops a limit (same def_version) ---------------------------------------


@step(name="fd_dropped", concurrency=Concurrency(limit=1))
def dropped(x: int) -> int:
    return x


def test_a_deploy_that_drops_a_steps_limit_still_runs_the_work_queued_before(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A worker of a deploy that dropped a kind's Concurrency (the same def_version)
    serves the steps queued under it: it claimed only steps without a gate, and never took
    the gated path, which only the worker's own limits turned on. The step waited for ever,
    and neither why_waiting nor stats said why."""
    old = client.enqueue(dropped, 1)
    deploy_2 = StepDef(dropped.fn, "fd_dropped", True, dropped.options)  # no concurrency
    registry = Registry()
    registry.register(deploy_2)
    start_worker(registry=registry)
    assert old.result(timeout=15) == 1


@step(name="fd_plain")
def plain(x: int) -> int:
    return x * 2


def _limited_wf(x):  # type: ignore[no-untyped-def]
    return plain(x)


fd_limited_wf = workflow(name="fd_limited_wf", concurrency=Concurrency(limit=1))(_limited_wf)


def test_a_deploy_that_drops_a_workflows_limit_still_runs_the_runs_queued_before(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """The same for a workflow's Concurrency, which is not part of its def_version."""
    old = client.submit(fd_limited_wf, 3)
    deploy_2 = WorkflowDef(_limited_wf, "fd_limited_wf")  # the same graph, no concurrency
    assert deploy_2.def_version == fd_limited_wf.def_version
    registry = Registry()
    registry.add_workflow_tree(deploy_2)
    start_worker(registry=registry)
    assert old.result(timeout=15) == 6


# -- a workflow limit and a fan-out: the run holding the slot is never claimed ---------------


@step(name="fd_fan_item")
def fan_item(x: int) -> int:
    return x


@step(name="fd_fan_list")
def fan_list(n: int) -> list[int]:
    return [n, n, n]


@workflow(name="fd_fan_wf", concurrency=Concurrency(limit=1))
def fan_wf(n):  # type: ignore[no-untyped-def]
    return for_each(fan_item, over=fan_list(n))


def test_a_limited_workflow_with_a_fan_out_drains_a_queue_of_runs(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A run holding the only run slot fans out: its items were inserted after every
    queued run's first step, and each claim picked those first steps (which wait for the
    slot) and never the items (which need none). The run never ended, nor did the others."""
    handles = [client.submit(fan_wf, n) for n in range(6)]
    start_worker(fan_wf, concurrency=2)
    for n, handle in enumerate(handles):
        assert handle.result(timeout=15) == [n, n, n]


@step(name="fd_urgent_first", priority=5)
def urgent_first(n: int) -> int:
    return n


@step(name="fd_calm_then", priority=0)
def calm_then(n: int) -> int:
    return n


@workflow(name="fd_priorities_wf", concurrency=Concurrency(limit=1))
def priorities_wf(n):  # type: ignore[no-untyped-def]
    return calm_then(urgent_first(n))


def test_a_limited_workflows_later_node_of_lower_priority_is_not_starved(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """The same shape without a fan-out: the run holding the slot has its next node at a
    lower priority than the queued runs' first nodes, which fill the claim's picks."""
    handles = [client.submit(priorities_wf, n) for n in range(6)]
    start_worker(priorities_wf, concurrency=2)
    assert [h.result(timeout=15) for h in handles] == list(range(6))


@step(name="fd_mixed_first", priority=5, concurrency=Concurrency(key="region", limit=10))
def mixed_first(job: dict[str, Any]) -> int:
    return int(job["n"])


@step(name="fd_mixed_then", concurrency=Concurrency(key="region", limit=10))
def mixed_then(n: int) -> int:
    return n * 10


@workflow(name="fd_mixed_wf", concurrency=Concurrency(key="tenant", limit=1))
def mixed_wf(job):  # type: ignore[no-untyped-def]
    return mixed_then(mixed_first(job))


def test_a_limited_workflow_whose_steps_have_a_key_of_their_own_drains_a_queue_of_runs(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """The same shape where every node carries a step limit keyed by another value than
    the workflow's: steps are queued under their step key, so the queued runs' first steps
    and the holding run's next step share a queue, which the holders' lookup (by the
    workflow's key) did not reach."""
    handles = [
        client.submit(mixed_wf, {"tenant": "acme", "region": "eu", "n": n}) for n in range(6)
    ]
    start_worker(mixed_wf, concurrency=2)
    assert [h.result(timeout=15) for h in handles] == [n * 10 for n in range(6)]


# -- a rate limit lowered by a deploy below a queued step's units ------------------------------


@step(name="fd_tokens", rate_limit=RateLimit(limit=10, per=timedelta(seconds=1), units=5))
def tokens(x: int) -> int:
    return x


def test_a_rate_limit_lowered_below_a_queued_steps_units_does_not_wedge_the_budget(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """A step queued with 5 units under a budget lowered to 4 could never start, and
    every later step of the budget waited behind it: it now takes the whole budget."""
    client.enqueue(tokens, 1)  # deploy 1
    lowered = StepDef(
        tokens.fn,
        "fd_tokens",
        True,
        tokens.options,
        rate_limit=RateLimit(limit=4, per=timedelta(seconds=1), units=1),
    )
    registry = Registry()
    registry.register(lowered)
    with Client(cyclone_dsn, registry=registry) as deploy_2:
        new = deploy_2.enqueue("fd_tokens", 2)
        start_worker(registry=registry)
        assert new.result(timeout=15) == 2


# -- a limit raised by a deploy ----------------------------------------------------------------

raised_gate = threading.Event()


@step(name="fd_raised", concurrency=Concurrency(key="tenant", limit=1))
def raised(job: dict[str, Any]) -> str:
    raised_gate.wait(20)
    return str(job["tenant"])


def test_a_limit_raised_by_a_deploy_applies_to_the_keys_queued_before(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """A raised limit made new slots only for the keys of the submit that recorded it:
    a key whose work was queued before kept running one step at a time."""
    raised_gate.clear()
    queued = [client.enqueue(raised, {"tenant": "a", "n": n}) for n in range(3)]
    wider = StepDef(
        raised.fn, "fd_raised", True, raised.options, concurrency=Concurrency(key="tenant", limit=3)
    )
    registry = Registry()
    registry.register(wider)
    try:
        with Client(cyclone_dsn, registry=registry) as deploy_2:
            deploy_2.enqueue("fd_raised", {"tenant": "b"})  # records the limit of 3
            start_worker(registry=registry, concurrency=10)

            def running_a() -> bool:
                return sum(1 for h in queued if h.get().steps[0].state == "running") == 3

            wait_until(running_a, timeout=10, what="3 steps of tenant a running at once")
    finally:
        raised_gate.set()
