"""Audit of observability as an on-call engineer relies on it, on the paths that are not
the happy one: cancels, deadlines, pauses, retries in backoff, reclaims, failed fan-out
items and failed child runs.

Each test drives a real worker against the real database and reads what a Prometheus
scrape, an OpenTelemetry exporter, a log handler, the stats views or the dashboard's
attempt list shows, and checks it against what actually happened.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.testclient import TestClient

from cyclone_dsl import (
    Client,
    Permanent,
    RunState,
    StepContext,
    Worker,
    child,
    for_each,
    step,
    workflow,
)
from cyclone_dsl.testing import set_clock_shift
from cyclone_dsl.ui.app import create_app
from tests.logged import Lines
from tests.scraped import counts, metered, scrape, total
from tests.waiting import expire_leases_until, wait_until

Spans = tuple[TracerProvider, Callable[[], list[ReadableSpan]]]

handler_log = logging.getLogger("tests.obc")

# -- handlers -----------------------------------------------------------------------------

gates: dict[str, threading.Event] = {}
calls: dict[str, list[Any]] = {}
calls_lock = threading.Lock()


def gate(name: str) -> threading.Event:
    with calls_lock:
        return gates.setdefault(name, threading.Event())


def record(name: str, value: Any) -> int:
    """Note a call of ``name``; return how many there were, this one included."""
    with calls_lock:
        seen = calls.setdefault(name, [])
        seen.append(value)
        return len(seen)


def called(name: str) -> list[Any]:
    with calls_lock:
        return list(calls.get(name, []))


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    gates.clear()
    calls.clear()
    yield
    for event in list(gates.values()):  # never leave a handler blocked
        event.set()


def held(name: str, ctx: StepContext) -> bool:
    """Block until the gate ``name`` opens (True) or the step is cancelled (False)."""
    opened = gate(name)
    while not opened.wait(0.02):
        if ctx.cancelled:
            return False
    return True


@step(name="obc_hold", max_attempts=3)
def obc_hold(n: int, *, ctx: StepContext) -> int:
    record("obc_hold", ctx.attempt)
    held("obc_hold", ctx)
    return n


@step(name="obc_ok")
def obc_ok(n: int) -> int:
    return n + 1


@workflow(name="obc_pair")
def obc_pair(n):  # type: ignore[no-untyped-def]
    return obc_ok(obc_hold(n))


@step(name="obc_list")
def obc_list(n: int) -> list[int]:
    return list(range(n))


@step(name="obc_item", max_attempts=1)
def obc_item(i: int, *, ctx: StepContext) -> int:
    record("obc_item", i)
    if i == 2:
        gate("obc_item_siblings_running").wait(10)
        raise Permanent(f"item {i} is broken")
    if len(called("obc_item")) >= 3:
        gate("obc_item_siblings_running").set()
    held("obc_item", ctx)
    return i


@workflow(name="obc_fan")
def obc_fan(n):  # type: ignore[no-untyped-def]
    return for_each(obc_item, over=obc_list(n))


@step(name="obc_perm", max_attempts=2)
def obc_perm(n: int) -> int:
    raise Permanent(f"child input {n} refused")


@workflow(name="obc_inner")
def obc_inner(n):  # type: ignore[no-untyped-def]
    return obc_perm(n)


@workflow(name="obc_parent")
def obc_parent(n):  # type: ignore[no-untyped-def]
    return obc_ok(child(obc_inner, obc_ok(n)))


@step(name="obc_flaky", max_attempts=3)
def obc_flaky(n: int, *, ctx: StepContext) -> int:
    handler_log.info("obc_flaky try")
    if ctx.attempt == 1:
        # Fail with the database clock an hour on: the retry is due an hour from now,
        # once the test has moved the clock back.
        set_clock_shift(timedelta(hours=1))
        raise RuntimeError("first try fails")
    return n


@step(name="obc_stall", max_attempts=2)
def obc_stall(n: int, *, ctx: StepContext) -> int:
    number = record("obc_stall", ctx.attempt)
    handler_log.info("obc_stall execution %d", number)
    gate(f"obc_stall{number}").wait(20)
    return n


@workflow(name="obc_fan_stall")
def obc_fan_stall(n):  # type: ignore[no-untyped-def]
    return for_each(obc_stall, over=obc_list(n))


@step(name="obc_stubborn", timeout=0.3, max_attempts=2)
async def obc_stubborn(n: int, *, ctx: StepContext) -> int:
    record("obc_stubborn", ctx.attempt)
    if ctx.attempt == 1:
        try:
            await asyncio.sleep(20)
        except asyncio.CancelledError:
            # Catches its cancel and goes on a little: its slot is held until it returns.
            await asyncio.sleep(0.3)
            return -1
    return n


# -- helpers ------------------------------------------------------------------------------


def idle(worker: Worker) -> None:
    wait_until(lambda: worker.slots_in_use == 0, what="every handler returned")


@pytest.fixture
def spans() -> Iterator[Spans]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, lambda: list(exporter.get_finished_spans())
    provider.shutdown()


def attr(span: ReadableSpan, name: str) -> object:
    assert span.attributes is not None
    return span.attributes.get(name)


def named(found: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in found if s.name == name]


@pytest.fixture
def web(client: Client) -> Iterator[TestClient]:
    with TestClient(create_app(client)) as test_client:
        yield test_client


def listed_attempts(web: TestClient, run_id: int) -> dict[str, list[dict[str, Any]]]:
    """The dashboard's attempt list of each node (``/api/runs/<id>/attempts``)."""
    response = web.get(f"/api/runs/{run_id}/attempts")
    assert response.status_code == 200, response.text
    listed: dict[str, list[dict[str, Any]]] = response.json()
    return listed


