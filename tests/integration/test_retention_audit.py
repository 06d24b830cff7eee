"""Audit of retention and purging of ended runs: when a run may go, what goes with it,
and what still works once it is gone.

Time is moved with the ``clock`` fixture (this process's database clock), never slept
through: a run ended "now" is past a retention of an hour once the clock is moved two
hours on. A retention pass is observed through a *canary*: a run that ended before the
clock moved and whose 10 minute step retention has then passed; the statement that
deletes it judged every other ended run at the same time.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from cyclone_dsl import (
    AsyncClient,
    Client,
    Concurrency,
    Debounce,
    InvalidArgument,
    InvalidGraph,
    Permanent,
    RunFailed,
    RunHandle,
    RunNotFound,
    RunState,
    StepContext,
    StepState,
    Worker,
    child,
    step,
    wait_signal,
    wait_timer,
    workflow,
)
from cyclone_dsl.cli.main import run as cyclone
from cyclone_dsl.worker.scanner import FULL_PASS_EVERY
from tests.waiting import PROMPT, scanner_passes, wait_until

HOUR = timedelta(hours=1)
gate = threading.Event()
entered = threading.Event()
failing = threading.Event()

Clock = Callable[[datetime | timedelta], None]


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    gate.clear()
    entered.clear()
    failing.clear()
    LATE.clear()
    yield
    gate.set()  # a handler still blocked must not hold its worker's stop
    failing.clear()


# -- handlers and workflows --------------------------------------------------------------


@step(name="rna_echo")
def rna_echo(x: object) -> object:
    return x


@step(name="rna_canary", retention=timedelta(minutes=10))
def rna_canary(x: object) -> object:
    return x


@step(name="rna_keep_2h", retention=timedelta(hours=2))
def rna_keep_2h(x: object) -> object:
    return x


@step(name="rna_keep_1m", retention=60)
def rna_keep_1m(x: object) -> object:
    return x


@step(name="rna_keep_1d", retention=timedelta(days=1))
def rna_keep_1d(x: object) -> object:
    return x


@step(name="rna_gate")
def rna_gate(x: object) -> object:
    entered.set()
    gate.wait(20)
    return x


LATE: dict[str, object] = {}


@step(name="rna_gate_emit")
def rna_gate_emit(x: object, ctx: StepContext) -> object:
    """Blocks on the gate, then emits and beats, saying in LATE how that went."""
    entered.set()
    gate.wait(20)
    try:
        ctx.emit({"late": x})
        LATE["emit"] = "returned"
    except Exception as exc:
        LATE["emit"] = exc
    LATE["heartbeat"] = ctx.heartbeat()
    return x


@step(name="rna_boom", max_attempts=1)
def rna_boom(x: object) -> object:
    raise Permanent(f"boom {x}")


@step(name="rna_flaky", max_attempts=1)
def rna_flaky(x: int) -> int:
    if failing.is_set():
        raise Permanent("flaky")
    return x + 100


@step(name="rna_emitter")
def rna_emitter(x: object, ctx: StepContext) -> object:
    ctx.emit({"x": x})
    return x


@step(name="rna_limited", concurrency=Concurrency(limit=1))
def rna_limited(x: object) -> object:
    return x


@step(name="rna_capped", queue="rna_capped_q")
def rna_capped(x: object) -> object:
    return x


@step(name="rna_ledger_write", transactional=True)
def rna_ledger_write(x: int, ctx: StepContext) -> int:
    ctx.connection.execute("INSERT INTO rna_ledger VALUES (%s)", (ctx.run_id,))
    entered.set()
    gate.wait(20)
    return x


@workflow(name="rna_mixed")
def rna_mixed(x):  # type: ignore[no-untyped-def]
    return rna_keep_1m(rna_keep_2h(x))


@workflow(name="rna_signal_wf")
def rna_signal_wf(x):  # type: ignore[no-untyped-def]
    return rna_echo(wait_signal("go"))


@workflow(name="rna_gated_wf")
def rna_gated_wf(x):  # type: ignore[no-untyped-def]
    return rna_gate(x)


@workflow(name="rna_timer_wf")
def rna_timer_wf(x):  # type: ignore[no-untyped-def]
    return rna_echo(x, after=[wait_timer(HOUR)])


@workflow(name="rna_kid")
def rna_kid(x):  # type: ignore[no-untyped-def]
    return rna_echo(x)


@workflow(name="rna_parent")
def rna_parent(x):  # type: ignore[no-untyped-def]
    return rna_gate(child(rna_kid, x))


@workflow(name="rna_long_kid")
def rna_long_kid(x):  # type: ignore[no-untyped-def]
    return rna_keep_1d(x)


@workflow(name="rna_failing_parent")
def rna_failing_parent(x):  # type: ignore[no-untyped-def]
    return rna_boom(child(rna_long_kid, x))


@workflow(name="rna_kept_parent")
def rna_kept_parent(x):  # type: ignore[no-untyped-def]
    return rna_keep_2h(child(rna_kid, x))


@workflow(name="rna_flaky_kid")
def rna_flaky_kid(x):  # type: ignore[no-untyped-def]
    return rna_flaky(x)


@workflow(name="rna_contained")
def rna_contained(x):  # type: ignore[no-untyped-def]
    kid = child(rna_flaky_kid, x)
    rna_echo(kid, on_dep_failure="cancel_branch")
    return rna_keep_2h(x)


@workflow(name="rna_two")
def rna_two(x):  # type: ignore[no-untyped-def]
    return rna_flaky(rna_echo(x))


@workflow(name="rna_events_wf")
def rna_events_wf(x):  # type: ignore[no-untyped-def]
    return rna_emitter(rna_echo(x))


@workflow(name="rna_one_at_a_time", concurrency=Concurrency(limit=1))
def rna_one_at_a_time(x):  # type: ignore[no-untyped-def]
    return rna_echo(x)


HANDLERS = (
    rna_echo,
    rna_canary,
    rna_keep_2h,
    rna_keep_1m,
    rna_keep_1d,
    rna_gate,
    rna_boom,
    rna_flaky,
    rna_emitter,
)
CHILDREN = (rna_kid, rna_long_kid, rna_flaky_kid)


def start(start_worker: Callable[..., Worker], *extra: object, **options: object) -> Worker:
    options.setdefault("retention", HOUR)
    options.setdefault("scan_interval", 0.05)
    return start_worker(*HANDLERS, *CHILDREN, *extra, **options)


def ids(client: Client) -> set[int]:
    return {r.id for r in client.list_runs(limit=1000)}


def canary(client: Client) -> int:
    """An ended run that a retention pass deletes once the clock is 10 minutes on."""
    handle = client.enqueue(rna_canary, "canary")
    assert handle.result(timeout=10) == "canary"
    return handle.id


def exists(client: Client, run_id: int) -> bool:
    try:
        client.get_run(run_id)
    except RunNotFound:
        return False
    return True


def until_gone(client: Client, run_id: int, what: str) -> None:
    wait_until(lambda: not exists(client, run_id), timeout=10, what=what)


def count(dsn: str, query: str, *params: object) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(query, params).fetchone()
    assert row is not None
    return int(row[0])


def child_of(client: Client, run_id: int) -> int:
    (row,) = client.children_of(run_id)
    return int(row["id"])


def race(action: Callable[[], object], purge: Callable[[], int]) -> tuple[object, int]:
    """Run ``action`` and ``purge`` at once: what the action gave (or raised), and how many
    runs the purge deleted."""
    barrier = threading.Barrier(2)
    out: dict[str, object] = {}

    def call(key: str, fn: Callable[[], object]) -> None:
        barrier.wait()
        try:
            out[key] = fn()
        except Exception as exc:
            out[key] = exc

    threads = [
        threading.Thread(target=call, args=("action", action)),
        threading.Thread(target=call, args=("purge", purge)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    purged = out["purge"]
    assert isinstance(purged, int), f"purge raised {purged!r}"
    return out["action"], purged


# -- 1. the retention scanner, by the database clock -------------------------------------


def test_the_scanner_deletes_a_run_only_once_its_retention_passed(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    start(start_worker)
    kept = client.enqueue(rna_echo, 1)
    assert kept.result(timeout=10) == 1
    first = canary(client)
    clock(timedelta(minutes=30))
    until_gone(client, first, "the canary to go")
    assert client.get_run(kept.id).state is RunState.COMPLETED  # 30 min < 1 h
    clock(timedelta(minutes=61))
    until_gone(client, kept.id, "the run to go past its retention")


def test_one_retention_pass_a_minute_serves_every_scanner(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    """The retention pass walks every kept run, so it runs once a minute (by the database
    clock) for all scanners together: a run that expires less than a minute after the last
    pass of any scanner waits for the next minute's."""
    workers = [start(start_worker), start(start_worker)]
    kept = client.enqueue(rna_keep_2h, 1)
    assert kept.result(timeout=10) == 1
    first = canary(client)
    clock(2 * HOUR - timedelta(seconds=20))  # past the canary's 10 min, not kept's 2 h
    until_gone(client, first, "the canary to go")
    mark = retention_mark(cyclone_dsn)  # that pass's, by the moved clock
    clock(mark + timedelta(seconds=21))  # past kept's 2 h, 21 s after that pass
    for worker in workers:
        scanner_passes(worker, FULL_PASS_EVERY + 2)  # a look that runs every pass among them
    # The database clock runs on with the real one: on a machine slow enough, the minute
    # has passed by now, and a second pass is right. Either way, passes are a minute apart.
    later = retention_mark(cyclone_dsn)
    assert later == mark or later - mark >= timedelta(minutes=1), (mark, later)
    assert exists(client, kept.id) == (later == mark), "a second retention pass within the minute"
    clock(mark + timedelta(seconds=90))
    until_gone(client, kept.id, "the next minute's retention pass")


