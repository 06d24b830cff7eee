"""Audit (property): wake-ups under flow control, for any mix of standalone work.

Two workers poll once a minute (``LONG_POLL``), so every start must come from a wake-up
(``NOTIFY``). Hypothesis draws standalone steps (a kind under ``Concurrency(key="tenant",
limit=1)`` and a plain kind; three queues; some with a ``sequence_key``; some that fail for
good, some that hold until released) and operations applied between the enqueues (release
a held step, cancel a run, cap a queue with ``set_queue_limit``, remove a cap). After every
action a model of the documented obstacles (a limit's slot, a sequence's earlier steps, a
queue's cap, a worker's free threads) says which waiting steps nothing holds back: each must
start within ``STALL`` seconds, and every started step nothing holds must end. At the end
every obstacle is removed, one at a time; then:

- every run ends within ``BOUND`` seconds of the last removal, in the state its step asked
  for (cancelled, failed, completed);
- at no time do more than ``limit`` steps of one kind and key run at once (a cancelled
  step's handler may outlive the cancel: "a step cancelled while its handler runs frees its
  slot at the cancel", so its time counts until the cancel);
- steps of one ``sequence_key`` never overlap and start in enqueue order.

How the examples stay clear of the scanner and of the known gaps:

- The scanner's due pass wakes the queues of steps that came due in about the last second,
  which would hide a missing wake-up: the steps are enqueued with a ``scheduled_at`` long
  past (in their order). The scanner runs every 0.2 s: it parks the gates of failed and
  cancelled steps, which claims would otherwise walk past.
- The steps between two operations are enqueued in one transaction, and every action waits
  until nothing moves: no step is enqueued while a step of its sequence completes (in the
  same queue it is woken, test_sequence_wakes.py's ``..._end_commits_starts``; in another
  queue it can wait for a poll).
- A tenant's steps are claimed by one worker only: two claimers at once can still skip
  a step whose free slot the other's statement locked for a step it could not take (one
  waiting for another slot too); a full claim that leaves work behind wakes the queue
  (``test_wpa_a_step_skipped_while_another_claimer_...``), a claim that took nothing
  does not.

The tests after the property are its findings, fixed, kept as regressions (the fourth,
a sequence step enqueued while its predecessor's end commits, is in test_sequence_wakes.py).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cyclone_dsl import (
    AlreadyTerminal,
    Client,
    Concurrency,
    Permanent,
    RunHandle,
    RunState,
    StepContext,
    Worker,
    step,
)
from cyclone_dsl.db.tx import ConnectionTx
from cyclone_dsl.engine import Engine
from cyclone_dsl.testing.failpoints import arm, disarm
from tests.waiting import LONG_POLL, PROMPT, HoldFirst, wait_idle, wait_until

# NOTIFY is database-wide: queue names of this process only.
QUEUES = [f"wpa_q{n}_{os.getpid()}" for n in range(3)]
#: How long a step that nothing holds back may take to start (lost: a 60 s poll).
STALL = 5.0
#: How long every run may take to end once its last obstacle is gone ("a few seconds": a
#: removed cap is read by the workers within 5 s).
BOUND = 10.0
#: The regressions below: how long a step may take to start once it can (a poll: 60 s).
SOON = 3.0
#: The steps' scheduled_at: long due, each a second after the one before (their order).
PAST = datetime.now(UTC) - timedelta(hours=1)

lock = threading.Lock()
#: (example, step index) -> [start, end] (monotonic; end None while the handler runs).
spans: dict[tuple[int, int], list[float | None]] = {}
gates: dict[tuple[int, int], threading.Event] = {}
timings: list[str] = []


def _gate(ex: int, i: int) -> threading.Event:
    with lock:
        return gates.setdefault((ex, i), threading.Event())


def _behave(job: dict[str, Any], ctx: StepContext) -> str:
    ex, i = int(job["ex"]), int(job["i"])
    with lock:
        spans[(ex, i)] = [time.monotonic(), None]
    try:
        if job["hold"]:
            gate = _gate(ex, i)
            while not gate.wait(0.02):
                if ctx.cancelled:  # as the docs advise: a long handler checks it
                    raise RuntimeError("stopped")
        if job["fail"]:
            raise Permanent(f"step {i} fails")
        return f"done {i}"
    finally:
        with lock:
            spans[(ex, i)][1] = time.monotonic()


@step(name="wpa_one", concurrency=Concurrency(key="tenant", limit=1), max_attempts=1)
def wpa_one(job: dict[str, Any], ctx: StepContext) -> str:
    return _behave(job, ctx)


@step(name="wpa_two", concurrency=Concurrency(key="tenant", limit=2), max_attempts=1)
def wpa_two(job: dict[str, Any], ctx: StepContext) -> str:
    return _behave(job, ctx)


@step(name="wpa_plain", max_attempts=1)
def wpa_plain(job: dict[str, Any], ctx: StepContext) -> str:
    return _behave(job, ctx)


KINDS = {"one": (wpa_one, 1), "two": (wpa_two, 2), "plain": (wpa_plain, None)}
#: Worker 0 serves queues 0 and 1 with 3 threads, worker 1 queue 2 with 2.
SERVES = [([0, 1], 3), ([2], 2)]


@dataclass(frozen=True)
class Spec:
    kind: str
    key: int
    queue: int
    seq: int | None
    hold: bool
    fail: bool


@dataclass
class Example:
    ex: int
    specs: list[Spec]
    handles: list[RunHandle] = field(default_factory=list)
    cancelled_at: dict[int, float] = field(default_factory=dict)
    caps: dict[int, int] = field(default_factory=dict)
    unsure: set[int] = field(default_factory=set)  # queues whose cap changed: read in 5 s
    log: list[str] = field(default_factory=list)


SPECS = st.lists(
    st.builds(
        Spec,
        kind=st.sampled_from(["one", "plain"]),
        key=st.integers(0, 2),
        queue=st.integers(0, 2),
        seq=st.one_of(st.none(), st.integers(0, 1)),
        hold=st.booleans(),
        fail=st.integers(0, 3).map(lambda n: n == 0),
    ),
    min_size=6,
    max_size=12,
)
#: (after how many enqueues, operation, argument, cap)
OPS = st.lists(
    st.tuples(
        st.integers(0, 12),
        st.sampled_from(["release", "release", "cancel", "cap", "uncap"]),
        st.integers(0, 11),
        st.integers(1, 2),
    ),
    max_size=6,
)


@pytest.fixture
def workers(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> Iterator[list[Worker]]:
    """Started once for all the examples; everything held is released before they stop."""
    kinds = [kind for kind, _ in KINDS.values()]
    started = [
        start_worker(
            *kinds,
            queues=[QUEUES[q] for q in queues],
            concurrency=threads,
            poll_interval=LONG_POLL,
            scan_interval=0.2,
            max_reclaims=0,
            grace=0.5,
        )
        for queues, threads in SERVES
    ]
    for worker in started:
        wait_idle(cyclone_dsn, worker, listeners=len(started))
    yield started
    with lock:
        for event in gates.values():
            event.set()
    for q in QUEUES:
        client.set_queue_limit(q, None)
    print("\n".join(timings))


def _running(worker: Worker) -> int:
    return int(worker._thread_lane.running)


def _has_room(worker: Worker) -> bool:
    lane = worker._thread_lane
    return int(lane.running) < int(lane.slots.limit)


def _slot(s: Spec) -> tuple[str, int, bool]:
    """The limit's key a step takes (the tenant field, see ``_enqueue``)."""
    return (s.kind, s.key, s.queue == 2)


