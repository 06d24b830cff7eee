"""Audit: the client's run watcher (cyclone_dsl/client/watch.py): every ``wait()`` and
``result()`` of one client, sync or async, shares one connection and one thread
(docs/concepts/runs-and-steps.md "Wake-ups", docs/howto/scale.md).

Runs here end by a signal (or a cancel) the test sends, so no worker is needed. Each wait
must end with its own answer, promptly, and never hang.

Tests marked ``xfail(strict=True)`` show a finding: they fail today and pass once fixed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cyclone_dsl import (
    AsyncClient,
    Client,
    ClientClosed,
    InvalidArgument,
    RunFailed,
    RunNotFound,
    RunState,
    wait_signal,
    workflow,
)
from cyclone_dsl.client import handle, watch
from tests.waiting import wait_backends, wait_until, waits_in_flight


@workflow(name="rwa_gate")
def rwa_gate(x):  # type: ignore[no-untyped-def]
    return wait_signal("rwa_go")


# -- helpers ----------------------------------------------------------------------------------


def watcher_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "cyclone-wait" and t.is_alive()}


def gate(client: Client) -> int:
    return client.submit(rwa_gate, None).id


def ended(client: Client, value: object = "done") -> int:
    run_id = gate(client)
    client.signal(run_id, "rwa_go", value)
    return run_id


async def until(predicate: Callable[[], object], *, what: str, timeout: float = 20.0) -> None:
    """``wait_until`` for a coroutine: polls without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout:g}s for {what}")
        await asyncio.sleep(0.01)


def caught(call: Callable[[], Any]) -> object:
    try:
        return call()
    except Exception as exc:  # the test reads what ended the call
        return exc


class Waits:
    """Sync waits in threads, each recording how it ended and when."""

    def __init__(self) -> None:
        self.outcomes: dict[str, object] = {}
        self.took: dict[str, float] = {}
        self.threads: list[threading.Thread] = []

    def start(self, name: str, call: Callable[[], Any]) -> None:
        def run() -> None:
            began = time.monotonic()
            outcome = caught(call)
            self.took[name] = time.monotonic() - began
            self.outcomes[name] = outcome

        thread = threading.Thread(target=run, daemon=True)
        self.threads.append(thread)
        thread.start()

    def join(self, bound: float = 20.0) -> None:
        deadline = time.monotonic() + bound
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        hung = [t for t in self.threads if t.is_alive()]
        assert not hung, f"{len(hung)} waits hung"


@pytest.fixture
def waiter(cyclone_dsn: str) -> Iterator[Client]:
    with Client(cyclone_dsn) as c:
        yield c


@pytest.fixture
def no_recheck(monkeypatch: pytest.MonkeyPatch) -> None:
    """The watcher's once-a-second fallback read pushed out of the tests' reach: a wait
    then ends only by its own first read or by a notification, as the docs describe."""
    monkeypatch.setattr(handle, "RECHECK_SECONDS", 120.0)


# -- arguments, single waits, their own errors ----------------------------------------------


BAD_TIMEOUTS: list[object] = [-1, -0.001, math.nan, -math.inf, "1", b"1", True, [1], 1j]


def test_rwa_a_bad_timeout_is_refused_before_any_io(cyclone_dsn: str, client: Client) -> None:
    """Every twin refuses a negative, NaN or non-numeric timeout with InvalidArgument
    before a wait begins: no watcher thread is started, no connection opened, even for a
    run that does not exist."""
    run_id = gate(client)
    before = wait_backends(cyclone_dsn)
    with Client(cyclone_dsn) as waiter:
        h = waiter.handle(run_id)
        sync_calls: list[Callable[[Any], object]] = [
            lambda t: waiter.wait(run_id, t),
            lambda t: waiter.result(10**12, t),
            lambda t: h.wait(t),
            lambda t: h.result(t),
        ]
        for timeout in BAD_TIMEOUTS:
            for call in sync_calls:
                with pytest.raises(InvalidArgument):
                    call(timeout)
        assert waiter._watcher._thread is None

        async def twins() -> list[object]:
            accepted: list[object] = []
            async with AsyncClient(cyclone_dsn) as aclient:
                ah = aclient.handle(run_id)
                for timeout in BAD_TIMEOUTS:
                    for coro in (
                        aclient.wait(run_id, timeout),  # type: ignore[arg-type]
                        aclient.result(10**12, timeout),  # type: ignore[arg-type]
                        ah.wait(timeout),  # type: ignore[arg-type]
                        ah.result(timeout),  # type: ignore[arg-type]
                    ):
                        try:
                            await coro
                        except InvalidArgument:
                            continue
                        accepted.append(timeout)
                assert aclient._client._watcher._thread is None
            return accepted

        assert asyncio.run(twins()) == []
        assert not wait_backends(cyclone_dsn) - before