def gauges_of(client: Client) -> dict[tuple[str, str | None, str | None], float]:
    return {(g["gauge"], g["queue"], g["state"]): g["value"] for g in client.gauges()}


# -- cancels and deadlines ------------------------------------------------------------------


def test_obc_an_execution_cancelled_mid_step_stays_listed_after_a_retry(
    client: Client, start_worker: Callable[..., Worker], web: TestClient
) -> None:
    """ui.md (Attempts): each node lists every execution: the history, then the step's
    own latest one (completed, running or cancelled). A step cancelled while it ran, then
    retried by an operator and completed, ran twice: both executions must be listed."""
    worker = start_worker(obc_hold)
    handle = client.enqueue(obc_hold, 1)
    wait_until(lambda: called("obc_hold"), what="the first execution runs")
    client.cancel(handle.id)
    assert handle.wait(timeout=20).state is RunState.CANCELLED
    idle(worker)
    before = listed_attempts(web, handle.id)["obc_hold"]
    assert [a["outcome"] for a in before] == ["cancelled"]
    gate("obc_hold").set()
    client.retry(handle.id, "obc_hold")
    assert handle.result(timeout=20) == 1
    assert len(called("obc_hold")) == 2
    after = listed_attempts(web, handle.id)["obc_hold"]
    assert [a["outcome"] for a in after] == ["cancelled", "completed"], after


