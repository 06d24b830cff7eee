"""Forks: ``client.fork(run_id, from_node=...)`` runs a workflow again from one node,
copying what the source run completed outside that node's downstream part."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from cyclone_dsl import (
    AsyncClient,
    Client,
    InvalidArgument,
    InvalidTransition,
    RunNotFound,
    StepContext,
    Worker,
    for_each,
    step,
    workflow,
)
from cyclone_dsl.dsl.registry import Registry
from cyclone_dsl.dsl.workflow import WorkflowDef
from cyclone_dsl.states import RunState, StepState

StartWorker = Callable[..., Worker]

calls: Counter[str] = Counter()
lock = threading.Lock()
broken = {"charge": True}


@pytest.fixture(autouse=True)
def _fresh() -> None:
    with lock:
        calls.clear()
    broken["charge"] = True


def count(ctx: StepContext) -> None:
    with lock:
        calls[ctx.node] += 1


@step(name="fk_fetch")
def fetch(order: int, *, ctx: StepContext) -> dict[str, int]:
    count(ctx)
    return {"order": order, "amount": order * 10}


@step(name="fk_price")
def price(order: dict[str, int], *, ctx: StepContext) -> int:
    count(ctx)
    return order["amount"] + 1


@step(name="fk_charge", max_attempts=1)
def charge(amount: int, *, ctx: StepContext) -> str:
    count(ctx)
    if broken["charge"]:
        raise RuntimeError("the card processor is down")
    return f"charged {amount}"


@step(name="fk_notify")
def notify(receipt: str, *, ctx: StepContext) -> str:
    count(ctx)
    return f"sent: {receipt}"


@step(name="fk_audit")
def audit(order: dict[str, int], *, ctx: StepContext) -> str:
    count(ctx)
    return "audited"


@step(name="fk_lines")
def lines(order: dict[str, int], *, ctx: StepContext) -> list[int]:
    count(ctx)
    return [1, 2, 3]


@step(name="fk_line")
def line(x: int, *, ctx: StepContext) -> int:
    count(ctx)
    return x * 2


@workflow(name="fk_order")
def order_flow(order):  # type: ignore[no-untyped-def]
    fetched = fetch(order)
    audit(fetched)  # a parallel branch: copied, never run again
    return notify(charge(price(fetched)))


@workflow(name="fk_fan")
def fan_flow(order):  # type: ignore[no-untyped-def]
    return charge(price(fetch(order)), after=[for_each(line, over=lines(fetch.named("f2")(order)))])


def test_fork_from_a_failed_node_after_fixing_its_handler(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(order_flow)
    failed = client.submit(order_flow, 7)
    assert failed.wait(timeout=30).state is RunState.FAILED
    with lock:
        before = dict(calls)
        calls.clear()
    broken["charge"] = False  # the handler is fixed
    fork = client.fork(failed.id, "fk_charge")
    assert fork.result(timeout=30) == "sent: charged 71"
    with lock:
        assert dict(calls) == {"fk_charge": 1, "fk_notify": 1}  # nothing upstream ran again
    assert before == {"fk_fetch": 1, "fk_audit": 1, "fk_price": 1, "fk_charge": 1}
    run = client.get_run(fork.id)
    assert (run.forked_from, run.fork_node) == (failed.id, "fk_charge")
    copied = {s.node for s in run.steps if s.copied}
    assert copied == {"fk_fetch", "fk_price", "fk_audit"}
    assert run.step("fk_price").output == 71
    assert client.get_run(failed.id).state is RunState.FAILED  # the source is untouched


def test_fork_with_a_new_input_and_from_a_completed_run(
    client: Client, start_worker: StartWorker
) -> None:
    broken["charge"] = False
    start_worker(order_flow)
    first = client.submit(order_flow, 1)
    assert first.result(timeout=30) == "sent: charged 11"
    again = client.fork(first.id, "fk_price")
    assert again.result(timeout=30) == "sent: charged 11"
    other = client.fork(first.id, "fk_fetch", input=2)
    assert other.result(timeout=30) == "sent: charged 21"
    assert {s.node for s in client.get_run(other.id).steps if s.copied} == set()


def test_a_fork_copies_a_completed_fan_out_and_reruns_what_it_must(
    client: Client, start_worker: StartWorker
) -> None:
    start_worker(fan_flow)
    failed = client.submit(fan_flow, 3)
    assert failed.wait(timeout=30).state is RunState.FAILED
    broken["charge"] = False
    with lock:
        calls.clear()
    fork = client.fork(failed.id, "fk_charge")
    assert fork.result(timeout=30) == "charged 31"
    with lock:
        assert dict(calls) == {"fk_charge": 1}
    steps = {s.node: s for s in client.get_run(fork.id).steps}
    assert steps["fk_line"].copied and steps["fk_line"].output == [2, 4, 6]
    assert steps["fk_line"].state is StepState.COMPLETED


def test_an_async_client_forks_too(
    client: Client, cyclone_dsn: str, start_worker: StartWorker
) -> None:
    start_worker(order_flow)
    failed = client.submit(order_flow, 5)
    failed.wait(timeout=30)
    broken["charge"] = False

    async def go() -> Any:
        async with AsyncClient(cyclone_dsn) as aclient:
            fork = await aclient.fork(failed.id, "fk_charge")
            return await fork.result(timeout=30)

    assert asyncio.run(go()) == "sent: charged 51"


def test_bad_forks_are_refused_and_write_nothing(client: Client, start_worker: StartWorker) -> None:
    start_worker(order_flow)
    run = client.submit(order_flow, 1)
    run.wait(timeout=30)
    runs_before = client.run_counts()
    with pytest.raises(RunNotFound):
        client.fork(run.id + 1000, "fk_charge")
    with pytest.raises(InvalidArgument, match="not a node"):
        client.fork(run.id, "nope")
    with pytest.raises(InvalidArgument, match="run id"):
        client.fork(run, "fk_charge")  # type: ignore[arg-type]
    assert client.run_counts() == runs_before


def test_a_fork_onto_another_definition_needs_consent_and_compatible_kinds(
    cyclone_dsn: str, client: Client, start_worker: StartWorker
) -> None:
    start_worker(order_flow)
    old = client.submit(order_flow, 4)
    old.wait(timeout=30)

    def newer_builder(order):  # type: ignore[no-untyped-def]
        fetched = fetch(order)
        return notify(charge(price(fetched), after=[audit(fetched)]))

    def renamed_builder(order):  # type: ignore[no-untyped-def]
        fetched = audit.named("fk_fetch")(fetch.named("zero")(order))
        return notify(charge(price(fetched)))

    newer = WorkflowDef(newer_builder, "fk_order")
    renamed = WorkflowDef(renamed_builder, "fk_order")
    registry = Registry()
    registry.add_workflow_tree(newer)

    with Client(cyclone_dsn, registry=registry) as other:
        with pytest.raises(InvalidTransition, match="current_definition=True"):
            other.fork(old.id, "fk_charge")
        broken["charge"] = False
        fork = other.fork(old.id, "fk_charge", current_definition=True)
        assert client.get_run(fork.id).def_version == newer.def_version
    registry = Registry()
    registry.add_workflow_tree(renamed)
    with (
        Client(cyclone_dsn, registry=registry) as other,
        pytest.raises(InvalidTransition, match="ran 'fk_fetch' there and is 'fk_audit'"),
    ):
        other.fork(old.id, "fk_charge", current_definition=True)


@step(name="fk_three")
def three(n: int) -> list[int]:
    return list(range(n))


@step(name="fk_twice")
def twice(x: int) -> int:
    return x * 2


@workflow(name="fk_root_fan")
def root_fan(x):  # type: ignore[no-untyped-def]
    a = three.named("a")(3)
    f = for_each(twice, over=x, node_id="f")  # a root: it completes as it starts for []
    return for_each(twice, over=a, after=[f], node_id="g")


def test_a_fork_from_a_root_that_ends_as_it_starts_reads_the_copied_outputs(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """The fork's roots were activated before the copied nodes took their outputs: "f"
    completed as it started and activated "g", whose fan-out read the copied "a" with no
    output yet, and the fork failed ("for_each over 'g' needs a JSON list, got nothing")."""
    start_worker(three, twice, root_fan)
    run = client.submit(root_fan, [1])
    assert run.result(timeout=20) == [0, 2, 4]
    fork = client.fork(run.id, "f", input=[])
    assert fork.result(timeout=20) == [0, 2, 4]
