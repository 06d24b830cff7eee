"""Audit: long-running worker hygiene. A worker (and a client) that keeps working for weeks
must come back to its idle size once the work is done: threads, file descriptors, database
sessions and the worker's own bookkeeping (claims in flight, handlers running, the metrics
and tracing observers' per-step maps) must not grow with the number of steps it ran.

Sessions are counted exactly: the worker (or client) under test logs in as a role of its
own, made for the test, and ``pg_stat_activity`` is counted by that role. Database time is
moved with the ``clock`` fixture, never waited out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace import TracerProvider
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from cyclone_dsl import (
    AsyncClient,
    Client,
    RunState,
    StepContext,
    Worker,
    child,
    for_each,
    step,
    wait_signal,
    workflow,
)
from tests.roles import application_role
from tests.waiting import wait_until

StartWorker = Callable[..., Worker]
Clock = Callable[[timedelta], None]

_lock = threading.Lock()
STARTED: Counter[str] = Counter()
GATES: dict[str, threading.Event] = {}


def gate(name: str) -> threading.Event:
    with _lock:
        return GATES.setdefault(name, threading.Event())


def started(tag: str) -> None:
    with _lock:
        STARTED[tag] += 1


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    STARTED.clear()
    GATES.clear()
    yield
    for event in list(GATES.values()):
        event.set()


# -- a role of the test's own: its sessions are counted exactly ------------------------------


def _schema_of(dsn: str) -> str:
    options = str(conninfo_to_dict(dsn).get("options") or "")
    return options.split("search_path=")[-1].split()[0]


@pytest.fixture
def role(cyclone_admin_dsn: str, cyclone_dsn: str) -> Iterator[tuple[str, str]]:
    """(a DSN that logs in as a role of this test's own, the role's name). The ledger table
    transactional steps write is made first, so the role may write it too."""
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS lrw_ledger (n int NOT NULL, tag text NOT NULL)")
    with application_role(cyclone_admin_dsn, _schema_of(cyclone_dsn), prefix="lrw") as made:
        yield made


def sessions(admin_dsn: str, role: str) -> int:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = %s", (role,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def sessions_by_name(admin_dsn: str, role: str) -> dict[str, int]:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT regexp_replace(application_name, '-[0-9]+$', ''), count(*) "
            "FROM pg_stat_activity WHERE usename = %s GROUP BY 1 ORDER BY 1",
            (role,),
        ).fetchall()
    return {str(r[0]): int(r[1]) for r in rows}


def kill_sessions(admin_dsn: str, role: str) -> int:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
            (role,),
        ).fetchall()
    return len(rows)


# -- what a process holds ----------------------------------------------------------------------


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def thread_names() -> Counter[str]:
    """Live threads by name, numbers at the end dropped (pool threads are numbered)."""
    return Counter(t.name.rstrip("0123456789").rstrip("-_") for t in threading.enumerate())


def threads_but(*prefixes: str) -> Counter[str]:
    """:func:`thread_names` without the threads whose names start with ``prefixes`` (those
    of a process's other parts, which the test does not look at)."""
    return Counter({k: v for k, v in thread_names().items() if not k.startswith(prefixes)})


def books(worker: Worker) -> dict[str, int]:
    """The worker's per-step bookkeeping: every entry is 0 once it is idle."""
    out = {
        "inflight": len(worker._inflight),
        "running": len(worker._running),
        "lanes_running": sum(lane.running for lane in worker._lanes),
        "cancel_runs": len(worker._cancel_runs),
        "outcomes_queued": worker._outcomes.qsize(),
    }
    observer = worker._observer
    for each in getattr(observer, "observers", []):
        if hasattr(each, "_steps"):  # the metrics observer: claimed and not settled
            out["metrics_steps"] = len(each._steps)
        if hasattr(each, "_open"):  # the tracing observer: spans not ended
            out["spans_open"] = len(each._open)
            out["spans_superseded"] = len(each._superseded)
    return out


def idle_books(worker: Worker) -> dict[str, int]:
    """Once the claims in flight are decided and every handler has returned: the books
    as they stay (nothing changes them without new work)."""

    def quiet() -> bool:
        b = books(worker)
        return b["inflight"] == b["running"] == b["lanes_running"] == b["outcomes_queued"] == 0

    wait_until(quiet, timeout=20, what=f"the worker to be idle: {books(worker)}")
    time.sleep(0.3)  # the completers' observer calls after the last commit
    return books(worker)


def open_runs(client: Client) -> int:
    counts = client.run_counts()
    return sum(n for state, n in counts.items() if not RunState(state).is_terminal)


# -- steps and workflows ----------------------------------------------------------------------


@step(name="lrw_echo")
def lrw_echo(value: object) -> object:
    return value


@step(name="lrw_emit")
def lrw_emit(value: int, ctx: StepContext) -> int:
    ctx.emit({"n": value})
    return value


@step(name="lrw_aecho")
async def lrw_aecho(value: object) -> object:
    await asyncio.sleep(0)
    return value


@step(name="lrw_list")
def lrw_list(n: int) -> list[int]:
    return list(range(n))


@step(name="lrw_boom", max_attempts=1)
def lrw_boom(value: object) -> object:
    raise RuntimeError(f"lrw boom {value}")


@step(name="lrw_aboom", max_attempts=1)
async def lrw_aboom(value: object) -> object:
    raise RuntimeError(f"lrw async boom {value}")


@step(name="lrw_flaky", max_attempts=3)
def lrw_flaky(value: int, ctx: StepContext) -> int:
    if ctx.attempt == 1:
        raise RuntimeError("lrw first attempt fails")
    return value


@step(name="lrw_slow_sync", max_attempts=1, timeout=0.3)
def lrw_slow_sync(value: int, ctx: StepContext) -> int:
    ctx.wait_cancelled(20)  # returns when the worker times it out
    return value


@step(name="lrw_slow_async", max_attempts=1, timeout=0.3)
async def lrw_slow_async(value: int) -> int:
    await asyncio.sleep(20)  # cancelled by the worker at its timeout
    return value


@step(name="lrw_hold_sync", max_attempts=1)
def lrw_hold_sync(value: int, ctx: StepContext) -> int:
    started("hold_sync")
    ctx.wait_cancelled(20)  # until its run is cancelled
    return value


@step(name="lrw_hold_async", max_attempts=1)
async def lrw_hold_async(value: int) -> int:
    started("hold_async")
    await asyncio.sleep(20)
    return value


@step(name="lrw_tx", transactional=True, max_attempts=1)
def lrw_tx(value: int, ctx: StepContext) -> int:
    ctx.connection.execute("INSERT INTO lrw_ledger VALUES (%s, 'tx')", (value,))
    if value % 5 == 4:
        raise RuntimeError("lrw tx rolls back")
    return value


@step(name="lrw_atx", transactional=True, max_attempts=1)
async def lrw_atx(value: int, ctx: StepContext) -> int:
    await ctx.connection.execute("INSERT INTO lrw_ledger VALUES (%s, 'atx')", (value,))
    return value


@step(name="lrw_gated")
def lrw_gated(value: int) -> int:
    started("gated")
    gate("gated").wait(30)
    return value


@workflow(name="lrw_chain")
def lrw_chain(x):  # type: ignore[no-untyped-def]
    return lrw_aecho(lrw_emit(lrw_echo(x)))


@workflow(name="lrw_fan")
def lrw_fan(n):  # type: ignore[no-untyped-def]
    return for_each(lrw_echo, over=lrw_list(n), max_parallel=4)


@workflow(name="lrw_fan_children")
def lrw_fan_children(n):  # type: ignore[no-untyped-def]
    return for_each(lrw_chain, over=lrw_list(n))


@workflow(name="lrw_parent")
def lrw_parent(x):  # type: ignore[no-untyped-def]
    return child(lrw_chain, x)


@workflow(name="lrw_signalled")
def lrw_signalled(x):  # type: ignore[no-untyped-def]
    return lrw_echo(wait_signal("lrw_go"))


@workflow(name="lrw_failing_chain")
def lrw_failing_chain(x):  # type: ignore[no-untyped-def]
    return lrw_echo(lrw_boom(x))


ALL = (
    lrw_echo,
    lrw_emit,
    lrw_aecho,
    lrw_list,
    lrw_boom,
    lrw_aboom,
    lrw_flaky,
    lrw_slow_sync,
    lrw_slow_async,
    lrw_hold_sync,
    lrw_hold_async,
    lrw_tx,
    lrw_atx,
    lrw_gated,
    lrw_chain,
    lrw_fan,
    lrw_fan_children,
    lrw_parent,
    lrw_signalled,
    lrw_failing_chain,
)


class Later:
    """Cumulative moves of the database clock."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.shift = timedelta(0)

    def __call__(self, by: timedelta) -> None:
        self.shift += by
        self.clock(self.shift)


def role_worker(dsn: str, **options: Any) -> Worker:
    """A started worker on ``dsn`` (the test's role), with the suite's short intervals."""
    options.setdefault("poll_interval", 0.5)
    options.setdefault("scan_interval", 0.5)
    options.setdefault("grace", 5.0)
    worker = Worker(dsn, ALL, **options)
    worker.start()
    return worker


def one_round(client: Client, later: Later, scale: int) -> int:
    """A mix of every kind of work, ``scale`` of most; wait until every run ended. Returns
    how many runs it submitted."""
    STARTED.clear()
    handles: list[int] = []
    handles += [h.id for h in client.enqueue_many(lrw_echo, list(range(scale * 10)))]
    handles += [h.id for h in client.enqueue_many(lrw_aecho, list(range(scale * 5)))]
    handles += [h.id for h in client.enqueue_many(lrw_boom, list(range(scale)))]
    handles += [h.id for h in client.enqueue_many(lrw_aboom, list(range(scale)))]
    handles += [h.id for h in client.enqueue_many(lrw_flaky, list(range(scale)))]
    handles += [h.id for h in client.enqueue_many(lrw_slow_sync, list(range(3)))]
    handles += [h.id for h in client.enqueue_many(lrw_slow_async, list(range(scale)))]
    handles += [h.id for h in client.enqueue_many(lrw_tx, list(range(scale * 2)))]
    handles += [h.id for h in client.enqueue_many(lrw_atx, list(range(scale)))]
    handles += [h.id for h in client.submit_many(lrw_chain, list(range(scale * 2)))]
    handles += [h.id for h in client.submit_many(lrw_fan, [6] * scale)]
    handles += [h.id for h in client.submit_many(lrw_fan_children, [3] * (scale // 2))]
    handles += [h.id for h in client.submit_many(lrw_parent, list(range(scale)))]
    handles += [h.id for h in client.submit_many(lrw_failing_chain, list(range(scale)))]
    signalled = [h.id for h in client.submit_many(lrw_signalled, list(range(scale)))]
    handles += signalled
    holds_sync = [h.id for h in client.enqueue_many(lrw_hold_sync, list(range(3)))]
    holds_async = [h.id for h in client.enqueue_many(lrw_hold_async, list(range(scale)))]
    handles += holds_sync + holds_async
    for run_id in signalled:
        client.signal(run_id, "lrw_go", run_id)
    wait_until(
        lambda: STARTED["hold_sync"] >= 3 and STARTED["hold_async"] >= scale,
        what=f"the held steps to start: {STARTED}",
    )
    for run_id in holds_sync + holds_async:
        client.cancel(run_id)

    def ended() -> bool:
        if open_runs(client) == 0:
            return True
        later(timedelta(seconds=2))  # retries' backoff passes (a lease is 30 s)
        return False

    wait_until(ended, timeout=60, interval=0.3, what="every run of the round to end")
    return len(handles)


def test_lrw_mixed_work_returns_the_worker_to_its_idle_size(
    client: Client,
    role: tuple[str, str],
    cyclone_admin_dsn: str,
    clock: Clock,
) -> None:
    """Rounds of every kind of work (standalone, chains, fan-outs, child runs, signals,
    retries, timeouts, failures, cancels, sync, async and transactional handlers) on one
    worker with metrics and tracing on: after each round the books are empty, and threads,
    descriptors and sessions do not grow from one round to the next."""
    dsn, name = role
    later = Later(clock)
    worker = role_worker(dsn, concurrency=8, metrics_port=0, tracing=TracerProvider())
    try:
        seen: list[dict[str, Any]] = []
        total = 0
        for scale in (4, 4, 4):
            total += one_round(client, later, scale)
            left = idle_books(worker)
            seen.append(
                {
                    "books": left,
                    "threads": thread_names(),
                    "fds": fds(),
                    "sessions": sessions(cyclone_admin_dsn, name),
                    "by_name": sessions_by_name(cyclone_admin_dsn, name),
                }
            )
        assert total > 250
        for n, snapshot in enumerate(seen, 1):
            assert all(v == 0 for v in snapshot["books"].values()), (n, snapshot["books"])
        first, last = seen[1], seen[2]  # the first round warms up the pools
        # The event loop's default executor ("asyncio_N") starts threads as it is used, up
        # to its own cap (min(32, cores + 4)): not compared.
        grown = Counter(
            {k: v for k, v in (last["threads"] - first["threads"]).items() if k != "asyncio"}
        )
        assert not grown, (first["threads"], last["threads"])
        assert last["threads"]["asyncio"] <= min(32, (os.cpu_count() or 1) + 4)
        # A pool may open a connection more in a later round (a socket and a session, up
        # to its size) when the machine is loaded; a leak per run would be hundreds.
        assert last["fds"] <= first["fds"] + 3, (first["fds"], last["fds"])
        # (How many transactional sessions a worker keeps: see the test below.)
        assert last["sessions"] <= first["sessions"] + 3, (first["by_name"], last["by_name"])
    finally:
        worker.stop()


# -- transactional sessions -------------------------------------------------------------------


@step(name="lrw_tx_hold", transactional=True, max_attempts=1)
def lrw_tx_hold(value: int, ctx: StepContext) -> int:
    ctx.connection.execute("INSERT INTO lrw_ledger VALUES (%s, 'hold')", (value,))
    started("tx_hold")
    gate("tx_hold").wait(20)
    return value


@step(name="lrw_atx_hold", transactional=True, max_attempts=1)
async def lrw_atx_hold(value: int, ctx: StepContext) -> int:
    await ctx.connection.execute("INSERT INTO lrw_ledger VALUES (%s, 'ahold')", (value,))
    started("atx_hold")
    await asyncio.to_thread(gate("atx_hold").wait, 20)
    return value


@pytest.mark.parametrize("kinds", ["sync", "sync-and-async"])
def test_lrw_transactional_handlers_keep_the_sessions_scale_md_lists(
    client: Client, role: tuple[str, str], cyclone_admin_dsn: str, kinds: str
) -> None:
    """scale.md: transactional steps hold up to ``concurrency`` sessions, twice that in a
    worker with both sync and async ones (a pool each, as psycopg's pools are either):
    a worker that ran N sync ones at once, then N async ones, kept 2N (the guide said
    N). At most N run at once either way."""
    dsn, name = role
    n = 4
    handlers = [lrw_tx_hold, lrw_atx_hold] if kinds == "sync-and-async" else [lrw_tx_hold]
    worker = Worker(dsn, handlers, concurrency=n, poll_interval=0.5)
    worker.start()
    try:
        for kind, tag in zip(handlers, ("tx_hold", "atx_hold"), strict=False):
            handles = client.enqueue_many(kind, list(range(n)))
            wait_until(lambda tag=tag: STARTED[tag] >= n, what=f"{n} {tag} handlers")  # type: ignore[misc]
            gate(tag).set()
            for handle in handles:
                assert handle.wait(timeout=20).state == RunState.COMPLETED
        idle_books(worker)
        by_name = sessions_by_name(cyclone_admin_dsn, name)
        assert by_name.get("cyclone-handler", 0) <= n * len(handlers), by_name
    finally:
        worker.stop()


# -- database clock jumps of days ---------------------------------------------------------------


def lease_ahead(dsn: str, shift: timedelta) -> bool:
    """Whether the running lrw_gated step's lease runs past the (moved) database clock."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT bool_and(lease_expiry > now() + %s) FROM cyclone_steps "
            "WHERE kind = 'lrw_gated' AND state = 'running'",
            (shift,),
        ).fetchone()
    return bool(row and row[0])


def test_lrw_a_worker_across_clock_jumps_of_days_keeps_its_leases_and_heartbeat(
    client: Client, cyclone_dsn: str, clock: Clock
) -> None:
    """The database clock jumps ahead by days, twice, while a handler runs: its lease is
    renewed under the new clock (by its heartbeat, or by a reclaim and a new claim of
    this very worker), the worker is live again in the registry, new work runs, and once
    the held step ends nothing is in flight."""
    later = Later(clock)
    worker = Worker(
        cyclone_dsn,
        ALL,
        concurrency=4,
        lease=3.0,
        poll_interval=0.5,
        scan_interval=0.5,
        metrics_port=0,
        tracing=TracerProvider(),
    )
    worker.start()
    try:
        held = client.enqueue(lrw_gated, 7)
        wait_until(lambda: STARTED["gated"] >= 1, what="the gated handler to start")
        for jump in (timedelta(days=2), timedelta(days=9)):
            later(jump)
            wait_until(
                lambda: lease_ahead(cyclone_dsn, later.shift),
                timeout=10,
                what=f"the lease renewed under a clock moved {later.shift}",
            )
            assert client.enqueue(lrw_echo, "after").result(timeout=10) == "after"
        wait_until(
            lambda: any(w["live"] and w["id"] == worker.id for w in client.workers()),
            timeout=12,
            what="the worker live again in the registry under the moved clock",
        )
        gate("gated").set()
        assert held.result(timeout=20) == 7
        left = idle_books(worker)
        # (The observers' books after a step claimed twice here: the test below.)
        core = {k: v for k, v in left.items() if not k.startswith(("metrics", "spans"))}
        assert all(v == 0 for v in core.values()), repr((left, dict(STARTED)))
    finally:
        worker.stop()


# -- every session killed, again and again ------------------------------------------------------


@step(name="lrw_tx_sturdy", transactional=True, max_attempts=10)
def lrw_tx_sturdy(value: int, ctx: StepContext) -> int:
    ctx.connection.execute("INSERT INTO lrw_ledger VALUES (%s, 'sturdy')", (value,))
    return value


@step(name="lrw_sturdy", max_attempts=10)
def lrw_sturdy(value: int, ctx: StepContext) -> int:
    ctx.emit({"n": value})
    time.sleep(0.002)
    return value


@workflow(name="lrw_sturdy_chain")
def lrw_sturdy_chain(x):  # type: ignore[no-untyped-def]
    return lrw_sturdy(lrw_tx_sturdy(lrw_sturdy(x)))


STURDY = (lrw_sturdy, lrw_tx_sturdy, lrw_sturdy_chain)


def test_lrw_a_worker_whose_sessions_are_all_killed_again_and_again_recovers(
    client: Client, role: tuple[str, str], cyclone_admin_dsn: str, clock: Clock
) -> None:
    """Every session of the worker is terminated three times in a row while it works: it
    finishes all the work (each run completed, each transactional write once), and its
    threads and sessions come back to what they were before the kills."""
    dsn, name = role
    later = Later(clock)
    worker = Worker(dsn, STURDY, concurrency=8, poll_interval=0.5, scan_interval=0.5)
    worker.start()
    try:
        warm = client.submit_many(lrw_sturdy_chain, list(range(40)))
        for handle in warm:
            assert handle.wait(timeout=20).state == RunState.COMPLETED
        idle_books(worker)
        before = {"threads": thread_names(), "by_name": sessions_by_name(cyclone_admin_dsn, name)}
        runs = client.submit_many(lrw_sturdy_chain, list(range(100, 180)))
        killed = []
        for _ in range(3):
            time.sleep(0.25)
            killed.append(kill_sessions(cyclone_admin_dsn, name))

        def ended() -> bool:
            if open_runs(client) == 0:
                return True
            later(timedelta(seconds=15))  # backoffs pass; leases of dead attempts expire
            return False

        assert all(k > 0 for k in killed), killed
        wait_until(ended, timeout=60, interval=0.5, what="every run to end after the kills")
        states = Counter(client.get_run(h.id).state for h in runs)
        assert states == {RunState.COMPLETED: len(runs)}, (states, killed)
        with psycopg.connect(cyclone_admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(_schema_of(dsn))))
            dup = conn.execute(
                "SELECT count(*) FROM (SELECT n FROM lrw_ledger WHERE tag = 'sturdy' "
                "GROUP BY n HAVING count(*) > 1) d"
            ).fetchone()
        assert dup == (0,)
        left = idle_books(worker)
        assert all(v == 0 for v in left.values()), left
        # Reconnected by now: a pool refills on its next call; give housekeeping a beat.
        wait_until(
            lambda: thread_names() == before["threads"],
            timeout=10,
            what=f"the threads of before the kills: {before['threads']} vs {thread_names()}",
        )
        after = sessions_by_name(cyclone_admin_dsn, name)
        # Each of the worker's own connections at most what it may open: its pool (3 + 2
        # completers), one heartbeat, one LISTEN, one for events, one per handler slot.
        bound = {"cyclone-worker": 5, "cyclone-heartbeat": 1, "cyclone-listen": 1}
        bound |= {"cyclone-emit": 1, "cyclone-handler": 8}
        over = {k: v for k, v in after.items() if v > bound.get(k, 0)}
        assert not over, (before["by_name"], after, killed)
    finally:
        worker.stop()


# -- a step reclaimed and claimed again by the same worker --------------------------------------

CONTEXTS: list[StepContext] = []


@step(name="lrw_attempts", max_attempts=1)
def lrw_attempts(value: int, ctx: StepContext) -> int:
    with _lock:
        CONTEXTS.append(ctx)
    started("attempts")
    while not gate("attempts").is_set() and not ctx.cancelled:
        time.sleep(0.01)
    return value


def test_lrw_a_step_reclaimed_and_claimed_again_here_stops_its_first_attempt_and_settles_books(
    client: Client, cyclone_dsn: str, clock: Clock
) -> None:
    """The database clock jumps past a running step's lease; the worker's own scanner
    reclaims it and the same worker claims it again while the first attempt still runs.
    The first attempt's lease is lost: its ``ctx.cancelled`` must be set ("its lease was
    lost"), and once both attempts are over the metrics and tracing observers hold
    nothing for the step."""
    CONTEXTS.clear()
    later = Later(clock)
    worker = Worker(
        cyclone_dsn,
        [lrw_attempts],
        concurrency=4,
        lease=3.0,
        poll_interval=0.5,
        scan_interval=0.5,
        metrics_port=0,
        tracing=TracerProvider(),
    )
    worker.start()
    try:
        handle = client.enqueue(lrw_attempts, 5)
        wait_until(lambda: STARTED["attempts"] >= 1, what="the first attempt to start")

        def twice() -> bool:
            if STARTED["attempts"] >= 2:
                return True
            later(timedelta(hours=1))
            return False

        wait_until(twice, timeout=20, interval=0.3, what="the step claimed a second time here")
        first = CONTEXTS[0]
        with contextlib.suppress(AssertionError):
            wait_until(lambda: first.cancelled, timeout=5, what="the first attempt cancelled")
        first_cancelled = first.cancelled
        gate("attempts").set()
        assert handle.result(timeout=20) == 5
        left = idle_books(worker)
        assert (first_cancelled, left) == (True, dict.fromkeys(left, 0)), repr(
            (first_cancelled, left)
        )
    finally:
        worker.stop()


# -- clients used for thousands of calls ------------------------------------------------------


def test_lrw_a_client_used_for_thousands_of_calls_keeps_a_bounded_number_of_sessions(
    start_worker: StartWorker, role: tuple[str, str], cyclone_admin_dsn: str
) -> None:
    """One Client shared by 8 threads: 1,200 submits, 240 results and 120 signals. Its
    sessions stay within pool_size plus the waits' one; closing it ends every session,
    its thread and its descriptors."""
    dsn, name = role
    start_worker(lrw_echo, lrw_signalled, concurrency=8)
    threads_before = threads_but("cyclone-handler")
    peak = 0
    client = Client(dsn, pool_size=4)
    try:

        def work(part: int) -> None:
            for i in range(150):
                handle = client.enqueue(lrw_echo, i)
                if i % 5 == 0:
                    assert handle.result(timeout=30) == i
            for i in range(15):
                run = client.submit(lrw_signalled, i)
                client.signal(run.id, "lrw_go", part)
                assert run.result(timeout=30) == part

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(work, p) for p in range(8)]
            while not all(f.done() for f in futures):
                peak = max(peak, sessions(cyclone_admin_dsn, name))
                time.sleep(0.1)
            for f in futures:
                f.result()
        peak = max(peak, sessions(cyclone_admin_dsn, name))
        assert peak <= 4 + 1, sessions_by_name(cyclone_admin_dsn, name)
        assert client._watcher.in_flight() == 0
    finally:
        client.close()
    wait_until(lambda: sessions(cyclone_admin_dsn, name) == 0, what="the client's sessions to end")
    # (Descriptors are not compared: the worker of this process opens its own meanwhile.)
    assert not threads_but("cyclone-handler") - threads_before, thread_names()