def test_obc_a_deadline_passing_mid_step_is_fenced_once_and_leaves_nothing_open(
    client: Client,
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    spans: Spans,
    clock: Callable[[timedelta], None],
    web: TestClient,
) -> None:
    provider, finished = spans
    worker = metered(start_worker, obc_pair, tracing=provider)
    with Client(cyclone_dsn, tracing=provider) as traced:
        run_id = traced.submit(obc_pair, 3, deadline=timedelta(minutes=5)).id
    handle = client.handle(run_id)
    wait_until(lambda: called("obc_hold"), what="the step runs")
    clock(timedelta(minutes=10))
    run = handle.wait(timeout=20)
    assert run.state is RunState.FAILED
    idle(worker)
    wait_until(
        lambda: counts(scrape(worker.metrics_port), "obc_hold")["fenced"] == 1,
        what="the attempt fenced",
    )
    samples = scrape(worker.metrics_port)
    assert counts(samples, "obc_hold") == {
        "claimed": 1,
        "completed": 0,
        "retried": 0,
        "failed": 0,
        "fenced": 1,
    }
    assert counts(samples, "obc_ok")["claimed"] == 0
    # The scanner ended the run, not a worker's outcome.
    assert total(samples, "cyclone_run_duration_seconds_count") == 0
    assert total(samples, "cyclone_step_handler_seconds_count", kind="obc_hold") == 1
    assert total(samples, "cyclone_worker_slots_in_use") == 0
    # Nothing of the run is open any more.
    assert not [g for g in client.gauges() if g["gauge"] != "waiting_runs" and g["value"]]
    stats = client.stats()
    assert [q for q in stats["queues"] if q["available"] or q["running"] or q["waiting"]] == []
    # The span of the attempt ended, abandoned, with the fence as its only event.
    wait_until(lambda: named(finished(), "cyclone.step obc_hold"), what="the attempt's span")
    [attempt] = named(finished(), "cyclone.step obc_hold")
    assert attr(attempt, "cyclone.outcome") == "abandoned"
    assert [e.name for e in attempt.events] == ["cyclone.fenced"]
    assert attempt.end_time is not None and attempt.start_time is not None
    assert attempt.end_time >= attempt.start_time
    # The execution is listed once, ended.
    [listed] = listed_attempts(web, handle.id)["obc_hold"]
    assert listed["ended_at"] is not None
    assert listed["outcome"] in ("cancelled", "discarded")
    assert listed["error_kind"] == "deadline"


def test_obc_a_cancelled_execution_lists_the_worker_that_ran_it(
    client: Client, start_worker: Callable[..., Worker], web: TestClient
) -> None:
    """ui.md (Attempts): each attempt is listed "with its worker, start, duration, error".
    The execution a cancel stopped ran on a worker: the list should say which."""
    worker = start_worker(obc_hold)
    handle = client.enqueue(obc_hold, 1)
    wait_until(lambda: called("obc_hold"), what="the execution runs")
    client.cancel(handle.id)
    assert handle.wait(timeout=20).state is RunState.CANCELLED
    idle(worker)
    [listed] = listed_attempts(web, handle.id)["obc_hold"]
    assert listed["outcome"] == "cancelled"
    assert listed["worker"] == worker.id, listed


@step(name="obc_held_item")
def obc_held_item(i: int, *, ctx: StepContext) -> int:
    record("obc_held_item", i)
    held("obc_held_item", ctx)
    return i


@workflow(name="obc_held_fan")
def obc_held_fan(n):  # type: ignore[no-untyped-def]
    return for_each(obc_held_item, over=obc_list(n))


def test_obc_fan_out_items_cancelled_mid_step_stay_listed_after_a_retry(
    client: Client, start_worker: Callable[..., Worker], web: TestClient
) -> None:
    """The items' twin of the retry above: a retry resets a fan-out's cancelled items
    (retry_reset_items), and each item's execution the cancel stopped stays listed, with
    the worker it ran on and the cancel as its error."""
    worker = start_worker(obc_held_fan, concurrency=4)
    handle = client.submit(obc_held_fan, 2)
    wait_until(lambda: len(called("obc_held_item")) == 2, what="both items run")
    client.cancel(handle.id)
    assert handle.wait(timeout=20).state is RunState.CANCELLED
    idle(worker)
    fan_out = next(s.item_of for s in handle.get().steps if s.item_of is not None)
    assert fan_out is not None
    gate("obc_held_item").set()
    client.retry(handle.id, fan_out)
    assert handle.result(timeout=20) == [0, 1]
    items = [s for s in handle.get().steps if s.item_of == fan_out]
    assert len(items) == 2
    for item in items:
        kept = [(a.outcome, a.worker, a.error_kind) for a in item.attempts]
        assert kept == [("cancelled", worker.id, "cancelled")], (item.node, kept)
        listed = listed_attempts(web, handle.id)[item.node]
        assert [a["outcome"] for a in listed] == ["cancelled", "completed"], listed