def test_rwa_timeout_zero_reads_an_ended_run_once(client: Client, waiter: Client) -> None:
    """timeout=0: an ended run is returned (every twin); a running one raises TimeoutError
    naming its state and the timeout; a missing one raises RunNotFound."""
    done = ended(client, {"v": 1})
    going = gate(client)
    cancelled = gate(client)
    client.cancel(cancelled)
    assert waiter.wait(done, timeout=0).state is RunState.COMPLETED
    assert waiter.result(done, timeout=0) == {"v": 1}
    assert waiter.handle(done).result(0) == {"v": 1}
    assert waiter.wait(cancelled, 0).state is RunState.CANCELLED
    with pytest.raises(RunFailed):
        waiter.result(cancelled, 0)
    with pytest.raises(TimeoutError, match=rf"^run {going} is still running after 0s$"):
        waiter.wait(going, timeout=0)
    with pytest.raises(RunNotFound):
        waiter.result(10**12, timeout=0)

    async def twins() -> list[object]:
        async with AsyncClient(waiter.dsn) as aclient:
            return [
                (await aclient.wait(done, 0)).state,
                await aclient.handle(done).result(0.0),
                caught_type(await await_caught(aclient.result(cancelled, 0))),
                str(await await_caught(aclient.handle(going).wait(0))),
                caught_type(await await_caught(aclient.wait(-5, 0))),
            ]

    assert asyncio.run(twins()) == [
        RunState.COMPLETED,
        {"v": 1},
        RunFailed,
        f"run {going} is still running after 0s",
        RunNotFound,
    ]


def caught_type(outcome: object) -> object:
    return type(outcome) if isinstance(outcome, BaseException) else outcome


async def await_caught(coro: Any) -> object:
    try:
        return await coro
    except Exception as exc:  # the test reads what ended the call
        return exc


def test_rwa_each_wait_on_one_client_keeps_its_own_error(
    client: Client, waiter: Client, no_recheck: None
) -> None:
    """At once on one client: waits that time out (sync and async, each at its own
    timeout), waits for missing ids, and waits that go on; only the run's signal ends
    the last ones, each with its own run's result."""
    a, b = gate(client), gate(client)
    waits = Waits()
    waits.start("a", lambda: waiter.result(a, 30))
    waits.start("b", lambda: waiter.handle(b).result(30))
    waits.start("t1", lambda: waiter.wait(a, 0.2))
    waits.start("t2", lambda: waiter.result(b, 0.5))
    waits.start("missing", lambda: waiter.wait(10**15, 30))
    waits.start("zero", lambda: waiter.result(0, None))

    async def async_side() -> list[object]:
        async with AsyncClient(waiter.dsn) as aclient:
            return [
                caught_type(o) if not isinstance(o, TimeoutError) else str(o)
                for o in await asyncio.gather(
                    await_caught(aclient.wait(a, 0.3)),
                    await_caught(aclient.result(2**63 - 1, 30)),
                )
            ]

    assert asyncio.run(async_side()) == [f"run {a} is still running after 0.3s", RunNotFound]
    wait_until(lambda: len(waits.outcomes) == 4, what="four waits to end")
    assert "a" not in waits.outcomes and "b" not in waits.outcomes
    client.signal(a, "rwa_go", "A")
    client.signal(b, "rwa_go", "B")
    waits.join()
    o = waits.outcomes
    assert (o["a"], o["b"]) == ("A", "B")
    assert str(o["t1"]) == f"run {a} is still running after 0.2s"
    assert str(o["t2"]) == f"run {b} is still running after 0.5s"
    assert isinstance(o["missing"], RunNotFound) and isinstance(o["zero"], RunNotFound)