def _unsettled(client: Client, workers: list[Worker], e: Example) -> tuple[list[int], list[int]]:
    """The enqueued steps that nothing documented holds back and that have not started, and
    the started steps that nothing holds and that have not ended."""
    n = len(e.handles)
    if n == 0:
        return [], []
    states = {r.id: r.state for r in client.list_runs(limit=n, before_id=e.handles[-1].id + 1)}
    ended = [states[h.id].is_terminal for h in e.handles]
    with lock:
        began = [(e.ex, i) in spans for i in range(n)]
    holding = [i for i in range(n) if began[i] and not ended[i]]
    room = {
        q: any(_has_room(workers[w]) for w, (qs, _) in enumerate(SERVES) if q in qs)
        for q in range(3)
    }
    free, ending = [], []
    for i, s in enumerate(e.specs[:n]):
        if ended[i]:
            continue
        if began[i]:
            if not s.hold or _gate(e.ex, i).is_set():
                ending.append(i)
            continue
        if s.queue in e.unsure or not room[s.queue]:
            continue
        if s.seq is not None and any(e.specs[j].seq == s.seq and not ended[j] for j in range(i)):
            continue
        limit = KINDS[s.kind][1]
        if limit is not None and limit <= sum(1 for j in holding if _slot(e.specs[j]) == _slot(s)):
            continue
        cap = e.caps.get(s.queue)
        if cap is not None and cap <= sum(1 for j in holding if e.specs[j].queue == s.queue):
            continue
        free.append(i)
    return free, ending


