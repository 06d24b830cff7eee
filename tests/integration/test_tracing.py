"""OpenTelemetry traces: one trace per submitted run whose parent links follow the DAG (child
runs and fan-out items included), retried attempts as sibling spans, a SIGKILL-reclaimed
attempt recorded by the worker that takes it back, and no OpenTelemetry import without use.

Every test has its own TracerProvider with an in-memory exporter, passed explicitly (the
global provider is never set).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cyclone_dsl import (
    AsyncClient,
    Client,
    RunState,
    StepContext,
    Worker,
    child,
    for_each,
    step,
    workflow,
)
from tests.faults import handlers
from tests.faults.conftest import read_log, wait_for, worker_processes
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]

#: The provider of the running test (handlers open their own spans with it).
current_provider: list[TracerProvider] = []


def app_span(name: str) -> None:
    """A span of the application's own, under whatever span is current."""
    with current_provider[-1].get_tracer("app").start_as_current_span(name):
        pass


@step(name="tr_a")
def tr_a(n: int) -> int:
    app_span("app.sync")
    return n


@step(name="tr_b")
async def tr_b(n: int) -> int:
    await asyncio.sleep(0)
    app_span("app.async")
    return n + 1


@step(name="tr_c", transactional=True)
def tr_c(n: int, *, ctx: StepContext) -> int:
    app_span("app.transactional")
    return n * 2


@step(name="tr_join")
def tr_join(values: list[int]) -> int:
    return sum(values)


@step(name="tr_items")
def tr_items(n: int) -> list[int]:
    return list(range(n % 3 + 2))


@step(name="tr_square")
def tr_square(n: int) -> int:
    return n * n


@step(name="tr_leaf")
def tr_leaf(n: int) -> int:
    return n - 1


@step(name="tr_end")
def tr_end(parts: list[object]) -> int:
    return len(parts)


@workflow(name="tr_inner")
def tr_inner(n):  # type: ignore[no-untyped-def]
    return tr_leaf(n)


@workflow(name="tr_dag")
def tr_dag(n):  # type: ignore[no-untyped-def]
    a = tr_a(n)
    joined = tr_join([tr_b(a), tr_c(a)])
    squares = for_each(tr_square, over=tr_items(joined))
    return tr_end([squares, child(tr_inner, joined)])


@step(name="tr_flaky", max_attempts=3)
def tr_flaky(n: int, *, ctx: StepContext) -> int:
    if ctx.attempt == 1:
        raise RuntimeError("fails once")
    return n