def test_rwa_a_cancelled_run_ends_its_waits_promptly(
    client: Client, waiter: Client, no_recheck: None
) -> None:
    """A cancel ends the waits by its notification (the fallback read is out of reach):
    wait() returns the cancelled run, result() raises RunFailed, sync and async."""
    run_id = gate(client)
    waits = Waits()
    waits.start("wait", lambda: waiter.wait(run_id, 20).state)
    waits.start("result", lambda: waiter.handle(run_id).result(20))

    async def async_side() -> list[object]:
        async with AsyncClient(waiter.dsn) as aclient:
            tasks = [
                asyncio.ensure_future(await_caught(aclient.result(run_id, 20))),
                asyncio.ensure_future(await_caught(aclient.handle(run_id).wait(20))),
            ]
            await until(
                lambda: waits_in_flight(aclient._client) == 2 and waits_in_flight(waiter) == 2,
                what="four waits to begin",
            )
            await asyncio.to_thread(client.cancel, run_id)
            results = await asyncio.gather(*tasks)
            return [caught_type(results[0]), results[1].state]  # type: ignore[union-attr]

    assert asyncio.run(async_side()) == [RunFailed, RunState.CANCELLED]
    waits.join()
    assert waits.outcomes["wait"] is RunState.CANCELLED
    assert isinstance(waits.outcomes["result"], RunFailed)


def test_rwa_a_run_that_ends_as_the_wait_begins_is_seen(
    cyclone_dsn: str, client: Client, no_recheck: None
) -> None:
    """The run ends while the wait begins: before the watcher connects (a new client),
    between the LISTEN and the first read, or just after: each wait ends, by its first
    read or by the notification, never by the fallback read."""
    for i in range(8):
        run_id = gate(client)
        with Client(cyclone_dsn) as waiter:
            signaller = threading.Thread(target=client.signal, args=(run_id, "rwa_go", i))
            waits = Waits()
            if i % 2:
                signaller.start()
                waits.start("w", lambda: waiter.result(run_id, 20))  # noqa: B023
            else:
                waits.start("w", lambda: waiter.result(run_id, 20))  # noqa: B023
                signaller.start()
            signaller.join()
            waits.join(25)
            assert waits.outcomes["w"] == i


def test_rwa_many_waits_on_one_run_cancelled_or_timed_out_leave_the_others(
    cyclone_dsn: str, client: Client, waiter: Client, no_recheck: None
) -> None:
    """20 threads and 20 tasks wait on the same run: some time out, some tasks are
    cancelled (task.cancel, asyncio.wait_for); the rest return its result once the
    signal comes, at once."""
    run_id = gate(client)
    waits = Waits()
    for i in range(20):
        timeout = 0.2 if i % 4 == 0 else 30
        waits.start(f"s{i}", lambda t=timeout: waiter.result(run_id, t))

    async def async_side() -> dict[str, object]:
        async with AsyncClient(cyclone_dsn) as aclient:
            ah = aclient.handle(run_id)
            tasks: dict[str, asyncio.Future[Any]] = {}
            for i in range(20):
                if i % 4 == 0:
                    coro = asyncio.wait_for(ah.result(), 0.1)
                elif i % 4 == 1:
                    coro = ah.result(0.2)
                else:
                    coro = aclient.result(run_id)
                tasks[f"a{i}"] = asyncio.ensure_future(coro)
            await until(
                lambda: waits_in_flight(waiter) >= 15 and waits_in_flight(aclient._client) >= 15,
                what="the waits to begin",
            )
            for i in range(2, 20, 4):
                tasks[f"a{i}"].cancel()
            await asyncio.sleep(0)
            # the sync waits with 0.2 s timed out
            await until(lambda: len(waits.outcomes) == 5, what="five timeouts")
            await asyncio.wait([tasks[f"a{i}"] for i in range(1, 20, 4)])
            await asyncio.to_thread(client.signal, run_id, "rwa_go", "all")
            done, _ = await asyncio.wait(tasks.values(), timeout=20)
            out: dict[str, object] = {}
            for name, task in tasks.items():
                if task not in done:
                    out[name] = "hung"
                elif task.cancelled():
                    out[name] = "cancelled"
                else:
                    out[name] = caught_type(task.exception() or task.result())
            return out

    got = asyncio.run(async_side())
    waits.join()
    for i in range(20):
        want = {0: TimeoutError, 1: TimeoutError, 2: "cancelled", 3: "all"}[i % 4]
        assert got[f"a{i}"] == want, (i, got)
        s = waits.outcomes[f"s{i}"]
        if i % 4 == 0:
            assert str(s) == f"run {run_id} is still running after 0.2s"
        else:
            assert s == "all"
    assert waits_in_flight(waiter) == 0


# -- the watcher retiring after its idle time -------------------------------------------------


