"""Audit of the user documentation as a new user reads it (part F): README.md beyond its
first code block, the claims of every program in examples/ (their docstrings, comments and
what they print), docs/comparison.md and docs/design.md.

tests/docs/test_docs.py runs every example end to end and checks only its exit code; here
what each example *says* it shows is checked through the public API against the real
database: the printed result, the states, the ordering it relies on. Examples whose claims
earlier audits already check (orders' result, ledger, progress, the framework examples) are
only checked for what those audits left out.
"""

from __future__ import annotations

import ast
import threading
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from cyclone_dsl import (
    Client,
    CycloneError,
    NodeRef,
    Ref,
    RunNotFound,
    RunState,
    StepState,
    Worker,
    child,
    for_each,
    step,
    wait_signal,
    workflow,
)
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
Clock = Callable[[datetime], None]
StartWorker = Callable[..., Worker]

CALLS: Counter[str] = Counter()
_lock = threading.Lock()


@pytest.fixture(autouse=True)
def _reset() -> None:
    CALLS.clear()


def _count(tag: str) -> None:
    with _lock:
        CALLS[tag] += 1


# -- README: "The workflow function runs once, to record the graph" ------------------------

SEEN_TYPES: list[tuple[str, str]] = []


@step(name="dwf_fetch")
def dwf_fetch(order_id: str) -> dict[str, object]:
    return {"id": order_id, "total": 42}


@step(name="dwf_charge")
def dwf_charge(order: dict[str, object]) -> dict[str, object]:
    return {"charged": order["total"]}


@workflow(name="dwf_orders")
def dwf_orders(order_id: Ref[str]) -> NodeRef[dict[str, object]]:
    SEEN_TYPES.append(("body", "called"))
    fetched = dwf_fetch(order_id)
    SEEN_TYPES.append((str(isinstance(order_id, Ref)), str(isinstance(fetched, NodeRef))))
    return dwf_charge(fetched)


def test_dwf_readme_the_workflow_function_runs_once_and_sees_references(
    start_worker: StartWorker, client: Client
) -> None:
    """README.md:46-48: the workflow function runs once, to record the graph; ``order_id``
    and each step call's result are references (``Ref``, ``NodeRef``)."""
    start_worker(dwf_orders)
    handles = [client.submit(dwf_orders, f"o-{i}") for i in range(3)]
    assert [h.result(timeout=30) for h in handles] == [{"charged": 42}] * 3
    handles.append(client.submit(dwf_orders, "o-4"))
    assert handles[-1].result(timeout=30) == {"charged": 42}
    # Whenever it first ran (lazily, at the first use), it ran once for every submit.
    assert SEEN_TYPES == [("body", "called"), ("True", "True")]


# -- examples/approval.py ------------------------------------------------------------------


def test_dwf_approval_the_answered_run_applies_the_decision_it_prints(
    start_worker: StartWorker, client: Client
) -> None:
    """examples/approval.py:45-48 prints the answered run's result and ``ap_apply``'s output:
    the signal sent before the wait is active is its decision, the escalation branch still
    gives the result."""
    from examples import approval as ex

    start_worker(ex.approval)
    answered = client.submit(ex.approval, {"id": 1, "amount": 120})
    client.signal(answered.id, "approve", {"by": "ana"})
    assert answered.result(timeout=30) == "escalated expense 1 to finance"
    run = answered.get()
    assert run.state is RunState.COMPLETED
    assert run.step("ap_apply").output == "decided: approve"
    assert run.step("any_approve_reject").output == {"name": "approve", "payload": {"by": "ana"}}
    assert run.step("ap_apply").state is StepState.COMPLETED


@step(name="dwf_req")
def dwf_req(value: int) -> int:
    return value


@step(name="dwf_apply")
def dwf_apply(decision: object) -> str:
    _count("dwf_apply")
    return "applied"


@step(name="dwf_after_apply")
def dwf_after_apply(applied: str) -> str:
    _count("dwf_after_apply")
    return applied + " and recorded"


@step(name="dwf_escalate")
def dwf_escalate(value: int) -> str:
    return f"escalated {value}"


