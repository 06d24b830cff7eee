"""Network faults between a worker and PostgreSQL (RELIABILITY.md scenario 6 and load).

The worker reaches a private PostgreSQL through :class:`TcpProxy`, which cuts,
delays or blackholes its connections; the client talks to the server directly.
Workers poll only every 60 s, so a step that starts within seconds was woken
by a notification: a dead listener cannot hide behind the poll.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import attrs
import psycopg
import pytest

from cyclone_dsl import AsyncClient, Client, ClientClosed, Worker, migrate, step
from cyclone_dsl.client.handle import RunHandle
from cyclone_dsl.db.connect import KEEPALIVE
from cyclone_dsl.db.embedded import EmbeddedServer
from cyclone_dsl.db.listen import PING_TIMEOUT_S
from cyclone_dsl.states import RunState, StepState
from tests.faults.conftest import wait_for
from tests.faults.tcp_proxy import TcpProxy

LISTEN = b"cyclone-listen"
#: Far longer than any test waits: only NOTIFY (or a listener's reconnect) wakes the worker.
POLL = 60.0

calls: Counter[int] = Counter()
calls_lock = threading.Lock()


@step(name="nf_echo", max_attempts=3)
def echo(x: int) -> int:
    return x


@step(name="nf_work", max_attempts=10)
def work(x: int) -> int:
    with calls_lock:
        calls[x] += 1
    time.sleep(0.1)
    return x * 2


@attrs.frozen
class Network:
    direct: str  # the server's own URL (Unix socket): clients and checks
    through_proxy: str  # TCP through the proxy: the worker
    proxy: TcpProxy


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def network() -> Iterator[Network]:
    # Not under pytest's basetemp: another pytest session starting meanwhile strips the
    # o+x bit from /tmp/pytest-of-<user>, and a server run by a service user (as root)
    # then cannot reach its own folder.
    folder = Path(tempfile.mkdtemp(prefix="cyclone-netfaults-"))
    server = EmbeddedServer(folder / "data", port=free_port())
    try:
        server.start()
        migrate(server.url)
        with TcpProxy("127.0.0.1", server.port or 5432) as proxy:
            dsn = (
                f"host=127.0.0.1 port={proxy.port} user=postgres dbname=postgres "
                "sslmode=disable gssencmode=disable"
            )
            yield Network(server.url, dsn, proxy)
    finally:
        server.stop("immediate")
        shutil.rmtree(folder, ignore_errors=True)


def start_delay(handle: RunHandle, timeout: float) -> float:
    """Seconds from enqueue to the step's start, both by the database clock."""
    run = handle.wait(timeout=timeout)
    assert run.state is RunState.COMPLETED
    (only,) = run.steps
    assert only.started_at is not None
    return (only.started_at - only.created_at).total_seconds()


def listener_ready(direct: str) -> bool:
    """The worker's LISTEN backend exists and has run a statement (LISTEN comes first)."""
    with psycopg.connect(direct, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE application_name LIKE 'cyclone-listen-%%' AND query <> ''"
        ).fetchone()
    return row is not None and row[0] == 1


def warm_up(net: Network, client: Client) -> None:
    """Wait for the listener, then prove it wakes the worker: a step starts at once."""
    wait_for(lambda: net.proxy.open_connections(LISTEN) == 1)
    wait_for(lambda: listener_ready(net.direct))
    assert start_delay(client.enqueue(echo, 0), timeout=10) < 2.0
    assert net.proxy.seen(LISTEN) == 1
    # Let the fetch loop settle: a wake-up still pending (the listener's own when it
    # connected can be taken late on a loaded machine) makes it claim once more, and that
    # claim could find the test's next step without any notification. Once, on a busy
    # machine, a step enqueued after the blackhole started 4 ms later.
    time.sleep(1.0)


def worker_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """The long-lived threads a worker started since ``before`` (fetch, listen, ...)."""
    started = [
        t
        for t in threading.enumerate()
        if t not in before
        and t.name.startswith("cyclone-")
        and not t.name.startswith(("cyclone-client", "cyclone-handler"))
    ]
    names = {t.name for t in started}
    assert {"cyclone-fetch", "cyclone-listen"} <= names, names
    return started


