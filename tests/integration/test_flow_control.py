"""Flow control through the public API: concurrency keys on steps and workflows, queue caps,
rate limits, fair claims across keys, debounce, and what stats and the run say about them."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from cyclone_dsl import (
    Client,
    Concurrency,
    Debounce,
    InvalidArgument,
    RateLimit,
    Registry,
    RunNotFound,
    RunState,
    StepContext,
    StepState,
    Worker,
    step,
    wait_signal,
    workflow,
)
from cyclone_dsl.dsl.workflow import WorkflowDef
from cyclone_dsl.testing.failpoints import arm, disarm


class Tracker:
    """Counts handlers running at once, per key, and records when each started."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: collections.Counter[str] = collections.Counter()
        self.peak: collections.Counter[str] = collections.Counter()
        self.starts: list[tuple[float, str, object]] = []
        self.release = threading.Event()

    def enter(self, key: str, value: object) -> None:
        with self.lock:
            self.running[key] += 1
            self.peak[key] = max(self.peak[key], self.running[key])
            self.starts.append((time.monotonic(), key, value))

    def leave(self, key: str) -> None:
        with self.lock:
            self.running[key] -= 1


tracker = Tracker()


@pytest.fixture(autouse=True)
def fresh_tracker() -> Tracker:
    global tracker
    tracker = Tracker()
    return tracker


