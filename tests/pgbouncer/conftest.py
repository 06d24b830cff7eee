"""A private PgBouncer (Debian's ``pgbouncer``) in transaction pooling mode, in front of
the test server.

``pgbouncer`` (session) starts one process per test process: its own ini in a temporary
folder, a free port on 127.0.0.1, ``auth_type = any`` (it logs in to the server as the
admin DSN's user), and a small server pool so that clients really share server sessions.
``pooled_dsn`` is a DSN through it onto the test's schema: PgBouncer 1.18 refuses the
``options`` startup parameter, so each schema gets a database alias of its own whose
server sessions set ``search_path`` once (``connect_query``), added with a ``RELOAD``.

Tests that need it skip, saying why, where no ``pgbouncer`` binary can be found
(``.ci/run`` installs the Debian package).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cyclone_dsl.db.embedded import SERVICE_USER

#: Server sessions per database alias: fewer than the clients, so they take turns.
POOL_SIZE = 4


def pgbouncer_binary() -> str | None:
    found = shutil.which("pgbouncer")
    if found:
        return found
    for candidate in ("/usr/sbin/pgbouncer", "/usr/local/sbin/pgbouncer"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class PgBouncer:
    """One pgbouncer process; :meth:`add_database` maps an alias to a schema of the server."""

    def __init__(self, binary: str, admin_dsn: str) -> None:
        self.binary = binary
        self.server = conninfo_to_dict(admin_dsn)
        self.port = free_port()
        self.folder = Path(tempfile.mkdtemp(prefix="cyclone-pgbouncer-"))
        self.databases: dict[str, str] = {}
        # PgBouncer refuses to run as root: it drops to the embedded server's user.
        self.run_as = SERVICE_USER if os.geteuid() == 0 else None
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def ini(self) -> Path:
        return self.folder / "pgbouncer.ini"

    @property
    def log(self) -> Path:
        return self.folder / "pgbouncer.log"

    def dsn(self, database: str) -> str:
        return make_conninfo("", host="127.0.0.1", port=self.port, dbname=database, user="cyclone")

    def _entry(self, schema: str) -> str:
        server = {
            "host": self.server.get("host") or "localhost",
            "port": self.server.get("port") or "5432",
            "dbname": self.server.get("dbname") or "postgres",
            "user": self.server.get("user") or "postgres",
        }
        if self.server.get("password"):
            server["password"] = self.server["password"]
        parts = " ".join(f"{key}={value}" for key, value in server.items())
        return f"{parts} connect_query='SET search_path TO {schema}'"

    def _write_ini(self) -> None:
        databases = "\n".join(
            f"{alias} = {self._entry(schema)}" for alias, schema in self.databases.items()
        )
        self.ini.write_text(
            f"""[databases]
{databases}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = any
admin_users = cyclone
pool_mode = transaction
default_pool_size = {POOL_SIZE}
max_client_conn = 500
logfile = {self.log}
pidfile = {self.folder / "pgbouncer.pid"}
{f"user = {self.run_as}" if self.run_as else ""}
"""
        )
        if self.run_as:
            entry = pwd.getpwnam(self.run_as)
            for path in (self.folder, self.ini):
                os.chown(path, entry.pw_uid, entry.pw_gid)

    def start(self) -> None:
        self._write_ini()
        self.process = subprocess.Popen(
            [self.binary, str(self.ini)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 15
        while True:
            try:
                self._admin("SHOW VERSION")
                return
            except psycopg.OperationalError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"pgbouncer did not start:\n{self.log_tail()}") from None
                time.sleep(0.05)

    def add_database(self, alias: str, schema: str) -> str:
        """Route ``alias`` to ``schema`` of the test server; return a DSN through PgBouncer."""
        self.databases[alias] = schema
        self._write_ini()
        self._admin("RELOAD")
        return self.dsn(alias)

    def stats(self, alias: str) -> dict[str, int]:
        """PgBouncer's ``SHOW STATS`` row of ``alias`` (transactions, queries...)."""
        with self._admin_connection() as conn, conn.cursor() as cur:
            cur.execute("SHOW STATS")
            names = [column.name for column in cur.description or ()]
            for row in cur.fetchall():
                if row[0] == alias:
                    return dict(zip(names[1:], row[1:], strict=True))
        raise KeyError(alias)

    def _admin_connection(self) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(self.dsn("pgbouncer"), autocommit=True, connect_timeout=2)

    def _admin(self, command: str) -> None:
        with self._admin_connection() as conn:
            conn.execute(command.encode())

    def log_text(self) -> str:
        """Its whole log (shared by the tests of this process: compare from an offset)."""
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self) -> str:
        return self.log_text()[-3000:]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        if self.process is not None and self.process.stderr is not None:
            self.process.stderr.close()
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(scope="session")
def pgbouncer(cyclone_admin_dsn: str) -> Iterator[PgBouncer]:
    binary = pgbouncer_binary()
    if binary is None:
        pytest.skip(
            "pgbouncer is not installed (Debian: apt-get install pgbouncer; .ci/run installs "
            "it): the PgBouncer tests need the binary"
        )
    bouncer = PgBouncer(binary, cyclone_admin_dsn)
    bouncer.start()
    try:
        yield bouncer
    finally:
        bouncer.stop()


@pytest.fixture
def pooled_dsn(pgbouncer: PgBouncer, cyclone_schema: str) -> str:
    """A DSN through PgBouncer (transaction mode) onto this test's schema."""
    return pgbouncer.add_database(cyclone_schema, cyclone_schema)


@pytest.fixture
def alias(cyclone_schema: str) -> str:
    """The PgBouncer database alias of this test's schema (see :func:`pooled_dsn`)."""
    return cyclone_schema
