"""Audit of draining workers, as a rolling deploy does (docs/howto/deploy.md, docs/guarantees.md
"Graceful stop loses nothing", docs/howto/versioning.md): a worker is stopped at each moment of
each kind of node, and a second worker (of the same registry, or of a second Registry of the
same or of a changed workflow) must finish every run with the right result, nothing lost and no
step's effect kept twice.

Handlers count their executions in ``CALLS`` (by tag) and block on ``gate(tag)``: the first
execution of a tag waits for its gate, later ones return at once. A test opens a gate during a
stop (the handler returns within the grace) or after it (the handler outlives the grace).
"""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cyclone_dsl import (
    Client,
    Concurrency,
    Registry,
    RunState,
    StepContext,
    StepState,
    Worker,
    child,
    for_each,
    step,
    wait_signal,
)
from cyclone_dsl.dsl.workflow import WorkflowDef
from cyclone_dsl.testing.failpoints import arm, disarm
from tests.waiting import HoldFirst, open_sockets, wait_until

CALLS: Counter[str] = Counter()
#: (tag, what) in the order handlers reported it: "start", "cancelled", "returned".
LOG: list[tuple[str, str]] = []
_GATES: defaultdict[str, threading.Event] = defaultdict(threading.Event)
_lock = threading.Lock()
#: The worker a handler may stop (tests of stop() called from a handler).
TARGET: list[Worker] = []


def gate(tag: str) -> threading.Event:
    with _lock:
        return _GATES[tag]


def _count(tag: str) -> int:
    with _lock:
        CALLS[tag] += 1
        LOG.append((tag, "start"))
        return CALLS[tag]


def _note(tag: str, what: str) -> None:
    with _lock:
        LOG.append((tag, what))


def _seen(tag: str, what: str) -> bool:
    with _lock:
        return (tag, what) in LOG


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    CALLS.clear()
    LOG.clear()
    _GATES.clear()
    TARGET.clear()
    yield
    with _lock:
        for event in _GATES.values():
            event.set()  # a handler still blocked in a stopped worker returns


@pytest.fixture
def workers(start_worker: Callable[..., Worker]) -> Iterator[Callable[..., Worker]]:
    """``start_worker`` polling and scanning every 0.2 s; at the end every gate is opened
    before the workers stop (a test may stop one first)."""
    yield functools.partial(start_worker, poll_interval=0.2, scan_interval=0.2)
    with _lock:
        for event in _GATES.values():
            event.set()


def stop_in_thread(worker: Worker, timeout: float | None = None) -> threading.Thread:
    """``worker.stop()`` on a thread of its own; join it to wait for the stop."""
    stopper = threading.Thread(target=worker.stop, args=(timeout,), name="drn-stop", daemon=True)
    stopper.start()
    wait_until(worker._stopping.is_set, timeout=5, what="the stop to begin")
    return stopper


def joined(thread: threading.Thread, timeout: float = 20) -> None:
    thread.join(timeout)
    assert not thread.is_alive(), f"{thread.name} still running after {timeout}s"


# -- handlers ---------------------------------------------------------------------------------


@step(name="drn_hold", max_attempts=1)
def drn_hold(tag: str, ctx: StepContext) -> str:
    """The first execution of ``tag`` waits for its gate (whatever the cancel says)."""
    if _count(tag) == 1:
        gate(tag).wait(30)
        _note(tag, "cancelled" if ctx.cancelled else "not cancelled")
        _note(tag, "returned")
        return f"{tag} first"
    return f"{tag} again"


@step(name="drn_hold_async", max_attempts=1)
async def drn_hold_async(tag: str, ctx: StepContext) -> str:
    """The async twin of drn_hold; a cancel of its task ends it."""
    if _count(tag) == 1:
        try:
            while not gate(tag).is_set():  # noqa: ASYNC110 - a thread sets it
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            _note(tag, "cancelled")
            raise
        _note(tag, "returned")
        return f"{tag} first"
    return f"{tag} again"


@step(name="drn_after")
def drn_after(text: str) -> str:
    _count(f"after {text}")
    return f"{text}!"


def _chain_sync(tag):  # type: ignore[no-untyped-def]
    return drn_after(drn_hold(tag))


def _chain_async(tag):  # type: ignore[no-untyped-def]
    return drn_after(drn_hold_async(tag))


CHAINS = {
    "sync": (_chain_sync, "drn_chain_sync", "drn_hold"),
    "async": (_chain_async, "drn_chain_async", "drn_hold_async"),
}


def deploy(builder: Callable[..., Any], name: str) -> tuple[Registry, WorkflowDef]:
    """One deploy: its own WorkflowDef of ``name`` and a Registry with its tree."""
    definition = WorkflowDef(builder, name)
    registry = Registry()
    registry.add_workflow_tree(definition)
    return registry, definition


