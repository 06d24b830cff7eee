"""An audit of migrating a database while it is in use (prefix ``lma_``).

A worker and a client run workflows while ``migrate()`` moves the schema: up from the
previous extension version, down to 18 and up again with runs in flight, behind a long
transaction that holds a lock on ``cyclone_runs``, two migrators at once, and
``cyclone migrate`` reporting the versions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from cyclone_dsl import (
    LATEST_EXTENSION_VERSION,
    LATEST_SCHEMA_VERSION,
    Client,
    Concurrency,
    Debounce,
    NodeRef,
    Ref,
    Worker,
    for_each,
    step,
    workflow,
)
from cyclone_dsl.cli.main import run as cli_run
from cyclone_dsl.errors import MigrationError, MigrationLockTimeout, SchemaVersionMismatch
from cyclone_dsl.migrate import migrate, migrate_versions, runner, versions
from cyclone_dsl.states import RunState
from tests.waiting import wait_until

FULL = (LATEST_SCHEMA_VERSION, LATEST_EXTENSION_VERSION)
#: Before ext 8, whose foreign key to cyclone_runs is what an application's open
#: transaction holds up: the deploys below migrate from here.
PREVIOUS_EXT = (LATEST_SCHEMA_VERSION, 7)


@step(name="lma_double")
def lma_double(x: int) -> int:
    return x * 2


@step(name="lma_inc")
def lma_inc(x: int) -> int:
    return x + 1


@workflow(name="lma_flow")
def lma_flow(x: Ref[int]) -> NodeRef[int]:
    return lma_inc(lma_double(x))


class Load:
    """Submits ``lma_flow`` runs a few times a second from a thread, timing each submit."""

    def __init__(self, client: Client, interval: float = 0.2) -> None:
        self.client = client
        self.interval = interval
        self.ids: dict[int, int] = {}  # run id -> input
        self.errors: list[BaseException] = []
        self.latencies: list[float] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        n = 0
        while not self.stopping.is_set():
            n += 1
            started = time.monotonic()
            try:
                handle = self.client.submit(lma_flow, n)
            except BaseException as exc:  # every failure is a finding
                self.errors.append(exc)
            else:
                self.ids[handle.id] = n
            self.latencies.append(time.monotonic() - started)
            self.stopping.wait(self.interval)

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(30)

    def submitted(self) -> int:
        return len(self.ids)

    def all_completed(self, timeout: float = 30.0) -> None:
        """Every submitted run completes with the right result."""
        assert not self.errors, self.errors
        assert self.ids, "nothing was submitted"
        for run_id, n in list(self.ids.items()):
            run = self.client.wait(run_id, timeout)
            assert run.state == RunState.COMPLETED, (run_id, run.state)
            assert self.client.result(run_id, 5) == n * 2 + 1


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def go() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:
            outcome["error"] = exc
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread, outcome


def relation_exists(dsn: str, name: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchone()
    return bool(row and row[0])


def migrator_waits_on_runs(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity AS a JOIN pg_locks AS l ON l.pid = a.pid "
            "WHERE a.application_name = 'cyclone-migrate' AND NOT l.granted "
            "AND l.relation = 'cyclone_runs'::regclass"
        ).fetchone()
    return bool(row and row[0])


@pytest.fixture
def short_tries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "DDL_LOCK_TRY_S", 0.5)
    monkeypatch.setattr(runner, "DDL_LOCK_PAUSE_S", 0.2)


@pytest.fixture
def app(cyclone_dsn: str, start_worker: Callable[..., Worker]) -> Iterator[tuple[Client, Worker]]:
    """A client and a worker started on the current schema, then the extension track moved
    to the previous build's version under them (this build refuses to start on it)."""
    worker = start_worker(lma_double, lma_inc)
    with Client(cyclone_dsn) as client:
        assert client.submit(lma_flow, 0).result(timeout=20) == 1
        assert migrate_versions(cyclone_dsn, extension_version=PREVIOUS_EXT[1]) == PREVIOUS_EXT
        yield client, worker