@pytest.mark.timeout(120)
def test_a_blackholed_listener_is_replaced_within_the_ping_timeout(network: Network) -> None:
    """Invariant: a half-open LISTEN connection (blackholed: open, silent) delays new work
    by at most the ping timeout plus a reconnect, never until the 60 s poll; the listener
    reconnects on a new connection."""
    net = network
    with Client(net.direct) as client, Worker(net.through_proxy, [echo], poll_interval=POLL):
        warm_up(net, client)
        assert net.proxy.blackhole(LISTEN) == 1
        delay = start_delay(client.enqueue(echo, 1), timeout=PING_TIMEOUT_S + 15)
        # The notification was swallowed: only the ping timeout noticed the dead connection.
        assert PING_TIMEOUT_S - 1.0 <= delay <= PING_TIMEOUT_S + 4.0, delay
        assert net.proxy.seen(LISTEN) == 2
        assert net.proxy.dropped_bytes(LISTEN) > 0
        # The new listener works: the next step starts at once.
        assert start_delay(client.enqueue(echo, 2), timeout=10) < 2.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reset", [True, False], ids=["rst", "fin"])
def test_a_cut_listener_reconnects_at_once(network: Network, reset: bool) -> None:
    """Invariant: when the LISTEN connection is closed under the worker (RST or FIN), the
    listener reconnects, LISTENs again and rescans, so new work starts within seconds."""
    net = network
    with Client(net.direct) as client, Worker(net.through_proxy, [echo], poll_interval=POLL):
        warm_up(net, client)
        assert net.proxy.cut(LISTEN, reset=reset) == 1
        assert start_delay(client.enqueue(echo, 1), timeout=15) < 3.0
        wait_for(lambda: net.proxy.seen(LISTEN) == 2, timeout=5)
        assert net.proxy.open_connections(LISTEN) == 1
        assert start_delay(client.enqueue(echo, 2), timeout=10) < 2.0