# -- sync and async handlers at the stop ------------------------------------------------------


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_handler_returning_within_the_grace_completes_on_its_worker_and_the_next_on_the_new(
    cyclone_dsn: str, workers: Callable[..., Worker], flavour: str
) -> None:
    """The old deploy's worker is stopping with the first step running; a worker of the new
    deploy (its own Registry, the same graph) starts; the handler returns within the grace:
    its completion is kept (one execution), and the next step runs on the new worker only."""
    builder, name, node = CHAINS[flavour]
    old_registry, old = deploy(builder, name)
    new_registry, new = deploy(builder, name)
    assert old.def_version == new.def_version
    first = workers(registry=old_registry, grace=20)
    tag = f"in-grace-{flavour}"
    with Client(cyclone_dsn, registry=old_registry) as old_client:
        handle = old_client.submit(name, tag)
    wait_until(lambda: CALLS[tag], what="the first step to start")
    stopper = stop_in_thread(first)
    second = workers(registry=new_registry)
    time.sleep(0.3)  # the stopping worker must not claim more meanwhile
    gate(tag).set()
    joined(stopper)
    with Client(cyclone_dsn) as client:
        assert client.handle(handle.id).result(timeout=20) == f"{tag} first!"
        run = client.get_run(handle.id)
    held, after = run.step(node), run.step("drn_after")
    assert (held.state, held.lease_owner, held.attempt, held.reclaims) == (
        StepState.COMPLETED,
        first.id,
        0,
        0,
    )
    assert after.lease_owner == second.id
    assert CALLS[tag] == 1
    assert CALLS[f"after {tag} first"] == 1
    assert not _seen(tag, "cancelled")
    assert first.error is None


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_handler_outliving_the_grace_is_released_to_the_new_worker_and_its_late_end_fenced(
    cyclone_dsn: str, workers: Callable[..., Worker], flavour: str
) -> None:
    """Past the grace the lease is released (not left to expire: the lease is 60 s here),
    the new deploy's worker runs the step again at once, without a spent attempt or a
    reclaim; the first execution saw its cancel, and its late return changes nothing."""
    builder, name, node = CHAINS[flavour]
    old_registry, _ = deploy(builder, name)
    new_registry, _ = deploy(builder, name)
    first = workers(registry=old_registry, grace=0.3, lease=60)
    tag = f"past-grace-{flavour}"
    with Client(cyclone_dsn, registry=old_registry) as old_client:
        handle = old_client.submit(name, tag)
    wait_until(lambda: CALLS[tag], what="the first step to start")
    second = workers(registry=new_registry, lease=60)
    first.stop()
    with Client(cyclone_dsn) as client:
        assert client.handle(handle.id).result(timeout=20) == f"{tag} again!"
        if flavour == "sync":
            assert not _seen(tag, "returned")
            gate(tag).set()  # the first execution returns now, long after its release
            wait_until(lambda: _seen(tag, "returned"), what="the late return")
            time.sleep(0.3)
            assert _seen(tag, "cancelled")  # ctx.cancelled was set at the release
        else:
            wait_until(lambda: _seen(tag, "cancelled"), what="the task's cancel")
        run = client.get_run(handle.id)
    held = run.step(node)
    assert (held.state, held.output, held.lease_owner) == (
        StepState.COMPLETED,
        f"{tag} again",
        second.id,
    )
    assert (held.attempt, held.reclaims) == (0, 0)
    assert run.step("drn_after").output == f"{tag} again!"
    assert CALLS[tag] == 2
    assert CALLS[f"after {tag} again"] == 1
    assert CALLS[f"after {tag} first"] == 0


# -- transactional steps whose transaction is open at the stop --------------------------------


@step(name="drn_tx", transactional=True, max_attempts=1)
def drn_tx(tag: str, ctx: StepContext) -> str:
    """Writes a ledger row in its step's transaction; the first execution then waits: in
    Python for its gate, or in SQL (``sql`` tags) for 30 s."""
    n = _count(tag)
    ctx.connection.execute("INSERT INTO drn_ledger (tag, execution) VALUES (%s, %s)", (tag, n))
    if n == 1:
        if tag.startswith("sql"):
            ctx.connection.execute("SELECT pg_sleep(30)")
        else:
            gate(tag).wait(30)
        _note(tag, "returned")
    return f"{tag} {n}"


@step(name="drn_tx_async", transactional=True, max_attempts=1)
async def drn_tx_async(tag: str, ctx: StepContext) -> str:
    n = _count(tag)
    await ctx.connection.execute(
        "INSERT INTO drn_ledger (tag, execution) VALUES (%s, %s)", (tag, n)
    )
    if n == 1:
        if tag.startswith("sql"):
            await ctx.connection.execute("SELECT pg_sleep(30)")
        else:
            while not gate(tag).is_set():  # noqa: ASYNC110 - a thread sets it
                await asyncio.sleep(0.01)
        _note(tag, "returned")
    return f"{tag} {n}"


