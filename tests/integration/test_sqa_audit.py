"""Audit of the ordering and uniqueness promises of standalone work, as a demanding user.

``enqueue(..., sequence_key=)`` (one at a time per key, in (``scheduled_at``, id) order),
``unique_key`` (at most one active step per (kind, key)), ``priority`` and ``scheduled_at``,
and how they hold up under retries and their backoff, pause, cancel, timeouts, a worker
killed mid-step, several workers claiming at once and concurrent enqueuers.

The handlers record, under a lock, when each execution starts and ends, per key: the tests
assert exact invariants on that record (never two executions of one key at once, the order
of starts), and read the outcome of each step through the public API.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from cyclone_dsl import Client, RunHandle, RunState, StepContext, StepState, Worker, action
from tests.integration import sqa_handlers
from tests.waiting import wait_until

StartWorker = Callable[..., Worker]
Clock = Callable[[datetime], None]
REPO = Path(__file__).resolve().parents[2]


class Recorder:
    """Starts and ends of handler executions, per key, in the order they happened."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, str, int, str]] = []  # (key, label, attempt, start|end)
        self.active: dict[str, int] = {}
        self.max_active: dict[str, int] = {}
        self.max_total = 0

    def reset(self) -> None:
        with self.lock:
            self.events.clear()
            self.active.clear()
            self.max_active.clear()
            self.max_total = 0

    @contextmanager
    def running(self, key: str, label: str, attempt: int = 1) -> Iterator[None]:
        with self.lock:
            self.events.append((key, label, attempt, "start"))
            self.active[key] = self.active.get(key, 0) + 1
            self.max_active[key] = max(self.max_active.get(key, 0), self.active[key])
            self.max_total = max(self.max_total, sum(self.active.values()))
        try:
            yield
        finally:
            with self.lock:
                self.active[key] -= 1
                self.events.append((key, label, attempt, "end"))

    def starts(self, key: str) -> list[str]:
        with self.lock:
            return [label for k, label, _, what in self.events if k == key and what == "start"]

    def runs(self, key: str) -> list[tuple[str, int]]:
        """(label, attempt) of each execution of ``key``, in the order they started."""
        with self.lock:
            return [(lb, a) for k, lb, a, what in self.events if k == key and what == "start"]

    def ended(self, key: str) -> list[str]:
        with self.lock:
            return [label for k, label, _, what in self.events if k == key and what == "end"]

    def assert_one_at_a_time(self, key: str) -> None:
        """Each execution of ``key`` ended before the next one started."""
        with self.lock:
            trail = [(label, what) for k, label, _, what in self.events if k == key]
        assert self.max_active.get(key, 0) <= 1, f"{key}: executions overlapped: {trail}"
        for i, (_, what) in enumerate(trail):
            assert what == ("start" if i % 2 == 0 else "end"), f"{key}: overlap in {trail}"


rec = Recorder()
#: label -> event a handler of that label waits for before going on.
gates: dict[str, threading.Event] = {}
#: label -> called once by sqa_seq just before its attempt raises.
before_fail: dict[str, Callable[[], None]] = {}


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    rec.reset()
    gates.clear()
    before_fail.clear()
    with sqa_handlers.events_lock:
        sqa_handlers.events.clear()
    yield
    for gate in list(gates.values()):
        gate.set()  # never leave a handler blocked for the worker's shutdown


def _gate(label: str) -> None:
    gate = gates.get(label)
    if gate is not None:
        assert gate.wait(20), f"gate {label} never opened"


@action(name="sqa_seq", max_attempts=3)
def seq(x: dict[str, Any], ctx: StepContext) -> None:
    """Records its execution under key x["k"]; fails its first x["fail"] attempts."""
    key, label = str(x["k"]), str(x["n"])
    with rec.running(key, label, ctx.attempt):
        _gate(label)
        time.sleep(0.02)
        if ctx.attempt <= int(x.get("fail", 0)):
            hook = before_fail.pop(label, None)
            if hook is not None:
                hook()
            raise RuntimeError(f"sqa_seq {label} attempt {ctx.attempt} fails")


@action(name="sqa_seq_other", queue="sqa_other")
def seq_other(x: dict[str, Any]) -> None:
    """Another kind, in another queue, recording under the same keys as sqa_seq."""
    with rec.running(str(x["k"]), str(x["n"])):
        time.sleep(0.02)


