"""Audit of observability (metrics, traces, structured logs) as a production user sees it.

Each test drives a real worker against the real database and reads what a scrape, an
exporter or a log handler would see.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from cyclone_dsl import Client, Permanent, RunState, StepContext, Worker, step, workflow
from cyclone_dsl.errors import CycloneError, InvalidArgument
from cyclone_dsl.observability import JsonFormatter, StepContextFilter, configure_logging
from cyclone_dsl.worker.observe import WorkerObserver
from tests.scraped import Samples, counts, metered, parse, scrape, total
from tests.waiting import expire_leases_until, wait_until

ROOT = Path(__file__).resolve().parents[2]


# -- handlers -----------------------------------------------------------------------------

gates: dict[str, threading.Event] = {}
calls: dict[str, list[int]] = {}


def gate(name: str) -> threading.Event:
    return gates.setdefault(name, threading.Event())


def called(name: str) -> list[int]:
    return calls.setdefault(name, [])


@pytest.fixture(autouse=True)
def _reset_gates() -> Iterator[None]:
    gates.clear()
    calls.clear()
    yield
    for event in gates.values():  # never leave a handler blocked
        event.set()


@step(name="oba_ok")
def oba_ok(n: int) -> int:
    return n + 1


@step(name="oba_async_flaky", max_attempts=3)
async def oba_async_flaky(n: int, *, ctx: StepContext) -> int:
    await asyncio.sleep(0)
    if ctx.attempt == 1:
        raise RuntimeError("first attempt fails")
    return n


@step(name="oba_permanent", max_attempts=3)
def oba_permanent(n: int) -> int:
    raise Permanent(f"card {n} declined")


@step(name="oba_blocked")
def oba_blocked(n: int) -> int:
    called("oba_blocked").append(n)
    gate(f"oba_blocked{len(called('oba_blocked'))}").wait(20)
    return n


@step(name="oba_async_blocked")
async def oba_async_blocked(n: int) -> int:
    called("oba_async_blocked").append(n)
    await asyncio.sleep(20)
    return n


@step(name="oba_tx", transactional=True)
def oba_tx(n: int, *, ctx: StepContext) -> int:
    ctx.connection.execute("SELECT 1")
    return n * 2


@step(name="oba_tx_blocked", transactional=True)
def oba_tx_blocked(n: int, *, ctx: StepContext) -> int:
    called("oba_tx_blocked").append(n)
    gate("oba_tx_blocked").wait(20)
    return n


@step(name="oba_slow", timeout=0.3, max_attempts=1)
def oba_slow(n: int) -> int:
    called("oba_slow").append(n)
    gate("oba_slow").wait(20)
    return n


@workflow(name="oba_flow")
def oba_flow(n):  # type: ignore[no-untyped-def]
    return oba_ok(oba_ok(n))


# -- helpers ------------------------------------------------------------------------------


def counted(worker: Worker, kind: str, **expected: int) -> Samples:
    """Wait until the worker's step counts of ``kind`` are ``expected`` (those not named:
    0); return the scrape that showed them."""
    want = {"claimed": 0, "completed": 0, "retried": 0, "failed": 0, "fenced": 0, **expected}
    seen: list[Samples] = []

    def settled() -> bool:
        seen[:] = [scrape(worker.metrics_port)]
        return counts(seen[0], kind) == want

    wait_until(settled, what=f"the counts of {kind}: {want}")
    return seen[0]


def step_state(client: Client, run_id: int) -> str:
    return str(client.get_run(run_id).steps[0].state)


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, Callable[[], list[ReadableSpan]]]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, lambda: list(exporter.get_finished_spans())
    provider.shutdown()


def attr(span: ReadableSpan, name: str) -> object:
    assert span.attributes is not None
    return span.attributes.get(name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- metrics: counted once, with the documented labels ------------------------------------


def test_oba_async_retry_counts_one_claim_per_attempt(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    worker = metered(start_worker, oba_async_flaky)
    handle = client.enqueue(oba_async_flaky, 5)
    assert handle.result(timeout=20) == 5
    samples = counted(worker, "oba_async_flaky", claimed=2, completed=1, retried=1)
    labels = {"queue": "default", "kind": "oba_async_flaky"}
    assert total(samples, "cyclone_step_handler_seconds_count", **labels) == 2
    assert total(samples, "cyclone_step_claim_to_start_seconds_count", **labels) == 2
    assert total(samples, "cyclone_run_duration_seconds_count", state="completed") == 1


def test_oba_permanent_failure_counts_failed_once_and_ends_the_run(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    worker = metered(start_worker, oba_permanent)
    handle = client.enqueue(oba_permanent, 7)
    assert handle.wait(timeout=20).state is RunState.FAILED
    samples = counted(worker, "oba_permanent", claimed=1, failed=1)
    assert (
        total(
            samples,
            "cyclone_run_duration_seconds_count",
            workflow="oba_permanent",
            state="failed",
        )
        == 1
    )


def test_oba_transactional_step_is_counted_once_with_its_run(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    worker = metered(start_worker, oba_tx)
    handle = client.enqueue(oba_tx, 4)
    assert handle.result(timeout=20) == 8
    samples = counted(worker, "oba_tx", claimed=1, completed=1)
    assert total(samples, "cyclone_step_handler_seconds_count", kind="oba_tx") == 1
    assert total(samples, "cyclone_run_duration_seconds_count", workflow="oba_tx") == 1


def test_oba_cancelled_async_step_is_fenced_once_and_frees_its_slot(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    worker = metered(start_worker, oba_async_blocked)
    port = worker.metrics_port
    handle = client.enqueue(oba_async_blocked, 1)
    wait_until(lambda: called("oba_async_blocked"), what="the handler runs")
    assert total(scrape(port), "cyclone_worker_slots_in_use") == 1
    client.cancel(handle.id)
    wait_until(
        lambda: total(scrape(port), "cyclone_worker_slots_in_use") == 0,
        what="the slot is free again",
    )
    wait_until(
        lambda: counts(scrape(port), "oba_async_blocked")["fenced"] == 1,
        what="the cancel counted as fenced",
    )
    samples = scrape(port)
    assert counts(samples, "oba_async_blocked") == {
        "claimed": 1,
        "completed": 0,
        "retried": 0,
        "failed": 0,
        "fenced": 1,
    }
    # A cancelled run is not one of the runs this worker's outcomes ended.
    assert total(samples, "cyclone_run_duration_seconds_count") == 0


def test_oba_cancelled_transactional_step_is_fenced_once(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    worker = metered(start_worker, oba_tx_blocked)
    port = worker.metrics_port
    handle = client.enqueue(oba_tx_blocked, 1)
    wait_until(lambda: called("oba_tx_blocked"), what="the handler runs")
    client.cancel(handle.id)
    wait_until(
        lambda: counts(scrape(port), "oba_tx_blocked")["fenced"] >= 1,
        what="the cancel counted as fenced",
    )
    gate("oba_tx_blocked").set()
    wait_until(
        lambda: total(scrape(port), "cyclone_worker_slots_in_use") == 0,
        what="the handler returned",
    )
    samples = scrape(port)
    assert counts(samples, "oba_tx_blocked") == {
        "claimed": 1,
        "completed": 0,
        "retried": 0,
        "failed": 0,
        "fenced": 1,
    }


def test_oba_timed_out_step_is_failed_once_and_its_handler_timed_once(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    worker = metered(start_worker, oba_slow)
    port = worker.metrics_port
    handle = client.enqueue(oba_slow, 1)
    assert handle.wait(timeout=20).state is RunState.FAILED
    wait_until(lambda: counts(scrape(port), "oba_slow")["failed"] == 1, what="the timeout counted")
    gate("oba_slow").set()
    wait_until(
        lambda: total(scrape(port), "cyclone_worker_slots_in_use") == 0,
        what="the handler returned",
    )
    samples = scrape(port)
    assert counts(samples, "oba_slow") == {
        "claimed": 1,
        "completed": 0,
        "retried": 0,
        "failed": 1,
        "fenced": 0,
    }
    wait_until(
        lambda: total(scrape(port), "cyclone_step_handler_seconds_count", kind="oba_slow") == 1,
        what="the handler's time observed once",
    )


def _reclaimed_by_the_same_worker(client: Client, worker: Worker) -> int:
    """Run oba_blocked; expire its lease by moving the clock (the ``clock`` fixture moves it
    back; the worker is alive and heartbeating); the worker's own scanner reclaims it and
    the same worker claims it again. The first attempt then returns (its completion is
    fenced out), then the second completes."""
    handle = client.enqueue(oba_blocked, 1)
    wait_until(lambda: len(called("oba_blocked")) == 1, what="the first attempt runs")
    expire_leases_until(lambda: handle.get().steps[0].reclaims == 1, what="the reclaim")
    wait_until(lambda: len(called("oba_blocked")) == 2, what="the second attempt runs")
    gate("oba_blocked1").set()  # the first attempt returns: fenced out
    wait_until(
        lambda: worker.slots_in_use == 1,
        what="the first attempt's handler returned",
    )
    gate("oba_blocked2").set()
    assert handle.result(timeout=20) == 1
    return handle.id


@pytest.mark.usefixtures("clock")
def test_oba_reclaimed_and_claimed_again_by_the_same_worker_counts_both_attempts(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    worker = metered(start_worker, oba_blocked, concurrency=2, lease=30.0)
    _reclaimed_by_the_same_worker(client, worker)
    port = worker.metrics_port
    wait_until(
        lambda: total(scrape(port), "cyclone_worker_slots_in_use") == 0, what="both returned"
    )
    samples = scrape(port)
    assert total(samples, "cyclone_leases_reclaimed_total") == 1
    # claimed = completed + retried + failed + fenced (+ released): 2 = 1 + 0 + 0 + 1
    assert counts(samples, "oba_blocked") == {
        "claimed": 2,
        "completed": 1,
        "retried": 0,
        "failed": 0,
        "fenced": 1,
    }


@pytest.mark.usefixtures("clock")
def test_oba_reclaimed_and_claimed_again_by_the_same_worker_traces_each_attempt(
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    spans: tuple[TracerProvider, Callable[[], list[ReadableSpan]]],
) -> None:
    provider, finished = spans
    worker = start_worker(oba_blocked, concurrency=2, lease=30.0, tracing=provider)
    with Client(cyclone_dsn, tracing=provider) as client:
        _reclaimed_by_the_same_worker(client, worker)
    wait_until(lambda: worker.slots_in_use == 0, what="both returned")

    def steps() -> list[ReadableSpan]:
        return [s for s in finished() if s.name == "cyclone.step oba_blocked"]

    wait_until(lambda: len(steps()) >= 3, what="the spans of both attempts and the reclaim")
    returned = [s for s in steps() if attr(s, "cyclone.outcome") == "returned"]
    # The second attempt completed: its span records no fenced outcome.
    assert [[e.name for e in s.events] for s in returned] == [[]]


@pytest.mark.usefixtures("clock")
def test_oba_attempt_fenced_after_another_worker_reclaimed_it_is_counted_once(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    stalled = metered(start_worker, oba_blocked, concurrency=1, lease=30.0)
    handle = client.enqueue(oba_blocked, 1)
    wait_until(lambda: len(called("oba_blocked")) == 1, what="the first attempt runs")
    other = metered(start_worker, oba_blocked, lease=30.0)
    expire_leases_until(lambda: handle.get().steps[0].reclaims == 1, what="the reclaim")
    wait_until(lambda: len(called("oba_blocked")) == 2, what="the second attempt runs")
    gate("oba_blocked2").set()
    assert handle.result(timeout=20) == 1
    gate("oba_blocked1").set()  # the stalled attempt returns: its outcome is refused
    wait_until(
        lambda: counts(scrape(stalled.metrics_port), "oba_blocked")["fenced"] == 1,
        what="the stalled attempt counted as fenced",
    )
    first, second = scrape(stalled.metrics_port), scrape(other.metrics_port)
    assert counts(first, "oba_blocked") == {
        "claimed": 1,
        "completed": 0,
        "retried": 0,
        "failed": 0,
        "fenced": 1,
    }
    assert counts(second, "oba_blocked") == {
        "claimed": 1,
        "completed": 1,
        "retried": 0,
        "failed": 0,
        "fenced": 0,
    }
    reclaims = [total(s, "cyclone_leases_reclaimed_total") for s in (first, second)]
    assert sum(reclaims) == 1
    assert total(first, "cyclone_run_duration_seconds_count") == 0
    assert total(second, "cyclone_run_duration_seconds_count", state="completed") == 1


def test_oba_lease_released_at_shutdown_counts_only_the_claim(
    client: Client, cyclone_dsn: str
) -> None:
    worker = Worker(
        cyclone_dsn,
        [oba_blocked],
        metrics_port=0,
        metrics_host="127.0.0.1",
        poll_interval=0.2,
        grace=0.2,
    )
    worker.start()
    try:
        client.enqueue(oba_blocked, 1)
        wait_until(lambda: called("oba_blocked"), what="the handler runs")
    finally:
        worker.stop()
    registry = worker.metrics_registry
    labels = {"queue": "default", "kind": "oba_blocked"}
    assert registry.get_sample_value("cyclone_steps_claimed_total", labels) == 1
    for what in ("completed", "retried", "failed", "fenced"):
        assert registry.get_sample_value(f"cyclone_steps_{what}_total", labels) == 0, what


def test_oba_gauges_come_back_down_once_the_worker_stopped(
    client: Client, cyclone_dsn: str
) -> None:
    worker = Worker(
        cyclone_dsn, [oba_ok], metrics_port=0, metrics_host="127.0.0.1", poll_interval=0.2
    )
    worker.start()
    try:
        wait_until(
            lambda: total(scrape(worker.metrics_port), "cyclone_worker_listener_connected") == 1,
            what="the listener is up",
        )
        assert client.enqueue(oba_ok, 1).result(timeout=20) == 2
    finally:
        worker.stop()
    registry = worker.metrics_registry
    assert registry.get_sample_value("cyclone_worker_slots_in_use") == 0
    assert registry.get_sample_value("cyclone_worker_listener_connected") == 0


def test_oba_labels_never_hold_run_ids_or_error_texts(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    worker = metered(start_worker, oba_flow, oba_permanent)
    handles = client.submit_many(oba_flow, [1, 2, 3])
    failing = client.enqueue(oba_permanent, 99)
    for h in handles:
        h.wait(timeout=20)
    failing.wait(timeout=20)
    with urllib.request.urlopen(
        f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=10
    ) as response:
        text = response.read().decode()
    assert "declined" not in text
    labels = {
        (name, value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        for name, value in sample.labels.items()
        if name != "le"
    }
    assert {name for name, _ in labels} <= {"queue", "kind", "workflow", "state"}
    ids = {str(h.id) for h in handles} | {str(failing.id)}
    assert not {value for _, value in labels} & ids


# -- metrics: configuration errors are typed ----------------------------------------------


def test_oba_metrics_port_in_use_is_invalid_argument_and_leaves_no_worker(
    cyclone_dsn: str, client: Client
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker = Worker(cyclone_dsn, [oba_ok], metrics_port=port, metrics_host="127.0.0.1")
        with pytest.raises(InvalidArgument, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            worker.start()
    assert [w for w in client.workers() if w["id"] == worker.id] == []


def test_oba_unknown_metrics_host_is_invalid_argument(cyclone_dsn: str) -> None:
    worker = Worker(cyclone_dsn, [oba_ok], metrics_port=0, metrics_host="203.0.113.7")
    with pytest.raises(InvalidArgument, match="cannot serve metrics"):
        worker.start()


def test_oba_missing_extras_give_invalid_argument(cyclone_dsn: str) -> None:
    code = (
        "import sys\n"
        "sys.modules['prometheus_client'] = None\n"
        "sys.modules['opentelemetry'] = None\n"
        "from cyclone_dsl import Worker, Client, step\n"
        "from cyclone_dsl.errors import InvalidArgument\n"
        "work = step(name='oba_plain')(lambda n: n)\n"
        "for kwargs in ({'metrics_port': 0}, {'tracing': True}):\n"
        "    try:\n"
        "        Worker(sys.argv[1], [work], **kwargs)\n"
        "    except InvalidArgument as exc:\n"
        "        print('typed', exc)\n"
        "try:\n"
        "    Client(sys.argv[1], tracing=True)\n"
        "except InvalidArgument as exc:\n"
        "    print('typed', exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, cyclone_dsn],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3, result.stdout
    assert "cyclone-dsl[metrics]" in lines[0]
    assert "cyclone-dsl[otel]" in lines[1] and "cyclone-dsl[otel]" in lines[2]


def test_oba_cli_bad_metrics_port_is_a_usage_error(cyclone_dsn: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "cyclone_dsl.cli",
            "--dsn",
            cyclone_dsn,
            "worker",
            "tests.integration.test_oba_audit",
            "--metrics-port",
            "70000",
            "--processes",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    assert "metrics" in result.stderr.lower(), result.stderr


# -- traces --------------------------------------------------------------------------------


def test_oba_failing_handler_span_carries_the_error_and_the_failed_event(
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    spans: tuple[TracerProvider, Callable[[], list[ReadableSpan]]],
) -> None:
    provider, finished = spans
    start_worker(oba_permanent, tracing=provider)
    with Client(cyclone_dsn, tracing=provider) as client:
        handle = client.enqueue(oba_permanent, 3)
        assert handle.wait(timeout=20).state is RunState.FAILED
    wait_until(lambda: len(finished()) == 2, what="the enqueue and the attempt")
    [attempt] = [s for s in finished() if s.name == "cyclone.step oba_permanent"]
    [enqueue] = [s for s in finished() if s.name.startswith("cyclone.enqueue")]
    assert attempt.parent is not None and attempt.parent.span_id == enqueue.context.span_id
    assert attempt.context.trace_id == enqueue.context.trace_id
    assert attempt.status.status_code is trace.StatusCode.ERROR
    assert "card 3 declined" in (attempt.status.description or "")
    assert attr(attempt, "cyclone.outcome") == "failed"
    assert attr(attempt, "cyclone.error_kind")
    assert [e.name for e in attempt.events] == ["cyclone.failed"]


def test_oba_timed_out_attempt_span_says_timeout(
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    spans: tuple[TracerProvider, Callable[[], list[ReadableSpan]]],
) -> None:
    provider, finished = spans
    start_worker(oba_slow, tracing=provider)
    with Client(cyclone_dsn, tracing=provider) as client:
        handle = client.enqueue(oba_slow, 3)
        assert handle.wait(timeout=20).state is RunState.FAILED
    gate("oba_slow").set()
    wait_until(
        lambda: [s for s in finished() if s.name == "cyclone.step oba_slow"],
        what="the attempt's span",
    )
    [attempt] = [s for s in finished() if s.name == "cyclone.step oba_slow"]
    assert attr(attempt, "cyclone.outcome") == "timeout"
    assert attr(attempt, "cyclone.error_kind") == "timeout"
    assert attempt.status.status_code is trace.StatusCode.ERROR
    assert [e.name for e in attempt.events] == ["cyclone.failed"]


@step(name="oba_tx_slow_sql", transactional=True, timeout=0.5, max_attempts=1)
def oba_tx_slow_sql(n: int, *, ctx: StepContext) -> int:
    ctx.connection.execute("SELECT pg_sleep(10)")  # ended by the step's timeout
    return n


def test_oba_transactional_timed_out_attempt_span_says_timeout(
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    spans: tuple[TracerProvider, Callable[[], list[ReadableSpan]]],
) -> None:
    """A transactional step whose SQL outlived its timeout: its span says timeout, as a
    plain step's does."""
    provider, finished = spans
    start_worker(oba_tx_slow_sql, tracing=provider)
    with Client(cyclone_dsn, tracing=provider) as client:
        handle = client.enqueue(oba_tx_slow_sql, 3)
        assert handle.wait(timeout=20).state is RunState.FAILED
        assert client.get_run(handle.id).steps[0].error_kind == "timeout"
    wait_until(
        lambda: [s for s in finished() if s.name == "cyclone.step oba_tx_slow_sql"],
        what="the attempt's span",
    )
    [attempt] = [s for s in finished() if s.name == "cyclone.step oba_tx_slow_sql"]
    assert attr(attempt, "cyclone.error_kind") == "timeout"
    assert attr(attempt, "cyclone.outcome") == "timeout"