@pytest.mark.timeout(120)
def test_all_connections_cut_repeatedly_under_load(network: Network) -> None:
    """Invariant: cutting every worker connection again and again under load loses no work
    and duplicates no effect: each step completes exactly once with its output, handlers
    run at most max_attempts + max_reclaims times, and the worker's threads survive."""
    net = network
    count, cuts = 200, 6
    calls.clear()
    worker = Worker(
        net.through_proxy,
        [work, echo],
        concurrency=8,
        poll_interval=POLL,
        scan_interval=0.2,
        lease=2,
        max_reclaims=20,
        grace=5,
    )
    before = set(threading.enumerate())
    with Client(net.direct) as client, worker:
        warm_up(net, client)
        engine_threads = worker_threads(before)
        handles = client.enqueue_many(work, list(range(count)))
        closed, started_by_cut = 0, []
        for _ in range(cuts):
            time.sleep(0.5)
            closed += net.proxy.cut()
            with calls_lock:
                started_by_cut.append(len(calls))
        assert closed >= cuts  # each cut hit at least the listener
        assert started_by_cut[cuts // 2] < count, "the load ended before half the cuts"

        runs = [h.wait(timeout=60) for h in handles]
        assert [r.state for r in runs] == [RunState.COMPLETED] * count
        for x, run in enumerate(runs):
            (only,) = run.steps
            assert only.state is StepState.COMPLETED
            assert only.output == x * 2
        with psycopg.connect(net.direct) as conn:
            rows = conn.execute(
                "SELECT count(*), count(DISTINCT run_id) FROM cyclone_steps WHERE run_id = ANY(%s)",
                ([h.id for h in handles],),
            ).fetchone()
        assert rows == (count, count)  # one step per run: nothing duplicated downstream
        assert worker.completed_count <= count + 1  # replays after a lost ack are fenced
        assert set(calls) == set(range(count))
        assert max(calls.values()) <= 10 + 20

        dead = [t.name for t in engine_threads if not t.is_alive()]
        assert not dead, f"worker threads died: {dead}"
        # Still listening after all that: new work starts at once.
        wait_for(lambda: listener_ready(net.direct))
        assert start_delay(client.enqueue(echo, 1), timeout=10) < 2.0


@pytest.mark.timeout(120)
def test_a_slow_network_delays_work_but_loses_nothing(network: Network) -> None:
    """Invariant: with every chunk between worker and database delayed (50 ms each way),
    work completes exactly once with its output, and the listener stays up (its ping,
    slower but answered, never times out)."""
    net = network
    calls.clear()
    with (
        Client(net.direct) as client,
        Worker(net.through_proxy, [work, echo], concurrency=8, poll_interval=POLL),
    ):
        warm_up(net, client)
        net.proxy.set_delay(0.05)
        handles = client.enqueue_many(work, list(range(40)))
        runs = [h.wait(timeout=60) for h in handles]
        assert [r.state for r in runs] == [RunState.COMPLETED] * 40
        assert [r.steps[0].output for r in runs] == [x * 2 for x in range(40)]
        assert calls == Counter(range(40))
        assert start_delay(client.enqueue(echo, 1), timeout=10) < 2.0
        assert net.proxy.seen(LISTEN) == 1


@pytest.mark.timeout(120)
def test_a_listener_reconnecting_into_a_silent_network_recovers_once_it_heals(
    network: Network,
) -> None:
    """Invariant: a listener whose reconnect meets a silent network (the TCP handshake
    succeeds, nothing ever answers: a stuck proxy or pooler) gives up and tries again, so
    once the network heals new work starts within the ping timeout plus a reconnect, not
    at the 60 s poll."""
    net = network
    with Client(net.direct) as client, Worker(net.through_proxy, [echo], poll_interval=POLL):
        warm_up(net, client)
        assert net.proxy.blackhole(LISTEN, new=True) == 1
        # The ping times out, the listener reconnects, and its startup message is swallowed.
        wait_for(lambda: net.proxy.seen(LISTEN) == 2, timeout=PING_TIMEOUT_S + 10)
        net.proxy.heal()
        # The stuck connect gives up after connect_timeout; the next attempt goes through.
        connect_timeout = float(KEEPALIVE["connect_timeout"] or 0)
        delay = start_delay(client.enqueue(echo, 1), timeout=connect_timeout + 10)
        assert delay <= connect_timeout + 5.0, delay
        assert net.proxy.seen(LISTEN) == 3


@step(name="nf_slow")
def slow(x: int) -> int:
    time.sleep(6)
    return x


@pytest.mark.timeout(120)
def test_waiting_for_a_run_survives_a_half_open_connection(network: Network) -> None:
    """Invariant: ``handle.wait(timeout)`` and its async twin return when the run ends, or
    raise TimeoutError at the timeout, even when their connection goes half-open while
    they wait: no read waits for an answer longer than the ping timeout."""
    net = network
    with (
        Client(net.direct) as direct,
        Client(net.through_proxy) as waiter,
        Worker(net.direct, [slow], poll_interval=0.2),
    ):
        run_id = direct.enqueue(slow, 1).id
        results: dict[str, object] = {}

        def wait_sync() -> None:
            results["sync"] = waiter.handle(run_id).wait(timeout=40).state

        def wait_async() -> None:
            async def wait() -> object:
                async with AsyncClient(net.through_proxy) as async_waiter:
                    return (await async_waiter.wait(run_id, 40)).state

            results["async"] = asyncio.run(wait())

        threads = [threading.Thread(target=wait_sync), threading.Thread(target=wait_async)]
        for thread in threads:
            thread.start()
        wait_for(lambda: net.proxy.open_connections(b"cyclone-wait") == 2)
        assert net.proxy.blackhole(b"cyclone-wait") == 2
        started = time.monotonic()
        for thread in threads:
            thread.join(60)
        elapsed = time.monotonic() - started
        assert results == {"sync": RunState.COMPLETED, "async": RunState.COMPLETED}
        assert elapsed < 6 + PING_TIMEOUT_S + 5, elapsed
        assert net.proxy.seen(b"cyclone-wait") >= 4  # both waits reconnected


@pytest.mark.timeout(60)
@pytest.mark.parametrize("follow", ["wait", "events"])
def test_closing_a_client_ends_its_waits_while_the_server_is_unreachable(
    network: Network, follow: str
) -> None:
    """A wait (or an events follower) with no timeout whose server became unreachable
    retries its connection for as long as the outage lasts; closing its client ends it
    with ClientClosed, not at the end of the outage."""
    net = network
    with Client(net.direct) as direct:
        run_id = direct.enqueue(slow, 1).id  # no worker: it never ends
    waiter = Client(net.through_proxy)
    ended: list[object] = []

    def wait() -> None:
        try:
            if follow == "wait":
                waiter.handle(run_id).wait(timeout=None)
            else:
                for _ in waiter.events(run_id):
                    pass
            ended.append("the run ended")
        except Exception as exc:  # the test reads what ended it
            ended.append(type(exc))

    name = b"cyclone-wait"  # a client's waits and followers share its wait connection
    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    wait_for(lambda: net.proxy.open_connections(name) == 1)
    net.proxy.stop()  # the outage: the connection is cut, and new ones are refused
    time.sleep(1.5)  # a few reconnects refused (not a synchronisation: the outage lasts)
    waiter.close()
    thread.join(10)
    assert ended == [ClientClosed]
