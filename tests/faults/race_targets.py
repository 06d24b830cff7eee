"""What the racing processes of test_process_races.py run (importable under "spawn").

Each racer is a long-lived child process serving one :class:`Task` per round
from its own inbox: it gets ready (opens its client and a connection), waits
at a barrier shared by all racers so every process calls the database at the
same moment, then reports an :class:`Outcome` on the shared outbox.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass, replace
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from typing import Literal

from cyclone_dsl import Client, StepContext, migrate, step, wait_n, workflow

#: How long a racer waits at the barrier for the others before giving up.
BARRIER_TIMEOUT = 60.0

#: The wait_n quorum of the signal race.
QUORUM = 3

Op = Literal["enqueue", "submit_once", "signal", "migrate"]


@step(name="pr_square")
def square(x: int) -> int:
    return x * x


@workflow(name="pr_once")
def once(x):  # type: ignore[no-untyped-def]
    return square(x)


echo_calls: list[int] = []  # run ids, appended by the worker of the parent process
echo_lock = threading.Lock()


@step(name="pr_echo")
def echo(value: object, *, ctx: StepContext | None = None) -> object:
    assert ctx is not None  # the worker passes it (a default keeps the workflow calls typed)
    with echo_lock:
        echo_calls.append(ctx.run_id)
    return value


@step(name="pr_gate")
def gate(x: int) -> int:
    return x


@workflow(name="pr_votes")
def votes(x):  # type: ignore[no-untyped-def]
    return echo(wait_n("approve", QUORUM))


@workflow(name="pr_votes_later")
def votes_later(x):  # type: ignore[no-untyped-def]
    first = gate(x)
    return echo(wait_n("approve", QUORUM, after=[first]))


@dataclass(frozen=True)
class Task:
    op: Op
    dsn: str
    key: str = ""
    value: int = 0
    run_id: int = 0


@dataclass(frozen=True)
class Outcome:
    index: int
    pid: int
    started: float = 0.0  # time.monotonic() (system-wide on Linux) as the racer left the barrier
    run_id: int | None = None
    created: bool | None = None
    delivery: str | None = None
    version: int | None = None
    applied: int | None = None
    error: str | None = None  # the class name of what the call raised
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


class _CountApplied(logging.Handler):
    """Counts the "migration NNN_name up" records the migrator logs per applied file."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("migration "):
            self.count += 1


def _call(
    client: Client | None, task: Task, index: int, pid: int, applied: _CountApplied
) -> Outcome:
    if task.op == "migrate":
        applied.count = 0
        version = migrate(task.dsn)
        return Outcome(index, pid, version=version, applied=applied.count)
    assert client is not None
    if task.op == "enqueue":
        handle = client.enqueue(square, task.value, unique_key=task.key)
        return Outcome(index, pid, run_id=handle.id, created=handle.created)
    if task.op == "submit_once":
        handle = client.submit_once(once, task.value, key=task.key)
        return Outcome(index, pid, run_id=handle.id, created=handle.created)
    delivery = client.signal(task.run_id, task.key, task.value)
    return Outcome(index, pid, delivery=delivery.value)


def serve(index: int, barrier: Barrier, inbox: Queue[Task | None], outbox: Queue[Outcome]) -> None:
    """The racer's loop: one task per round until ``None``."""
    pid = os.getpid()
    applied = _CountApplied()
    migrate_log = logging.getLogger("cyclone.migrate")
    migrate_log.setLevel(logging.INFO)
    migrate_log.addHandler(applied)
    client: Client | None = None
    try:
        while (task := inbox.get()) is not None:
            try:
                if task.op != "migrate":
                    if client is not None and client.dsn != task.dsn:
                        client.close()
                        client = None
                    if client is None:
                        client = Client(task.dsn, pool_size=1)
                    client.run_counts()  # the connection is open before the starting gun
            except Exception as exc:
                barrier.abort()  # the others must not wait for a racer that will not come
                outbox.put(Outcome(index, pid, error=type(exc).__name__, detail=repr(exc)))
                continue
            try:
                barrier.wait(BARRIER_TIMEOUT)
                started = time.monotonic()
                outcome = replace(_call(client, task, index, pid, applied), started=started)
            except Exception as exc:
                outcome = Outcome(
                    index, pid, error=type(exc).__name__, detail=traceback.format_exc()
                )
            outbox.put(outcome)
    finally:
        if client is not None:
            client.close()
