"""Audit of operator retry (``client.retry``, ``retry_many``, the CLI) meeting fan-outs,
child runs, conditions, contained failures, waits, timeouts, fencing and replays.

Handlers fail (``Permanent``, so at once) while their tag is in ``FAILING``, and count
their executions in ``CALLS``; each test fails a run, fixes the cause, retries, and
checks the run's outcome, its steps and how often each handler ran.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from click.testing import CliRunner

from cyclone_dsl import (
    AlreadyTerminal,
    AsyncClient,
    Client,
    Concurrency,
    InvalidTransition,
    NoOutput,
    Permanent,
    Run,
    RunFailed,
    RunFilter,
    RunState,
    StepContext,
    StepState,
    Worker,
    child,
    for_each,
    step,
    wait_any,
    wait_n,
    wait_signal,
    workflow,
)
from cyclone_dsl.cli.main import cli
from cyclone_dsl.db import clock as db_clock
from tests.waiting import wait_until

FAILING: set[str] = set()
CALLS: Counter[str] = Counter()
SEEN_ATTEMPTS: dict[str, list[int]] = {}
VALUES: dict[str, int] = {}
_lock = threading.Lock()


def _count(tag: str) -> None:
    with _lock:
        CALLS[tag] += 1


def _fail_if(tag: str) -> None:
    if tag in FAILING:
        raise Permanent(f"{tag} is set to fail")


@pytest.fixture(autouse=True)
def _reset() -> None:
    FAILING.clear()
    CALLS.clear()
    SEEN_ATTEMPTS.clear()
    VALUES.clear()
    gate.set()
    slow_release.clear()


def time_out(clock: Callable[[datetime], None], client: Client, run_id: int, node: str) -> None:
    """Time out the hour-long wait ``node`` of the run: once it waits (its timeout counts
    from then), move the database clock two hours on; the workers' scanner fails it.

    A retried wait's fresh hour counts from the moved clock, so a signal after a retry
    never races its timeout, on a machine however loaded."""
    wait_until(
        lambda: client.get_run(run_id).step(node).state is StepState.WAITING_SIGNAL,
        what=f"{node} to wait",
    )
    clock(datetime.now(UTC) + db_clock.current_shift() + timedelta(hours=2))


def settled(client: Client, run_id: int, timeout: float = 15) -> Run:
    return wait_until(
        lambda: (run := client.get_run(run_id)).state.is_terminal and run,
        timeout=timeout,
        what=f"run {run_id} to end",
    )


# -- handlers --------------------------------------------------------------------------


@step(name="ra_items")
def ra_items(n: int) -> list[int]:
    _count("items")
    return list(range(n))


@step(name="ra_item", max_attempts=1)
def ra_item(x: int) -> int:
    _count(f"item-{x}")
    _fail_if(f"item-{x}")
    return x * 10


@step(name="ra_total")
def ra_total(values: list[int]) -> int:
    _count("total")
    return sum(values)


@step(name="ra_task", max_attempts=1)
def ra_task(tag: str) -> str:
    _count(tag)
    _fail_if(tag)
    return tag


@step(name="ra_after")
def ra_after(value: object) -> str:
    _count("after")
    return f"after {value}"


@step(name="ra_join")
def ra_join(a: object, b: object) -> list[object]:
    return [a, b]


@step(name="ra_value")
def ra_value(key: str) -> int:
    """Returns VALUES[key] (what a test sets), counting its calls."""
    _count(f"value-{key}")
    return VALUES.get(key, 0)


@step(name="ra_double")
def ra_double(x: int) -> int:
    _count("double")
    return x * 2


@step(name="ra_budget", max_attempts=2)
def ra_budget(tag: str, ctx: StepContext) -> str:
    """Fails while its tag is in FAILING, with a plain error (retried up to max_attempts)."""
    _count(tag)
    SEEN_ATTEMPTS.setdefault(tag, []).append(ctx.attempt)
    if tag in FAILING:
        raise RuntimeError(f"{tag} failed on attempt {ctx.attempt}")
    return f"{tag} ok on attempt {ctx.attempt}"


gate = threading.Event()
#: What a timed-out ``ra_slow`` waits for before it returns, late (the test sets it).
slow_release = threading.Event()


@step(name="ra_slow", timeout=timedelta(seconds=2), max_attempts=1)
def ra_slow(tag: str, ctx: StepContext) -> str:
    """Overstays its timeout while its tag is in FAILING (a sync handler: it keeps running
    until the test sets ``slow_release``). The timeout leaves an attempt that returns at once
    room to do so on a loaded machine (the worker times it from its dispatch)."""
    _count(tag)
    if tag in FAILING:
        slow_release.wait(10)
        return "too late"
    return f"{tag} in time"


@step(name="ra_stale", max_attempts=1)
def ra_stale(tag: str) -> str:
    """The first execution blocks on ``gate`` and then returns a stale value."""
    with _lock:
        CALLS[tag] += 1
        n = CALLS[tag]
    if n == 1:
        gate.wait(10)
        return "stale"
    return "fresh"


# -- workflows -------------------------------------------------------------------------


@workflow(name="ra_fan")
def ra_fan(n):  # type: ignore[no-untyped-def]
    return ra_total(for_each(ra_item, over=ra_items(n), max_parallel=2))


@workflow(name="ra_inner")
def ra_inner(x):  # type: ignore[no-untyped-def]
    return ra_item(x)


@workflow(name="ra_child_fan")
def ra_child_fan(n):  # type: ignore[no-untyped-def]
    return ra_total(for_each(ra_inner, over=ra_items(n), max_parallel=2))


@workflow(name="ra_inner_chain")
def ra_inner_chain(tag):  # type: ignore[no-untyped-def]
    return ra_after(ra_task(tag))


@workflow(name="ra_outer")
def ra_outer(tag):  # type: ignore[no-untyped-def]
    return ra_after(child(ra_inner_chain, tag))


@workflow(name="ra_cond")
def ra_cond(key):  # type: ignore[no-untyped-def]
    v = ra_value(key)
    big = ra_task("big", when=v.gt(5)).named("big")
    small = ra_task("small", otherwise=big).named("small")
    return ra_join(big, small)


@workflow(name="ra_cond_gate")
def ra_cond_gate(key):  # type: ignore[no-untyped-def]
    """The condition's input comes after a step that fails first."""
    first = ra_task("first").named("first")
    v = ra_value(key, after=[first])
    big = ra_task("big", when=v.gt(5)).named("big")
    small = ra_task("small", otherwise=big).named("small")
    return ra_join(big, small)