@workflow(name="dwf_approval_deep")
def dwf_approval_deep(value: Ref[int]) -> NodeRef[str]:
    requested = dwf_req(value)
    decision = wait_signal("dwf_ok", timeout=timedelta(seconds=1), after=[requested])
    applied = dwf_apply(decision, on_dep_failure="cancel_branch")
    dwf_after_apply(applied)
    return dwf_escalate(requested)


def test_dwf_approval_cancel_branch_cancels_the_whole_branch_and_the_run_completes(
    start_worker: StartWorker, client: Client
) -> None:
    """examples/approval.py:3-6: a wait that times out fails with ``signal_timeout``; with
    ``on_dep_failure="cancel_branch"`` only that branch is cancelled (the node below the
    cancelled one too) and the other branch still completes the run."""
    start_worker(dwf_approval_deep)
    handle = client.submit(dwf_approval_deep, 7)
    assert handle.result(timeout=30) == "escalated 7"
    run = handle.get()
    assert run.state is RunState.COMPLETED
    assert run.step("dwf_ok").error_kind == "signal_timeout"
    assert run.step("dwf_apply").state is StepState.CANCELLED
    assert run.step("dwf_after_apply").state is StepState.CANCELLED
    assert run.step("dwf_escalate").state is StepState.COMPLETED
    assert CALLS["dwf_apply"] == 0
    assert CALLS["dwf_after_apply"] == 0


# -- examples/document_pipeline.py ---------------------------------------------------------


def test_dwf_document_pipeline_fans_out_over_pages_then_indexes_them_in_a_child_run(
    start_worker: StartWorker, client: Client
) -> None:
    """examples/document_pipeline.py:1: a fan-out over pages (of at most ten words), then a
    child workflow that indexes the text: the child run is recorded under its parent and
    takes the OCR'd pages in page order."""
    from examples import document_pipeline as ex

    text = "Cyclone runs durable workflows on PostgreSQL. " * 8
    start_worker(ex.pipeline, ex.index)
    handle = client.submit(ex.pipeline, {"text": text})
    assert handle.result(timeout=30) == {"pages": 5, "words": 48}
    run = handle.get()
    items = sorted((s for s in run.steps if s.item_of is not None), key=lambda s: s.item_index or 0)
    assert [s.item_index for s in items] == [0, 1, 2, 3, 4]
    assert all(s.kind == "doc_ocr_page" and s.state is StepState.COMPLETED for s in items)
    words = text.split()
    pages = [" ".join(words[i : i + 10]).upper() for i in range(0, len(words), 10)]
    assert [s.output for s in items] == pages
    (kid,) = client.list_runs(parent_run_id=handle.id)
    assert kid.workflow == "doc_index"
    assert kid.parent_run_id == handle.id
    assert kid.state is RunState.COMPLETED
    assert client.get_run(kid.id).input == pages


# -- examples/hello.py: "two steps in parallel, joined by a third" -------------------------


def test_dwf_hello_two_steps_are_ready_together_and_the_third_waits_for_both(
    start_worker: StartWorker, client: Client
) -> None:
    """examples/hello.py:1: two steps in parallel, joined by a third."""
    from examples import hello as ex

    handle = client.submit(ex.hello, "Ada")
    run = handle.get()
    assert run.step("greet").state is StepState.AVAILABLE
    assert run.step("shout").state is StepState.AVAILABLE
    assert run.step("combine").state is StepState.PENDING
    start_worker(ex.hello)
    assert handle.result(timeout=30) == "Hello, Ada (ADA!)"


# -- examples/job_queue.py -----------------------------------------------------------------


def test_dwf_job_queue_a_unique_key_does_no_duplicate_work(
    start_worker: StartWorker, client: Client
) -> None:
    """examples/job_queue.py:1,26-29: unique keys (no duplicate work): the second enqueue
    returns the first job and the invoice is sent by one run, once."""
    from examples import job_queue as ex

    first = client.enqueue(ex.send_invoice, "inv-7", unique_key="inv-7")
    again = client.enqueue(ex.send_invoice, "inv-7", unique_key="inv-7")
    assert first.created
    assert again.id == first.id
    assert not again.created
    start_worker(ex.send_invoice)
    assert first.result(timeout=30) == "sent inv-7"
    (only,) = client.list_runs(workflow="jq_send_invoice")
    assert only.id == first.id
    assert client.get_run(first.id).steps[0].attempt_number == 1
    # The key is unique among active work only: once the holder finished, it is free.
    later = client.enqueue(ex.send_invoice, "inv-7", unique_key="inv-7")
    assert later.created and later.id != first.id
    assert later.result(timeout=30) == "sent inv-7"


