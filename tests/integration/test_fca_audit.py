"""Audit: fair claims of limited work (docs/concepts/flow-control.md, "Fair claims").

"A claim looks at a window of keys (at least 16 after where the last one stopped, and as
many from the first); a window whose keys are all at their limit moves the claim on to the
next, up to four windows per claim, and the next claim goes on from there. So a key whose
slot frees starts its next step at once behind up to about 60 keys that are all at their
limit; behind more, it can wait one ``poll_interval`` for every 60 or so of them."

Steps here are under a step-level ``Concurrency(key, limit=1)``; holders block on an event
the test sets. Workers poll every 60 s unless a test says otherwise: work that starts
within a few seconds was woken or found by the claim, not polled. A worker's free handlers
are its claim's room: a worker with ``concurrency=N+1`` and N holders running claims with
room 1 (a window of 16 keys). Tests marked ``xfail(strict=True)`` show a finding.
"""

from __future__ import annotations

import collections
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cyclone_dsl import Client, Concurrency, RateLimit, RunHandle, Worker, step
from tests.waiting import LONG_POLL, PROMPT, wait_until

#: How long a freed key's queued step may take to start (lost: a 60 s poll).
STALL = 6.0
#: Behind more than ~60 blocked keys, with poll_interval=0.5: a few polls.
FEW_POLLS = 10.0

QA = "fca_qa"
QB = "fca_qb"


class Board:
    """What the handlers did: starts by (key, n), running and peak per key, and the events
    holders wait on (per key)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: collections.Counter[str] = collections.Counter()
        self.peak: collections.Counter[str] = collections.Counter()
        self.total = self.total_peak = 0
        self.started: dict[tuple[str, int], float] = {}
        self.order: list[tuple[str, int]] = []
        self.gates: dict[str, threading.Event] = {}
        self.closed = False

    def gate(self, key: str) -> threading.Event:
        with self.lock:
            event = self.gates.setdefault(key, threading.Event())
            if self.closed:
                event.set()
            return event

    def close(self) -> None:
        with self.lock:
            self.closed = True
            for event in self.gates.values():
                event.set()

    def run(self, key: str, n: int, hold: bool) -> int:
        with self.lock:
            self.running[key] += 1
            self.peak[key] = max(self.peak[key], self.running[key])
            self.total += 1
            self.total_peak = max(self.total_peak, self.total)
            self.started[(key, n)] = time.monotonic()
            self.order.append((key, n))
        try:
            if hold:
                self.gate(key).wait(timeout=60)
        finally:
            with self.lock:
                self.running[key] -= 1
                self.total -= 1
        return n

    def has(self, key: str, n: int) -> bool:
        with self.lock:
            return (key, n) in self.started


board = Board()


@pytest.fixture(autouse=True)
def _fresh(start_worker: Callable[..., Worker]) -> Iterator[Board]:
    """A new board; at the end every holder is let go before the workers stop (this
    fixture is torn down first: it needs start_worker)."""
    global board
    board = Board()
    yield board
    board.close()


# -- handlers ----------------------------------------------------------------------------


@step(name="fca_keyed", concurrency=Concurrency(key="tenant", limit=1))
def fca_keyed(job: dict[str, Any]) -> int:
    return board.run(str(job["tenant"]), int(job["n"]), bool(job.get("hold")))


@step(name="fca_fair", concurrency=Concurrency(key="tenant", limit=None))
def fca_fair(job: dict[str, Any]) -> int:
    return board.run(str(job["tenant"]), int(job["n"]), bool(job.get("hold")))


@step(name="fca_rated", rate_limit=RateLimit(limit=1, per=timedelta(hours=1)))
def fca_rated(n: int) -> int:
    return board.run("rated", n, False)


@step(
    name="fca_both",
    concurrency=Concurrency(key="tenant", limit=1),
    rate_limit=RateLimit(limit=1, per=timedelta(seconds=1), name="fca_shared"),
)
def fca_both(job: dict[str, Any]) -> int:
    return board.run(str(job["tenant"]), int(job["n"]), bool(job.get("hold")))


# -- helpers -----------------------------------------------------------------------------


def _waits_for_slot(client: Client, run: RunHandle[Any], what: str = "concurrency slot") -> None:
    wait_until(
        lambda: what in " ".join(client.why_waiting(run.id).values()),
        timeout=PROMPT,
        what=f"run {run.id} to wait for a {what}",
    )


def _block(
    client: Client,
    names: Sequence[str],
    *,
    queue: str | None = None,
    by_arg: bool = False,
) -> dict[str, RunHandle[Any]]:
    """A holder per key, each running (blocked on its key's event)."""
    holders = {}
    for key in names:
        job = {"tenant": key, "n": 0, "hold": True}
        extra: dict[str, Any] = {"concurrency_key": key} if by_arg else {}
        holders[key] = client.enqueue(fca_keyed, job, queue=queue, **extra)
    for key in names:
        wait_until(lambda k=key: board.has(k, 0), timeout=PROMPT, what=f"holder of {key!r}")
    return holders


def _queue_one_each(
    client: Client,
    names: Sequence[str],
    *,
    queue: str | None = None,
    by_arg: bool = False,
    n: int = 1,
    hold: bool = False,
) -> dict[str, RunHandle[Any]]:
    queued = {}
    for key in names:
        job = {"tenant": key, "n": n, "hold": hold}
        extra: dict[str, Any] = {"concurrency_key": key} if by_arg else {}
        queued[key] = client.enqueue(fca_keyed, job, queue=queue, **extra)
    for key in (names[0], names[-1]):
        _waits_for_slot(client, queued[key])
    return queued


def _release(key: str, queued: RunHandle[Any], timeout: float = STALL) -> None:
    board.gate(key).set()
    wait_until(lambda: board.has(key, 1), timeout=timeout, what=f"the queued step of {key!r}")
    assert queued.result(timeout=PROMPT) == 1


# -- a freed key among blocked keys --------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "freed"),
    [(3, [1, 0]), (17, [16, 0, 8]), (33, [5, 32, 4, 20])],
)
def test_a_freed_key_starts_its_queued_step_at_once(
    client: Client, start_worker: Callable[..., Worker], keys: int, freed: list[int]
) -> None:
    """Up to ~60 keys all at their limit: a freed key's queued step starts at once (the
    holder's end wakes the claim, which looks past the blocked windows)."""
    names = [f"k{i:02d}" for i in range(keys)]
    start_worker(fca_keyed, concurrency=keys + 1, poll_interval=LONG_POLL)
    _block(client, names)
    queued = _queue_one_each(client, names)
    for index in freed:
        _release(names[index], queued[names[index]])
    for index in range(keys):
        if index not in freed:
            assert not board.has(names[index], 1)
    assert max(board.peak.values()) == 1


