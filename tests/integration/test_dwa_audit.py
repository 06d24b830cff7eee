"""Audit of the scanner's due pass: work that comes due later is woken at its time.

"Work that comes due later (a step enqueued with ``scheduled_at=``, a retry after its
backoff, a debounced run's window) needs no write at its time, so the scanner's *due*
pass [...] wakes the queues of the steps that came due since the last pass: such work
starts within about a second of its time, whatever the ``poll_interval`` (at least one
worker, or a ``cyclone scan`` process, must run the scanner, as for timers)."
(docs/concepts/runs-and-steps.md, "Wake-ups").

Every worker here polls once a minute (``LONG_POLL``): a step that starts within a few
seconds of its due time was woken, not polled. Queue names carry this process's id, so
no other test's wake-up (NOTIFY is database-wide) wakes a worker under test.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from cyclone_dsl import Client, RunState, StepState, Worker, step
from cyclone_dsl.cli.main import run as cyclone
from cyclone_dsl.testing import set_clock_shift
from tests.waiting import LONG_POLL, PROMPT, wait_idle, wait_until

PID = os.getpid()
#: How long after its due time a step may start (a missed wake-up waits for the 60 s poll).
LATE = 4.0
#: How long a woken step may take to start after the transition that woke it.
STALL = 4.0
#: How much earlier than its due time a step may seem to start (clock reads, rounding).
EARLY = 0.25

starts: dict[str, float] = {}
release = threading.Event()


def q(name: str) -> str:
    return f"dwa_{PID}_{name}"


@pytest.fixture(autouse=True)
def _fresh(start_worker: Callable[..., Worker]) -> Iterator[None]:
    """Set up after ``start_worker``, so torn down before it: a held handler returns
    before its worker stops."""
    starts.clear()
    release.clear()
    yield
    release.set()


@step(name="dwa_note")
def dwa_note(label: str) -> str:
    starts.setdefault(label, time.monotonic())
    return label


@step(name="dwa_hold")
def dwa_hold(label: str) -> str:
    starts.setdefault(label, time.monotonic())
    release.wait(timeout=30)
    return label


@step(name="dwa_flaky", max_attempts=2)
def dwa_flaky(label: str) -> str:
    first = label not in starts
    starts[label + "#" + ("1" if first else "2")] = time.monotonic()
    starts.setdefault(label, time.monotonic())
    if first:
        raise RuntimeError("fails once")
    return label


def _due_in(seconds: float) -> tuple[datetime, float]:
    """(the database time, the monotonic time) ``seconds`` from now."""
    return datetime.now(UTC) + timedelta(seconds=seconds), time.monotonic() + seconds


def _started_on_time(label: str, due: float, *, late: float = LATE) -> float:
    """Seconds from ``due`` to the start of ``label``; fails if it starts past ``late``
    or clearly before its time."""
    try:
        wait_until(
            lambda: label in starts,
            timeout=max(0.1, due + late - time.monotonic()),
            what=f"{label} to start (a wake-up; the next poll is {LONG_POLL:g}s away)",
        )
    except AssertionError:
        raise AssertionError(
            f"{label} did not start within {late:g}s of its time "
            f"({time.monotonic() - due:.1f}s past it now)"
        ) from None
    took = starts[label] - due
    assert took >= -EARLY, f"{label} started {-took:.2f}s before its time"
    assert took <= late, f"{label} started {took:.1f}s after its time"
    return took


def _mark(dsn: str) -> datetime | None:
    """Where the last due pass stopped (cyclone_ext_due_wakes.woken_until)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT woken_until FROM cyclone_ext_due_wakes").fetchone()
    return None if row is None else row[0]


def _passed(dsn: str, at: datetime, *, overlap: bool = True) -> None:
    """Until a due pass ran past ``at``; with ``overlap``, past ``at`` plus the window's
    one-second overlap too: no later pass looks at a step due at ``at``."""
    margin = timedelta(seconds=1.2 if overlap else 0.05)
    wait_until(
        lambda: (m := _mark(dsn)) is not None and m > at + margin,
        timeout=PROMPT,
        what=f"a due pass past {at}",
        interval=0.05,
    )


# -- several due times, queues, priorities --------------------------------------------------