# -- what this build accepts ------------------------------------------------------------


@pytest.mark.parametrize(
    ("core", "ext"),
    [(LATEST_SCHEMA_VERSION, LATEST_EXTENSION_VERSION - 1), (18, 0)],
    ids=["previous-extension", "core-18"],
)
def test_lma_client_and_worker_refuse_an_older_schema_naming_the_command(
    cyclone_dsn: str, core: int, ext: int
) -> None:
    """deploy.md: "A database that is reachable but not migrated for this build raises
    SchemaVersionMismatch ("run `cyclone migrate`")": also one extension version behind."""
    if core == LATEST_SCHEMA_VERSION:
        migrate(cyclone_dsn, extension_version=ext)
    else:
        migrate(cyclone_dsn, version=core)
    assert versions(cyclone_dsn) == (core, ext)
    with pytest.raises(SchemaVersionMismatch, match="run `cyclone migrate`") as caught:
        Client(cyclone_dsn)
    assert f"schema version {core} (extension {ext})" in str(caught.value)
    worker = Worker(cyclone_dsn, [lma_double, lma_inc], poll_interval=0.2)
    with pytest.raises(SchemaVersionMismatch, match="run `cyclone migrate`"):
        worker.start()
    worker.stop()
    migrate(cyclone_dsn)
    with Client(cyclone_dsn) as client:
        assert versions(cyclone_dsn) == FULL
        assert client.list_runs() is not None


# -- migrating up under load --------------------------------------------------------------


def test_lma_migrate_up_while_a_worker_and_a_client_run_loses_nothing(
    cyclone_dsn: str, app: tuple[Client, Worker], short_tries: None
) -> None:
    client, _ = app
    with Load(client) as load:
        wait_until(lambda: load.submitted() >= 3, what="submits before the migration")
        assert migrate_versions(cyclone_dsn) == FULL
        at_migration = load.submitted()
        wait_until(lambda: load.submitted() >= at_migration + 3, what="submits after it")
    load.all_completed()
    assert relation_exists(cyclone_dsn, "cyclone_ext_trace_context")
    # Nothing is left to claim or stuck in flight.
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM cyclone_runs WHERE state <> 'completed'"
        ).fetchone()
    assert row == (0,)