TX = {"sync": drn_tx, "async": drn_tx_async}


@pytest.fixture
def ledger(cyclone_dsn: str) -> Callable[[str], list[int]]:
    """Make the ledger table; ``ledger(tag)``: the executions whose rows were kept."""
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE drn_ledger (tag text, execution int)")

    def rows(tag: str) -> list[int]:
        with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
            found = conn.execute(
                "SELECT execution FROM drn_ledger WHERE tag = %s ORDER BY execution", (tag,)
            ).fetchall()
        return [int(r[0]) for r in found]

    return rows


@pytest.mark.parametrize("flavour", ["sync"])  # async: in a process of its own, below
def test_a_transactional_step_that_returns_within_the_grace_commits_once(
    client: Client,
    workers: Callable[..., Worker],
    ledger: Callable[[str], list[int]],
    flavour: str,
) -> None:
    handler = TX[flavour]
    first = workers(handler, grace=20)
    tag = f"tx-in-grace-{flavour}"
    handle = client.enqueue(handler, tag)
    wait_until(lambda: CALLS[tag], what="the handler to start")
    stopper = stop_in_thread(first)
    second = workers(handler)
    time.sleep(0.2)
    gate(tag).set()
    joined(stopper)
    assert handle.result(timeout=20) == f"{tag} 1"
    row = handle.get().steps[0]
    assert (row.lease_owner, row.attempt, row.reclaims) == (first.id, 0, 0)
    assert ledger(tag) == [1]
    assert CALLS[tag] == 1
    assert second.error is None


@pytest.mark.parametrize("where", ["python", "sql"])
@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_transactional_step_outliving_the_grace_rolls_back_and_runs_once_more(
    client: Client,
    workers: Callable[..., Worker],
    ledger: Callable[[str], list[int]],
    flavour: str,
    where: str,
) -> None:
    """Past the grace: the open transaction is rolled back (a statement in flight is
    interrupted), the lease released; the second worker's execution is the one kept. A
    sync handler blocked in Python returns later: its decision is refused, its row rolled
    back."""
    handler = TX[flavour]
    first = workers(handler, grace=0.3, lease=60)
    tag = f"{where}-tx-past-grace-{flavour}"
    handle = client.enqueue(handler, tag)
    wait_until(lambda: CALLS[tag], what="the handler to start")
    time.sleep(0.2)  # the first execution's INSERT is done (or pg_sleep is running)
    second = workers(handler, lease=60)
    first.stop()
    assert handle.result(timeout=20) == f"{tag} 2"
    gate(tag).set()
    if flavour == "sync" and where == "python":
        wait_until(lambda: _seen(tag, "returned"), what="the late return")
        time.sleep(0.3)
    row = handle.get().steps[0]
    assert (row.state, row.output, row.lease_owner) == (StepState.COMPLETED, f"{tag} 2", second.id)
    assert (row.attempt, row.reclaims) == (0, 0)
    assert ledger(tag) == [2]
    assert first.error is None


@pytest.mark.parametrize("flavour", ["sync", "async", "sync-tx", "async-tx"])
def test_a_completion_still_committing_at_the_stop_is_kept(
    client: Client,
    workers: Callable[..., Worker],
    ledger: Callable[[str], list[int]],
    flavour: str,
) -> None:
    """The handler returned before the stop; its completion is in its transaction (held at
    the engine's commit point) when the stop comes. The handler ran within the grace: its
    completion must be kept, by the first worker, and the step must not wait for its lease
    (5 s) to expire and run again."""
    handler = {
        "sync": drn_hold,
        "async": drn_hold_async,
        "sync-tx": drn_tx,
        "async-tx": drn_tx_async,
    }[flavour]
    first = workers(handler, grace=3, lease=5)
    tag = f"held-commit-{flavour}"
    gate(tag).set()
    hold = HoldFirst()
    arm("complete.before_commit", hold)
    try:
        handle = client.enqueue(handler, tag)
        assert hold.reached.wait(20), "the completion never reached its commit"
        stopper = stop_in_thread(first)
        second = workers(handler, lease=5)
        stopper.join(1)
        hold.release()
        joined(stopper)
    finally:
        disarm("complete.before_commit")
    wanted = f"{tag} 1" if flavour.endswith("tx") else f"{tag} first"
    assert handle.result(timeout=20) == wanted, "the completion was lost: another execution won"
    row = handle.get().steps[0]
    assert (row.lease_owner, row.attempt, row.reclaims) == (first.id, 0, 0)
    assert CALLS[tag] == 1
    if flavour.endswith("tx"):
        assert ledger(tag) == [1]
    assert second.error is None