def wait_until(condition: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# -- concurrency keys -------------------------------------------------------------------


@step(name="fc_keyed", concurrency=Concurrency(key="tenant", limit=2))
def keyed(job: dict[str, Any]) -> int:
    tracker.enter(job["tenant"], job["n"])
    tracker.enter("all", job["n"])
    time.sleep(0.03)
    tracker.leave("all")
    tracker.leave(job["tenant"])
    return int(job["n"])


def test_a_step_concurrency_key_caps_each_key(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    handles = [client.enqueue(keyed, {"tenant": f"t{i % 3}", "n": i}) for i in range(30)]
    start_worker(keyed, concurrency=20)
    assert [h.result(timeout=30) for h in handles] == list(range(30))
    assert {key: tracker.peak[key] for key in ("t0", "t1", "t2")} == {"t0": 2, "t1": 2, "t2": 2}


def test_limited_work_queued_between_the_gate_look_and_the_claim_waits_for_the_next_claim(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A claim looks for limited work first and runs the gated claim only on queues holding
    some. Steps gated just after that look are not taken by the same round's plain claim
    (past their limit), and their commit wakes the claimer: no wait for the next poll."""
    submitting, submitted = threading.Event(), threading.Event()
    handles = []

    def submit_once() -> None:
        if not submitting.is_set():
            submitting.set()
            handles.extend(
                client.enqueue(keyed, {"tenant": "t", "n": i}, concurrency_key="k")
                for i in range(6)
            )
            submitted.set()

    arm("claim.after_gate_look", submit_once)
    try:
        start_worker(keyed, concurrency=20, poll_interval=60)
        wait_until(submitted.is_set, what="a claim")
        assert [h.result(timeout=20) for h in handles] == list(range(6))
    finally:
        disarm("claim.after_gate_look")
    assert tracker.peak["all"] == 2


def test_enqueue_can_give_the_key(client: Client, start_worker: Callable[..., Worker]) -> None:
    handles = [
        client.enqueue(keyed, {"tenant": f"t{i}", "n": i}, concurrency_key="shared")
        for i in range(8)
    ]
    start_worker(keyed, concurrency=20)
    for handle in handles:
        handle.result(timeout=30)
    assert tracker.peak["all"] == 2
    assert [r["key"] for r in client.stats()["limits"]] == ["shared"]


spans: dict[int, list[float]] = {}


@step(name="fc_run_step")
def run_step(job: dict[str, Any]) -> int:
    tracker.enter("runs", job["n"])
    spans[int(job["n"])] = [time.monotonic()]
    time.sleep(0.05)
    tracker.leave("runs")
    return int(job["n"])


@step(name="fc_run_tail")
def run_tail(n: int) -> int:
    spans[n].append(time.monotonic())
    return n


@workflow(name="fc_per_tenant", concurrency=Concurrency(key="tenant", limit=2))
def per_tenant(job):  # type: ignore[no-untyped-def]
    return run_tail(run_step(job))


def test_a_workflow_limit_runs_its_runs_in_submit_order(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """At most two runs of a key are under way: from its first handler's start to its last
    handler's end (a run ends when that handler's completion commits, later still)."""
    spans.clear()
    handles = [client.submit(per_tenant, {"tenant": "acme", "n": n}) for n in range(8)]
    other = client.submit(per_tenant, {"tenant": "other", "n": 99})
    start_worker(per_tenant, concurrency=10)
    assert [h.result(timeout=30) for h in handles] == list(range(8))
    assert other.result(timeout=30) == 99
    acme = [value for _, _, value in tracker.starts if value != 99]
    assert acme == list(range(8)), "runs beyond the limit started out of submit order"
    intervals = [spans[n] for n in range(8)]
    for start, _ in intervals:
        under_way = sum(1 for begin, end in intervals if begin <= start < end)
        assert under_way <= 2, "more than 2 runs of one key were under way"


# -- queue caps -----------------------------------------------------------------------------


@step(name="fc_capped", queue="fc_capped")
def capped(n: int) -> int:
    tracker.enter("queue", n)
    time.sleep(0.03)
    tracker.leave("queue")
    return n


def test_a_queue_cap_holds_across_workers(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    client.set_queue_limit("fc_capped", 3)
    handles = client.enqueue_many(capped, list(range(24)))
    for _ in range(2):
        start_worker(capped, queues=["fc_capped"], concurrency=10)
    assert [h.result(timeout=30) for h in handles] == list(range(24))
    assert tracker.peak["queue"] == 3
    client.set_queue_limit("fc_capped", None)
    assert [r for r in client.stats()["limits"] if r["scope"] == "queue:fc_capped"] == []


def test_a_capped_queue_gives_its_free_slots_to_the_highest_priorities(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    client.set_queue_limit("fc_capped", 2)
    priorities = [0, 5, 1, 9, 3, 7]
    handles = [client.enqueue(capped, p, priority=p) for p in priorities]
    start_worker(capped, queues=["fc_capped"], concurrency=10)
    for handle in handles:
        handle.result(timeout=30)
    started = [value for _, key, value in tracker.starts if key == "queue"]
    # Six due steps, two slots: the first claim takes the two highest priorities.
    assert set(started[:2]) == {9, 7}
    assert tracker.peak["queue"] == 2
    client.set_queue_limit("fc_capped", None)


def test_a_worker_queue_limit_holds_in_that_worker(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    handles = client.enqueue_many(capped, list(range(12)))
    start_worker(capped, queues=["fc_capped"], concurrency=10, queue_limits={"fc_capped": 2})
    for handle in handles:
        handle.result(timeout=30)
    assert tracker.peak["queue"] == 2


# -- rate limits ----------------------------------------------------------------------------


@step(name="fc_rated", rate_limit=RateLimit(limit=5, per=timedelta(seconds=1)))
def rated(n: int) -> int:
    tracker.enter("rate", n)
    tracker.leave("rate")
    return n


def test_a_rate_limit_spreads_starts_over_windows(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    handles = client.enqueue_many(rated, list(range(15)))
    start_worker(rated, concurrency=10)
    for handle in handles:
        handle.result(timeout=30)
    with psycopg.connect(cyclone_dsn) as conn:
        starts = [
            row[0]
            for row in conn.execute(
                "SELECT started_at FROM cyclone_steps WHERE kind = 'fc_rated' ORDER BY 1"
            )
        ]
        attempts = conn.execute(
            "SELECT max(attempt) FROM cyclone_steps WHERE kind = 'fc_rated'"
        ).fetchone()
    assert attempts == (0,), "a step over the limit spent an attempt"
    for index, start in enumerate(starts):
        in_window = [s for s in starts[index:] if s < start + timedelta(seconds=1)]
        assert len(in_window) <= 5, f"{len(in_window)} starts within one second"
    assert starts[-1] - starts[0] >= timedelta(seconds=2)


@step(name="fc_metered", rate_limit=RateLimit(limit=5, per=timedelta(hours=1)))
def metered(used: int, *, ctx: StepContext) -> int:
    ctx.rate_limit_units = used
    return used


def test_units_a_handler_reports_are_charged_to_its_budget(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(metered)
    assert client.enqueue(metered, 4).result(timeout=20) == 4  # 1 claimed, 3 charged
    assert client.enqueue(metered, 1).result(timeout=20) == 1  # the fifth unit
    held = client.enqueue(metered, 1)
    wait_until(lambda: "rate limited until" in client.why_waiting(held.id).get("fc_metered", ""))
    assert held.get().state is RunState.RUNNING


def test_a_report_past_any_budget_completes_its_step(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A handler's report past the int range (2**40 units) failed the completion of every
    step in its batch in the database; it takes the whole budget instead."""
    start_worker(metered)
    assert client.enqueue(metered, 2**40).result(timeout=20) == 2**40
    held = client.enqueue(metered, 1)
    wait_until(lambda: "rate limited until" in client.why_waiting(held.id).get("fc_metered", ""))


# -- fair claims ----------------------------------------------------------------------------


@step(name="fc_fair", concurrency=Concurrency(key="tenant", limit=None))
def fair(job: dict[str, Any]) -> int:
    tracker.enter(job["tenant"], job["n"])
    tracker.leave(job["tenant"])
    return int(job["n"])


def test_claims_take_keys_in_turn(client: Client, start_worker: Callable[..., Worker]) -> None:
    big = client.enqueue_many(fair, [{"tenant": "big", "n": n} for n in range(400)])
    small = client.enqueue_many(fair, [{"tenant": "small", "n": n} for n in range(10)])
    start_worker(fair, concurrency=4, batch_size=4)
    for handle in [*big, *small]:
        handle.result(timeout=60)
    order = [key for _, key, _ in tracker.starts]
    last_small = max(i for i, key in enumerate(order) if key == "small")
    big_before = sum(1 for key in order[:last_small] if key == "big")
    assert big_before <= 40, f"the small tenant waited behind {big_before} of the big one's steps"


# -- bad input ------------------------------------------------------------------------------


def test_limits_refuse_bad_values_at_definition() -> None:
    with pytest.raises(InvalidArgument, match="limit must be an integer from 1 to"):
        Concurrency(key="tenant", limit=0)
    with pytest.raises(InvalidArgument, match="per must be a positive duration"):
        RateLimit(limit=5, per=timedelta(0))
    with pytest.raises(InvalidArgument, match="key must be None, a field name"):
        Concurrency(key=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="concurrency must be a Concurrency"):
        step(concurrency=3)(lambda x: x)  # type: ignore[call-overload]


def test_limits_past_the_largest_are_refused(client: Client) -> None:
    """A limit is a slot row per unit per key: a limit of a million made every submit of a
    new key insert a million rows (8 s here), and a queue cap past 2**31 - 1 came back as a
    raw NumericValueOutOfRange."""
    with pytest.raises(InvalidArgument, match="limit must be an integer from 1 to 100000"):
        Concurrency(key="tenant", limit=100_001)
    with pytest.raises(InvalidArgument, match="limit must be an integer from 1 to 100000"):
        RateLimit(limit=1_000_000, per=timedelta(minutes=1))
    for cap in (100_001, 2**31):
        with pytest.raises(InvalidArgument, match="a queue limit must be an integer from 1"):
            client.set_queue_limit("fc_huge", cap)
    assert [r for r in client.stats()["limits"] if r["scope"] == "queue:fc_huge"] == []
    # The largest limit is taken.
    Concurrency(key="tenant", limit=100_000)
    client.set_queue_limit("fc_huge", 100_000)
    client.set_queue_limit("fc_huge", None)


def test_a_key_that_cannot_be_evaluated_refuses_the_submit(client: Client) -> None:
    with pytest.raises(InvalidArgument, match="the run input has no field 'tenant'"):
        client.enqueue(keyed, {"n": 1})
    with pytest.raises(InvalidArgument, match="a key must be a string"):
        client.enqueue(keyed, {"tenant": ["x"], "n": 1})
    with pytest.raises(InvalidArgument, match="not a JSON object"):
        client.submit(per_tenant, 5)
    with pytest.raises(InvalidArgument, match="declares no Concurrency"):
        client.enqueue(capped, 1, concurrency_key="x")
    assert client.list_runs() == []


@step(name="fc_key_override", concurrency=Concurrency(key="tenant", limit=2))
def key_override(job: dict[str, Any]) -> int:
    return 1


@pytest.mark.parametrize(
    "key", ["a\x00b", "k" * 300, "k\ud800"], ids=["nul", "over_256_bytes", "lone_surrogate"]
)
def test_a_bad_concurrency_key_is_refused(client: Client, key: str) -> None:
    """concurrency_key= was only checked to be a non-empty string: a NUL and a lone surrogate
    raised psycopg's errors from the insert, and a key over 256 bytes was stored."""
    with pytest.raises(InvalidArgument):
        client.enqueue(key_override, {"tenant": "t"}, concurrency_key=key)
    assert client.list_runs() == []


@step(name="fc_fn_keyed", concurrency=Concurrency(key=lambda job: job["k"] + "\ud800", limit=2))
def fn_keyed(job: dict[str, Any]) -> int:
    return 1


def test_a_key_function_returning_a_lone_surrogate_is_refused(client: Client) -> None:
    """It raised UnicodeEncodeError."""
    with pytest.raises(InvalidArgument):
        client.enqueue(fn_keyed, {"k": "x"})
    assert client.list_runs() == []


@step(name="fc_int_keyed", concurrency=Concurrency(key=lambda job: 10**5000, limit=2))
def int_keyed(job: dict[str, Any]) -> int:
    return 1


def test_a_key_function_returning_a_huge_int_is_refused(client: Client) -> None:
    """An int key is allowed; one of 5,000 digits raised a bare ValueError (Python's limit
    on converting ints to strings)."""
    with pytest.raises(InvalidArgument):
        client.enqueue(int_keyed, {"k": "x"})
    assert client.list_runs() == []


@step(name="fc_plain")
def plain(x: int) -> int:
    return x * 2


@workflow(name="fc_once")
def once(x):  # type: ignore[no-untyped-def]
    return plain(x)


SURROGATE_CALLS: dict[str, Callable[[Client], object]] = {
    "submit_once": lambda c: c.submit_once(once, 1, key="k\ud800"),
    "unique_key": lambda c: c.enqueue(plain, 1, unique_key="k\ud800"),
    "sequence_key": lambda c: c.enqueue(plain, 1, sequence_key="k\ud800"),
    "debounce": lambda c: c.submit(
        once, 1, debounce=Debounce(key=lambda _: "k\ud800", delay=timedelta(seconds=1))
    ),
}


@pytest.mark.parametrize("call", list(SURROGATE_CALLS))
def test_a_key_with_a_lone_surrogate_is_refused(client: Client, call: str) -> None:
    """Each raised UnicodeEncodeError (the same string as an input is InvalidPayload)."""
    with pytest.raises(InvalidArgument):
        SURROGATE_CALLS[call](client)
    assert client.list_runs() == []


# -- what users see ---------------------------------------------------------------------------


@step(name="fc_one_at_a_time", concurrency=Concurrency(key="tenant", limit=1))
def one_at_a_time(job: dict[str, Any]) -> int:
    tracker.release.wait(20)
    return 1


def test_stats_and_the_run_say_why_a_step_waits(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    first = client.enqueue(one_at_a_time, {"tenant": "t7"})
    second = client.enqueue(one_at_a_time, {"tenant": "t7"})
    start_worker(one_at_a_time, concurrency=5)
    wait_until(lambda: first.get().steps[0].state is StepState.RUNNING, what="the first step")
    assert client.why_waiting(second.id) == {
        "fc_one_at_a_time": "waiting for a concurrency slot (t7: 1/1)"
    }
    (share,) = client.stats()["limits"]
    assert (share["scope"], share["key"], share["in_use"], share["waiting"]) == (
        "step:fc_one_at_a_time",
        "t7",
        1,
        1,
    )
    tracker.release.set()
    assert second.wait(timeout=20).state is RunState.COMPLETED


# -- debounce ------------------------------------------------------------------------------


@step(name="fc_refresh")
def refresh(job: dict[str, Any]) -> object:
    return job["n"]


@workflow(name="fc_refresh_wf")
def refresh_wf(job):  # type: ignore[no-untyped-def]
    return refresh(job)


def db_now(dsn: str) -> datetime:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def test_debounced_submits_make_one_run_with_the_last_input(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    delay = timedelta(seconds=0.6)
    debounce = Debounce(key="doc", delay=delay)
    handles = []
    started = time.monotonic()
    for n in range(49):
        handles.append(client.submit(refresh_wf, {"doc": "d1", "n": n}, debounce=debounce))
        time.sleep(0.02)
    last_submit = time.monotonic()
    before_last = db_now(cyclone_dsn)
    handles.append(client.submit(refresh_wf, {"doc": "d1", "n": 49}, debounce=debounce))
    other = client.submit(refresh_wf, {"doc": "d2", "n": -1}, debounce=debounce)
    assert len({h.id for h in handles}) == 1
    assert [h.created for h in handles] == [True] + [False] * 49
    # The last submit moved the start to its delay after itself (the first submit's delay
    # passed during the submits, which took over a second).
    (held,) = handles[-1].get().steps
    assert held.scheduled_at >= before_last + delay, (held.scheduled_at, before_last)
    # The worker starts once the submits are made: no claim closes the window between two
    # of them, however slowly a loaded machine makes them.
    start_worker(refresh_wf)
    assert handles[-1].result(timeout=20) == 49
    assert time.monotonic() - last_submit >= 0.5, "the run started before the delay"
    assert other.result(timeout=20) == -1
    assert len(client.list_runs()) == 2
    assert time.monotonic() - started < 20


def test_a_debounced_run_takes_the_deadline_of_its_last_submit(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    """The window moves past the first submit's deadline: the run, which starts after the
    last submit with the last input, keeps to the last submit's deadline, not the first's
    (it failed by a deadline that passed before it could start). Time moves on the
    database clock: deadlines and windows of an hour, passed by moving the clock."""
    hour = timedelta(hours=1)
    debounce = Debounce(key="doc", delay=timedelta(seconds=0.5))
    base = datetime.now(UTC)
    handles = []
    for n in range(8):  # 70 minutes of submits, 10 apart: the window stays open
        clock(base + n * timedelta(minutes=10))
        handles.append(
            client.submit(refresh_wf, {"doc": "d4", "n": n}, debounce=debounce, deadline=hour)
        )
    assert len({h.id for h in handles}) == 1
    deadline_at = handles[-1].get().deadline_at
    assert deadline_at is not None and deadline_at >= base + timedelta(minutes=70) + hour
    start_worker(refresh_wf)  # 70 minutes on: past the first submit's deadline
    assert handles[-1].result(timeout=20) == 7
    # The last submit without a deadline leaves the run without one. (A window of an hour:
    # the second submit joins it however loaded the machine is; the clock then passes both
    # the window and the first submit's deadline.)
    wide = Debounce(key="doc", delay=hour)
    first = client.submit(refresh_wf, {"doc": "d5", "n": 1}, debounce=wide, deadline=hour)
    last = client.submit(refresh_wf, {"doc": "d5", "n": 2}, debounce=wide)
    assert last.id == first.id
    assert last.get().deadline_at is None
    clock(datetime.now(UTC) + timedelta(hours=4))
    assert last.result(timeout=20) == 2


@step(name="fc_double")
def double(job: dict[str, Any]) -> object:
    return job["n"] * 2


def refresh_then_double(job):  # type: ignore[no-untyped-def]
    return double(job, after=[refresh(job)])


def double_then_refresh(job):  # type: ignore[no-untyped-def]
    return refresh(job, after=[double(job)])


def test_a_debounced_submit_of_another_deploy_opens_its_own_window(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """Two deploys whose definitions have the same nodes in another shape: the new
    deploy's submit does not move its input into the old deploy's run (whose rows and
    edges are the old shape); it opens a window of its own, and each run keeps its input."""
    debounce = Debounce(key="doc", delay=timedelta(seconds=0.3))
    old_registry, new_registry = Registry(), Registry()
    old = WorkflowDef(refresh_then_double, "fc_debounced_deploys")
    new = WorkflowDef(double_then_refresh, "fc_debounced_deploys")
    old_registry.add_workflow_tree(old)
    new_registry.add_workflow_tree(new)
    assert old.def_version != new.def_version
    with (
        Client(cyclone_dsn, registry=old_registry) as old_client,
        Client(cyclone_dsn, registry=new_registry) as new_client,
    ):
        first = old_client.submit("fc_debounced_deploys", {"doc": "d6", "n": 1}, debounce=debounce)
        second = new_client.submit("fc_debounced_deploys", {"doc": "d6", "n": 2}, debounce=debounce)
        third = new_client.submit("fc_debounced_deploys", {"doc": "d6", "n": 3}, debounce=debounce)
        assert second.created and second.id != first.id
        assert not third.created and third.id == second.id
        start_worker(registry=old_registry, name="old")
        start_worker(registry=new_registry, name="new")
        assert first.result(timeout=20) == 2  # refresh, then double: its own input
        assert third.result(timeout=20) == 3  # double, then refresh: the last input
        assert old_client.get_run(first.id).def_version == old.def_version
        assert new_client.get_run(third.id).def_version == new.def_version


def test_concurrent_first_submits_of_a_key_make_one_run(client: Client) -> None:
    """Eight submitters at a barrier, none finding a window yet: the advisory lock lets one
    open it and the others join it."""
    debounce = Debounce(key="doc", delay=timedelta(seconds=30))
    barrier = threading.Barrier(8)
    handles: list[Any] = []
    lock = threading.Lock()

    def submit(n: int) -> None:
        barrier.wait()
        handle = client.submit(refresh_wf, {"doc": "d3", "n": n}, debounce=debounce)
        with lock:
            handles.append(handle)

    threads = [threading.Thread(target=submit, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({h.id for h in handles}) == 1
    assert sorted(h.created for h in handles) == [False] * 7 + [True]
    assert len(client.list_runs()) == 1


def test_debounce_refuses_a_workflow_that_does_not_start_with_steps(client: Client) -> None:
    with pytest.raises(InvalidArgument, match="debounce holds a run's first steps"):
        client.submit(
            per_tenant_wait,
            {"doc": "x"},
            debounce=Debounce(key="doc", delay=timedelta(seconds=1)),
        )
    assert client.list_runs() == []


@workflow(name="fc_wait_first")
def per_tenant_wait(job):  # type: ignore[no-untyped-def]
    return refresh(job, after=[wait_signal("go")])


@step(name="fc_quick_keyed", concurrency=Concurrency(key="tenant", limit=5))
def quick_keyed(job: dict[str, Any]) -> None:
    return None


def test_a_completed_step_no_longer_stands_in_its_queues_gates(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """Every gated claim walks its keys' gates in order: a completed step's gate left in the
    queue's index made each claim walk past all the completed steps of its keys (claims
    slowed as a backlog drained). Completion parks the gate itself, without the scanner."""
    handles = client.enqueue_many(quick_keyed, [{"tenant": f"t{i % 3}"} for i in range(60)])
    start_worker(quick_keyed, scanners=False)
    for handle in handles:
        handle.result(timeout=30)
    with psycopg.connect(cyclone_dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE queue <> ''), count(*) FROM cyclone_ext_gates"
        ).fetchone()
    assert row == (0, 60)


def test_bulk_submits_apply_limits_when_the_inputs_are_a_generator(client: Client) -> None:
    """The inputs were read twice (encoded, then keyed): a generator gave no second pass,
    and its runs were written without their limits."""
    client.enqueue_many(keyed, ({"tenant": f"s{i}", "n": i} for i in range(2)))
    client.submit_many(per_tenant, ({"tenant": f"w{i}", "n": i} for i in range(2)))
    keys = {r["key"] for r in client.stats()["limits"]}
    assert {"s0", "s1", "w0", "w1"} <= keys, keys


@pytest.mark.parametrize("inputs", ["abc", {"tenant": "t"}, 5, None], ids=repr)
def test_bulk_submits_refuse_inputs_that_are_not_a_collection_of_inputs(
    client: Client, inputs: object
) -> None:
    """A string or a dict is iterable: submit_many("abc") made three runs, of "a", "b", "c"."""
    with pytest.raises(InvalidArgument, match="inputs"):
        client.submit_many(per_tenant, inputs)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="inputs"):
        client.enqueue_many(keyed, inputs)  # type: ignore[arg-type]
    assert client.list_runs() == []


def test_why_waiting_of_a_run_that_does_not_exist_is_run_not_found(client: Client) -> None:
    """It answered {} (nothing holds it back) for a run purged or never submitted, where
    every other call about a run raises RunNotFound."""
    done = client.enqueue(keyed, {"tenant": "t-why"})
    assert client.why_waiting(done.id) == {}  # exists; its limit is free
    with pytest.raises(RunNotFound):
        client.why_waiting(done.id + 1000)