def test_dwa_staggered_due_times_in_several_queues_start_each_at_its_time(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker(
        dwa_note,
        queues=[q("a"), q("b"), q("c")],
        poll_interval=LONG_POLL,
        scan_interval=1.0,
        concurrency=8,
    )
    wait_idle(cyclone_dsn, worker, listeners=1)
    plan = [  # (label, queue, priority, seconds)
        ("a1", "a", 0, 1.0),
        ("a2", "a", 5, 1.3),
        ("a3", "a", -3, 2.1),
        ("b1", "b", 2, 1.1),
        ("b2", "b", 2, 1.8),
        ("c1", "c", -7, 1.5),
    ]
    dues: dict[str, float] = {}
    handles = []
    for label, queue, priority, seconds in plan:
        at, dues[label] = _due_in(seconds)
        handles.append(
            client.enqueue(dwa_note, label, queue=q(queue), priority=priority, scheduled_at=at)
        )
    for label, *_ in plan:
        _started_on_time(label, dues[label])
    assert [h.result(timeout=PROMPT) for h in handles] == [p[0] for p in plan]


def test_dwa_many_steps_due_at_once_across_twenty_queues_all_start(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    queues = [q(f"m{i}") for i in range(20)]
    one = start_worker(
        dwa_note, queues=queues[:10], poll_interval=LONG_POLL, scan_interval=1.0, concurrency=8
    )
    two = start_worker(
        dwa_note, queues=queues[10:], poll_interval=LONG_POLL, scanners=False, concurrency=8
    )
    wait_idle(cyclone_dsn, one, listeners=2)
    wait_idle(cyclone_dsn, two, listeners=2)
    at, due = _due_in(1.5)
    for i, queue in enumerate(queues):
        client.enqueue_many(
            dwa_note, [f"m{i}-{j}" for j in range(10)], queue=queue, priority=i % 3, scheduled_at=at
        )
    labels = [f"m{i}-{j}" for i in range(20) for j in range(10)]
    wait_until(
        lambda: all(label in starts for label in labels),
        timeout=max(0.1, due + LATE + 2.0 - time.monotonic()),
        what=f"all 200 steps to start ({sum(lbl in starts for lbl in labels)} did)",
    )
    first = min(starts[label] for label in labels)
    assert first >= due - EARLY, f"a step started {due - first:.2f}s before its time"


# -- who runs the scanner --------------------------------------------------------------------


def test_dwa_a_worker_without_scanner_is_woken_by_another_worker_s_scanner(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    start_worker(dwa_note, queues=[q("scanning")], poll_interval=LONG_POLL, scan_interval=1.0)
    idle = start_worker(dwa_note, queues=[q("plain")], poll_interval=LONG_POLL, scanners=False)
    wait_idle(cyclone_dsn, idle, listeners=2)
    at, due = _due_in(1.0)
    handle = client.enqueue(dwa_note, "plain", queue=q("plain"), scheduled_at=at)
    _started_on_time("plain", due)
    assert handle.result(timeout=PROMPT) == "plain"


def test_dwa_with_no_scanner_the_step_waits_until_cyclone_scan_once_wakes_it(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """Documented: at least one worker, or ``cyclone scan``, must run the scanner."""
    idle = start_worker(dwa_note, queues=[q("noscan")], poll_interval=LONG_POLL, scanners=False)
    wait_idle(cyclone_dsn, idle, listeners=1)
    at, due = _due_in(0.5)
    handle = client.enqueue(dwa_note, "noscan", queue=q("noscan"), scheduled_at=at)
    wait_until(lambda: time.monotonic() > due + 1.2, timeout=PROMPT, what="the due time")
    assert "noscan" not in starts  # nothing woke it: the poll is a minute away
    assert _mark(cyclone_dsn) is None
    since = time.monotonic()
    assert cyclone(["--dsn", cyclone_dsn, "scan", "--once", "--retention", "none"]) == 0
    wait_until(lambda: "noscan" in starts, timeout=STALL, what="the step after the scan")
    assert starts["noscan"] - since <= STALL
    assert handle.result(timeout=PROMPT) == "noscan"


def test_dwa_a_scanner_back_after_an_outage_wakes_what_came_due_meanwhile(
    client: Client,
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    clock: Callable[[datetime], None],
) -> None:
    """The mark is where the last pass stopped: a scanner that was away two minutes
    wakes the steps that came due in those two minutes (the clock is moved instead)."""
    idle = start_worker(dwa_note, queues=[q("outage")], poll_interval=LONG_POLL, scanners=False)
    wait_idle(cyclone_dsn, idle, listeners=1)
    assert cyclone(["--dsn", cyclone_dsn, "scan", "--once", "--retention", "none"]) == 0
    now = datetime.now(UTC)
    handle = client.enqueue(
        dwa_note, "outage", queue=q("outage"), scheduled_at=now + timedelta(seconds=30)
    )
    wait_idle(cyclone_dsn, idle, listeners=1)  # the enqueue's wake-up is over
    clock(now + timedelta(minutes=2))
    assert "outage" not in starts
    since = time.monotonic()
    assert cyclone(["--dsn", cyclone_dsn, "scan", "--once", "--retention", "none"]) == 0
    wait_until(lambda: "outage" in starts, timeout=STALL, what="the step after the scan")
    assert starts["outage"] - since <= STALL
    assert handle.result(timeout=PROMPT) == "outage"


# -- the database clock moved ----------------------------------------------------------------


def test_dwa_after_the_clock_moved_forward_then_back_later_steps_are_still_woken(
    client: Client,
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    clock: Callable[[datetime], None],
) -> None:
    worker = start_worker(dwa_note, queues=[q("clock")], poll_interval=LONG_POLL, scan_interval=0.3)
    wait_idle(cyclone_dsn, worker, listeners=1)
    clock(datetime.now(UTC) + timedelta(hours=1))
    wait_until(
        lambda: (
            (m := _mark(cyclone_dsn)) is not None and m > datetime.now(UTC) + timedelta(minutes=30)
        ),
        timeout=PROMPT,
        what="a due pass on the moved clock",
    )
    set_clock_shift(timedelta(0))  # back: the mark is an hour ahead of now
    at, due = _due_in(1.0)
    handle = client.enqueue(dwa_note, "after-back", queue=q("clock"), scheduled_at=at)
    _started_on_time("after-back", due)
    assert handle.result(timeout=PROMPT) == "after-back"
    # Then an hour back from real time: the mark is an hour ahead again.
    back = timedelta(hours=-1)
    clock(datetime.now(UTC) + back)
    at, due = _due_in(1.0)
    handle = client.enqueue(dwa_note, "on-back", queue=q("clock"), scheduled_at=at + back)
    _started_on_time("on-back", due)
    assert handle.result(timeout=PROMPT) == "on-back"


# -- pause, resume, operator retry -----------------------------------------------------------


def test_dwa_a_run_resumed_before_its_step_is_due_starts_it_at_its_time(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker(dwa_note, queues=[q("early")], poll_interval=LONG_POLL, scan_interval=0.5)
    wait_idle(cyclone_dsn, worker, listeners=1)
    at, due = _due_in(1.5)
    handle = client.enqueue(dwa_note, "early", queue=q("early"), scheduled_at=at)
    client.pause(handle.id)
    client.resume(handle.id)
    _started_on_time("early", due)
    assert handle.result(timeout=PROMPT) == "early"


def test_dwa_an_operator_retry_of_a_cancelled_delayed_step_starts_it_at_its_time(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """Documented: a step enqueued with a later scheduled_at and cancelled before it keeps
    that start when retried."""
    worker = start_worker(dwa_note, queues=[q("retry")], poll_interval=LONG_POLL, scan_interval=0.5)
    wait_idle(cyclone_dsn, worker, listeners=1)
    at, due = _due_in(1.5)
    handle = client.enqueue(dwa_note, "retried", queue=q("retry"), scheduled_at=at)
    client.cancel(handle.id)
    client.retry(handle.id, "dwa_note")
    assert handle.get().state is RunState.RUNNING
    _started_on_time("retried", due)
    assert handle.result(timeout=PROMPT) == "retried"


def test_dwa_a_retry_due_while_the_run_is_paused_starts_at_the_resume(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """The first attempt fails; its retry (0.5-1 s of backoff) comes due during a pause."""
    worker = start_worker(
        dwa_flaky, queues=[q("flaky")], poll_interval=LONG_POLL, scan_interval=0.5
    )
    wait_idle(cyclone_dsn, worker, listeners=1)
    handle = client.enqueue(dwa_flaky, "flaky", queue=q("flaky"))
    wait_until(lambda: "flaky#1" in starts, timeout=PROMPT, what="the first attempt")
    retried = wait_until(
        lambda: next(
            (s for s in handle.get().steps if s.attempt >= 1 and s.state is StepState.AVAILABLE),
            None,
        ),
        timeout=PROMPT,
        what="the failed attempt to be recorded",
    )
    client.pause(handle.id)
    _passed(cyclone_dsn, retried.scheduled_at)  # its backoff ended during the pause
    assert "flaky#2" not in starts
    wait_idle(cyclone_dsn, worker, listeners=1)
    since = time.monotonic()
    client.resume(handle.id)
    wait_until(lambda: "flaky#2" in starts, timeout=STALL, what="the retry after the resume")
    assert starts["flaky#2"] - since <= STALL
    assert handle.result(timeout=PROMPT) == "flaky"


# -- held past its time ---------------------------------------------------------------------


def test_dwa_a_step_due_while_its_worker_is_full_starts_when_the_slot_frees(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    start_worker(
        dwa_note,
        dwa_hold,
        queues=[q("busy")],
        poll_interval=LONG_POLL,
        scan_interval=0.5,
        concurrency=1,
    )
    holder = client.enqueue(dwa_hold, "holder", queue=q("busy"))
    wait_until(lambda: "holder" in starts, timeout=PROMPT, what="the holder to run")
    at, _ = _due_in(0.5)
    handle = client.enqueue(dwa_note, "queued", queue=q("busy"), scheduled_at=at)
    _passed(cyclone_dsn, at)  # no later due pass wakes it: the completion must
    assert "queued" not in starts
    since = time.monotonic()
    release.set()
    wait_until(lambda: "queued" in starts, timeout=STALL, what="the step after the slot freed")
    assert starts["queued"] - since <= STALL
    assert holder.result(timeout=PROMPT) == "holder"
    assert handle.result(timeout=PROMPT) == "queued"


def test_dwa_a_sequence_step_due_behind_a_running_one_in_another_queue_starts_when_it_ends(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """Docs: "with sequence_key=, steps of one key run one at a time" and "frees its key at
    once, and the next one starts"."""
    start_worker(dwa_hold, queues=[q("seq1")], poll_interval=LONG_POLL, scan_interval=0.5)
    idle = start_worker(dwa_note, queues=[q("seq2")], poll_interval=LONG_POLL, scanners=False)
    first = client.enqueue(dwa_hold, "seq-first", queue=q("seq1"), sequence_key=f"k{PID}")
    wait_until(lambda: "seq-first" in starts, timeout=PROMPT, what="the first of the key")
    at, _ = _due_in(0.3)
    second = client.enqueue(
        dwa_note, "seq-second", queue=q("seq2"), sequence_key=f"k{PID}", scheduled_at=at
    )
    _passed(cyclone_dsn, at)  # held past its due time and the due pass's overlap
    wait_idle(cyclone_dsn, idle, listeners=2)
    assert "seq-second" not in starts
    since = time.monotonic()
    release.set()
    assert first.result(timeout=PROMPT) == "seq-first"
    wait_until(lambda: "seq-second" in starts, timeout=STALL, what="the next of the key")
    assert starts["seq-second"] - since <= STALL
    assert second.result(timeout=PROMPT) == "seq-second"


def test_dwa_a_delayed_enqueue_committed_long_after_its_time_starts_at_the_commit(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker(
        dwa_note, queues=[q("late_tx")], poll_interval=LONG_POLL, scan_interval=0.5
    )
    wait_idle(cyclone_dsn, worker, listeners=1)
    at, _ = _due_in(0.5)
    with psycopg.connect(cyclone_dsn) as conn:
        handle = client.enqueue_tx(conn, dwa_note, "late", queue=q("late_tx"), scheduled_at=at)
        _passed(cyclone_dsn, at)  # the passes that could have seen it are over
        wait_idle(cyclone_dsn, worker, listeners=1)
        since = time.monotonic()
        conn.commit()
    wait_until(lambda: "late" in starts, timeout=STALL, what="the step after the commit")
    assert starts["late"] - since <= STALL
    assert handle.result(timeout=PROMPT) == "late"