@action(name="sqa_coop")
def coop(x: dict[str, Any], ctx: StepContext) -> None:
    """Blocks until its run is cancelled (a cooperative long handler)."""
    with rec.running(str(x["k"]), str(x["n"])):
        ctx.wait_cancelled(20)


@action(name="sqa_async_slow", max_attempts=1)
async def async_slow(x: dict[str, Any]) -> None:
    """Never finishes in time: its timeout cancels it at its await."""
    with rec.running(str(x["k"]), str(x["n"])):
        await asyncio.sleep(20)


@action(name="sqa_stuck", max_attempts=1)
def stuck(x: dict[str, Any]) -> None:
    """A sync handler that outlives its timeout (it cannot be interrupted)."""
    with rec.running(str(x["k"]), str(x["n"])):
        time.sleep(float(x["s"]))


@action(name="sqa_prio", queue="sqa_prio")
def prio(x: dict[str, Any]) -> None:
    label = str(x["n"])
    with rec.running("prio", label):
        _gate(label)


@action(name="sqa_uniq")
def uniq(x: dict[str, Any]) -> None:
    with rec.running(str(x["k"]), str(x["n"])):
        time.sleep(0.03)


@action(name="sqa_uniq_flaky", max_attempts=2)
def uniq_flaky(x: dict[str, Any], ctx: StepContext) -> None:
    """Fails every attempt; the first waits for gate "uniq" and calls before_fail["uniq"]."""
    with rec.running(str(x["k"]), "holder", ctx.attempt):
        if ctx.attempt == 1:
            _gate("uniq")
            hook = before_fail.pop("uniq", None)
            if hook is not None:
                hook()
        raise RuntimeError("sqa_uniq_flaky always fails")


def _item(key: str, label: str, **more: Any) -> dict[str, Any]:
    return {"k": key, "n": label, **more}


def _step_state(client: Client, handle: RunHandle) -> tuple[StepState, int]:
    (s,) = client.get_run(handle.id).steps
    return s.state, s.attempt


def _all_ended(client: Client, handles: list[RunHandle], timeout: float = 30) -> None:
    for h in handles:
        h.wait(timeout=timeout)


def _shift_clock_by(clock: Clock, seconds: float) -> Callable[[], None]:
    return lambda: clock(datetime.now(UTC) + timedelta(seconds=seconds))


# -- sequence keys: one at a time, in order ---------------------------------------------------


def test_sqa_sequence_keys_never_overlap_and_keep_fifo_under_three_workers(
    client: Client, start_worker: StartWorker
) -> None:
    keys = ("s1", "s2", "s3")
    handles = [
        client.enqueue(seq, _item(key, f"{key}-{n}"), sequence_key=key)
        for n in range(8)
        for key in keys
    ]
    for _ in range(3):
        start_worker(seq, concurrency=4)
    _all_ended(client, handles)
    assert {h.get().state for h in handles} == {RunState.COMPLETED}
    for key in keys:
        rec.assert_one_at_a_time(key)
        assert rec.starts(key) == [f"{key}-{n}" for n in range(8)]
    # The keys are independent: the steps of different keys did run side by side.
    assert rec.max_total >= 2


def test_sqa_a_sequence_key_spans_kinds_and_queues(
    client: Client, start_worker: StartWorker
) -> None:
    """ "Steps of one key run one at a time": whatever their kind or queue (unlike a unique
    key, which is per kind)."""
    handles = []
    for n in range(6):
        target = seq if n % 2 == 0 else seq_other
        handles.append(client.enqueue(target, _item("mixed", f"m{n}"), sequence_key="mixed"))
    start_worker(seq, concurrency=4)
    start_worker(seq_other, queues=["sqa_other"], concurrency=4)
    _all_ended(client, handles)
    rec.assert_one_at_a_time("mixed")
    assert rec.starts("mixed") == [f"m{n}" for n in range(6)]