def test_lrw_an_async_client_used_for_thousands_of_calls_leaves_nothing_behind(
    start_worker: StartWorker, role: tuple[str, str], cyclone_admin_dsn: str
) -> None:
    """An AsyncClient: 1,000 submits, 200 results and 100 signals from concurrent tasks.
    Its sessions stay bounded; after close no task of its is left pending, and once the
    loop ends no thread, session or descriptor is left."""
    dsn, name = role
    start_worker(lrw_echo, lrw_signalled, concurrency=8)
    threads_before = threads_but("cyclone-handler")
    seen: dict[str, Any] = {}

    async def main() -> None:
        aclient = await asyncio.to_thread(AsyncClient, dsn, pool_size=4)
        limit = asyncio.Semaphore(16)

        async def one(i: int) -> None:
            async with limit:
                handle = await aclient.enqueue(lrw_echo, i)
                if i % 5 == 0:
                    assert await handle.result(timeout=30) == i
                if i % 10 == 0:
                    run = await aclient.submit(lrw_signalled, i)
                    await aclient.signal(run.id, "lrw_go", i)
                    assert await run.result(timeout=30) == i

        await asyncio.gather(*(one(i) for i in range(1000)))
        seen["sessions"] = sessions_by_name(cyclone_admin_dsn, name)
        await aclient.close()
        await asyncio.sleep(0.05)
        seen["pending"] = [
            t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()
        ]

    asyncio.run(main())
    assert sum(seen["sessions"].values()) <= 4 + 1, seen["sessions"]
    assert seen["pending"] == []
    wait_until(lambda: sessions(cyclone_admin_dsn, name) == 0, what="the client's sessions to end")
    wait_until(
        lambda: not threads_but("cyclone-handler") - threads_before,
        timeout=5,
        what=f"no thread left: {threads_before} vs {thread_names()}",
    )


