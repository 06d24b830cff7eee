"""Audit: following a run's events (``Client.events()``, ``RunHandle.events()``,
``AsyncClient.events()``) now that every follower and every ``wait()`` / ``result()`` of
one client share one connection and one thread (the client's RunWatcher), seen from the
docs only (docs/howto/progress-events.md "Following", docs/concepts/runs-and-steps.md
"Wake-ups", docs/howto/scale.md, the docstring of ``Client.events``).

Complements test_event_watcher.py, test_events.py and test_acc_audit.py: here followers
with different ``after=`` on several runs whose fan-out items emit at once (pages past
500, fast and slow consumers, sync and async on one watcher), a follower broken out of
mid-page and resumed, a client closed while followers hold pages, the watcher's idle
close while followers come and go, followers through ``pooled=True``, async followers in
two loops one after the other, and random interleavings (hypothesis) of followers
starting, events emitted, followers broken, the run ending and the client closing.

Two findings, fixed: a follower of an ended run with pages left raised TimeoutError once
its timeout passed while its consumer took the pages; ``after=2**63`` failed the shared
read, and with it every other follower and wait of the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cyclone_dsl import (
    AsyncClient,
    Client,
    ClientClosed,
    RunState,
    StepContext,
    StepEvent,
    Worker,
    for_each,
    step,
    workflow,
)
from cyclone_dsl.client import watch
from tests.waiting import until, wait_backends, wait_until, waits_in_flight

# -- definitions ------------------------------------------------------------------------------

#: Commands for the gated steps, by the token each run was given: ``(n, done)`` emits ``n``
#: events (data = their running count, hence their seq) then sets ``done``; None returns.
GATES: dict[str, queue.Queue[tuple[int, threading.Event] | None]] = {}


@step(name="ewa_gated")
def ewa_gated(token: str, ctx: StepContext) -> int:
    commands = GATES[token]
    emitted = 0
    while True:
        command = commands.get(timeout=30)
        if command is None:
            return emitted
        n, done = command
        for _ in range(n):
            emitted += 1
            ctx.emit(emitted)
        done.set()


@step(name="ewa_item")
def ewa_item(item: dict[str, int], ctx: StepContext) -> int:
    for k in range(item["n"]):
        ctx.emit([item["i"], k])
    return item["i"]


@workflow(name="ewa_fan")
def ewa_fan(items):  # type: ignore[no-untyped-def]
    return for_each(ewa_item, over=items)


@workflow(name="ewa_four")
def ewa_four(x):  # type: ignore[no-untyped-def]
    """Four steps that emit 300 events each, at once (1200 events: three pages)."""
    for i in range(4):
        ewa_item({"i": i, "n": 300})


class Gate:
    """The test's end of one ``ewa_gated`` run: ``emit(n)`` returns once the ``n`` events
    are stored; ``end()`` lets the step return (its run completes)."""

    def __init__(self, client: Client) -> None:
        self.token = uuid.uuid4().hex
        self.commands: queue.Queue[tuple[int, threading.Event] | None] = queue.Queue()
        GATES[self.token] = self.commands
        self.run_id = client.enqueue(ewa_gated, self.token).id
        self.emitted = 0
        self.ended = False

    def emit(self, n: int) -> None:
        assert not self.ended
        done = threading.Event()
        self.commands.put((n, done))
        assert done.wait(20), "the gated step did not emit"
        self.emitted += n

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.commands.put(None)


@pytest.fixture(autouse=True)
def _gates_released() -> Iterator[None]:
    yield
    for commands in GATES.values():
        commands.put(None)  # never leave a handler blocked
    GATES.clear()


def fan_items(item_count: int, per_item: int) -> list[dict[str, int]]:
    return [{"i": i, "n": per_item} for i in range(item_count)]


def ended_run_of_1200_events(client: Client) -> int:
    run_id = client.submit(ewa_four, None).id
    assert client.wait(run_id, timeout=30).state is RunState.COMPLETED
    return run_id


def seqs_of(events: list[StepEvent]) -> list[int]:
    return [e.seq for e in events]


# -- many followers, many runs, concurrent emitters -------------------------------------------


def test_ewa_followers_with_different_afters_on_runs_whose_items_emit_at_once(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """Three runs, each a fan-out of 4 items emitting 160 events at once (640 per run, more
    than one page); on each, six followers of one AsyncClient (sync ones on its Client,
    async ones on its loop: one watcher) with different ``after`` (0, 1, 140 = exactly one
    page left, 639, 640 = nothing left, 700 = past the end), fast ones and slow ones (which
    take one event, then wait for the run to complete before taking the rest). Each gets
    exactly seqs after+1..640, in order, as ``events_of`` has them, and ends."""
    per_run = 4 * 160
    runs = [client.submit(ewa_fan, fan_items(4, 160)).id for _ in range(3)]
    plans = [(0, False), (1, True), (140, True), (639, False), (640, False), (700, True)]
    aclient = AsyncClient(cyclone_dsn)
    sync_client = aclient._client  # the same watcher as the async followers
    got: dict[tuple[int, int, str], list[StepEvent]] = {}

    def completed(run_id: int) -> bool:
        return client.get_run(run_id).state is RunState.COMPLETED

    def follow_sync(run_id: int, after: int, slow: bool) -> None:
        into = got.setdefault((run_id, after, "sync"), [])
        for event in sync_client.events(run_id, after=after, timeout=60):
            into.append(event)
            if slow and len(into) == 1:
                wait_until(lambda: completed(run_id), what="the run to complete")

    async def follow_async(run_id: int, after: int, slow: bool) -> None:
        into = got.setdefault((run_id, after, "async"), [])
        async for event in aclient.events(run_id, after=after, timeout=60):
            into.append(event)
            if slow and len(into) == 1:
                await until(lambda: completed(run_id), what="the run to complete")

    threads = [threading.Thread(target=follow_sync, args=(r, a, s)) for r in runs for a, s in plans]
    for thread in threads:
        thread.start()

    async def main() -> None:
        tasks = [asyncio.ensure_future(follow_async(r, a, not s)) for r in runs for a, s in plans]
        await until(lambda: waits_in_flight(sync_client) == 36, what="every follower to begin")
        start_worker(ewa_item, concurrency=8)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        await until(lambda: waits_in_flight(sync_client) == 0, what="the sync followers to end")
        await aclient.close()

    asyncio.run(main())
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()
    assert len(got) == 36
    for run_id in runs:
        everything = client.events_of(run_id, limit=1000)
        assert seqs_of(everything) == list(range(1, per_run + 1))
        for i in range(4):
            mine = [e.data for e in everything if e.node == f"ewa_item[{i}]"]
            assert mine == [[i, k] for k in range(160)]
        for after, _ in plans:
            for kind in ("sync", "async"):
                assert got[run_id, after, kind] == everything[after:], (run_id, after, kind)


def test_ewa_a_follower_broken_out_of_mid_page_leaves_the_others_and_resumes_without_gap(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """On one client, one follower of a 1200-event run breaks after 321 events (a page
    read ahead), another closes its iterator by hand after 600 (``contextlib.closing``),
    while a third goes on: the broken ones leave the watcher, the third gets everything,
    and each broken one resumed with ``after=<last seq seen>`` gets the rest, nothing
    twice, nothing missed."""
    start_worker(ewa_item, concurrency=4)
    run_id = ended_run_of_1200_events(client)
    with Client(cyclone_dsn) as follower:
        whole = follower.events(run_id, timeout=30)
        first = [next(whole).seq]
        seen: list[int] = []
        for event in follower.events(run_id, timeout=30):
            seen.append(event.seq)
            if len(seen) == 321:
                break
        assert waits_in_flight(follower) == 1
        closed: list[int] = []
        with contextlib.closing(follower.events(run_id, timeout=30)) as events:
            for event in events:
                closed.append(event.seq)
                if len(closed) == 600:
                    break
            assert waits_in_flight(follower) == 2  # broken, but still referenced
        assert waits_in_flight(follower) == 1
        rest_of_seen = seqs_of(list(follower.events(run_id, after=seen[-1], timeout=30)))
        rest_of_closed = seqs_of(list(follower.events(run_id, after=closed[-1], timeout=30)))
        rest = seqs_of(list(whole))
        assert waits_in_flight(follower) == 0
    everything = list(range(1, 1201))
    assert first + rest == everything
    assert seen + rest_of_seen == everything
    assert closed + rest_of_closed == everything


def test_ewa_a_follower_of_an_ended_run_with_pages_left_does_not_time_out(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """A run completed with 1200 events (three pages); three followers with ``timeout=0.3``
    each take one event, then the rest after 0.3 s have passed: the run is not going, so
    no TimeoutError; each gets all 1200 events and ends."""
    start_worker(ewa_item, concurrency=4)
    run_id = ended_run_of_1200_events(client)
    with Client(cyclone_dsn) as follower:
        began = time.monotonic()
        iterators = [follower.events(run_id, timeout=0.3) for _ in range(3)]
        firsts = [next(events).seq for events in iterators]
        wait_until(lambda: time.monotonic() > began + 0.4, what="the timeout to pass")
        outcomes: list[object] = []
        for first, events in zip(firsts, iterators, strict=True):
            try:
                outcomes.append([first, *seqs_of(list(events))] == list(range(1, 1201)))
            except TimeoutError as exc:
                outcomes.append(str(exc))
    assert outcomes == [True, True, True]


def test_ewa_a_follower_with_an_after_past_bigint_fails_only_itself(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """A request passes a client-supplied offset that no seq can reach: that follower may
    fail (or find nothing), but the other follower and the result() wait of the same
    client, in flight meanwhile, must go on to their run's end."""
    start_worker(ewa_gated)
    gate = Gate(client)
    gate.emit(2)
    outcomes: dict[str, object] = {}
    with Client(cyclone_dsn) as shared:

        def record(name: str, call: Callable[[], object]) -> None:
            try:
                outcomes[name] = call()
            except Exception as exc:  # the test reads what ended each
                outcomes[name] = type(exc).__name__

        follows = threading.Thread(
            target=record,
            args=("follower", lambda: seqs_of(list(shared.events(gate.run_id, timeout=30)))),
        )
        waits = threading.Thread(
            target=record, args=("wait", lambda: shared.result(gate.run_id, timeout=30))
        )
        follows.start()
        waits.start()
        wait_until(lambda: waits_in_flight(shared) == 2, what="the follower and the wait")
        record("huge", lambda: list(shared.events(gate.run_id, after=2**63, timeout=0.5)))
        gate.emit(1)
        gate.end()
        follows.join(30)
        waits.join(30)
    assert (outcomes["follower"], outcomes["wait"]) == ([1, 2, 3], 3), outcomes


