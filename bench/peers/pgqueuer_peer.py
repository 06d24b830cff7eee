"""pgqueuer 1.6 as a peer: the asyncpg driver, ``batch_size=100`` (database ``bench_pgqueuer``).

``noop_throughput`` enqueues in batches of 1,000 (one ``enqueue`` call with lists),
then ``PgQueuer.run(batch_size=100, mode=drain)`` processes them and returns
when the queue is empty. ``wakeup_latency`` runs a continuous worker (it
LISTENs; pgqueuer's insert trigger NOTIFYs) and enqueues one job at a time
from a second connection.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time

from bench.cpu import Meter
from bench.peers import connect_kwargs, peer_url, reset_database

DB = "bench_pgqueuer"
BATCH = 100


def available() -> bool:
    try:
        import asyncpg  # type: ignore[import-untyped]  # noqa: F401
        import pgqueuer  # noqa: F401
    except ImportError:
        return False
    return True


async def _setup(admin_url: str):  # type: ignore[no-untyped-def]
    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries

    logging.getLogger("pgqueuer").setLevel(logging.WARNING)
    url = peer_url(admin_url, DB)
    reset_database(url)
    conn = await asyncpg.connect(**connect_kwargs(url))
    await Queries(AsyncpgDriver(conn)).install()
    return url, conn


def noop_throughput(admin_url: str, jobs: int, meter: Meter | None = None) -> float:
    """Jobs per second of the processing phase (enqueue excluded; ``meter`` reads its CPU)."""
    return asyncio.run(_noop(admin_url, jobs, meter))


async def _noop(admin_url: str, jobs: int, meter: Meter | None = None) -> float:
    from pgqueuer import AsyncpgDriver, PgQueuer, Queries
    from pgqueuer.types import QueueExecutionMode

    _, conn = await _setup(admin_url)
    try:
        driver = AsyncpgDriver(conn)
        queries = Queries(driver)
        worker = PgQueuer(driver)
        done = 0

        @worker.entrypoint("bench_noop")
        async def noop(job: object) -> None:
            nonlocal done
            done += 1

        for start in range(0, jobs, 1000):
            count = min(1000, jobs - start)
            await queries.enqueue(["bench_noop"] * count, [None] * count, [0] * count)
        if meter is not None:
            meter.start()
        started = time.perf_counter()
        await asyncio.wait_for(
            worker.run(batch_size=BATCH, mode=QueueExecutionMode.drain), timeout=120
        )
        elapsed = time.perf_counter() - started
        if meter is not None:
            meter.stop()
        if done != jobs:
            raise RuntimeError(f"pgqueuer ran {done} of {jobs} jobs")
        return jobs / elapsed
    finally:
        await conn.close()


def noop_throughput_processes(admin_url: str, jobs: int, processes: int) -> float:
    """Jobs per second with ``processes`` worker processes, each one ``PgQueuer.run``
    (batch 100, drain mode) on its own connection: pgqueuer's way to use several cores.

    The jobs are enqueued first; every process imports, connects and waits at a barrier,
    and the clock runs from the barrier until the last process has drained the queue.
    """
    url = asyncio.run(_enqueue_only(admin_url, jobs))
    context = multiprocessing.get_context("spawn")
    ready = context.Barrier(processes + 1)
    counts = context.Queue()
    children = [
        context.Process(target=_drain_process, args=(url, ready, counts)) for _ in range(processes)
    ]
    for child in children:
        child.start()
    ready.wait(timeout=120)
    started = time.perf_counter()
    for child in children:
        child.join(timeout=180)
    elapsed = time.perf_counter() - started
    done = sum(counts.get(timeout=10) for _ in children)
    if done != jobs:
        raise RuntimeError(f"pgqueuer ran {done} of {jobs} jobs")
    return jobs / elapsed


async def _enqueue_only(admin_url: str, jobs: int) -> str:
    from pgqueuer import AsyncpgDriver, Queries

    url, conn = await _setup(admin_url)
    try:
        queries = Queries(AsyncpgDriver(conn))
        for start in range(0, jobs, 1000):
            count = min(1000, jobs - start)
            await queries.enqueue(["bench_noop"] * count, [None] * count, [0] * count)
    finally:
        await conn.close()
    return url


def _drain_process(url: str, ready: object, counts: object) -> None:
    counts.put(asyncio.run(_drain(url, ready)))  # type: ignore[attr-defined]


async def _drain(url: str, ready: object) -> int:
    import asyncpg
    from pgqueuer import AsyncpgDriver, PgQueuer
    from pgqueuer.types import QueueExecutionMode

    logging.getLogger("pgqueuer").setLevel(logging.WARNING)
    conn = await asyncpg.connect(**connect_kwargs(url))
    try:
        worker = PgQueuer(AsyncpgDriver(conn))
        done = 0

        @worker.entrypoint("bench_noop")
        async def noop(job: object) -> None:
            nonlocal done
            done += 1

        ready.wait(timeout=120)  # type: ignore[attr-defined]
        await worker.run(batch_size=BATCH, mode=QueueExecutionMode.drain)
        return done
    finally:
        await conn.close()


def wakeup_latency(admin_url: str, samples: int) -> list[float]:
    """Seconds from the enqueue call to the handler's start, one job at a time."""
    return asyncio.run(_latency(admin_url, samples))


async def _latency(admin_url: str, samples: int) -> list[float]:
    import asyncpg
    from pgqueuer import AsyncpgDriver, PgQueuer, Queries

    url, conn = await _setup(admin_url)
    producer = await asyncpg.connect(**connect_kwargs(url))
    worker = PgQueuer(AsyncpgDriver(conn))
    started_at: asyncio.Queue[float] = asyncio.Queue()

    @worker.entrypoint("bench_ping")
    async def ping(job: object) -> None:
        started_at.put_nowait(time.perf_counter())

    runner = asyncio.create_task(worker.run(batch_size=BATCH))
    try:
        await asyncio.sleep(0.5)  # let it LISTEN and go idle
        queries = Queries(AsyncpgDriver(producer))
        latencies = []
        for _ in range(samples + 1):  # the first is a discarded warm-up
            sent = time.perf_counter()
            await queries.enqueue("bench_ping", None)
            latencies.append(await asyncio.wait_for(started_at.get(), timeout=10) - sent)
            await asyncio.sleep(0.02)
        return latencies[1:]
    finally:
        worker.shutdown.set()
        await asyncio.wait_for(runner, timeout=30)
        await producer.close()
        if not conn.is_closed():
            await conn.close()