@step(name="obc_second_try", max_attempts=3)
def obc_second_try(n: int, *, ctx: StepContext) -> int:
    record("obc_second_try", ctx.attempt)
    if ctx.attempt == 1:
        raise RuntimeError("attempt 1 broke")
    held("obc_second_try", ctx)
    return n


@workflow(name="obc_second_flow")
def obc_second_flow(n):  # type: ignore[no-untyped-def]
    return obc_second_try(n)


@pytest.mark.parametrize("ended_by", ["cancel", "deadline"])
def test_obc_an_ended_second_attempt_is_not_listed_with_the_first_attempts_error(
    client: Client,
    start_worker: Callable[..., Worker],
    web: TestClient,
    clock: Callable[[timedelta], None],
    ended_by: str,
) -> None:
    """Attempt 1 fails (retried); a cancel or the run's deadline stops attempt 2 while it
    runs. The dashboard lists attempt 1 (retried, with its error) and attempt 2
    (cancelled): attempt 2's entry must say what ended it (``cancelled`` or ``deadline``,
    runs-and-steps.md's error kinds), not repeat attempt 1's error as if it had failed the
    same way."""
    worker = start_worker(obc_second_flow)
    handle = client.submit(obc_second_flow, 1, deadline=timedelta(minutes=5))
    wait_until(lambda: len(called("obc_second_try")) == 2, what="attempt 2 runs")
    if ended_by == "cancel":
        client.cancel(handle.id)
    else:
        clock(timedelta(minutes=10))
    assert handle.wait(timeout=20).state in (RunState.CANCELLED, RunState.FAILED)
    idle(worker)
    listed = listed_attempts(web, handle.id)["obc_second_try"]
    assert [(a["number"], a["outcome"]) for a in listed] == [(1, "retried"), (2, "cancelled")]
    assert listed[0]["error_kind"] == "error"
    expected = "cancelled" if ended_by == "cancel" else "deadline"
    assert (listed[1]["error_kind"], "attempt 1 broke" in (listed[1]["error"] or "")) == (
        expected,
        False,
    ), listed[1]


# -- pauses -----------------------------------------------------------------------------------