def test_sqa_scheduled_at_decides_the_order_within_a_sequence(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    """(scheduled_at, id) order: a step due later does not hold back the steps of its key
    due before it, whenever they were enqueued; one enqueued later with an earlier start
    goes first."""
    now = datetime.now(UTC)
    gates["b"] = threading.Event()
    a = client.enqueue(
        seq, _item("t", "a"), sequence_key="t", scheduled_at=now + timedelta(hours=1)
    )
    client.enqueue(seq, _item("t", "b"), sequence_key="t")
    c = client.enqueue(
        seq, _item("t", "c"), sequence_key="t", scheduled_at=now + timedelta(hours=2)
    )
    d = client.enqueue(seq, _item("t", "d"), sequence_key="t")
    start_worker(seq, concurrency=4)
    wait_until(lambda: rec.starts("t") == ["b"], timeout=15, what="b started")
    # While b runs: e, enqueued last but due an hour ago, is ahead of d.
    e = client.enqueue(
        seq, _item("t", "e"), sequence_key="t", scheduled_at=now - timedelta(hours=1)
    )
    gates["b"].set()
    d.wait(timeout=15)
    e.wait(timeout=15)
    assert rec.starts("t") == ["b", "e", "d"]
    assert _step_state(client, a) == (StepState.AVAILABLE, 0)
    assert _step_state(client, c) == (StepState.AVAILABLE, 0)
    clock(now + timedelta(hours=1, minutes=30))
    assert a.wait(timeout=15).state is RunState.COMPLETED
    assert _step_state(client, c) == (StepState.AVAILABLE, 0)
    clock(now + timedelta(hours=2, minutes=30))
    assert c.wait(timeout=15).state is RunState.COMPLETED
    assert rec.starts("t") == ["b", "e", "d", "a", "c"]
    rec.assert_one_at_a_time("t")


# -- sequence keys and failures ------------------------------------------------------------------


def test_sqa_a_head_in_backoff_is_overtaken_and_never_overlaps(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    """Documented: "a step in a retry backoff can be overtaken by a later one". The head's
    first attempt fails while the database clock is 10 s ahead, so its backoff ends ~10 s
    after the clock is put back: the later steps run meanwhile, then the head, alone."""
    before_fail["a"] = _shift_clock_by(clock, 10)
    a = client.enqueue(seq, _item("r", "a", fail=1), sequence_key="r")
    b = client.enqueue(seq, _item("r", "b"), sequence_key="r")
    c = client.enqueue(seq, _item("r", "c"), sequence_key="r")
    start_worker(seq, concurrency=4)
    wait_until(lambda: _step_state(client, a) == (StepState.AVAILABLE, 1), what="a in backoff")
    clock(datetime.now(UTC))
    b.wait(timeout=15)
    c.wait(timeout=15)
    assert _step_state(client, a) == (StepState.AVAILABLE, 1), "a waits out its backoff"
    clock(datetime.now(UTC) + timedelta(seconds=20))
    assert a.wait(timeout=15).state is RunState.COMPLETED
    assert rec.runs("r") == [("a", 1), ("b", 1), ("c", 1), ("a", 2)]
    rec.assert_one_at_a_time("r")


def test_sqa_retries_under_several_workers_never_overlap_a_key(
    client: Client, start_worker: StartWorker
) -> None:
    """Steps that fail once, in backoff, come back into the order of their key: whichever
    order results, two executions of one key never overlap, and every step completes."""
    rnd = random.Random(7)
    handles = [
        client.enqueue(
            seq, _item(key, f"{key}-{n}", fail=int(rnd.random() < 0.3)), sequence_key=key
        )
        for n in range(6)
        for key in ("f1", "f2")
    ]
    for _ in range(2):
        start_worker(seq, concurrency=4)
    _all_ended(client, handles)
    assert {h.get().state for h in handles} == {RunState.COMPLETED}
    for key in ("f1", "f2"):
        rec.assert_one_at_a_time(key)
        # First attempts kept the enqueue order; only retries came back later.
        firsts = [lb for lb, attempt in rec.runs(key) if attempt == 1]
        assert firsts == [f"{key}-{n}" for n in range(6)]


@pytest.mark.parametrize("how", ["error", "timeout"])
def test_sqa_a_head_that_fails_for_good_lets_the_rest_run_in_order(
    client: Client, start_worker: StartWorker, how: str
) -> None:
    if how == "error":
        head = client.enqueue(seq, _item("g", "head", fail=9), sequence_key="g", max_attempts=1)
    else:
        head = client.enqueue(
            async_slow, _item("g", "head"), sequence_key="g", timeout=timedelta(seconds=1)
        )
    rest = [client.enqueue(seq, _item("g", f"r{n}"), sequence_key="g") for n in range(3)]
    start_worker(seq, async_slow, concurrency=4)
    run = head.wait(timeout=20)
    assert run.state is RunState.FAILED
    (s,) = run.steps
    assert (s.state, s.error_kind) == (StepState.DISCARDED, how)
    _all_ended(client, rest)
    assert {h.get().state for h in rest} == {RunState.COMPLETED}
    assert rec.starts("g") == ["head", "r0", "r1", "r2"]
    rec.assert_one_at_a_time("g")


def test_sqa_a_timed_out_head_holds_its_key_until_its_timeout(
    client: Client, start_worker: StartWorker
) -> None:
    """The head holds the key while it runs, up to its timeout: the next step does not
    start before the head's timeout failed it."""
    head = client.enqueue(
        stuck, _item("to", "head", s=2.5), sequence_key="to", timeout=timedelta(seconds=1)
    )
    nxt = client.enqueue(seq, _item("to", "next"), sequence_key="to")
    start_worker(seq, stuck, concurrency=4)
    nxt.wait(timeout=20)
    (s,) = head.get().steps
    assert (s.state, s.error_kind) == (StepState.DISCARDED, "timeout")
    (n,) = nxt.get().steps
    assert s.completed_at is not None and n.started_at is not None
    assert n.started_at >= s.completed_at
    assert rec.starts("to") == ["head", "next"]


def test_sqa_a_timed_out_head_frees_its_key_at_its_timeout(
    client: Client, start_worker: StartWorker
) -> None:
    """runs-and-steps.md: a step that fails by its timeout frees its key at once, even
    while a sync handler that ignores ``ctx.cancelled`` still runs (it cannot be
    stopped): the next step starts then, not before, and not once the thread returns."""
    head = client.enqueue(
        stuck, _item("zz", "head", s=2.5), sequence_key="zz", timeout=timedelta(seconds=1)
    )
    nxt = client.enqueue(seq, _item("zz", "next"), sequence_key="zz")
    start_worker(seq, stuck, concurrency=4)
    assert nxt.wait(timeout=20).state is RunState.COMPLETED
    assert head.wait(timeout=20).state is RunState.FAILED
    assert head.get().steps[0].error_kind == "timeout"
    assert rec.starts("zz") == ["head", "next"]
    assert rec.ended("zz")[0] == "next", "the next step waited for the stuck thread"
    wait_until(lambda: len(rec.ended("zz")) == 2, what="the stuck handler to return")


# -- sequence keys, cancel and pause ------------------------------------------------------------


def test_sqa_cancelling_the_running_head_lets_the_rest_run_in_order(
    client: Client, start_worker: StartWorker
) -> None:
    head = client.enqueue(coop, _item("c", "head"), sequence_key="c")
    rest = [client.enqueue(seq, _item("c", f"r{n}"), sequence_key="c") for n in range(3)]
    start_worker(seq, coop, concurrency=4)
    wait_until(lambda: rec.starts("c") == ["head"], what="the head running")
    time.sleep(0.5)
    assert rec.starts("c") == ["head"], "the running head holds back the rest"
    client.cancel(head.id)
    _all_ended(client, rest)
    assert head.get().state is RunState.CANCELLED
    assert {h.get().state for h in rest} == {RunState.COMPLETED}
    assert rec.starts("c") == ["head", "r0", "r1", "r2"]
    wait_until(lambda: len(rec.ended("c")) == 4, what="the cancelled head returned")


@pytest.mark.parametrize("which", ["paused head", "waiting middle"])
def test_sqa_cancelling_a_waiting_step_of_a_sequence_lets_the_rest_run(
    client: Client, start_worker: StartWorker, which: str
) -> None:
    handles = [client.enqueue(seq, _item("w", f"s{n}"), sequence_key="w") for n in range(4)]
    victim = handles[0] if which == "paused head" else handles[1]
    if which == "paused head":
        client.pause(victim.id)
    else:
        gates["s0"] = threading.Event()
    start_worker(seq, concurrency=4)
    if which == "paused head":
        time.sleep(0.6)
        assert rec.starts("w") == [], "a paused head holds back its sequence"
    else:
        wait_until(lambda: rec.starts("w") == ["s0"], what="s0 running")
    client.cancel(victim.id)
    gates.get("s0", threading.Event()).set()
    others = [h for h in handles if h is not victim]
    _all_ended(client, others)
    assert victim.get().state is RunState.CANCELLED
    assert {h.get().state for h in others} == {RunState.COMPLETED}
    expected = ["s1", "s2", "s3"] if which == "paused head" else ["s0", "s2", "s3"]
    assert rec.starts("w") == expected
    rec.assert_one_at_a_time("w")


def test_sqa_pausing_a_head_in_backoff_keeps_the_key_order_after_resume(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    """A step waiting out a backoff that is paused and resumed keeps its start time: the
    steps of its key due before run, it runs when due, alone."""
    before_fail["a"] = _shift_clock_by(clock, 10)
    a = client.enqueue(seq, _item("pb", "a", fail=1), sequence_key="pb")
    b = client.enqueue(seq, _item("pb", "b"), sequence_key="pb")
    gates["b"] = threading.Event()
    start_worker(seq, concurrency=4)
    wait_until(lambda: _step_state(client, a)[1] == 1, what="a failed once")
    clock(datetime.now(UTC))
    client.pause(a.id)
    wait_until(lambda: rec.starts("pb") == ["a", "b"], what="b overtook a")
    client.resume(a.id)
    gates["b"].set()
    b.wait(timeout=15)
    assert _step_state(client, a) == (StepState.AVAILABLE, 1)
    clock(datetime.now(UTC) + timedelta(seconds=20))
    assert a.wait(timeout=15).state is RunState.COMPLETED
    assert rec.runs("pb") == [("a", 1), ("b", 1), ("a", 2)]
    rec.assert_one_at_a_time("pb")


# -- a worker killed mid-step --------------------------------------------------------------------


def test_sqa_a_sigkilled_head_keeps_the_key_and_its_place(
    client: Client, start_worker: StartWorker, cyclone_dsn: str
) -> None:
    """The head's worker is killed: the step stays running (holding its key) until its
    lease expires, is reclaimed (attempt unchanged) and runs first, then the rest."""
    handles = [
        client.enqueue(sqa_handlers.proc_seq, {"n": f"k{n}"}, sequence_key="kill") for n in range(3)
    ]
    code = (
        "import sys\n"
        "from cyclone_dsl import Worker\n"
        "from tests.integration import sqa_handlers\n"
        "Worker(sys.argv[1], [sqa_handlers], lease=1.0, poll_interval=0.1, scan_interval=0.2,"
        " concurrency=4).run()\n"
    )
    victim = subprocess.Popen(
        [sys.executable, "-c", code, cyclone_dsn],
        cwd=REPO,
        env={**os.environ, "SQA_CHILD": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(
            lambda: _step_state(client, handles[0])[0] is StepState.RUNNING,
            timeout=30,
            what="the victim runs the head",
        )
        time.sleep(0.5)  # the victim had time to claim more, were it allowed to
        states = [_step_state(client, h)[0] for h in handles]
        assert states == [StepState.RUNNING, StepState.AVAILABLE, StepState.AVAILABLE]
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
    start_worker(sqa_handlers, lease=5.0, concurrency=4)
    _all_ended(client, handles)
    assert {h.get().state for h in handles} == {RunState.COMPLETED}
    (head,) = handles[0].get().steps
    assert (head.reclaims, head.attempt) == (1, 0)
    with sqa_handlers.events_lock:
        events = list(sqa_handlers.events)
    assert events == [(f"k{n}", what) for n in range(3) for what in ("start", "end")]


# -- unique keys -----------------------------------------------------------------------------------


def _race(dsn: str, call: Callable[[Client], RunHandle], racers: int = 10) -> list[RunHandle]:
    barrier = threading.Barrier(racers)
    results: list[RunHandle] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one() -> None:
        try:
            with Client(dsn, pool_size=1) as c:
                barrier.wait(10)
                handle = call(c)
            with lock:
                results.append(handle)
        except BaseException as exc:  # reported below
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert len(results) == racers
    return results


def test_sqa_unique_key_ten_racers_across_the_holders_lifecycle(
    client: Client, start_worker: StartWorker, cyclone_dsn: str, clock: Clock
) -> None:
    """Ten concurrent enqueuers of one unique key: one holder is made; while it runs and
    while it waits out a backoff they all get it; once it failed for good, exactly one new
    holder is made."""

    def enqueue(c: Client) -> RunHandle:
        return c.enqueue(uniq_flaky, {"k": "u"}, unique_key="u")

    first = _race(cyclone_dsn, enqueue)
    assert sum(h.created for h in first) == 1 and len({h.id for h in first}) == 1
    holder = first[0].id

    gates["uniq"] = threading.Event()
    before_fail["uniq"] = _shift_clock_by(clock, 10)
    start_worker(uniq_flaky, concurrency=4)
    wait_until(lambda: rec.starts("u") == ["holder"], what="the holder running")
    running = _race(cyclone_dsn, enqueue)
    assert {(h.id, h.created) for h in running} == {(holder, False)}

    gates["uniq"].set()
    wait_until(lambda: _step_state(client, client.handle(holder))[1] == 1, what="backoff")
    clock(datetime.now(UTC))
    assert _step_state(client, client.handle(holder)) == (StepState.AVAILABLE, 1)
    in_backoff = _race(cyclone_dsn, enqueue)
    assert {(h.id, h.created) for h in in_backoff} == {(holder, False)}

    clock(datetime.now(UTC) + timedelta(seconds=20))
    assert client.handle(holder).wait(timeout=15).state is RunState.FAILED
    after = _race(cyclone_dsn, enqueue)
    assert sum(h.created for h in after) == 1
    assert len({h.id for h in after}) == 1 and after[0].id != holder


def test_sqa_unique_key_never_has_two_running_holders_under_ten_enqueuers(
    client: Client, start_worker: StartWorker, cyclone_dsn: str
) -> None:
    """Ten threads enqueue two unique keys over and over while a worker with spare slots
    drains them: never two executions of one key at once, each created step ran once, and
    a duplicate always named an active holder or one that had just ended."""
    start_worker(uniq, concurrency=6)
    created: dict[str, list[int]] = {"u1": [], "u2": []}
    lock = threading.Lock()
    stop = time.monotonic() + 2.0
    errors: list[BaseException] = []

    def enqueuer(n: int) -> None:
        try:
            with Client(cyclone_dsn, pool_size=1) as c:
                i = 0
                while time.monotonic() < stop:
                    key = ("u1", "u2")[(n + i) % 2]
                    i += 1
                    h = c.enqueue(uniq, {"k": key, "n": f"{n}-{i}"}, unique_key=key)
                    if h.created:
                        with lock:
                            created[key].append(h.id)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=enqueuer, args=(n,)) for n in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    for key in ("u1", "u2"):
        ids = created[key]
        assert len(ids) >= 2, "the key was taken again after each holder completed"
        _all_ended(client, [client.handle(i) for i in ids])
        rec.assert_one_at_a_time(key)
        assert len(rec.starts(key)) == len(ids), "each created holder ran exactly once"
        # The holders' executions, as the database saw them, do not overlap either.
        spans = sorted((s.started_at, s.completed_at) for i in ids for s in client.get_run(i).steps)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end is not None and start is not None and end <= start


# -- priorities --------------------------------------------------------------------------------


def test_sqa_priorities_drain_in_order_with_one_slot(
    client: Client, start_worker: StartWorker
) -> None:
    rnd = random.Random(11)
    handles: list[RunHandle] = []
    for n in range(16):
        handles.append(client.enqueue(prio, {"n": f"e{n}"}, priority=rnd.randint(-3, 3)))
    handles += client.enqueue_many(prio, [{"n": f"m{n}"} for n in range(5)], priority=2)
    handles += client.enqueue_many(prio, [{"n": f"l{n}"} for n in range(5)], priority=-5)
    handles += client.enqueue_many(prio, [{"n": f"h{n}"} for n in range(3)], priority=10**6)
    start_worker(prio, queues=["sqa_prio"], concurrency=1)
    _all_ended(client, handles)
    steps = {}
    for h in handles:
        (s,) = h.get().steps
        assert s.state is StepState.COMPLETED
        steps[str((s.input or {})["n"])] = s  # type: ignore[index,call-overload]
    order = rec.starts("prio")
    assert sorted(order) == sorted(steps)
    ranks = [(-steps[n].priority, steps[n].scheduled_at) for n in order]
    assert ranks == sorted(ranks), f"claimed out of (priority, scheduled_at) order: {order}"
    rec.assert_one_at_a_time("prio")


def test_sqa_a_late_high_priority_step_jumps_the_queue_and_a_future_one_waits(
    client: Client, start_worker: StartWorker, clock: Clock
) -> None:
    low = [client.enqueue(prio, {"n": f"low{n}"}) for n in range(3)]
    gates["low0"] = threading.Event()
    start_worker(prio, queues=["sqa_prio"], concurrency=1)
    wait_until(lambda: rec.starts("prio") == ["low0"], what="low0 running")
    later = datetime.now(UTC) + timedelta(hours=1)
    future = client.enqueue(prio, {"n": "future"}, priority=100, scheduled_at=later)
    urgent = client.enqueue(prio, {"n": "urgent"}, priority=50)
    gates["low0"].set()
    _all_ended(client, [*low, urgent])
    assert rec.starts("prio") == ["low0", "urgent", "low1", "low2"]
    assert _step_state(client, future) == (StepState.AVAILABLE, 0)
    clock(later + timedelta(minutes=1))
    assert future.wait(timeout=15).state is RunState.COMPLETED
