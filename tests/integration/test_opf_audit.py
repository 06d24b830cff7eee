"""Audit: ordering, priority and fairness promises, as a production user relies on them.

Each test records the order handlers actually ran in (a thread-safe list) and compares it
with the documented order: ``priority=`` (steps, enqueues, workflow nodes, schedules)
claims higher first within a queue, ``scheduled_at`` holds a start back, ``sequence_key``
runs one at a time in (``scheduled_at``, id) order, fair keys take turns, and a worker's
queues are served in turn. Time is moved with the ``clock`` fixture, never waited out.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from cyclone_dsl import (
    Client,
    Concurrency,
    InvalidArgument,
    RunHandle,
    RunState,
    StepContext,
    StepState,
    Worker,
    step,
    workflow,
)
from cyclone_dsl.testing import set_clock_shift
from tests.waiting import scanner_passes, wait_until

StartWorker = Callable[..., Worker]
Clock = Callable[[datetime | timedelta], None]

Q = "opf_q"
QA = "opf_qa"
QB = "opf_qb"
LONG_POLL = 60.0

_lock = threading.Lock()
#: (label, value) in the order the handlers started.
ORDER: list[tuple[str, object]] = []
GATES: dict[str, threading.Event] = {}
#: Live handler count per label, and the most seen at once.
LIVE: dict[str, int] = {}
PEAK: dict[str, int] = {}
#: Steps a recording handler should enqueue when it runs (the flood test).
FLOOD: dict[str, Any] = {}


def gate(name: str) -> threading.Event:
    with _lock:
        return GATES.setdefault(name, threading.Event())


def note(label: str, value: object) -> None:
    with _lock:
        ORDER.append((label, value))


def seen(label: str | None = None) -> list[object]:
    with _lock:
        return [v for k, v in ORDER if label is None or k == label]


class _Live:
    def __init__(self, label: str) -> None:
        self.label = label

    def __enter__(self) -> None:
        with _lock:
            LIVE[self.label] = LIVE.get(self.label, 0) + 1
            PEAK[self.label] = max(PEAK.get(self.label, 0), LIVE[self.label])

    def __exit__(self, *exc: object) -> None:
        with _lock:
            LIVE[self.label] -= 1


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    with _lock:
        ORDER.clear()
        GATES.clear()
        LIVE.clear()
        PEAK.clear()
        FLOOD.clear()
    yield
    set_clock_shift(timedelta(0))
    with _lock:
        events = list(GATES.values())
    for event in events:
        event.set()


# -- handlers -------------------------------------------------------------------------------


@step(name="opf_rec", queue=Q)
def opf_rec(value: object) -> object:
    note("rec", value)
    return value


@step(name="opf_hold", queue=Q)
def opf_hold(value: object) -> object:
    """Holds the worker's only slot until its gate opens."""
    note("rec", value)
    gate("hold").wait(20)
    return value


@step(name="opf_fair", queue=Q, concurrency=Concurrency(key="tenant", limit=None))
def opf_fair(job: dict[str, Any]) -> object:
    note("rec", f"{job['tenant']}:{job['n']}")
    return job["n"]


@step(name="opf_keyed", queue=Q, concurrency=Concurrency(key="tenant", limit=5))
def opf_keyed(job: dict[str, Any]) -> object:
    note("rec", f"{job['tenant']}:{job['n']}")
    return job["n"]


@step(name="opf_prio7", queue=Q, priority=7)
def opf_prio7(value: object) -> object:
    note("rec", value)
    return value


@step(name="opf_low_root", queue=Q, priority=1)
def opf_low_root(value: object) -> object:
    note("rec", f"a{value}")
    return value


@step(name="opf_high_root", queue=Q)
def opf_high_root(value: object) -> object:
    note("rec", f"b{value}")
    return value


@step(name="opf_join", queue=Q)
def opf_join(a: object, b: object) -> object:
    note("rec", f"c{a}")
    return [a, b]


@workflow(name="opf_two_roots")
def opf_two_roots(n):  # type: ignore[no-untyped-def]
    a = opf_low_root(n)
    b = opf_high_root(n, priority=9)
    return opf_join(a, b)


