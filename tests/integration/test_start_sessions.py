"""A client, a worker and a CLI command start on one server session: the start-up check's
connection (reachable, migrated) is the pool's first, not a session of its own. A worker's
stop closes every session it opened, its LISTEN one included, before it returns.

A session is counted where it is opened: each call of ``psycopg.Connection.connect`` (the
pool's connections and the check's all go through it), recorded by application name.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from cyclone_dsl import Client, DatabaseUnavailable, SchemaVersionMismatch, Worker, step
from cyclone_dsl.db.connect import make_pool
from cyclone_dsl.migrate import checked_connection
from tests.cli.runner import in_process
from tests.waiting import open_sockets

Opened = list[tuple[str, psycopg.Connection[Any]]]


@step(name="ss_echo")
def ss_echo(x: int) -> int:
    return x


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> Opened:
    """Every connection this process opens from now on: (application name, connection)."""
    seen: Opened = []
    original = psycopg.Connection.connect.__func__  # type: ignore[attr-defined]

    def connect(cls: type[psycopg.Connection[Any]], *args: Any, **kwargs: Any) -> Any:
        conn = original(cls, *args, **kwargs)
        seen.append((conn.info.parameter_status("application_name") or "", conn))
        return conn

    monkeypatch.setattr(psycopg.Connection, "connect", classmethod(connect))
    # psycopg.connect is Connection.connect bound at import: it needs its own stand-in.
    monkeypatch.setattr(psycopg, "connect", lambda *a, **k: connect(psycopg.Connection, *a, **k))
    return seen


def names(opened: Opened, prefix: str) -> list[str]:
    return [name for name, _ in opened if name.startswith(prefix)]


#: Sessions of background threads an earlier test of this process may have left running.
BACKGROUND = ("cyclone-wait", "cyclone-listen", "cyclone-worker", "cyclone-emit")


def foreground(opened: Opened) -> list[str]:
    return [name for name, _ in opened if not name.startswith(BACKGROUND)]


def test_a_client_checks_and_calls_on_one_session(cyclone_dsn: str, opened: Opened) -> None:
    with Client(cyclone_dsn) as client:
        handle = client.enqueue(ss_echo, 1)
        assert client.get_run(handle.id).workflow == "ss_echo"
        assert client.list_runs()
        assert names(opened, "cyclone-client") == ["cyclone-client"]
        # That session carries the engine's settings, as any the pool opens does.
        with client._db.pool.connection() as conn:
            assert conn is opened[0][1]
            row = conn.execute(
                "SELECT current_setting('jit'), current_setting('default_transaction_isolation')"
            ).fetchone()
        assert row == ("off", "read committed")
    assert opened[0][1].closed  # closed with the client


def test_a_worker_starts_with_its_check_session_in_its_pool(
    cyclone_dsn: str, opened: Opened, client: Client
) -> None:
    worker = Worker(cyclone_dsn, [ss_echo], poll_interval=0.5, scan_interval=0.5, grace=5.0)
    worker.start()
    try:
        own = [conn for name, conn in opened if name == f"cyclone-worker-{os.getpid()}"]
        assert own, "the worker opened no session of its name"
        assert not own[0].closed  # the check's session serves the pool
        assert client.enqueue(ss_echo, 7).result(timeout=20) == 7
    finally:
        worker.stop()
    assert all(conn.closed for conn in own)


def test_a_worker_stop_returns_with_every_session_closed(
    cyclone_dsn: str, opened: Opened, client: Client
) -> None:
    worker = Worker(cyclone_dsn, [ss_echo], poll_interval=60, scan_interval=0.5, grace=5.0)
    worker.start()
    assert client.enqueue(ss_echo, 3).result(timeout=20) == 3  # woken by its LISTEN
    listen = f"cyclone-listen-{os.getpid()}"
    assert names(opened, listen) == [listen]
    worker.stop()
    mine = [  # the worker's sessions (the client's wait connection stays with the client)
        (name, conn)
        for name, conn in opened
        if name.endswith(f"-{os.getpid()}") and not name.startswith("cyclone-wait")
    ]
    assert {name for name, _ in mine} >= {listen, f"cyclone-worker-{os.getpid()}"}
    assert [name for name, conn in mine if not conn.closed] == []


@pytest.mark.parametrize("listen", [True, False], ids=["listen", "polling"])
def test_worker_starts_and_stops_leave_no_socket_open(cyclone_dsn: str, listen: bool) -> None:
    """With LISTEN and without (a pooled DSN and no listen_dsn): its connections and the
    listener's wake-up sockets are all closed when each stop returns."""
    options: dict[str, Any] = {} if listen else {"pooled": True, "listen_dsn": ""}
    workers = []  # kept: a collected worker's sockets would be closed by the collector
    before = open_sockets()
    for _ in range(3):
        worker = Worker(cyclone_dsn, [ss_echo], poll_interval=0.5, grace=5.0, **options)
        worker.start()
        worker.stop()
        workers.append(worker)
    assert open_sockets() == before


def test_a_cli_read_opens_one_session(cyclone_dsn: str, opened: Opened) -> None:
    result = in_process(cyclone_dsn)("runs", "--json")
    assert result.returncode == 0, result.stderr
    assert foreground(opened) == ["cyclone-client"]


def test_a_cli_scan_pass_opens_one_session(cyclone_dsn: str, opened: Opened) -> None:
    result = in_process(cyclone_dsn)("scan", "--once")
    assert result.returncode == 0, result.stderr
    assert foreground(opened) == ["cyclone-scan"]


def test_the_pool_takes_the_checked_session_first_then_opens_more(cyclone_dsn: str) -> None:
    checked = checked_connection(cyclone_dsn, name="t-handover")
    pid = checked.info.backend_pid
    pool = make_pool(cyclone_dsn, name="t-handover", max_size=2, first=checked)
    try:
        with pool.connection() as first, pool.connection(timeout=10) as second:
            assert first.info.backend_pid == pid
            assert second.info.backend_pid != pid  # the second is a connection of its own
            row = second.execute("SELECT current_setting('jit')").fetchone()
            assert row == ("off",)
    finally:
        pool.close()
    assert checked.closed


def test_a_pool_that_cannot_be_made_closes_the_session_it_was_given(cyclone_dsn: str) -> None:
    checked = checked_connection(cyclone_dsn, name="t-handover")
    with pytest.raises(ValueError, match="max_size"):
        make_pool(cyclone_dsn, name="t-handover", min_size=2, max_size=1, first=checked)
    assert checked.closed


def test_a_failed_check_leaves_no_session_open(
    cyclone_admin_dsn: str, opened: Opened, unmigrated_dsn: str
) -> None:
    with pytest.raises(SchemaVersionMismatch):
        Client(unmigrated_dsn)
    assert opened and all(conn.closed for _, conn in opened)


@pytest.fixture
def unmigrated_dsn(cyclone_admin_dsn: str) -> Iterator[str]:
    """A DSN onto an empty schema of its own (nothing migrated)."""
    schema = f"ss_empty_{os.getpid()}"
    with psycopg.connect(cyclone_admin_dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE; CREATE SCHEMA "{schema}"')
    try:
        yield psycopg.conninfo.make_conninfo(cyclone_admin_dsn, options=f"-c search_path={schema}")
    finally:
        with psycopg.connect(cyclone_admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_an_unreachable_server_still_fails_fast_with_its_cause() -> None:
    with pytest.raises(DatabaseUnavailable) as caught:
        Client("postgresql://nobody@127.0.0.1:1/nothing?connect_timeout=2")
    assert caught.value.cause == "connection_refused"