def test_behind_seventy_blocked_keys_a_freed_key_starts_within_a_few_polls(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    names = [f"k{i:02d}" for i in range(70)]
    start_worker(fca_keyed, concurrency=71, poll_interval=0.5)
    _block(client, names)
    queued = _queue_one_each(client, names)
    for index in (0, 69, 35, 1, 68):
        _release(names[index], queued[names[index]], timeout=FEW_POLLS)
    assert max(board.peak.values()) == 1


#: Keys whose order depends on the database's collation (case, accents, digits, spaces).
ODD_KEYS = [
    "é",
    "Z",
    "a",
    "10",
    "9",
    "A",
    "É",
    "e",
    "z",
    "a ",
    " a",
    "-",
    "_",
    "ä",
    "aa",
    "AA",
    "Ω",
    "日本",
    "0",
    "~",
    "a-b",
    "ab",
]


#: Keys of spaces and punctuation (ignored at the first level by linguistic collations: they
#: sort among, or equal to, the letters' places). ('' is refused.)
BLANK_ISH_KEYS = [" ", "  ", "\t", "!", ".", " k05", "k05 ", *[f"k{i:02d}" for i in range(16)]]


@pytest.mark.parametrize(("names", "seed"), [(ODD_KEYS, 7), (BLANK_ISH_KEYS, 3)])
def test_keys_that_sort_oddly_are_never_skipped(
    client: Client, start_worker: Callable[..., Worker], names: list[str], seed: int
) -> None:
    """The cursor is a key compared in SQL: every key, whatever its collation order, is
    reached by the claim when it frees (released one by one in a shuffled order)."""
    start_worker(fca_keyed, concurrency=len(names) + 1, poll_interval=LONG_POLL)
    _block(client, names, by_arg=True)
    queued = _queue_one_each(client, names, by_arg=True)
    order = list(names)
    random.Random(seed).shuffle(order)
    for key in order:
        _release(key, queued[key])
    assert max(board.peak.values()) == 1


# -- random releases -----------------------------------------------------------------------

_example = itertools.count()


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_every_queued_step_runs_and_no_key_runs_two(
    client: Client, start_worker: Callable[..., Worker], data: st.DataObject
) -> None:
    """Random keys (1-40) each with a blocked holder and a queued step; a random subset is
    released in a random order: each released key's queued step starts promptly, the
    others stay queued, and no key ever runs two at once. Then all are released: all run."""
    keys = data.draw(st.integers(1, 40), label="keys")
    tag = next(_example)
    names = [f"h{tag:02d}-{i:02d}" for i in range(keys)]
    worker = start_worker(fca_keyed, concurrency=keys + 1, poll_interval=LONG_POLL)
    try:
        _block(client, names)
        queued = _queue_one_each(client, names)
        released = data.draw(st.permutations(names), label="order")
        cut = data.draw(st.integers(0, keys), label="released")
        for key in released[:cut]:
            _release(key, queued[key])
        for key in released[cut:]:
            assert not board.has(key, 1)
        for key in released[cut:]:
            board.gate(key).set()
        for key in names:
            assert queued[key].result(timeout=PROMPT) == 1
        assert max(board.peak[k] for k in names) == 1
    finally:
        for key in names:
            board.gate(key).set()
        worker.stop()


# -- priorities and rounds -----------------------------------------------------------------


@pytest.mark.parametrize("kind", [fca_keyed, fca_fair])
@pytest.mark.parametrize("concurrency", [1, 2])
def test_priorities_hold_within_a_key_and_keys_take_turns(
    client: Client, start_worker: Callable[..., Worker], kind: Any, concurrency: int
) -> None:
    plan = {"a": [0, 5, 1, 9, 3], "b": [7, 2, 8], "c": [4, 6]}
    handles = [
        client.enqueue(kind, {"tenant": key, "n": p}, priority=p)
        for key, ps in plan.items()
        for p in ps
    ]
    start_worker(kind, concurrency=concurrency, poll_interval=LONG_POLL)
    for handle in handles:
        handle.result(timeout=PROMPT * 2)
    # Within a key, a step of higher priority is never claimed after one of lower priority
    # (its started_at is its claim's now(): steps of one claim share it).
    claimed: dict[str, list[tuple[int, datetime]]] = collections.defaultdict(list)
    jobs = [(key, p) for key, ps in plan.items() for p in ps]
    for (key, p), handle in zip(jobs, handles, strict=True):
        started_at = handle.get().steps[0].started_at
        assert started_at is not None
        claimed[key].append((p, started_at))
    for key, steps in claimed.items():
        by_priority = [at for _, at in sorted(steps, key=lambda s: -s[0])]
        assert by_priority == sorted(by_priority), (key, sorted(steps))
    order = list(board.order)
    # With one handler, starts are claims: the same order, and rounds: the first 6 starts
    # hold two of a and b and both of c (one per key per turn). With two, the handler
    # threads of consecutive claims may start in either order on a loaded machine.
    if concurrency == 1:
        for key, ps in plan.items():
            assert [n for k, n in order if k == key] == sorted(ps, reverse=True), order
        first = collections.Counter(k for k, _ in order[:6])
        assert first == {"a": 2, "b": 2, "c": 2}, order


# -- mixed limits in one queue -------------------------------------------------------------


def test_a_rate_limited_kind_exhausted_in_the_queue_hides_no_keyed_step(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """One queue: a rate-limited kind with its hour's budget spent (steps queued for an hour)
    and 20 keys at their limit. A freed key starts at once; a new key starts at once."""
    names = [f"k{i:02d}" for i in range(20)]
    start_worker(fca_keyed, fca_rated, concurrency=len(names) + 1, poll_interval=LONG_POLL)
    rated = [client.enqueue(fca_rated, n) for n in range(4)]
    wait_until(lambda: len([k for k, _ in board.order if k == "rated"]) == 1, what="one rated")
    _block(client, names)
    queued = _queue_one_each(client, names)
    _waits_for_slot(client, rated[-1], what="rate limited until")
    for index in (3, 19, 0):
        _release(names[index], queued[names[index]])
    fresh = client.enqueue(fca_keyed, {"tenant": "zz-new", "n": 1})
    assert fresh.result(timeout=STALL) == 1
    assert sum(1 for k, _ in board.order if k == "rated") == 1


def test_a_queue_cap_with_keys_holds_both(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    client.set_queue_limit(QA, 3)
    names = [f"k{i}" for i in range(8)]
    handles = [
        client.enqueue(fca_fair, {"tenant": key, "n": n}, queue=QA)
        for n in range(3)
        for key in names
    ]
    start_worker(fca_fair, queues=[QA], concurrency=8, poll_interval=LONG_POLL)
    for handle in handles:
        handle.result(timeout=PROMPT * 2)
    assert len(board.order) == 24
    assert board.total_peak <= 3
    assert max(board.peak.values()) <= 3


def test_a_capped_queue_with_blocked_keys_runs_every_free_key(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Cap 3 across workers, three holders of keys a, b, c running, queued steps of those and
    of 20 other keys. b's holder ends: a cap slot is free for as long as a and c hold theirs,
    and the queued steps of b and of the other keys (nothing else stops them) all run."""
    client.set_queue_limit(QA, 3)
    start_worker(fca_keyed, queues=[QA], concurrency=10, poll_interval=LONG_POLL)
    holders = _block(client, ["a", "b", "c"], queue=QA)
    others = [f"o{i:02d}" for i in range(20)]
    queued = _queue_one_each(client, ["a", "b", "c"], queue=QA)
    extra = {k: client.enqueue(fca_keyed, {"tenant": k, "n": 1}, queue=QA) for k in others}
    _waits_for_slot(client, extra[others[-1]], what="queue")
    board.gate("b").set()
    assert holders["b"].result(timeout=PROMPT) == 0
    for handle in [queued["b"], *extra.values()]:
        assert handle.result(timeout=STALL) == 1
    assert not board.has("a", 1) and not board.has("c", 1)
    assert board.total_peak == 3
    for key in ("a", "c"):
        board.gate(key).set()
        assert queued[key].result(timeout=PROMPT) == 1


@pytest.mark.parametrize(
    "a_waits",
    [False, True],
)
def test_a_key_at_its_limit_does_not_take_a_shared_rate_budget_from_the_others(
    client: Client, start_worker: Callable[..., Worker], a_waits: bool
) -> None:
    """Keys a and b share a rate budget of 1 a second; a's holder runs (its key at its
    limit), and (a_waits) a's next step waits for it. b's three steps must run about one a
    second (the budget frees every second), not wait for a's holder."""
    start_worker(fca_both, concurrency=4, poll_interval=LONG_POLL)
    holder = client.enqueue(fca_both, {"tenant": "a", "n": 0, "hold": True})
    wait_until(lambda: board.has("a", 0), timeout=PROMPT, what="a's holder")
    waiting = client.enqueue(fca_both, {"tenant": "a", "n": 9}) if a_waits else None
    bs = [client.enqueue(fca_both, {"tenant": "b", "n": n}) for n in range(3)]
    for n, handle in enumerate(bs):
        assert handle.result(timeout=STALL) == n
    assert not board.has("a", 9)
    board.gate("a").set()
    assert holder.result(timeout=PROMPT) == 0
    if waiting is not None:
        assert waiting.result(timeout=PROMPT) == 9


# -- a free key among many blocked ones ----------------------------------------------------


def test_one_free_handler_runs_a_free_key_past_forty_blocked_keys(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Holders of 40 keys run in queue A (their own worker); queue B holds a queued step of
    each of those keys and 5 steps of a free key, claimed by a worker with concurrency=1:
    the free key's 5 steps all run promptly, the blocked keys' stay queued."""
    names = [f"k{i:02d}" for i in range(40)]
    start_worker(fca_keyed, queues=[QA], concurrency=41, poll_interval=LONG_POLL)
    _block(client, names, queue=QA)
    queued = _queue_one_each(client, names, queue=QB)
    start_worker(fca_keyed, queues=[QB], concurrency=1, poll_interval=LONG_POLL)
    free = [client.enqueue(fca_keyed, {"tenant": "k20x", "n": n}, queue=QB) for n in range(5)]
    for handle in free:
        assert isinstance(handle.result(timeout=STALL), int)
    for key in (names[0], names[-1]):
        assert not board.has(key, 1)
    for key in names:
        board.gate(key).set()
    for key in names:
        assert queued[key].result(timeout=PROMPT) == 1


def test_a_holder_ending_in_another_queue_wakes_its_key_s_queued_step(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """The slot is the kind's and key's in every queue ("caps the steps of that kind and key
    that run at once, in every workflow and as standalone work"; work over a limit "waits,
    and the claim takes it as soon as the limit has room"). The holder runs in queue A; the
    queued step of its key in queue B (its own worker) must start when the holder ends."""
    names = ["solo"]
    start_worker(fca_keyed, queues=[QA], concurrency=2, poll_interval=LONG_POLL)
    _block(client, names, queue=QA)
    queued = _queue_one_each(client, names, queue=QB)
    start_worker(fca_keyed, queues=[QB], concurrency=2, poll_interval=LONG_POLL)
    _waits_for_slot(client, queued["solo"])
    _release("solo", queued["solo"])
