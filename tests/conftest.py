"""Shared fixtures (the schema fixtures come from cyclone_dsl.testing.plugin)."""

from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

import cyclone_dsl
from cyclone_dsl import Client, Worker
from cyclone_dsl.testing import set_clock_shift
from cyclone_dsl.testing.failpoints import armed, disarm
from tests.logged import Lines, json_lines

# Every module of the package is imported now, on the main thread, before a test starts
# threads. pytest rewrites the modules of a plugin's distribution (ours has the pytest11 entry
# point) when they are first imported, with ast.parse; on CPython 3.11.0-3.11.7 a parse that
# overlaps another thread's (a worker formatting a traceback parses too) can fail with
# "SystemError: AST constructor recursion depth mismatch". A lazy import in a test did, in CI.
for _module in pkgutil.walk_packages(cyclone_dsl.__path__, "cyclone_dsl."):
    if not _module.name.endswith(".__main__"):
        with contextlib.suppress(ImportError):  # an integration whose extra is missing
            importlib.import_module(_module.name)

settings.register_profile(
    "ci",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "full", deadline=None, max_examples=500, suppress_health_check=list(HealthCheck)
)
settings.load_profile(os.environ.get("CYCLONE_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def client(cyclone_dsn: str) -> Iterator[Client]:
    with Client(cyclone_dsn) as c:
        yield c


@pytest.fixture
def start_worker(cyclone_dsn: str) -> Iterator[Callable[..., Worker]]:
    """Start background workers for the test; every one is stopped at the end."""
    started: list[Worker] = []

    def start(*objects: Any, **options: Any) -> Worker:
        # Work is woken by NOTIFY; the poll and the scanner's pass (timers, deadlines, due
        # work) run twice a second: an idle worker scanning 5 times a second cost about 8%
        # of a core (its statements and the server's), and the suite is CPU-bound.
        options.setdefault("poll_interval", 0.5)
        options.setdefault("scan_interval", 0.5)
        options.setdefault("grace", 5.0)
        worker = Worker(cyclone_dsn, objects, **options)
        worker.start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture
def clock() -> Iterator[Callable[[datetime | timedelta], None]]:
    """``clock(at)`` moves this process's database clock so that now() is about ``at``, or
    ``at`` (a timedelta) on from the real time; moved back at the end of the test."""

    def move(at: datetime | timedelta) -> None:
        set_clock_shift(at if isinstance(at, timedelta) else at - datetime.now(UTC))

    yield move
    set_clock_shift(timedelta(0))


@pytest.fixture
def logged() -> Iterator[Lines]:
    """``logged()``: the JSON lines the root logger printed since the test began, each a
    dict (through the step-context filter, as ``--log-format json`` prints them)."""
    with json_lines() as lines:
        yield lines


@pytest.fixture(autouse=True)
def _no_failpoint_left_armed() -> Iterator[None]:
    """A failpoint armed in this process and left armed would fire in the next test."""
    before = set(armed())
    yield
    left = set(armed()) - before
    for name in left:
        disarm(name)
    if left:
        pytest.fail(f"the test left failpoints armed: {sorted(left)}", pytrace=False)