def test_dwf_job_queue_sequence_keys_keep_fifo_per_key_with_many_slots(
    start_worker: StartWorker, client: Client
) -> None:
    """examples/job_queue.py:30-42: sequence keys (FIFO per key) with eight slots."""
    from examples import job_queue as ex

    ex.applied.clear()
    handles = [
        client.enqueue(ex.apply_event, {"account": a, "n": n}, sequence_key=a)
        for n in range(5)
        for a in ("dwf-1", "dwf-2")
    ]
    start_worker(ex.apply_event, concurrency=8)
    for handle in handles:
        handle.wait(timeout=30)
    for account in ("dwf-1", "dwf-2"):
        assert [e for e in ex.applied if e.startswith(account)] == [
            f"{account}:{n}" for n in range(5)
        ]
    ex.applied.clear()


# -- examples/nightly.py -------------------------------------------------------------------


def test_dwf_nightly_a_worker_registers_the_schedule_and_two_scanners_fire_a_slot_once(
    start_worker: StartWorker, client: Client, clock: Clock
) -> None:
    """examples/nightly.py:1-6: ``@schedule`` registers a cron schedule when a worker starts;
    it pins the workflow's def_version; every scanner (one per worker) competes for due slots
    and each slot fires once. The cron is read in Europe/Paris."""
    from examples import nightly as ex

    assert client.list_schedules() == []
    start_worker(ex.nightly, scanners=False)  # no scanner: only the registration happens
    (entry,) = wait_until(
        lambda: [s for s in client.list_schedules() if s.id == "nightly-cleanup"],
        what="the schedule registered by the worker's start",
    )
    assert entry.def_version == ex.nightly.def_version
    assert entry.input == {"days": 30}
    paris = entry.next_run_at.astimezone(ZoneInfo("Europe/Paris"))
    assert (paris.hour, paris.minute, paris.second) == (2, 30, 0)
    assert entry.next_run_at - datetime.now(UTC) <= timedelta(days=1)

    clock(entry.next_run_at + timedelta(seconds=1))
    start_worker(ex.nightly)
    start_worker(ex.nightly)
    (run,) = wait_until(
        lambda: client.list_runs(workflow="nightly"), what="the nightly slot to fire"
    )
    assert client.handle(run.id).result(timeout=30) == "removed files older than 30 days"
    assert run.def_version == ex.nightly.def_version
    wait_until(
        lambda: [s for s in client.list_schedules() if s.next_run_at > entry.next_run_at],
        what="the schedule to move to its next slot",
    )
    assert len(client.list_runs(workflow="nightly")) == 1


# -- examples/orders.py: the shipments wait for the payment --------------------------------


def test_dwf_orders_shipping_waits_for_the_approved_payment_and_notify_comes_last(
    start_worker: StartWorker, client: Client
) -> None:
    """examples/orders.py:48-56: ``for_each(..., after=[payment])`` starts no shipment before
    the signal lets the charge run, though the lines it iterates are known; ``notify`` runs
    after the report."""
    from examples import orders as ex

    start_worker(ex.orders)
    handle = client.submit(ex.orders, "o-17")
    wait_until(
        lambda: handle.get().step("ex_order_lines").state is StepState.COMPLETED,
        what="the order lines",
    )
    run = handle.get()
    assert run.step("approved").state is StepState.WAITING_SIGNAL
    assert run.step("ex_charge").state is StepState.PENDING
    assert run.step("ex_ship_line").state is StepState.PENDING
    assert [s for s in run.steps if s.item_of is not None] == []
    client.signal(handle.id, "approved", {"by": "ana"})
    result = handle.result(timeout=30)
    assert isinstance(result, dict) and result["approved_by"] == "ana"
    run = handle.get()
    summary, notified = run.step("ex_summarize"), run.step("ex_notify")
    charge = run.step("ex_charge")
    items = [s for s in run.steps if s.item_of == "ex_ship_line"]
    assert len(items) == 3
    assert charge.completed_at is not None and notified.started_at is not None
    assert all(s.started_at is not None and s.started_at >= charge.completed_at for s in items)
    assert summary.completed_at is not None
    assert notified.started_at >= summary.completed_at