def test_obc_a_run_paused_mid_step_is_counted_and_gauged_as_it_is(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    worker = metered(start_worker, obc_pair)
    handle = client.submit(obc_pair, 4)
    wait_until(lambda: called("obc_hold"), what="the first step runs")
    client.pause(handle.id)
    gate("obc_hold").set()  # the running step finishes; the next one is paused
    wait_until(
        lambda: str(client.get_run(handle.id).step("obc_ok").state) == "paused",
        what="the next step paused",
    )
    wait_until(
        lambda: counts(scrape(worker.metrics_port), "obc_hold")["completed"] == 1,
        what="the completion",
    )
    samples = scrape(worker.metrics_port)
    assert counts(samples, "obc_ok")["claimed"] == 0
    assert total(samples, "cyclone_run_duration_seconds_count") == 0
    gauges = gauges_of(client)
    assert gauges.get(("steps", "default", "paused")) == 1
    assert gauges.get(("runs", None, "paused")) == 1
    assert gauges.get(("steps", "default", "available"), 0) == 0
    [queue] = [q for q in client.stats()["queues"] if q["queue"] == "default"]
    assert (queue["available"], queue["running"], queue["waiting"]) == (0, 0, 1)
    assert queue["oldest_available_s"] is None
    client.resume(handle.id)
    assert handle.result(timeout=20) == 5
    wait_until(
        lambda: total(scrape(worker.metrics_port), "cyclone_run_duration_seconds_count") == 1,
        what="the run's end observed",
    )
    samples = scrape(worker.metrics_port)
    assert (
        total(samples, "cyclone_run_duration_seconds_count", workflow="obc_pair", state="completed")
        == 1
    )
    assert counts(samples, "obc_ok") == {
        "claimed": 1,
        "completed": 1,
        "retried": 0,
        "failed": 0,
        "fenced": 0,
    }


# -- retries in backoff ------------------------------------------------------------------------


@pytest.mark.usefixtures("clock")
def test_obc_a_step_in_backoff_is_gauged_as_not_due_and_its_retry_logs_attempt_two(
    client: Client,
    start_worker: Callable[..., Worker],
    web: TestClient,
    logged: Lines,
) -> None:
    worker = metered(start_worker, obc_flaky)
    handle = client.enqueue(obc_flaky, 9)

    def retried() -> bool:
        return len(client.get_run(handle.id).steps[0].attempts) == 1

    wait_until(retried, what="the first failure recorded")
    set_clock_shift(timedelta(0))  # the retry is due an hour from now
    step_row = client.get_run(handle.id).steps[0]
    assert str(step_row.state) == "available"
    # Gauges: the step is open and available, but nothing is due: the oldest runnable age
    # is 0 (documented: "0: none"), never negative.
    gauges = client.gauges()
    [available] = [g for g in gauges if g["gauge"] == "steps" and g["state"] == "available"]
    assert available["value"] == 1
    assert available["oldest_s"] is None
    samples = scrape(worker.metrics_port)
    assert total(samples, "cyclone_queue_steps", queue="default", state="available") == 1
    assert total(samples, "cyclone_queue_oldest_runnable_age_seconds", queue="default") == 0
    # The stats: available, with a negative age (all of it scheduled later).
    [queue] = [q for q in client.stats()["queues"] if q["queue"] == "default"]
    assert queue["available"] == 1 and queue["running"] == 0
    assert queue["oldest_available_s"] < -3000
    # The dashboard's attempt list: the failed execution only (the next one has not run).
    listed = listed_attempts(web, handle.id)["obc_flaky"]
    assert [(a["number"], a["outcome"]) for a in listed] == [(1, "retried")]
    assert listed[0]["error_kind"] == "error"
    assert counts(samples, "obc_flaky") == {
        "claimed": 1,
        "completed": 0,
        "retried": 1,
        "failed": 0,
        "fenced": 0,
    }
    # Due now: the retry runs and completes.
    set_clock_shift(timedelta(hours=2))
    assert handle.result(timeout=20) == 9
    listed = listed_attempts(web, handle.id)["obc_flaky"]
    assert [(a["number"], a["outcome"]) for a in listed] == [(1, "retried"), (2, "completed")]
    tries = [line for line in logged() if line["message"] == "obc_flaky try"]
    step_id = client.get_run(handle.id).steps[0].id
    assert [(t["attempt"], t["step_id"], t["run_id"]) for t in tries] == [
        (1, step_id, handle.id),
        (2, step_id, handle.id),
    ]
    wait_until(
        lambda: counts(scrape(worker.metrics_port), "obc_flaky")["completed"] == 1,
        what="the completion",
    )
    assert counts(scrape(worker.metrics_port), "obc_flaky") == {
        "claimed": 2,
        "completed": 1,
        "retried": 1,
        "failed": 0,
        "fenced": 0,
    }


# -- reclaims ------------------------------------------------------------------------------------


@pytest.mark.usefixtures("clock")
def test_obc_a_reclaimed_execution_is_listed_once_and_both_log_the_same_attempt(
    client: Client,
    start_worker: Callable[..., Worker],
    web: TestClient,
    logged: Lines,
) -> None:
    stalled = start_worker(obc_stall, concurrency=1, lease=30.0)
    handle = client.enqueue(obc_stall, 1)
    wait_until(lambda: len(called("obc_stall")) == 1, what="the first execution runs")
    other = start_worker(obc_stall, lease=30.0)
    expire_leases_until(lambda: handle.get().steps[0].reclaims == 1, what="the reclaim")
    wait_until(lambda: len(called("obc_stall")) == 2, what="the second execution runs")
    gate("obc_stall2").set()
    assert handle.result(timeout=20) == 1
    gate("obc_stall1").set()  # the stalled execution returns: fenced
    idle(stalled)
    listed = listed_attempts(web, handle.id)["obc_stall"]
    assert [(a["number"], a["outcome"]) for a in listed] == [(1, "reclaimed"), (1, "completed")]
    assert listed[0]["worker"] == stalled.id
    assert listed[1]["worker"] == other.id
    run = client.get_run(handle.id)
    assert [a.outcome for a in run.steps[0].attempts] == ["reclaimed"]
    # Both executions are attempt 1, as ctx.attempt says; their lines say so too.
    assert called("obc_stall") == [1, 1]
    lines = [line for line in logged() if line["message"].startswith("obc_stall execution")]
    assert len(lines) == 2
    assert {(line["attempt"], line["step_id"]) for line in lines} == {(1, run.steps[0].id)}
    # ui.md (fleet): a step counts once in the throughput, at its latest start.
    slices = client.throughput(window=timedelta(days=1), buckets=4)
    assert sum(s["started"] for s in slices) == 1
    assert sum(s["completed"] for s in slices) == 1


@pytest.mark.usefixtures("clock")
def test_obc_a_reclaimed_fan_out_item_span_names_its_item_and_workflow(
    cyclone_dsn: str, start_worker: Callable[..., Worker], spans: Spans
) -> None:
    """monitoring.md: span attributes include ``cyclone.item_index`` (a fan-out item's
    index) and ``cyclone.workflow``; the reclaiming worker records the lost attempt as a
    ``cyclone.step <node>`` span. An on-call engineer filtering traces by workflow or item
    must find the reclaimed attempt too."""
    provider, finished = spans
    worker = start_worker(obc_fan_stall, concurrency=2, lease=30.0, tracing=provider)
    with Client(cyclone_dsn, tracing=provider) as client:
        handle = client.submit(obc_fan_stall, 1)
        wait_until(lambda: len(called("obc_stall")) == 1, what="the item runs")
        item = next(s for s in handle.get().steps if s.item_of is not None)
        expire_leases_until(
            lambda: client.get_run(handle.id).step(item.node).reclaims == 1, what="the reclaim"
        )
        wait_until(lambda: len(called("obc_stall")) == 2, what="the item runs again")
        gate("obc_stall1").set()
        gate("obc_stall2").set()
        assert handle.result(timeout=20) == [0]
    idle(worker)

    def reclaimed() -> list[ReadableSpan]:
        return [s for s in finished() if attr(s, "cyclone.outcome") == "reclaimed"]

    [lost] = wait_until(reclaimed, what="the reclaimed attempt's span")
    assert lost.name == f"cyclone.step {item.node}"
    assert attr(lost, "cyclone.run_id") == handle.id
    assert attr(lost, "cyclone.item_index") == 0
    assert attr(lost, "cyclone.workflow") == "obc_fan_stall"


# -- failed fan-out items and child runs ------------------------------------------------------


def test_obc_a_failed_fan_out_item_is_counted_and_traced_once_with_its_siblings(
    cyclone_dsn: str, start_worker: Callable[..., Worker], spans: Spans
) -> None:
    provider, finished = spans
    worker = metered(start_worker, obc_fan, concurrency=8, tracing=provider)
    with Client(cyclone_dsn, tracing=provider) as client:
        handle = client.submit(obc_fan, 4)
        run = handle.wait(timeout=20)
        assert run.state is RunState.FAILED
        idle(worker)
        ran = called("obc_item")
        assert 2 in ran
        items = [s for s in client.get_run(handle.id).steps if s.item_of is not None]
    failed_items = [s for s in items if s.error_kind == "permanent"]
    assert [s.item_index for s in failed_items] == [2]
    wait_until(
        lambda: counts(scrape(worker.metrics_port), "obc_item")["failed"] == 1,
        what="the failure counted",
    )

    def settled() -> bool:
        c = counts(scrape(worker.metrics_port), "obc_item")
        return c["claimed"] == c["completed"] + c["retried"] + c["failed"] + c["fenced"]

    wait_until(settled, what="every claimed item settled in the counters")
    samples = scrape(worker.metrics_port)
    item_counts = counts(samples, "obc_item")
    assert item_counts["claimed"] == len(ran), (item_counts, ran)
    completed_items = sum(1 for s in items if str(s.state) == "completed")
    assert item_counts["completed"] == completed_items
    assert item_counts["retried"] == 0 and item_counts["failed"] == 1
    assert total(samples, "cyclone_step_handler_seconds_count", kind="obc_item") == len(ran)
    assert (
        total(samples, "cyclone_run_duration_seconds_count", workflow="obc_fan", state="failed")
        == 1
    )
    assert total(samples, "cyclone_run_duration_seconds_count") == 1

    # One span per execution, every one ended, each naming its item; the failed one says so.
    def item_spans() -> list[ReadableSpan]:
        return [s for s in finished() if s.name.startswith("cyclone.step obc_item[")]

    wait_until(lambda: len(item_spans()) == len(ran), what="one span per item execution")
    [submit] = [s for s in finished() if s.name == "cyclone.submit obc_fan"]
    by_index = {attr(s, "cyclone.item_index"): s for s in item_spans()}
    assert sorted(by_index) == sorted(ran)  # type: ignore[type-var]
    broken = by_index[2]
    assert attr(broken, "cyclone.outcome") == "failed"
    assert attr(broken, "cyclone.error_kind") == "permanent"
    assert broken.status.status_code is trace.StatusCode.ERROR
    assert [e.name for e in broken.events] == ["cyclone.failed"]
    for index, span in by_index.items():
        assert span.parent is not None and span.parent.span_id == submit.context.span_id
        assert span.context.trace_id == submit.context.trace_id
        if index != 2:
            assert attr(span, "cyclone.outcome") in ("abandoned", "returned"), index
            events = [e.name for e in span.events]
            assert events in ([], ["cyclone.fenced"]), (index, events)


def test_obc_a_failed_child_run_is_timed_for_the_child_and_its_parent_and_traced_under_it(
    cyclone_dsn: str, start_worker: Callable[..., Worker], spans: Spans
) -> None:
    """monitoring.md: run_duration counts the runs this worker's outcomes ended. The child
    step's failure, committed by this worker, failed the child run and, with it, the parent
    run (in the same transaction): both ends are this worker's. Its span nests under the
    ``cyclone.child`` span, in the parent's trace."""
    provider, finished = spans
    worker = metered(start_worker, obc_parent, obc_inner, tracing=provider)
    with Client(cyclone_dsn, tracing=provider) as client:
        handle = client.submit(obc_parent, 1)
        assert handle.wait(timeout=20).state is RunState.FAILED
        [child_run] = client.list_runs(parent_run_id=handle.id)
        assert child_run.state is RunState.FAILED
    wait_until(
        lambda: counts(scrape(worker.metrics_port), "obc_perm")["failed"] == 1,
        what="the failure counted",
    )
    samples = scrape(worker.metrics_port)
    assert counts(samples, "obc_perm") == {
        "claimed": 1,
        "completed": 0,
        "retried": 0,
        "failed": 1,
        "fenced": 0,
    }
    durations = {
        (dict(ls)["workflow"], dict(ls)["state"]): v
        for (n, ls), v in samples.items()
        if n == "cyclone_run_duration_seconds_count"
    }
    assert durations == {("obc_inner", "failed"): 1, ("obc_parent", "failed"): 1}
    assert total(samples, "cyclone_run_duration_seconds_sum") >= 0

    wait_until(lambda: named(finished(), "cyclone.step obc_perm"), what="the child's span")
    [submit] = named(finished(), "cyclone.submit obc_parent")
    [node] = [s for s in finished() if s.name.startswith("cyclone.child ")]
    [failing] = named(finished(), "cyclone.step obc_perm")
    assert node.parent is not None and node.parent.span_id == submit.context.span_id
    assert failing.parent is not None and failing.parent.span_id == node.context.span_id
    assert failing.context.trace_id == submit.context.trace_id
    assert attr(failing, "cyclone.workflow") == "obc_inner"
    assert attr(failing, "cyclone.run_id") == child_run.id
    assert attr(failing, "cyclone.outcome") == "failed"
    assert [e.name for e in failing.events] == ["cyclone.failed"]


@step(name="obc_tx_flaky", transactional=True, max_attempts=2)
def obc_tx_flaky(n: int, *, ctx: StepContext) -> int:
    ctx.connection.execute("SELECT 1")
    if ctx.attempt == 1:
        raise RuntimeError("the transaction fails once")
    return n


def test_obc_a_retried_transactional_step_is_counted_traced_and_listed_once_per_attempt(
    cyclone_dsn: str, start_worker: Callable[..., Worker], spans: Spans, web: TestClient
) -> None:
    provider, finished = spans
    worker = metered(start_worker, obc_tx_flaky, tracing=provider)
    with Client(cyclone_dsn, tracing=provider) as client:
        assert client.enqueue(obc_tx_flaky, 2).result(timeout=20) == 2
        [run] = client.list_runs(workflow="obc_tx_flaky")
    wait_until(
        lambda: counts(scrape(worker.metrics_port), "obc_tx_flaky")["completed"] == 1,
        what="the completion",
    )
    samples = scrape(worker.metrics_port)
    assert counts(samples, "obc_tx_flaky") == {
        "claimed": 2,
        "completed": 1,
        "retried": 1,
        "failed": 0,
        "fenced": 0,
    }
    assert total(samples, "cyclone_step_handler_seconds_count", kind="obc_tx_flaky") == 2
    assert total(samples, "cyclone_run_duration_seconds_count", state="completed") == 1
    wait_until(lambda: len(named(finished(), "cyclone.step obc_tx_flaky")) == 2, what="both spans")
    first, second = sorted(
        named(finished(), "cyclone.step obc_tx_flaky"), key=lambda s: s.start_time or 0
    )
    assert (attr(first, "cyclone.attempt"), attr(first, "cyclone.outcome")) == (1, "failed")
    assert first.status.status_code is trace.StatusCode.ERROR
    assert [e.name for e in first.events] == ["cyclone.retry"]
    assert (attr(second, "cyclone.attempt"), attr(second, "cyclone.outcome")) == (2, "returned")
    assert second.events == () or list(second.events) == []
    listed = listed_attempts(web, run.id)["obc_tx_flaky"]
    assert [(a["number"], a["outcome"]) for a in listed] == [(1, "retried"), (2, "completed")]


# -- timeouts -------------------------------------------------------------------------------------


def test_obc_an_async_handler_that_outlives_its_timeout_is_retried_once_and_its_span_ends(
    client: Client, start_worker: Callable[..., Worker], spans: Spans, web: TestClient
) -> None:
    provider, finished = spans
    worker = metered(start_worker, obc_stubborn, tracing=provider)
    handle = client.enqueue(obc_stubborn, 6)
    assert handle.result(timeout=20) == 6
    idle(worker)
    wait_until(
        lambda: counts(scrape(worker.metrics_port), "obc_stubborn")["completed"] == 1,
        what="the completion",
    )
    samples = scrape(worker.metrics_port)
    assert counts(samples, "obc_stubborn") == {
        "claimed": 2,
        "completed": 1,
        "retried": 1,
        "failed": 0,
        "fenced": 0,
    }
    wait_until(
        lambda: (
            total(
                scrape(worker.metrics_port),
                "cyclone_step_handler_seconds_count",
                kind="obc_stubborn",
            )
            == 2
        ),
        what="both handlers timed",
    )
    wait_until(lambda: len(named(finished(), "cyclone.step obc_stubborn")) == 2, what="both spans")
    first, second = sorted(
        named(finished(), "cyclone.step obc_stubborn"),
        key=lambda s: s.start_time or 0,
    )
    assert attr(first, "cyclone.outcome") == "timeout"
    assert attr(first, "cyclone.attempt") == 1
    assert [e.name for e in first.events] == ["cyclone.retry"]
    assert attr(second, "cyclone.outcome") == "returned"
    assert attr(second, "cyclone.attempt") == 2
    listed = listed_attempts(web, handle.id)["obc_stubborn"]
    assert [(a["number"], a["outcome"], a["error_kind"]) for a in listed] == [
        (1, "retried", "timeout"),
        (2, "completed", None),
    ]
