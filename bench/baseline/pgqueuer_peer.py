"""pgqueuer 1.6 as a peer, at its best documented setting: the asyncpg driver, batch 100.

Jobs are enqueued in batches of 1,000, then ``PgQueuer.run(batch_size=100,
mode=drain)`` processes them and returns when the queue is empty.
"""

from __future__ import annotations

import asyncio
import time

from psycopg.conninfo import conninfo_to_dict


def available() -> bool:
    try:
        import asyncpg  # noqa: F401
        import pgqueuer  # noqa: F401
    except ImportError:
        return False
    return True


def noop_throughput(dsn: str, jobs: int, batch: int = 100) -> float:
    """Jobs per second of the processing phase."""
    return asyncio.run(_noop(dsn, jobs, batch))


async def _noop(dsn: str, jobs: int, batch: int) -> float:
    import asyncpg
    from pgqueuer import AsyncpgDriver, PgQueuer, Queries
    from pgqueuer.types import QueueExecutionMode

    params = conninfo_to_dict(dsn)
    settings = {}
    options = str(params.get("options") or "")
    if "search_path=" in options:
        settings["search_path"] = options.split("search_path=", 1)[1].split()[0]
    conn = await asyncpg.connect(
        host=params.get("host"),
        port=int(params.get("port") or 5432),
        user=params.get("user"),
        database=params.get("dbname"),
        server_settings=settings,
    )
    try:
        driver = AsyncpgDriver(conn)
        queries = Queries(driver)
        await queries.install()
        worker = PgQueuer(driver)

        @worker.entrypoint("bench_noop")
        async def noop(job: object) -> None:
            return None

        for start in range(0, jobs, 1000):
            count = min(1000, jobs - start)
            await queries.enqueue(["bench_noop"] * count, [None] * count, [0] * count)
        started = time.perf_counter()
        await worker.run(batch_size=batch, mode=QueueExecutionMode.drain)
        return jobs / (time.perf_counter() - started)
    finally:
        await conn.close()