def test_lma_down_to_18_and_up_again_keeps_runs_in_flight(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """Core 19's down refuses only while a step is waiting_child (schema.md); runs in
    flight (available steps, no worker) survive a round trip to 18 and then complete."""
    with Client(cyclone_dsn) as client:
        handles = [client.submit(lma_flow, n) for n in range(5)]
        assert migrate_versions(cyclone_dsn, version=18) == (18, 0)
        with pytest.raises(SchemaVersionMismatch, match="run `cyclone migrate`"):
            Client(cyclone_dsn)
        assert migrate_versions(cyclone_dsn) == FULL
        start_worker(lma_double, lma_inc)
        for n, handle in enumerate(handles):
            assert handle.result(timeout=30) == n * 2 + 1


def test_lma_extension_down_and_up_under_a_running_worker_loses_nothing(
    cyclone_dsn: str, app: tuple[Client, Worker]
) -> None:
    """The extension track only adds tables: moving it down one version and up again while
    a client submits and a worker claims fails nothing."""
    client, _ = app
    with Load(client) as load:
        wait_until(lambda: load.submitted() >= 3, what="submits before the migrations")
        assert migrate_versions(cyclone_dsn) == FULL
        assert migrate_versions(cyclone_dsn, extension_version=PREVIOUS_EXT[1]) == PREVIOUS_EXT
        assert migrate_versions(cyclone_dsn) == FULL
        at_migration = load.submitted()
        wait_until(lambda: load.submitted() >= at_migration + 3, what="submits after them")
    load.all_completed()


# -- a long transaction in front of the deploy --------------------------------------------


def test_lma_a_long_transaction_delays_the_migration_not_the_application(
    cyclone_dsn: str,
    app: tuple[Client, Worker],
    short_tries: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    client, worker = app
    caplog.set_level(logging.WARNING, logger="cyclone.migrate")
    with (
        Load(client) as load,
        psycopg.connect(cyclone_dsn) as blocker,
    ):
        wait_until(lambda: load.submitted() >= 2, what="submits before the blocker")
        # An open transaction that wrote to cyclone_runs (ROW EXCLUSIVE), as an application
        # transaction left open would: the FK of ext 8 needs SHARE ROW EXCLUSIVE on it.
        blocker.execute("LOCK TABLE cyclone_runs IN ROW EXCLUSIVE MODE")
        blocker_pid = blocker.info.backend_pid
        completed_before = worker.completed_count
        migrator, migrated = in_thread(lambda: migrate(cyclone_dsn, lock_timeout=5))
        wait_until(lambda: migrator_waits_on_runs(cyclone_dsn), what="the migrator to wait")
        started_at = time.monotonic()
        at_start = load.submitted()
        # Submits and the worker's claims go on between the migration's tries.
        wait_until(
            lambda: (
                load.submitted() >= at_start + 4 and worker.completed_count >= completed_before + 4
            ),
            what="submits and completions while the migration waits",
            timeout=30,
        )
        progressed_at = time.monotonic()
        migrator.join(30)
        assert not migrator.is_alive()
        blocker.rollback()
        max_latency = max(load.latencies)
    assert progressed_at < migrated["at"], "the application stalled until the migration gave up"
    assert max_latency < 3.0, f"a submit waited {max_latency:.1f}s behind the migration"
    error = migrated.get("error")
    assert isinstance(error, MigrationLockTimeout), migrated
    assert migrated["at"] - started_at < 15
    message = str(error)
    assert "extension migration 008_trace_context (up)" in message, message
    assert str(blocker_pid) in message and "over 5s" in message, message
    retries = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
    assert len(retries) >= 2 and all(str(blocker_pid) in r for r in retries), retries
    # Nothing of the migration is kept.
    assert versions(cyclone_dsn) == PREVIOUS_EXT
    assert not relation_exists(cyclone_dsn, "cyclone_ext_trace_context")
    load.all_completed()
    # Once the transaction is over, the deploy goes through.
    assert migrate_versions(cyclone_dsn, lock_timeout=10) == FULL
    assert relation_exists(cyclone_dsn, "cyclone_ext_trace_context")


# -- two migrators at once, and the command line ------------------------------------------


def test_lma_two_migrators_at_once_under_load_apply_each_migration_once(
    cyclone_dsn: str,
    app: tuple[Client, Worker],
    caplog: pytest.LogCaptureFixture,
) -> None:
    client, _ = app
    caplog.set_level(logging.INFO, logger="cyclone.migrate")
    with Load(client) as load:
        wait_until(lambda: load.submitted() >= 2, what="submits before the migrations")
        first, one = in_thread(lambda: migrate_versions(cyclone_dsn))
        second, other = in_thread(lambda: migrate_versions(cyclone_dsn))
        first.join(30)
        second.join(30)
        at_migration = load.submitted()
        wait_until(lambda: load.submitted() >= at_migration + 2, what="submits after them")
    assert one.get("value") == FULL, one
    assert other.get("value") == FULL, other
    applied = [r for r in caplog.records if "008_trace_context up" in r.getMessage()]
    assert len(applied) == 1, [r.getMessage() for r in caplog.records]
    assert versions(cyclone_dsn) == FULL
    load.all_completed()


def test_lma_cli_migrate_reports_the_versions_under_a_running_worker(
    cyclone_dsn: str, app: tuple[Client, Worker], capsys: pytest.CaptureFixture[str]
) -> None:
    client, _ = app
    with Load(client) as load:
        wait_until(lambda: load.submitted() >= 2, what="submits before the command")
        assert cli_run(["--dsn", cyclone_dsn, "migrate", "--status"]) == 0
        status = capsys.readouterr().out
        assert cli_run(["--dsn", cyclone_dsn, "migrate"]) == 0
        applied = capsys.readouterr().out
        assert cli_run(["--dsn", cyclone_dsn, "migrate"]) == 0
        again = capsys.readouterr().out
    assert status.splitlines() == [
        f"schema version {LATEST_SCHEMA_VERSION} (this build: {LATEST_SCHEMA_VERSION})",
        f"extension version {PREVIOUS_EXT[1]} (this build: {LATEST_EXTENSION_VERSION})",
    ]
    assert applied.strip() == (
        f"schema version at {LATEST_SCHEMA_VERSION}, extension version "
        f"{PREVIOUS_EXT[1]} -> {LATEST_EXTENSION_VERSION}"
    )
    assert again.strip() == (
        f"schema version at {LATEST_SCHEMA_VERSION}, extension version at "
        f"{LATEST_EXTENSION_VERSION}"
    )
    load.all_completed()


@step(name="lma_score")
def lma_score(x: int) -> int:
    return x


@step(name="lma_big")
def lma_big(x: int) -> str:
    return "big"


@workflow(name="lma_cond")
def lma_cond(x: Ref[int]) -> NodeRef[str]:
    return lma_big(x, when=lma_score(x).gt(10))


def test_lma_going_down_is_refused_while_a_run_in_flight_needs_its_condition(
    cyclone_dsn: str, start_worker: Callable[..., Worker]
) -> None:
    """Going below 19 drops the extension track, the when= guards of the definitions
    included: while a run of such a definition is in flight that would make its node whose
    condition is false run. Its down migration is refused (as core 019's is while a step
    waits for a child run), checked before any migration goes down: nothing changes, and
    the run ends as its definition says."""
    with Client(cyclone_dsn) as client:
        handle = client.submit(lma_cond, 1)
        with pytest.raises(MigrationError, match=r"005_conditions .down. refused.*conditions"):
            migrate_versions(cyclone_dsn, version=18)
        assert versions(cyclone_dsn) == FULL
        worker = start_worker(lma_score, lma_big)
        run = handle.wait(30)
        worker.stop()  # a worker of this build does not run on 18
        assert run.state == RunState.COMPLETED
        assert {s.node: s.state.value for s in run.steps} == {
            "lma_score": "completed",
            "lma_big": "skipped",
        }
        assert migrate_versions(cyclone_dsn, version=18) == (18, 0)  # once it has ended
        assert migrate_versions(cyclone_dsn) == FULL


@step(name="lma_items")
def lma_items(n: int) -> list[int]:
    return list(range(n))


@step(name="lma_item")
def lma_item(x: int) -> int:
    return x


@workflow(name="lma_capped")
def lma_capped(n):  # type: ignore[no-untyped-def]
    return for_each(lma_item, over=lma_items(n), max_items=2)


@step(name="lma_limited", concurrency=Concurrency(limit=1))
def lma_limited(x: int) -> int:
    return x


@pytest.mark.parametrize(
    ("submit", "reason"),
    [
        (lambda c: c.submit(lma_capped, 5), r"003_fan_out_limits .down. refused.*fan-out"),
        (lambda c: c.enqueue(lma_limited, 1), r"004_flow_control .down. refused.*flow control"),
        (
            lambda c: c.submit(lma_flow, 1, debounce=Debounce(delay=timedelta(minutes=5))),
            r"004_flow_control .down. refused.*debounce",
        ),
    ],
    ids=["fan-out-limit", "flow-control", "debounce"],
)
def test_lma_going_down_is_refused_while_a_run_in_flight_needs_its_limits(
    cyclone_dsn: str, submit: Callable[[Client], Any], reason: str
) -> None:
    """The same for a fan-out's max_items (ext 3) and a step's flow control (ext 4): a
    run in flight would lose its limit."""
    with Client(cyclone_dsn) as client:
        handle = submit(client)
        with pytest.raises(MigrationError, match=reason):
            migrate_versions(cyclone_dsn, version=18)
        assert versions(cyclone_dsn) == FULL
        client.cancel(handle.id)
    assert migrate_versions(cyclone_dsn, version=18) == (18, 0)
    assert migrate_versions(cyclone_dsn) == FULL