@workflow(name="ra_contained")
def ra_contained(tag):  # type: ignore[no-untyped-def]
    bad = ra_task("bad").named("bad")
    ra_after(bad, on_dep_failure="cancel_branch").named("branch")
    return ra_task("main").named("main")


@workflow(name="ra_sig")
def ra_sig(tag):  # type: ignore[no-untyped-def]
    return ra_after(wait_signal("ra_go", timeout=timedelta(hours=1)))


@workflow(name="ra_any")
def ra_any(tag):  # type: ignore[no-untyped-def]
    return ra_after(wait_any(["ra_yes", "ra_no"], timeout=timedelta(hours=1)))


@workflow(name="ra_quorum")
def ra_quorum(tag):  # type: ignore[no-untyped-def]
    return ra_after(wait_n("ra_vote", 2, timeout=timedelta(hours=1)))


@workflow(name="ra_timeout")
def ra_timeout(tag):  # type: ignore[no-untyped-def]
    return ra_after(ra_slow(tag))


@workflow(name="ra_budget_wf")
def ra_budget_wf(tag):  # type: ignore[no-untyped-def]
    return ra_budget(tag)


@workflow(name="ra_stale_wf")
def ra_stale_wf(tag):  # type: ignore[no-untyped-def]
    stale = ra_stale("s").named("stale")
    bad = ra_task("bad", after=[wait_signal("ra_fail_now")]).named("bad")
    return ra_join(stale, bad)


@workflow(name="ra_chain")
def ra_chain(key):  # type: ignore[no-untyped-def]
    return ra_double(ra_value(key))


@workflow(name="ra_replay_fan")
def ra_replay_fan(key):  # type: ignore[no-untyped-def]
    return ra_total(for_each(ra_item, over=ra_items(ra_value(key)), max_parallel=2))


HANDLERS = [
    ra_items,
    ra_item,
    ra_total,
    ra_task,
    ra_after,
    ra_join,
    ra_value,
    ra_double,
    ra_budget,
    ra_slow,
    ra_stale,
]
WORKFLOWS = [ra_inner, ra_inner_chain]


# -- fan-out ---------------------------------------------------------------------------