@pytest.fixture
def spans() -> Iterator[Callable[[], list[ReadableSpan]]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    current_provider.append(provider)
    yield lambda: list(exporter.get_finished_spans())
    current_provider.remove(provider)
    provider.shutdown()


def attr(span: ReadableSpan, name: str) -> object:
    assert span.attributes is not None
    return span.attributes.get(name)


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def only(found: list[ReadableSpan]) -> ReadableSpan:
    assert len(found) == 1, [s.name for s in found]
    return found[0]


def test_a_run_with_a_join_a_fan_out_and_a_child_is_one_trace_shaped_like_its_graph(
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    spans: Callable[[], list[ReadableSpan]],
) -> None:
    provider = current_provider[-1]
    with Client(cyclone_dsn, tracing=provider) as client:
        handle = client.submit(tr_dag, 4)
        start_worker(tr_dag, tr_inner, tracing=provider)
        run = handle.wait(timeout=30)
    assert run.state is RunState.COMPLETED
    # A step's span ends just after its outcome commits: wait for all 15 to be exported (the
    # submit, 6 steps, 3 items, the child node, the child's step, 3 of the handlers').
    wait_until(lambda: len(spans()) == 15, what="every span")
    found = spans()
    assert len({s.context.trace_id for s in found}) == 1  # one trace

    submit = only([s for s in found if s.name == "cyclone.submit tr_dag"])
    assert submit.parent is None
    assert attr(submit, "cyclone.run_id") == handle.id
    top = {
        str(attr(s, "cyclone.node")): s
        for s in found
        if s.name.startswith("cyclone.step ") and attr(s, "cyclone.run_id") == handle.id
    }
    items = [s for n, s in top.items() if attr(s, "cyclone.item_index") is not None]
    assert len(items) == 13 % 3 + 2  # tr_join: (4 + 1) + 4 * 2 = 13
    assert {attr(s, "cyclone.kind") for s in items} == {"tr_square"}
    for name, span in top.items():
        assert parent_of(span) == submit.context.span_id, name
        assert attr(span, "cyclone.workflow") == "tr_dag"
        assert attr(span, "cyclone.attempt") == 1
        assert attr(span, "cyclone.outcome") == "returned"
        assert attr(span, "cyclone.queue") == "default"
        assert attr(span, "cyclone.def_version")
    assert sorted(str(attr(s, "cyclone.kind")) for s in top.values()) == sorted(
        ["tr_a", "tr_b", "tr_c", "tr_join", "tr_items", "tr_end"] + ["tr_square"] * len(items)
    )
    # The child node's span starts the child run; the child run's step nests under it.
    node = only([s for s in found if s.name.startswith("cyclone.child ")])
    assert parent_of(node) == submit.context.span_id
    assert attr(node, "cyclone.kind") == "child"
    leaf = only([s for s in found if attr(s, "cyclone.kind") == "tr_leaf"])
    assert attr(leaf, "cyclone.run_id") == attr(node, "cyclone.child_run_id")
    assert attr(leaf, "cyclone.workflow") == "tr_inner"
    assert parent_of(leaf) == node.context.span_id
    # The handlers' own spans (sync, async, transactional) nest under their step's span.
    for app, kind in (("app.sync", "tr_a"), ("app.async", "tr_b"), ("app.transactional", "tr_c")):
        mine = only([s for s in found if s.name == app])
        step_span = only([s for s in top.values() if attr(s, "cyclone.kind") == kind])
        assert parent_of(mine) == step_span.context.span_id, app


def test_attempts_of_a_retried_step_are_sibling_spans(
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    spans: Callable[[], list[ReadableSpan]],
) -> None:
    provider = current_provider[-1]
    with Client(cyclone_dsn, tracing=provider) as client:
        handle = client.enqueue(tr_flaky, 3)
        start_worker(tr_flaky, tracing=provider)
        assert handle.wait(timeout=30).state is RunState.COMPLETED
    wait_until(lambda: len(spans()) == 3, what="the enqueue span and two attempts")
    enqueue = only([s for s in spans() if s.name == "cyclone.enqueue tr_flaky"])
    first, second = sorted(
        (s for s in spans() if s.name == "cyclone.step tr_flaky"),
        key=lambda s: int(str(attr(s, "cyclone.attempt"))),
    )
    assert parent_of(first) == parent_of(second) == enqueue.context.span_id
    assert (attr(first, "cyclone.attempt"), attr(first, "cyclone.outcome")) == (1, "failed")
    assert attr(first, "cyclone.error_kind") == "error"
    assert first.status.status_code is trace.StatusCode.ERROR
    assert [e.name for e in first.events] == ["cyclone.retry"]
    assert (attr(second, "cyclone.attempt"), attr(second, "cyclone.outcome")) == (2, "returned")
    assert attr(second, "cyclone.error_kind") is None
    assert [e.name for e in second.events] == []


def test_a_sigkilled_attempt_is_recorded_by_the_worker_that_reclaims_it(
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    spans: Callable[[], list[ReadableSpan]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The killed worker's span dies with it: the scanner that takes the lease back records
    the lost attempt (from the lease's start to the reclaim, with a ``cyclone.reclaimed``
    event), and the attempt run again is a sibling span."""
    log = tmp_path / "invocations.log"
    log.touch()
    monkeypatch.setenv("CYCLONE_FAULT_LOG", str(log))
    provider = current_provider[-1]
    with worker_processes(cyclone_dsn) as spawn, Client(cyclone_dsn, tracing=provider) as client:
        victim = spawn(CYCLONE_FAULT_SLEEP="30")
        handle = client.enqueue(handlers.work, 1)
        wait_for(lambda: len(read_log(log)) == 1)
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        start_worker(handlers, lease=1.0, tracing=provider)
        assert handle.wait(timeout=30).state is RunState.COMPLETED
    wait_until(lambda: len(spans()) == 3, what="the enqueue span and two attempts")
    enqueue = only([s for s in spans() if s.name.startswith("cyclone.enqueue ")])
    attempts = [s for s in spans() if s.name == "cyclone.step fault_work"]
    lost = only([s for s in attempts if attr(s, "cyclone.outcome") == "reclaimed"])
    again = only([s for s in attempts if attr(s, "cyclone.outcome") == "returned"])
    assert parent_of(lost) == parent_of(again) == enqueue.context.span_id
    assert attr(lost, "cyclone.attempt") == attr(again, "cyclone.attempt") == 1
    assert [e.name for e in lost.events] == ["cyclone.reclaimed"]
    assert f":{victim.pid}:" in str(attr(lost, "cyclone.worker"))
    assert f":{os.getpid()}:" in str(attr(again, "cyclone.worker"))
    assert lost.status.status_code is trace.StatusCode.ERROR


def test_an_async_submit_is_a_span_under_the_callers_span(
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    spans: Callable[[], list[ReadableSpan]],
) -> None:
    provider = current_provider[-1]

    async def submit() -> int:
        async with AsyncClient(cyclone_dsn, tracing=provider) as client:
            with provider.get_tracer("app").start_as_current_span("app.request"):
                handle = await client.submit(tr_inner, 5)
            await handle.wait(timeout=30)
            return handle.id

    start_worker(tr_inner, tracing=provider)
    run_id = asyncio.run(submit())
    wait_until(lambda: len(spans()) == 3, what="the request, the submit and the step")
    request = only([s for s in spans() if s.name == "app.request"])
    submitted = only([s for s in spans() if s.name == "cyclone.submit tr_inner"])
    leaf = only([s for s in spans() if s.name == "cyclone.step tr_leaf"])
    assert parent_of(submitted) == request.context.span_id
    assert attr(submitted, "cyclone.run_id") == run_id
    assert parent_of(leaf) == submitted.context.span_id


def test_a_client_that_does_not_trace_writes_no_trace_context(
    cyclone_dsn: str, client: Client, spans: Callable[[], list[ReadableSpan]]
) -> None:
    provider = current_provider[-1]
    client.submit(tr_dag, 1)
    client.enqueue(tr_flaky, 1)
    with Client(cyclone_dsn, tracing=provider) as traced:
        traced_id = traced.submit(tr_inner, 1).id
        many = [h.id for h in traced.submit_many(tr_inner, [1, 2])]
    with psycopg.connect(cyclone_dsn) as conn:
        stored = [r[0] for r in conn.execute("SELECT run_id FROM cyclone_ext_trace_context")]
    assert sorted(stored) == sorted([traced_id, *many])
    submit_many = only([s for s in spans() if s.name == "cyclone.submit_many tr_inner"])
    assert attr(submit_many, "cyclone.run_ids") == tuple(many)


def test_importing_cyclone_does_not_import_opentelemetry(cyclone_dsn: str) -> None:
    code = (
        "import sys, cyclone_dsl\n"
        "from cyclone_dsl import Client, Worker, step\n"
        "work = step(name='tr_plain')(lambda n: n)\n"
        "with Client(sys.argv[1]) as client:\n"
        "    client.enqueue(work, 1)\n"
        "with Worker(sys.argv[1], [work], poll_interval=0.1):\n"
        "    client = Client(sys.argv[1])\n"
        "    client.enqueue(work, 2).wait(timeout=30)\n"
        "    client.close()\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')], 'imported'\n"
    )
    subprocess.run(
        [sys.executable, "-c", code, cyclone_dsn],
        cwd=ROOT,
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


class BrokenProcessor(SpanProcessor):
    """A span processor with a bug: every span's start and end raise."""

    def on_start(self, span: Span, parent_context: object = None) -> None:
        raise RuntimeError("on_start is broken")

    def on_end(self, span: ReadableSpan) -> None:
        raise RuntimeError("on_end is broken")


@pytest.fixture
def broken_provider() -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(BrokenProcessor())
    return provider


@workflow(name="tr_with_child")
def tr_with_child(n):  # type: ignore[no-untyped-def]
    return child(tr_inner, tr_leaf(n))


def test_a_broken_span_processor_never_fails_a_submit_that_committed(
    cyclone_dsn: str, broken_provider: TracerProvider
) -> None:
    """The span ended after the commit and its error reached the caller, who would submit
    the run again."""
    with Client(cyclone_dsn, tracing=broken_provider) as client:
        handle = client.enqueue(tr_leaf, 1)
        runs = client.submit_many(tr_inner, [1, 2])
        assert [r.id for r in client.list_runs()] == sorted([handle.id, *(r.id for r in runs)])[
            ::-1
        ]


def test_a_broken_span_processor_stops_no_run_and_no_reclaim(
    cyclone_dsn: str, start_worker: Callable[..., Worker], broken_provider: TracerProvider
) -> None:
    """The trace hooks run inside the engine's transactions: a child run's start failed its
    parent's completion, and a reclaim failed the scanner's reclaim pass for every run."""
    with Client(cyclone_dsn, tracing=broken_provider) as client:
        handle = client.submit(tr_with_child, 4)
        lost = client.enqueue(tr_leaf, 7)
        with psycopg.connect(cyclone_dsn) as conn:  # its worker died: the lease expired
            conn.execute(
                "UPDATE cyclone_steps SET state = 'running', lease_owner = 'gone', "
                "lease_generation = lease_generation + 1, started_at = now(), "
                "lease_expiry = now() - interval '1 second' WHERE run_id = %s",
                (lost.id,),
            )
        start_worker(tr_with_child, tr_inner, tr_leaf, tracing=broken_provider)
        assert handle.result(timeout=30) == 2
        assert lost.result(timeout=30) == 6