def test_rwa_waits_that_begin_as_the_watcher_retires_never_hang(
    cyclone_dsn: str, client: Client, monkeypatch: pytest.MonkeyPatch, no_recheck: None
) -> None:
    """IDLE_SECONDS=0.05: waits begin, sync and async, at moments spread around the
    watcher's retirement; each ends by its first read, well before its timeout."""
    monkeypatch.setattr(watch, "IDLE_SECONDS", 0.05)
    done = [ended(client, i) for i in range(3)]
    with Client(cyclone_dsn) as waiter:
        slowest = 0.0
        for i in range(18):
            began = time.monotonic()
            assert waiter.result(done[i % 3], timeout=20) == i % 3
            slowest = max(slowest, time.monotonic() - began)
            time.sleep(0.035 + (i % 6) * 0.006)  # around the 0.05 s retirement
        assert slowest < 10, slowest

        async def async_side() -> float:
            worst = 0.0
            async with AsyncClient(cyclone_dsn) as aclient:
                for i in range(18):
                    began = time.monotonic()
                    assert await aclient.result(done[i % 3], timeout=20) == i % 3
                    worst = max(worst, time.monotonic() - began)
                    await asyncio.sleep(0.035 + (i % 6) * 0.006)
            return worst

        assert asyncio.run(async_side()) < 10


def test_rwa_threads_racing_the_retirement_all_get_their_answer(
    cyclone_dsn: str, client: Client, monkeypatch: pytest.MonkeyPatch, no_recheck: None
) -> None:
    """Six threads each begin short waits in a tight loop, pausing around the idle time,
    while runs end: every wait returns its run's result, none hangs."""
    monkeypatch.setattr(watch, "IDLE_SECONDS", 0.05)
    with Client(cyclone_dsn) as waiter:
        done = [ended(client, i) for i in range(4)]
        problems: list[object] = []

        def loop(k: int) -> None:
            for i in range(12):
                run_id = done[(i + k) % 4]
                began = time.monotonic()
                got = caught(lambda r=run_id: waiter.result(r, 20))
                if got != (i + k) % 4 or time.monotonic() - began > 10:
                    problems.append((k, i, got, time.monotonic() - began))
                time.sleep(0.04 + 0.005 * ((i * k) % 5))

        threads = [threading.Thread(target=loop, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert problems == []


# -- the pooled route (no LISTEN: polling) ----------------------------------------------------


def test_rwa_pooled_route_answers_each_wait(cyclone_dsn: str, client: Client) -> None:
    """``pooled=True``, no listen_dsn: a missing run, a timeout, timeout=0 on an ended run,
    a cancel (RunFailed), a signal, and a close ending a wait in flight."""
    done = ended(client, "d")
    going, cancelled, closing = gate(client), gate(client), gate(client)
    with Client(cyclone_dsn, pooled=True) as pooled:
        assert not pooled.wait_route.listen
        assert pooled.result(done, timeout=0) == "d"
        with pytest.raises(RunNotFound):
            pooled.wait(10**12, 10)
        with pytest.raises(TimeoutError, match=rf"^run {going} is still running after 0.3s$"):
            pooled.wait(going, 0.3)
        waits = Waits()
        waits.start("cancelled", lambda: pooled.result(cancelled, 20))
        waits.start("signalled", lambda: pooled.handle(going).result(20))
        waits.start("closing", lambda: pooled.wait(closing, None))
        wait_until(lambda: waits_in_flight(pooled) == 3, what="three waits to begin")
        client.cancel(cancelled)
        client.signal(going, "rwa_go", "g")
        wait_until(lambda: len(waits.outcomes) == 2, what="two waits to end")
    waits.join(10)
    assert isinstance(waits.outcomes["cancelled"], RunFailed)
    assert waits.outcomes["signalled"] == "g"
    assert isinstance(waits.outcomes["closing"], ClientClosed)
    assert waits.took["closing"] < 10


# -- closing the client -----------------------------------------------------------------------


def test_rwa_closing_from_another_thread_ends_50_waits_at_once(
    cyclone_dsn: str, client: Client
) -> None:
    """50 sync waits (no timeout, with timeouts, missing-free) on a client closed from
    another thread: all end with ClientClosed within seconds; its connection and thread
    are gone."""
    runs = [gate(client) for _ in range(5)]
    threads_before = watcher_threads()
    conns_before = wait_backends(cyclone_dsn)
    waiter = Client(cyclone_dsn)
    waits = Waits()
    for i in range(50):
        timeout = None if i % 2 else 60
        waits.start(str(i), lambda r=runs[i % 5], t=timeout: waiter.wait(r, t))
    wait_until(lambda: waits_in_flight(waiter) == 50, what="every wait to begin")
    wait_until(lambda: wait_backends(cyclone_dsn) - conns_before, what="the wait connection")
    closer = threading.Thread(target=waiter.close)
    closer.start()
    waits.join(10)
    closer.join(10)
    assert {type(o) for o in waits.outcomes.values()} == {ClientClosed}
    assert max(waits.took.values()) < 10
    wait_until(lambda: not (watcher_threads() - threads_before), what="the thread to end")
    wait_until(lambda: wait_backends(cyclone_dsn) <= conns_before, what="the connection")


def test_rwa_closing_an_async_client_from_another_thread_ends_its_tasks(
    cyclone_dsn: str, client: Client
) -> None:
    runs = [gate(client) for _ in range(5)]
    threads_before = watcher_threads()
    conns_before = wait_backends(cyclone_dsn)

    async def main() -> tuple[list[object], float]:
        aclient = AsyncClient(cyclone_dsn)
        tasks = [
            asyncio.ensure_future(
                await_caught(
                    aclient.result(runs[i % 5], None if i % 2 else 60)
                    if i % 3
                    else aclient.handle(runs[i % 5]).wait()
                )
            )
            for i in range(50)
        ]
        await until(lambda: waits_in_flight(aclient._client) == 50, what="every wait to begin")
        began = time.monotonic()
        closer = threading.Thread(target=lambda: asyncio.run(aclient.close()))
        closer.start()
        done, _ = await asyncio.wait(tasks, timeout=10)
        took = time.monotonic() - began
        await asyncio.to_thread(closer.join, 10)
        return [caught_type(t.result()) if t in done else "hung" for t in tasks], took

    outcomes, took = asyncio.run(main())
    assert set(outcomes) == {ClientClosed}, outcomes
    assert took < 10
    wait_until(lambda: not (watcher_threads() - threads_before), what="the thread to end")
    wait_until(lambda: wait_backends(cyclone_dsn) <= conns_before, what="the connection")


# -- random interleavings -------------------------------------------------------------------

RUNS = 3
TIMEOUTS = [None, 0.1, 30.0]
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.sampled_from(["sync", "async"]),
            st.integers(0, RUNS - 1),
            st.sampled_from(["wait", "result"]),
            st.sampled_from(TIMEOUTS),
        ),
        st.tuples(st.sampled_from(["signal", "cancel"]), st.integers(0, RUNS - 1)),
        st.tuples(st.just("drop"), st.integers(0, 30)),
        st.tuples(st.just("missing"), st.sampled_from(["sync", "async"])),
    ),
    min_size=1,
    max_size=12,
)