def _settle(client: Client, workers: list[Worker], e: Example, after: str) -> None:
    """Until every step that nothing holds back started, and every started step that
    nothing holds ended: the next action then races with no step's start or end."""
    e.log.append(after)
    since = time.monotonic()

    def settled() -> bool:
        free, ending = _unsettled(client, workers, e)
        return not free and not ending

    try:
        wait_until(settled, timeout=STALL, what=f"the free steps to run after {after}")
    except AssertionError:
        free, ending = _unsettled(client, workers, e)
        why = {i: client.why_waiting(e.handles[i].id) for i in free}
        raise AssertionError(
            f"steps {free} free but not started, {ending} not ended "
            f"{time.monotonic() - since:.1f}s after {after}; why_waiting {why}; "
            f"specs {e.specs}; actions {e.log}"
        ) from None


def _enqueue(
    client: Client, cyclone_dsn: str, workers: list[Worker], e: Example, upto: int
) -> None:
    """Enqueue the next steps up to ``upto`` in one transaction (see the module's doc)."""
    first = len(e.handles)
    if first >= upto:
        return
    with psycopg.connect(cyclone_dsn) as conn, conn.transaction():
        for i in range(first, upto):
            s = e.specs[i]
            side = "b" if s.queue == 2 else "a"  # a key is claimed by one worker only
            job = {"ex": e.ex, "i": i, "tenant": f"{e.ex}-{s.key}{side}"}  # kinds share keys
            job.update(hold=s.hold, fail=s.fail)
            seq = None if s.seq is None else f"wpa-{os.getpid()}-{e.ex}-{s.seq}"
            e.handles.append(
                client.enqueue_tx(
                    conn,
                    KINDS[s.kind][0],
                    job,
                    queue=QUEUES[s.queue],
                    sequence_key=seq,
                    scheduled_at=PAST + timedelta(seconds=i),
                )
            )
    _settle(client, workers, e, f"enqueue {first}..{upto - 1}")


def _apply(client: Client, e: Example, op: str, arg: int, cap: int) -> str | None:
    n = len(e.handles)
    if op in ("release", "cancel"):
        if n == 0:
            return None
        i = arg % n
        if op == "release":
            if not e.specs[i].hold or _gate(e.ex, i).is_set():
                return None
            _gate(e.ex, i).set()
            return f"release {i}"
        at = time.monotonic()
        try:
            client.cancel(e.handles[i].id)
        except AlreadyTerminal:
            return None
        e.cancelled_at[i] = at
        return f"cancel {i}"
    q = arg % 3
    if op == "cap":
        if q in e.caps:
            e.unsure.add(q)  # a raised (or lowered) cap: read within a few seconds
        e.caps[q] = cap
        client.set_queue_limit(QUEUES[q], cap)
        return f"cap q{q}={cap}"
    if q not in e.caps:
        return None
    del e.caps[q]
    e.unsure.add(q)  # a removed cap: read within a few seconds
    client.set_queue_limit(QUEUES[q], None)
    return f"uncap q{q}"


