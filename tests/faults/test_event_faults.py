"""Following a run's events across a cut connection: a sync and an async follower reach the
server through :class:`TcpProxy`, which cuts their connections mid-stream; both still get
every event, in order, once each."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import psycopg
import pytest

from cyclone_dsl import AsyncClient, Client, RunState, StepContext, StepEvent, Worker, step
from tests.faults.conftest import wait_for
from tests.faults.tcp_proxy import TcpProxy

FOLLOW = b"cyclone-wait"  # a client follows events on its wait connection
EVENTS = 1000
HALF = EVENTS // 2

gate = threading.Event()


@step(name="evf_stream")
def stream(n: int, ctx: StepContext) -> int:
    for i in range(n):
        if i == HALF:
            gate.wait(30)  # the followers' connections are cut here
        ctx.emit(i)
    return n


@pytest.fixture
def proxy(cyclone_dsn: str) -> Iterator[tuple[TcpProxy, str]]:
    """A proxy in front of the test server's Unix socket, and the DSN through it."""
    params = psycopg.conninfo.conninfo_to_dict(cyclone_dsn)
    socket = f"{params['host']}/.s.PGSQL.{params.get('port') or 5432}"
    with TcpProxy("127.0.0.1", 0, upstream_socket=socket) as running:
        params.update(host="127.0.0.1", port=running.port, sslmode="disable", gssencmode="disable")
        yield running, psycopg.conninfo.make_conninfo(**params)


@pytest.mark.timeout(90)
def test_a_thousand_events_reach_both_followers_across_a_cut(
    cyclone_dsn: str, proxy: tuple[TcpProxy, str]
) -> None:
    net, through_proxy = proxy
    gate.clear()
    seen_sync: list[StepEvent] = []
    seen_async: list[StepEvent] = []
    with Client(through_proxy) as client:
        handle = client.enqueue(stream, EVENTS)

        def follow_sync() -> None:
            seen_sync.extend(handle.events(timeout=60))

        async def follow_async() -> None:
            async with AsyncClient(through_proxy) as aclient:
                async for event in aclient.handle(handle.id).events(timeout=60):
                    seen_async.append(event)

        followers = [
            threading.Thread(target=follow_sync, daemon=True),
            threading.Thread(target=lambda: asyncio.run(follow_async()), daemon=True),
        ]
        for thread in followers:
            thread.start()
        with Worker(cyclone_dsn, [stream], poll_interval=0.2):
            wait_for(lambda: len(seen_sync) >= HALF and len(seen_async) >= HALF, timeout=30)
            assert net.cut(FOLLOW) == 2  # both followers, mid-stream
            gate.set()
            for thread in followers:
                thread.join(60)
            assert handle.wait(timeout=10).state is RunState.COMPLETED
    assert net.seen(FOLLOW) >= 4  # both reconnected
    for seen in (seen_sync, seen_async):
        assert [e.seq for e in seen] == list(range(1, EVENTS + 1))
        assert [e.data for e in seen] == list(range(EVENTS))
        assert not any(e.fenced for e in seen)