def retention_mark(dsn: str) -> datetime:
    """When the last retention pass ran, by the database clock as it was moved."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT marked_at FROM cyclone_ext_scan_marks WHERE pass = 'retention'"
        ).fetchone()
    assert row is not None, "no retention pass yet"
    marked: datetime = row[0]
    return marked


def test_a_retention_mark_ahead_of_the_clock_does_not_hold_the_pass_back(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    """A last pass marked ahead of the database clock (the clock was moved back since) is
    not a recent one: retention runs."""
    worker = start(start_worker)
    ended = client.enqueue(rna_echo, 1)
    assert ended.result(timeout=10) == 1
    scanner_passes(worker)  # its first look, with its retention pass, is over
    with psycopg.connect(cyclone_dsn) as conn:
        conn.execute(
            "INSERT INTO cyclone_ext_scan_marks (pass, marked_at)"
            " VALUES ('retention', now() + interval '1 day')"
            " ON CONFLICT (pass) DO UPDATE SET marked_at = EXCLUDED.marked_at"
        )
    clock(2 * HOUR)
    until_gone(client, ended.id, "the run to go past its retention")


def test_the_longest_step_retention_wins_and_a_short_one_beats_the_default(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    """A run with a 2 h step and a 1 min step is kept 2 h, past the worker's 1 h; a run
    whose only step keeps 1 min goes after 1 min, before the worker's 1 h; and
    ``enqueue(retention=3 h)`` overrides that step's own 1 min."""
    start(start_worker, rna_mixed)
    mixed = client.submit(rna_mixed, 1)
    assert mixed.result(timeout=10) == 1
    short = client.enqueue(rna_keep_1m, 2)
    assert short.result(timeout=10) == 2
    long = client.enqueue(rna_keep_1m, 3, retention=3 * HOUR)
    assert long.result(timeout=10) == 3
    clock(timedelta(minutes=90))
    until_gone(client, short.id, "the 1 min run to go")
    assert ids(client) == {mixed.id, long.id}
    clock(timedelta(minutes=121))
    until_gone(client, mixed.id, "the 2 h run to go")
    assert ids(client) == {long.id}
    clock(timedelta(minutes=181))
    until_gone(client, long.id, "the 3 h run to go")