def test_oba_cancelled_attempt_span_is_abandoned_with_a_fenced_event(
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    spans: tuple[TracerProvider, Callable[[], list[ReadableSpan]]],
) -> None:
    provider, finished = spans
    start_worker(oba_async_blocked, tracing=provider)
    with Client(cyclone_dsn, tracing=provider) as client:
        handle = client.enqueue(oba_async_blocked, 3)
        wait_until(lambda: called("oba_async_blocked"), what="the handler runs")
        client.cancel(handle.id)
    wait_until(
        lambda: [s for s in finished() if s.name == "cyclone.step oba_async_blocked"],
        what="the attempt's span",
    )
    [attempt] = [s for s in finished() if s.name == "cyclone.step oba_async_blocked"]
    assert attr(attempt, "cyclone.outcome") == "abandoned"
    assert [e.name for e in attempt.events] == ["cyclone.fenced"]


def test_oba_attempt_released_at_shutdown_ends_its_span_with_a_released_event(
    cyclone_dsn: str, spans: tuple[TracerProvider, Callable[[], list[ReadableSpan]]]
) -> None:
    provider, finished = spans
    worker = Worker(cyclone_dsn, [oba_blocked], poll_interval=0.2, grace=0.2, tracing=provider)
    worker.start()
    try:
        with Client(cyclone_dsn) as client:
            client.enqueue(oba_blocked, 1)
            wait_until(lambda: called("oba_blocked"), what="the handler runs")
    finally:
        worker.stop()
    gate("oba_blocked1").set()  # the handler returns after the stop
    wait_until(
        lambda: [s for s in finished() if s.name == "cyclone.step oba_blocked"],
        what="the attempt's span",
    )
    [attempt] = [s for s in finished() if s.name == "cyclone.step oba_blocked"]
    assert [e.name for e in attempt.events] == ["cyclone.released"]
    assert attr(attempt, "cyclone.outcome") == "abandoned"


