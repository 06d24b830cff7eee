"""Runs through the public API: shapes, inputs, results, failures, fencing."""

from __future__ import annotations

import threading
from collections.abc import Callable

import psycopg
import pytest

from cyclone_dsl import Client, NoOutput, Permanent, RunFailed, Worker, step, workflow
from cyclone_dsl.errors import InvalidTransition, NodeNotFound, RunNotFound
from cyclone_dsl.states import RunState, StepState

calls: dict[str, int] = {}
calls_lock = threading.Lock()


def count(name: str) -> int:
    with calls_lock:
        calls[name] = calls.get(name, 0) + 1
        return calls[name]


@step(name="rt_add_one")
def add_one(x: int) -> int:
    return x + 1


@step(name="rt_double")
def double(x: int) -> int:
    return x * 2


@step(name="rt_pair")
def pair(a: int, b: int) -> list[int]:
    return [a, b]


@step(name="rt_total")
def total(values: list[int]) -> int:
    return sum(values)


@step(name="rt_constant")
def constant() -> str:
    return "hello"


@step(name="rt_flaky", max_attempts=3)
def flaky(x: int) -> int:
    if count(f"flaky-{x}") < 3:
        raise RuntimeError("not yet")
    return x


@step(name="rt_broken", max_attempts=2)
def broken(x: int) -> int:
    raise ValueError(f"bad input {x}")


@step(name="rt_permanent", max_attempts=5)
def permanent(x: int) -> int:
    count("permanent")
    raise Permanent("no point retrying")


@workflow(name="rt_chain")
def chain(x):  # type: ignore[no-untyped-def]
    return double(add_one(add_one(x)))


@workflow(name="rt_diamond")
def diamond(x):  # type: ignore[no-untyped-def]
    start = add_one(x)
    left = double(start)
    right = add_one(start)
    return pair(left, right)


@workflow(name="rt_wide")
def wide(x):  # type: ignore[no-untyped-def]
    branches = [add_one(x) for _ in range(6)]
    return total(branches)


@workflow(name="rt_no_result")
def no_result(x):  # type: ignore[no-untyped-def]
    add_one(x)


@workflow(name="rt_control")
def control_only(x):  # type: ignore[no-untyped-def]
    first = constant()
    return add_one(x, after=[first])


@workflow(name="rt_retry")
def retried(x):  # type: ignore[no-untyped-def]
    return flaky(x)


@workflow(name="rt_fail")
def failing(x):  # type: ignore[no-untyped-def]
    bad = broken(x)
    return add_one(bad)


@workflow(name="rt_permanent")
def permanent_wf(x):  # type: ignore[no-untyped-def]
    return permanent(x)


@workflow(name="rt_branch")
def branch(x):  # type: ignore[no-untyped-def]
    bad = broken(x)
    add_one(bad, on_dep_failure="cancel_branch")
    return double(x)


HANDLERS = [add_one, double, pair, total, constant, flaky, broken, permanent]


def test_chain_passes_outputs_down(client: Client, start_worker: Callable[..., Worker]) -> None:
    start_worker(*HANDLERS)
    assert client.submit(chain, 3).result(timeout=10) == 10


def test_diamond_joins_two_branches_as_a_tuple(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS)
    assert client.submit(diamond, 1).result(timeout=10) == [4, 3]


def test_wide_join_collects_a_list_in_order(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS)
    handle = client.submit(wide, 10)
    assert handle.result(timeout=10) == 66
    run = handle.wait(timeout=1)
    assert run.state is RunState.COMPLETED
    assert run.finished_at is not None
    assert all(s.state is StepState.COMPLETED for s in run.steps)


def test_control_edge_orders_without_passing_data(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS)
    handle = client.submit(control_only, 5)
    assert handle.result(timeout=10) == 6
    run = handle.get()
    assert run.step("rt_constant").completed_at <= run.step("rt_add_one").started_at  # type: ignore[operator]


def test_workflow_without_result_raises_no_output(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS)
    handle = client.submit(no_result, 1)
    assert handle.wait(timeout=10).state is RunState.COMPLETED
    with pytest.raises(NoOutput):
        handle.result(timeout=1)


@pytest.fixture
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    from cyclone_dsl.engine import backoff

    monkeypatch.setattr(backoff, "BASE_SECONDS", 0.05)


