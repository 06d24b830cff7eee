"""Audit: how workers claim limited work (the gate look before the gated claim) and which
workflows a worker given step objects serves.

Flow control (docs/concepts/flow-control.md): "Work over a limit is not failed and spends
no attempt: it waits, and the claim takes it as soon as the limit has room." The claim
looks first for the queues that hold limited work and runs the gated claim only there
(docs/performance.md); a step gated after that look is left to the next claim, which its
commit wakes. Serving (docs/howto/versioning.md "A worker serves"): a worker given step
objects serves the workflows of its process it has work in.

Idle workers here poll every 30-60 s, so a run that finishes within a few seconds was
woken, not polled. Tests marked ``xfail(strict=True)`` show a finding.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cyclone_dsl import (
    Client,
    Concurrency,
    RateLimit,
    Worker,
    child,
    for_each,
    step,
    wait_signal,
    workflow,
)
from cyclone_dsl.testing.failpoints import arm, disarm
from tests.waiting import LONG_POLL, PROMPT, wait_until

#: How long the next step may take to start once a slot is free (each test costs this long
#: if the wake-up is lost).
STALL = 5.0


class Tracker:
    """Handlers running at once per key (as test_flow_control.py's Tracker)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: collections.Counter[str] = collections.Counter()
        self.peak: collections.Counter[str] = collections.Counter()
        self.ran: collections.Counter[str] = collections.Counter()

    def enter(self, *keys: str) -> None:
        with self.lock:
            for key in keys:
                self.running[key] += 1
                self.ran[key] += 1
                self.peak[key] = max(self.peak[key], self.running[key])

    def leave(self, *keys: str) -> None:
        with self.lock:
            for key in keys:
                self.running[key] -= 1


tracker = Tracker()


@pytest.fixture(autouse=True)
def _fresh_tracker() -> None:
    global tracker
    tracker = Tracker()


def _hold(*keys: str, seconds: float = 0.02) -> None:
    tracker.enter(*keys)
    time.sleep(seconds)
    tracker.leave(*keys)


# -- handlers ----------------------------------------------------------------------------


@step(name="gla_keyed", concurrency=Concurrency(key="tenant", limit=2))
def gla_keyed(job: dict[str, Any]) -> int:
    _hold(f"keyed:{job['tenant']}", "keyed")
    return int(job["n"])


@step(name="gla_plain")
def gla_plain(job: dict[str, Any]) -> int:
    _hold("plain")
    return int(job["n"]) * 10


@step(name="gla_rated", rate_limit=RateLimit(limit=5, per=timedelta(seconds=1)))
def gla_rated(job: dict[str, Any]) -> int:
    _hold("rated")
    return int(job["n"]) + 1000


@step(name="gla_first")
def gla_first(job: dict[str, Any]) -> dict[str, Any]:
    tracker.enter(f"run:{job['tenant']}")  # left by gla_second: the run's span
    return {**job, "seen": ["first"]}


@step(name="gla_second")
def gla_second(job: dict[str, Any]) -> dict[str, Any]:
    tracker.leave(f"run:{job['tenant']}")
    return {**job, "seen": [*job["seen"], "second"]}


@workflow(name="gla_one_per_tenant", concurrency=Concurrency(key="tenant", limit=1))
def gla_one_per_tenant(job):  # type: ignore[no-untyped-def]
    return gla_second(gla_first(job))


# -- the gate look -----------------------------------------------------------------------


def test_limited_work_submitted_to_an_idle_worker_starts_promptly(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Each kind of limit, submitted while the worker sleeps in a long poll: the submit's
    notification wakes it, and the gate look then finds the limited work."""
    start_worker(gla_keyed, gla_plain, gla_first, gla_second, poll_interval=LONG_POLL)
    # the worker's first claims found nothing: it sleeps now
    wait_until(lambda: client.workers(), what="the worker to register")
    keyed = client.enqueue(gla_keyed, {"tenant": "t", "n": 1})
    assert keyed.result(timeout=PROMPT) == 1
    run = client.submit(gla_one_per_tenant, {"tenant": "t"})
    assert run.result(timeout=PROMPT)["seen"] == ["first", "second"]
    plain = client.enqueue(gla_plain, {"n": 2})
    assert plain.result(timeout=PROMPT) == 20


def test_a_queue_that_first_held_no_limited_work_then_gets_some_is_claimed(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """The look found no gates in the worker's queues (plain work only); limited work
    that arrives later in the same queues is still claimed, under its limit."""
    start_worker(
        gla_keyed, gla_plain, queues=["gla_q1", "gla_q2"], concurrency=8, poll_interval=LONG_POLL
    )
    plain = [client.enqueue(gla_plain, {"n": i}, queue="gla_q1") for i in range(3)]
    assert [h.result(timeout=PROMPT) for h in plain] == [0, 10, 20]
    keyed = [
        client.enqueue(gla_keyed, {"tenant": f"t{i % 2}", "n": i}, queue=f"gla_q{1 + i % 2}")
        for i in range(8)
    ]
    assert [h.result(timeout=PROMPT) for h in keyed] == list(range(8))
    assert tracker.peak["keyed:t0"] <= 2 and tracker.peak["keyed:t1"] <= 2


@pytest.mark.parametrize("into", ["gla_q1", "gla_q2"])
def test_limited_work_gated_after_the_look_in_another_queue_is_claimed_next(
    client: Client, start_worker: Callable[..., Worker], into: str
) -> None:
    """A worker of two queues: limited work (and plain work) committed between its look
    and its claims, in either queue, is taken by the next claim, which its commit wakes."""
    submitting, submitted = threading.Event(), threading.Event()
    handles: list[Any] = []

    def submit_once() -> None:
        if not submitting.is_set():
            submitting.set()
            handles.extend(
                client.enqueue(gla_keyed, {"tenant": "x", "n": i}, queue=into) for i in range(4)
            )
            handles.append(client.enqueue(gla_plain, {"n": 7}, queue=into))
            submitted.set()

    arm("claim.after_gate_look", submit_once)
    try:
        start_worker(
            gla_keyed,
            gla_plain,
            queues=["gla_q1", "gla_q2"],
            concurrency=8,
            poll_interval=LONG_POLL,
        )
        wait_until(submitted.is_set, what="a claim")
        assert [h.result(timeout=PROMPT) for h in handles] == [0, 1, 2, 3, 70]
    finally:
        disarm("claim.after_gate_look")
    assert tracker.peak["keyed:x"] == 2


def test_a_workflow_slot_freed_in_another_queue_wakes_the_next_runs_worker(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A workflow limit whose steps run in two queues, each served by its own worker: the
    run's last step ends in queue gla_qb, and the next run of the key waits in gla_qa."""

    @workflow(name="gla_two_queues", concurrency=Concurrency(key="tenant", limit=1))
    def two_queues(job):  # type: ignore[no-untyped-def]
        return gla_second(gla_first(job, queue="gla_qa"), queue="gla_qb")

    start_worker(gla_first, queues=["gla_qa"], poll_interval=LONG_POLL)
    start_worker(gla_second, queues=["gla_qb"], poll_interval=LONG_POLL)
    runs = [client.submit(two_queues, {"tenant": "t", "n": i}) for i in range(3)]
    for run in runs:
        assert run.result(timeout=STALL)["seen"] == ["first", "second"]
    assert tracker.peak["run:t"] == 1


@workflow(name="gla_ends_off_worker", concurrency=Concurrency(key="tenant", limit=1))
def ends_off_worker(job):  # type: ignore[no-untyped-def]
    return wait_signal("gla_go", after=[gla_plain(job)])


@pytest.mark.parametrize("end", ["signal", "cancel", "deadline"])
def test_a_run_slot_freed_by_a_run_ended_off_the_worker_starts_the_next_run(
    client: Client, start_worker: Callable[..., Worker], end: str
) -> None:
    """A limited workflow whose run waits for a signal holds its slot; the run ends by the
    signal, a cancel or its deadline (none of them a step of the worker's), and the next
    run of the key, queued on the slot, starts without waiting for the worker's poll."""

    start_worker(gla_plain, poll_interval=LONG_POLL)
    deadline = timedelta(seconds=3) if end == "deadline" else None
    first = client.submit(ends_off_worker, {"tenant": "t", "n": 1}, deadline=deadline)
    second = client.submit(ends_off_worker, {"tenant": "t", "n": 2})
    wait_until(lambda: tracker.ran["plain"] == 1, what="the first run's step")
    wait_until(
        lambda: "1/1 runs under way" in client.why_waiting(second.id).get("gla_plain", ""),
        what="the second run to wait for the slot",
    )
    if end == "signal":
        client.signal(first.id, "gla_go", "a")
    elif end == "cancel":
        client.cancel(first.id)
    wait_until(lambda: first.get().state.is_terminal, timeout=PROMPT, what="the first run's end")
    wait_until(lambda: tracker.ran["plain"] == 2, timeout=STALL, what="the second run's step")
    client.signal(second.id, "gla_go", "b")
    assert second.result(timeout=PROMPT) == "b"


def test_a_queue_cap_across_workers_frees_its_slot_without_a_poll(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    client.set_queue_limit("gla_capped", 1)
    handles = [client.enqueue(gla_plain, {"n": i}, queue="gla_capped") for i in range(3)]
    start_worker(gla_plain, queues=["gla_capped"], concurrency=4, poll_interval=LONG_POLL)
    assert [h.result(timeout=STALL) for h in handles] == [0, 10, 20]
    assert tracker.peak["plain"] == 1


def test_a_workers_own_queue_limit_frees_its_slot_without_a_poll(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    handles = [client.enqueue(gla_plain, {"n": i}, queue="gla_mine") for i in range(3)]
    start_worker(
        gla_plain,
        queues=["gla_mine"],
        queue_limits={"gla_mine": 1},
        concurrency=4,
        poll_interval=LONG_POLL,
    )
    assert [h.result(timeout=STALL) for h in handles] == [0, 10, 20]
    assert tracker.peak["plain"] == 1


# -- several workers, different handler subsets ---------------------------------------------


@step(name="gla_a")
def gla_a(x: int) -> int:
    _hold("a")
    return x + 1


@step(name="gla_b")
def gla_b(x: int) -> int:
    _hold("b")
    return x * 2


@step(name="gla_c")
def gla_c(x: int) -> int:
    _hold("c")
    return x - 3


@workflow(name="gla_abc")
def gla_abc(x: int) -> int:
    return gla_c(gla_b(gla_a(x)))


@workflow(name="gla_only_c")
def gla_only_c(x: int) -> int:
    return gla_c(x)


@workflow(name="gla_parent_of_c")
def gla_parent_of_c(x: int) -> object:
    """Calls only gla_b; its child calls only gla_c."""
    return child(gla_only_c, gla_b(x))


@workflow(name="gla_fans_over_c")
def gla_fans_over_c(x: int) -> object:
    """gla_a's list, fanned out over gla_c, which only worker C has."""
    return for_each(gla_c, over=gla_list(gla_a(x)))


@step(name="gla_list")
def gla_list(x: int) -> list[int]:
    return [x, x + 1, x + 2]


@workflow(name="gla_fans_child")
def gla_fans_child(xs: list[int]) -> object:
    """No handler node of its own but the fan-out over a workflow."""
    return for_each(gla_only_c, over=xs)


def _served(client: Client, worker: Worker) -> set[str]:
    (row,) = [w for w in client.workers() if w["id"] == worker.id]
    return {v["workflow"] for v in row["versions"]}


def test_runs_split_across_workers_with_disjoint_handlers_complete(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    wa = start_worker(gla_a, gla_list, poll_interval=LONG_POLL)
    wb = start_worker(gla_b, poll_interval=LONG_POLL)
    wc = start_worker(gla_c, poll_interval=LONG_POLL)
    assert {"gla_abc", "gla_fans_over_c"} <= _served(client, wa)
    assert {"gla_abc", "gla_parent_of_c"} <= _served(client, wb)
    served_c = _served(client, wc)
    assert {"gla_abc", "gla_only_c", "gla_fans_over_c", "gla_fans_child"} <= served_c
    assert "gla_parent_of_c" in served_c  # it has a child node
    runs = [
        (client.submit(gla_abc, 4), 7),
        (client.submit(gla_parent_of_c, 5), 7),
        (client.submit(gla_fans_over_c, 1), [-1, 0, 1]),
        (client.submit(gla_fans_child, [3, 4]), [0, 1]),
    ]
    for handle, want in runs:
        assert handle.result(timeout=PROMPT * 2) == want
    assert client.stats()["unserved"] == []


def test_a_child_whose_parent_calls_only_other_workers_handlers_starts(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Only worker C has the child's handler, and the parent calls only worker B's."""
    start_worker(gla_c, poll_interval=LONG_POLL)
    start_worker(gla_b, poll_interval=LONG_POLL)
    handles = [client.submit(gla_parent_of_c, i) for i in range(3)]
    assert [h.result(timeout=PROMPT) for h in handles] == [-3, -1, 1]


def test_a_workflow_defined_after_the_worker_started_is_served(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker(gla_a, gla_keyed, poll_interval=LONG_POLL)

    @workflow(name="gla_late")
    def late(x: int) -> int:
        return gla_a(gla_a(x))

    @workflow(name="gla_late_limited", concurrency=Concurrency(key="tenant", limit=1))
    def late_limited(job):  # type: ignore[no-untyped-def]
        return gla_keyed(job)

    assert client.submit(late, 1).result(timeout=PROMPT) == 3
    handles = [client.submit(late_limited, {"tenant": "t", "n": i}) for i in range(3)]
    assert [h.result(timeout=PROMPT) for h in handles] == [0, 1, 2]
    assert tracker.peak["keyed:t"] == 1
    assert {"gla_late", "gla_late_limited"} <= _served(client, worker)


def test_work_no_live_worker_serves_is_reported_then_runs_when_one_comes(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """gla_only_c calls only gla_c: a worker with gla_a does not serve it. The step is in
    stats()["unserved"] until a worker that has gla_c starts, then the run completes."""
    start_worker(gla_a, poll_interval=LONG_POLL)
    handle = client.submit(gla_only_c, 10)
    unserved = client.stats()["unserved"]
    assert [(u["kind"], u["workflow"], u["steps"]) for u in unserved] == [
        ("gla_c", "gla_only_c", 1)
    ]
    start_worker(gla_c, poll_interval=LONG_POLL)
    assert handle.result(timeout=PROMPT) == 7
    assert client.stats()["unserved"] == []


# -- random mixes on a fleet ------------------------------------------------------------------

MIX = ["keyed", "plain", "rated", "limited_run", "abc", "parent", "fan"]


@given(
    mix=st.lists(
        st.tuples(st.sampled_from(MIX), st.sampled_from(["t0", "t1"])), min_size=3, max_size=8
    )
)
@settings(max_examples=4, deadline=None)
def test_random_limited_and_plain_work_on_a_fleet(
    client: Client, start_worker: Callable[..., Worker], mix: list[tuple[str, str]]
) -> None:
    """Three workers, two queues, overlapping handler subsets; limited kinds next to plain
    ones. Every run completes with its result and no limit is passed."""
    if not hasattr(start_worker, "_gla"):  # one fleet for every example
        start_worker(
            gla_keyed,
            gla_plain,
            gla_a,
            gla_list,
            queues=["default", "gla_side"],
            concurrency=6,
            poll_interval=LONG_POLL,
        )
        start_worker(gla_keyed, gla_first, gla_b, gla_rated, concurrency=6, poll_interval=LONG_POLL)
        start_worker(
            gla_second,
            gla_c,
            gla_plain,
            queues=["gla_side", "default"],
            concurrency=6,
            poll_interval=LONG_POLL,
        )
        start_worker._gla = True  # type: ignore[attr-defined]
    expect: list[tuple[Any, object]] = []
    for i, (kind, tenant) in enumerate(mix):
        queue = "gla_side" if i % 2 else "default"
        if kind == "keyed":
            job = {"tenant": tenant, "n": i}
            expect.append((client.enqueue(gla_keyed, job, queue=queue), i))
        elif kind == "plain":
            expect.append((client.enqueue(gla_plain, {"n": i}, queue=queue), 10 * i))
        elif kind == "rated":
            expect.append((client.enqueue(gla_rated, {"n": i}), 1000 + i))
        elif kind == "limited_run":
            run = client.submit(gla_one_per_tenant, {"tenant": tenant, "n": i})
            expect.append((run, {"tenant": tenant, "n": i, "seen": ["first", "second"]}))
        elif kind == "abc":
            expect.append((client.submit(gla_abc, i), (i + 1) * 2 - 3))
        elif kind == "parent":
            expect.append((client.submit(gla_parent_of_c, i), 2 * i - 3))
        else:
            expect.append((client.submit(gla_fans_over_c, i), [i - 2, i - 1, i]))
    for handle, want in expect:
        assert handle.result(timeout=PROMPT * 2) == want
    for key, peak in tracker.peak.items():
        if key.startswith("keyed:"):
            assert peak <= 2, (key, peak)
        if key.startswith("run:"):
            assert peak <= 1, (key, peak)