_EXIT_SCRIPT = """
import sys, threading, time
import psycopg
from cyclone_dsl import Client, Worker
from tests.integration import test_drain_audit as m
dsn, grace, hold = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
worker = Worker(dsn, [m.drn_tx_async], poll_interval=0.1, grace=grace, lease=60).start()
tag = "exit-lock-" + sys.argv[2]
with Client(dsn) as client:
    handle = client.enqueue(m.drn_tx_async, tag)
    m.wait_until(lambda: m.CALLS[tag], what="the handler to start")
    with psycopg.connect(dsn) as lock:  # another transaction holds the run's row a moment
        lock.execute("SELECT 1 FROM cyclone_runs WHERE id = %s FOR UPDATE", (handle.id,))
        m.gate(tag).set()
        m.wait_until(lambda: m._seen(tag, "returned"), what="the handler to return")
        time.sleep(0.5)  # the handler returned: its completion waits for the run's lock
        stopper = threading.Thread(target=worker.stop)
        stopper.start()
        time.sleep(hold)
    stopper.join()
    print("stopped", flush=True)
    deadline = time.monotonic() + (5 if hold < grace else 0)  # past the grace: left running
    while time.monotonic() < deadline and handle.get().steps[0].state.value == "running":
        time.sleep(0.1)
    print("state", handle.get().steps[0].state.value, flush=True)
"""


@pytest.mark.parametrize("moment", ["in_grace", "past_grace"])
def test_an_async_transactional_completion_in_flight_at_the_stop_and_the_process_exit(
    cyclone_dsn: str, ledger: Callable[[str], list[int]], moment: str
) -> None:
    """An async transactional handler returns within the grace; its completion waits for
    its run's row, which another transaction holds. Seen: the stop went on as soon as the
    decision was taken and stopped the event loop under the completion, whose statement
    never got its answer: the step stayed running (until its lease expired, then ran
    again), and a thread of asyncio's default executor blocked forever in
    AsyncConnectionTx._call, so the interpreter never exited (it joins that thread).
    Now the stop waits for the commit within the grace (in_grace: the row is freed after
    1 s of a 5-s grace); past the grace (the row held 3 s, a 1-s grace) the stop returns
    and the process exits, the step left to its lease."""
    grace, hold = ("5", "1") if moment == "in_grace" else ("1", "3")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", _EXIT_SCRIPT, cyclone_dsn, grace, hold],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the worker's process did not exit after stop(); it printed {out!r}")
    assert "stopped" in out
    assert proc.returncode == 0
    if moment == "in_grace":
        assert "state completed" in out, out
        assert ledger(f"exit-lock-{grace}") == [1]
    else:
        assert ledger(f"exit-lock-{grace}") == []


# -- a fan-out whose items are partly running -------------------------------------------------


@step(name="drn_tags")
def drn_tags(prefix: str) -> list[str]:
    return [f"{prefix}-{i}" for i in range(4)]


def _fan(prefix):  # type: ignore[no-untyped-def]
    return for_each(drn_hold, over=drn_tags(prefix))


def test_a_fan_out_drained_with_items_running_finishes_on_the_new_deploy(
    cyclone_dsn: str, workers: Callable[..., Worker]
) -> None:
    """Two items run on the old worker (one returns within the grace, one outlives it), two
    wait: the new deploy's worker runs the released item and the waiting ones; every item
    completes once, the collected output is in item order."""
    old_registry, _ = deploy(_fan, "drn_fan")
    new_registry, _ = deploy(_fan, "drn_fan")
    first = workers(registry=old_registry, grace=1.0, concurrency=2, lease=60)
    with Client(cyclone_dsn, registry=old_registry) as old_client:
        handle = old_client.submit("drn_fan", "fan")
    tags = [f"fan-{i}" for i in range(4)]
    wait_until(lambda: sum(CALLS[t] for t in tags) == 2, what="two items to start")
    time.sleep(0.2)
    running = [t for t in tags if CALLS[t]]
    waiting = [t for t in tags if not CALLS[t]]
    assert len(running) == 2
    in_grace, past_grace = running
    stopper = stop_in_thread(first)
    gate(in_grace).set()
    for tag in waiting:
        gate(tag).set()
    joined(stopper)
    second = workers(registry=new_registry, concurrency=4, lease=60)
    with Client(cyclone_dsn) as client:
        result = client.handle(handle.id).result(timeout=20)
        gate(past_grace).set()
        wait_until(lambda: _seen(past_grace, "returned"), what="the late item's return")
        time.sleep(0.3)
        run = client.get_run(handle.id)
    wanted = [f"{t} again" if t == past_grace else f"{t} first" for t in tags]
    assert result == wanted
    items = {s.node: s for s in run.steps if s.item_of == "drn_hold"}
    assert [items[f"drn_hold[{i}]"].output for i in range(4)] == wanted
    owners = {t: items[f"drn_hold[{i}]"].lease_owner for i, t in enumerate(tags)}
    assert owners[in_grace] == first.id
    assert {owners[t] for t in [past_grace, *waiting]} == {second.id}
    assert all((s.attempt, s.reclaims) == (0, 0) for s in items.values())
    assert {t: CALLS[t] for t in tags} == {t: 2 if t == past_grace else 1 for t in tags}
    assert run.state is RunState.COMPLETED