@pytest.mark.usefixtures("fast_backoff")
def test_retries_until_success(client: Client, start_worker: Callable[..., Worker]) -> None:
    start_worker(*HANDLERS)
    handle = client.submit(retried, 7)
    assert handle.result(timeout=30) == 7
    step_row = handle.get().step("rt_flaky")
    assert step_row.attempt == 2
    # The completed step has no error of its own; its failed attempts are its history.
    assert (step_row.error, step_row.error_kind, step_row.panic_stack) == (None, None, None)
    assert [(a.number, a.outcome, a.error) for a in step_row.attempts] == [
        (1, "retried", "RuntimeError: not yet"),
        (2, "retried", "RuntimeError: not yet"),
    ]
    assert all(a.worker and a.started_at and a.panic_stack for a in step_row.attempts)
    assert step_row.attempt_label == "3/3"


@pytest.mark.usefixtures("fast_backoff")
def test_exhausted_attempts_discard_the_step_and_fail_the_run(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS)
    handle = client.submit(failing, 1)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=30)
    assert failed.value.node == "rt_broken"
    assert "ValueError: bad input 1" in (failed.value.error or "")
    run = handle.get()
    assert run.state is RunState.FAILED
    bad = run.step("rt_broken")
    assert bad.state is StepState.DISCARDED
    assert bad.attempt == 2
    assert bad.error_kind == "error"
    assert bad.panic_stack is not None and "Traceback" in bad.panic_stack
    assert run.step("rt_add_one").state is StepState.CANCELLED


def test_permanent_error_skips_remaining_attempts(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS)
    calls.pop("permanent", None)
    handle = client.submit(permanent_wf, 1)
    with pytest.raises(RunFailed):
        handle.result(timeout=10)
    assert calls["permanent"] == 1
    assert handle.get().step("rt_permanent").error_kind == "permanent"


@pytest.mark.usefixtures("fast_backoff")
def test_cancel_branch_contains_the_failure(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS)
    handle = client.submit(branch, 4)
    assert handle.result(timeout=30) == 8
    run = handle.get()
    assert run.state is RunState.COMPLETED
    assert run.step("rt_broken").state is StepState.DISCARDED
    assert run.step("rt_add_one").state is StepState.CANCELLED
    assert run.step("rt_add_one").error_kind == "dep_failed"


gate = threading.Event()


@step(name="rt_gate", max_attempts=1)
def gated(x: int) -> int:
    if not gate.is_set():
        raise RuntimeError("gate closed")
    return x * 10


@workflow(name="rt_gated")
def gated_wf(x):  # type: ignore[no-untyped-def]
    return add_one(gated(x))


def test_operator_retry_reruns_a_failed_node(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(*HANDLERS, gated)
    gate.clear()
    handle = client.submit(gated_wf, 4)
    assert handle.wait(timeout=10).state is RunState.FAILED
    assert handle.get().step("rt_add_one").state is StepState.CANCELLED
    gate.set()
    client.retry(handle.id, "rt_gate")
    assert handle.result(timeout=10) == 41
    node = handle.get().step("rt_gate")
    assert node.attempt == 0 and node.reclaims == 0
    with pytest.raises(InvalidTransition, match="only a discarded or cancelled"):
        client.retry(handle.id, "rt_gate")
    with pytest.raises(NodeNotFound):
        client.retry(handle.id, "nope")
    with pytest.raises(RunNotFound):
        client.retry(10**9, "rt_gate")


def test_submit_tx_exists_only_if_the_caller_commits(client: Client, cyclone_dsn: str) -> None:
    with psycopg.connect(cyclone_dsn) as conn:
        handle = client.submit_tx(conn, chain, 1)
        conn.rollback()
    assert client.list_runs() == []
    with psycopg.connect(cyclone_dsn) as conn:
        committed = client.submit_tx(conn, chain, 1)
        conn.commit()
    assert [r.id for r in client.list_runs()] == [committed.id]
    with pytest.raises(RunNotFound):
        client.get_run(handle.id)


def test_list_runs_filters_and_pages(client: Client) -> None:
    ids = [client.submit(chain, i).id for i in range(5)]
    client.submit(diamond, 1)
    runs = client.list_runs(workflow="rt_chain", limit=3)
    assert [r.id for r in runs] == ids[::-1][:3]
    rest = client.list_runs(workflow="rt_chain", limit=3, before_id=runs[-1].id)
    assert [r.id for r in rest] == ids[::-1][3:]
    assert {r.state for r in client.list_runs(state="running")} == {RunState.RUNNING}


def test_run_done_notifications_batch_ids() -> None:
    from cyclone_dsl.engine.notify import IDS_PER_NOTIFICATION, names_run

    assert names_run("1,22,333", 22)
    assert not names_run("1,222", 22)
    assert IDS_PER_NOTIFICATION * (len(str(2**63)) + 1) < 8000  # PostgreSQL payload limit
