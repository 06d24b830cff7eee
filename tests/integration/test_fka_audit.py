"""Audit: Client, AsyncClient and Worker across ``os.fork()`` (gunicorn --preload, uWSGI,
celery prefork, multiprocessing's fork start method).

A client made in a parent and used there holds pooled connections; a forked child gets
copies of their sockets. A production library either gives each process its own
connections (resetting the pool after a fork) or refuses at once with a typed error
saying to make the client after forking. Never: two processes on one socket.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import select
import signal
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cyclone_dsl import (
    AsyncClient,
    Client,
    CycloneError,
    NodeRef,
    Ref,
    RunState,
    StepContext,
    Worker,
    step,
    workflow,
)

StartWorker = Callable[..., Worker]
Report = dict[str, Any]

DOCS = Path(__file__).resolve().parents[2] / "docs"

release = threading.Event()


@pytest.fixture(autouse=True)
def _fresh() -> None:
    release.clear()


@step(name="fka_square")
def fka_square(x: int) -> dict[str, int]:
    return {"x": x, "sq": x * x}


@step(name="fka_tag")
def fka_tag(value: dict[str, int]) -> dict[str, int]:
    return {**value, "tag": value["x"] + 1}


@workflow(name="fka_flow")
def fka_flow(x: Ref[int]) -> NodeRef[dict[str, int]]:
    return fka_tag(fka_square(x))


@step(name="fka_gate", max_attempts=1)
def fka_gate(x: int, *, ctx: StepContext) -> int:
    """Held until the test sets ``release`` (in the process running the worker)."""
    deadline = time.monotonic() + 25
    while not release.is_set() and not ctx.cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    return x * 10


def expected(x: int) -> dict[str, int]:
    return {"x": x, "sq": x * x, "tag": x + 1}


# -- forking helpers ---------------------------------------------------------------------


def error_report(exc: BaseException) -> Report:
    return {
        "ok": False,
        "type": type(exc).__name__,
        "cyclone": isinstance(exc, CycloneError),
        "message": str(exc)[:300],
        "where": traceback.format_exc().strip().splitlines()[-3:],
    }


def fork_children(
    count: int, body: Callable[[int], Any], *, bound: float, stop_on_failure: bool = False
) -> list[Report]:
    """Fork ``count`` children at once, each running ``body(index)`` and reporting
    ``{"ok": True, "value": ...}`` (or its error) as JSON through a pipe, then
    ``os._exit``. A child silent after ``bound`` seconds is killed and reported as hung;
    with ``stop_on_failure``, the others are killed as soon as one reports a failure."""
    children: list[tuple[int, int]] = []
    for index in range(count):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            try:
                os.close(read_end)
                signal.alarm(int(bound) + 5)  # never outlives the test, whatever happens
                try:
                    report: Report = {"ok": True, "value": body(index)}
                except BaseException as exc:  # reported to the parent
                    report = error_report(exc)
                with os.fdopen(write_end, "wb") as out:
                    out.write(json.dumps(report, default=repr).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        children.append((pid, read_end))
    return collect(children, bound=bound, stop_on_failure=stop_on_failure)


def collect(
    children: list[tuple[int, int]], *, bound: float, stop_on_failure: bool
) -> list[Report]:
    deadline = time.monotonic() + bound
    buffers: dict[int, bytearray] = {fd: bytearray() for _, fd in children}
    pending = set(buffers)
    failed = False
    while pending and not failed and time.monotonic() < deadline:
        ready, _, _ = select.select(list(pending), [], [], max(0.0, deadline - time.monotonic()))
        for fd in ready:
            chunk = os.read(fd, 65536)
            if chunk:
                buffers[fd] += chunk
                continue
            pending.discard(fd)
            done = json.loads(bytes(buffers[fd])) if buffers[fd] else {"ok": False}
            failed = stop_on_failure and not (done["ok"] and not done["value"])
    reports: list[Report] = []
    for pid, fd in children:
        if fd in pending:
            os.kill(pid, signal.SIGKILL)
            reports.append({"ok": False, "hung": not failed, "killed": True})
        else:
            reports.append(json.loads(bytes(buffers[fd])) if buffers[fd] else {"ok": False})
        os.close(fd)
        os.waitpid(pid, 0)
    return reports


def churn(client: Client, base: int, count: int) -> list[Any]:
    """Submit ``count`` runs and read each back; return what came back wrong."""
    wrong: list[Any] = []
    for i in range(count):
        x = base + i
        handle = client.submit(fka_flow, x)
        run = client.get_run(handle.id)
        if run.input != x or run.workflow != "fka_flow":
            wrong.append(("get_run", handle.id, x, run.input))
        got = handle.result(timeout=20)
        if got != expected(x):
            wrong.append(("result", handle.id, x, got))
    return wrong


def fine_or_refused_for_fork(report: Report) -> bool:
    """A child's report is acceptable: it did all its work right, or its first call was
    refused with a typed error that says to make the client after forking."""
    if report["ok"]:
        return bool(report["value"] == [])
    return bool(report.get("cyclone")) and "fork" in report.get("message", "").lower()


def submitted_inputs(client: Client) -> list[Any]:
    return sorted(r.input for r in client.list_runs(workflow="fka_flow", limit=1000))


# -- a client made before the fork, used in the children ---------------------------------


def test_fka_children_using_the_parents_client_get_own_connections_or_a_typed_refusal(
    cyclone_dsn: str, start_worker: StartWorker
) -> None:
    start_worker(fka_square, fka_tag, fka_flow)
    parent = Client(cyclone_dsn)
    try:
        # Used once, as an app does at import or start: the pool holds an open connection.
        assert parent.submit(fka_flow, 1).result(timeout=20) == expected(1)
        reports = fork_children(
            4,
            lambda index: churn(parent, 1000 * (index + 1), 8),
            bound=20,
            stop_on_failure=True,
        )
        assert all(fine_or_refused_for_fork(r) for r in reports), reports
        # Nothing submitted was lost, nothing was written twice or wrongly.
        made = [1] + [
            1000 * (index + 1) + i for index, r in enumerate(reports) if r["ok"] for i in range(8)
        ]
        assert submitted_inputs(parent) == sorted(made)
    finally:
        parent.close()


def test_fka_children_using_the_parents_async_client_get_own_connections_or_a_refusal(
    cyclone_dsn: str, start_worker: StartWorker
) -> None:
    start_worker(fka_square, fka_tag, fka_flow)
    parent = AsyncClient(cyclone_dsn)

    async def once() -> Any:
        return await (await parent.submit(fka_flow, 1)).result(timeout=20)

    async def use(base: int) -> list[Any]:
        wrong: list[Any] = []
        for i in range(8):
            x = base + i
            handle = await parent.submit(fka_flow, x)
            run = await parent.get_run(handle.id)
            if run.input != x:
                wrong.append(("get_run", handle.id, x, run.input))
            got = await handle.result(timeout=20)
            if got != expected(x):
                wrong.append(("result", handle.id, x, got))
        return wrong

    try:
        assert asyncio.run(once()) == expected(1)
        reports = fork_children(
            4,
            lambda index: asyncio.run(use(1000 * (index + 1))),
            bound=20,
            stop_on_failure=True,
        )
        assert all(fine_or_refused_for_fork(r) for r in reports), reports
    finally:
        asyncio.run(parent.close())


def test_fka_a_child_closing_its_inherited_client_leaves_the_parents_working(
    cyclone_dsn: str, start_worker: StartWorker
) -> None:
    """A child process's cleanup (``with Client(...)``, an atexit hook such as the Django
    integration's ``close_client``) closes the client it inherited: that must end the
    child's use of it, never the parent's server sessions."""
    start_worker(fka_square, fka_tag, fka_flow)
    with Client(cyclone_dsn, pool_size=2) as parent:
        first = parent.submit(fka_flow, 1)
        assert first.result(timeout=20) == expected(1)

        def close_inherited(_: int) -> None:
            parent.close()

        [report] = fork_children(1, close_inherited, bound=20)
        assert report == {"ok": True, "value": None}
        # The parent's client was not closed: every call still works, first time.
        assert parent.get_run(first.id).state is RunState.COMPLETED
        assert parent.submit(fka_flow, 2).result(timeout=20) == expected(2)
        assert submitted_inputs(parent) == [1, 2]


# -- what works: clients and workers made after the fork ---------------------------------


def test_fka_clients_made_after_the_fork_work_beside_the_parents(
    cyclone_dsn: str, start_worker: StartWorker
) -> None:
    """The pattern to use: each child makes its own Client after forking. The parent
    keeps using its own client (submits, reads, and a result() LISTEN wait that spans
    the fork) while the children use theirs; every answer goes to the right process."""
    start_worker(fka_square, fka_tag, fka_flow, fka_gate)
    with Client(cyclone_dsn) as parent:
        assert parent.submit(fka_flow, 1).result(timeout=20) == expected(1)
        gated = parent.enqueue(fka_gate, 7)
        waited: list[Any] = []
        waiter = threading.Thread(target=lambda: waited.append(gated.result(timeout=30)))
        waiter.start()  # LISTENing on its own connection while the children are forked

        parent_wrong: list[Any] = []
        children_done = threading.Event()

        def parent_loop() -> None:
            base = 900_000
            while not children_done.is_set():
                parent_wrong.extend(churn(parent, base, 1))
                base += 1

        looping = threading.Thread(target=parent_loop, daemon=True)
        looping.start()

        def child(index: int) -> list[Any]:
            with Client(cyclone_dsn) as own:
                wrong = churn(own, 1000 * (index + 1), 6)
                # A run the parent submitted, waited for from the child (its own LISTEN).
                if own.handle(gated.id).get().state.is_terminal:
                    wrong.append(("gated run ended early", gated.id))
                return wrong

        try:
            reports = fork_children(3, child, bound=30)
        finally:
            children_done.set()
            looping.join(timeout=30)
        assert reports == [{"ok": True, "value": []}] * 3
        assert not looping.is_alive() and parent_wrong == []
        assert waiter.is_alive()  # still waiting: the gate holds
        release.set()
        waiter.join(timeout=30)
        assert waited == [70]
        children = sorted(1000 * (index + 1) + i for index in range(3) for i in range(6))
        inputs = submitted_inputs(parent)
        assert [x for x in inputs if x < 900_000] == [1, *children]
        assert all(r.state is RunState.COMPLETED for r in parent.list_runs(limit=1000))


def test_fka_a_worker_started_in_a_child_serves_a_parent_that_made_a_client(
    cyclone_dsn: str,
) -> None:
    """celery/multiprocessing style: the parent made (and used) a Client, then forks a
    child that starts a Worker; the worker serves the parent's submits, and stops
    gracefully when told."""
    stop_read, stop_write = os.pipe()
    with Client(cyclone_dsn) as parent:
        warm = parent.submit(fka_flow, 1)  # the pool holds an open connection
        assert not parent.get_run(warm.id).state.is_terminal

        def serve(index: int) -> Report:
            os.close(stop_write)
            worker = Worker(
                cyclone_dsn, [fka_square, fka_tag, fka_flow], poll_interval=0.2, grace=5.0
            )
            worker.start()
            ready, _, _ = select.select([stop_read], [], [], 25)  # until the parent says
            worker.stop()
            return {"told": bool(ready), "completed": worker.completed_count}

        results: list[Any] = []

        def submit_and_stop() -> None:
            try:
                handles = [parent.submit(fka_flow, x) for x in range(2, 12)]
                results.extend(h.result(timeout=20) for h in [warm, *handles])
            finally:
                os.close(stop_write)

        submitter = threading.Timer(0.0, submit_and_stop)
        submitter.start()
        try:
            [report] = fork_children(1, serve, bound=40)
        finally:
            submitter.join(timeout=30)
            os.close(stop_read)
        assert results == [expected(x) for x in range(1, 12)]
        assert report["ok"], report
        assert report["value"]["told"] is True
        assert report["value"]["completed"] == 22  # two steps per run, each once


def test_fka_the_docs_say_what_a_client_does_across_a_fork() -> None:
    texts = [
        inspect.getdoc(Client) or "",
        (DOCS / "howto" / "deploy.md").read_text(),
        (DOCS / "howto" / "frameworks.md").read_text(),
    ]
    assert any("fork" in text.lower() for text in texts)