# -- a child run started at the stop ----------------------------------------------------------


def _kid(x):  # type: ignore[no-untyped-def]
    return drn_after(x)


def _parent_v1(tag):  # type: ignore[no-untyped-def]
    return drn_after(child(WorkflowDef(_kid, "drn_kid"), drn_hold(tag)))


def _parent_v2(tag):  # type: ignore[no-untyped-def]
    return drn_after(drn_after(child(WorkflowDef(_kid, "drn_kid"), drn_hold(tag))))


def test_a_step_whose_completion_starts_a_child_at_the_stop_starts_it_once(
    cyclone_dsn: str, workers: Callable[..., Worker]
) -> None:
    """The step before a child node returns within the grace: its completion starts the
    child run (in its transaction); the new deploy's worker runs the child and the rest."""
    old_registry, _ = deploy(_parent_v1, "drn_parent")
    new_registry, _ = deploy(_parent_v1, "drn_parent")
    first = workers(registry=old_registry, grace=20)
    with Client(cyclone_dsn, registry=old_registry) as old_client:
        handle = old_client.submit("drn_parent", "kid")
    wait_until(lambda: CALLS["kid"], what="the parent's step to start")
    stopper = stop_in_thread(first)
    gate("kid").set()
    joined(stopper)
    workers(registry=new_registry)
    with Client(cyclone_dsn) as client:
        assert client.handle(handle.id).result(timeout=20) == "kid first!!"
        kids = client.children_of(handle.id)
        assert len(kids) == 1
        assert client.get_run(kids[0]["id"]).state is RunState.COMPLETED
    assert CALLS["kid"] == 1
    assert CALLS["after kid first"] == 1
    assert CALLS["after kid first!"] == 1


def test_a_run_of_the_old_shape_released_at_the_stop_waits_for_an_old_worker(
    cyclone_dsn: str, workers: Callable[..., Worker]
) -> None:
    """A change of shape: the old deploy's last worker is stopped with the old run's step
    running past the grace. The new deploy's worker leaves it alone (no attempt spent, shown
    as unserved); an old worker started later finishes it, with the old definition."""
    old_registry, old = deploy(_parent_v1, "drn_shape")
    new_registry, new = deploy(_parent_v2, "drn_shape")
    assert old.def_version != new.def_version
    first = workers(registry=old_registry, grace=0.3, lease=60)
    with Client(cyclone_dsn, registry=old_registry) as old_client:
        handle = old_client.submit("drn_shape", "shape")
    wait_until(lambda: CALLS["shape"], what="the old run's step to start")
    workers(registry=new_registry, lease=60)
    first.stop()
    with Client(cyclone_dsn, registry=new_registry) as new_client:
        fresh = new_client.submit("drn_shape", "fresh")
        gate("fresh").set()
        assert fresh.result(timeout=20) == "fresh first!!!"
        wait_until(
            lambda: any(
                u["def_version"] == old.def_version for u in new_client.stats()["unserved"]
            ),
            what="the old run's step to be shown as unserved",
        )
        row = new_client.get_run(handle.id).step("drn_hold")
        assert (row.state, row.attempt, row.reclaims) == (StepState.AVAILABLE, 0, 0)
        assert CALLS["shape"] == 1
        third = workers(registry=old_registry, lease=60)
        assert new_client.handle(handle.id).result(timeout=20) == "shape again!!"
        assert new_client.get_run(handle.id).step("drn_hold").lease_owner == third.id
    assert CALLS["shape"] == 2


# -- events emitted at the stop ---------------------------------------------------------------


@step(name="drn_emit", max_attempts=1)
def drn_emit(tag: str, ctx: StepContext) -> int:
    n = _count(tag)
    ctx.progress(0, 1, f"execution {n}")
    ctx.emit({"execution": n})
    if n == 1:
        gate(tag).wait(30)
        ctx.emit("late")
        _note(tag, "returned")
    return n


@pytest.mark.parametrize("when", ["in-grace", "past-grace"])
def test_events_emitted_at_the_stop_are_fenced_only_for_a_released_execution(
    client: Client, workers: Callable[..., Worker], when: str
) -> None:
    tag = f"emit-{when}"
    first = workers(drn_emit, grace=20 if when == "in-grace" else 0.3, lease=60)
    handle = client.enqueue(drn_emit, tag)
    wait_until(lambda: len(client.events_of(handle.id)) == 2, what="the first events")
    second = workers(drn_emit, lease=60)
    if when == "in-grace":
        stopper = stop_in_thread(first)
        gate(tag).set()
        joined(stopper)
        assert handle.result(timeout=20) == 1
        owner = first.id
    else:
        first.stop()
        assert handle.result(timeout=20) == 2
        gate(tag).set()
        wait_until(lambda: _seen(tag, "returned"), what="the late return")
        owner = second.id
    events = [
        (e.data, e.fenced)
        for e in client.events_of(handle.id)
        if not (isinstance(e.data, dict) and "done" in e.data)
    ]
    progress = [
        (e.data.get("message"), e.fenced)
        for e in client.events_of(handle.id)
        if e.kind == "progress" and isinstance(e.data, dict)
    ]
    if when == "in-grace":
        assert events == [({"execution": 1}, False), ("late", False)]
        assert progress == [("execution 1", False)]
    else:
        assert sorted(events, key=str) == sorted(
            [({"execution": 1}, True), ({"execution": 2}, False), ("late", True)], key=str
        )
        assert sorted(progress) == [("execution 1", True), ("execution 2", False)]
    assert handle.get().steps[0].lease_owner == owner


