"""Audit of flow control: concurrency slots of steps and of runs, rate units, queue caps and
what why_waiting and stats say, through failures, retries, timeouts, cancels, pauses,
deadlines, operator retries, forks, dead workers and deploys that change a limit."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from cyclone_dsl import (
    AsyncClient,
    Client,
    Concurrency,
    InvalidArgument,
    Permanent,
    RateLimit,
    Registry,
    RunFailed,
    RunState,
    StepContext,
    StepState,
    Worker,
    WorkflowDef,
    step,
    workflow,
)
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


class Board:
    """Per-test record of handler spans and named gates the test opens."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.gates: dict[str, threading.Event] = collections.defaultdict(threading.Event)
        self.spans: list[list[Any]] = []  # [name, start, end or None, ctx or None]
        self.calls: collections.Counter[str] = collections.Counter()
        # Per span: the spans open at its start whose step was still live (not yet told
        # ctx.cancelled), itself included.
        self.live_at_start: list[int] = []

    def gate(self, name: str) -> threading.Event:
        with self.lock:
            return self.gates[name]

    def enter(self, name: str, ctx: StepContext | None = None) -> list[Any]:
        span = [name, time.monotonic(), None, ctx]
        with self.lock:
            live = [s for s in self.spans if s[2] is None and not (s[3] and s[3].cancelled)]
            self.live_at_start.append(1 + len(live))
            self.spans.append(span)
            self.calls[name] += 1
        return span

    def leave(self, span: list[Any]) -> None:
        with self.lock:
            span[2] = time.monotonic()

    def started(self, name: str) -> int:
        with self.lock:
            return self.calls[name]

    def running(self) -> list[str]:
        with self.lock:
            return [s[0] for s in self.spans if s[2] is None]

    def peak_live(self) -> int:
        """The most handlers of live steps at one time: a handler told ``ctx.cancelled``
        (its step timed out, and may have freed its slot already) no longer counts, however
        long it takes to notice."""
        with self.lock:
            return max(self.live_at_start, default=0)

    def peak(self, prefix: str = "") -> int:
        """The most spans (of names starting with prefix) open at one time."""
        with self.lock:
            spans = [
                (s[1], s[2] or time.monotonic()) for s in self.spans if s[0].startswith(prefix)
            ]
        return max(
            (sum(1 for b, e in spans if b <= start < e) for start, _ in spans),
            default=0,
        )


board = Board()


@pytest.fixture(autouse=True)
def fresh_board() -> Any:
    global board
    board = Board()
    yield board
    for event in list(board.gates.values()):
        event.set()  # no handler is left blocked past its test


def _behave(job: dict[str, Any], ctx: StepContext | None = None) -> str:
    """What a handler does, from its input: fail on its first attempts, block on a gate."""
    name = str(job["name"])
    span = board.enter(name, ctx)
    try:
        if ctx is not None and ctx.attempt <= int(job.get("fail_first", 0)):
            raise RuntimeError(f"{name} fails attempt {ctx.attempt}")
        if job.get("permanent"):
            raise Permanent(f"{name} fails for good")
        if "fail_unless" in job and not board.gate(str(job["fail_unless"])).is_set():
            raise Permanent(f"{name} fails until {job['fail_unless']} is set")
        if "gate" in job:
            gate = board.gate(str(job["gate"]))
            if ctx is not None:
                while not gate.is_set() and not ctx.cancelled:
                    gate.wait(0.02)
            else:
                gate.wait(20)
        if "sleep" in job:
            time.sleep(float(job["sleep"]))
        return name
    finally:
        board.leave(span)


# -- step slots ----------------------------------------------------------------------------


@step(name="la_one", concurrency=Concurrency(key="tenant", limit=1), max_attempts=3)
def la_one(job: dict[str, Any], ctx: StepContext) -> str:
    return _behave(job, ctx)