def _overlaps(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at once (an interval ending when another starts is closed)."""
    points = sorted([(s, 1) for s, _ in intervals] + [(t, -1) for _, t in intervals])
    most = now = 0
    for _, step_ in points:
        now += step_
        most = max(most, now)
    return most


def _check_limits(e: Example) -> None:
    """No more than ``limit`` steps of a kind and key at once; a sequence one at a time, in
    enqueue order. From the handlers' own times (a cancelled one's end at its cancel)."""
    specs = e.specs
    with lock:
        own = {i: spans[(e.ex, i)] for i in range(len(specs)) if (e.ex, i) in spans}
    runs: dict[int, tuple[float, float]] = {}
    for i, (start, end) in own.items():
        assert start is not None and end is not None
        end = min(end, e.cancelled_at.get(i, end))
        if end > start:
            runs[i] = (start, end)
    for slot in {_slot(s) for s in specs if KINDS[s.kind][1] is not None}:
        limit = KINDS[slot[0]][1]
        mine = [runs[i] for i in runs if _slot(specs[i]) == slot]
        assert limit is not None and _overlaps(mine) <= limit, (
            f"more than {limit} steps of {slot} ran at once; specs {specs}; "
            f"actions {e.log}; times {runs}"
        )
    for seq in (0, 1):
        mine = sorted(i for i in own if specs[i].seq == seq)
        assert _overlaps([runs[i] for i in mine if i in runs]) <= 1, (
            f"steps of sequence {seq} overlapped; specs {specs}; actions {e.log}; times {runs}"
        )
        order = sorted(mine, key=lambda i: own[i][0] or 0.0)
        assert order == mine, f"sequence {seq} started in order {order}; specs {specs}"


counter = [0]


@given(specs=SPECS, ops=OPS)
@settings(
    max_examples=12,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_wpa_every_step_starts_on_a_wake_up_and_limits_hold(
    client: Client,
    cyclone_dsn: str,
    workers: list[Worker],
    specs: list[Spec],
    ops: list[tuple[int, str, int, int]],
) -> None:
    counter[0] += 1
    e = Example(counter[0], specs)
    began = time.monotonic()
    with lock:  # a failed example (hypothesis replays it) left its steps held
        for event in gates.values():
            event.set()
    wait_until(lambda: all(_running(w) == 0 for w in workers), timeout=STALL, what="idle")
    for at, op, arg, cap in sorted(ops, key=lambda o: o[0]):
        _enqueue(client, cyclone_dsn, workers, e, min(at, len(specs)))
        done = _apply(client, e, op, arg, cap)
        if done is not None:
            _settle(client, workers, e, done)
    _enqueue(client, cyclone_dsn, workers, e, len(specs))

    # The operator removes every obstacle, one at a time.
    for i, s in enumerate(specs):
        if s.hold and not _gate(e.ex, i).is_set():
            _gate(e.ex, i).set()
            _settle(client, workers, e, f"release {i}")
    for q in sorted(e.caps):
        _apply(client, e, "uncap", q, 0)
        e.log.append(f"uncap q{q}")
    cleared = time.monotonic()
    for i, handle in enumerate(e.handles):
        run = handle.wait(timeout=max(BOUND - (time.monotonic() - cleared), 0.1))
        if i in e.cancelled_at:
            expected = RunState.CANCELLED
        else:
            expected = RunState.FAILED if specs[i].fail else RunState.COMPLETED
        assert run.state is expected, f"step {i}: {run.state}; specs {specs}; actions {e.log}"
    ended = time.monotonic() - cleared
    wait_until(lambda: all(_running(w) == 0 for w in workers), timeout=STALL, what="handlers")
    _check_limits(e)
    timings.append(
        f"wpa example {e.ex}: {len(specs)} steps, {len(e.log)} actions, "
        f"{time.monotonic() - began:.2f}s (all ended {ended:.2f}s after the last obstacle)"
    )


# -- regressions ------------------------------------------------------------------------------


def test_wpa_a_free_kind_is_not_held_behind_another_kind_s_full_slot_of_the_same_key(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Two kinds limited by the same key field: ``one`` (limit 1) is full for tenant t, and
    its next step waits; ``two`` (limit 2) has room for t. A worker with one free thread
    (polling every 0.5 s) must start the ``two`` step: "the slots are the kind's and key's"
    and work over a limit waits "as soon as the limit has room"."""
    q = QUEUES[0]
    start_worker(wpa_one, wpa_two, queues=[q], concurrency=2, grace=0.5)
    job = {"ex": -1, "tenant": "t", "fail": False}
    client.enqueue(wpa_one, dict(job, i=0, hold=True), queue=q)
    wait_until(lambda: (-1, 0) in spans, timeout=PROMPT, what="the holder to start")
    blocked = client.enqueue(wpa_one, dict(job, i=1, hold=False), queue=q)
    wait_until(
        lambda: "concurrency slot" in " ".join(client.why_waiting(blocked.id).values()),
        timeout=PROMPT,
        what="the second step of kind one to wait",
    )
    free = client.enqueue(wpa_two, dict(job, i=2, hold=False), queue=q)
    try:
        assert free.result(timeout=SOON) == "done 2"
        assert not blocked.get().state.is_terminal
    finally:
        _gate(-1, 0).set()
    assert blocked.result(timeout=PROMPT) == "done 1"


