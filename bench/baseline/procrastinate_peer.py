"""procrastinate 3.10 as a peer: no-op jobs deferred in a batch, then one worker drains them.

Settings: the sync ``App`` with ``PsycopgConnector``, ``batch_defer``, and
``run_worker(wait=False, concurrency=8)`` (it listens for new jobs and exits
when the queue is empty). Its own schema goes into a fresh PostgreSQL schema.
"""

from __future__ import annotations

import logging
import time


def available() -> bool:
    try:
        import procrastinate  # noqa: F401
    except ImportError:
        return False
    return True


def noop_throughput(dsn: str, jobs: int) -> float:
    """Jobs per second of the processing phase."""
    import procrastinate

    logging.getLogger("procrastinate").setLevel(logging.WARNING)
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))

    @app.task(name="bench_noop")
    def noop() -> None:
        return None

    with app.open():
        app.schema_manager.apply_schema()
        for start in range(0, jobs, 5000):
            noop.batch_defer(*[{} for _ in range(min(5000, jobs - start))])
        started = time.perf_counter()
        app.run_worker(wait=False, concurrency=8, install_signal_handlers=False)
        return jobs / (time.perf_counter() - started)