# -- a retry's backoff pending at the stop ----------------------------------------------------


@step(name="drn_flaky", max_attempts=3)
def drn_flaky(tag: str) -> str:
    if _count(tag) == 1:
        raise ValueError("first execution fails")
    return f"{tag} ok"


def test_a_retry_pending_its_backoff_at_the_stop_runs_on_the_new_worker_after_it(
    client: Client,
    workers: Callable[..., Worker],
    clock: Callable[[timedelta], None],
) -> None:
    first = workers(drn_flaky)
    handle = client.enqueue(drn_flaky, "retry")
    wait_until(lambda: handle.get().steps[0].attempt == 1, what="the first attempt to fail")
    row = handle.get().steps[0]
    assert row.state is StepState.AVAILABLE
    first.stop()
    second = workers(drn_flaky)
    row = handle.get().steps[0]
    assert (row.state, row.attempt, row.scheduled_at) == (StepState.AVAILABLE, 1, row.scheduled_at)
    assert CALLS["retry"] == 1  # the stop neither ran it early nor dropped its backoff
    clock(timedelta(hours=1))
    assert handle.result(timeout=20) == "retry ok"
    row = handle.get().steps[0]
    assert (row.attempt, row.reclaims, row.lease_owner) == (1, 0, second.id)
    assert CALLS["retry"] == 2


# -- a wait signalled during the stop ---------------------------------------------------------


def _signalled(tag):  # type: ignore[no-untyped-def]
    return drn_after(wait_signal("drn_go"))


SIGNALLED = WorkflowDef(_signalled, "drn_signalled")


def test_a_wait_signalled_while_its_worker_stops_is_taken_by_the_next_worker(
    client: Client, workers: Callable[..., Worker]
) -> None:
    first = workers(SIGNALLED, drn_hold, grace=20)
    handle = client.submit(SIGNALLED, "sig")
    blocker = client.enqueue(drn_hold, "blocker")
    wait_until(lambda: CALLS["blocker"], what="the blocker to start")
    assert handle.get().step("drn_go").state is StepState.WAITING_SIGNAL
    stopper = stop_in_thread(first)
    client.signal(handle.id, "drn_go", "payload")
    time.sleep(0.5)  # a stopping worker claims nothing more
    assert handle.get().step("drn_after").state is StepState.AVAILABLE
    gate("blocker").set()
    joined(stopper)
    assert blocker.result(timeout=5) == "blocker first"
    second = workers(SIGNALLED, drn_hold)
    assert handle.result(timeout=20) == "payload!"
    assert handle.get().step("drn_after").lease_owner == second.id
    assert CALLS["after payload"] == 1


# -- an idle worker, and a claim in flight at the stop ----------------------------------------


@step(name="drn_keyed", concurrency=Concurrency(limit=5))
def drn_keyed(tag: str) -> str:
    _count(tag)
    return f"{tag} done"


def test_an_idle_worker_stops_at_once_and_is_recorded_stopped(
    client: Client, workers: Callable[..., Worker]
) -> None:
    worker = workers(drn_hold, grace=30)
    gate("idle-warmup").set()
    assert client.enqueue(drn_hold, "idle-warmup").result(timeout=20) == "idle-warmup first"
    stopper = stop_in_thread(worker)
    joined(stopper, timeout=10)  # nothing runs: the 30 s grace is not waited for
    row = next(w for w in client.workers() if w["id"] == worker.id)
    assert row["stopped_at"] is not None
    late = client.enqueue(drn_hold, "after-stop")
    time.sleep(0.3)
    assert late.get().steps[0].state is StepState.AVAILABLE
    assert worker.error is None