@step(name="la_two", concurrency=Concurrency(key="tenant", limit=2), max_attempts=3)
def la_two(job: dict[str, Any], ctx: StepContext) -> str:
    return _behave(job, ctx)


def _state(handle: Any) -> StepState:
    return handle.get().steps[0].state


def test_a_retry_backoff_does_not_hold_the_slot(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A step that failed waits out its backoff without its slot: another step of its key
    runs meanwhile, and the retry waits for the slot like any step."""
    flaky = client.enqueue(la_one, {"tenant": "t", "name": "flaky", "fail_first": 1})
    start_worker(la_one, concurrency=4)
    wait_until(lambda: flaky.get().steps[0].attempt == 1, what="the first failure")
    other = client.enqueue(la_one, {"tenant": "t", "name": "other", "gate": "other"})
    wait_until(lambda: board.started("other"), timeout=5, what="the other step to start")
    assert board.started("flaky") == 1, "the retry ran before the other step"
    wait_until(
        lambda: (
            client.why_waiting(flaky.id).get("la_one") == "waiting for a concurrency slot (t: 1/1)"
        ),
        what="the retry to wait for the slot",
    )
    board.gate("other").set()
    assert other.result(timeout=10) == "other"
    assert flaky.result(timeout=10) == "flaky"
    assert board.peak() == 1


def test_a_retried_step_holds_one_slot_not_two(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Limit 2: a step that failed and is retried into another slot than its first one
    leaves the first one marked as its own (the holder is the step id, which runs again):
    it holds two slots, and a third step of its key waits while only one runs."""
    first = client.enqueue(la_two, {"tenant": "t", "name": "y", "gate": "y"})
    start_worker(la_two, concurrency=4)
    wait_until(lambda: board.started("y"), what="y to start")
    flaky = client.enqueue(la_two, {"tenant": "t", "name": "x", "fail_first": 1, "gate": "x"})
    wait_until(lambda: flaky.get().steps[0].attempt == 1, what="x to fail once")
    board.gate("y").set()
    assert first.result(timeout=10) == "y"
    wait_until(lambda: board.started("x") == 2, what="x to run again")
    later = client.enqueue(la_two, {"tenant": "t", "name": "w"})
    try:
        wait_until(
            lambda: later.get().state is RunState.COMPLETED,
            timeout=3,
            what=f"w to run beside x alone, not {client.why_waiting(later.id)}",
        )
    finally:
        board.gate("x").set()
    assert flaky.result(timeout=10) == "x"


@step(name="la_slow", concurrency=Concurrency(key="tenant", limit=1), timeout=0.3, max_attempts=1)
def la_slow(job: dict[str, Any], ctx: StepContext) -> str:
    return _behave(job, ctx)


def test_a_timed_out_step_frees_its_slot(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    slow = client.enqueue(la_slow, {"tenant": "t", "name": "slow", "gate": "never"})
    # Not its 0.3 s: quick has to return within its timeout, on a loaded machine too.
    quick = client.enqueue(la_slow, {"tenant": "t", "name": "quick"}, timeout=30)
    start_worker(la_slow, concurrency=4)
    with pytest.raises(RunFailed):
        slow.result(timeout=10)
    assert slow.get().steps[0].error_kind == "timeout"
    assert quick.result(timeout=10) == "quick"
    # The worker commits the timeout (freeing the slot), then tells the handler
    # (ctx.cancelled), which notices within 20 ms: quick may start before slow's handler
    # returns, never beside a step not yet timed out.
    assert board.peak_live() == 1


@workflow(name="la_one_wf")
def la_one_wf(job):  # type: ignore[no-untyped-def]
    return la_one(job)


def test_cancelling_a_run_frees_its_running_steps_slot(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    held = client.submit(la_one_wf, {"tenant": "t", "name": "held", "gate": "never"})
    start_worker(la_one_wf, concurrency=4)
    wait_until(lambda: board.started("held"), what="held to start")
    waiting = client.enqueue(la_one, {"tenant": "t", "name": "waiting"})
    wait_until(lambda: client.why_waiting(waiting.id), what="the second step to wait")
    client.cancel(held.id)
    assert waiting.result(timeout=10) == "waiting"
    assert held.get().state is RunState.CANCELLED


def test_a_run_failing_by_deadline_frees_its_running_steps_slot(
    client: Client,
    start_worker: Callable[..., Worker],
    clock: Callable[[datetime], None],
) -> None:
    # A deadline the claim cannot miss on a loaded machine (nothing starts in a run past
    # its deadline), passed by moving the clock once the step runs.
    held = client.submit(
        la_one_wf,
        {"tenant": "t", "name": "held", "gate": "never"},
        deadline=timedelta(hours=1),
    )
    start_worker(la_one_wf, concurrency=4)
    wait_until(lambda: board.started("held"), what="held to start")
    clock(datetime.now(UTC) + timedelta(hours=2))
    waiting = client.enqueue(la_one, {"tenant": "t", "name": "waiting"})
    assert waiting.result(timeout=10) == "waiting"
    assert held.wait(timeout=10).state is RunState.FAILED


# -- run slots -----------------------------------------------------------------------------


@step(name="la_work")
def la_work(job: dict[str, Any], ctx: StepContext) -> str:
    return _behave(job, ctx)


@step(name="la_tail")
def la_tail(name: str) -> str:
    return name


@workflow(name="la_runs", concurrency=Concurrency(key="tenant", limit=1))
def la_runs(job):  # type: ignore[no-untyped-def]
    return la_tail(la_work(job))


def _run_waits(client: Client, run_id: int) -> str:
    return client.why_waiting(run_id).get("la_work", "")


@pytest.mark.parametrize("ending", ["fail", "cancel", "deadline"])
def test_a_run_that_ends_gives_its_run_slot_to_the_next(
    client: Client,
    start_worker: Callable[..., Worker],
    ending: str,
    clock: Callable[[datetime], None],
) -> None:
    job: dict[str, Any] = {"tenant": "t", "name": "a", "gate": "a"}
    if ending == "fail":
        job["permanent"] = True
    # A deadline the claim cannot miss on a loaded machine (nothing starts in a run past
    # its deadline), passed by moving the clock once a runs.
    deadline = timedelta(hours=1) if ending == "deadline" else None
    first = client.submit(la_runs, job, deadline=deadline)
    second = client.submit(la_runs, {"tenant": "t", "name": "b"})
    start_worker(la_runs, concurrency=4)
    if ending != "fail":
        wait_until(lambda: board.started("a"), what="a to start")
        reason = _run_waits(client, second.id)
        assert reason == "waiting for a run slot of la_runs (t: 1/1 runs under way)"
    if ending == "cancel":
        client.cancel(first.id)
    if ending == "deadline":
        clock(datetime.now(UTC) + timedelta(hours=2))
    assert second.result(timeout=10) == "b"
    assert first.wait(timeout=10).state in (RunState.FAILED, RunState.CANCELLED)


def test_a_paused_run_keeps_its_run_slot(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    first = client.submit(la_runs, {"tenant": "t", "name": "a", "gate": "a"})
    second = client.submit(la_runs, {"tenant": "t", "name": "b"})
    start_worker(la_runs, concurrency=4)
    wait_until(lambda: board.started("a"), what="a to start")
    client.pause(first.id)
    board.gate("a").set()
    wait_until(lambda: first.get().step("la_work").state is StepState.COMPLETED, what="a's step")
    time.sleep(0.5)
    assert board.started("b") == 0, "a run started while a paused run held the only slot"
    assert "1/1 runs under way" in _run_waits(client, second.id)
    client.resume(first.id)
    assert first.result(timeout=10) == "a"
    assert second.result(timeout=10) == "b"


def test_an_operator_retry_of_a_failed_run_waits_for_a_slot(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A run that failed gave up its slot; retried while another run holds it, it waits."""
    first = client.submit(la_runs, {"tenant": "t", "name": "a", "fail_unless": "fix"})
    start_worker(la_runs, concurrency=4)
    assert first.wait(timeout=10).state is RunState.FAILED
    second = client.submit(la_runs, {"tenant": "t", "name": "b", "gate": "b"})
    wait_until(lambda: board.started("b"), what="b to start")
    board.gate("fix").set()
    client.retry(first.id, "la_work")
    wait_until(lambda: "1/1 runs under way" in _run_waits(client, first.id), what="a to wait")
    time.sleep(0.3)
    assert board.started("a") == 1, "the retried run started while another held the slot"
    board.gate("b").set()
    assert second.result(timeout=10) == "b"
    assert first.result(timeout=10) == "a"
    assert board.peak() == 1


def test_a_fork_waits_for_a_run_slot(client: Client, start_worker: Callable[..., Worker]) -> None:
    first = client.submit(la_runs, {"tenant": "t", "name": "a", "fail_unless": "fix"})
    start_worker(la_runs, concurrency=4)
    assert first.wait(timeout=10).state is RunState.FAILED
    second = client.submit(la_runs, {"tenant": "t", "name": "b", "gate": "b"})
    wait_until(lambda: board.started("b"), what="b to start")
    board.gate("fix").set()
    fork = client.fork(first.id, "la_work")
    wait_until(lambda: "1/1 runs under way" in _run_waits(client, fork.id), what="the fork")
    time.sleep(0.3)
    assert board.started("a") == 1, "the fork started while another run held the slot"
    board.gate("b").set()
    assert second.result(timeout=10) == "b"
    assert fork.result(timeout=10) == "a"
    assert board.peak() == 1


def _la_runs2(job):  # type: ignore[no-untyped-def]
    return la_tail(la_work(job))


la_runs2 = workflow(name="la_runs2", concurrency=Concurrency(key="tenant", limit=2))(_la_runs2)


def test_a_retry_after_a_lowered_run_limit_waits_for_the_new_limit(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    running = client.submit(la_runs2, {"tenant": "t", "name": "b", "gate": "b"})
    start_worker(la_runs2, concurrency=4)
    wait_until(lambda: board.started("b"), what="b to start")
    failed = client.submit(la_runs2, {"tenant": "t", "name": "a", "fail_unless": "fix"})
    assert failed.wait(timeout=10).state is RunState.FAILED
    lowered = WorkflowDef(_la_runs2, "la_runs2", concurrency=Concurrency(key="tenant", limit=1))
    registry = Registry()
    registry.add_workflow_tree(lowered)
    with Client(cyclone_dsn, registry=registry) as deploy_2:
        queued = deploy_2.submit("la_runs2", {"tenant": "t", "name": "c"})  # records limit 1
        wait_until(lambda: client.why_waiting(queued.id), what="c to wait")
        board.gate("fix").set()
        client.retry(failed.id, "la_work")
        time.sleep(0.8)
        try:
            assert board.started("a") == 1, "a retried run started beside b under a limit of 1"
        finally:
            board.gate("b").set()
        assert running.result(timeout=10) == "b"
        assert queued.result(timeout=10) == "c"
    assert failed.result(timeout=10) == "a"


@workflow(name="la_pair", concurrency=Concurrency(limit=2))
def la_pair(job):  # type: ignore[no-untyped-def]
    return la_tail(la_work(job))


def test_fifty_concurrent_submits_never_run_more_than_two_runs(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(la_pair, concurrency=10)
    barrier = threading.Barrier(10)
    handles: list[Any] = []
    lock = threading.Lock()

    def submit(t: int) -> None:
        barrier.wait()
        for n in range(5):
            handle = client.submit(la_pair, {"name": f"r{t}-{n}", "sleep": 0.02})
            with lock:
                handles.append(handle)

    threads = [threading.Thread(target=submit, args=(t,)) for t in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(handles) == 50
    for handle in handles:
        handle.result(timeout=30)
    assert board.peak() == 2


@step(name="la_pair_step", concurrency=Concurrency(limit=2))
def la_pair_step(job: dict[str, Any], ctx: StepContext) -> str:
    return _behave(job, ctx)


def test_fifty_concurrent_enqueues_never_run_more_than_two_steps(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(la_pair_step, concurrency=10)
    start_worker(la_pair_step, concurrency=10)
    barrier = threading.Barrier(10)
    handles: list[Any] = []
    lock = threading.Lock()

    def submit(t: int) -> None:
        barrier.wait()
        for n in range(5):
            handle = client.enqueue(la_pair_step, {"name": f"s{t}-{n}", "sleep": 0.02})
            with lock:
                handles.append(handle)

    threads = [threading.Thread(target=submit, args=(t,)) for t in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for handle in handles:
        handle.result(timeout=30)
    assert board.peak() == 2


# -- queue caps ----------------------------------------------------------------------------


@step(name="la_capped", queue="la_q", max_attempts=3)
def la_capped(job: dict[str, Any], ctx: StepContext) -> str:
    return _behave(job, ctx)


def test_a_retried_step_holds_one_queue_slot_not_two(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """The same with a queue cap of 2: y takes slot 1, x slot 2 and fails; y ends; x's retry
    takes slot 1 and still names slot 2; a third step waits while x alone runs."""
    client.set_queue_limit("la_q", 2)
    first = client.enqueue(la_capped, {"name": "y", "gate": "y"})
    start_worker(la_capped, queues=["la_q"], concurrency=4)
    wait_until(lambda: board.started("y"), what="y to start")
    flaky = client.enqueue(la_capped, {"name": "x", "fail_first": 1, "gate": "x"})
    wait_until(lambda: flaky.get().steps[0].attempt == 1, what="x to fail once")
    board.gate("y").set()
    assert first.result(timeout=10) == "y"
    wait_until(lambda: board.started("x") == 2, what="x to run again")
    later = client.enqueue(la_capped, {"name": "w"})
    try:
        wait_until(
            lambda: later.get().state is RunState.COMPLETED,
            timeout=3,
            what=f"w to run beside x alone, not {client.why_waiting(later.id)}",
        )
    finally:
        board.gate("x").set()
    assert flaky.result(timeout=10) == "x"


# -- rate units ----------------------------------------------------------------------------


@step(name="la_units", rate_limit=RateLimit(limit=3, per=timedelta(hours=1), units=2))
def la_units(job: dict[str, Any], ctx: StepContext) -> str:
    return _behave(job, ctx)


def test_a_step_short_of_units_says_why_it_waits(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(la_units)
    assert client.enqueue(la_units, {"name": "first"}).result(timeout=10) == "first"
    held = client.enqueue(la_units, {"name": "second"})
    time.sleep(0.6)
    assert board.started("second") == 0
    (row,) = [r for r in client.stats()["limits"] if r["scope"] == "rate:la_units"]
    assert (row["in_use"], row["waiting"]) == (2, 1)
    assert "rate limited until" in client.why_waiting(held.id).get("la_units", "")


# -- limit=None ----------------------------------------------------------------------------


@step(name="la_fair", concurrency=Concurrency(key="tenant", limit=None))
def la_fair(job: dict[str, Any], ctx: StepContext) -> str:
    return _behave(job, ctx)


def test_limit_none_caps_nothing(client: Client, start_worker: Callable[..., Worker]) -> None:
    handles = [
        client.enqueue(la_fair, {"tenant": "t", "name": f"f{n}", "gate": "f"}) for n in range(4)
    ]
    start_worker(la_fair, concurrency=8)
    wait_until(lambda: len(board.running()) == 4, what="all four at once")
    assert client.why_waiting(handles[0].id) == {}
    board.gate("f").set()
    assert [h.result(timeout=10) for h in handles] == [f"f{n}" for n in range(4)]


# -- keys ----------------------------------------------------------------------------------


def test_a_missing_key_refuses_the_submit_and_writes_nothing(client: Client) -> None:
    with pytest.raises(InvalidArgument, match="tenant"):
        client.submit(la_runs, {"name": "x"})
    with pytest.raises(InvalidArgument, match="tenant"):
        client.enqueue(la_one, {"name": "x"})
    with pytest.raises(InvalidArgument):
        client.submit_many(la_runs, [{"tenant": "t", "name": "ok"}, {"name": "bad"}])
    assert client.list_runs() == []
    assert client.stats()["limits"] == []


def test_the_async_client_refuses_a_missing_key_and_says_why_a_run_waits(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    async def main() -> None:
        async with AsyncClient(cyclone_dsn) as ac:
            with pytest.raises(InvalidArgument, match="tenant"):
                await ac.submit(la_runs, {"name": "x"})
            assert await ac.list_runs() == []
            first = await ac.submit(la_runs, {"tenant": "t", "name": "a", "gate": "a"})
            second = await ac.submit(la_runs, {"tenant": "t", "name": "b"})
            start_worker(la_runs, concurrency=4)
            await asyncio.to_thread(wait_until, lambda: board.started("a"), what="a to start")
            reasons = await ac.why_waiting(second.id)
            assert reasons == {
                "la_work": "waiting for a run slot of la_runs (t: 1/1 runs under way)"
            }
            stats = await ac.stats()
            (row,) = [r for r in stats["limits"] if r["scope"] == "run:la_runs"]
            assert (row["key"], row["in_use"], row["waiting"]) == ("t", 1, 1)
            board.gate("a").set()
            assert await first.result(timeout=10) == "a"
            assert await second.result(timeout=10) == "b"

    asyncio.run(main())


# -- a worker that dies --------------------------------------------------------------------


def _victim(dsn: str) -> subprocess.Popen[str]:
    code = (
        "import sys\n"
        "from cyclone_dsl import Worker\n"
        "from tests.integration import test_limits_audit as m\n"
        "Worker(sys.argv[1], [m.la_one], lease=1.0, poll_interval=0.1,\n"
        "       scan_interval=60, grace=30, concurrency=2).run()\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, dsn],
        cwd=ROOT,
        env={**os.environ},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def test_a_dead_workers_slot_comes_back_after_its_lease(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    held = client.enqueue(la_one, {"tenant": "t", "name": "held", "gate": "victim"})
    victim = _victim(cyclone_dsn)
    try:
        wait_until(lambda: _state(held) is StepState.RUNNING, timeout=30, what="the victim")
        waiting = client.enqueue(la_one, {"tenant": "t", "name": "waiting"})
        wait_until(
            lambda: (
                client.why_waiting(waiting.id).get("la_one")
                == "waiting for a concurrency slot (t: 1/1)"
            ),
            what="the second step to wait",
        )
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(10)
    board.gate("victim").set()
    start_worker(la_one, concurrency=4)
    assert waiting.result(timeout=15) == "waiting"
    assert held.result(timeout=15) == "held"
    assert held.get().steps[0].reclaims == 1
    assert board.peak() == 1


def test_why_waiting_names_a_full_queue_cap(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    client.set_queue_limit("la_q", 1)
    first = client.enqueue(la_capped, {"name": "y", "gate": "y"})
    second = client.enqueue(la_capped, {"name": "w"})
    start_worker(la_capped, queues=["la_q"], concurrency=4)
    wait_until(lambda: board.started("y"), what="y to start")
    (row,) = [r for r in client.stats()["limits"] if r["scope"] == "queue:la_q"]
    assert (row["in_use"], row["waiting"]) == (1, 1)
    try:
        assert client.why_waiting(second.id) == {
            "la_capped": "waiting for queue la_q (1/1 running: its cap)"
        }
    finally:
        board.gate("y").set()
    assert first.result(timeout=10) == "y"
    assert second.result(timeout=10) == "w"
