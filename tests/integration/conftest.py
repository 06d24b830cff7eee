"""Fixtures for tests that drive the public API against a real PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cyclone_dsl import Client, Worker


@pytest.fixture
def client(cyclone_dsn: str) -> Iterator[Client]:
    with Client(cyclone_dsn) as c:
        yield c


@pytest.fixture
def start_worker(cyclone_dsn: str) -> Iterator[Callable[..., Worker]]:
    """Start background workers for the test; every one is stopped at the end."""
    started: list[Worker] = []

    def start(*objects: Any, **options: Any) -> Worker:
        options.setdefault("poll_interval", 0.2)
        options.setdefault("scan_interval", 0.2)
        options.setdefault("grace", 5.0)
        worker = Worker(cyclone_dsn, objects, **options)
        worker.start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()