@step(name="opf_flood", queue=Q)
def opf_flood(value: int, ctx: StepContext) -> int:
    """While FLOOD["left"] > 0, each run enqueues one more high-priority step."""
    note("rec", value)
    client: Client | None = FLOOD.get("client")
    with _lock:
        left = int(FLOOD.get("left", 0))
        FLOOD["left"] = left - 1
    if client is not None and left > 0:
        client.enqueue(opf_flood, value + 1, priority=50)
    return value


@step(name="opf_qa_rec", queue=QA)
def opf_qa_rec(value: object) -> object:
    note("rec", f"qa:{value}")
    return value


@step(name="opf_qb_rec", queue=QB)
def opf_qb_rec(value: object) -> object:
    note("rec", f"qb:{value}")
    return value


@step(name="opf_seq_fair", queue=Q, concurrency=Concurrency(key="tenant", limit=None))
def opf_seq_fair(job: dict[str, Any]) -> object:
    with _Live("seq"):
        note("seq", job["n"])
        gate(f"seq{job['n']}").wait(0.05)
    return job["n"]


@step(name="opf_seq_plain", queue=Q)
def opf_seq_plain(n: int) -> object:
    with _Live("seq"):
        note("seq", n)
        gate(f"seq{n}").wait(0.05)
    return n


def ended(handles: list[RunHandle], timeout: float = 30) -> None:
    for handle in handles:
        handle.wait(timeout=timeout)


def now() -> datetime:
    return datetime.now(UTC)


# -- priorities within one queue ------------------------------------------------------------


def test_opf_extreme_priorities_and_ties_drain_highest_first_then_in_enqueue_order(
    client: Client, start_worker: StartWorker
) -> None:
    top, bottom = 2**31 - 1, -(2**31 - 1)
    plan = [0, top, bottom, 5, 5, 0, -1, top, bottom, 5]
    handles = [client.enqueue(opf_rec, i, priority=p) for i, p in enumerate(plan)]
    start_worker(opf_rec, queues=[Q], concurrency=1)
    ended(handles)
    expected = [i for i, _ in sorted(enumerate(plan), key=lambda ip: (-ip[1], ip[0]))]
    assert seen() == expected
    assert [h.get().steps[0].priority for h in handles] == plan


@pytest.mark.parametrize("priority", ["2**31", "-2**31", "2**63"])
def test_opf_a_priority_beyond_32_bits_is_refused_and_writes_nothing(
    client: Client, priority: str
) -> None:
    value = {"2**31": 2**31, "-2**31": -(2**31), "2**63": 2**63}[priority]
    with pytest.raises(InvalidArgument):
        client.enqueue(opf_rec, 1, priority=value)
    assert client.list_runs(workflow="opf_rec") == []


def test_opf_enqueue_many_runs_the_higher_priority_batch_first(
    client: Client, start_worker: StartWorker
) -> None:
    """The higher priority batch runs first, though enqueued second. Within one batch
    (one statement, one scheduled_at) no order is documented: a fresh clone once ran
    item 4 before item 0."""
    handles = client.enqueue_many(opf_rec, list(range(30)), priority=3)
    handles += client.enqueue_many(opf_rec, list(range(100, 110)), priority=4)
    start_worker(opf_rec, queues=[Q], concurrency=1)
    ended(handles)
    assert sorted(seen()[:10]) == list(range(100, 110))
    assert sorted(seen()[10:]) == list(range(30))


def test_opf_a_step_s_own_priority_is_overridden_by_enqueue_even_with_zero(
    client: Client, start_worker: StartWorker
) -> None:
    default = client.enqueue(opf_prio7, "default")
    zero = client.enqueue(opf_prio7, "zero", priority=0)
    plain = client.enqueue(opf_rec, "plain", priority=3)
    assert default.get().steps[0].priority == 7
    assert zero.get().steps[0].priority == 0
    start_worker(opf_prio7, opf_rec, queues=[Q], concurrency=1)
    ended([default, zero, plain])
    assert seen() == ["default", "plain", "zero"]


