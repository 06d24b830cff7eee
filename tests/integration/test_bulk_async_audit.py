"""Audit of operations in bulk (``cancel_many``, ``retry_many``, ``resume_many``) and of the
AsyncClient's parity with the Client, through the public API on a real PostgreSQL.

Bulk: dry runs act on nothing, the counts are honest, batches of any size act on each
run once, runs changing between batches, parents and their child runs in one batch, a
refused run in the middle of a batch, a call stopped between batches, filters (names,
queues, end times), bad filters and arguments (typed, nothing written), the CLI.
Async: the same results and typed errors as the sync client, coroutines cancelled or
timed out, and a client closed while a call is in flight.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from cyclone_dsl import (
    AsyncClient,
    BulkResult,
    Client,
    ClientClosed,
    CycloneError,
    Delivery,
    InvalidArgument,
    Permanent,
    RunFilter,
    RunState,
    StepState,
    Worker,
    child,
    step,
    wait_signal,
    workflow,
)
from cyclone_dsl.cli.main import main
from tests.waiting import wait_until

FAILING: set[str] = set()
CALLS: Counter[str] = Counter()
_lock = threading.Lock()


@pytest.fixture(autouse=True)
def _reset() -> None:
    FAILING.clear()
    CALLS.clear()
    GATE.clear()


# -- handlers and workflows ----------------------------------------------------------------


@step(name="bua_task", max_attempts=1)
def bua_task(tag: str) -> str:
    with _lock:
        CALLS[tag] += 1
    if tag in FAILING:
        raise Permanent(f"{tag} is set to fail")
    return f"done {tag}"


@step(name="bua_after")
def bua_after(value: object) -> str:
    return f"after {value}"


GATE = threading.Event()


@step(name="bua_gated", max_attempts=1)
def bua_gated(tag: str) -> str:
    with _lock:
        CALLS[f"start-{tag}"] += 1
    GATE.wait(10)
    with _lock:
        CALLS[f"end-{tag}"] += 1
    return tag


@step(name="bua_q1_step", queue="bua_q1", max_attempts=1)
def bua_q1_step(tag: str) -> str:
    return tag


@step(name="bua_q2_step", queue="bua_q2", max_attempts=1)
def bua_q2_step(tag: str) -> str:
    return tag


@workflow(name="bua_one")
def bua_one(tag):  # type: ignore[no-untyped-def]
    return bua_task(tag)


@workflow(name="bua_gated_wf")
def bua_gated_wf(tag):  # type: ignore[no-untyped-def]
    return bua_after(bua_gated(tag))


@workflow(name="bua_wait")
def bua_wait(tag):  # type: ignore[no-untyped-def]
    return bua_after(wait_signal("go"))


@workflow(name="bua_wait_other")
def bua_wait_other(tag):  # type: ignore[no-untyped-def]
    return bua_after(wait_signal("go"))


@workflow(name="bua_parent")
def bua_parent(tag):  # type: ignore[no-untyped-def]
    return bua_after(child(bua_wait, tag))


HANDLERS = [bua_task, bua_after, bua_gated, bua_q1_step, bua_q2_step]


# -- helpers -------------------------------------------------------------------------------


def states(client: Client, run_ids: list[int]) -> list[RunState]:
    return [client.get_run(r).state for r in run_ids]


def snapshot(client: Client, run_ids: list[int]) -> list[tuple[Any, ...]]:
    """Everything an operation could change on these runs: run and step states."""
    out = []
    for r in run_ids:
        run = client.get_run(r)
        out.append(
            (run.state, run.finished_at, run.paused_at, tuple((s.node, s.state) for s in run.steps))
        )
    return out


def waiting_runs(client: Client, wf: object, n: int) -> list[int]:
    return [h.id for h in client.submit_many(wf, [f"t{i}" for i in range(n)])]


def with_kid(client: Client, tag: str) -> tuple[int, int]:
    """A bua_parent run and its child run (which waits for a signal)."""
    p = client.submit(bua_parent, tag).id
    kid = wait_until(lambda: client.children_of(p), what="the child run")[0]["id"]
    return p, kid


def counts(result: BulkResult) -> tuple[int, int, int]:
    return result.matched, result.acted, result.skipped


# -- bad input: typed, nothing written -----------------------------------------------------


@pytest.mark.parametrize("field", ["workflows", "states", "queues", "error_kinds"])
@pytest.mark.parametrize("value", [5, b"failed", {"failed": 1}])
def test_a_criterion_that_is_neither_a_name_nor_a_list_is_invalid_argument(
    field: str, value: Any
) -> None:
    """It raised a raw TypeError (or took a mapping's keys, or bytes as numbers)."""
    with pytest.raises(InvalidArgument, match="one or a list of them"):
        RunFilter(**{field: value})


def test_bad_bulk_arguments_are_typed_on_both_clients_and_act_on_nothing(
    client: Client, cyclone_dsn: str
) -> None:
    runs = waiting_runs(client, bua_wait, 2)
    client.pause(runs[1])
    before = snapshot(client, runs)
    where = RunFilter(workflows="bua_wait")
    bad: list[dict[str, Any]] = [
        {"dry_run": "yes"},
        {"dry_run": None},
        {"batch_size": 10_001},
        {"batch_size": True},
        {"batch_size": 2.0},
        {"progress": 5},
    ]
    messages: dict[str, list[str]] = {"sync": [], "async": []}
    for op in ("cancel_many", "retry_many", "resume_many"):
        for kwargs in bad:
            with pytest.raises(InvalidArgument) as refused:
                getattr(client, op)(where, **kwargs)
            messages["sync"].append(str(refused.value))

    async def go() -> None:
        async with AsyncClient(cyclone_dsn) as aclient:
            for op in ("cancel_many", "retry_many", "resume_many"):
                for kwargs in bad:
                    with pytest.raises(InvalidArgument) as refused:
                        await getattr(aclient, op)(where, **kwargs)
                    messages["async"].append(str(refused.value))

    asyncio.run(go())
    assert messages["async"] == messages["sync"]
    assert snapshot(client, runs) == before


# -- dry runs ------------------------------------------------------------------------------


def test_dry_runs_of_every_operation_change_nothing_and_call_no_progress(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS)
    FAILING.add("f")
    failed = client.submit(bua_one, "f").id
    wait_until(lambda: client.get_run(failed).state.is_terminal, what="the run to fail")
    running, paused, cancelled = waiting_runs(client, bua_wait, 3)
    client.pause(paused)
    client.cancel(cancelled)
    ids = [failed, running, paused, cancelled]
    before = snapshot(client, ids)
    seen: list[BulkResult] = []
    everything = RunFilter(match_all=True)
    cancel = client.cancel_many(everything, dry_run=True, progress=seen.append)
    retry = client.retry_many(RunFilter(states=["failed", "cancelled"]), dry_run=True)
    resume = client.resume_many(everything, dry_run=True, progress=seen.append)
    assert [(r.action, r.dry_run, *counts(r), r.done) for r in (cancel, retry, resume)] == [
        ("cancel", True, 2, 0, 0, True),
        ("retry", True, 2, 0, 0, True),
        ("resume", True, 1, 0, 0, True),
    ]
    assert seen == []
    assert snapshot(client, ids) == before
    assert CALLS["f"] == 1


# -- batches -------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 4, 11, 12])
def test_any_batch_size_acts_on_each_run_exactly_once(client: Client, batch_size: int) -> None:
    runs = waiting_runs(client, bua_wait, 11)
    other = waiting_runs(client, bua_wait_other, 2)
    seen: list[BulkResult] = []
    result = client.cancel_many(
        RunFilter(workflows="bua_wait"), batch_size=batch_size, progress=seen.append
    )
    assert counts(result) == (11, 11, 0)
    pages = -(-11 // batch_size) + (1 if 11 % batch_size == 0 else 0)
    assert len(seen) == pages
    assert [s.done for s in seen] == [False] * (pages - 1) + [True]
    assert [s.acted for s in seen] == sorted(s.acted for s in seen)
    assert states(client, runs) == [RunState.CANCELLED] * 11
    assert states(client, other) == [RunState.RUNNING] * 2
    # Each run went through the transition once: one cancelled step set, no double end.
    for r in runs:
        assert {s.state for s in client.get_run(r).steps} == {StepState.CANCELLED}


def test_runs_that_change_between_batches_are_neither_lost_nor_doubled(client: Client) -> None:
    runs = waiting_runs(client, bua_wait, 6)
    changed: list[str] = []

    def meddle(so_far: BulkResult) -> None:
        if not changed:
            client.cancel(runs[3])  # ended meanwhile: no longer selected
            client.pause(runs[4])  # paused meanwhile: still selected by a cancel
            changed.append("done")

    result = client.cancel_many(RunFilter(workflows="bua_wait"), batch_size=2, progress=meddle)
    assert counts(result) == (5, 5, 0)
    assert states(client, runs) == [RunState.CANCELLED] * 6


def test_resume_many_with_runs_resumed_and_paused_between_batches(client: Client) -> None:
    runs = waiting_runs(client, bua_wait, 5)
    for r in runs[:4]:
        client.pause(r)
    changed: list[str] = []

    def meddle(so_far: BulkResult) -> None:
        if not changed:
            client.resume(runs[2])  # resumed meanwhile: no longer selected
            client.pause(runs[4])  # paused after the call started: selected (it existed)
            changed.append("done")

    result = client.resume_many(RunFilter(workflows="bua_wait"), batch_size=2, progress=meddle)
    assert counts(result) == (4, 4, 0)
    assert states(client, runs) == [RunState.RUNNING] * 5
    for r in runs:
        run = client.get_run(r)
        assert run.paused_at is None
        assert StepState.WAITING_SIGNAL in {s.state for s in run.steps}


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_progress_exception_keeps_the_committed_batch_and_a_rerun_finishes(
    client: Client, cyclone_dsn: str, flavour: str
) -> None:
    runs = waiting_runs(client, bua_wait, 5)
    where = RunFilter(workflows="bua_wait")

    def boom(so_far: BulkResult) -> None:
        raise RuntimeError(f"stop after {so_far.acted}")

    if flavour == "sync":
        with pytest.raises(RuntimeError, match="stop after 2"):
            client.cancel_many(where, batch_size=2, progress=boom)
    else:

        async def go() -> None:
            async with AsyncClient(cyclone_dsn) as aclient:
                await aclient.cancel_many(where, batch_size=2, progress=boom)

        with pytest.raises(RuntimeError, match="stop after 2"):
            asyncio.run(go())
    assert states(client, runs) == [RunState.CANCELLED] * 2 + [RunState.RUNNING] * 3
    assert counts(client.cancel_many(where)) == (3, 3, 0)
    assert states(client, runs) == [RunState.CANCELLED] * 5


def test_an_async_bulk_call_cancelled_between_batches_stops_there(
    client: Client, cyclone_dsn: str
) -> None:
    runs = waiting_runs(client, bua_wait, 6)
    where = RunFilter(workflows="bua_wait")

    async def go() -> list[int]:
        async with AsyncClient(cyclone_dsn) as aclient:
            seen: list[int] = []

            def cancel_me(so_far: BulkResult) -> None:
                seen.append(so_far.acted)
                task.cancel()

            task = asyncio.create_task(aclient.cancel_many(where, batch_size=2, progress=cancel_me))
            with pytest.raises(asyncio.CancelledError):
                await task
            return seen

    assert asyncio.run(go()) == [2]
    assert states(client, runs) == [RunState.CANCELLED] * 2 + [RunState.RUNNING] * 4
    assert counts(client.cancel_many(where)) == (4, 4, 0)


def test_an_async_progress_callback_is_awaited_by_the_async_client_and_refused_by_the_sync_one(
    client: Client, cyclone_dsn: str
) -> None:
    """AsyncClient called it and dropped the coroutine unawaited: no progress was reported."""
    runs = waiting_runs(client, bua_wait, 5)
    reported: list[int] = []

    async def progress(so_far: BulkResult) -> None:
        await asyncio.sleep(0)
        reported.append(so_far.acted)

    with pytest.raises(InvalidArgument, match="coroutine function"):
        client.cancel_many(RunFilter(workflows="bua_wait"), progress=progress)
    assert states(client, runs) == [RunState.RUNNING] * 5

    async def go() -> None:
        async with AsyncClient(cyclone_dsn) as aclient:
            await aclient.cancel_many(
                RunFilter(workflows="bua_wait"), batch_size=2, progress=progress
            )

    asyncio.run(go())
    assert reported == [2, 4, 5]
    assert states(client, runs) == [RunState.CANCELLED] * 5


def lock_waits(conn: psycopg.Connection[Any], blocker: psycopg.Connection[Any]) -> int:
    """How many backends wait for a lock ``blocker`` holds."""
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
        (blocker.info.backend_pid,),
    ).fetchone()
    return int(row[0]) if row else 0


def test_an_async_bulk_call_timed_out_mid_batch_commits_that_batch_whole_and_no_more(
    client: Client, cyclone_dsn: str
) -> None:
    runs = waiting_runs(client, bua_wait, 5)
    where = RunFilter(workflows="bua_wait")
    with (
        psycopg.connect(cyclone_dsn) as blocker,
        psycopg.connect(cyclone_dsn, autocommit=True) as watcher,
    ):
        blocker.execute("SELECT 1 FROM cyclone_runs WHERE id = %s FOR UPDATE", (runs[1],))

        async def go() -> None:
            async with AsyncClient(cyclone_dsn) as aclient:
                task = asyncio.create_task(aclient.cancel_many(where, batch_size=2))
                await asyncio.to_thread(
                    wait_until, lambda: lock_waits(watcher, blocker) == 1, what="the batch to wait"
                )
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                blocker.rollback()  # the batch in flight goes on, in its thread

        asyncio.run(go())  # returns once the executor's threads have ended
    assert states(client, runs) == [RunState.CANCELLED] * 2 + [RunState.RUNNING] * 3
    for r in runs[:2]:
        assert {s.state for s in client.get_run(r).steps} == {StepState.CANCELLED}


def test_a_step_running_when_its_run_is_bulk_cancelled_is_fenced_out(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker(*HANDLERS)
    runs = [h.id for h in client.submit_many(bua_gated_wf, ["g0", "g1"])]
    wait_until(lambda: CALLS["start-g0"] and CALLS["start-g1"], what="both steps to start")
    assert counts(client.cancel_many(RunFilter(workflows="bua_gated_wf"))) == (2, 2, 0)
    GATE.set()
    worker.stop()  # waits for the handlers in flight to return and report
    assert CALLS["end-g0"] == CALLS["end-g1"] == 1
    for r in runs:
        run = client.get_run(r)
        assert run.state is RunState.CANCELLED
        assert {s.state for s in run.steps} == {StepState.CANCELLED}
        assert all(s.output is None for s in run.steps)


# -- parents and child runs ----------------------------------------------------------------


def test_bulk_cancel_of_child_runs_does_what_a_single_cancel_does(client: Client) -> None:
    bulk_parent, bulk_kid = with_kid(client, "a")
    one_parent, one_kid = with_kid(client, "b")
    client.cancel(one_kid)
    result = client.cancel_many(RunFilter(workflows="bua_wait", states="running"))
    assert counts(result) == (1, 1, 0)

    def shape(r: int) -> tuple[Any, ...]:
        run = client.get_run(r)
        return run.state, tuple((s.node, s.state, s.error_kind) for s in run.steps)

    assert shape(bulk_kid) == shape(one_kid)
    assert shape(bulk_parent) == shape(one_parent)


def test_retry_many_of_a_cancelled_parent_and_its_child_in_one_batch(client: Client) -> None:
    p, kid = with_kid(client, "r")
    client.cancel(p)
    assert states(client, [p, kid]) == [RunState.CANCELLED] * 2
    where = RunFilter(states="cancelled")
    assert client.retry_many(where, dry_run=True).matched == 2
    result = client.retry_many(where)
    assert counts(result) == (2, 1, 1)
    assert result.skipped_runs[0][0] == kid
    assert states(client, [p, kid]) == [RunState.RUNNING] * 2
    assert [c["id"] for c in client.children_of(p)] == [kid]  # reopened, not a second child
    assert counts(client.retry_many(where)) == (0, 0, 0)
    # The reopened child waits again: a signal finishes it.
    assert client.signal(kid, "go", 1) is Delivery.CONSUMED


def test_retry_many_of_child_runs_alone_skips_them_and_changes_nothing(client: Client) -> None:
    pairs = [with_kid(client, f"c{i}") for i in range(2)]
    for p, _ in pairs:
        client.cancel(p)
    ids = [i for pair in pairs for i in pair]
    before = snapshot(client, ids)
    result = client.retry_many(RunFilter(workflows="bua_wait", states="cancelled"))
    assert counts(result) == (2, 0, 2)
    assert [r for r, _ in result.skipped_runs] == [kid for _, kid in pairs]
    assert all("does not wait for it" in why for _, why in result.skipped_runs)
    assert snapshot(client, ids) == before


def test_resume_many_of_a_paused_tree_counts_the_child_resumed_with_its_parent(
    client: Client,
) -> None:
    p, kid = with_kid(client, "t")
    alone_p, alone_kid = with_kid(client, "u")
    client.pause(p)  # pauses its child run with it
    client.pause(alone_kid)  # paused on its own
    assert states(client, [p, kid, alone_p, alone_kid]) == [
        RunState.PAUSED,
        RunState.PAUSED,
        RunState.RUNNING,
        RunState.PAUSED,
    ]
    result = client.resume_many(RunFilter(match_all=True))
    assert counts(result) == (3, 2, 1)
    assert result.skipped_runs[0][0] == kid
    assert states(client, [p, kid, alone_p, alone_kid]) == [RunState.RUNNING] * 4


def test_skipped_runs_list_the_first_hundred_and_count_them_all(client: Client) -> None:
    parents = [h.id for h in client.submit_many(bua_parent, [f"m{i}" for i in range(101)])]
    wait_until(
        lambda: len(client.list_runs(workflow="bua_wait", limit=200)) == 101,
        what="the child runs",
    )
    result = client.cancel_many(RunFilter(match_all=True))
    assert counts(result) == (202, 101, 101)
    assert len(result.skipped_runs) == 100
    assert len({r for r, _ in result.skipped_runs}) == 100
    assert all(r not in parents for r, _ in result.skipped_runs)


# -- filters -------------------------------------------------------------------------------


def test_end_time_filters_never_select_an_open_run_even_one_reopened_by_a_retry(
    client: Client,
) -> None:
    runs = waiting_runs(client, bua_wait, 2)
    client.cancel(runs[0])
    long_ago = datetime(2000, 1, 1, tzinfo=UTC)
    assert client.retry_many(RunFilter(states="cancelled", ended_since=long_ago)).acted == 1
    assert client.get_run(runs[0]).finished_at is None
    for where in (
        RunFilter(ended_since=long_ago),
        RunFilter(ended_until=datetime.max.replace(tzinfo=UTC)),
    ):
        assert client.cancel_many(where, dry_run=True).matched == 0
        assert counts(client.cancel_many(where)) == (0, 0, 0)
    assert states(client, runs) == [RunState.RUNNING] * 2


def test_queue_and_workflow_filters_on_enqueued_steps(client: Client) -> None:
    q1 = [
        client.enqueue(bua_q1_step, f"a{i}", scheduled_at=datetime.now(UTC) + timedelta(hours=1)).id
        for i in range(3)
    ]
    q2 = [
        client.enqueue(bua_q2_step, f"b{i}", scheduled_at=datetime.now(UTC) + timedelta(hours=1)).id
        for i in range(2)
    ]
    assert client.cancel_many(RunFilter(queues="bua_q1"), dry_run=True).matched == 3
    assert counts(client.cancel_many(RunFilter(queues=["bua_q1", "bua_nowhere"]))) == (3, 3, 0)
    assert states(client, q1) == [RunState.CANCELLED] * 3
    assert states(client, q2) == [RunState.RUNNING] * 2
    assert counts(client.cancel_many(RunFilter(workflows="bua_q2_step"))) == (2, 2, 0)
    assert states(client, q2) == [RunState.CANCELLED] * 2


def test_a_creation_window_in_the_future_or_the_past_selects_nothing(client: Client) -> None:
    runs = waiting_runs(client, bua_wait, 2)
    created = client.get_run(runs[0]).created_at
    later = RunFilter(since=created + timedelta(days=1))
    earlier = RunFilter(until=created)
    for where in (later, earlier):
        assert counts(client.cancel_many(where)) == (0, 0, 0)
    assert counts(
        client.cancel_many(RunFilter(since=created, until=created + timedelta(days=1)))
    ) == (2, 2, 0)


def test_retry_many_skips_a_run_refused_mid_batch_and_retries_the_others(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS)
    FAILING.update(["k", "x", "y"])
    first = client.submit(bua_one, "x").id
    keyed = client.enqueue(bua_task, "k", unique_key="bua-key").id
    last = client.submit(bua_one, "y").id
    ids = [first, keyed, last]
    wait_until(lambda: all(s.is_terminal for s in states(client, ids)), what="the runs to fail")
    assert states(client, ids) == [RunState.FAILED] * 3
    holder = client.enqueue(
        bua_task, "h", unique_key="bua-key", scheduled_at=datetime.now(UTC) + timedelta(hours=1)
    )
    assert holder.created and holder.id != keyed
    FAILING.clear()
    result = client.retry_many(RunFilter(match_all=True))
    assert counts(result) == (3, 2, 1)
    assert result.skipped_runs[0][0] == keyed
    assert "unique key" in result.skipped_runs[0][1]
    assert client.result(first, timeout=10) == "done x"
    assert client.result(last, timeout=10) == "done y"
    assert client.get_run(keyed).state is RunState.FAILED
    assert [CALLS["x"], CALLS["y"], CALLS["k"]] == [2, 2, 1]


# -- the CLI -------------------------------------------------------------------------------


def test_cli_bad_batch_size_is_one_line_and_changes_nothing(
    client: Client, cyclone_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = waiting_runs(client, bua_wait, 2)
    args = ["cancel-many", "--workflow", "bua_wait", "--batch-size", "0", "--yes"]
    with pytest.raises(SystemExit) as exited:
        main(["--dsn", cyclone_dsn, *args])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invalid value for '--batch-size'" in err[0], err
    assert states(client, runs) == [RunState.RUNNING] * 2
    with pytest.raises(SystemExit) as exited:
        main(["--dsn", cyclone_dsn, "retry-many", "--all", "--yes", "--json"])
    assert exited.value.code == 0
    assert '"matched": 0' in capsys.readouterr().out


# -- the async client ----------------------------------------------------------------------


def _bad_calls(runs: dict[str, int]) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    return [
        ("submit", ("bua_no_such_workflow", 1), {}),
        ("submit", (bua_wait, {1, 2}), {}),
        ("submit_many", (bua_wait, "not a list"), {}),
        ("submit_many", (bua_wait, [1, object()]), {}),
        ("enqueue", (bua_task, "x"), {"queue": ""}),
        ("enqueue", (bua_task, "x"), {"scheduled_at": datetime(2030, 1, 1)}),
        ("signal", (runs["cancelled"], "go", 1), {}),
        ("signal", (runs["running"], "nope", 1), {}),
        ("signal", (runs["running"], "go", object()), {}),
        ("cancel", (runs["cancelled"],), {}),
        ("cancel", (10**12,), {}),
        ("retry", (runs["running"], "bua_after"), {}),
        ("retry", (runs["cancelled"], "no_such_node"), {}),
        ("pause", (runs["cancelled"],), {}),
        ("resume", (runs["running"],), {}),
        ("get_run", (10**12,), {}),
        ("get_run", ("1",), {}),
        ("result", (runs["cancelled"],), {"timeout": 1}),
        ("wait", (runs["running"],), {"timeout": 0.05}),
        ("wait", (runs["running"],), {"timeout": "soon"}),
        ("cancel_many", (RunFilter(states="completed"),), {}),
        ("retry_many", ({"workflows": "x"},), {}),
    ]


def test_the_async_client_raises_what_the_sync_client_raises(
    client: Client, cyclone_dsn: str
) -> None:
    running, cancelled = waiting_runs(client, bua_wait, 2)
    client.cancel(cancelled)
    runs = {"running": running, "cancelled": cancelled}
    ids = [running, cancelled]
    before = snapshot(client, ids)
    calls = _bad_calls(runs)

    def sync_outcome(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        try:
            getattr(client, name)(*args, **kwargs)
        except (CycloneError, TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "returned"

    async def go() -> list[str]:
        out = []
        async with AsyncClient(cyclone_dsn) as aclient:
            for name, args, kwargs in calls:
                try:
                    await getattr(aclient, name)(*args, **kwargs)
                except (CycloneError, TimeoutError) as exc:
                    out.append(f"{type(exc).__name__}: {exc}")
                else:
                    out.append("returned")
        return out

    expected = [sync_outcome(*c) for c in calls]
    assert "returned" not in expected
    assert asyncio.run(go()) == expected
    assert snapshot(client, ids) == before
    assert len(client.list_runs(limit=100)) == 2


def test_async_submit_signal_result_and_handles_match_the_sync_client(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS)

    async def go() -> tuple[list[Any], list[int], int, Any]:
        async with AsyncClient(cyclone_dsn) as aclient:
            handles = await aclient.submit_many(bua_wait, ["a", "b"])
            one = await aclient.submit(bua_one, "c")
            job = await aclient.enqueue(bua_task, "d")
            deliveries = [await aclient.signal(h.id, "go", h.id) for h in handles]
            assert deliveries == [Delivery.CONSUMED] * 2
            results = [await h.result(timeout=10) for h in handles]
            waited = await one.wait(timeout=10)
            got = await aclient.handle(job.id).result(timeout=10)
            assert (await job.get()).id == job.id
            return results, [h.id for h in handles], waited.id, got

    results, ids, one_id, job_result = asyncio.run(go())
    assert results == [f"after {i}" for i in ids]
    assert [client.result(i) for i in ids] == results
    assert client.result(one_id) == "done c"
    assert job_result == "done d"


def wait_pids(conn: psycopg.Connection[Any]) -> set[int]:
    """The backends of this process's wait connections (``cyclone-wait-<pid>``) now."""
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
        (f"cyclone-wait-{os.getpid()}",),
    ).fetchall()
    return {int(r[0]) for r in rows}


def test_an_async_wait_cut_short_leaves_no_connection_and_no_write(
    client: Client, cyclone_dsn: str
) -> None:
    (run,) = waiting_runs(client, bua_wait, 1)
    before = snapshot(client, [run])
    with psycopg.connect(cyclone_dsn, autocommit=True) as watcher:
        others = wait_pids(watcher)
        ours: set[int] = set()

        async def go() -> None:
            async with AsyncClient(cyclone_dsn) as aclient:
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(aclient.wait(run), timeout=0.3)
                task = asyncio.create_task(aclient.result(run))
                found = await asyncio.to_thread(
                    wait_until, lambda: wait_pids(watcher) - others, what="the wait's connection"
                )
                ours.update(found)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

        asyncio.run(go())
        assert ours
        wait_until(lambda: not wait_pids(watcher) & ours, what="the wait connection to close")
    assert snapshot(client, [run]) == before


def test_closing_the_async_client_while_calls_are_in_flight(
    client: Client, cyclone_dsn: str
) -> None:
    running, other = waiting_runs(client, bua_wait, 2)
    with (
        psycopg.connect(cyclone_dsn) as blocker,
        psycopg.connect(cyclone_dsn, autocommit=True) as watcher,
    ):
        blocker.execute("SELECT 1 FROM cyclone_runs WHERE id = %s FOR UPDATE", (running,))

        async def go() -> tuple[object, object]:
            aclient = AsyncClient(cyclone_dsn, pool_size=1)
            cancel = asyncio.create_task(aclient.cancel(running))
            pool = aclient._client._db.pool
            await asyncio.to_thread(
                wait_until,
                lambda: lock_waits(watcher, blocker) == 1,
                what="the cancel to hold the only connection, waiting for the lock",
            )
            read = asyncio.create_task(aclient.get_run(other))
            await asyncio.to_thread(
                wait_until,
                lambda: pool.get_stats().get("requests_waiting", 0) >= 1,
                what="the read to wait for the connection",
            )
            await aclient.close()
            read_outcome = await asyncio.gather(read, return_exceptions=True)
            blocker.commit()
            cancel_outcome = await asyncio.gather(cancel, return_exceptions=True)
            return read_outcome[0], cancel_outcome[0]

        read_outcome, cancel_outcome = asyncio.run(go())
    # The cancel in flight when the client closed finished, whole.
    assert cancel_outcome is None
    run = client.get_run(running)
    assert run.state is RunState.CANCELLED
    assert {s.state for s in run.steps} == {StepState.CANCELLED}
    assert client.get_run(other).state is RunState.RUNNING
    assert isinstance(read_outcome, ClientClosed), repr(read_outcome)


def test_closing_the_sync_client_while_a_call_waits_for_a_connection(
    client: Client, cyclone_dsn: str
) -> None:
    """The same on ``Client``: the waiting call got DatabaseUnavailable (a lost connection,
    "the next call opens a new connection"); it gets ClientClosed."""
    running, other = waiting_runs(client, bua_wait, 2)
    closing = Client(cyclone_dsn, pool_size=1)
    outcomes: dict[str, object] = {}

    def call(name: str, fn: Callable[[], object]) -> threading.Thread:
        def run() -> None:
            try:
                outcomes[name] = fn()
            except Exception as exc:
                outcomes[name] = exc

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    with (
        psycopg.connect(cyclone_dsn) as blocker,
        psycopg.connect(cyclone_dsn, autocommit=True) as watcher,
    ):
        blocker.execute("SELECT 1 FROM cyclone_runs WHERE id = %s FOR UPDATE", (running,))
        cancel = call("cancel", lambda: closing.cancel(running))
        wait_until(lambda: lock_waits(watcher, blocker) == 1, what="the cancel to wait")
        read = call("read", lambda: closing.get_run(other))
        pool = closing._db.pool
        wait_until(
            lambda: pool.get_stats().get("requests_waiting", 0) >= 1, what="the read to wait"
        )
        closing.close()
        read.join(timeout=10)
        blocker.commit()
        cancel.join(timeout=10)
    assert isinstance(outcomes["read"], ClientClosed), repr(outcomes["read"])
    assert outcomes["cancel"] is None
    assert client.get_run(running).state is RunState.CANCELLED
