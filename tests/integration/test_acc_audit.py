"""Audit: AsyncClient in an asyncio web app whose request tasks get cancelled (a client
that disconnects, ``asyncio.wait_for`` / ``asyncio.timeout`` around a call), seen from
the docs only (the AsyncClient docstring, docs/howto/frameworks.md and
docs/howto/progress-events.md).

Complements test_aca_audit.py (result()/wait() cancelled, writes cancelled, two loops):
here the live event followers (``async for ev in aclient.events(...)``) cut short in
every way a request can be, resumed with ``after=``, many at once cancelled by a
shutdown, a follower in flight when the client closes, the FastAPI helpers on a
disconnect or a shutdown, a bulk retry cancelled while its progress coroutine awaits,
and a bulk submit timed out right before the client closes.

Tests marked ``xfail(strict=True)`` show a finding: they fail today and pass once fixed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import warnings
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from cyclone_dsl import (
    AsyncClient,
    AsyncRunHandle,
    BulkResult,
    Client,
    ClientClosed,
    RunFilter,
    RunState,
    StepContext,
    StepEvent,
    StepState,
    Worker,
    step,
    wait_signal,
    workflow,
)
from tests.waiting import until, wait_backends, wait_until, waits_in_flight

# -- definitions ------------------------------------------------------------------------------


@step(name="acc_emit")
def acc_emit(n: int, ctx: StepContext) -> int:
    for i in range(n):
        ctx.emit(i)
    return n


@step(name="acc_tail")
def acc_tail(value: object) -> object:
    return value


@workflow(name="acc_live")
def acc_live(n):  # type: ignore[no-untyped-def]
    """Emits ``n`` events, then waits for the signal ``acc_go``: live, with events."""
    first = acc_emit(n)
    return acc_tail(wait_signal("acc_go", after=[first]))


@step(name="acc_head")
def acc_head(value: object) -> object:
    return value


@workflow(name="acc_plain")
def acc_plain(x):  # type: ignore[no-untyped-def]
    return acc_tail(acc_head(x))


@workflow(name="acc_done")
def acc_done(n):  # type: ignore[no-untyped-def]
    return acc_tail(acc_emit(n))


# -- helpers ----------------------------------------------------------------------------------


async def collect(events: AsyncIterator[StepEvent]) -> list[int]:
    return [event.seq async for event in events]


async def first(events: AsyncIterator[StepEvent], n: int) -> list[int]:
    """The seqs of the first ``n`` events; the follower closed at once (``aclosing``)."""
    seqs: list[int] = []
    async with contextlib.aclosing(events) as closing:  # type: ignore[type-var]
        async for event in closing:
            seqs.append(event.seq)
            if len(seqs) == n:
                break
    return seqs


def outcome(task: asyncio.Future[Any], done: set[asyncio.Future[Any]]) -> object:
    """How a task ended: the type of its exception, "returned", or "hung"."""
    if task not in done:
        return "hung"
    error = task.exception()
    return type(error) if error is not None else "returned"


def live_run_with_events(client: Client, worker: Worker, n: int) -> int:
    """An acc_live run that recorded ``n`` events and waits for its signal; the worker is
    stopped (its connections would blur the socket counts)."""
    run_id = client.submit(acc_live, n).id
    wait_until(
        lambda: client.progress(run_id)[0] >= 1 and len(client.events_of(run_id)) == n,
        what="the events to be recorded and the run to wait for its signal",
    )
    worker.stop()
    return run_id


def no_unclosed(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "deleted while still open" in str(w.message)]


# -- followers cut short ----------------------------------------------------------------------


def test_acc_200_followers_cut_short_leak_nothing_and_a_later_one_sees_everything(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """``async for ev in aclient.events(run)`` on a live run, cut short 200 times: the
    task cancelled, ``asyncio.wait_for``, ``asyncio.timeout``, a ``break`` (docs: the
    follower is registered "until the loop ends or you break out of it"), a ``break``
    inside ``aclosing``, and the follower's own ``timeout=``. Every follower leaves the
    client's watcher, no connection is left to the garbage collector, no task nor thread
    stays, and a later follower gets every event once and ends when the run ends."""
    run_id = live_run_with_events(client, start_worker(acc_emit, acc_tail), 3)
    threads_before = threading.active_count()

    async def cut_short() -> list[str]:
        seen: list[str] = []
        aclient = AsyncClient(cyclone_dsn, pool_size=1)
        for i in range(200):
            kind = i % 6
            jitter = 0.001 * (i % 5)
            try:
                if kind == 0:
                    task = asyncio.ensure_future(collect(aclient.events(run_id)))
                    await asyncio.sleep(jitter)  # lands anywhere: connecting, reading, waiting
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    seen.append("cancelled")
                elif kind == 1:
                    await asyncio.wait_for(collect(aclient.events(run_id)), jitter)
                    seen.append("ended?!")
                elif kind == 2:
                    async with asyncio.timeout(jitter):
                        await collect(aclient.handle(run_id).events())
                    seen.append("ended?!")
                elif kind == 3:
                    async for event in aclient.events(run_id):
                        assert event.seq == 1
                        break
                    seen.append("break")
                elif kind == 4:
                    async with contextlib.aclosing(aclient.events(run_id, after=1)) as events:
                        async for event in events:
                            assert event.seq == 2
                            break
                    seen.append("break")
                else:
                    got: list[int] = []
                    try:
                        async for event in aclient.events(run_id, timeout=jitter):
                            got.append(event.seq)
                    finally:
                        assert got == [1, 2, 3]  # what was recorded comes before the timeout
            except TimeoutError:
                seen.append("timeout")
        await until(lambda: waits_in_flight(aclient._client) == 0, what="every follower ended")
        current = asyncio.current_task()
        await until(lambda: asyncio.all_tasks() == {current}, what="no task left behind")
        await aclient.close()
        return seen

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        seen = asyncio.run(cut_short())
        gc.collect()
    assert "ended?!" not in seen, seen
    assert seen.count("break") == sum(1 for i in range(200) if i % 6 in (3, 4))
    assert no_unclosed(caught) == []
    wait_until(lambda: threading.active_count() <= threads_before, what="no thread left")

    start_worker(acc_emit, acc_tail)

    async def later() -> list[int]:
        async with AsyncClient(cyclone_dsn) as aclient:
            follower = asyncio.ensure_future(collect(aclient.events(run_id, timeout=30)))
            await aclient.signal(run_id, "acc_go", "go")
            return await asyncio.wait_for(follower, 30)

    assert asyncio.run(later()) == [1, 2, 3]
    assert client.result(run_id, timeout=10) == "go"


def test_acc_followers_cancelled_together_by_a_shutdown_all_leave_the_one_connection(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A server shutting down cancels every streaming request at once: 10 followers (and
    10 result() waits) of live runs cancelled together all leave the client's watcher, whose
    one connection served them all, and each follower saw the events recorded before, in
    order. The connection closes with the client."""
    run_id = live_run_with_events(client, start_worker(acc_emit, acc_tail), 2)
    other = client.submit(acc_live, 0).id  # no worker: stays at its first step
    before = wait_backends(cyclone_dsn)  # the test client's, if it waited

    async def shutdown() -> tuple[list[list[int]], int]:
        async with AsyncClient(cyclone_dsn) as aclient:
            got: list[list[int]] = [[] for _ in range(10)]

            async def follow(into: list[int]) -> None:
                async for event in aclient.events(run_id):
                    into.append(event.seq)

            tasks = [asyncio.ensure_future(follow(into)) for into in got]
            tasks += [asyncio.ensure_future(aclient.result(other)) for _ in range(10)]
            await until(lambda: all(len(g) == 2 for g in got), what="every follower's events")
            await until(
                lambda: waits_in_flight(aclient._client) == 20, what="the 20 waits to begin"
            )
            connections = len(wait_backends(cyclone_dsn) - before)
            for task in tasks:
                task.cancel()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes
            assert waits_in_flight(aclient._client) == 0
        return got, connections

    got, connections = asyncio.run(shutdown())
    assert got == [[1, 2]] * 10
    assert connections == 1
    wait_until(lambda: not wait_backends(cyclone_dsn) - before, what="the connection closed")