def test_opf_workflow_node_priorities_order_parallel_roots_across_runs(
    client: Client, start_worker: StartWorker
) -> None:
    handles = [client.submit(opf_two_roots, n) for n in range(3)]
    start_worker(opf_two_roots, queues=[Q], concurrency=1)
    for h in handles:
        assert h.result(timeout=30) is not None
    # b (node option priority=9) of every run, then a (@step priority=1), then the joins
    # (each due from its activation, which two completers may commit in either order).
    assert seen()[:6] == ["b0", "b1", "b2", "a0", "a1", "a2"]
    assert sorted(map(str, seen()[6:])) == ["c0", "c1", "c2"]


def test_opf_a_high_priority_flood_runs_before_low_priority_work_without_aging(
    client: Client, start_worker: StartWorker
) -> None:
    """Priorities are strict within a queue: a low step waits while higher work keeps
    coming (the documented order: higher claims first; no aging is documented)."""
    low = client.enqueue(opf_rec, "low", priority=-1)
    FLOOD["client"] = client
    FLOOD["left"] = 15
    first = client.enqueue(opf_flood, 0, priority=50)
    start_worker(opf_flood, opf_rec, queues=[Q], concurrency=1)
    ended([low, first])
    wait_until(lambda: "low" in seen(), what="the low step ran")
    assert seen() == [*range(16), "low"]


# -- limited and unlimited work in one queue --------------------------------------------


@pytest.mark.parametrize("kind", ["fair", "keyed"])
def test_opf_limited_work_of_a_queue_is_claimed_before_its_unlimited_work(
    client: Client, start_worker: StartWorker, kind: str
) -> None:
    """flow-control.md ("Priorities and limited work"): in a queue holding limited work
    (a concurrency key, even one without a limit, a rate limit, a workflow limit), each
    claim takes the limited steps first, by their keys' turns, then unlimited ones by
    priority: an unlimited step of priority 50 waits behind limited ones of priority -5.
    (The explorer's report, as a finding: priority is not compared across the two.)"""
    limited = opf_fair if kind == "fair" else opf_keyed
    low = [client.enqueue(limited, {"tenant": "t", "n": n}, priority=-5) for n in range(4)]
    high = client.enqueue(opf_rec, "high", priority=50)
    start_worker(limited, opf_rec, queues=[Q], concurrency=1)
    ended([*low, high])
    assert seen() == ["t:0", "t:1", "t:2", "t:3", "high"], seen()


@step(name="opf_fair_chain", queue=Q, concurrency=Concurrency(key="tenant", limit=None))
def opf_fair_chain(job: dict[str, Any]) -> object:
    """Each run enqueues the next step of its tenant while FLOOD["left"] > 0."""
    note("rec", f"{job['tenant']}:{job['n']}")
    client: Client | None = FLOOD.get("client")
    with _lock:
        left = int(FLOOD.get("left", 0))
        FLOOD["left"] = left - 1
    if client is not None and left > 0:
        client.enqueue(opf_fair_chain, {"tenant": job["tenant"], "n": job["n"] + 1}, priority=-5)
    return job["n"]


def test_opf_a_flow_of_limited_work_holds_unlimited_work_of_its_queue_until_it_ends(
    client: Client, start_worker: StartWorker
) -> None:
    FLOOD["client"] = client
    FLOOD["left"] = 12
    chain = client.enqueue(opf_fair_chain, {"tenant": "t", "n": 0}, priority=-5)
    high = client.enqueue(opf_rec, "high", priority=50)
    start_worker(opf_fair_chain, opf_rec, queues=[Q], concurrency=1)
    ended([chain, high])
    wait_until(lambda: len(seen()) >= 14, what="the chain and the high step ran")
    # Documented (flow-control.md): it runs once the queue has no limited work left to
    # claim; a queue of its own for the limited kind would let it run at once.
    assert seen()[-1] == "high", seen()


# -- schedules ------------------------------------------------------------------------------