def test_wpa_a_claim_takes_every_free_step_of_a_key_when_another_key_is_busy(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """A step of tenant b runs (kind ``one``); two steps of tenant a (kind ``two``, limit 2)
    are enqueued together (``enqueue_many``). The worker has 2 free threads and tenant a 2
    free slots: both must start at that wake-up. (Its claim shares its room among the keys
    of the queue, b included, which has nothing to claim: it takes one step of a, and
    waits for the next wake-up or poll, a minute, with a free thread.)"""
    q = QUEUES[2]
    job = {"ex": -3, "fail": False, "hold": True}
    client.enqueue(wpa_one, dict(job, i=0, tenant="b"), queue=q)
    worker = start_worker(
        wpa_one,
        wpa_two,
        queues=[q],
        concurrency=3,
        poll_interval=LONG_POLL,
        scan_interval=LONG_POLL,
        grace=0.5,
    )
    wait_until(lambda: (-3, 0) in spans, timeout=PROMPT, what="tenant b's step to start")
    # The worker's look "for limited work every few seconds" saw it at its start, and sees
    # no change later (a change wakes it): only a wake-up can start work.
    assert q in worker._gated_queues
    wait_idle(cyclone_dsn, worker, listeners=1)
    client.enqueue_many(wpa_two, [dict(job, i=1, tenant="a"), dict(job, i=2, tenant="a")], queue=q)
    try:
        wait_until(
            lambda: (-3, 1) in spans and (-3, 2) in spans,
            timeout=SOON,
            what="both steps of tenant a to start",
        )
    finally:
        with lock:
            for key in [(-3, 0), (-3, 1), (-3, 2)]:
                gates.setdefault(key, threading.Event()).set()


def test_wpa_a_step_skipped_while_another_claimer_looked_at_its_slot_is_woken(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """Two claimers at once (one wake-up, two workers): a gated claim with room for one step
    looks at the first step of each key and locks it and its free slot (``FOR UPDATE SKIP
    LOCKED``), also of the key whose step it then has no room for. The other claimer's
    statement skips that step: it claims nothing, and must be woken once the first commits.
    The first claimer here is the engine's claim in an open transaction; the worker's claim
    runs while it is open (held at ``claim.after_gate_look`` until then)."""
    q = QUEUES[0]
    job = {"ex": -4, "hold": False, "fail": False}
    # Another tenant's step runs throughout, so that the worker's look "for limited work
    # every few seconds" (at its start) sees no change later (a change wakes it).
    client.enqueue(wpa_one, dict(job, i=2, tenant="other", hold=True), queue=q)
    worker = start_worker(
        wpa_one, queues=[q], concurrency=3, poll_interval=LONG_POLL, scan_interval=LONG_POLL
    )
    wait_until(lambda: (-4, 2) in spans, timeout=PROMPT, what="the other tenant's step")
    assert q in worker._gated_queues
    wait_idle(cyclone_dsn, worker, listeners=1)
    hold = HoldFirst()  # the worker's claim, until the other claimer has locked
    arm("claim.after_gate_look", hold)
    try:
        handles = client.enqueue_many(
            wpa_one, [dict(job, i=0, tenant="k"), dict(job, i=1, tenant="k2")], queue=q
        )
        wait_until(hold.reached.is_set, timeout=PROMPT, what="the worker's claim")
        # (begun after the enqueue: its now() is its start, and the steps are due by then)
        with psycopg.connect(cyclone_dsn) as conn, conn.transaction():
            (taken,) = Engine().claim(
                ConnectionTx(conn),
                owner="the-other-claimer",
                queues=[q],
                kinds=["wpa_one"],
                versions=[("wpa_one", "standalone")],
                limit=1,
                lease=timedelta(minutes=5),
                gated=True,
            )
            hold.release()
            wait_idle(cyclone_dsn, worker, listeners=1)  # its claim skipped the locked step
            left = next(h for h in handles if h.id != taken.run_id)
            assert not left.get().state.is_terminal
        # the other claimer commits, its room full, the locked step left behind
        assert left.result(timeout=SOON).startswith("done")
    finally:
        hold.release()
        disarm("claim.after_gate_look")
        _gate(-4, 2).set()
