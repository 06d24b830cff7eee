"""A migration that waits for a table lock behind a long transaction: it waits in short
tries, so the queries queued behind its lock request go on between them, and it gives up
with a typed error naming the blocking session once ``lock_timeout`` has passed."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from cyclone_dsl.errors import MigrationLockTimeout
from cyclone_dsl.migrate import migrate, runner, versions


@pytest.fixture
def short_tries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "DDL_LOCK_TRY_S", 0.3)


def in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:
            outcome["error"] = exc
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def waiting_for_a_lock(conn: psycopg.Connection[Any], application: str) -> bool:
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity AS a JOIN pg_locks AS l ON l.pid = a.pid "
        "WHERE a.application_name = %s AND NOT l.granted "
        "AND l.relation = 'cyclone_runs'::regclass",
        (application,),
    ).fetchone()
    return bool(row and row[0])


def test_a_long_transaction_makes_the_migration_give_up_without_blocking_readers(
    empty_schema: tuple[str, str], short_tries: None
) -> None:
    _, dsn = empty_schema
    migrate(dsn, version=18)
    with (
        psycopg.connect(dsn) as blocker,
        psycopg.connect(dsn, autocommit=True) as watcher,
    ):
        blocker.execute("SELECT count(*) FROM cyclone_runs")  # holds ACCESS SHARE until rollback
        migrator, migrated = in_thread(lambda: migrate(dsn, lock_timeout=3))
        deadline = time.monotonic() + 10
        while not waiting_for_a_lock(watcher, "cyclone-migrate"):
            assert time.monotonic() < deadline, "the migrator never waited for cyclone_runs"
            time.sleep(0.01)
        # A reader that comes while the ALTER waits queues behind it; it gets through at the
        # end of the ALTER's try, long before the migration gives up.
        reader, read = in_thread(
            lambda: psycopg.connect(dsn, autocommit=True).execute(
                "SELECT count(*) FROM cyclone_runs"
            )
        )
        reader.join(10)
        migrator.join(20)
        blocker_pid = blocker.info.backend_pid
    assert "error" not in read, read
    error = migrated.get("error")
    assert isinstance(error, MigrationLockTimeout), migrated
    assert read["at"] < migrated["at"] - 1
    message = str(error)
    assert message.startswith("migration 019_child_runs (up) ")
    assert str(blocker_pid) in message and "over 3s" in message
    assert versions(dsn) == (18, 0)


def test_a_migration_goes_on_once_the_long_transaction_ends(
    empty_schema: tuple[str, str], short_tries: None
) -> None:
    _, dsn = empty_schema
    migrate(dsn, version=18)
    with psycopg.connect(dsn) as blocker, psycopg.connect(dsn, autocommit=True) as watcher:
        blocker.execute("SELECT count(*) FROM cyclone_runs")
        migrator, migrated = in_thread(lambda: migrate(dsn, lock_timeout=30))
        deadline = time.monotonic() + 10
        while not waiting_for_a_lock(watcher, "cyclone-migrate"):
            assert time.monotonic() < deadline, "the migrator never waited for cyclone_runs"
            time.sleep(0.01)
        time.sleep(1)  # a few tries fail meanwhile
        blocker.rollback()
        migrator.join(20)
    assert "error" not in migrated, migrated
    assert migrated["value"] == 19
    assert versions(dsn)[0] == 19