def test_no_run_that_has_not_ended_is_deleted_however_old(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    """Ten years on, a run waiting for a signal, a paused run and a running parent with a
    completed child run are all kept (the child too: its parent has not completed)."""
    start(start_worker, rna_signal_wf, rna_parent)
    waiting = client.submit(rna_signal_wf, 1)
    paused = client.submit(rna_signal_wf, 2)
    parent = client.submit(rna_parent, 3)
    wait_until(entered.is_set, what="the parent's gated step to run")
    kid = child_of(client, parent.id)
    wait_until(lambda: paused.get().step("go").state is StepState.WAITING_SIGNAL, what="the wait")
    client.pause(paused.id)
    first = canary(client)
    clock(timedelta(days=3650))
    until_gone(client, first, "the canary to go")
    assert client.get_run(waiting.id).state is RunState.RUNNING
    assert client.get_run(paused.id).state is RunState.PAUSED
    assert client.get_run(parent.id).state is RunState.RUNNING
    assert client.get_run(kid).state is RunState.COMPLETED
    assert client.count_purgeable() == 0
    assert client.purge() == 0
    gate.set()
    assert parent.result(timeout=10) == 3
    # The worker's retention pass may take the parent and its child before this purge does.
    assert client.purge() in (0, 1, 2)
    assert ids(client) == {waiting.id, paused.id}


def test_retention_counts_from_the_last_end_of_a_retried_run(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    """A run cancelled two hours ago, retried and completed just now, is kept four hours
    after its first end: its 3 h retention counts from its last."""
    start(start_worker, rna_gated_wf, retention=3 * HOUR)
    handle = client.submit(rna_gated_wf, 1)
    client.cancel(handle.id)
    wait_until(lambda: client.get_run(handle.id).is_terminal, what="the cancel")
    clock(2 * HOUR)
    gate.set()
    client.retry(handle.id, "rna_gate")
    assert handle.result(timeout=10) == 1
    first = canary(client)
    clock(4 * HOUR)
    until_gone(client, first, "the canary to go")
    assert client.get_run(handle.id).state is RunState.COMPLETED


def test_worker_retention_none_keeps_ended_runs_for_ever(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    """``retention=None`` turns the retention pass off, step retentions included; the
    scanner still runs (timers fire: two timer canaries show two later passes)."""
    start(start_worker, rna_timer_wf, retention=None)
    short = client.enqueue(rna_keep_1m, 1)
    assert short.result(timeout=10) == 1
    plain = client.enqueue(rna_echo, 2)
    assert plain.result(timeout=10) == 2
    first = client.submit(rna_timer_wf, "t1")
    clock(timedelta(days=3650))
    assert first.result(timeout=10) == "t1"
    second = client.submit(rna_timer_wf, "t2")
    clock(timedelta(days=3650) + 2 * HOUR)
    assert second.result(timeout=10) == "t2"
    assert {short.id, plain.id} <= ids(client)


def last_run(client: Client) -> int:
    """The last run id of the one schedule (0: none yet)."""
    return client.list_schedules()[0].last_run_id or 0


def test_a_schedule_retention_keeps_its_runs_and_a_purge_clears_last_run_id(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    base = datetime(2031, 7, 1, 12, 0, 30, tzinfo=UTC)
    clock(base)
    made = client.schedule(
        rna_kid, "*/5 * * * *", id="rna_sched", location="UTC", input=7, retention=3 * HOUR
    )
    assert made.retention_s == 3 * 3600
    start(start_worker, scan_interval=0.05)
    clock(made.next_run_at + timedelta(seconds=30))
    fired: int = wait_until(lambda: last_run(client), what="the first fire")
    assert client.wait(fired, timeout=10).state is RunState.COMPLETED
    clock(made.next_run_at + 2 * HOUR)  # past the worker's 1 h, not the schedule's 3 h
    second: int = wait_until(lambda: (s := last_run(client)) != fired and s, what="a fire")
    assert client.wait(second, timeout=10).state is RunState.COMPLETED
    client.enable_schedule("rna_sched", False)  # no more fires while the clock moves
    first = canary(client)
    clock(made.next_run_at + 2 * HOUR + timedelta(minutes=30))
    until_gone(client, first, "the canary to go")
    assert client.get_run(fired).state is RunState.COMPLETED
    assert client.purge() == 2
    (after,) = client.list_schedules()
    assert after.last_run_id is None
    assert not after.enabled and after.last_error is None


# -- 2. child runs -----------------------------------------------------------------------


def test_a_child_of_a_failed_parent_outlives_it_by_its_own_retention_then_goes(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    start(start_worker, rna_failing_parent)
    parent = client.submit(rna_failing_parent, 1)
    with pytest.raises(RunFailed):
        parent.result(timeout=10)
    kid = child_of(client, parent.id)
    assert client.get_run(kid).state is RunState.COMPLETED
    assert client.count_purgeable() == 2  # a purge takes both
    clock(2 * HOUR)
    until_gone(client, parent.id, "the failed parent to go past its 1 h")
    # The child was kept while its failed parent existed (a retry of the parent reopens
    # it); with the parent gone, its own retention (a step's 1 d) applies, as to any run.
    first = canary(client)
    clock(2 * HOUR + timedelta(minutes=30))
    until_gone(client, first, "the canary to go")
    assert exists(client, kid), "deleted before its own retention passed"
    clock(timedelta(days=1, hours=3))
    until_gone(client, kid, "the child run to go past its own 1 d")


def test_a_completed_parent_keeps_on_once_its_child_run_expired_and_replays_it(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    """The parent completed (its own step keeps it 2 h): its child run goes after the
    worker's 1 h, the parent stays readable, and a replay of its child node starts a
    new child run (the old one, which made the replay refuse, is gone)."""
    start(start_worker, rna_kept_parent)
    parent = client.submit(rna_kept_parent, 1)
    assert parent.result(timeout=10) == 1
    kid = child_of(client, parent.id)
    clock(timedelta(minutes=90))
    until_gone(client, kid, "the child run to go")
    assert client.children_of(parent.id) == []
    assert parent.get().step("rna_kid").state is StepState.COMPLETED
    client.retry(parent.id, "rna_kid", force=True)
    assert parent.result(timeout=10) == 1
    fresh = child_of(client, parent.id)
    assert fresh != kid
    assert client.get_run(fresh).state is RunState.COMPLETED


def test_purge_racing_a_retry_of_a_contained_child_node(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """The parent completed, its child run failed (contained): a purge may take the child
    while a retry of the parent's child node reopens it. Either the retry reopens it (purge
    0) or the purge wins and the retry starts a fresh child: one completed child, always."""
    start(start_worker, rna_contained, retention=None)
    outcomes: set[int] = set()
    with Client(cyclone_dsn) as other:
        for i in range(4):
            failing.set()
            parent = client.submit(rna_contained, i)
            assert parent.result(timeout=10) == i
            assert client.get_run(child_of(client, parent.id)).state is RunState.FAILED
            failing.clear()
            got, purged = race(
                lambda p=parent: other.retry(p.id, "rna_flaky_kid"),  # type: ignore[misc]
                lambda: client.purge(states=("failed",)),
            )
            assert got is None, f"retry raised {got!r}"
            outcomes.add(purged)
            wait_until(
                lambda p=parent: p.get().step("rna_echo").state is StepState.COMPLETED,  # type: ignore[misc]
                what="the retried branch",
            )
            assert [c["state"] for c in client.children_of(parent.id)] == ["completed"]
            assert parent.get().step("rna_echo").output == i + 100
            assert client.purge() == 2
    assert outcomes <= {0, 1}


# -- 3. purge ------------------------------------------------------------------------------


def test_purge_older_than_follows_the_database_clock(
    client: Client, start_worker: Callable[..., Worker], clock: Clock
) -> None:
    start(start_worker, retention=None)
    handle = client.enqueue(rna_echo, 1)
    assert handle.result(timeout=10) == 1
    assert client.count_purgeable(older_than=HOUR) == 0
    assert client.purge(older_than=HOUR) == 0
    clock(2 * HOUR)
    assert client.count_purgeable(older_than=HOUR) == 1
    assert client.purge(older_than=3 * HOUR) == 0
    assert client.purge(older_than=HOUR) == 1
    assert ids(client) == set()


ATTEMPTS = "cyclone_ext_attempts"
RUN_TABLES = (
    "cyclone_steps",
    "cyclone_deps",
    "cyclone_step_inputs",
    "cyclone_signals",
    "cyclone_schedule_fires",
    "cyclone_ext_events",
    "cyclone_ext_event_seqs",
    "cyclone_ext_trace_context",
    "cyclone_ext_debounce",
    "cyclone_ext_forks",
    "cyclone_ext_gates",
    "cyclone_ext_fan_out_limits",
)


def test_nothing_of_a_purged_run_is_left(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """Steps, deps, inputs, signals, events, attempts, gates, debounce windows, fork links:
    every row of a purged run goes with it, and another run's rows stay."""
    start(start_worker, rna_events_wf, rna_two, rna_limited, retention=None)
    events = client.submit(rna_events_wf, 1, debounce=Debounce(delay=timedelta(seconds=0.01)))
    assert events.result(timeout=10) == 1
    assert client.events_of(events.id)
    failing.set()
    source = client.submit(rna_two, 2)
    with pytest.raises(RunFailed):
        source.result(timeout=10)
    failing.clear()
    fork = client.fork(source.id, "rna_flaky")
    assert fork.result(timeout=10) == 102
    limited = client.enqueue(rna_limited, 3)
    assert limited.result(timeout=10) == 3
    keep = client.enqueue(rna_echo, 4)
    assert keep.result(timeout=10) == 4
    gone = {events.id, source.id, fork.id, limited.id}
    for run_id in gone:
        assert client.get_run(run_id).is_terminal
    kept_steps = count(cyclone_dsn, "SELECT count(*) FROM cyclone_steps WHERE run_id = %s", keep.id)
    written = {
        t for t in (*RUN_TABLES, ATTEMPTS) if count(cyclone_dsn, f"SELECT count(*) FROM {t}")
    }
    assert written >= {"cyclone_steps", "cyclone_deps", ATTEMPTS, "cyclone_ext_events"}
    assert written >= {"cyclone_ext_debounce", "cyclone_ext_forks", "cyclone_ext_gates"}
    assert client.purge(older_than=timedelta(0)) == 5
    assert ids(client) == set()
    for table in RUN_TABLES:
        assert count(cyclone_dsn, f"SELECT count(*) FROM {table}") == 0, table
    assert count(cyclone_dsn, f"SELECT count(*) FROM {ATTEMPTS}") == 0
    assert kept_steps == 1


def test_every_call_about_a_purged_run_is_run_not_found(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start(start_worker, retention=None)
    handle = client.enqueue(rna_echo, 1)
    assert handle.result(timeout=10) == 1
    other = client.enqueue(rna_echo, 2)
    assert other.result(timeout=10) == 2
    assert client.purge(states=("completed",)) == 2
    calls: dict[str, Callable[[], object]] = {
        "get": handle.get,
        "result": lambda: handle.result(timeout=5),
        "wait": lambda: handle.wait(timeout=5),
        "events": lambda: list(handle.events(timeout=5)),
        "events_of": lambda: client.events_of(handle.id),
        "outcome": lambda: client.outcome(handle.id),
        "progress": lambda: client.progress(handle.id),
        "dependencies": lambda: client.dependencies(handle.id),
        "signals_of": lambda: client.signals_of(handle.id),
        "children_of": lambda: client.children_of(handle.id),
        "why_waiting": lambda: client.why_waiting(handle.id),
        "cancel": lambda: client.cancel(handle.id),
        "pause": lambda: client.pause(handle.id),
        "resume": lambda: client.resume(handle.id),
        "retry": lambda: client.retry(handle.id, "rna_echo"),
        "replay": lambda: client.retry(handle.id, "rna_echo", force=True),
        "fork": lambda: client.fork(handle.id, "rna_echo"),
        "signal": lambda: client.signal(handle.id, "go", 1),
    }
    for name, call in calls.items():
        try:
            call()
        except RunNotFound:
            continue
        pytest.fail(f"{name} of a purged run did not raise RunNotFound")

    async def via_async() -> None:
        async with AsyncClient(client.dsn) as aclient:
            for call in (aclient.get_run, aclient.result, aclient.wait):
                with pytest.raises(RunNotFound):
                    await call(handle.id)

    asyncio.run(via_async())
    assert client.list_runs() == []
    assert client.list_runs(state="completed", workflow="rna_echo") == []
    assert client.run_counts() == {}
    stats = client.stats()
    assert all(row["running"] == 0 for row in stats["queues"])


def test_waiters_of_a_run_purged_as_it_ends_get_its_result_or_run_not_found(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """result(), wait() and events() block on a running run; it ends and is purged at
    once: each waiter returns or raises RunNotFound, none hangs to its timeout."""
    start(start_worker, rna_gated_wf, retention=None)
    handle = client.submit(rna_gated_wf, 5)
    wait_until(entered.is_set, what="the step to run")
    got: dict[str, object] = {}

    def waiter(name: str, call: Callable[[], object]) -> None:
        try:
            got[name] = call()
        except Exception as exc:
            got[name] = exc

    calls: dict[str, Callable[[], object]] = {
        "result": lambda: handle.result(timeout=15),
        "wait": lambda: handle.wait(timeout=15).state,
        "events": lambda: list(handle.events(timeout=15)),
    }
    threads = [threading.Thread(target=waiter, args=item) for item in calls.items()]
    for t in threads:
        t.start()
    gate.set()
    wait_until(lambda: client.purge() == 1, timeout=10, what="the purge of the ended run")
    for t in threads:
        t.join(10)
    assert set(got) == set(calls), f"a waiter hangs: {got}"
    assert got["result"] == 5 or isinstance(got["result"], RunNotFound), got
    assert got["wait"] is RunState.COMPLETED or isinstance(got["wait"], RunNotFound), got
    assert got["events"] == [] or isinstance(got["events"], RunNotFound), got


def test_purge_racing_a_replay_of_the_same_run(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """Either the replay wins (the run runs again, held at the gate: the purge takes
    nothing) or the purge does (RunNotFound): never a raw error, nor a run half reset."""
    start(start_worker, rna_gated_wf, retention=None)
    outcomes: set[str] = set()
    with Client(cyclone_dsn) as other:
        for i in range(6):
            gate.set()
            handle = client.submit(rna_gated_wf, i)
            assert handle.result(timeout=10) == i
            gate.clear()
            got, purged = race(
                lambda h=handle: other.retry(h.id, "rna_gate", force=True),  # type: ignore[misc]
                lambda: client.purge(states=("completed",)),
            )
            if isinstance(got, RunNotFound):
                outcomes.add("purged")
                assert purged == 1
                assert not exists(client, handle.id)
            else:
                outcomes.add("replayed")
                assert got is None, f"replay raised {got!r}"
                assert purged == 0
                assert client.get_run(handle.id).state is RunState.RUNNING
                gate.set()
                assert handle.result(timeout=10) == i
                (replayed,) = handle.get().steps
                assert replayed.attempts[0].outcome == "replayed"
                assert client.purge() == 1
            assert ids(client) == set()
    assert outcomes


def test_a_handler_still_running_when_its_run_is_purged_ends_quietly(
    client: Client, start_worker: Callable[..., Worker], caplog: pytest.LogCaptureFixture
) -> None:
    """A cancelled run whose handler still runs is purged: the handler's emit returns
    (the event has nowhere to go), its heartbeat says the lease is lost, nothing is
    logged as an error, and the worker goes on serving."""
    start(start_worker, rna_gate_emit, retention=None)
    handle = client.enqueue(rna_gate_emit, 1)
    wait_until(entered.is_set, what="the handler to run")
    client.cancel(handle.id)
    assert client.purge() == 1
    gate.set()
    wait_until(lambda: "heartbeat" in LATE, what="the handler to end")
    assert LATE == {"emit": "returned", "heartbeat": False}
    after = client.enqueue(rna_echo, 2)
    assert after.result(timeout=10) == 2
    assert ids(client) == {after.id}
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.fixture
def ledger(cyclone_dsn: str) -> Iterator[Callable[[], int]]:
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE rna_ledger (run_id bigint)")
    try:
        yield lambda: count(cyclone_dsn, "SELECT count(*) FROM rna_ledger")
    finally:
        with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
            conn.execute("DROP TABLE rna_ledger")


def test_the_writes_of_a_transactional_step_whose_run_was_purged_roll_back(
    client: Client, start_worker: Callable[..., Worker], ledger: Callable[[], int]
) -> None:
    worker = start(start_worker, rna_ledger_write, retention=None)
    handle = client.enqueue(rna_ledger_write, 1)
    wait_until(entered.is_set, what="the handler's write")
    client.cancel(handle.id)
    assert client.purge() == 1
    gate.set()
    worker.stop()  # waits for the handler's end
    assert ledger() == 0
    assert ids(client) == set()


def test_keys_and_windows_of_purged_runs_are_free_again(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start(start_worker, rna_signal_wf, retention=None)
    once = client.submit_once(rna_kid, 1, key="rna-once")
    assert once.result(timeout=10) == 1
    window = Debounce(delay=HOUR)
    held = client.submit(rna_kid, 2, debounce=window)
    assert held.created
    assert client.submit(rna_kid, 3, debounce=window).id == held.id
    client.cancel(held.id)
    unique = client.enqueue(rna_gate, 4, unique_key="rna-unique")
    wait_until(entered.is_set, what="the unique step to run")
    client.cancel(unique.id)
    assert client.purge() == 3
    again = client.submit_once(rna_kid, 5, key="rna-once")
    assert again.created and again.id != once.id
    assert again.result(timeout=10) == 5
    fresh = client.submit(rna_kid, 6, debounce=window)
    assert fresh.created and fresh.id != held.id
    gate.set()
    reused = client.enqueue(rna_gate, 7, unique_key="rna-unique")
    assert reused.created
    assert reused.result(timeout=10) == 7


def test_a_purge_frees_the_limit_slots_its_runs_held(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A step concurrency, a run concurrency and a queue cap, each of 1: the slot of a
    holder that ended is free at once; so must be the slot of one that was purged (it was
    held until the scanner's slow pass, while stats() showed it free)."""
    client.set_queue_limit("rna_capped_q", 1)  # before the worker starts: it reads caps then
    worker = start(
        start_worker,
        rna_limited,
        rna_capped,
        rna_one_at_a_time,
        retention=None,
        queues=("default", "rna_capped_q"),
        # Its slow pass (which frees lost slots) runs at start only: a slot the purge left
        # held would stay held for the rest of the test, however long the waits below.
        scan_interval=3600.0,
    )
    scanner = worker._scanner
    assert scanner is not None
    submits: dict[str, Callable[[int], RunHandle]] = {
        "step concurrency": lambda x: client.enqueue(rna_limited, x),
        "run concurrency": lambda x: client.submit(rna_one_at_a_time, x),
        "queue cap": lambda x: client.enqueue(rna_capped, x),
    }
    for submit in submits.values():
        assert submit(1).result(timeout=10) == 1
        assert submit(2).result(timeout=PROMPT) == 2  # the slot of an ended holder is free
    # The start's pass is over before the purge: only the purge can free the slots now.
    wait_until(lambda: scanner.passes >= 1, timeout=PROMPT, what="the scanner's first pass")
    assert client.purge() == 6
    after = {name: submit(3) for name, submit in submits.items()}

    def stuck() -> list[str]:
        return [name for name, h in after.items() if not client.get_run(h.id).is_terminal]

    try:
        wait_until(lambda: not stuck(), timeout=PROMPT, what="the steps after the purge to run")
    except AssertionError:
        pytest.fail(f"still waiting for a slot nobody holds: {stuck()}")


def test_a_fork_outlives_its_purged_source_and_forks_again(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start(start_worker, rna_two, retention=None)
    failing.set()
    source = client.submit(rna_two, 1)
    with pytest.raises(RunFailed):
        source.result(timeout=10)
    failing.clear()
    fork = client.fork(source.id, "rna_flaky")
    assert fork.result(timeout=10) == 101
    assert client.purge(states=("failed",)) == 1
    run = fork.get()
    assert run.forked_from == source.id
    assert run.step("rna_echo").copied and run.step("rna_echo").output == 1
    again = client.fork(fork.id, "rna_flaky")
    assert again.result(timeout=10) == 101
    assert again.get().forked_from == fork.id
    assert client.purge() == 2


# -- 4. bad retention values and the command line ------------------------------------------

BAD_RETENTIONS = [0, -1, timedelta(0), timedelta(seconds=-1), "7d", float("nan"), True]
BAD_RETENTIONS += [float("inf"), timedelta(days=366_000), 1e-7]


def bad_call_site(i: int, value: Any) -> object:
    """A workflow whose one node is given ``retention=value``."""

    @workflow(name=f"rna_bad_call_site_{i}")
    def bad(x):  # type: ignore[no-untyped-def]
        return rna_echo(x, retention=value)

    return bad


def test_a_bad_retention_is_a_typed_error_wherever_it_is_given(client: Client) -> None:
    """The decorator, enqueue, enqueue_many, a schedule and a node option of a workflow
    refuse it with InvalidArgument (InvalidGraph for the node), and nothing is written."""
    for i, value in enumerate(BAD_RETENTIONS):
        with pytest.raises(InvalidArgument, match="retention"):
            step(name="rna_bad_retention", retention=value)(rna_echo.fn)  # type: ignore[call-overload]
        with pytest.raises(InvalidArgument, match="retention"):
            client.enqueue(rna_echo, 1, retention=value)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="retention"):
            client.enqueue_many(rna_echo, [1], retention=value)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="retention"):
            client.schedule(rna_kid, "* * * * *", id="rna_bad", retention=value)  # type: ignore[arg-type]

        with pytest.raises((InvalidGraph, InvalidArgument), match="retention"):
            client.submit(bad_call_site(i, value), 1)
    assert client.list_runs() == []
    assert client.list_schedules() == []


def test_cyclone_purge_dry_run_and_purge_follow_the_clock(
    client: Client,
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    clock: Clock,
    capsys: pytest.CaptureFixture[str],
) -> None:
    start(start_worker, retention=None)
    handle = client.enqueue(rna_echo, 1)
    assert handle.result(timeout=10) == 1
    purge = ["--dsn", cyclone_dsn, "purge", "--older-than", "1h", "--json"]
    assert cyclone([*purge, "--dry-run"]) == 0
    assert '"would_delete": 0' in capsys.readouterr().out
    clock(2 * HOUR)
    assert cyclone([*purge, "--dry-run"]) == 0
    assert '"would_delete": 1' in capsys.readouterr().out
    assert cyclone([*purge, "--state", "failed", "--yes"]) == 0
    assert '"deleted": 0' in capsys.readouterr().out
    assert cyclone([*purge, "--yes"]) == 0
    assert '"deleted": 1' in capsys.readouterr().out
    assert ids(client) == set()


def test_cyclone_refuses_bad_retentions_and_cutoffs_with_exit_2(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    start(start_worker, retention=None)
    handle = client.enqueue(rna_echo, 1)
    assert handle.result(timeout=10) == 1
    dsn = ["--dsn", cyclone_dsn]
    assert cyclone([*dsn, "worker", __name__, "--retention", "0s"]) == 2
    assert cyclone([*dsn, "worker", __name__, "--retention", "soon"]) == 2
    assert cyclone([*dsn, "purge", "--older-than", "400000d", "--yes"]) == 2
    assert cyclone([*dsn, "purge", "--older-than", "-1h", "--yes"]) == 2
    assert cyclone([*dsn, "purge", "--batch-size", "0", "--yes"]) == 2
    add = [*dsn, "schedules", "add", "rna_kid", "* * * * *", "-m", __name__, "--id", "rna_s"]
    assert cyclone([*add, "--retention", "0s"]) == 2
    assert client.list_schedules() == []
    assert ids(client) == {handle.id}


def test_cyclone_scan_with_retention_none_keeps_ended_runs(
    client: Client,
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    clock: Clock,
) -> None:
    start(start_worker, scanners=False)
    short = client.enqueue(rna_keep_1m, 1)
    assert short.result(timeout=10) == 1
    clock(timedelta(days=3650))
    assert cyclone(["--dsn", cyclone_dsn, "scan", "--once", "--retention", "none"]) == 0
    assert ids(client) == {short.id}
    assert cyclone(["--dsn", cyclone_dsn, "scan", "--once", "--retention", "7d"]) == 0
    assert ids(client) == set()


def test_cyclone_scan_refuses_a_zero_retention(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    start(start_worker, scanners=False)
    handle = client.enqueue(rna_echo, 1)
    assert handle.result(timeout=10) == 1
    code = cyclone(["--dsn", cyclone_dsn, "scan", "--once", "--retention", "0s"])
    assert ids(client) == {handle.id}, "the scan deleted a run that ended a moment ago"
    assert code == 2
