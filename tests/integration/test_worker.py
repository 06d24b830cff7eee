"""Worker behaviour: timeouts, bad outputs, async handlers, context, shutdown, fencing."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import psycopg
import pytest

from cyclone_dsl import (
    AsyncClient,
    Client,
    RunFailed,
    StepContext,
    Worker,
    step,
    wait_signal,
    workflow,
)
from cyclone_dsl.db.connect import make_pool
from cyclone_dsl.db.tx import in_transaction
from cyclone_dsl.dsl.runs import child_compiler
from cyclone_dsl.engine import Engine, Success, complete
from cyclone_dsl.states import RunState, StepState
from tests.waiting import wait_until

gate = threading.Event()
contexts: list[StepContext] = []

#: What a claim in this test serves: standalone runs of wk_async.
STANDALONE = [("wk_async", "standalone")]


@step(name="wk_sleepy", timeout=timedelta(seconds=0.3), max_attempts=1)
def sleepy(x: int) -> int:
    time.sleep(1.5)
    return x


@step(name="wk_bad_output", max_attempts=3)
def bad_output(x: int) -> object:
    return {1, 2, 3}


@step(name="wk_async")
async def doubled(x: int) -> int:
    await asyncio.sleep(0.01)
    return x * 2


@step(name="wk_async_slow", timeout=0.2, max_attempts=1)
async def async_slow(x: int) -> int:
    await asyncio.sleep(5)
    return x


@step(name="wk_blocked")
def blocked(x: int, *, ctx: StepContext) -> int:
    contexts.append(ctx)
    gate.wait(20)
    return x + 1


@workflow(name="wk_timeout")
def timing_out(x):  # type: ignore[no-untyped-def]
    return sleepy(x)


@workflow(name="wk_async_wf")
def async_wf(x):  # type: ignore[no-untyped-def]
    return doubled(doubled(x))


def test_a_step_past_its_timeout_fails_with_kind_timeout(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(sleepy)
    handle = client.submit(timing_out, 1)
    with pytest.raises(RunFailed) as failed:
        handle.result(timeout=10)
    assert failed.value.error_kind == "timeout"
    assert handle.get().step("wk_sleepy").state is StepState.DISCARDED


def test_an_output_that_is_not_json_fails_at_once(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(bad_output)
    handle = client.enqueue(bad_output, 1)
    with pytest.raises(RunFailed):
        handle.result(timeout=10)
    row = handle.get().step("wk_bad_output")
    assert row.error_kind == "invalid_output"
    assert row.attempt == 1  # not retried
    assert "set is not JSON" in (row.error or "")


def test_async_handlers_and_the_async_client(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    start_worker(doubled, async_slow)

    async def scenario() -> tuple[object, str | None]:
        async with AsyncClient(cyclone_dsn) as aclient:
            handle = await aclient.submit(async_wf, 5)
            result = await handle.result(timeout=10)
            slow = await aclient.enqueue(async_slow, 1)
            run = await slow.wait(timeout=10)
            return result, run.step("wk_async_slow").error_kind

    result, kind = asyncio.run(scenario())
    assert result == 20
    assert kind == "timeout"


def test_graceful_stop_releases_leases_without_spending_an_attempt(
    client: Client, cyclone_dsn: str
) -> None:
    gate.clear()
    contexts.clear()
    first = Worker(cyclone_dsn, [blocked], grace=0.3, poll_interval=0.1).start()
    handle = client.enqueue(blocked, 1)
    wait_until(lambda: contexts, what="the handler to start")
    assert contexts[0].idempotency_key == f"{handle.id}:wk_blocked"
    first.stop()
    assert contexts[0].cancelled
    row = handle.get().step("wk_blocked")
    assert row.state is StepState.AVAILABLE
    assert row.attempt == 0
    gate.set()
    with Worker(cyclone_dsn, [blocked], poll_interval=0.1):
        assert handle.result(timeout=10) == 2


def test_a_stale_completion_is_fenced_after_a_reclaim(client: Client, cyclone_dsn: str) -> None:
    handle = client.enqueue(doubled, 3)
    pool = make_pool(cyclone_dsn, name="test-fencing")
    engine = Engine(compile_child=child_compiler(client.registry))
    lease = timedelta(seconds=30)
    try:
        (first,) = in_transaction(
            pool,
            lambda tx: engine.claim(
                tx,
                owner="a",
                queues=["default"],
                kinds=["wk_async"],
                versions=STANDALONE,
                limit=5,
                lease=lease,
            ),
        )
        later = timedelta(minutes=5)  # the database clock moves past the lease
        reclaimed, _ = in_transaction(
            pool,
            lambda tx: engine.reclaim_expired_leases(
                tx, after_id=0, limit=10, max_reclaims={}, default_max_reclaims=3
            ),
            shift=later,
        )
        assert reclaimed == 1
        (second,) = in_transaction(
            pool,
            lambda tx: engine.claim(
                tx,
                owner="b",
                queues=["default"],
                kinds=["wk_async"],
                versions=STANDALONE,
                limit=5,
                lease=lease,
            ),
            shift=later,
        )
        assert second.generation == first.generation + 1
        stale = in_transaction(
            pool,
            lambda tx: engine.complete(tx, [Success(first.id, first.generation, "1")]),
        )
        assert stale == set()
        assert handle.get().step("wk_async").state is StepState.RUNNING
        fresh = in_transaction(
            pool,
            lambda tx: engine.complete(tx, [Success(second.id, second.generation, "6")]),
        )
        assert fresh == {second.id}
        run = handle.wait(timeout=5)
        assert run.state is RunState.COMPLETED
        assert run.step("wk_async").output == 6
        assert run.step("wk_async").reclaims == 1
    finally:
        pool.close()


def test_reclaim_limit_discards_the_step(client: Client, cyclone_dsn: str) -> None:
    handle = client.enqueue(doubled, 3)
    pool = make_pool(cyclone_dsn, name="test-reclaim-limit")
    engine = Engine(compile_child=child_compiler(client.registry))
    try:
        for round_ in range(3):
            shift = timedelta(minutes=10 * (round_ + 1))
            in_transaction(
                pool,
                lambda tx: engine.claim(
                    tx,
                    owner="crashy",
                    queues=["default"],
                    kinds=["wk_async"],
                    versions=STANDALONE,
                    limit=1,
                    lease=timedelta(seconds=1),
                ),
                shift=shift,
            )
            in_transaction(
                pool,
                lambda tx: engine.reclaim_expired_leases(
                    tx,
                    after_id=0,
                    limit=10,
                    max_reclaims={"wk_async": 2},
                    default_max_reclaims=5,
                ),
                shift=shift + timedelta(seconds=5),
            )
        run = handle.wait(timeout=5)
        assert run.state is RunState.FAILED
        row = run.step("wk_async")
        assert row.state is StepState.DISCARDED
        assert row.error_kind == "reclaim_limit"
        assert row.reclaims == 3
    finally:
        pool.close()


@step(name="wk_maybe_poison")
def maybe_poison(x: str) -> str:
    time.sleep(0.05)  # let outcomes of several steps land in one completion batch
    return x


def test_an_outcome_the_database_refuses_fails_only_its_own_step(
    client: Client, start_worker: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_complete = complete.complete

    def refusing(tx, results, hooks, **options):  # type: ignore[no-untyped-def]
        if any(r.output == '"poison"' for r in results):
            raise psycopg.errors.DataError("simulated: the database refused this value")
        return real_complete(tx, results, hooks, **options)

    monkeypatch.setattr(complete, "complete", refusing)
    handles = client.enqueue_many(maybe_poison, ["ok-1", "poison", "ok-2", "ok-3"])
    start_worker(maybe_poison, concurrency=4)
    runs = [h.wait(timeout=20) for h in handles]
    states = [r.state for r in runs]
    assert states == [RunState.COMPLETED, RunState.FAILED, RunState.COMPLETED, RunState.COMPLETED]
    bad = runs[1].step("wk_maybe_poison")
    assert bad.error_kind == "invalid_output"
    assert "refused" in (bad.error or "")


def test_async_client_bulk_purge_and_handles(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    start_worker(doubled, async_slow)

    async def scenario() -> tuple[list[object], list[str], int, list[int]]:
        async with AsyncClient(cyclone_dsn) as aclient:
            runs = await aclient.submit_many(async_wf, [1, 2, 3])
            results = [await h.result(timeout=10) for h in runs]
            steps = await aclient.enqueue_many(doubled, [4, 5])
            states = [(await aclient.handle(h.id).wait(timeout=10)).state.value for h in steps]
            purged = await aclient.purge()
            left = [r.id for r in await aclient.list_runs()]
            return results, states, purged, left

    results, states, purged, left = asyncio.run(scenario())
    assert results == [4, 8, 12]
    assert states == ["completed", "completed"]
    assert purged == 5
    assert left == []


@workflow(name="wk_gated")
def gated(x):  # type: ignore[no-untyped-def]
    return doubled(x, after=[wait_signal("go")])


def test_async_submit_tx_exists_only_if_the_caller_commits(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    start_worker(doubled)

    async def scenario() -> tuple[list[int], object, object, int]:
        async with AsyncClient(cyclone_dsn) as aclient:
            async with await psycopg.AsyncConnection.connect(cyclone_dsn) as conn:
                await aclient.submit_tx(conn, async_wf, 1)
                await conn.rollback()
                after_rollback = [r.id for r in await aclient.list_runs()]
                committed = await aclient.submit_tx(conn, async_wf, 3)
                await conn.commit()
                waiting = await aclient.submit_tx(conn, gated, 1)  # its root is a wait
                await conn.commit()
            await aclient.signal(waiting.id, "go")
            result = await committed.result(timeout=10)
            gated_result = await waiting.result(timeout=10)
            return after_rollback, result, gated_result, len(await aclient.list_runs())

    after_rollback, result, gated_result, runs = asyncio.run(scenario())
    assert after_rollback == []
    assert result == 12
    assert gated_result == 2
    assert runs == 2
