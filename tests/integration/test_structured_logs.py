"""Structured logs: lines logged while a step runs carry its context, from the worker and
from inside the handler (sync, async, transactional), and the JSON formatter prints them."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from cyclone_dsl import Client, StepContext, Worker, step, workflow
from cyclone_dsl.observability import (
    CONTEXT_FIELDS,
    configure_logging,
)
from tests.logged import Lines
from tests.waiting import wait_until

handler_log = logging.getLogger("tests.handler")
blocker = threading.Event()


@step(name="sl_sync")
def sync_step(n: int) -> int:
    handler_log.info("inside sync %d", n)
    return n + 1


@step(name="sl_async")
async def async_step(n: int) -> int:
    handler_log.info("inside async before %d", n)
    await asyncio.sleep(0.01)
    await asyncio.to_thread(handler_log.info, "inside async thread %d", n)
    handler_log.info("inside async after %d", n)
    return n + 1


@step(name="sl_tx", transactional=True)
def tx_step(n: int, *, ctx: StepContext) -> int:
    ctx.connection.execute("SELECT 1")
    handler_log.info("inside transactional %d", n)
    return n


@step(name="sl_blocked")
def blocked(n: int) -> int:
    blocker.wait(20)
    return n


@workflow(name="sl_flow")
def flow(n):  # type: ignore[no-untyped-def]
    return async_step(sync_step(n))


def context_of(line: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(line.get(name) for name in CONTEXT_FIELDS)


def test_handler_lines_carry_the_step_context_sync_and_async(
    client: Client, start_worker: Callable[..., Worker], logged: Lines
) -> None:
    start_worker(flow, concurrency=4)
    handles = client.submit_many(flow, [10, 20])
    assert [h.result(timeout=20) for h in handles] == [12, 22]
    run = client.get_run(handles[0].id)
    by_node = {s.node: s for s in run.steps}
    found = logged()
    mine = {line["message"]: line for line in found if line["logger"] == "tests.handler"}
    for message, node in [
        ("inside sync 10", "sl_sync"),
        ("inside async before 11", "sl_async"),
        ("inside async thread 11", "sl_async"),
        ("inside async after 11", "sl_async"),
    ]:
        line = mine[message]
        assert context_of(line) == (run.id, node, by_node[node].id, 1, node), message
        assert line["level"] == "INFO" and "time" in line
    other = mine["inside sync 20"]
    assert other["run_id"] == handles[1].id != run.id
    # Lines logged outside any step carry no step context.
    started = [line for line in found if "started: queues" in line["message"]]
    assert started and all("run_id" not in line for line in started)


def test_transactional_handler_lines_carry_the_step_context(
    client: Client, start_worker: Callable[..., Worker], logged: Lines
) -> None:
    start_worker(tx_step)
    handle = client.enqueue(tx_step, 3)
    assert handle.result(timeout=20) == 3
    found = logged()
    [line] = [line for line in found if line["message"] == "inside transactional 3"]
    step_id = client.get_run(handle.id).steps[0].id
    assert context_of(line) == (handle.id, "sl_tx", step_id, 1, "sl_tx")


def test_worker_lines_about_a_step_carry_its_context(
    client: Client, start_worker: Callable[..., Worker], logged: Lines
) -> None:
    blocker.clear()
    start_worker(blocked)
    handle = client.enqueue(blocked, 1)
    wait_until(lambda: client.get_run(handle.id).steps[0].state == "running", what="it runs")
    client.cancel(handle.id)

    def cancelled_line() -> list[dict[str, Any]]:
        return [line for line in logged() if "was cancelled" in line["message"]]

    [line] = wait_until(cancelled_line, what="the worker logs the cancel")
    blocker.set()
    assert line["logger"] == "cyclone.worker"
    step_id = client.get_run(handle.id).steps[0].id
    assert context_of(line) == (handle.id, "sl_blocked", step_id, 1, "sl_blocked")


def test_configure_logging_prints_json_lines_with_extras_and_errors() -> None:
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    stream = io.StringIO()
    try:
        handler = configure_logging(json=True, stream=stream)
        assert root.handlers == [handler]
        log = logging.getLogger("tests.configure")
        log.info("plain %s", "text", extra={"order": 7})
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
        configure_logging(json=False, stream=stream, level=logging.WARNING)
        log.info("not shown")
        log.warning("as text")
    finally:
        for h in root.handlers[:]:
            root.removeHandler(h)
        for h in saved:
            root.addHandler(h)
        root.setLevel(level)
    printed = stream.getvalue().splitlines()
    first, second, text = printed[0], printed[1], printed[-1]
    plain = json.loads(first)
    assert plain["message"] == "plain text" and plain["order"] == 7
    assert plain["logger"] == "tests.configure" and "run_id" not in plain
    failed = json.loads(second)
    assert failed["level"] == "ERROR" and "ValueError: boom" in failed["exc_info"]
    assert text.endswith("WARNING tests.configure: as text")
    assert "not shown" not in stream.getvalue()
