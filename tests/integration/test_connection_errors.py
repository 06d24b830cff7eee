"""Wrong connection settings fail in seconds with a typed error that names the cause.

Before: Client(...) and Worker(...) waited for the pool's 30 s timeout and raised
psycopg_pool.PoolTimeout, which hid the cause. Elapsed time is asserted here, and only
here, because a hang is the bug.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cyclone_dsl import Client, DatabaseUnavailable, InvalidArgument, Worker, migrate, step
from cyclone_dsl.db.diagnose import is_connection_loss, mask_passwords
from cyclone_dsl.db.errors import ConnectionFailure


@step(name="ce_noop")
def noop(x: object) -> object:
    return x


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def fails_fast(dsn: str, cause: str, *names: str) -> DatabaseUnavailable:
    started = time.monotonic()
    with pytest.raises(DatabaseUnavailable) as caught:
        Client(dsn)
    assert time.monotonic() - started < 8
    assert caught.value.cause == cause, caught.value
    for name in names:
        assert name in str(caught.value)
    assert "\n" not in str(caught.value)
    return caught.value


def test_a_wrong_port(cyclone_dsn: str) -> None:
    port = free_port()
    error = fails_fast(f"host=127.0.0.1 port={port} dbname=app", "connection_refused", str(port))
    assert "is PostgreSQL running there" in str(error)


def test_an_unknown_host() -> None:
    fails_fast("host=no-such-host.invalid dbname=app", "unknown_host", "no-such-host.invalid")


def test_a_missing_database(cyclone_admin_dsn: str) -> None:
    dsn = make_conninfo(cyclone_admin_dsn, dbname="no_such_database")
    error = fails_fast(dsn, "database_missing", "no_such_database")
    assert "create it" in str(error)


def test_an_unknown_role(cyclone_admin_dsn: str) -> None:
    dsn = make_conninfo(cyclone_admin_dsn, user="no_such_role", password="secret-word")
    error = fails_fast(dsn, "authentication_failed", "no_such_role")
    assert "secret-word" not in str(error)


@pytest.mark.parametrize("dsn", ["postgress://user@localhost/app", "host", ""])
def test_a_malformed_dsn(dsn: str) -> None:
    started = time.monotonic()
    with pytest.raises(InvalidArgument, match="DSN") as caught:
        Client(dsn or "   ")
    assert time.monotonic() - started < 2
    assert not isinstance(caught.value.__cause__, psycopg.Error)


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP server that accepts connections and never says a word."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield int(listener.getsockname()[1])
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


def test_a_server_that_never_answers(silent_server: int) -> None:
    fails_fast(f"host=127.0.0.1 port={silent_server} dbname=app", "timeout", str(silent_server))


def test_a_worker_fails_fast_too() -> None:
    port = free_port()
    worker = Worker(f"host=127.0.0.1 port={port} dbname=app", [noop])
    started = time.monotonic()
    with pytest.raises(DatabaseUnavailable) as caught:
        worker.start()
    assert time.monotonic() - started < 8
    assert caught.value.cause == "connection_refused"


def test_a_lost_connection_is_typed_and_the_next_call_reconnects(
    cyclone_dsn: str, cyclone_admin_dsn: str
) -> None:
    with Client(cyclone_dsn, pool_size=1) as client:
        client.run_counts()
        with client._db.pool.connection() as conn:  # the pool's one connection
            pid = conn.info.backend_pid
        with psycopg.connect(cyclone_admin_dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(DatabaseUnavailable) as caught:
            client.run_counts()
        assert caught.value.cause == "connection_lost"
        assert isinstance(caught.value.__cause__, psycopg.OperationalError)
        assert client.run_counts() == {}  # the next call has a new connection


@pytest.mark.parametrize(
    ("dsn", "message"),
    [
        (
            "mysql://app:s3cret@localhost/app",
            "the DSN cannot be parsed: its URL scheme is 'mysql': a PostgreSQL URL starts "
            "with postgresql:// or postgres://",
        ),
        (
            "postgresql://app:hunter 2@localhost/app",
            'the DSN cannot be parsed: unexpected spaces found in "****", use '
            "percent-encoded spaces (%20) instead",
        ),
        (
            # An unquoted space splits the password: libpq quotes its second half.
            "host=db password=s3c ret dbname=app",
            'the DSN cannot be parsed: missing "=" after "****" in connection info string',
        ),
    ],
)
def test_a_dsn_error_is_one_line_without_the_password(dsn: str, message: str) -> None:
    for opening in (Client, migrate):
        with pytest.raises(InvalidArgument) as caught:
            opening(dsn)
        assert str(caught.value) == message


def test_mask_passwords_hides_urls_settings_and_a_known_password() -> None:
    text = "a postgresql://u:pw1@h/db, b password=pw2 host=h, c 'pw 3' and p%40ss"
    assert mask_passwords(text) == (
        "a postgresql://u:****@h/db, b password=**** host=h, c 'pw 3' and p%40ss"
    )
    assert mask_passwords(text, "postgresql://u:pw 3@h/db").endswith("c '****' and p%40ss")
    assert mask_passwords("x p@ss y", "postgresql://u:p%40ss@h/db") == "x **** y"
    assert mask_passwords("x secret", password="secret") == "x ****"
    assert mask_passwords("database 'b'", password="b") == "database '****'"


def test_a_session_the_server_ended_for_idling_in_a_transaction_is_a_lost_connection(
    cyclone_dsn: str,
) -> None:
    """A process that stalls inside a transaction past the server's
    idle_in_transaction_session_timeout gets SQLSTATE 25P03 (an InternalError, for the
    driver) at its next statement. Nothing of the transaction was kept: it is a lost
    connection, retried by the worker and typed for the client, not a refused statement."""
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        conn.execute("SET idle_in_transaction_session_timeout = 100")
        conn.execute("BEGIN")
        conn.execute("SELECT 1")
        time.sleep(0.5)
        with pytest.raises(psycopg.Error) as caught:
            conn.execute("SELECT 1")
    assert caught.value.sqlstate == "25P03"
    assert isinstance(caught.value, ConnectionFailure)
    assert is_connection_loss(caught.value)


def test_calls_fail_fast_while_the_server_is_unreachable(cyclone_dsn: str) -> None:
    """Once a call found the server unreachable, the next ones say so at once (a probe of
    a few milliseconds) instead of each waiting the pool's 30 s for a connection that
    cannot come: a web app's requests, or the dashboard's live page, would pile up."""
    from tests.faults.tcp_proxy import TcpProxy

    params: dict[str, Any] = conninfo_to_dict(cyclone_dsn)
    socket_path = f"{params['host']}/.s.PGSQL.{params.get('port') or 5432}"
    proxy = TcpProxy("127.0.0.1", 0, upstream_socket=socket_path).start()
    params.update(host="127.0.0.1", port=str(proxy.port))
    try:
        with Client(make_conninfo(**params), pool_size=1) as client:
            assert client.run_counts() == {}
            proxy.stop()  # connections cut, new ones refused
            with pytest.raises(DatabaseUnavailable):
                client.run_counts()
            for _ in range(2):
                started = time.monotonic()
                with pytest.raises(DatabaseUnavailable) as caught:
                    client.run_counts()
                assert time.monotonic() - started < 5
                assert caught.value.cause == "connection_refused"
    finally:
        proxy.stop()
