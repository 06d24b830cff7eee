"""procrastinate 3.10 as a peer (database ``bench_procrastinate``).

Async ``App`` with ``PsycopgConnector``; async no-op tasks. ``noop_throughput``
defers with ``batch_defer_async`` in batches of 1,000, then
``run_worker_async(wait=False, concurrency=CONCURRENCY)`` drains the queue and
returns. ``wakeup_latency`` runs ``run_worker_async(wait=True)`` (LISTEN/NOTIFY
on, the default) as a task and defers one job at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from bench.peers import peer_url, reset_database

DB = "bench_procrastinate"
CONCURRENCY = 10


def available() -> bool:
    try:
        import procrastinate  # noqa: F401
    except ImportError:
        return False
    return True


def _app(admin_url: str):  # type: ignore[no-untyped-def]
    import procrastinate

    logging.getLogger("procrastinate").setLevel(logging.WARNING)
    url = peer_url(admin_url, DB)
    reset_database(url)
    return procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))


def noop_throughput(admin_url: str, jobs: int, concurrency: int = CONCURRENCY) -> float:
    """Jobs per second of the processing phase (deferring excluded)."""
    return asyncio.run(_noop(admin_url, jobs, concurrency))


async def _noop(admin_url: str, jobs: int, concurrency: int) -> float:
    app = _app(admin_url)
    done = 0

    @app.task(name="bench_noop")  # type: ignore[untyped-decorator]
    async def noop() -> None:
        nonlocal done
        done += 1

    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        for start in range(0, jobs, 1000):
            await noop.batch_defer_async(*[{} for _ in range(min(1000, jobs - start))])
        started = time.perf_counter()
        await asyncio.wait_for(
            app.run_worker_async(
                wait=False, concurrency=concurrency, install_signal_handlers=False
            ),
            timeout=120,
        )
        elapsed = time.perf_counter() - started
    if done != jobs:
        raise RuntimeError(f"procrastinate ran {done} of {jobs} jobs")
    return jobs / elapsed


def wakeup_latency(admin_url: str, samples: int) -> list[float]:
    """Seconds from the defer call to the task's start, one job at a time."""
    return asyncio.run(_latency(admin_url, samples))


async def _latency(admin_url: str, samples: int) -> list[float]:
    app = _app(admin_url)
    started_at: asyncio.Queue[float] = asyncio.Queue()

    @app.task(name="bench_ping")  # type: ignore[untyped-decorator]
    async def ping() -> None:
        started_at.put_nowait(time.perf_counter())

    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        worker = asyncio.create_task(app.run_worker_async(wait=True, install_signal_handlers=False))
        try:
            await asyncio.sleep(0.5)  # let it LISTEN and go idle
            latencies = []
            for _ in range(samples + 1):  # the first is a discarded warm-up
                sent = time.perf_counter()
                await ping.defer_async()
                latencies.append(await asyncio.wait_for(started_at.get(), timeout=10) - sent)
                await asyncio.sleep(0.02)
            return latencies[1:]
        finally:
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(worker, timeout=30)