tracing_dsn: list[tuple[str, TracerProvider]] = []


@step(name="oba_submits")
def oba_submits(n: int) -> int:
    dsn, provider = tracing_dsn[-1]
    with Client(dsn, tracing=provider) as client:
        return client.enqueue(oba_ok, n).id


def test_oba_a_run_submitted_by_a_handler_joins_the_handlers_trace(
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    spans: tuple[TracerProvider, Callable[[], list[ReadableSpan]]],
) -> None:
    provider, finished = spans
    tracing_dsn.append((cyclone_dsn, provider))
    start_worker(oba_submits, oba_ok, tracing=provider)
    with Client(cyclone_dsn, tracing=provider) as client:
        inner_id = client.enqueue(oba_submits, 3).result(timeout=20)
        assert client.wait(inner_id, timeout=20).state is RunState.COMPLETED
    wait_until(lambda: len(finished()) == 4, what="two enqueues and two attempts")
    by_name = {s.name: s for s in finished()}
    outer = by_name["cyclone.step oba_submits"]
    inner_enqueue = by_name["cyclone.enqueue oba_ok"]
    inner_step = by_name["cyclone.step oba_ok"]
    assert inner_enqueue.parent is not None
    assert inner_enqueue.parent.span_id == outer.context.span_id
    assert inner_step.parent is not None
    assert inner_step.parent.span_id == inner_enqueue.context.span_id
    assert len({s.context.trace_id for s in finished()}) == 1


