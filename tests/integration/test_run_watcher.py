"""Every wait of one client (``wait()``, ``result()``, sync and async) shares one connection
and one thread, and each keeps its own answer, deadline and error.

Runs here end by a signal the test sends, so no worker is needed and the test decides
when each run ends.
"""

from __future__ import annotations

import asyncio
import os
import resource
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from cyclone_dsl import AsyncClient, Client, RunNotFound, RunState, wait_signal, workflow
from cyclone_dsl.client import watch
from tests.integration.test_fka_audit import fork_children
from tests.waiting import wait_backends, wait_until, waits_in_flight


@workflow(name="rw_wait_go")
def wait_go(x):  # type: ignore[no-untyped-def]
    return wait_signal("rw_go")


@pytest.fixture
def waiter(cyclone_dsn: str) -> Iterator[Client]:
    with Client(cyclone_dsn) as client:
        yield client


def test_a_hundred_waits_of_one_client_share_one_connection(
    cyclone_dsn: str, client: Client, waiter: Client
) -> None:
    """60 threads in result() and 40 tasks of an AsyncClient: two wait connections (one
    per client), and each wait returns its own run's result once a signal ends it."""
    runs = [client.submit(wait_go, i).id for i in range(100)]
    others = wait_backends(cyclone_dsn)
    results: dict[int, Any] = {}

    def sync_wait(run_id: int) -> None:
        results[run_id] = waiter.result(run_id, timeout=60)

    threads = [threading.Thread(target=sync_wait, args=(r,)) for r in runs[:60]]
    for thread in threads:
        thread.start()

    async def async_waits(aclient: AsyncClient) -> list[Any]:
        return list(await asyncio.gather(*(aclient.result(r, timeout=60) for r in runs[60:])))

    async def main() -> list[Any]:
        async with AsyncClient(cyclone_dsn) as aclient:
            task = asyncio.ensure_future(async_waits(aclient))
            await asyncio.to_thread(
                wait_until,
                lambda: waits_in_flight(waiter) == 60 and waits_in_flight(aclient._client) == 40,
                what="every wait to begin",
            )
            # The watcher connects as it reads: it may not have yet when the waits began.
            wait_until(
                lambda: len(wait_backends(cyclone_dsn) - others) >= 2, what="the connections"
            )
            opened = wait_backends(cyclone_dsn) - others
            for run_id in runs:
                client.signal(run_id, "rw_go", f"go {run_id}")
            return [opened, await task]

    opened, async_results = asyncio.run(main())
    for thread in threads:
        thread.join(60)
    assert len(opened) == 2, opened
    assert results == {r: f"go {r}" for r in runs[:60]}
    assert async_results == [f"go {r}" for r in runs[60:]]


def test_each_wait_keeps_its_own_deadline_and_error(client: Client, waiter: Client) -> None:
    """On one client at once: a wait that times out, one for a run that does not exist,
    and one that goes on until its run ends; none answers for another."""
    slow, quick = client.submit(wait_go, 1).id, client.submit(wait_go, 2).id
    outcomes: dict[str, object] = {}

    def record(name: str, call: Any) -> None:
        try:
            outcomes[name] = call()
        except Exception as exc:  # the test reads what ended each wait
            outcomes[name] = exc

    threads = [
        threading.Thread(target=record, args=("slow", lambda: waiter.wait(slow, 60).state)),
        threading.Thread(target=record, args=("timeout", lambda: waiter.wait(quick, 0.3))),
        threading.Thread(target=record, args=("missing", lambda: waiter.wait(10**12, 30))),
    ]
    for thread in threads:
        thread.start()
    wait_until(lambda: "timeout" in outcomes and "missing" in outcomes, what="two waits to end")
    assert "slow" not in outcomes
    client.signal(slow, "rw_go", "now")
    for thread in threads:
        thread.join(30)
    assert outcomes["slow"] is RunState.COMPLETED
    timed_out = outcomes["timeout"]
    assert isinstance(timed_out, TimeoutError), timed_out
    assert f"run {quick} is still running" in str(timed_out)
    assert isinstance(outcomes["missing"], RunNotFound)


def test_a_wait_with_no_time_left_reads_the_run_once(client: Client, waiter: Client) -> None:
    ended = client.submit(wait_go, 1).id
    client.signal(ended, "rw_go", "done")
    assert waiter.result(ended, timeout=0) == "done"
    going = client.submit(wait_go, 2).id
    with pytest.raises(TimeoutError, match="still running"):
        waiter.wait(going, timeout=0)


def test_an_idle_watcher_gives_its_connection_back_and_starts_again(
    cyclone_dsn: str, client: Client, waiter: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watch, "IDLE_SECONDS", 0.3)
    others = wait_backends(cyclone_dsn)
    run_id = client.submit(wait_go, 1).id
    client.signal(run_id, "rw_go", "first")
    assert waiter.result(run_id, timeout=10) == "first"
    wait_until(lambda: not wait_backends(cyclone_dsn) - others, what="the connection to close")
    again = client.submit(wait_go, 2).id
    client.signal(again, "rw_go", "second")
    assert waiter.result(again, timeout=10) == "second"