@pytest.mark.parametrize("grace", ["0", "5"])
def test_a_claim_in_flight_at_the_stop_is_run_in_the_grace_or_released(
    client: Client, workers: Callable[..., Worker], grace: str
) -> None:
    """The claim statement is under way (held after its gate look) when the stop comes: what
    it claims is run within the grace, or released at once (grace 0); nothing waits for the
    60 s lease, nothing is lost."""
    handle = client.enqueue(drn_keyed, f"claimed-{grace}")
    hold = HoldFirst()
    arm("claim.after_gate_look", hold)
    try:
        first = workers(drn_keyed, grace=float(grace), lease=60)
        assert hold.reached.wait(20), "no claim reached the gate look"
        first.request_stop()
        hold.release()
        first.stop()
    finally:
        disarm("claim.after_gate_look")
    row = handle.get().steps[0]
    if row.state is StepState.COMPLETED:
        assert (row.lease_owner, CALLS[f"claimed-{grace}"]) == (first.id, 1)
    else:
        assert grace == "0", f"claimed within a grace of 5 s, yet {row.state}"
        assert (row.state, row.attempt, row.reclaims) == (StepState.AVAILABLE, 0, 0)
        second = workers(drn_keyed, lease=60)
        assert handle.result(timeout=20) == f"claimed-{grace} done"
        assert handle.get().steps[0].lease_owner == second.id
    assert handle.result(timeout=5) == f"claimed-{grace} done"


# -- the worker's own state after the stop ----------------------------------------------------


WORKER_SESSIONS = ("worker", "heartbeat", "listen", "handler", "emit")


def _worker_backends(dsn: str) -> list[str]:
    names = [f"cyclone-{what}-{os.getpid()}" for what in WORKER_SESSIONS]
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT application_name FROM pg_stat_activity WHERE application_name = ANY(%s)",
            (names,),
        ).fetchall()
    return sorted(str(r[0]) for r in rows)


def _threads() -> set[threading.Thread]:
    return set(threading.enumerate())


def test_after_the_stop_no_thread_connection_or_session_of_the_worker_is_left(
    cyclone_dsn: str, workers: Callable[..., Worker], ledger: Callable[[str], list[int]]
) -> None:
    """A worker that ran sync, async, transactional (both) and emitting handlers, stopped:
    its threads end, its sockets close, and it holds no session on the server."""
    threads, sockets = _threads(), open_sockets()
    worker = workers(drn_hold, drn_hold_async, drn_tx, drn_tx_async, drn_emit, grace=5)
    with Client(cyclone_dsn) as client:
        for tag in ("st-s", "st-a", "st-t", "st-ta", "st-e"):
            gate(tag).set()
        handles = [
            client.enqueue(drn_hold, "st-s"),
            client.enqueue(drn_hold_async, "st-a"),
            client.enqueue(drn_tx, "st-t"),
            client.enqueue(drn_tx_async, "st-ta"),
            client.enqueue(drn_emit, "st-e"),
        ]
        for h in handles:
            h.result(timeout=20)
    assert _worker_backends(cyclone_dsn)
    worker.stop()
    wait_until(lambda: not _worker_backends(cyclone_dsn), timeout=10, what="no worker session")
    wait_until(
        lambda: not [t for t in _threads() - threads if t.is_alive()],
        timeout=10,
        what="the worker's threads to end",
    )
    wait_until(lambda: open_sockets() <= sockets, timeout=10, what="the worker's sockets to close")


def test_a_handler_outliving_the_stop_closes_its_transactional_session_when_it_returns(
    cyclone_dsn: str, workers: Callable[..., Worker], ledger: Callable[[str], list[int]]
) -> None:
    """stop() cannot take the connection from a sync transactional handler blocked in
    Python; once the handler returns, its rolled back session must go (the pool was closed)."""
    worker = workers(drn_tx, grace=0.2)
    with Client(cyclone_dsn) as client:
        handle = client.enqueue(drn_tx, "outlives")
        wait_until(lambda: CALLS["outlives"], what="the handler to start")
        worker.stop()
        gate("outlives").set()
        wait_until(lambda: _seen("outlives", "returned"), what="the late return")
        wait_until(lambda: not _worker_backends(cyclone_dsn), timeout=10, what="no worker session")
        assert handle.get().steps[0].state is StepState.AVAILABLE
    assert ledger("outlives") == []


# -- stop() and request_stop() called in every order ------------------------------------------


def test_request_stop_then_stop_waits_for_the_running_handler(
    client: Client, workers: Callable[..., Worker]
) -> None:
    worker = workers(drn_hold, grace=20)
    handle = client.enqueue(drn_hold, "rs")
    wait_until(lambda: CALLS["rs"], what="the handler to start")
    worker.request_stop()  # returns at once
    gate("rs-late").set()  # if a claim in flight at the request takes it, it ends at once
    late = client.enqueue(drn_hold, "rs-late")
    stopper = threading.Thread(target=worker.stop, name="drn-stop", daemon=True)
    stopper.start()
    stopper.join(0.3)
    assert stopper.is_alive(), "stop() did not wait for the running handler"
    gate("rs").set()
    joined(stopper)
    row = handle.get().steps[0]
    assert (row.state, row.lease_owner) == (StepState.COMPLETED, worker.id)
    # A claim the fetch loop began as the request came (seen once on a loaded machine)
    # may take it: it then runs within the grace. Else it is left for another worker.
    ran = (late.get().steps[0].state, CALLS["rs-late"])
    assert ran in ((StepState.AVAILABLE, 0), (StepState.COMPLETED, 1)), ran