# -- docs/comparison.md: "A submit writes it whole" ----------------------------------------


@step(name="dwf_leaf")
def dwf_leaf(value: object) -> object:
    return value


@workflow(name="dwf_kid")
def dwf_kid(value: Ref[object]) -> NodeRef[object]:
    return dwf_leaf(value)


@step(name="dwf_list")
def dwf_list(values: list[int]) -> list[int]:
    return values


@step(name="dwf_item")
def dwf_item(value: int) -> int:
    return value


@workflow(name="dwf_whole")
def dwf_whole(values: Ref[list[int]]) -> NodeRef[object]:
    first = dwf_list(values)
    spread = for_each(dwf_item, over=first)
    got = wait_signal("dwf_go", after=[spread])
    return child(dwf_kid, got)


def test_dwf_comparison_a_submit_writes_the_graph_whole(client: Client) -> None:
    """docs/comparison.md:42-45: a workflow is a graph known before it runs; a submit writes
    it whole, so a run can be inspected node by node before anything ran."""
    handle = client.submit(dwf_whole, [1, 2])
    run = handle.get()
    nodes = {s.node: s.state for s in run.steps}
    assert len(nodes) == 4, nodes
    assert nodes["dwf_list"] is StepState.AVAILABLE
    assert all(state is StepState.PENDING for node, state in nodes.items() if node != "dwf_list"), (
        nodes
    )
    assert {s.node for s in run.steps if s.signal_name == "dwf_go"} == {"dwf_go"}
    assert [s.child_workflow for s in run.steps if s.child_workflow] == ["dwf_kid"]
    assert run.def_version == dwf_whole.def_version


# -- docs/design.md: "The DSL and graph layers import nothing that does I/O" ---------------

IO_MODULES = {
    "asyncio",
    "http",
    "os",
    "pathlib",
    "psycopg",
    "psycopg_pool",
    "requests",
    "select",
    "shutil",
    "socket",
    "sqlite3",
    "subprocess",
    "urllib",
}


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def test_dwf_design_dsl_and_graph_import_nothing_that_does_io() -> None:
    """docs/design.md:14 and README.md:71: the DSL and graph layers import nothing that does
    I/O: no driver, no socket, no file system, and none of the layers above them."""
    files = sorted((ROOT / "cyclone_dsl" / "dsl").rglob("*.py"))
    files += sorted((ROOT / "cyclone_dsl" / "graph").rglob("*.py"))
    assert len(files) > 4
    bad: list[str] = []
    for path in files:
        for name in _imports(path):
            top = name.split(".")[0]
            layer = name.split(".")[1] if top == "cyclone_dsl" and "." in name else ""
            if top in IO_MODULES or layer in {
                "client",
                "worker",
                "engine",
                "sql",
                "db",
                "cli",
                "ui",
                "contrib",
            }:
                bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert bad == []


# -- docs/design.md: transitions lock runs before steps, ancestors first -------------------


@step(name="dwf_slow")
def dwf_slow(value: object) -> object:
    return value


@workflow(name="dwf_lock_kid")
def dwf_lock_kid(value: Ref[object]) -> NodeRef[object]:
    got = wait_signal("dwf_poke")
    out: NodeRef[object] = dwf_slow(got)
    return out


@workflow(name="dwf_lock_parent")
def dwf_lock_parent(value: Ref[object]) -> NodeRef[object]:
    return child(dwf_lock_kid, value)