def test_lrw_workers_started_and_stopped_again_and_again_leave_nothing_behind(
    client: Client, role: tuple[str, str], cyclone_admin_dsn: str
) -> None:
    """Six workers in a row in one process (a deploy loop, a test suite), each running
    sync, async and transactional steps: after each stop, no session is left, and the
    threads and descriptors are those after the first one (the client's pool and wait
    connection are made during the first)."""
    dsn, name = role
    threads_before: Counter[str] = Counter()
    fds_before = 0
    for cycle in range(4):
        worker = role_worker(dsn, metrics_port=0, tracing=TracerProvider())
        try:
            handles = client.enqueue_many(lrw_echo, list(range(20)))
            handles += client.enqueue_many(lrw_aecho, list(range(20)))
            handles += client.enqueue_many(lrw_tx, [0, 1, 2])
            handles += client.submit_many(lrw_chain, [1, 2])
            for handle in handles:
                handle.wait(timeout=20)
        finally:
            worker.stop()
        wait_until(
            lambda: sessions(cyclone_admin_dsn, name) == 0,
            what=f"cycle {cycle}: the worker's sessions to end",
        )
        if cycle == 0:
            time.sleep(0.5)
            threads_before, fds_before = thread_names(), fds()
            continue
        wait_until(
            lambda before=threads_before: not thread_names() - before,  # type: ignore[misc]
            timeout=5,
            what=f"cycle {cycle}: the threads of before: {threads_before} vs {thread_names()}",
        )
        wait_until(
            lambda before=fds_before: fds() <= before,  # type: ignore[misc]
            timeout=5,
            what=f"cycle {cycle}: at most the {fds_before} descriptors after the first",
        )
