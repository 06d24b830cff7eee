"""Every event follower of one client (``events()``, sync and async) shares the connection and
the thread of its waits, and each follower keeps its own cursor, deadline and error.

Before, each follower held a connection of its own: a web app streaming runs' events to
a thousand browsers held a thousand database sessions.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cyclone_dsl import AsyncClient, Client, RunNotFound, StepContext, Worker, step
from cyclone_dsl.client.handle import EVENTS_PAGE
from tests.waiting import wait_backends, wait_until, waits_in_flight

release = threading.Event()


@step(name="ew_emit")
def emit(n: int, ctx: StepContext) -> int:
    """Emits ``n`` events, waits for the test, then emits "last"."""
    for i in range(n):
        ctx.emit(i)
    release.wait(30)
    ctx.emit("last")
    return n


@step(name="ew_many")
def many(n: int, ctx: StepContext) -> int:
    for i in range(n):
        ctx.emit(i)
    return n


@pytest.fixture
def follower(cyclone_dsn: str) -> Iterator[Client]:
    with Client(cyclone_dsn) as client:
        yield client


@pytest.fixture(autouse=True)
def _released() -> Iterator[None]:
    release.clear()
    yield
    release.set()  # never leave a handler blocked


def test_a_hundred_followers_of_one_client_share_one_connection(
    cyclone_dsn: str, client: Client, follower: Client, start_worker: Callable[..., Worker]
) -> None:
    """60 threads following with a Client and 40 tasks with an AsyncClient: two connections
    (one per client) however many follow, and each follower gets every event once, in
    order, and ends when its run ends."""
    start_worker(emit, concurrency=4)
    runs = [client.enqueue(emit, 3).id for _ in range(4)]
    others = wait_backends(cyclone_dsn)
    seen: dict[int, list[Any]] = {}

    def sync_follow(n: int) -> None:
        seen[n] = [e.data for e in follower.events(runs[n % 4], timeout=60)]

    threads = [threading.Thread(target=sync_follow, args=(n,)) for n in range(60)]
    for thread in threads:
        thread.start()

    async def async_follow(aclient: AsyncClient, n: int) -> list[Any]:
        return [e.data async for e in aclient.events(runs[n % 4], timeout=60)]

    async def main() -> tuple[set[int], list[list[Any]]]:
        async with AsyncClient(cyclone_dsn) as aclient:
            task = asyncio.gather(*(async_follow(aclient, n) for n in range(40)))
            await asyncio.to_thread(
                wait_until,
                lambda: waits_in_flight(follower) == 60 and waits_in_flight(aclient._client) == 40,
                what="every follower to begin",
            )
            # The watcher connects as it reads: it may not have yet when the waits began.
            wait_until(
                lambda: len(wait_backends(cyclone_dsn) - others) >= 2, what="the connections"
            )
            opened = wait_backends(cyclone_dsn) - others
            release.set()
            return opened, list(await task)

    opened, async_seen = asyncio.run(main())
    for thread in threads:
        thread.join(60)
    assert len(opened) == 2, opened
    expected = [0, 1, 2, "last"]
    assert seen == dict.fromkeys(range(60), expected)
    assert async_seen == [expected] * 40


def test_followers_and_waits_of_one_client_keep_their_own_outcomes(
    client: Client, follower: Client, start_worker: Callable[..., Worker]
) -> None:
    """At once on one client: a follower of a run that does not exist (RunNotFound), one
    whose timeout passes (TimeoutError), a result() wait, and a follower that goes on until
    its run ends; none answers for another."""
    start_worker(emit)
    run_id = client.enqueue(emit, 2).id
    outcomes: dict[str, object] = {}

    def record(name: str, call: Callable[[], object]) -> None:
        try:
            outcomes[name] = call()
        except Exception as exc:  # the test reads which error ended it
            outcomes[name] = type(exc)

    calls: dict[str, Callable[[], object]] = {
        "missing": lambda: list(follower.events(10**12)),
        "timed out": lambda: list(follower.events(run_id, timeout=0.5)),
        "wait": lambda: follower.result(run_id, timeout=30),
        "follows": lambda: [e.data for e in follower.events(run_id, timeout=30)],
    }
    threads = [threading.Thread(target=record, args=item) for item in calls.items()]
    for thread in threads:
        thread.start()
    wait_until(lambda: "timed out" in outcomes and "missing" in outcomes, what="two ended")
    release.set()
    for thread in threads:
        thread.join(30)
    assert outcomes == {
        "missing": RunNotFound,
        "timed out": TimeoutError,
        "wait": 2,
        "follows": [0, 1, "last"],
    }


def test_a_slow_follower_holds_one_page_and_misses_nothing(
    client: Client, follower: Client, start_worker: Callable[..., Worker]
) -> None:
    """A follower that takes one event and stalls holds at most one page (500 events)
    read ahead, whatever the run recorded; a fast follower of the same run on the same
    client is not held back; then the slow one gets the rest, once each, in order."""
    start_worker(many)
    total = 3 * EVENTS_PAGE + 7
    handle = client.enqueue(many, total)
    handle.result(timeout=60)
    slow = follower.events(handle.id, timeout=60)
    first = next(slow)
    fast = [e.seq for e in follower.events(handle.id, timeout=60)]
    (held,) = [f for f in follower._watcher._follows if f.cursor < total]
    assert len(held.pending) <= EVENTS_PAGE
    rest = [e.seq for e in slow]
    assert fast == list(range(1, total + 1))
    assert [first.seq, *rest] == list(range(1, total + 1))
    assert waits_in_flight(follower) == 0


def test_followers_through_a_pooled_dsn_poll_on_one_connection(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """``pooled=True`` and no ``listen_dsn``: no LISTEN; 20 followers read every 0.25 s,
    all on one connection, and get every event."""
    start_worker(emit)
    run_id = client.enqueue(emit, 2).id
    others = wait_backends(cyclone_dsn)
    with Client(cyclone_dsn, pooled=True) as pooled:
        assert not pooled.wait_route.listen
        seen: dict[int, list[Any]] = {}
        threads = [
            threading.Thread(
                target=lambda n=n: seen.update(
                    {n: [e.data for e in pooled.events(run_id, timeout=30)]}
                )
            )
            for n in range(20)
        ]
        for thread in threads:
            thread.start()
        wait_until(lambda: waits_in_flight(pooled) == 20, what="every follower to begin")
        # The watcher connects as it reads: it may not have yet when the waits began.
        wait_until(lambda: len(wait_backends(cyclone_dsn) - others) >= 1, what="the connections")
        opened = wait_backends(cyclone_dsn) - others
        release.set()
        for thread in threads:
            thread.join(30)
    assert len(opened) == 1, opened
    assert seen == {n: [0, 1, "last"] for n in range(20)}


def test_a_client_listens_to_events_only_while_it_follows_some(
    client: Client, follower: Client, start_worker: Callable[..., Worker]
) -> None:
    """A client that only waits is not sent every event's notification: its connection
    LISTENs on cyclone_events from a follower's start to the end of the last one."""
    start_worker(emit)
    run_id = client.enqueue(emit, 1).id

    def listens() -> tuple[str, ...]:
        return follower._watcher._listener.channels

    waiting = threading.Thread(target=follower.result, args=(run_id, 30))
    waiting.start()
    wait_until(lambda: follower._watcher._listener.connected, what="the wait's connection")
    assert listens() == ("cyclone_run_done",)
    events = follower.events(run_id, timeout=30)
    assert next(events).data == 0
    assert listens() == ("cyclone_run_done", "cyclone_events")
    events.close()
    wait_until(lambda: listens() == ("cyclone_run_done",), what="the events channel left")
    release.set()
    waiting.join(30)
    assert [e.data for e in follower.events(run_id, timeout=30)] == [0, "last"]