# -- closing, idling, pooled, two loops -------------------------------------------------------


def test_ewa_closing_the_client_while_followers_hold_pages_ends_each_with_client_closed(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """Three sync followers and one async follower of an ended 1200-event run each took
    one event (a page in hand, the next read ahead) when the client closes: each yields
    no more than a gapless prefix and ends with ClientClosed, none is left registered, and
    the watcher's connection closes."""
    start_worker(ewa_item, concurrency=4)
    run_id = ended_run_of_1200_events(client)
    others = wait_backends(cyclone_dsn)
    aclient = AsyncClient(cyclone_dsn)
    sync_client = aclient._client
    iterators = [sync_client.events(run_id, after=after) for after in (0, 7, 650)]
    heads = [next(events).seq for events in iterators]
    assert heads == [1, 8, 651]

    async def main() -> tuple[list[int], object]:
        seen: list[int] = []
        events = aclient.events(run_id, after=3)
        async for event in events:
            seen.append(event.seq)
            break
        await aclient.close()
        try:
            async for event in events:
                seen.append(event.seq)
        except ClientClosed:
            return seen, ClientClosed
        return seen, "ended"

    async_seen, async_end = asyncio.run(main())
    outcomes: list[object] = []
    for head, events in zip(heads, iterators, strict=True):
        seen = [head]
        try:
            seen.extend(e.seq for e in events)
            outcomes.append("ended")
        except ClientClosed:
            outcomes.append(ClientClosed)
        assert seen == list(range(head, head + len(seen)))
        assert len(seen) <= 500
    assert outcomes == [ClientClosed] * 3
    assert async_end is ClientClosed
    assert async_seen == list(range(4, 4 + len(async_seen)))
    assert waits_in_flight(sync_client) == 0
    wait_until(lambda: not wait_backends(cyclone_dsn) - others, what="the connection to close")


def test_ewa_followers_coming_and_going_across_idle_closes_miss_nothing(
    client: Client,
    cyclone_dsn: str,
    start_worker: Callable[..., Worker],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the watcher's idle close at 50 ms, followers of one live run (sync and async,
    one client) begin and break, some right after, some once the connection closed: each
    gets seqs after+1.. in order; never more than one connection; the last follower, begun
    before the run ends, and one begun after, get everything and end."""
    monkeypatch.setattr(watch, "IDLE_SECONDS", 0.05)
    start_worker(ewa_gated)
    gate = Gate(client)
    others = wait_backends(cyclone_dsn)
    aclient = AsyncClient(cyclone_dsn)
    sync_client = aclient._client
    connections: set[int] = set()

    async def take_async(after: int, upto: int) -> list[int]:
        seen: list[int] = []
        async with contextlib.aclosing(aclient.events(gate.run_id, after=after, timeout=20)) as it:  # type: ignore[type-var]
            async for event in it:
                seen.append(event.seq)
                if event.seq == upto:
                    break
        return seen

    for round_ in range(8):
        gate.emit(2)
        after = (round_ * 3) % (gate.emitted - 1)
        if round_ % 2:
            seen = asyncio.run(take_async(after, gate.emitted))
        else:
            seen = []
            with contextlib.closing(sync_client.events(gate.run_id, after=after, timeout=20)) as it:
                for event in it:
                    seen.append(event.seq)
                    if event.seq == gate.emitted:
                        break
        assert seen == list(range(after + 1, gate.emitted + 1)), (round_, after)
        assert waits_in_flight(sync_client) == 0
        opened = wait_backends(cyclone_dsn) - others
        assert len(opened) <= 1, opened
        connections |= opened
        if round_ % 3 == 0:
            wait_until(lambda: not wait_backends(cyclone_dsn) - others, what="the idle close")
    last: list[int] = []
    follower = threading.Thread(
        target=lambda: last.extend(e.seq for e in sync_client.events(gate.run_id, timeout=20))
    )
    follower.start()
    wait_until(lambda: waits_in_flight(sync_client) == 1, what="the last follower")
    gate.emit(3)
    gate.end()
    follower.join(20)
    assert not follower.is_alive()
    assert last == list(range(1, gate.emitted + 1))
    wait_until(lambda: not wait_backends(cyclone_dsn) - others, what="the idle close")
    assert seqs_of(list(sync_client.events(gate.run_id, after=5, timeout=20))) == list(
        range(6, gate.emitted + 1)
    )
    assert len(connections) >= 2  # it closed and opened again
    asyncio.run(aclient.close())


def test_ewa_pooled_followers_get_live_events_batch_by_batch_and_end(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """``Client(dsn, pooled=True)`` (no LISTEN: polling): followers with after 0, 2 and 9
    see each batch of a live run's events, in order, before the next is emitted, and end
    when the run ends; one begun after the end gets everything and ends."""
    start_worker(ewa_gated)
    gate = Gate(client)
    with Client(cyclone_dsn, pooled=True) as pooled:
        assert not pooled.wait_route.listen
        seen: dict[int, list[int]] = {0: [], 2: [], 9: []}

        def follow(after: int) -> None:
            seen[after].extend(e.seq for e in pooled.events(gate.run_id, after=after, timeout=20))

        threads = [threading.Thread(target=follow, args=(after,)) for after in seen]
        for thread in threads:
            thread.start()
        for batch in (3, 1, 7):
            gate.emit(batch)
            wait_until(
                lambda: seen[0][-1:] == [gate.emitted] and seen[2][-1:] == [gate.emitted],
                what=f"batch up to {gate.emitted}",
            )
        gate.end()
        for thread in threads:
            thread.join(20)
            assert not thread.is_alive()
        assert seen == {0: list(range(1, 12)), 2: list(range(3, 12)), 9: [10, 11]}
        assert seqs_of(list(pooled.events(gate.run_id, timeout=20))) == list(range(1, 12))
        assert waits_in_flight(pooled) == 0


def test_ewa_async_followers_in_two_loops_while_a_sync_one_follows_throughout(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """One AsyncClient: a sync follower (its Client) follows a live run from start to end;
    a first ``asyncio.run`` follows two events and breaks; a second, later, follows from
    after=1 to the run's end, ending the run itself mid-way: all three get their seqs in
    order and end."""
    start_worker(ewa_gated)
    gate = Gate(client)
    aclient = AsyncClient(cyclone_dsn)
    throughout: list[int] = []
    sync = threading.Thread(
        target=lambda: throughout.extend(
            e.seq for e in aclient._client.events(gate.run_id, timeout=30)
        )
    )
    sync.start()
    gate.emit(3)

    async def first_loop() -> list[int]:
        seen: list[int] = []
        async with contextlib.aclosing(aclient.events(gate.run_id, timeout=20)) as it:  # type: ignore[type-var]
            async for event in it:
                seen.append(event.seq)
                if len(seen) == 2:
                    break
        return seen

    async def second_loop() -> list[int]:
        seen: list[int] = []
        events: AsyncIterator[StepEvent] = aclient.events(gate.run_id, after=1, timeout=20)
        async for event in events:
            seen.append(event.seq)
            if event.seq == 4:
                await asyncio.to_thread(gate.emit, 2)
            elif event.seq == 5:
                await asyncio.to_thread(gate.end)
        return seen

    assert asyncio.run(first_loop()) == [1, 2]
    gate.emit(1)
    assert asyncio.run(second_loop()) == [2, 3, 4, 5, 6]
    sync.join(20)
    assert not sync.is_alive()
    assert throughout == [1, 2, 3, 4, 5, 6]
    assert waits_in_flight(aclient._client) == 0
    asyncio.run(aclient.close())


def test_ewa_a_cut_connection_while_followers_hold_pages_skips_and_repeats_nothing(
    client: Client, cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """The watcher's connection is terminated while three followers of a 1200-event run
    each hold a page (and a live follower of a gated run waits): it is replaced, and each
    gets every event once, in order ("a cut connection delays events, never skips one")."""
    start_worker(ewa_item, ewa_gated, concurrency=6)
    run_id = ended_run_of_1200_events(client)
    gate = Gate(client)
    gate.emit(2)
    others = wait_backends(cyclone_dsn)
    with Client(cyclone_dsn) as follower:
        live: list[int] = []
        live_thread = threading.Thread(
            target=lambda: live.extend(e.seq for e in follower.events(gate.run_id, timeout=30))
        )
        live_thread.start()
        wait_until(lambda: len(live) == 2, what="the live follower's first events")
        iterators = [follower.events(run_id, after=after, timeout=30) for after in (0, 499, 1000)]
        heads = [next(events).seq for events in iterators]
        (backend,) = wait_backends(cyclone_dsn) - others
        with psycopg.connect(cyclone_dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (backend,))
        gate.emit(3)
        rests = [seqs_of(list(events)) for events in iterators]
        gate.end()
        live_thread.join(30)
        assert not live_thread.is_alive()
    for head, rest, after in zip(heads, rests, (0, 499, 1000), strict=True):
        assert [head, *rest] == list(range(after + 1, 1201)), after
    assert live == [1, 2, 3, 4, 5]


# -- random interleavings ---------------------------------------------------------------------

FOLLOW_SYNC = st.tuples(st.just("sync"), st.integers(0, 6))
FOLLOW_ASYNC = st.tuples(st.just("async"), st.integers(0, 6))
EMIT = st.tuples(st.just("emit"), st.integers(1, 3))
#: Followers begin, events are emitted, followers are broken out of; the run's end and
#: the client's close are put in at drawn places (the close in some examples only).
ACTIONS = st.lists(
    st.one_of(FOLLOW_SYNC, FOLLOW_ASYNC, EMIT, st.tuples(st.just("break"), st.integers(0, 7))),
    min_size=4,
    max_size=10,
)


class Follower:
    """One follower of the interleaving test: what it saw and how it ended."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.seqs: list[int] = []
        self.outcome: object = None  # "ended", "broken", an exception type; None: running
        self.stop = threading.Event()
        self.task: asyncio.Task[None] | None = None  # an async follower's, on the loop
        self.thread: threading.Thread | None = None

    def done(self) -> bool:
        if self.thread is not None:
            return not self.thread.is_alive()
        assert self.task is not None
        return self.task.done()


@pytest.fixture
def gated_worker(start_worker: Callable[..., Worker]) -> Worker:
    return start_worker(ewa_gated, concurrency=4)


@settings(max_examples=15, deadline=None)
@given(
    drawn=ACTIONS,
    end_at=st.integers(3, 10),
    close_at=st.one_of(st.none(), st.none(), st.integers(0, 11)),
    pooled=st.booleans(),
)
def test_ewa_random_interleavings_of_followers_emits_breaks_end_and_close(
    client: Client,
    cyclone_dsn: str,
    gated_worker: Worker,
    drawn: list[Any],
    end_at: int,
    close_at: int | None,
    pooled: bool,
) -> None:
    """Followers (sync and async, random ``after``) begin, events are emitted, followers
    are broken out of (sync: break at the next event; async: task cancelled), the run ends,
    the client closes, in any order, on a direct or a pooled client (polling). No follower
    ends normally before the run ended; each that ended normally saw exactly after+1..last
    in order; a broken one, or one ended by ClientClosed (only once the client closed), a
    gapless prefix of that; none hangs."""
    actions = list(drawn)
    actions.insert(min(end_at, len(actions)), ("end", 0))
    if close_at is not None:
        actions.insert(min(close_at, len(actions)), ("close", 0))
    gate = Gate(client)
    aclient = AsyncClient(cyclone_dsn, pool_size=1, pooled=pooled)
    sync_client = aclient._client
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()
    followers: list[Follower] = []
    closed = False

    def run_sync(f: Follower) -> None:
        try:
            for event in sync_client.events(gate.run_id, after=f.after, timeout=30):
                f.seqs.append(event.seq)
                if f.stop.is_set():
                    f.outcome = "broken"
                    return
            f.outcome = "ended"
        except Exception as exc:  # the test reads what ended it
            f.outcome = type(exc)

    async def start(follow: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        return asyncio.ensure_future(follow)

    async def run_async(f: Follower) -> None:
        try:
            async for event in aclient.events(gate.run_id, after=f.after, timeout=30):
                f.seqs.append(event.seq)
            f.outcome = "ended"
        except asyncio.CancelledError:
            f.outcome = "broken"
            raise
        except Exception as exc:  # the test reads what ended it
            f.outcome = type(exc)

    try:
        for action, arg in actions:
            if action in ("sync", "async"):
                f = Follower(arg)
                if closed:
                    begin: Callable[..., object] = (
                        sync_client.events if action == "sync" else aclient.events
                    )
                    with pytest.raises(ClientClosed):
                        begin(gate.run_id, after=arg)
                    continue
                followers.append(f)
                if action == "sync":
                    f.thread = threading.Thread(target=run_sync, args=(f,), daemon=True)
                    f.thread.start()
                else:
                    f.task = asyncio.run_coroutine_threadsafe(start(run_async(f)), loop).result(5)
            elif action == "emit" and not gate.ended:
                gate.emit(arg)
            elif action == "break" and followers:
                f = followers[arg % len(followers)]
                f.stop.set()
                if f.task is not None:
                    loop.call_soon_threadsafe(f.task.cancel)
            elif action == "end" and not gate.ended:
                assert [f.outcome for f in followers].count("ended") == 0
                gate.end()
            elif action == "close" and not closed:
                closed = True
                asyncio.run_coroutine_threadsafe(aclient.close(), loop).result(20)
        if not gate.ended:
            assert [f.outcome for f in followers].count("ended") == 0
            gate.end()
        wait_until(
            lambda: all(f.done() for f in followers),
            what="every follower to end",
            timeout=20,
        )
        last = gate.emitted
        for f in followers:
            expected = list(range(f.after + 1, last + 1))
            if f.task is not None and f.task.cancelled():
                f.outcome = f.outcome or "broken"
            if f.outcome == "ended":
                assert f.seqs == expected, (f.after, last)
            elif f.outcome == "broken" or (f.outcome is ClientClosed and closed):
                assert f.seqs == expected[: len(f.seqs)], (f.after, last)
            else:
                raise AssertionError(f"follower after={f.after} ended with {f.outcome!r}")
        if not closed:
            assert waits_in_flight(sync_client) == 0
    finally:
        gate.end()
        if not closed:
            asyncio.run_coroutine_threadsafe(aclient.close(), loop).result(20)
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(10)
        loop.close()