def test_dwf_design_concurrent_steering_of_a_parent_and_its_child_never_deadlocks(
    start_worker: StartWorker, cyclone_dsn: str, client: Client
) -> None:
    """docs/design.md:23-24 (and runs-and-steps' retry paragraph): transitions lock the run
    row and its ancestors before step rows, in id order, so pausing and resuming a parent
    while its child takes signals and completes raise nothing but typed refusals."""
    start_worker(dwf_lock_parent)
    parents = [client.submit(dwf_lock_parent, i) for i in range(4)]
    kids = wait_until(
        lambda: (
            [k for p in parents for k in client.list_runs(parent_run_id=p.id)]
            if all(client.list_runs(parent_run_id=p.id) for p in parents)
            else []
        ),
        what="every child run",
    )
    kid_ids = [k.id for k in kids]
    assert len(kid_ids) == 4
    errors: list[BaseException] = []

    def steer(target: list[int], action: Callable[[Client, int], Any]) -> None:
        with Client(cyclone_dsn) as own:
            for _ in range(15):
                for run_id in target:
                    try:
                        action(own, run_id)
                    except CycloneError:
                        pass  # a typed refusal (already paused, ended) is fine
                    except BaseException as exc:  # what the test looks for
                        errors.append(exc)

    threads = [
        threading.Thread(target=steer, args=([p.id for p in parents], lambda c, r: c.pause(r))),
        threading.Thread(target=steer, args=([p.id for p in parents], lambda c, r: c.resume(r))),
        threading.Thread(target=steer, args=(kid_ids, lambda c, r: c.signal(r, "dwf_poke", r))),
        threading.Thread(target=steer, args=(kid_ids[::-1], lambda c, r: c.pause(r))),
        threading.Thread(target=steer, args=(kid_ids, lambda c, r: c.resume(r))),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    for parent in parents:
        for run_id in [parent.id, *[k.id for k in client.list_runs(parent_run_id=parent.id)]]:
            if client.get_run(run_id).state is RunState.PAUSED:
                client.resume(run_id)
    for parent in parents:
        assert parent.result(timeout=30) == client.list_runs(parent_run_id=parent.id)[0].id


# -- docs/comparison.md: "submit_tx, submit_once_tx, enqueue_tx, sync and async, every
# workflow shape" ---------------------------------------------------------------------------


@workflow(name="dwf_fan_root")
def dwf_fan_root(values: Ref[list[int]]) -> NodeRef[list[int]]:
    return for_each(dwf_item, over=values)


def test_dwf_comparison_async_submits_in_your_transaction_activate_every_root_shape(
    cyclone_dsn: str, client: Client, start_worker: StartWorker
) -> None:
    """docs/comparison.md:18: ``submit_tx``, ``submit_once_tx``, ``enqueue_tx``, async too,
    every workflow shape: a root child run and a root fan-out are activated in the caller's
    transaction (they exist after the commit, before any worker) and vanish with a rollback."""
    import asyncio

    import psycopg

    from cyclone_dsl import AsyncClient

    async def submit(commit: bool) -> list[int]:
        ids: list[int] = []
        async with (
            AsyncClient(cyclone_dsn) as aclient,
            await psycopg.AsyncConnection.connect(cyclone_dsn) as conn,
        ):
            ids.append((await aclient.submit_tx(conn, dwf_lock_parent, 1)).id)
            once = await aclient.submit_once_tx(conn, dwf_fan_root, [3, 4], key=f"dwf-{commit}")
            ids.append(once.id)
            ids.append((await aclient.enqueue_tx(conn, dwf_item, 5)).id)
            if commit:
                await conn.commit()
            else:
                await conn.rollback()
        return ids

    gone = asyncio.run(submit(False))
    for run_id in gone:
        with pytest.raises(RunNotFound):
            client.get_run(run_id)
    assert client.list_runs() == []

    parent_id, fan_id, job_id = asyncio.run(submit(True))
    (kid,) = client.list_runs(parent_run_id=parent_id)
    assert kid.workflow == "dwf_lock_kid"
    fan = client.get_run(fan_id)
    assert sorted((s.item_index, s.input) for s in fan.steps if s.item_of is not None) == [
        (0, 3),
        (1, 4),
    ]
    assert client.get_run(job_id).steps[0].state is StepState.AVAILABLE
    start_worker(dwf_fan_root, dwf_item, dwf_lock_parent)
    assert client.handle(fan_id).result(timeout=30) == [3, 4]
    assert client.handle(job_id).result(timeout=30) == 5
    client.signal(kid.id, "dwf_poke", "k")
    assert client.handle(parent_id).result(timeout=30) == "k"