@pytest.fixture
def background_loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=OPS)
def test_rwa_random_interleavings_end_every_wait_as_the_database_says(
    cyclone_dsn: str,
    client: Client,
    background_loop: asyncio.AbstractEventLoop,
    monkeypatch: pytest.MonkeyPatch,
    ops: list[tuple[Any, ...]],
) -> None:
    """Waits (sync threads, async tasks, wait() or result(), with or without a timeout)
    begin on a few runs, runs end by a signal or a cancel, async waits are cancelled, and
    the clients close: each wait ends with what the database says, and no wait connection
    nor watcher thread of the clients is left. The watcher retires after 0.05 s idle and
    the fallback read is out of reach (a wait must be answered by a read or a NOTIFY)."""
    monkeypatch.setattr(watch, "IDLE_SECONDS", 0.05)
    monkeypatch.setattr(handle, "RECHECK_SECONDS", 120.0)
    loop = background_loop
    threads_before = watcher_threads()
    conns_before = wait_backends(cyclone_dsn)
    runs = [gate(client) for _ in range(RUNS)]
    ends: dict[int, tuple[str, int]] = {}  # run id -> how it ended, and at which op
    waiter = Client(cyclone_dsn)
    aclient = AsyncClient(cyclone_dsn)
    waits: list[dict[str, Any]] = []

    def begin(kind: str, run_id: int, method: str, timeout: float | None, at: int) -> None:
        future: concurrent.futures.Future[Any]
        if kind == "sync":
            future = concurrent.futures.Future()

            def run() -> None:
                call = waiter.wait if method == "wait" else waiter.result
                try:
                    future.set_result(call(run_id, timeout))
                except Exception as exc:  # the test reads what ended the wait
                    future.set_exception(exc)

            threading.Thread(target=run, daemon=True).start()
        else:
            acall = aclient.wait if method == "wait" else aclient.result
            future = asyncio.run_coroutine_threadsafe(acall(run_id, timeout), loop)
        waits.append(
            {
                "kind": kind,
                "run": run_id,
                "method": method,
                "timeout": timeout,
                "at": at,
                "future": future,
                "dropped": False,
            }
        )

    for at, op in enumerate(ops):
        if op[0] in ("sync", "async"):
            begin(op[0], runs[op[1]], op[2], op[3], at)
        elif op[0] == "missing":
            begin(op[1], 10**12 + at, "result", 30.0, at)
        elif op[0] in ("signal", "cancel"):
            run_id = runs[op[1]]
            if op[0] == "signal":
                outcome = caught(lambda r=run_id, v=at: client.signal(r, "rwa_go", v))
            else:
                outcome = caught(lambda r=run_id: client.cancel(r))
            if run_id not in ends:
                assert not isinstance(outcome, Exception), outcome
                ends[run_id] = (op[0], at)
        else:
            asyncs = [w for w in waits if w["kind"] == "async"]
            if asyncs:
                chosen = asyncs[op[1] % len(asyncs)]
                chosen["dropped"] = True
                chosen["future"].cancel()

    def settled(w: dict[str, Any]) -> bool:
        return (
            w["run"] in ends
            or w["timeout"] == 0.1
            or w["run"] not in runs
            or (w["dropped"] and w["kind"] == "async")
        )

    # Every wait whose run ended, or whose timeout passed, ends without the close.
    bound = time.monotonic() + 15
    for w in waits:
        if settled(w):
            concurrent.futures.wait([w["future"]], max(0.0, bound - time.monotonic()))
            assert w["future"].done(), f"a wait hung: {w}, ends={ends}"
    open_at_close = [w for w in waits if not w["future"].done()]
    waiter.close()
    asyncio.run_coroutine_threadsafe(aclient.close(), loop).result(15)
    concurrent.futures.wait([w["future"] for w in waits], 10)
    assert all(w["future"].done() for w in waits), "a wait outlived the close"

    for w in waits:
        future: concurrent.futures.Future[Any] = w["future"]
        run_id = w["run"]
        if future.cancelled():
            assert w["dropped"], w
            continue
        error = future.exception()
        if isinstance(error, ClientClosed):
            assert w in open_at_close, w
        elif isinstance(error, RunNotFound):
            assert run_id not in runs, w
        elif isinstance(error, TimeoutError):
            assert w["timeout"] == 0.1, w
            assert str(error) == f"run {run_id} is still running after 0.1s", w
        elif isinstance(error, RunFailed):
            assert w["method"] == "result" and ends.get(run_id, ("",))[0] == "cancel", w
        elif error is not None:
            raise error
        else:
            how = ends.get(run_id)
            assert how is not None, f"a wait returned for a run that did not end: {w}"
            state = client.get_run(run_id).state
            assert state is (RunState.COMPLETED if how[0] == "signal" else RunState.CANCELLED)
            value = future.result()
            if w["method"] == "wait":
                assert value.state is state, w
            else:
                assert how[0] == "signal" and value == how[1], (w, value, how)
    wait_until(lambda: not (watcher_threads() - threads_before), what="the watchers to end")
    wait_until(lambda: wait_backends(cyclone_dsn) <= conns_before, what="the connections")


# -- a read in flight answers a wait that began after its snapshot ----------------------------


def test_rwa_timeout_zero_on_a_run_ended_before_the_wait_began_returns_it(
    client: Client, waiter: Client
) -> None:
    """Other waits of the client read run R again and again (each begins with a read);
    R ends (the signal has committed), then a wait with timeout=0 begins: R ended before
    it began, so it must return R. Repeated until a wait does not, within a bound."""
    stale: list[str] = []
    stop = threading.Event()
    current = [gate(client)]

    def others() -> None:
        while not stop.is_set():
            caught(lambda: waiter.wait(current[0], timeout=0))

    threads = [threading.Thread(target=others) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        bound = time.monotonic() + 8
        while not stale and time.monotonic() < bound:
            run_id = current[0]
            client.signal(run_id, "rwa_go", "over")
            got = caught(lambda: waiter.wait(run_id, timeout=0))  # noqa: B023
            if isinstance(got, TimeoutError):
                stale.append(str(got))
            elif isinstance(got, Exception):
                raise got
            else:
                assert got.state is RunState.COMPLETED  # type: ignore[attr-defined]
            current[0] = gate(client)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    assert stale == []