def test_stop_with_a_short_timeout_returns_and_a_second_stop_waits_for_the_end(
    client: Client, workers: Callable[..., Worker]
) -> None:
    worker = workers(drn_hold, grace=20)
    handle = client.enqueue(drn_hold, "to")
    wait_until(lambda: CALLS["to"], what="the handler to start")
    worker.stop(timeout=0.2)  # returns with the handler still running
    row = handle.get().steps[0]
    assert (row.state, row.lease_owner) == (StepState.RUNNING, worker.id)
    stoppers = [
        threading.Thread(target=worker.stop, name=f"drn-stop-{i}", daemon=True) for i in range(2)
    ]
    for s in stoppers:
        s.start()
    time.sleep(0.3)
    assert all(s.is_alive() for s in stoppers)
    gate("to").set()
    for s in stoppers:
        joined(s)
    assert handle.result(timeout=5) == "to first"
    assert handle.get().steps[0].lease_owner == worker.id
    assert CALLS["to"] == 1
    assert worker.error is None
    worker.stop()  # stopped: at once


@step(name="drn_stops_itself", max_attempts=1)
def drn_stops_itself(how: str) -> str:
    if _count(how) == 1:
        if how == "request":
            TARGET[0].request_stop()
        else:
            TARGET[0].stop()
        _note(how, "stop returned")
    return f"{how} {CALLS[how]}"


def test_request_stop_from_a_handler_keeps_its_result_and_stops_the_worker(
    client: Client, workers: Callable[..., Worker]
) -> None:
    worker = workers(drn_stops_itself, grace=20)
    TARGET.append(worker)
    handle = client.enqueue(drn_stops_itself, "request")
    assert handle.result(timeout=20) == "request 1"
    wait_until(
        lambda: next(w for w in client.workers() if w["id"] == worker.id)["stopped_at"],
        what="the worker to stop",
    )
    assert handle.get().steps[0].lease_owner == worker.id
    assert CALLS["request"] == 1
    worker.stop()
    assert worker.error is None


def test_stop_from_a_handler_returns_and_the_step_completes(
    client: Client, workers: Callable[..., Worker]
) -> None:
    """stop() called by a running handler waited for the running handlers, its caller
    among them: for the whole grace, and the caller's result was then dropped with its
    lease (the step ran again). It now returns at once, as request_stop() does, and the
    handler's result is kept by its worker."""
    worker = workers(drn_stops_itself, grace=20)
    TARGET.append(worker)
    handle = client.enqueue(drn_stops_itself, "stop")
    assert handle.result(timeout=10) == "stop 1"
    assert handle.get().steps[0].lease_owner == worker.id
    assert _seen("stop", "stop returned")
    wait_until(
        lambda: next(w for w in client.workers() if w["id"] == worker.id)["stopped_at"],
        what="the worker to stop",
    )
    assert CALLS["stop"] == 1
    worker.stop()
    assert worker.error is None


# -- what the docs say about grace ------------------------------------------------------------


@step(name="drn_until_cancelled", max_attempts=1)
def drn_until_cancelled(tag: str, ctx: StepContext) -> str:
    if _count(tag) == 1:
        started = time.monotonic()
        ctx.wait_cancelled(30)
        CANCEL_AFTER[tag] = time.monotonic() - started
        return f"{tag} first"
    return f"{tag} again"


CANCEL_AFTER: dict[str, float] = {}


@pytest.mark.parametrize("grace", ["0", "1.5"])
def test_running_handlers_get_the_grace_then_their_cancel_and_their_lease_back(
    client: Client, workers: Callable[..., Worker], grace: str
) -> None:
    """ "running handlers get --grace seconds; leases still held are then released, so
    another worker starts those steps at once": the cancel comes no earlier than the grace
    (a lower bound only: a loaded machine makes it later), the attempt is not spent."""
    CANCEL_AFTER.clear()
    tag = f"grace-{grace}"
    worker = workers(drn_until_cancelled, grace=float(grace), lease=60)
    handle = client.enqueue(drn_until_cancelled, tag)
    wait_until(lambda: CALLS[tag], what="the handler to start")
    asked = time.monotonic()
    worker.stop()
    took = time.monotonic() - asked
    wait_until(lambda: tag in CANCEL_AFTER, what="the handler to see its cancel")
    assert took >= float(grace) * 0.9
    row = handle.get().steps[0]
    assert (row.state, row.attempt, row.reclaims) == (StepState.AVAILABLE, 0, 0)
    second = workers(drn_until_cancelled, lease=60)
    assert handle.result(timeout=20) == f"{tag} again"
    assert handle.get().steps[0].lease_owner == second.id