def test_waits_through_a_pooled_dsn_poll_on_one_connection(
    cyclone_dsn: str, client: Client
) -> None:
    """``pooled=True`` and no ``listen_dsn``: no LISTEN; the waits read every 0.25 s, all
    on one connection."""
    runs = [client.submit(wait_go, i).id for i in range(20)]
    others = wait_backends(cyclone_dsn)
    with Client(cyclone_dsn, pooled=True) as pooled:
        assert not pooled.wait_route.listen
        results: dict[int, Any] = {}
        threads = [
            threading.Thread(target=lambda r=r: results.update({r: pooled.result(r, timeout=30)}))
            for r in runs
        ]
        for thread in threads:
            thread.start()
        wait_until(lambda: waits_in_flight(pooled) == 20, what="every wait to begin")
        # The watcher connects as it reads: it may not have yet when the waits began.
        wait_until(lambda: len(wait_backends(cyclone_dsn) - others) >= 1, what="the connections")
        opened = wait_backends(cyclone_dsn) - others
        for run_id in runs:
            client.signal(run_id, "rw_go", run_id)
        for thread in threads:
            thread.join(30)
    assert len(opened) == 1, opened
    assert results == {r: r for r in runs}


def test_a_forked_child_waits_on_its_own_connection_and_leaves_the_parents(
    cyclone_dsn: str, client: Client, waiter: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parent's watcher is connected when the child forks: the child's waits open a
    connection of their own, and the parent's goes on (a child that used or closed the
    inherited one would end the parent's session)."""
    monkeypatch.setattr(watch, "IDLE_SECONDS", 60.0)
    first = client.submit(wait_go, 1).id
    client.signal(first, "rw_go", "parent")
    assert waiter.result(first, timeout=10) == "parent"
    parents = wait_backends(cyclone_dsn)
    ended = client.submit(wait_go, 2).id
    client.signal(ended, "rw_go", "child")

    def in_child(_: int) -> object:
        value = waiter.result(ended, timeout=10)
        waiter.close()
        return value

    [report] = fork_children(1, in_child, bound=20)
    assert report == {"ok": True, "value": "child"}
    assert parents <= wait_backends(cyclone_dsn)  # the parent's session is still there
    later = client.submit(wait_go, 3).id
    client.signal(later, "rw_go", "after")
    assert waiter.result(later, timeout=10) == "after"


def test_waits_work_in_a_process_with_descriptors_past_1024(
    cyclone_dsn: str, client: Client
) -> None:
    """A busy server process (a web app with many open sockets) gets descriptors past 1024,
    which select() refuses: the watcher's connection and wake-up socket are among them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if min(hard, 4096) < 1200:
        pytest.skip(f"this process may open only {hard} files")
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        with Client(cyclone_dsn) as waiter:
            run_id = client.submit(wait_go, 1).id
            thread = threading.Thread(
                target=lambda: client.signal(run_id, "rw_go", "high"), daemon=True
            )
            timer = threading.Timer(0.3, thread.start)
            timer.start()
            assert waiter.result(run_id, timeout=20) == "high"
            assert waiter._watcher._wake is not None
            assert waiter._watcher._wake[0].fileno() > 1024
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_waits_failed_by_one_error_each_raise_their_own_copy(
    cyclone_dsn: str, client: Client, waiter: Client
) -> None:
    """A read that fails with an error that is not a lost connection (here the runs table
    is gone) ends every wait and follower with that error; each raises an object of its
    own, caused by the one the read raised (one object raised in several threads at once
    would mix their tracebacks)."""
    run_id = client.submit(wait_go, 1).id
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            waiter.result(run_id, timeout=30)
        except Exception as exc:  # the test reads what ended it
            errors.append(exc)

    def follow() -> None:
        try:
            list(waiter.events(run_id, timeout=30))
        except Exception as exc:  # the test reads what ended it
            errors.append(exc)

    threads = [threading.Thread(target=wait) for _ in range(3)]
    threads.append(threading.Thread(target=follow))
    for thread in threads:
        thread.start()
    wait_until(lambda: waits_in_flight(waiter) == 4, what="every wait to begin")
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE cyclone_runs RENAME TO cyclone_runs_gone")
        try:
            for thread in threads:
                thread.join(30)
        finally:
            conn.execute("ALTER TABLE cyclone_runs_gone RENAME TO cyclone_runs")
    assert len(errors) == 4
    assert {type(e) for e in errors} == {psycopg.errors.UndefinedTable}
    assert len({id(e) for e in errors}) == 4
    # One read's error (the waits' states and the follower's page may be read apart, on a
    # loaded machine: then two reads failed, each error copied for its callers).
    causes = {id(e.__cause__): e.__cause__ for e in errors}
    assert 1 <= len(causes) <= 2
    assert all(isinstance(c, psycopg.errors.UndefinedTable) for c in causes.values())
    assert not set(causes) & {id(e) for e in errors}