class FlakyStepSpans(SimpleSpanProcessor):
    """Exports every span; while ``broken`` is set, starting a step's span raises (a span
    processor with a bug)."""

    broken = False

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        if self.broken and span.name.startswith("cyclone.step"):
            raise RuntimeError("on_start is broken")
        super().on_start(span, parent_context)


app_provider: list[TracerProvider] = []


@step(name="oba_app_span")
def oba_app_span(n: int) -> int:
    with app_provider[-1].get_tracer("app").start_as_current_span(f"app.{n}"):
        return n


def test_oba_an_untraced_attempt_does_not_inherit_the_previous_steps_span(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    exporter = InMemorySpanExporter()
    processor = FlakyStepSpans(exporter)
    provider = TracerProvider()
    provider.add_span_processor(processor)
    app_provider.append(provider)
    try:
        # One handler thread: the second step runs on the thread the first one used.
        start_worker(oba_app_span, concurrency=1, tracing=provider)
        with Client(cyclone_dsn) as client:
            assert client.enqueue(oba_app_span, 1).result(timeout=20) == 1
            processor.broken = True  # the next attempt goes on untraced
            assert client.enqueue(oba_app_span, 2).result(timeout=20) == 2
        found = {s.name: s for s in exporter.get_finished_spans()}
        assert {"cyclone.step oba_app_span", "app.1", "app.2"} <= set(found)
        first_step = found["cyclone.step oba_app_span"]
        assert found["app.1"].parent is not None
        assert found["app.1"].parent.span_id == first_step.context.span_id
        # app.2 belongs to another run: it must not be a child of the first run's step.
        assert found["app.2"].context.trace_id != first_step.context.trace_id
    finally:
        app_provider.remove(provider)
        provider.shutdown()


# -- structured logs -----------------------------------------------------------------------


@step(name="oba_logs\nCRITICAL forged: admin logged in")
def oba_evil_kind(n: int) -> int:
    logging.getLogger("tests.oba").warning("handled %d", n)
    return n


def test_oba_text_logs_escape_a_kind_with_a_newline(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    try:
        configure_logging(json=False, stream=stream, level=logging.INFO)
        start_worker(oba_evil_kind)
        assert client.enqueue(oba_evil_kind, 5).result(timeout=20) == 5
    finally:
        for h in root.handlers[:]:
            root.removeHandler(h)
        for h in saved:
            root.addHandler(h)
        root.setLevel(level)
    lines = stream.getvalue().splitlines()
    assert not [line for line in lines if line.startswith("CRITICAL forged")], lines
    [handled] = [line for line in lines if "handled 5" in line]
    assert "kind='oba_logs\\nCRITICAL forged: admin logged in'" in handled


def test_oba_json_logs_are_one_line_per_record_and_keep_the_context(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(StepContextFilter())
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        start_worker(oba_evil_kind)
        handle = client.enqueue(oba_evil_kind, 6)
        assert handle.result(timeout=20) == 6
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    parsed = [json.loads(line) for line in stream.getvalue().splitlines()]  # each line JSON
    [handled] = [p for p in parsed if p["message"] == "handled 6"]
    assert handled["kind"] == "oba_logs\nCRITICAL forged: admin logged in"
    assert handled["run_id"] == handle.id and handled["attempt"] == 1


class Raising(WorkerObserver):
    def on_claimed(self, steps: Any) -> None:
        raise RuntimeError("observer bug")


def test_oba_a_raising_observer_is_logged_once_and_stops_nothing(
    client: Client, start_worker: Callable[..., Worker], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="cyclone.worker")
    start_worker(oba_ok, observers=[Raising()])
    handles = [client.enqueue(oba_ok, n) for n in range(3)]
    assert [h.result(timeout=20) for h in handles] == [1, 2, 3]
    mine = [r for r in caplog.records if "on_claimed" in r.getMessage()]
    assert len(mine) == 1


# -- secrets -------------------------------------------------------------------------------


def test_oba_wrong_password_never_shows_it(cyclone_dsn: str) -> None:
    params = psycopg.conninfo.conninfo_to_dict(cyclone_dsn)
    params.update(user="oba_nobody", password="S3cretPassw0rd")
    dsn = psycopg.conninfo.make_conninfo(**params)
    with pytest.raises(CycloneError) as raised:
        Worker(dsn, [oba_ok]).start()
    assert "S3cretPassw0rd" not in str(raised.value)


def test_oba_cli_connection_failure_never_prints_the_password() -> None:
    dsn = f"postgresql://bob:S3cretPassw0rd@127.0.0.1:{free_port()}/db"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "cyclone_dsl.cli",
            "--dsn",
            dsn,
            "-v",
            "worker",
            "tests.integration.test_oba_audit",
            "--processes",
            "1",
            "--log-format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert "S3cretPassw0rd" not in out, out
    assert "Traceback" not in out, out


def test_oba_listen_connection_failures_never_log_the_password(
    cyclone_dsn: str, start_worker: Callable[..., Worker], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    listen = f"postgresql://bob:S3cretPassw0rd@127.0.0.1:{free_port()}/db"
    start_worker(oba_ok, listen_dsn=listen)
    wait_until(
        lambda: [r for r in caplog.records if "LISTEN" in r.getMessage()],
        what="the listener's failure logged",
    )
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "S3cretPassw0rd" not in text, text


@step(name="oba_tx_dup", transactional=True, max_attempts=1)
def oba_tx_dup(value: str, *, ctx: StepContext) -> int:
    ctx.connection.execute("INSERT INTO oba_unique (v) VALUES (%s), (%s)", (value, value))
    return 1


def test_oba_text_log_of_a_failed_commit_cannot_forge_a_line(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE oba_unique (v text UNIQUE DEFERRABLE INITIALLY DEFERRED)")
    stream = io.StringIO()
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    try:
        configure_logging(json=False, stream=stream, level=logging.INFO)
        start_worker(oba_tx_dup)
        handle = client.enqueue(oba_tx_dup, "x\nCRITICAL forged: admin logged in")
        assert handle.wait(timeout=20).state is RunState.FAILED
    finally:
        for h in root.handlers[:]:
            root.removeHandler(h)
        for h in saved:
            root.addHandler(h)
        root.setLevel(level)
    lines = stream.getvalue().splitlines()
    assert [line for line in lines if "did not commit" in line], lines  # it was logged
    assert not [line for line in lines if line.startswith("CRITICAL forged")], lines


def test_oba_metrics_ports_of_every_process_are_checked_up_front(cyclone_dsn: str) -> None:
    with pytest.raises(InvalidArgument, match="metrics_port"):
        Worker(cyclone_dsn, [oba_ok], processes=2, metrics_port=65535)


def test_oba_dashboard_metrics_report_the_gauges_down_when_the_database_read_fails(
    cyclone_dsn: str,
) -> None:
    from starlette.testclient import TestClient

    from cyclone_dsl.ui.app import create_app

    client = Client(cyclone_dsn)
    client.close()  # every read of the database gauges now fails
    with TestClient(create_app(client)) as web:
        response = web.get("/metrics")
    assert response.status_code == 200
    samples = parse(response.text)
    assert total(samples, "cyclone_database_gauges_up") == 0
    assert not [n for (n, _) in samples if n.startswith("cyclone_queue_steps")]


def test_oba_a_hostile_cancel_payload_does_not_stop_the_listener(
    client: Client, cyclone_dsn: str
) -> None:
    """Any role that may connect can NOTIFY on the cancel channel: a payload of digits
    that int() does not read ("²" is a digit to str.isdigit) is ignored, and the listener
    still wakes the worker (its poll is 30 s, so only the listener can run this step)."""
    worker = Worker(
        cyclone_dsn, [oba_ok], metrics_port=0, metrics_host="127.0.0.1", poll_interval=30
    )
    worker.start()
    try:
        wait_until(
            lambda: total(scrape(worker.metrics_port), "cyclone_worker_listener_connected") == 1,
            what="the listener is up",
        )
        with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
            # No plain run id in it: the channel is the database's, and another test's
            # worker (in its own schema) would check its leases of run 1 at once.
            conn.execute("SELECT pg_notify('cyclone_cancel', '²,٣,x')")
        handle = client.enqueue(oba_ok, 1)
        assert handle.result(timeout=10) == 2
        assert total(scrape(worker.metrics_port), "cyclone_worker_listener_connected") == 1
    finally:
        worker.stop()