def test_opf_a_schedule_s_priority_puts_its_fired_step_ahead_of_the_backlog(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    hold = client.enqueue(opf_hold, "hold", priority=100)
    # A lease longer than the clock's move: the holder is not reclaimed and run again.
    start_worker(opf_hold, opf_rec, queues=[Q], concurrency=1, lease=3600)
    wait_until(lambda: seen() == ["hold"], what="the holder running")
    backlog = [client.enqueue(opf_rec, f"low{n}") for n in range(3)]
    schedule = client.schedule(
        opf_rec, "* * * * *", id="opf_sched", location="UTC", input="sched", priority=5
    )
    clock(schedule.next_run_at + timedelta(seconds=1))
    last = wait_until(
        lambda: next(s for s in client.list_schedules() if s.id == "opf_sched").last_run_id,
        what="the schedule fired",
    )
    assert last is not None
    fired: int = last
    assert client.get_run(fired).steps[0].priority == 5
    gate("hold").set()
    ended([hold, *backlog, client.handle(fired)])
    assert seen()[:2] == ["hold", "sched"], seen()
    assert sorted(map(str, seen()[2:])) == ["low0", "low1", "low2"]


# -- scheduled_at -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["plain", "fair"])
def test_opf_a_later_start_never_runs_early_whatever_its_priority_and_runs_once_due(
    client: Client, start_worker: StartWorker, clock: Clock, kind: str
) -> None:
    def job(tenant: str, n: str) -> Any:
        return n if kind == "plain" else {"tenant": tenant, "n": n}

    target = opf_rec if kind == "plain" else opf_fair
    later = now() + timedelta(hours=1)
    future = client.enqueue(target, job("x", "future"), priority=1000, scheduled_at=later)
    due = [client.enqueue(target, job(f"y{n}", f"due{n}"), priority=-1000) for n in range(3)]
    worker = start_worker(target, queues=[Q], concurrency=1, poll_interval=LONG_POLL)
    ended(due)
    scanner_passes(worker, 3)
    clock(later - timedelta(seconds=30))
    scanner_passes(worker, 3)
    (step_row,) = future.get().steps
    assert (step_row.state, step_row.started_at) == (StepState.AVAILABLE, None)
    assert len(seen()) == 3
    clock(later + timedelta(seconds=1))
    # The scanner's due pass wakes it: no 60 s poll is waited for.
    assert future.wait(timeout=20).state is RunState.COMPLETED
    started = future.get().steps[0].started_at
    assert started is not None and started >= later


@pytest.mark.parametrize("kind", ["plain", "keyed", "fair"])
def test_opf_within_one_priority_an_earlier_scheduled_at_runs_first(
    client: Client, start_worker: StartWorker, clock: Clock, kind: str
) -> None:
    """Claims order by (priority DESC, scheduled_at); within one key, limited steps go in
    priority, then enqueue order (flow-control.md: a limit's turns know no scheduled_at)."""
    target = {"plain": opf_rec, "keyed": opf_keyed, "fair": opf_fair}[kind]
    base = now()
    handles = []
    for minutes in [30, 10, 20, 5]:
        value: Any = f"m{minutes}" if kind == "plain" else {"tenant": "t", "n": f"m{minutes}"}
        handles.append(
            client.enqueue(target, value, scheduled_at=base + timedelta(minutes=minutes))
        )
    clock(base + timedelta(hours=1))
    start_worker(target, queues=[Q], concurrency=1)
    ended(handles)
    got = [str(v).removeprefix("t:") for v in seen()]
    if kind == "plain":
        assert got == ["m5", "m10", "m20", "m30"]
    else:
        assert got == ["m30", "m10", "m20", "m5"]  # enqueue order, all due


# -- fair keys ---------------------------------------------------------------------------


@pytest.mark.parametrize("concurrency", [1, 2])
def test_opf_a_tenant_with_one_step_is_not_starved_by_one_with_a_thousand(
    client: Client, start_worker: StartWorker, concurrency: int
) -> None:
    client.enqueue_many(opf_fair, [{"tenant": "big", "n": n} for n in range(1000)], priority=10)
    small = client.enqueue(opf_fair, {"tenant": "small", "n": 0}, priority=-10)
    start_worker(opf_fair, queues=[Q], concurrency=concurrency)
    small.wait(timeout=30)
    got = seen()
    assert got.index("small:0") <= concurrency, got[:10]
    # Later work of the small tenant, while the big one still has hundreds queued, runs
    # at its next turn too.
    before = len(seen())
    late = client.enqueue(opf_fair, {"tenant": "small", "n": 1}, priority=-10)
    late.wait(timeout=30)
    got = seen()
    assert got.index("small:1") - before <= 2 + concurrency, got[before:]
    assert len([v for v in got if str(v).startswith("big:")]) < 1000


# -- queues of one worker -----------------------------------------------------------------


def test_opf_a_workers_second_queue_is_not_starved_by_a_busy_first_queue(
    client: Client, start_worker: StartWorker
) -> None:
    busy = client.enqueue_many(opf_qa_rec, list(range(60)), priority=100)
    other = client.enqueue(opf_qb_rec, 0, priority=-100)
    start_worker(opf_qa_rec, opf_qb_rec, queues=[QA, QB], concurrency=1)
    other.wait(timeout=30)
    ended(busy)
    got = seen()
    assert got.index("qb:0") <= 2, got[:10]
    assert [v for v in got if str(v).startswith("qa:")] == [f"qa:{n}" for n in range(60)]


# -- sequence keys on the limited and capped claim paths ----------------------------------


@pytest.mark.parametrize("path", ["fair", "capped", "mixed"])
def test_opf_a_sequence_runs_one_at_a_time_in_order_on_every_claim_path(
    client: Client, start_worker: StartWorker, path: str
) -> None:
    if path == "capped":
        client.set_queue_limit(Q, 3)
    handles = []
    for n in range(8):
        fair = path == "fair" or (path == "mixed" and n % 2 == 1)
        if fair:
            handles.append(
                client.enqueue(opf_seq_fair, {"tenant": f"t{n % 3}", "n": n}, sequence_key="S")
            )
        else:
            handles.append(client.enqueue(opf_seq_plain, n, sequence_key="S"))
    start_worker(opf_seq_fair, opf_seq_plain, queues=[Q], concurrency=4)
    ended(handles)
    assert seen("seq") == list(range(8))
    assert PEAK["seq"] == 1


# -- workflow run slots ---------------------------------------------------------------------


@step(name="opf_run_first", queue=Q)
def opf_run_first(job: dict[str, Any]) -> object:
    note("rec", f"{job['tenant']}:{job['n']}")
    return job["n"]


@step(name="opf_run_second", queue=Q)
def opf_run_second(n: object) -> object:
    note("second", n)
    return n


@workflow(name="opf_one_run_at_a_time", concurrency=Concurrency(key="tenant", limit=1))
def opf_one_run_at_a_time(job):  # type: ignore[no-untyped-def]
    return opf_run_second(opf_run_first(job))


@workflow(name="opf_fair_runs", concurrency=Concurrency(key="tenant", limit=None))
def opf_fair_runs(job):  # type: ignore[no-untyped-def]
    return opf_run_first(job)


def test_opf_runs_queued_for_a_run_slot_start_in_submit_order(
    client: Client, start_worker: StartWorker
) -> None:
    handles = [client.submit(opf_one_run_at_a_time, {"tenant": "t", "n": n}) for n in range(6)]
    start_worker(opf_one_run_at_a_time, queues=[Q], concurrency=4)
    for h in handles:
        h.result(timeout=30)
    assert seen("rec") == [f"t:{n}" for n in range(6)]
    # One run at a time: each run's second step ran before the next run's first.
    assert [v for _, v in ORDER] == [x for n in range(6) for x in (f"t:{n}", n)]


def test_opf_a_tenant_with_one_run_is_not_starved_by_one_with_hundreds(
    client: Client, start_worker: StartWorker
) -> None:
    client.submit_many(opf_fair_runs, [{"tenant": "big", "n": n} for n in range(300)])
    small = client.submit(opf_fair_runs, {"tenant": "small", "n": 0})
    start_worker(opf_fair_runs, queues=[Q], concurrency=1)
    small.result(timeout=30)
    got = seen()
    assert got.index("small:0") <= 1, got[:10]
