"""Standalone work: enqueue, unique keys, sequence keys, submit_once, races."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from cyclone_dsl import Client, RunHandle, Worker, action, step, workflow
from cyclone_dsl.errors import InvalidArgument
from cyclone_dsl.states import RunState

order: list[tuple[str, int]] = []
order_lock = threading.Lock()


@step(name="sa_square")
def square(x: int) -> int:
    return x * x


@action(name="sa_record")
def record(item: dict[str, object]) -> None:
    time.sleep(0.01)
    with order_lock:
        order.append((str(item["key"]), int(str(item["n"]))))


@workflow(name="sa_once")
def once(x):  # type: ignore[no-untyped-def]
    return square(x)


def test_enqueue_runs_a_step_as_its_own_run(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(square)
    handle = client.enqueue(square, 12)
    assert handle.result(timeout=10) == 144
    run = handle.get()
    assert run.workflow == "sa_square"
    assert [s.node for s in run.steps] == ["sa_square"]


def test_enqueue_validates_options_and_writes_nothing(client: Client) -> None:
    with pytest.raises(InvalidArgument):
        client.enqueue(square, 1, queue="q" * 257)
    with pytest.raises(InvalidArgument):
        client.enqueue(square, 1, max_attempts=0)
    with pytest.raises(InvalidArgument):
        client.enqueue(square, float("nan"))
    with pytest.raises(InvalidArgument):
        client.enqueue(square, 1, scheduled_at=datetime(2030, 1, 1))
    assert client.list_runs() == []


def test_scheduled_enqueue_waits_for_its_time(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(square)
    later = client.enqueue(square, 3, scheduled_at=datetime.now(UTC) + timedelta(seconds=1.5))
    now = client.enqueue(square, 2)
    assert now.result(timeout=5) == 4
    assert later.get().state is RunState.RUNNING
    assert later.result(timeout=10) == 9


def race(dsn: str, call: Callable[[Client], RunHandle], racers: int = 8) -> list[RunHandle]:
    """Start ``racers`` clients together at a barrier; return what each call returned."""
    barrier = threading.Barrier(racers)
    results: list[RunHandle] = []

    def one() -> None:
        with Client(dsn, pool_size=1) as c:
            barrier.wait()
            results.append(call(c))

    threads = [threading.Thread(target=one) for _ in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_unique_key_under_eight_concurrent_enqueuers(cyclone_dsn: str) -> None:
    results = race(cyclone_dsn, lambda c: c.enqueue(square, 5, unique_key="only-one"))
    assert len(results) == 8
    assert len({h.id for h in results}) == 1
    assert sum(h.created for h in results) == 1


def test_unique_key_is_free_again_once_the_step_completed(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    first = client.enqueue(square, 2, unique_key="k")
    assert client.enqueue(square, 2, unique_key="k").id == first.id
    start_worker(square)
    first.wait(timeout=10)
    second = client.enqueue(square, 2, unique_key="k")
    assert second.created and second.id != first.id


def test_sequence_key_runs_fifo_one_at_a_time_under_four_workers(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    order.clear()
    handles = [
        client.enqueue(record, {"key": key, "n": n}, sequence_key=key)
        for n in range(8)
        for key in ("a", "b")
    ]
    for _ in range(4):
        start_worker(record, concurrency=4)
    for h in handles:
        h.wait(timeout=20)
    for key in ("a", "b"):
        assert [n for k, n in order if k == key] == list(range(8))


def test_submit_once_under_eight_concurrent_callers(cyclone_dsn: str) -> None:
    results = race(cyclone_dsn, lambda c: c.submit_once(once, 3, key="order-77"))
    assert len(results) == 8
    assert len({h.id for h in results}) == 1
    assert sum(h.created for h in results) == 1


def test_submit_once_returns_the_run_in_any_state(
    client: Client, start_worker: Callable[..., Worker]
) -> None:
    start_worker(square)
    first = client.submit_once(once, 4, key="k1")
    assert first.result(timeout=10) == 16
    again = client.submit_once(once, 5, key="k1")
    assert again.id == first.id and not again.created


def test_enqueue_many_and_submit_many(client: Client, start_worker: Callable[..., Worker]) -> None:
    start_worker(square)
    handles = client.enqueue_many(square, list(range(50)))
    assert len({h.id for h in handles}) == 50
    assert [h.result(timeout=20) for h in handles] == [i * i for i in range(50)]
    runs = client.submit_many(once, [1, 2, 3])
    assert [h.result(timeout=20) for h in runs] == [1, 4, 9]
    assert client.submit_many(once, []) == []