def test_acc_a_follower_left_suspended_is_closed_when_its_event_loop_ends(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """An iterator broken out of but still referenced (handed out of ``asyncio.run``)
    stays registered with the client's watcher while its loop runs, but ``asyncio.run``
    closes it at the end of its loop: no follower left, no ResourceWarning. The same
    client then follows again from another loop (it holds no loop-bound state)."""
    run_id = live_run_with_events(client, start_worker(acc_emit, acc_tail), 2)

    async def first_loop(aclient: AsyncClient) -> tuple[AsyncIterator[StepEvent], int]:
        events = aclient.events(run_id)
        async for event in events:
            assert event.seq == 1
            break
        return events, waits_in_flight(aclient._client)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        aclient = AsyncClient(cyclone_dsn, pool_size=1)
        kept, inside = asyncio.run(first_loop(aclient))
        after_loop = waits_in_flight(aclient._client)
        assert asyncio.run(first(aclient.events(run_id, after=1), 1)) == [2]
        assert asyncio.run(first(aclient.events(run_id), 2)) == [1, 2]
        asyncio.run(aclient.close())
        gc.collect()
    assert (inside, after_loop) == (1, 0)  # the suspended follower's, while its loop ran
    assert no_unclosed(caught) == []
    del kept


def test_acc_a_follower_timed_out_mid_stream_resumes_after_its_last_seq_without_gap(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """A request that follows 620 events (two pages) under ``asyncio.timeout`` and is cut
    mid-stream resumes with ``after=<last seq seen>`` (progress-events.md: "nothing missed
    and nothing twice"), whatever the moment the timeout lands."""
    start_worker(acc_emit, acc_tail)
    handle = client.submit(acc_done, 620)
    client.result(handle.id, timeout=30)

    async def follow_in_pieces() -> tuple[list[int], int]:
        seen: list[int] = []
        cuts = 0
        async with AsyncClient(cyclone_dsn) as aclient:
            for attempt in range(200):
                after = seen[-1] if seen else 0
                try:
                    async with asyncio.timeout(0.001 * (attempt % 7) + 0.0005 * attempt):
                        async for event in aclient.events(handle.id, after=after, timeout=30):
                            seen.append(event.seq)
                    return seen, cuts
                except TimeoutError:
                    cuts += 1
        raise AssertionError(f"never finished; {len(seen)} events seen")

    seen, cuts = asyncio.run(follow_in_pieces())
    assert seen == list(range(1, 621))
    assert cuts >= 1


# -- closing while followers and waits are in flight -----------------------------------------


def test_acc_closing_the_client_ends_its_event_followers_in_flight(
    cyclone_dsn: str, client: Client
) -> None:
    """FastAPI's lifespan closes the AsyncClient at shutdown while a request streams a
    run's events (``async for ev in client.events(run_id)``, no timeout): the follower
    should end like a result() wait does, with ClientClosed, giving back its connection.
    It goes on instead until the run ends, which may be never: the shutdown waits on it."""
    run_id = client.submit(acc_live, 0).id  # no worker: never ends

    async def check() -> list[object]:
        aclient = AsyncClient(cyclone_dsn)
        follower = asyncio.ensure_future(collect(aclient.events(run_id)))
        waiter = asyncio.ensure_future(aclient.result(run_id))
        await until(lambda: waits_in_flight(aclient._client) == 2, what="the follower and the wait")
        await asyncio.wait_for(aclient.close(), 10)
        done, pending = await asyncio.wait({follower, waiter}, timeout=4)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return [outcome(follower, done), outcome(waiter, done)]

    assert asyncio.run(check()) == [ClientClosed, ClientClosed]


def test_acc_closing_a_sync_client_ends_its_event_follower_in_flight(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """The same for ``Client.events``: a follower iterating in another thread when the
    client closes ends with ClientClosed (at its next look), not when the run ends."""
    start_worker(acc_emit, acc_tail)
    run_id = client.submit(acc_live, 1).id  # one event, then waits for a signal
    other = Client(cyclone_dsn)
    seen = threading.Event()
    ended: list[object] = []

    def follow() -> None:
        try:
            for _ in other.events(run_id):
                seen.set()
            ended.append("the run ended")
        except Exception as exc:  # the test reads what ended it
            ended.append(type(exc))

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    assert seen.wait(20), "the follower saw no event"
    other.close()
    thread.join(10)
    assert ended == [ClientClosed]


def test_acc_fastapi_helpers_on_a_disconnect_and_on_a_shutdown(
    cyclone_dsn: str, client: Client
) -> None:
    """With the client from ``cyclone_lifespan``: a ``result_response`` request whose
    client disconnects (its task cancelled) closes its wait connection, and the next
    request is answered (202: not ended within its timeout). At shutdown, a
    ``result_response(timeout=None)`` and a ``status_events`` stream in flight end with
    ClientClosed (no hang), and the lifespan's exit returns."""
    pytest.importorskip("fastapi")
    from fastapi import FastAPI

    from cyclone_dsl.contrib.fastapi import cyclone_lifespan, result_response, status_events

    run_id = client.submit(acc_live, 0).id  # no worker: never ends
    app = FastAPI()

    async def serve() -> tuple[int, list[object]]:
        async with cyclone_lifespan(cyclone_dsn, pool_size=1)(app):
            aclient: AsyncClient = app.state.cyclone
            for i in range(20):  # disconnects at various moments
                request = asyncio.ensure_future(result_response(aclient, run_id, timeout=30))
                await asyncio.sleep(0.002 * (i % 5))
                request.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await request
            await until(
                lambda: waits_in_flight(aclient._client) == 0, what="the cancelled waits to leave"
            )
            answered = await result_response(aclient, run_id, timeout=0.05)

            streamed: list[dict[str, Any]] = []

            async def stream() -> None:
                async for status in status_events(aclient, run_id, interval=0.05):
                    streamed.append(status)

            held = asyncio.ensure_future(result_response(aclient, run_id, timeout=None))
            streaming = asyncio.ensure_future(stream())
            await until(lambda: streamed, what="the first status event")
            await until(
                lambda: waits_in_flight(aclient._client) == 1, what="the held request's wait"
            )
        # The lifespan has exited: the client is closed.
        done, pending = await asyncio.wait({held, streaming}, timeout=10)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        assert streamed[0]["state"] == "running"
        return answered.status_code, [outcome(held, done), outcome(streaming, done)]

    status, outcomes = asyncio.run(serve())
    assert status == 202
    assert outcomes == [ClientClosed, ClientClosed]


# -- writes cancelled -------------------------------------------------------------------------


def test_acc_a_retry_many_cancelled_while_its_progress_coroutine_awaits(
    cyclone_dsn: str, client: Client
) -> None:
    """A request cancelled while ``retry_many``'s progress coroutine awaits (it reports to a
    slow consumer): the batch it reported is retried whole, no later batch starts, and
    rerunning the call retries the rest."""
    runs = [h.id for h in client.submit_many(acc_live, [0] * 6)]
    client.cancel_many(RunFilter(workflows="acc_live"))
    where = RunFilter(workflows="acc_live", states=["cancelled"])

    async def check() -> list[int]:
        reported: list[int] = []
        async with AsyncClient(cyclone_dsn) as aclient:
            stuck = asyncio.Event()

            async def progress(so_far: BulkResult) -> None:
                reported.append(so_far.acted)
                await stuck.wait()  # never set: the request is cancelled here

            task = asyncio.ensure_future(aclient.retry_many(where, batch_size=2, progress=progress))
            await until(lambda: reported, what="the first batch to be reported")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        return reported

    assert asyncio.run(check()) == [2]
    states = [client.get_run(r).state for r in runs]
    assert states == [RunState.RUNNING] * 2 + [RunState.CANCELLED] * 4, states
    for r in runs[:2]:
        assert StepState.CANCELLED not in {s.state for s in client.get_run(r).steps}
    for r in runs[2:]:
        assert {s.state for s in client.get_run(r).steps} == {StepState.CANCELLED}
    again = client.retry_many(where)
    assert (again.matched, again.acted) == (4, 4)
    assert {client.get_run(r).state for r in runs} == {RunState.RUNNING}


def test_acc_a_submit_many_timed_out_right_before_close_lands_whole_or_not_at_all(
    cyclone_dsn: str, client: Client
) -> None:
    """``asyncio.wait_for(aclient.submit_many(...), tiny)`` then the app shuts down at once
    (close while the write's thread still runs): close does not hang, and each batch is
    all its runs (each whole: both steps) or none. The AsyncClient docstring says so:
    "the write is whole or absent"."""
    sizes = [150, 90, 30]

    async def check() -> list[str]:
        outcomes: list[str] = []
        for size in sizes:
            aclient = AsyncClient(cyclone_dsn, pool_size=1)
            try:
                await asyncio.wait_for(
                    aclient.submit_many(acc_plain, [size] * size), 0.0001 * (size // 30)
                )
                outcomes.append("ok")
            except TimeoutError:
                outcomes.append("timed out")
            await asyncio.wait_for(aclient.close(), 10)
        return outcomes

    outcomes = asyncio.run(check())  # returns once the executor's threads have ended
    assert "timed out" in outcomes, outcomes
    runs = client.list_runs(workflow="acc_plain", limit=1000)
    landed = [client.get_run(r.id) for r in runs]
    inputs = [run.input for run in landed]
    for size, seen in zip(sizes, outcomes, strict=True):
        count = inputs.count(size)
        assert count == size if seen == "ok" else count in (0, size), (size, count, seen)
    for run in landed:
        assert run.state is RunState.RUNNING
        assert {s.node for s in run.steps} == {"acc_head", "acc_tail"}, run.id


# -- handles survive their loop ---------------------------------------------------------------


def test_acc_a_handle_made_in_one_loop_waits_and_follows_in_another(
    cyclone_dsn: str, client: Client, start_worker: Callable[..., Worker]
) -> None:
    """An AsyncRunHandle returned from one ``asyncio.run`` (a startup script) is used in
    the next: wait(), result() and events() work there; after a cancelled wait in the
    second loop, a third loop still gets the result."""
    aclient = AsyncClient(cyclone_dsn, pool_size=1)

    async def submit() -> AsyncRunHandle:
        return await aclient.submit(acc_done, 2)

    handle = asyncio.run(submit())

    async def cancelled_wait() -> str:
        task = asyncio.ensure_future(handle.wait(timeout=60))
        await until(lambda: waits_in_flight(aclient._client) == 1, what="the wait to begin")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return "cancelled" if task.cancelled() else "ended"

    assert asyncio.run(cancelled_wait()) == "cancelled"
    start_worker(acc_emit, acc_tail)

    async def later() -> tuple[RunState, object, list[int]]:
        run = await handle.wait(timeout=30)
        return run.state, await handle.result(timeout=5), await collect(handle.events())

    assert asyncio.run(later()) == (RunState.COMPLETED, 2, [1, 2])
    asyncio.run(aclient.close())
