"""Audit of the user documentation as a new user reads it (part B): docs/concepts/flow-control.md,
docs/concepts/schedules.md, docs/concepts/runs-and-steps.md, docs/howto/versioning.md,
docs/howto/transactional-steps.md and docs/howto/progress-events.md.

Each test copies a page's sample (handlers renamed with the ``dwb_`` prefix) or checks one of
its claims through the public API, against the real database and a real worker.
tests/docs/test_docs.py already runs every example file; here the pages' *claims* are checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cyclone_dsl import (
    AsyncClient,
    Client,
    Concurrency,
    Debounce,
    EventLimitExceeded,
    InvalidArgument,
    InvalidPayload,
    InvalidTransition,
    NodeRef,
    PayloadTooLarge,
    RateLimit,
    Ref,
    RunFailed,
    RunFilter,
    RunNotFound,
    RunState,
    StepContext,
    StepState,
    Worker,
    step,
    wait_signal,
    workflow,
)
from cyclone_dsl.cli.main import run as cli_run
from tests.waiting import PROMPT, wait_until

Clock = Callable[[datetime], None]
StartWorker = Callable[..., Worker]

CALLS: Counter[str] = Counter()
SEEN: dict[str, Any] = {}
GATES: dict[str, threading.Event] = {}
_lock = threading.Lock()

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _reset() -> None:
    CALLS.clear()
    SEEN.clear()
    GATES.clear()


def _count(tag: str) -> int:
    with _lock:
        CALLS[tag] += 1
        return CALLS[tag]


def _gate(name: str) -> threading.Event:
    with _lock:
        return GATES.setdefault(name, threading.Event())


# =========================================================================================
# progress-events.md
# =========================================================================================


# examples/progress.py, as the page includes it (renamed)
@step(name="dwb_resize_all")
def dwb_resize_all(images: list[str], ctx: StepContext) -> int:
    for done, name in enumerate(images, start=1):
        time.sleep(0.05)  # the real work
        ctx.progress(done, len(images), f"resized {name}")
    ctx.emit({"thumbnails": len(images), "bucket": "thumbs"})
    return len(images)


@workflow(name="dwb_thumbnails")
def dwb_thumbnails(images: Ref[list[str]]) -> NodeRef[int]:
    return dwb_resize_all(images)


def test_progress_sample_prints_what_the_page_shows(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwb_thumbnails)
    handle = client.submit(dwb_thumbnails, ["a.png", "b.png", "c.png"])
    lines = []
    for event in handle.events(timeout=30):
        if event.kind == "progress":
            lines.append(f"#{event.seq} {event.node}: {event.data}")
        else:
            lines.append(f"#{event.seq} {event.node} says {event.data}")
    lines.append(f"result: {handle.result(timeout=5)}")
    assert lines == [
        "#1 dwb_resize_all: {'done': 1, 'total': 3, 'message': 'resized a.png'}",
        "#2 dwb_resize_all: {'done': 2, 'total': 3, 'message': 'resized b.png'}",
        "#3 dwb_resize_all: {'done': 3, 'total': 3, 'message': 'resized c.png'}",
        "#4 dwb_resize_all says {'bucket': 'thumbs', 'thumbnails': 3}",
        "result: 3",
    ]
    events = client.events_of(handle.id)
    step_row = client.get_run(handle.id).step("dwb_resize_all")
    first = events[0]
    # StepEvent fields as the page lists them
    assert (first.run_id, first.node, first.step_id, first.attempt, first.fenced) == (
        handle.id,
        "dwb_resize_all",
        step_row.id,
        1,
        False,
    )
    assert first.at.tzinfo is not None


def _follow_lines(cyclone_dsn: str, run_id: int, capsys: pytest.CaptureFixture[str]) -> list[str]:
    code = cli_run(["--dsn", cyclone_dsn, "run", str(run_id), "--follow"])
    out = capsys.readouterr().out
    assert code == 0, out
    # drop the time column: "10:02:11.201 #1 ..." -> "#1 ..."
    return [line.split(" ", 1)[1] if line[:2].isdigit() else line for line in out.splitlines()]


def test_progress_cli_follow_prints_the_progress_lines_of_the_page(
    cyclone_dsn: str,
    start_worker: StartWorker,
    client: Client,
    capsys: pytest.CaptureFixture[str],
) -> None:
    start_worker(dwb_thumbnails)
    handle = client.submit(dwb_thumbnails, ["a.png", "b.png", "c.png"])
    handle.result(timeout=30)
    lines = _follow_lines(cyclone_dsn, handle.id, capsys)
    assert lines[:3] == [
        "#1 dwb_resize_all progress 1/3 (33%) resized a.png",
        "#2 dwb_resize_all progress 2/3 (66%) resized b.png",
        "#3 dwb_resize_all progress 3/3 (100%) resized c.png",
    ]
    assert lines[-1] == f"run {handle.id} dwb_thumbnails completed"


def test_progress_cli_follow_prints_the_event_line_of_the_page(
    cyclone_dsn: str,
    start_worker: StartWorker,
    client: Client,
    capsys: pytest.CaptureFixture[str],
) -> None:
    start_worker(dwb_thumbnails)
    handle = client.submit(dwb_thumbnails, ["a.png", "b.png", "c.png"])
    handle.result(timeout=30)
    lines = _follow_lines(cyclone_dsn, handle.id, capsys)
    assert lines[3] == '#4 dwb_resize_all {"bucket": "thumbs", "thumbnails": 3}'


@step(name="dwb_bad_events")
def dwb_bad_events(value: object, ctx: StepContext) -> dict[str, str]:
    seen: dict[str, str] = {}
    tries: dict[str, Callable[[], None]] = {
        "nan": lambda: ctx.emit(float("nan")),
        "set": lambda: ctx.emit({1, 2}),
        "nul": lambda: ctx.emit("a\u0000b"),
        "large": lambda: ctx.emit("x" * (64 * 1024 + 1)),
        "done_neg": lambda: ctx.progress(-1, 3),
        "done_float": lambda: ctx.progress(1.5, 3),  # type: ignore[arg-type]
        "done_over": lambda: ctx.progress(4, 3),
        "message_int": lambda: ctx.progress(1, 3, 7),  # type: ignore[arg-type]
    }
    for name, call in tries.items():
        try:
            call()
        except Exception as exc:
            seen[name] = type(exc).__name__
        else:
            seen[name] = "stored"
    ctx.emit(None)  # "any JSON value ... None"
    ctx.emit("a string")
    ctx.progress(0, 0)
    return seen


@workflow(name="dwb_bad_events_wf")
def dwb_bad_events_wf(value: Ref[object]) -> NodeRef[dict[str, str]]:
    return dwb_bad_events(value)


def test_progress_bad_values_raise_at_once_and_store_nothing(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwb_bad_events)
    handle = client.submit(dwb_bad_events_wf, 1)
    seen = handle.result(timeout=20)
    assert seen == {
        "nan": InvalidPayload.__name__,
        "set": InvalidPayload.__name__,
        "nul": InvalidPayload.__name__,
        "large": PayloadTooLarge.__name__,
        "done_neg": InvalidArgument.__name__,
        "done_float": InvalidArgument.__name__,
        "done_over": InvalidArgument.__name__,
        "message_int": InvalidArgument.__name__,
    }
    events = client.events_of(handle.id)
    assert [(e.seq, e.kind, e.data) for e in events] == [
        (1, "event", None),
        (2, "event", "a string"),
        (3, "progress", {"done": 0, "total": 0, "message": None}),
    ]


@step(name="dwb_chatty", max_attempts=2)
def dwb_chatty(value: object, ctx: StepContext) -> list[object]:
    if ctx.attempt == 1:
        ctx.emit("a1-1")
        ctx.emit("a1-2")
        raise RuntimeError("fail the first attempt")
    ctx.emit("a2-1")
    try:
        ctx.emit("a2-2")
    except EventLimitExceeded as exc:
        return ["capped", exc.run_id, exc.node, exc.cap]
    return ["not capped"]


@workflow(name="dwb_chatty_wf")
def dwb_chatty_wf(value: Ref[object]) -> NodeRef[list[object]]:
    return dwb_chatty(value)


def test_progress_event_cap_counts_across_attempts_and_names_run_node_cap(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwb_chatty, max_events_per_step=3)
    handle = client.submit(dwb_chatty_wf, 1)
    assert handle.result(timeout=20) == ["capped", handle.id, "dwb_chatty", 3]
    assert [e.data for e in client.events_of(handle.id)] == ["a1-1", "a1-2", "a2-1"]
    assert [e.attempt for e in client.events_of(handle.id)] == [1, 1, 2]


@step(name="dwb_ticker")
def dwb_ticker(count: int, ctx: StepContext) -> int:
    for i in range(count):
        ctx.emit(i)
    _gate("dwb_ticker").wait(10)
    return count


@workflow(name="dwb_ticker_wf")
def dwb_ticker_wf(count: Ref[int]) -> NodeRef[int]:
    return dwb_ticker(count)


def test_progress_following_after_timeout_and_unknown_run(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwb_ticker)
    handle = client.submit(dwb_ticker_wf, 5)
    wait_until(lambda: len(client.events_of(handle.id)) == 5, what="5 events", timeout=10)
    # timeout=S raises TimeoutError when the run is still going after S seconds
    got: list[int] = []
    with pytest.raises(TimeoutError):  # noqa: PT012 - the loop is what raises
        for event in handle.events(after=2, timeout=0.5):
            got.append(event.seq)
    assert got == [3, 4, 5]  # after=N starts after seq N
    assert [e.seq for e in client.events_of(handle.id, after=1, limit=2)] == [2, 3]
    _gate("dwb_ticker").set()
    assert handle.result(timeout=10) == 5
    # ends once the run ended and every event was yielded
    assert [e.seq for e in handle.events(after=3, timeout=5)] == [4, 5]
    with pytest.raises(RunNotFound):
        list(client.handle(handle.id + 10_000).events(timeout=2))


def test_progress_async_following_with_after(
    cyclone_dsn: str, start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwb_ticker)
    handle = client.submit(dwb_ticker_wf, 12)
    _gate("dwb_ticker").set()
    handle.result(timeout=10)

    async def show_async() -> list[tuple[int, bool, object]]:
        async with AsyncClient(cyclone_dsn) as aclient:
            return [
                (event.seq, event.fenced, event.data)
                async for event in aclient.handle(handle.id).events(after=10)
            ]

    assert asyncio.run(show_async()) == [(11, False, 10), (12, False, 11)]


@step(name="dwb_async_reporter")
async def dwb_async_reporter(total: int, ctx: StepContext) -> int:
    await ctx.progress_async(1, total, "half")
    await ctx.emit_async({"k": [1, 2]})
    ctx.progress(total, total)  # "also work in an async def handler"
    return total


@workflow(name="dwb_async_reporter_wf")
def dwb_async_reporter_wf(total: Ref[int]) -> NodeRef[int]:
    return dwb_async_reporter(total)


def test_progress_async_calls_store_the_same_events(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwb_async_reporter)
    handle = client.submit(dwb_async_reporter_wf, 2)
    assert handle.result(timeout=10) == 2
    assert [(e.kind, e.data) for e in client.events_of(handle.id)] == [
        ("progress", {"done": 1, "total": 2, "message": "half"}),
        ("event", {"k": [1, 2]}),
        ("progress", {"done": 2, "total": 2, "message": None}),
    ]


# The first emit must come before the timeout (its time runs from the dispatch, not from
# the handler's start) or it is fenced too: 1.5 s leaves room for a late handler thread.
@step(name="dwb_overrun", timeout=timedelta(seconds=1.5), max_attempts=1)
def dwb_overrun(value: object, ctx: StepContext) -> str:
    ctx.emit("before the timeout")
    ctx.wait_cancelled(10)
    SEEN["cancelled"] = ctx.cancelled
    ctx.emit("after the timeout")
    _gate("dwb_overrun_emitted").set()
    return "ignored"


@workflow(name="dwb_overrun_wf")
def dwb_overrun_wf(value: Ref[object]) -> NodeRef[str]:
    return dwb_overrun(value)


def test_progress_events_after_a_timeout_are_kept_and_fenced(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwb_overrun)
    handle = client.submit(dwb_overrun_wf, 1)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=15)
    assert failed.value.error_kind == "timeout"
    assert _gate("dwb_overrun_emitted").wait(5)
    assert SEEN["cancelled"] is True
    events = wait_until(
        lambda: (e := client.events_of(handle.id)) and len(e) == 2 and e,
        what="both events",
        timeout=5,
    )
    assert [(e.data, e.fenced) for e in events] == [
        ("before the timeout", False),
        ("after the timeout", True),
    ]


# =========================================================================================
# transactional-steps.md
# =========================================================================================


@pytest.fixture
def payments(cyclone_dsn: str) -> str:
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS dwb_payments (order_id text, amount int)")
        conn.execute("TRUNCATE dwb_payments")
    return cyclone_dsn


def _rows(dsn: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql).fetchall()


# examples/ledger.py, as the page includes it (renamed table and kinds)
@step(name="dwb_debit", transactional=True, max_attempts=3)
def dwb_debit(order: dict[str, object], *, ctx: StepContext) -> int:
    conn = ctx.connection  # inside the transaction that completes this step
    conn.execute(
        "INSERT INTO dwb_payments (order_id, amount) VALUES (%s, %s)",
        (order["id"], order["amount"]),
    )
    if ctx.attempt == 1:
        raise ConnectionError("the card network timed out")  # the insert rolls back
    row = conn.execute("SELECT sum(amount) FROM dwb_payments").fetchone()
    return int(row[0])


@workflow(name="dwb_ledger")
def dwb_ledger(order):  # type: ignore[no-untyped-def]
    return dwb_debit(order)


def test_transactional_ledger_debits_once_and_keeps_the_failed_attempt(
    payments: str, start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwb_ledger)
    handle = client.submit(dwb_ledger, {"id": "o-1", "amount": 40})
    assert handle.result(timeout=30) == 40
    assert _rows(payments, "SELECT order_id, amount FROM dwb_payments") == [("o-1", 40)]
    debit = client.get_run(handle.id).step("dwb_debit")
    assert [a.outcome for a in debit.attempts] == ["retried"]
    assert debit.error is None  # "A step that completed has no error of its own"


@step(name="dwb_not_tx")
def dwb_not_tx(value: object, ctx: StepContext) -> str:
    try:
        ctx.connection  # noqa: B018 - the property raises
    except InvalidArgument as exc:
        return f"InvalidArgument: {exc}"
    return "no error"


@workflow(name="dwb_not_tx_wf")
def dwb_not_tx_wf(value: Ref[object]) -> NodeRef[str]:
    return dwb_not_tx(value)


def test_transactional_connection_on_a_plain_step_raises_invalid_argument(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwb_not_tx)
    assert client.submit(dwb_not_tx_wf, 1).result(timeout=10).startswith("InvalidArgument")


@step(name="dwb_swallow", transactional=True, max_attempts=3)
def dwb_swallow(value: object, ctx: StepContext) -> int:
    conn = ctx.connection
    conn.execute("INSERT INTO dwb_payments VALUES ('swallow', %s)", (ctx.attempt,))
    if ctx.attempt == 1:
        with contextlib.suppress(psycopg.errors.DivisionByZero):  # swallowed: the tx is aborted
            conn.execute("SELECT 1/0")
    return ctx.attempt


@workflow(name="dwb_swallow_wf")
def dwb_swallow_wf(value: Ref[object]) -> NodeRef[int]:
    return dwb_swallow(value)


def test_transactional_a_swallowed_database_error_fails_the_attempt_and_retries(
    payments: str, start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwb_swallow)
    handle = client.submit(dwb_swallow_wf, 1)
    assert handle.result(timeout=20) == 2
    assert _rows(payments, "SELECT order_id, amount FROM dwb_payments") == [("swallow", 2)]
    assert [a.outcome for a in client.get_run(handle.id).step("dwb_swallow").attempts] == [
        "retried"
    ]


@step(name="dwb_savepoint", transactional=True)
def dwb_savepoint(value: object, ctx: StepContext) -> str:
    conn = ctx.connection
    conn.execute("INSERT INTO dwb_payments VALUES ('outer', 1)")
    try:
        with conn.transaction():
            conn.execute("INSERT INTO dwb_payments VALUES ('inner', 2)")
            raise ValueError("roll back only the block")
    except ValueError:
        pass
    return "ok"


@workflow(name="dwb_savepoint_wf")
def dwb_savepoint_wf(value: Ref[object]) -> NodeRef[str]:
    return dwb_savepoint(value)


def test_transactional_a_savepoint_rolls_back_only_its_block(
    payments: str, start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwb_savepoint)
    assert client.submit(dwb_savepoint_wf, 1).result(timeout=10) == "ok"
    assert _rows(payments, "SELECT order_id FROM dwb_payments") == [("outer",)]


@step(name="dwb_bad_output_tx", transactional=True, max_attempts=3)
def dwb_bad_output_tx(value: object, ctx: StepContext) -> object:
    _count("bad_output_tx")
    ctx.connection.execute("INSERT INTO dwb_payments VALUES ('bad-output', 1)")
    return {"not json": {1, 2}}


@workflow(name="dwb_bad_output_tx_wf")
def dwb_bad_output_tx_wf(value: Ref[object]) -> NodeRef[object]:
    return dwb_bad_output_tx(value)


def test_transactional_a_non_json_output_rolls_back_and_fails_for_good(
    payments: str, start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwb_bad_output_tx)
    handle = client.submit(dwb_bad_output_tx_wf, 1)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=15)
    assert failed.value.error_kind == "invalid_output"
    assert CALLS["bad_output_tx"] == 1
    assert _rows(payments, "SELECT * FROM dwb_payments") == []


@step(name="dwb_session", transactional=True, isolation=None)
def dwb_session(value: str, ctx: StepContext) -> dict[str, object]:
    conn = ctx.connection
    seen: dict[str, object] = {
        "isolation": conn.execute("SHOW transaction_isolation").fetchone()[0],
        "work_mem": conn.execute("SHOW work_mem").fetchone()[0],
        "pid": conn.execute("SELECT pg_backend_pid()").fetchone()[0],
        "temp": conn.execute("SELECT to_regclass('pg_temp.dwb_scratch') IS NOT NULL").fetchone()[0],
    }
    if value == "dirty":
        conn.execute("SET work_mem = '7MB'")
        conn.execute("SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE")
        conn.execute("CREATE TEMP TABLE dwb_scratch (x int)")
    return seen


@step(name="dwb_serial", transactional=True, isolation="serializable")
def dwb_serial(value: object, ctx: StepContext) -> str:
    return str(ctx.connection.execute("SHOW transaction_isolation").fetchone()[0])


@workflow(name="dwb_session_wf")
def dwb_session_wf(value: Ref[str]) -> NodeRef[dict[str, object]]:
    return dwb_session(value)


@workflow(name="dwb_serial_wf")
def dwb_serial_wf(value: Ref[object]) -> NodeRef[str]:
    return dwb_serial(value)


def test_transactional_each_handler_gets_a_clean_read_committed_session(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwb_session, dwb_serial, concurrency=1)  # one handler connection
    first = client.submit(dwb_session_wf, "dirty").result(timeout=10)
    second = client.submit(dwb_session_wf, "clean").result(timeout=10)
    assert first["isolation"] == "read committed"
    # what the first left (SET, SET SESSION CHARACTERISTICS, a temp table) is dropped
    assert second == first  # on the same connection (pid)
    assert client.submit(dwb_serial_wf, 1).result(timeout=10) == "serializable"


@step(name="dwb_tx_events", transactional=True, max_attempts=1)
def dwb_tx_events(value: object, ctx: StepContext) -> None:
    ctx.connection.execute("INSERT INTO dwb_payments VALUES ('events', 1)")
    ctx.emit("kept")
    raise RuntimeError("roll back")


@workflow(name="dwb_tx_events_wf")
def dwb_tx_events_wf(value: Ref[object]) -> NodeRef[None]:
    return dwb_tx_events(value)


def test_transactional_events_survive_the_rollback(
    payments: str, start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwb_tx_events)
    handle = client.submit(dwb_tx_events_wf, 1)
    with pytest.raises(RunFailed):
        handle.result(timeout=10)
    assert [e.data for e in client.events_of(handle.id)] == ["kept"]
    assert _rows(payments, "SELECT * FROM dwb_payments") == []


@step(name="dwb_tx_slow", transactional=True)
def dwb_tx_slow(value: object, ctx: StepContext) -> str:
    ctx.connection.execute("INSERT INTO dwb_payments VALUES ('slow', 1)")
    _gate("dwb_tx_slow_started").set()
    ctx.connection.execute("SELECT pg_sleep(20)")
    return "finished"


@workflow(name="dwb_tx_slow_wf")
def dwb_tx_slow_wf(value: Ref[object]) -> NodeRef[str]:
    return dwb_tx_slow(value)


def test_transactional_cancelling_the_run_interrupts_the_statement_and_rolls_back(
    payments: str, start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwb_tx_slow)
    handle = client.submit(dwb_tx_slow_wf, 1)
    assert _gate("dwb_tx_slow_started").wait(10)
    started = time.monotonic()
    client.cancel(handle.id)
    wait_until(
        lambda: (
            client.get_run(handle.id).step("dwb_tx_slow").state is StepState.CANCELLED
            and not _rows(
                payments, "SELECT 1 FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep(20)%'"
            )
        ),
        what="the statement interrupted",
        timeout=5,
    )
    assert time.monotonic() - started < 5
    assert client.get_run(handle.id).state is RunState.CANCELLED
    assert _rows(payments, "SELECT * FROM dwb_payments") == []


@step(name="dwb_tx_plain", transactional=True)
def dwb_tx_plain(value: object, ctx: StepContext) -> object:
    return value


def test_transactional_a_bad_transactional_dsn_is_refused_without_showing_its_password(
    cyclone_dsn: str,
) -> None:
    bad = "host=/tmp password=abc s3cr3t"  # an unquoted space splits the password
    raised: BaseException | None = None
    worker = None
    try:
        worker = Worker(cyclone_dsn, [dwb_tx_plain], transactional_dsn=bad, poll_interval=0.2)
        worker.start()
    except Exception as exc:
        raised = exc
    finally:
        if worker is not None:
            with contextlib.suppress(Exception):  # a worker that never started
                worker.stop()
    assert isinstance(raised, InvalidArgument), repr(raised)
    assert "s3cr3t" not in str(raised)


# =========================================================================================
# flow-control.md
# =========================================================================================


@step(name="dwb_sync_account", concurrency=Concurrency(key="tenant", limit=3))
def dwb_sync_account(job: dict[str, object]) -> None:  # 3 at once per tenant
    _count(f"sync:{job['tenant']}")
    _gate("dwb_sync_account").wait(10)


@workflow(name="dwb_sync_wf")
def dwb_sync_wf(job: Ref[dict[str, object]]) -> NodeRef[None]:
    return dwb_sync_account(job)


@step(
    name="dwb_region_step",
    concurrency=Concurrency(key=lambda job: job["region"] + "/" + job["tier"], limit=2),
)
def dwb_region_step(job: dict[str, object]) -> object:
    return job


@workflow(name="dwb_region_wf")
def dwb_region_wf(job: Ref[dict[str, object]]) -> NodeRef[object]:
    return dwb_region_step(job)


def _run_count(client: Client, name: str) -> int:
    return len(client.list_runs(workflow=name, limit=1000))


@pytest.mark.parametrize(
    "bad",
    [
        ["not", "an", "object"],
        {"other": "x"},  # a missing field
        {"tenant": 1.5},
        {"tenant": True},
        {"tenant": None},
        {"tenant": ["a"]},
        {"tenant": "x" * 257},
        {"tenant": "\u00e9" * 129},  # 258 bytes of UTF-8
    ],
)
def test_flow_a_key_that_cannot_be_evaluated_refuses_the_submit_and_writes_nothing(
    client: Client, bad: object
) -> None:
    before = _run_count(client, "dwb_sync_wf")
    with pytest.raises(InvalidArgument):
        client.submit(dwb_sync_wf, bad)  # type: ignore[arg-type]
    assert _run_count(client, "dwb_sync_wf") == before


def test_flow_keys_that_evaluate_are_accepted_and_a_key_function_that_raises_is_refused(
    client: Client,
) -> None:
    client.submit(dwb_sync_wf, {"tenant": "x" * 256})  # exactly 256 bytes
    client.submit(dwb_sync_wf, {"tenant": 7})  # an integer
    assert _run_count(client, "dwb_sync_wf") == 2
    client.submit(dwb_region_wf, {"region": "eu", "tier": "gold"})
    with pytest.raises(InvalidArgument):
        client.submit(dwb_region_wf, {"region": "eu"})  # the lambda's KeyError
    assert _run_count(client, "dwb_region_wf") == 1


@step(name="dwb_unlimited")
def dwb_unlimited(job: object) -> object:
    return job


def test_flow_enqueue_concurrency_key_needs_a_kind_that_declares_concurrency(
    client: Client,
) -> None:
    with pytest.raises(InvalidArgument):
        client.enqueue(dwb_unlimited, {"x": 1}, concurrency_key="acme")
    handle = client.enqueue(dwb_sync_account, {"tenant": "t"}, concurrency_key="acme")
    assert handle.created


def test_flow_concurrency_caps_a_key_and_why_waiting_says_so(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwb_sync_account, concurrency=8)
    handles = [client.submit(dwb_sync_wf, {"tenant": "tenant-7"}) for _ in range(5)]
    other = client.submit(dwb_sync_wf, {"tenant": "tenant-8"})
    wait_until(
        lambda: CALLS["sync:tenant-7"] == 3 and CALLS["sync:tenant-8"] == 1,
        what="3 of tenant-7 and 1 of tenant-8 running",
        timeout=10,
    )
    time.sleep(0.6)  # three poll intervals: nothing more starts
    assert CALLS["sync:tenant-7"] == 3
    waiting = [
        h
        for h in handles
        if client.get_run(h.id).step("dwb_sync_account").state.value == "available"
    ]
    assert len(waiting) == 2
    assert client.why_waiting(waiting[0].id) == {
        "dwb_sync_account": "waiting for a concurrency slot (tenant-7: 3/3)"
    }
    # "Work over a limit is not failed and spends no attempt"
    assert client.get_run(waiting[0].id).step("dwb_sync_account").attempt == 0
    _gate("dwb_sync_account").set()
    for handle in [*handles, other]:
        handle.result(timeout=15)
    assert CALLS["sync:tenant-7"] == 5


@step(name="dwb_onboard_step")
def dwb_onboard_step(customer: dict[str, object]) -> object:
    with _lock:
        SEEN.setdefault("onboard_order", []).append(customer["n"])
    _gate(f"onboard:{customer['n']}").wait(10)
    return customer["n"]


@workflow(name="dwb_onboarding", concurrency=Concurrency(key="customer_id", limit=1))
def dwb_onboarding(customer):  # type: ignore[no-untyped-def]
    return dwb_onboard_step(customer)  # one onboarding per customer at a time


def test_flow_a_workflow_limit_queues_runs_in_submit_order_and_says_why(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwb_onboard_step, concurrency=8)
    runs = [client.submit(dwb_onboarding, {"customer_id": "c-9", "n": n}) for n in range(3)]
    wait_until(lambda: SEEN.get("onboard_order") == [0], what="the first run started")
    time.sleep(0.5)
    assert SEEN["onboard_order"] == [0]
    assert client.why_waiting(runs[1].id) == {
        "dwb_onboard_step": "waiting for a run slot of dwb_onboarding (c-9: 1/1 runs under way)"
    }
    for n in range(3):
        _gate(f"onboard:{n}").set()
    assert [h.result(timeout=15) for h in runs] == [0, 1, 2]
    assert SEEN["onboard_order"] == [0, 1, 2]


@workflow(name="dwb_onboarding_wait", concurrency=Concurrency(key="customer_id", limit=1))
def dwb_onboarding_wait(customer):  # type: ignore[no-untyped-def]
    approved = wait_signal("approved")
    return dwb_onboard_step(customer, after=[approved])


def test_flow_a_queued_run_whose_first_node_is_a_signal_wait_takes_its_signal(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwb_onboard_step, concurrency=4)
    first = client.submit(dwb_onboarding_wait, {"customer_id": "c-1", "n": 10})
    second = client.submit(dwb_onboarding_wait, {"customer_id": "c-1", "n": 11})
    assert client.signal(first.id, "approved").value == "consumed"
    wait_until(lambda: SEEN.get("onboard_order") == [10], what="the first run holds its slot")
    assert client.signal(second.id, "approved").value == "consumed"
    _gate("onboard:10").set()
    _gate("onboard:11").set()
    assert first.result(timeout=10) == 10
    assert second.result(timeout=10) == 11


def test_flow_queue_limits_must_name_a_served_queue_and_limits_stop_at_100000(
    cyclone_dsn: str, client: Client
) -> None:
    with pytest.raises(InvalidArgument):
        Worker(cyclone_dsn, [dwb_unlimited], queues=["default"], queue_limits={"emials": 5})
    Worker(cyclone_dsn, [dwb_unlimited], queues=["emails"], queue_limits={"emails": 5})
    with pytest.raises(InvalidArgument):
        RateLimit(limit=100_001, per=timedelta(seconds=1))
    with pytest.raises(InvalidArgument):
        Concurrency(limit=100_001)
    with pytest.raises(InvalidArgument):
        client.set_queue_limit("emails", 100_001)
    RateLimit(limit=100_000, per=timedelta(seconds=1))
    Concurrency(key="tenant", limit=None)  # fairness without a cap


@step(name="dwb_crm", rate_limit=RateLimit(limit=2, per=timedelta(hours=1), name="dwb_crm_api"))
def dwb_crm(job: object) -> object:
    return job


@step(
    name="dwb_crm_big",
    rate_limit=RateLimit(limit=3, per=timedelta(hours=1), name="dwb_crm_big_api", units=2),
)
def dwb_crm_big(job: object) -> object:
    return job


def test_flow_a_rate_limit_holds_work_in_its_window_and_why_waiting_says_so(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwb_crm, dwb_crm_big)
    done = [client.enqueue(dwb_crm, n) for n in range(2)]
    assert [h.result(timeout=10) for h in done] == [0, 1]
    held = client.enqueue(dwb_crm, 2)
    time.sleep(0.6)
    assert client.get_run(held.id).state is RunState.RUNNING
    reason = client.why_waiting(held.id)["dwb_crm"]
    assert reason.startswith("rate limited until ")
    assert reason.endswith("(dwb_crm_api, 2/2 in the window)")
    # a step needing 2 units with 1 left in its window is listed too
    assert client.enqueue(dwb_crm_big, 0).result(timeout=10) == 0
    big = client.enqueue(dwb_crm_big, 1)
    time.sleep(0.6)
    assert client.why_waiting(big.id)["dwb_crm_big"].endswith(
        "(dwb_crm_big_api, 2/3 in the window)"
    )
    limits = client.stats()["limits"]
    assert any("dwb_crm_api" in str(row) for row in limits), limits


@step(name="dwb_reindex")
def dwb_reindex(job: dict[str, object]) -> object:
    _count("reindex")
    return job


@workflow(name="dwb_reindex_wf")
def dwb_reindex_wf(job: Ref[dict[str, object]]) -> NodeRef[object]:
    return dwb_reindex(job)


DEBOUNCE = Debounce(key="doc", delay=timedelta(seconds=5))


def test_flow_debounce_collapses_submits_into_one_run_with_the_last_input_and_deadline(
    start_worker: StartWorker, client: Client, clock: Clock
) -> None:
    start_worker(dwb_reindex)
    first = client.submit(
        dwb_reindex_wf, {"doc": "d1", "v": 1}, debounce=DEBOUNCE, deadline=timedelta(hours=1)
    )
    second = client.submit(dwb_reindex_wf, {"doc": "d1", "v": 2}, debounce=DEBOUNCE)
    other = client.submit(dwb_reindex_wf, {"doc": "d2", "v": 3}, debounce=DEBOUNCE)
    assert (first.created, second.created, other.created) == (True, False, True)
    assert second.id == first.id != other.id
    run = client.get_run(first.id)
    assert run.input == {"doc": "d1", "v": 2}
    assert run.deadline_at is None  # the last submit gave none
    planned = run.step("dwb_reindex").scheduled_at
    time.sleep(0.5)
    assert run.state is RunState.RUNNING and CALLS["reindex"] == 0
    clock(datetime.now(UTC) + timedelta(seconds=6))
    assert first.result(timeout=10) == {"doc": "d1", "v": 2}
    assert client.get_run(first.id).step("dwb_reindex").started_at >= planned
    # once a step of the run was claimed, the next submit opens a new window
    third = client.submit(dwb_reindex_wf, {"doc": "d1", "v": 4}, debounce=DEBOUNCE)
    assert third.created and third.id != first.id


def test_flow_debounce_joins_a_paused_run_which_stays_paused(
    start_worker: StartWorker, client: Client, clock: Clock
) -> None:
    start_worker(dwb_reindex)
    first = client.submit(dwb_reindex_wf, {"doc": "p", "v": 1}, debounce=DEBOUNCE)
    client.pause(first.id)
    joined = client.submit(dwb_reindex_wf, {"doc": "p", "v": 2}, debounce=DEBOUNCE)
    assert (joined.created, joined.id) == (False, first.id)
    clock(datetime.now(UTC) + timedelta(seconds=30))
    time.sleep(0.6)
    run = client.get_run(first.id)
    assert run.state is RunState.PAUSED and run.input == {"doc": "p", "v": 2}
    client.resume(first.id)
    assert first.result(timeout=10) == {"doc": "p", "v": 2}


@workflow(name="dwb_debounce_wait_first")
def dwb_debounce_wait_first(job):  # type: ignore[no-untyped-def]
    go = wait_signal("go")
    return dwb_reindex(job, after=[go])


def test_flow_debounce_refuses_a_workflow_that_does_not_start_with_plain_steps(
    client: Client,
) -> None:
    with pytest.raises(InvalidArgument):
        client.submit(dwb_debounce_wait_first, {"doc": "w"}, debounce=DEBOUNCE)
    assert _run_count(client, "dwb_debounce_wait_first") == 0


# =========================================================================================
# runs-and-steps.md
# =========================================================================================


class DwbUnprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


@step(name="dwb_odd_errors", max_attempts=3)
def dwb_odd_errors(value: str, ctx: StepContext) -> int:
    if ctx.attempt == 1:
        if value == "str":
            raise DwbUnprintable
        if value == "exit":
            raise SystemExit(3)
        if value == "interrupt":
            raise KeyboardInterrupt
        if value == "timeout":
            raise TimeoutError("the library's own timeout")
    return ctx.attempt


@workflow(name="dwb_odd_errors_wf")
def dwb_odd_errors_wf(value: Ref[str]) -> NodeRef[int]:
    return dwb_odd_errors(value)


@step(name="dwb_odd_errors_async", max_attempts=3)
async def dwb_odd_errors_async(value: str, ctx: StepContext) -> int:
    if ctx.attempt == 1:
        if value == "exit":
            raise SystemExit(3)
        raise KeyboardInterrupt
    return ctx.attempt


@workflow(name="dwb_odd_errors_async_wf")
def dwb_odd_errors_async_wf(value: Ref[str]) -> NodeRef[int]:
    return dwb_odd_errors_async(value)


def test_runs_odd_exceptions_fail_the_attempt_and_are_retried(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwb_odd_errors, dwb_odd_errors_async)
    runs = {
        what: client.submit(dwb_odd_errors_wf, what)
        for what in ("str", "exit", "interrupt", "timeout")
    }
    runs["async-exit"] = client.submit(dwb_odd_errors_async_wf, "exit")
    runs["async-interrupt"] = client.submit(dwb_odd_errors_async_wf, "interrupt")
    for what, handle in runs.items():
        assert handle.result(timeout=20) == 2, what
    errors = {}
    for what, handle in runs.items():
        node = "dwb_odd_errors_async" if what.startswith("async") else "dwb_odd_errors"
        (attempt,) = client.get_run(handle.id).step(node).attempts
        assert attempt.outcome == "retried", what
        errors[what] = attempt.error
    assert errors["str"] == "DwbUnprintable: <str() raised RuntimeError>"
    # the worker survived SystemExit and KeyboardInterrupt: it ran every second attempt
    failed_on = {a.worker for h in runs.values() for a in _attempts(client, h.id)}
    completed_on = {client.get_run(h.id).steps[0].lease_owner for h in runs.values()}
    assert len(failed_on) == 1 and failed_on == completed_on, (failed_on, completed_on)
    # a TimeoutError the handler raises itself is an error like any other
    (attempt,) = client.get_run(runs["timeout"].id).step("dwb_odd_errors").attempts
    assert attempt.error_kind == "error"


def _attempts(client: Client, run_id: int) -> tuple[Any, ...]:
    return client.get_run(run_id).steps[0].attempts


class DwbLazy(dict[str, object]):
    def items(self):  # type: ignore[no-untyped-def, override]
        raise ConnectionError("the backend has gone")

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise ConnectionError("the backend has gone")

    def keys(self):  # type: ignore[no-untyped-def, override]
        raise ConnectionError("the backend has gone")


@step(name="dwb_bad_output", max_attempts=3)
def dwb_bad_output(value: str) -> object:
    _count(f"bad_output:{value}")
    if value == "set":
        return {1, 2}
    if value == "lazy":
        return DwbLazy(a=1)
    return object()


@workflow(name="dwb_bad_output_wf")
def dwb_bad_output_wf(value: Ref[str]) -> NodeRef[object]:
    return dwb_bad_output(value)


@pytest.mark.parametrize("value", ["set", "lazy", "object"])
def test_runs_an_output_that_is_not_json_fails_for_good_without_retry(
    start_worker: StartWorker, client: Client, value: str
) -> None:
    start_worker(dwb_bad_output)
    handle = client.submit(dwb_bad_output_wf, value)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=15)
    assert failed.value.error_kind == "invalid_output"
    assert CALLS[f"bad_output:{value}"] == 1


@step(name="dwb_numbers")
def dwb_numbers(value: object) -> object:
    return value


@workflow(name="dwb_numbers_wf")
def dwb_numbers_wf(value: Ref[object]) -> NodeRef[object]:
    return dwb_numbers(value)


@step(name="dwb_numbers_next")
def dwb_numbers_next(value: object) -> object:
    return [value, type(value).__name__]


@workflow(name="dwb_numbers_chain")
def dwb_numbers_chain(value: Ref[object]) -> NodeRef[object]:
    return dwb_numbers_next(dwb_numbers(value))


def test_runs_numbers_come_back_as_jsonb_keeps_them(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwb_numbers, dwb_numbers_next)
    out = client.submit(dwb_numbers_wf, [2e3, 0.1, 1e16, 2**63 - 1, -(2**63)]).result(timeout=10)
    assert out == [2000, 0.1, 1e16, 2**63 - 1, -(2**63)]  # a float comes back equal
    assert isinstance(out, list) and type(out[2]) is int  # 1e16: a whole one as an int
    # a float of 1e19 or more is read back as a float, so a step can pass it on
    assert client.submit(dwb_numbers_chain, 1e19).result(timeout=10) == [1e19, "float"]
    assert client.submit(dwb_numbers_chain, 1.5e300).result(timeout=10) == [1.5e300, "float"]
    # an integer must fit in 64 bits
    with pytest.raises(InvalidArgument):
        client.submit(dwb_numbers_wf, 2**64)


@step(name="dwb_flaky", max_attempts=5)
def dwb_flaky(value: object, ctx: StepContext) -> int:
    if ctx.attempt < 2:
        raise RuntimeError("first attempt fails")
    return ctx.attempt


@workflow(name="dwb_flaky_wf")
def dwb_flaky_wf(value: Ref[object]) -> NodeRef[int]:
    return dwb_flaky(value)


def test_runs_the_pages_whole_float_examples(start_worker: StartWorker, client: Client) -> None:
    page = (ROOT / "docs/concepts/runs-and-steps.md").read_text(encoding="utf-8")
    assert "(`1e16` as `10000000000000000`" in page and "`2e3`, written `2000.0`" in page
    start_worker(dwb_numbers)
    out = client.submit(dwb_numbers_wf, 1e16).result(timeout=10)
    assert (out, type(out)) == (10**16, int)
    out = client.submit(dwb_numbers_wf, 2e3).result(timeout=10)
    assert (out, type(out)) == (2000.0, float)


def test_runs_attempt_numbers_label_and_history(start_worker: StartWorker, client: Client) -> None:
    start_worker(dwb_flaky)
    handle = client.submit(dwb_flaky_wf, 1)
    assert handle.result(timeout=15) == 2  # ctx.attempt == 2 on its first retry
    flaky = client.get_run(handle.id).step("dwb_flaky")
    assert flaky.attempt == 1  # the column counts failed executions
    assert flaky.attempt_number == 2
    (first,) = flaky.attempts
    assert (first.outcome, first.error) == ("retried", "RuntimeError: first attempt fails")
    assert flaky.error is None and flaky.error_kind is None


# the page's sample, with write() and the rows given
@step(name="dwb_export", timeout=timedelta(minutes=5))
def dwb_export(rows: list[int], ctx: StepContext) -> int:
    done = 0
    SEEN["export_ctx"] = ctx
    for row in rows:
        if ctx.cancelled:  # timed out, cancelled, or the lease is gone
            _gate("dwb_export_stopped").set()
            raise RuntimeError("stopped")
        _count("export_row")
        _gate("dwb_export_started").set()
        SEEN["written"] = row  # write(row)
        time.sleep(0.05)
        done += 1
    return done


@workflow(name="dwb_export_wf")
def dwb_export_wf(rows: Ref[list[int]]) -> NodeRef[int]:
    return dwb_export(rows)


def test_runs_export_sample_stops_soon_after_its_run_is_cancelled(
    start_worker: StartWorker, client: Client
) -> None:
    # A lease of an hour: no heartbeat (every 20 min) looks at the step during the test, so
    # only the cancel's NOTIFY can tell the handler to stop before its 400 rows are done.
    start_worker(dwb_export, lease=3600)
    handle = client.submit(dwb_export_wf, list(range(400)))  # 20 s of rows
    assert _gate("dwb_export_started").wait(10)
    ctx: StepContext = SEEN["export_ctx"]
    client.cancel(handle.id)
    # The rows written once ctx.cancelled is set (read when it is seen set, so at least as
    # many as when it was set, however late this thread looks).
    told = wait_until(
        lambda: ctx.cancelled and CALLS["export_row"], what="ctx.cancelled", timeout=PROMPT
    )
    assert _gate("dwb_export_stopped").wait(PROMPT)  # it raised "stopped"
    assert CALLS["export_row"] <= told + 1  # it stopped within a row of ctx.cancelled
    assert CALLS["export_row"] < 400  # stopped soon after the cancel: far from its 20 s
    export = client.get_run(handle.id).step("dwb_export")
    assert export.state is StepState.CANCELLED
    assert client.get_run(handle.id).state is RunState.CANCELLED


@step(name="dwb_fails")
def dwb_fails(value: object) -> object:
    raise RuntimeError("boom")


@workflow(name="dwb_fails_wf")
def dwb_fails_wf(value: Ref[object]) -> NodeRef[object]:
    return dwb_fails(value, max_attempts=1)


@step(name="dwb_blocker")
def dwb_blocker(value: object) -> object:
    _gate("dwb_blocker").wait(10)
    return value


@workflow(name="dwb_branchy")
def dwb_branchy(value):  # type: ignore[no-untyped-def]
    failed = dwb_fails(value, max_attempts=1)
    dwb_numbers(failed, on_dep_failure="cancel_branch")
    return dwb_blocker(value)


def test_runs_retry_refusals_change_nothing(start_worker: StartWorker, client: Client) -> None:
    start_worker(dwb_numbers, dwb_fails, dwb_blocker)
    done = client.submit(dwb_numbers_wf, 1)
    done.result(timeout=10)
    with pytest.raises(InvalidTransition):
        client.retry(done.id, "dwb_numbers")  # completed: nothing to retry
    held = client.submit(dwb_branchy, 1)
    wait_until(
        lambda: client.get_run(held.id).step("dwb_fails").state is StepState.DISCARDED,
        what="the contained failure",
        timeout=10,
    )
    client.pause(held.id)
    with pytest.raises(InvalidTransition):
        client.retry(held.id, "dwb_fails")  # "a paused run starts nothing"
    run = client.get_run(held.id)
    assert run.state is RunState.PAUSED
    assert run.step("dwb_fails").state is StepState.DISCARDED
    client.resume(held.id)
    client.retry(held.id, "dwb_fails")  # "client.resume(run_id), then retry"
    _gate("dwb_blocker").set()
    assert held.result(timeout=10) == 1  # the failure, run again, is contained again
    assert len(client.get_run(held.id).step("dwb_fails").attempts) == 2


def test_runs_run_filter_refusals(client: Client) -> None:
    with pytest.raises(InvalidArgument):
        RunFilter()
    with pytest.raises(InvalidArgument):
        RunFilter(states="exploded")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        RunFilter(error_kinds=["oops"])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument):
        RunFilter(workflows=[""])
    with pytest.raises(InvalidArgument):
        RunFilter(since=datetime(2030, 1, 1))  # naive
    now = datetime.now(UTC)
    with pytest.raises(InvalidArgument):
        RunFilter(since=now, until=now)  # since not before until
    with pytest.raises(InvalidArgument):
        client.retry_many(RunFilter(states="running"))
    with pytest.raises(InvalidArgument):
        client.cancel_many(RunFilter(states="completed"))

    async def progress(_: object) -> None: ...

    with pytest.raises(InvalidArgument):
        client.cancel_many(RunFilter(workflows="dwb_none"), progress=progress)  # type: ignore[arg-type]


def test_runs_retry_many_dry_run_counts_then_retries(
    start_worker: StartWorker, client: Client
) -> None:
    start_worker(dwb_fails)
    failed = [client.submit(dwb_fails_wf, n) for n in range(3)]
    for handle in failed:
        with pytest.raises(RunFailed):
            handle.result(timeout=10)
    where = RunFilter(workflows="dwb_fails_wf", error_kinds="error")
    dry = client.retry_many(where, dry_run=True)
    assert (dry.matched, dry.acted) == (3, 0)
    seen: list[int] = []
    result = client.retry_many(where, progress=lambda so_far: seen.append(so_far.acted))
    assert (result.matched, result.acted, result.skipped) == (3, 3, 0)
    assert seen and seen[-1] == 3
    for handle in failed:
        with pytest.raises(RunFailed):
            handle.result(timeout=10)
    for handle in failed:  # retried with a fresh budget: failed again
        assert len(client.get_run(handle.id).step("dwb_fails").attempts) == 2


def test_runs_unique_key_returns_the_holder(client: Client) -> None:
    first = client.enqueue(dwb_numbers, 1, unique_key="dwb-k")
    again = client.enqueue(dwb_numbers, 2, unique_key="dwb-k")
    assert (first.created, again.created, again.id) == (True, False, first.id)
    assert client.get_run(first.id).workflow == "dwb_numbers"  # a one-step run of the kind


def test_runs_submit_tx_is_atomic_with_your_writes_and_a_failed_submit_keeps_them(
    payments: str, client: Client
) -> None:
    with psycopg.connect(payments) as conn:
        conn.execute("INSERT INTO dwb_payments VALUES ('tx', 1)")
        with pytest.raises(InvalidArgument):
            client.submit_tx(conn, dwb_sync_wf, {"no": "tenant"})  # a refused key
        handle = client.submit_tx(conn, dwb_numbers_wf, 5)
        conn.rollback()
    with pytest.raises(RunNotFound):
        client.get_run(handle.id)
    assert _rows(payments, "SELECT * FROM dwb_payments") == []
    with psycopg.connect(payments) as conn:
        conn.execute("INSERT INTO dwb_payments VALUES ('tx', 2)")
        with pytest.raises(InvalidArgument):
            client.submit_tx(conn, dwb_sync_wf, {"no": "tenant"})
        handle = client.submit_tx(conn, dwb_numbers_wf, 6)
        conn.commit()
    assert client.get_run(handle.id).input == 6
    assert _rows(payments, "SELECT * FROM dwb_payments") == [("tx", 2)]


def test_runs_submit_tx_refuses_pipeline_mode_and_the_other_connection_kind(
    payments: str, client: Client
) -> None:
    with psycopg.connect(payments) as conn, conn.pipeline(), pytest.raises(InvalidArgument):
        client.submit_tx(conn, dwb_numbers_wf, 1)

    async def other_kind() -> None:
        async with await psycopg.AsyncConnection.connect(payments) as aconn:
            with pytest.raises(TypeError):
                client.submit_tx(aconn, dwb_numbers_wf, 1)  # type: ignore[arg-type]

    asyncio.run(other_kind())
    assert _run_count(client, "dwb_numbers_wf") == 0


# =========================================================================================
# schedules.md
# =========================================================================================


@step(name="dwb_nightly_step")
def dwb_nightly_step(params: object, ctx: StepContext) -> list[object]:
    return [params, ctx.max_attempts]


@workflow(name="dwb_nightly_report")
def dwb_nightly_report(params):  # type: ignore[no-untyped-def]
    return dwb_nightly_step(params, max_attempts=4)


@step(name="dwb_no_param")
def dwb_no_param() -> str:
    return "none"


def test_schedules_an_expression_no_date_matches_is_refused_and_nothing_written(
    client: Client,
) -> None:
    from cyclone_dsl import schedule
    from cyclone_dsl.errors import ScheduleError

    with pytest.raises(ScheduleError):
        schedule("0 0 30 2 *", id="dwb-feb30")
    with pytest.raises(ScheduleError):
        client.schedule(dwb_nightly_report, "0 0 30 2 *", id="dwb-feb30", location="UTC")
    # an input its target could not take
    with pytest.raises(InvalidArgument):
        client.schedule(dwb_no_param, "* * * * *", id="dwb-no-param", input=1)
    with pytest.raises(InvalidArgument):
        client.schedule(dwb_sync_account, "* * * * *", id="dwb-no-key", input={"x": 1})
    assert not [s for s in client.list_schedules() if s.id.startswith("dwb-")]


def test_schedules_the_runtime_sample_and_its_defaults(client: Client) -> None:
    made = client.schedule(
        dwb_nightly_report, "*/15 * * * *", id="dwb-quarter-hourly", location="UTC"
    )
    assert (made.enabled, made.location, made.cron_spec) == (True, "UTC", "*/15 * * * *")
    assert (made.queue, made.priority, made.max_attempts) == ("default", 0, 5)
    assert made.next_run_at.minute % 15 == 0 and made.next_run_at.second == 0
    local = client.schedule(dwb_nightly_report, "0 3 * * *", id="dwb-local")
    assert local.location == "Local"  # the default, stored and listed as Local
    assert client.schedule(dwb_nightly_report, "0 3 * * *", id="dwb-local2", location="Local")
    client.enable_schedule("dwb-quarter-hourly", False)
    listed = {s.id: s for s in client.list_schedules()}
    assert listed["dwb-quarter-hourly"].enabled is False
    assert listed["dwb-quarter-hourly"].next_run_at == made.next_run_at  # it keeps its slot
    client.unschedule("dwb-quarter-hourly")
    assert "dwb-quarter-hourly" not in {s.id for s in client.list_schedules()}


def _fired(client: Client, *ids: str) -> dict[str, int] | None:
    found = {s.id: s.last_run_id for s in client.list_schedules() if s.id in ids}
    if len(found) == len(ids) and all(found.values()):
        return found  # type: ignore[return-value]
    return None


def test_schedules_a_workflow_schedule_applies_the_options_it_sets_to_every_step(
    start_worker: StartWorker, client: Client, clock: Clock
) -> None:
    start_worker(dwb_nightly_report, queues=["night", "default"])
    client.schedule(
        dwb_nightly_report,
        "* * * * *",
        id="dwb-night",
        location="UTC",
        input={"days": 1},
        queue="night",
        max_attempts=2,
    )
    client.schedule(dwb_nightly_report, "* * * * *", id="dwb-day", location="UTC", max_attempts=5)
    clock(datetime.now(UTC) + timedelta(minutes=2))
    fired = wait_until(
        lambda: _fired(client, "dwb-night", "dwb-day"), what="both schedules fired", timeout=10
    )
    night = client.handle(fired["dwb-night"])
    assert night.result(timeout=10) == [{"days": 1}, 2]
    nightly = client.get_run(night.id).step("dwb_nightly_step")
    assert (nightly.queue, nightly.max_attempts) == ("night", 2)
    # setting exactly a default value is the same as not setting it: the step keeps its 4
    day = client.handle(fired["dwb-day"])
    assert day.result(timeout=10) == [None, 4]


def test_schedules_a_worker_given_only_the_steps_leaves_the_slot_and_says_why(
    start_worker: StartWorker, client: Client, clock: Clock
) -> None:
    """schedules.md: a workflow's schedule fires on a worker given the workflow (or its
    module); one given only its steps runs its runs (versioning.md) but leaves the slot,
    with a last_error that names the workflow and what to do."""
    start_worker(dwb_nightly_step)
    client.schedule(dwb_nightly_report, "* * * * *", id="dwb-steps-only", location="UTC", input=3)
    assert client.submit(dwb_nightly_report, 1).result(timeout=10) == [1, 4]
    clock(datetime.now(UTC) + timedelta(minutes=2))
    wait_until(lambda: the_schedule(client, "dwb-steps-only").last_error, what="the refused fire")
    left = the_schedule(client, "dwb-steps-only")
    assert left.last_run_id is None
    assert "workflow 'dwb_nightly_report'" in str(left.last_error)
    assert "@step or @action" not in str(left.last_error)
    assert "module" in str(left.last_error)
    start_worker(dwb_nightly_report)
    wait_until(lambda: the_schedule(client, "dwb-steps-only").last_run_id, what="the fire")
    fired = the_schedule(client, "dwb-steps-only")
    assert fired.last_error is None
    assert client.handle(fired.last_run_id).result(timeout=10) == [3, 4]


def the_schedule(client: Client, schedule_id: str) -> Any:
    (found,) = [s for s in client.list_schedules() if s.id == schedule_id]
    return found


@pytest.mark.parametrize("older_than", [timedelta(days=366_000), timedelta(seconds=-1), "7d", 3600])
def test_schedules_purge_older_than_refusals(client: Client, older_than: object) -> None:
    with pytest.raises(InvalidArgument):
        client.purge(older_than=older_than)  # type: ignore[arg-type]


@pytest.mark.parametrize("retention", [0, timedelta(0), -5, "7d", timedelta(days=366_000)])
def test_schedules_worker_retention_refusals(cyclone_dsn: str, retention: object) -> None:
    with pytest.raises(InvalidArgument):
        Worker(cyclone_dsn, [dwb_numbers], retention=retention)  # type: ignore[arg-type]


def test_schedules_worker_retention_accepts_seconds_and_none(cyclone_dsn: str) -> None:
    Worker(cyclone_dsn, [dwb_numbers], retention=7 * 86400)
    Worker(cyclone_dsn, [dwb_numbers], retention=None)


# =========================================================================================
# versioning.md
# =========================================================================================


def test_versioning_def_version_changes_with_the_shape_not_the_handler_body() -> None:
    from cyclone_dsl.dsl.step import StepDef
    from cyclone_dsl.dsl.workflow import WorkflowDef

    def body_a(x: object) -> object:
        return x

    def body_b(x: object) -> object:
        return [x, "a different body"]

    step_a = StepDef(body_a, "dwb_ver_step", True, dwb_numbers.options)
    step_b = StepDef(body_b, "dwb_ver_step", True, dwb_numbers.options)

    def shape(s: Any, **options: Any) -> Callable[..., Any]:
        def build(x):  # type: ignore[no-untyped-def]
            return s(x, **options)

        return build

    def body_pair(x: object, y: object) -> object:
        return [x, y]

    step_pair = StepDef(body_pair, "dwb_ver_step", True, dwb_numbers.options)

    def as_tuple(x):  # type: ignore[no-untyped-def]
        return step_pair(x, x)

    versions = {
        name: WorkflowDef(builder, "dwb_ver_wf").def_version
        for name, builder in {
            "a": shape(step_a),
            "b": shape(step_b),
            "option": shape(step_a, max_attempts=2),
            "renamed": shape(step_a, node_id="dwb_other_node"),
            "tuple": as_tuple,
        }.items()
    }
    assert versions["a"] == versions["b"]  # only the handler's body changed
    assert len({versions[k] for k in ("a", "option", "renamed", "tuple")}) == 4