def test_fan_out_item_retry_keeps_completed_items_and_recomputes_the_total(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("item-4")
    start_worker(*HANDLERS, concurrency=1)
    handle = client.submit(ra_fan, 8)
    run = settled(client, handle.id)
    assert run.state is RunState.FAILED
    assert run.step("ra_item[4]").state is StepState.DISCARDED
    done_before = {
        s.item_index for s in run.steps if s.item_of == "ra_item" and s.state is StepState.COMPLETED
    }
    assert done_before  # max_parallel=2 and one slot: items 0..3 ran before item 4
    FAILING.clear()
    client.retry(handle.id, "ra_item[4]")
    assert handle.result(timeout=15) == sum(x * 10 for x in range(8))
    for i in done_before:
        assert CALLS[f"item-{i}"] == 1, f"completed item {i} ran again"
    assert CALLS["item-4"] == 2
    assert CALLS["total"] == 1
    run = client.get_run(handle.id)
    assert {s.state for s in run.steps} == {StepState.COMPLETED}


def test_fan_out_of_child_runs_retries_the_failed_child_in_place(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("item-3")
    start_worker(*HANDLERS, *WORKFLOWS, ra_child_fan, concurrency=2)
    handle = client.submit(ra_child_fan, 6)
    run = settled(client, handle.id)
    assert run.state is RunState.FAILED
    children_before = {r.id: r.state for r in client.list_runs(workflow="ra_inner")}
    failed_children = [i for i, s in children_before.items() if s is RunState.FAILED]
    assert len(failed_children) == 1
    FAILING.clear()
    client.retry(handle.id, "ra_inner[3]")
    assert handle.result(timeout=15) == sum(x * 10 for x in range(6))
    after = {r.id: r.state for r in client.list_runs(workflow="ra_inner")}
    assert len(after) == 6  # one child run per item: the failed one was reopened
    assert set(children_before) <= set(after)
    assert set(after.values()) == {RunState.COMPLETED}
    assert CALLS["item-3"] == 2


def test_child_run_failure_retried_through_the_parent_node(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("deep")
    start_worker(*HANDLERS, *WORKFLOWS, ra_outer)
    handle = client.submit(ra_outer, "deep")
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=15)
    assert failed.value.node == "ra_inner_chain"
    (child_run,) = client.list_runs(workflow="ra_inner_chain")
    with pytest.raises(InvalidTransition):
        client.retry(child_run.id, "ra_task")
    FAILING.clear()
    client.retry(handle.id, "ra_inner_chain")
    assert handle.result(timeout=15) == "after after deep"
    assert client.get_run(child_run.id).state is RunState.COMPLETED
    assert CALLS["deep"] == 2


# -- conditions ------------------------------------------------------------------------


def test_conditions_judged_after_a_retry_see_the_new_upstream_output(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("first")
    VALUES["k1"] = 9
    start_worker(*HANDLERS)
    handle = client.submit(ra_cond_gate, "k1")
    run = settled(client, handle.id)
    assert run.state is RunState.FAILED
    assert run.step("big").state is StepState.CANCELLED
    FAILING.clear()
    client.retry(handle.id, "first")
    assert handle.result(timeout=15) == ["big", None]
    run = client.get_run(handle.id)
    assert run.step("small").state is StepState.SKIPPED
    assert CALLS["small"] == 0


def test_a_failed_conditional_branch_retries_and_the_skipped_one_stays_skipped(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("big")
    VALUES["k2"] = 9
    start_worker(*HANDLERS)
    handle = client.submit(ra_cond, "k2")
    run = settled(client, handle.id)
    assert run.state is RunState.FAILED
    assert run.step("big").state is StepState.DISCARDED
    assert run.step("small").state is StepState.SKIPPED
    FAILING.clear()
    client.retry(handle.id, "big")
    assert handle.result(timeout=15) == ["big", None]
    assert client.get_run(handle.id).step("small").state is StepState.SKIPPED
    assert CALLS["small"] == 0 and CALLS["big"] == 2


def test_replay_judges_conditions_again(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    VALUES["k3"] = 9
    start_worker(*HANDLERS)
    handle = client.submit(ra_cond, "k3")
    assert handle.result(timeout=15) == ["big", None]
    VALUES["k3"] = 1
    client.retry(handle.id, "ra_value", force=True)
    assert handle.result(timeout=15) == [None, "small"]
    run = client.get_run(handle.id)
    assert run.step("big").state is StepState.SKIPPED
    assert run.step("small").state is StepState.COMPLETED


# -- contained failures -------------------------------------------------------------------


def test_contained_failure_retry_reopens_and_completes_the_run_again(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("bad")
    start_worker(*HANDLERS)
    handle = client.submit(ra_contained, "x")
    assert handle.result(timeout=15) == "main"
    first_finish = client.get_run(handle.id).finished_at
    FAILING.clear()
    client.retry(handle.id, "bad")
    assert client.get_run(handle.id).state in (RunState.RUNNING, RunState.COMPLETED)
    run = client.wait(handle.id, timeout=15)
    assert run.state is RunState.COMPLETED
    assert run.step("branch").output == "after bad"
    assert run.finished_at is not None and first_finish is not None
    assert run.finished_at >= first_finish
    assert CALLS["main"] == 1  # the completed node did not run again


# -- waits -----------------------------------------------------------------------------


def test_wait_any_timeout_retry_waits_again(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    start_worker(*HANDLERS)
    handle = client.submit(ra_any, "x")
    time_out(clock, client, handle.id, "any_ra_yes_ra_no")
    run = settled(client, handle.id)
    assert run.state is RunState.FAILED
    assert run.step("any_ra_yes_ra_no").error_kind == "signal_timeout"
    with pytest.raises(AlreadyTerminal):
        client.signal(handle.id, "ra_yes", 1)
    client.retry(handle.id, "any_ra_yes_ra_no")
    assert client.get_run(handle.id).step("any_ra_yes_ra_no").state is StepState.WAITING_SIGNAL
    client.signal(handle.id, "ra_no", 2)
    assert handle.result(timeout=15) == "after {'name': 'ra_no', 'payload': 2}"


def test_wait_n_quorum_starts_again_after_a_retry(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    start_worker(*HANDLERS)
    handle = client.submit(ra_quorum, "x")
    wait_until(
        lambda: client.get_run(handle.id).step("ra_vote").state is StepState.WAITING_SIGNAL,
        what="the quorum to wait",
    )
    client.signal(handle.id, "ra_vote", "old")
    time_out(clock, client, handle.id, "ra_vote")
    run = settled(client, handle.id)
    assert run.state is RunState.FAILED
    assert run.step("ra_vote").error_kind == "signal_timeout"
    client.retry(handle.id, "ra_vote")
    client.signal(handle.id, "ra_vote", "new1")
    time.sleep(0.2)
    assert client.get_run(handle.id).step("ra_vote").state is StepState.WAITING_SIGNAL
    client.signal(handle.id, "ra_vote", "new2")
    assert handle.result(timeout=15) == "after ['new1', 'new2']"


def test_signal_timeout_retry_then_a_second_timeout_fails_again(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    start_worker(*HANDLERS)
    handle = client.submit(ra_sig, "x")
    time_out(clock, client, handle.id, "ra_go")
    assert settled(client, handle.id).state is RunState.FAILED
    client.retry(handle.id, "ra_go")
    time_out(clock, client, handle.id, "ra_go")
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=15)
    assert failed.value.node == "ra_go"
    assert failed.value.error_kind == "signal_timeout"
    client.retry(handle.id, "ra_go")
    client.signal(handle.id, "ra_go", "late")
    assert handle.result(timeout=15) == "after late"


# -- timeouts, attempts and fencing ---------------------------------------------------------


def test_step_timeout_retry_runs_the_step_again(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("slow")
    start_worker(*HANDLERS, concurrency=2)
    handle = client.submit(ra_timeout, "slow")
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=15)
    slow_release.set()  # the timed-out handler returns: too late, it is not kept
    assert failed.value.error_kind == "timeout"
    FAILING.clear()
    client.retry(handle.id, "ra_slow")
    assert handle.result(timeout=15) == "after slow in time"


def test_retry_gives_a_fresh_attempt_budget_and_attempt_numbers(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("b")
    start_worker(*HANDLERS)
    handle = client.submit(ra_budget_wf, "b")
    with pytest.raises(RunFailed):
        handle.result(timeout=15)
    step_before = client.get_run(handle.id).step("ra_budget")
    assert step_before.attempt == 2 and step_before.state is StepState.DISCARDED
    assert SEEN_ATTEMPTS["b"] == [1, 2]
    client.retry(handle.id, "ra_budget")
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=15)
    assert "attempt 2" in str(failed.value.error)
    assert SEEN_ATTEMPTS["b"] == [1, 2, 1, 2]
    FAILING.clear()
    client.retry(handle.id, "ra_budget")
    assert handle.result(timeout=15) == "b ok on attempt 1"
    s = client.get_run(handle.id).step("ra_budget")
    assert s.attempt == 0 and s.error is None
    assert len(s.attempts) == 4


def test_a_late_completion_of_the_cancelled_attempt_is_fenced_after_a_retry(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    gate.clear()
    FAILING.add("bad")
    start_worker(*HANDLERS, concurrency=4)
    handle = client.submit(ra_stale_wf, "x")
    wait_until(lambda: CALLS["s"] == 1, what="the first execution of 'stale' to start")
    client.signal(handle.id, "ra_fail_now", None)
    run = settled(client, handle.id)
    assert run.state is RunState.FAILED
    assert run.step("stale").state is StepState.CANCELLED
    FAILING.clear()
    client.retry(handle.id, "bad")
    wait_until(lambda: CALLS["s"] == 2, what="the retried 'stale' to run")
    gate.set()  # the first execution now returns "stale": it must be dropped
    assert handle.result(timeout=15) == ["fresh", "bad"]


def test_two_concurrent_retries_take_effect_once(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("deep")
    start_worker(*HANDLERS, *WORKFLOWS, ra_outer)
    handle = client.submit(ra_outer, "deep")
    assert settled(client, handle.id).state is RunState.FAILED
    FAILING.clear()
    outcomes: list[str] = []
    barrier = threading.Barrier(2)

    def attempt() -> None:
        with Client(cyclone_dsn) as own:
            barrier.wait()
            try:
                own.retry(handle.id, "ra_inner_chain")
                outcomes.append("ok")
            except InvalidTransition:
                outcomes.append("refused")

    threads = [threading.Thread(target=attempt) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert sorted(outcomes) == ["ok", "refused"]
    assert handle.result(timeout=15) == "after after deep"
    assert CALLS["deep"] == 2


# -- cancelled runs, replays, results -------------------------------------------------------


def test_retry_of_a_cancelled_fan_out_run(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    handle = client.submit(ra_fan, 5)
    client.cancel(handle.id)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=5)
    assert failed.value.state == "cancelled"
    client.retry(handle.id, "ra_items")
    start_worker(*HANDLERS)
    assert handle.result(timeout=15) == sum(x * 10 for x in range(5))


def test_replay_recomputes_the_completed_downstream(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    VALUES["c"] = 3
    start_worker(*HANDLERS)
    handle = client.submit(ra_chain, "c")
    assert handle.result(timeout=15) == 6
    VALUES["c"] = 5
    client.retry(handle.id, "ra_value", force=True)
    assert handle.result(timeout=15) == 10
    assert CALLS["double"] == 2


def test_replay_of_a_fan_out_source_expands_again(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    VALUES["f"] = 4
    start_worker(*HANDLERS)
    handle = client.submit(ra_replay_fan, "f")
    assert handle.result(timeout=15) == 60
    VALUES["f"] = 2
    client.retry(handle.id, "ra_value", force=True)
    assert handle.result(timeout=15) == 10
    items = [s for s in client.get_run(handle.id).steps if s.item_of == "ra_item"]
    assert len(items) == 2


def test_run_failed_details_name_the_new_failure_after_a_retry(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("first")
    VALUES["k4"] = 9
    start_worker(*HANDLERS)
    handle = client.submit(ra_cond_gate, "k4")
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=15)
    assert failed.value.node == "first"
    FAILING.clear()
    FAILING.add("big")
    client.retry(handle.id, "first")
    with pytest.raises(RunFailed) as again:
        handle.result(timeout=15)
    assert again.value.node == "big"
    assert again.value.error is not None and "big is set to fail" in again.value.error


# -- async client, bulk and CLI ------------------------------------------------------------


def test_async_client_retry_and_retry_many(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("deep")
    start_worker(*HANDLERS, *WORKFLOWS, ra_outer)
    one = client.submit(ra_outer, "deep")
    two = client.submit(ra_outer, "deep")
    settled(client, one.id)
    settled(client, two.id)
    FAILING.clear()

    async def go() -> tuple[object, int]:
        async with AsyncClient(cyclone_dsn) as aclient:
            await aclient.retry(one.id, "ra_inner_chain")
            with pytest.raises(InvalidTransition):
                await aclient.retry(one.id, "ra_inner_chain")
            bulk = await aclient.retry_many(RunFilter(workflows="ra_outer"))
            return await aclient.result(one.id, timeout=15), bulk.acted

    result, acted = asyncio.run(go())
    assert result == "after after deep"
    assert acted == 1  # only `two` was still failed (`one` was already retried)
    assert two.result(timeout=15) == "after after deep"


def test_cli_retry(cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]) -> None:
    FAILING.add("bad")
    start_worker(*HANDLERS)
    handle = client.submit(ra_budget_wf, "bad")
    settled(client, handle.id)
    FAILING.clear()
    result = CliRunner().invoke(
        cli, ["--dsn", cyclone_dsn, "retry", str(handle.id), "ra_budget", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert handle.result(timeout=15) == "bad ok on attempt 1"


# -- batch 2 ---------------------------------------------------------------------------


@workflow(name="ra_mid")
def ra_mid(tag):  # type: ignore[no-untyped-def]
    return ra_after(child(ra_inner_chain, tag))


@workflow(name="ra_top")
def ra_top(tag):  # type: ignore[no-untyped-def]
    return ra_after(child(ra_mid, tag))


def test_grandchild_failure_retried_from_the_top(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("gc")
    start_worker(*HANDLERS, *WORKFLOWS, ra_mid, ra_top)
    handle = client.submit(ra_top, "gc")
    assert settled(client, handle.id).state is RunState.FAILED
    (mid,) = client.list_runs(workflow="ra_mid")
    (inner,) = client.list_runs(workflow="ra_inner_chain")
    assert mid.state is RunState.FAILED and inner.state is RunState.FAILED
    FAILING.clear()
    client.retry(handle.id, "ra_mid")
    assert handle.result(timeout=15) == "after after after gc"
    assert client.get_run(mid.id).state is RunState.COMPLETED
    assert client.get_run(inner.id).state is RunState.COMPLETED
    assert len(client.list_runs(workflow="ra_inner_chain")) == 1


@workflow(name="ra_inner_wait")
def ra_inner_wait(tag):  # type: ignore[no-untyped-def]
    return ra_task(tag, after=[wait_signal("ra_inner_go")])


@workflow(name="ra_child_fan_wait")
def ra_child_fan_wait(tags):  # type: ignore[no-untyped-def]
    return for_each(ra_inner_wait, over=tags, max_parallel=2)


def test_child_fan_out_with_cancelled_children_runs_them_again(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("cf-bad")
    start_worker(*HANDLERS, ra_inner_wait, ra_child_fan_wait)
    handle = client.submit(ra_child_fan_wait, ["cf-a", "cf-bad", "cf-b", "cf-c"])
    wait_until(
        lambda: len(client.list_runs(workflow="ra_inner_wait")) == 2,
        what="two child runs to start",
    )
    kids = {r.input: r.id for r in client.list_runs(workflow="ra_inner_wait")}
    client.signal(kids["cf-bad"], "ra_inner_go", None)
    run = settled(client, handle.id)
    assert run.state is RunState.FAILED
    assert client.get_run(kids["cf-a"]).state is RunState.CANCELLED
    FAILING.clear()
    client.retry(handle.id, "ra_inner_wait")
    # cf-a is reopened; cf-bad (failed) is retried in place: its wait already completed.
    wait_until(
        lambda: client.get_run(kids["cf-a"]).state is RunState.RUNNING,
        what="the cancelled child run to reopen",
    )
    for _ in range(40):
        for r in client.list_runs(workflow="ra_inner_wait"):
            if r.state is RunState.RUNNING:
                s = client.get_run(r.id).step("ra_inner_go")
                if s.state is StepState.WAITING_SIGNAL:
                    client.signal(r.id, "ra_inner_go", None)
        if client.get_run(handle.id).state.is_terminal:
            break
        time.sleep(0.1)
    assert handle.result(timeout=5) == ["cf-a", "cf-bad", "cf-b", "cf-c"]
    assert len(client.list_runs(workflow="ra_inner_wait")) == 4


@workflow(name="ra_cut_result")
def ra_cut_result(tag):  # type: ignore[no-untyped-def]
    bad = ra_task("cut-bad").named("bad")
    main = ra_task("cut-main").named("main")
    return ra_join(bad, main, on_dep_failure="cancel_branch").named("joined")


def test_a_result_cut_off_by_a_contained_failure_is_computed_after_a_retry(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("cut-bad")
    start_worker(*HANDLERS)
    handle = client.submit(ra_cut_result, "x")
    with pytest.raises(NoOutput):
        handle.result(timeout=15)
    FAILING.clear()
    client.retry(handle.id, "bad")
    assert handle.result(timeout=15) == ["cut-bad", "cut-main"]
    assert CALLS["cut-main"] == 1


@workflow(name="ra_buffered")
def ra_buffered(tag):  # type: ignore[no-untyped-def]
    first = ra_task("buf-first").named("first")
    return ra_after(wait_signal("ra_buf", after=[first]))


def test_a_signal_buffered_before_the_failure_is_consumed_after_the_retry(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("buf-first")
    handle = client.submit(ra_buffered, "x")
    client.signal(handle.id, "ra_buf", "early")  # buffered: the wait has not started
    start_worker(*HANDLERS)
    assert settled(client, handle.id).state is RunState.FAILED
    FAILING.clear()
    client.retry(handle.id, "first")
    assert handle.result(timeout=15) == "after early"


@workflow(name="ra_contained_wait")
def ra_contained_wait(tag):  # type: ignore[no-untyped-def]
    w = wait_signal("ra_cw", timeout=timedelta(hours=1))
    ra_after(w, on_dep_failure="cancel_branch").named("branch")
    return ra_task("cw-main").named("main")


def test_a_contained_signal_timeout_waits_again_after_a_retry(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    start_worker(*HANDLERS)
    handle = client.submit(ra_contained_wait, "x")
    wait_until(
        lambda: client.get_run(handle.id).step("main").state is StepState.COMPLETED,
        what="the main branch (before the clock moves: no lease of it expires by the move)",
    )
    time_out(clock, client, handle.id, "ra_cw")
    run = settled(client, handle.id)
    assert run.state is RunState.COMPLETED
    assert run.step("ra_cw").error_kind == "signal_timeout"
    client.retry(handle.id, "ra_cw")
    assert client.get_run(handle.id).state is RunState.RUNNING
    assert client.signal(handle.id, "ra_cw", "v").name == "CONSUMED"
    run = client.wait(handle.id, timeout=15)
    assert run.state is RunState.COMPLETED
    assert run.step("branch").output == "after v"


@workflow(name="ra_fan_contained")
def ra_fan_contained(n):  # type: ignore[no-untyped-def]
    lines = for_each(ra_item, over=ra_items(n), max_parallel=2)
    ra_total(lines, on_dep_failure="cancel_branch").named("sum")
    return ra_after(wait_signal("ra_fc_end"))


def test_retrying_a_contained_fan_out_item_in_an_open_run(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("item-2")
    start_worker(*HANDLERS, concurrency=1)
    handle = client.submit(ra_fan_contained, 6)
    wait_until(
        lambda: client.get_run(handle.id).step("sum").state is StepState.CANCELLED,
        what="the failed fan-out to cancel its branch",
    )
    FAILING.clear()
    client.retry(handle.id, "ra_item[2]")
    wait_until(
        lambda: client.get_run(handle.id).step("sum").state is StepState.COMPLETED,
        what="the retried fan-out's branch to complete",
    )
    client.signal(handle.id, "ra_fc_end", 1)
    run = client.wait(handle.id, timeout=15)
    assert run.state is RunState.COMPLETED
    assert run.step("sum").output == sum(x * 10 for x in range(6))


def test_retry_many_of_a_parent_and_its_failed_child_run(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("rm")
    start_worker(*HANDLERS, *WORKFLOWS, ra_outer)
    handle = client.submit(ra_outer, "rm")
    assert settled(client, handle.id).state is RunState.FAILED
    (kid,) = client.list_runs(workflow="ra_inner_chain")
    FAILING.clear()
    result = client.retry_many(RunFilter(workflows=["ra_outer", "ra_inner_chain"]))
    assert result.acted == 1
    assert handle.result(timeout=15) == "after after rm"
    assert client.get_run(kid.id).state is RunState.COMPLETED
    assert CALLS["rm"] == 2


def test_replay_of_a_completed_node_upstream_of_the_failure(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    VALUES["rp"] = 2
    start_worker(*HANDLERS)
    handle = client.submit(ra_replay_fan, "rp")
    assert handle.result(timeout=15) == 10
    FAILING.add("item-1")
    VALUES["rp"] = 3
    client.retry(handle.id, "ra_value", force=True)
    with pytest.raises(RunFailed):
        handle.result(timeout=15)
    FAILING.clear()
    client.retry(handle.id, "ra_value", force=True)
    assert handle.result(timeout=15) == 30
    value = client.get_run(handle.id).step("ra_value")
    assert [a.outcome for a in value.attempts].count("replayed") == 2


def test_timeout_with_attempts_left_then_operator_retry(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("t2")
    start_worker(*HANDLERS, concurrency=4)
    handle = client.submit(ra_timeout, "t2")
    with pytest.raises(RunFailed):
        handle.result(timeout=15)
    slow_release.set()  # the timed-out handler returns: too late, it is not kept
    s = client.get_run(handle.id).step("ra_slow")
    assert s.error_kind == "timeout" and s.attempt == 1
    FAILING.clear()
    client.retry(handle.id, "ra_slow")
    assert handle.result(timeout=15) == "after t2 in time"
    s = client.get_run(handle.id).step("ra_slow")
    assert s.attempt == 0 and s.error_kind is None
    assert [a.error_kind for a in s.attempts] == ["timeout"]


def test_cli_retry_force_replays(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    VALUES["cli"] = 1
    start_worker(*HANDLERS)
    handle = client.submit(ra_chain, "cli")
    assert handle.result(timeout=15) == 2
    VALUES["cli"] = 7
    result = CliRunner().invoke(
        cli, ["--dsn", cyclone_dsn, "retry", str(handle.id), "ra_value", "--force", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert handle.result(timeout=15) == 14


# -- batch 3 ---------------------------------------------------------------------------


@step(name="ra_block_item")
def ra_block_item(x: int) -> int:
    _count("block-item")
    gate.wait(10)
    return x * 10


@workflow(name="ra_replay_block")
def ra_replay_block(key):  # type: ignore[no-untyped-def]
    return ra_total(for_each(ra_block_item, over=ra_items(ra_value(key)), max_parallel=2))


def test_replay_is_refused_while_a_fan_out_of_the_replayed_part_has_items_running(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    gate.clear()
    VALUES["rb"] = 3
    start_worker(*HANDLERS, ra_block_item, concurrency=4)
    handle = client.submit(ra_replay_block, "rb")
    wait_until(lambda: CALLS["block-item"] == 2, what="two items to be running")
    before = client.get_run(handle.id)
    try:
        with pytest.raises(InvalidTransition, match="under way"):
            client.retry(handle.id, "ra_value", force=True)
        after = client.get_run(handle.id)
        assert [(s.node, s.state) for s in after.steps] == [(s.node, s.state) for s in before.steps]
    finally:
        gate.set()
    assert handle.result(timeout=15) == 30
    assert CALLS["block-item"] == 3  # each item ran once


@workflow(name="ra_pausable")
def ra_pausable(tag):  # type: ignore[no-untyped-def]
    blocked = ra_stale("p").named("blocked")
    return ra_after(ra_after(blocked))


def test_a_run_that_failed_while_paused_runs_again_after_a_retry(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    gate.clear()
    start_worker(*HANDLERS)
    handle = client.submit(ra_pausable, "x")
    wait_until(lambda: CALLS["p"] == 1, what="the blocking step to start")
    client.pause(handle.id)
    client.cancel(handle.id)
    gate.set()
    run = settled(client, handle.id)
    assert run.state is RunState.CANCELLED
    client.retry(handle.id, "blocked")
    assert client.get_run(handle.id).paused_at is None
    assert handle.result(timeout=15) == "after after fresh"


def test_two_contained_failures_retried_concurrently_both_take_effect(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    FAILING.update({"a1", "a2"})
    start_worker(*HANDLERS)
    handle = client.submit(ra_two_branches, "x")
    run = settled(client, handle.id)
    assert run.state is RunState.COMPLETED
    FAILING.clear()
    barrier = threading.Barrier(2)
    errors: list[InvalidTransition] = []

    def retry(node: str) -> None:
        with Client(cyclone_dsn) as own:
            barrier.wait()
            try:
                own.retry(handle.id, node)
            except InvalidTransition as exc:
                errors.append(exc)

    threads = [threading.Thread(target=retry, args=(n,)) for n in ("a1", "a2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert errors == []
    wait_until(
        lambda: client.get_run(handle.id).step("both").state is StepState.COMPLETED,
        what="the join of both branches",
    )
    run = client.wait(handle.id, timeout=15)
    assert run.state is RunState.COMPLETED
    assert run.step("both").output == ["a1", "a2"]


@workflow(name="ra_two_branches")
def ra_two_branches(tag):  # type: ignore[no-untyped-def]
    a1 = ra_task("a1").named("a1")
    a2 = ra_task("a2").named("a2")
    ra_join(a1, a2, on_dep_failure="cancel_branch").named("both")
    return ra_task("tb-main").named("main")


@step(name="ra_conc_task", max_attempts=1)
def ra_conc_task(tag: str) -> str:
    _count(tag)
    _fail_if(tag)
    return tag


@workflow(name="ra_conc", concurrency=Concurrency(limit=1))
def ra_conc(tag):  # type: ignore[no-untyped-def]
    done = ra_conc_task(tag)
    return ra_after(done, after=[wait_signal("ra_conc_go")])


def test_a_retried_run_waits_for_its_workflow_concurrency_slot(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    FAILING.add("conc-a")
    start_worker(*HANDLERS, ra_conc_task)
    a = client.submit(ra_conc, "conc-a")
    client.signal(a.id, "ra_conc_go", None)
    assert settled(client, a.id).state is RunState.FAILED
    b = client.submit(ra_conc, "conc-b")
    wait_until(lambda: CALLS["conc-b"] == 1, what="run b to start (it holds the slot)")
    FAILING.clear()
    client.retry(a.id, "ra_conc_task")
    time.sleep(0.8)
    assert CALLS["conc-a"] == 1, "the retried run started while run b held the only slot"
    client.signal(b.id, "ra_conc_go", None)
    assert b.result(timeout=15) == "after conc-b"
    assert a.result(timeout=15) == "after conc-a"


def test_retry_many_by_error_kind(
    client: Client, start_worker: Callable[..., Worker], clock: Callable[[datetime], None]
) -> None:
    FAILING.add("ek")
    start_worker(*HANDLERS)
    waits = client.submit(ra_sig, "x")
    fails = client.submit(ra_budget_wf, "ek")
    settled(client, fails.id)  # before the clock moves: no lease of it expires by the move
    time_out(clock, client, waits.id, "ra_go")
    settled(client, waits.id)
    result = client.retry_many(
        RunFilter(error_kinds="signal_timeout", workflows=["ra_sig", "ra_budget_wf"])
    )
    assert (result.matched, result.acted) == (1, 1)
    assert client.get_run(waits.id).state is RunState.RUNNING
    assert client.get_run(fails.id).state is RunState.FAILED
    client.signal(waits.id, "ra_go", "v")
    assert waits.result(timeout=15) == "after v"


# -- the worker's bookkeeping when a retried step comes back to the same worker -------------

first_release = threading.Event()
second_release = threading.Event()


@step(name="ra_deaf", max_attempts=1)
def ra_deaf(tag: str) -> str:
    """Ignores cancellation: the first execution runs on after its run was cancelled."""
    _count("deaf")
    (first_release if CALLS["deaf"] == 1 else second_release).wait(10)
    return f"deaf {tag}"


@workflow(name="ra_deaf_wf")
def ra_deaf_wf(tag):  # type: ignore[no-untyped-def]
    return ra_deaf(tag)


def test_a_retried_step_claimed_by_the_same_worker_keeps_its_slot_when_the_old_handler_returns(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    """The worker keeps its handlers by step id: the old execution's return must not free
    the slot (nor stop the heartbeats) of the new execution of the same step."""
    first_release.clear()
    second_release.clear()
    worker = start_worker(ra_deaf, concurrency=2)
    handle = client.submit(ra_deaf_wf, "x")
    try:
        wait_until(lambda: CALLS["deaf"] == 1, what="the first execution to start")
        client.cancel(handle.id)
        client.retry(handle.id, "ra_deaf")
        wait_until(lambda: CALLS["deaf"] == 2, what="the retried step to start on this worker")
        assert worker.slots_in_use == 2
        first_release.set()  # the old, cancelled execution returns
        wait_until(lambda: worker.slots_in_use < 2, what="the old execution's slot to be freed")
        time.sleep(0.2)
        assert worker.slots_in_use == 1, "the new execution's slot was freed with the old one"
    finally:
        first_release.set()
        second_release.set()
    assert handle.result(timeout=10) == "deaf x"
    assert worker.slots_in_use == 0
