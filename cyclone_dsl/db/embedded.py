"""The embedded PostgreSQL server: a private server in a project-local folder.

With ``CYCLONE_DATABASE_URL`` set, :func:`database_url` returns it and nothing
is started. Otherwise Cyclone runs its own server in ``.cyclone/pgdata``
(or ``CYCLONE_DATA_DIR``): the binaries come from the ``pgserver`` wheel when
it is installed, else from ``initdb``/``pg_ctl`` on ``PATH``. The data folder
is reused across runs; :class:`EmbeddedServer` stops only a server it started
itself. As root, the server runs as an unprivileged system user, because
PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

from cyclone_dsl.errors import EmbeddedServerError

ENV_URL = "CYCLONE_DATABASE_URL"
ENV_DATA_DIR = "CYCLONE_DATA_DIR"
SERVICE_USER = "cyclonepg"
#: How long pg_ctl waits for a start or a stop. A stop waits for the shutdown checkpoint,
#: which syncs every file written since the last one: after a test suite (tens of
#: thousands of files) on a busy disk that took 108 s, over pg_ctl's default of 60.
PG_CTL_WAIT_S = 600
_SOCKET_PATH_MAX = 100  # sun_path is 108 bytes; leave room for ".s.PGSQL.NNNNN"


def default_data_dir() -> Path:
    """``$CYCLONE_DATA_DIR``, else ``.cyclone/pgdata`` under the working directory."""
    configured = os.environ.get(ENV_DATA_DIR)
    return Path(configured) if configured else Path.cwd() / ".cyclone" / "pgdata"


def _bin_dir() -> Path:
    # Locate pgserver's binaries without importing it: its import has side effects.
    spec = importlib.util.find_spec("pgserver")
    if spec is not None and spec.origin is not None:
        shipped = Path(spec.origin).parent / "pginstall" / "bin"
        if (shipped / "pg_ctl").exists():
            return shipped
    found = shutil.which("pg_ctl")
    if found is None:
        raise EmbeddedServerError(
            "no PostgreSQL binaries: install the 'embedded' extra (pip install "
            "'cyclone-dsl[embedded]'), put pg_ctl on PATH, or set CYCLONE_DATABASE_URL"
        )
    return Path(found).resolve().parent


class EmbeddedServer:
    """A private PostgreSQL server in ``data_dir``.

    ``port=None`` listens on a Unix socket only; a port number also listens on
    127.0.0.1 (the fault tests put a proxy in front of it). ``durable=False`` starts it
    with PostgreSQL's non-durable settings (no fsync, commits not waiting for their WAL
    flush, no full-page writes): fast, and safe against a crash of PostgreSQL, not of
    the machine; for test data. It applies when this object starts the server (a server
    already running keeps its settings), and is not written to its configuration.
    """

    def __init__(
        self, data_dir: Path | None = None, *, port: int | None = None, durable: bool = True
    ) -> None:
        self.data_dir = (data_dir or default_data_dir()).resolve()
        self.port = port
        self.durable = durable
        self.started_here = False
        self._bin = _bin_dir()
        self._user = SERVICE_USER if os.geteuid() == 0 else None

    @property
    def socket_dir(self) -> Path:
        own = self.data_dir.parent / "sock"
        if len(str(own)) < _SOCKET_PATH_MAX - 20:
            return own
        digest = hashlib.sha256(str(self.data_dir).encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / f"cyclone-{digest}"

    @property
    def url(self) -> str:
        port = self.port or 5432
        host = quote(str(self.socket_dir), safe="")
        return f"postgresql://postgres@/postgres?host={host}&port={port}"

    def is_running(self) -> bool:
        pid_file = self.data_dir / "postmaster.pid"
        try:
            pid = int(pid_file.read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def start(self) -> str:
        """Initialise the folder if needed, start the server unless it runs; return its URL."""
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with self._lock():
            if not (self.data_dir / "PG_VERSION").exists():
                self._initdb()
            if self.is_stopping():
                # The last user left and its stop is still under way (a stop can be
                # killed before it ends, e.g. with a test process): let it end.
                self._wait_until_running(False, within_s=PG_CTL_WAIT_S)
            if not self.is_running():
                self._pg_ctl_start()
                self.started_here = True
        return self.url

    def is_stopping(self) -> bool:
        """Whether the server is shutting down: it refuses new sessions until it is gone."""
        try:
            lines = (self.data_dir / "postmaster.pid").read_text().split("\n")
        except OSError:
            return False
        # The postmaster's status, on the 8th line of its lock file.
        return len(lines) > 7 and lines[7].strip() == "stopping" and self.is_running()

    def stop(self, mode: str = "fast", *, wait: bool = True) -> None:
        """Stop the server (``fast`` rolls back open sessions; ``immediate`` is a crash;
        ``smart`` waits for the sessions to end). ``wait=False`` only asks it to stop."""
        if self.is_running():
            self._pg_ctl_stop(mode, wait=wait)
        self.started_here = False

    def acquire(self) -> str:
        """Start (or reuse) the server and count this process among its users."""
        url = self.start()
        with self._lock():
            users = self._live_users()
            users.add(os.getpid())
            self._write_users(users)
        return url

    def release(self) -> None:
        """Stop counting this process; the last live user stops the server."""
        with self._lock():
            users = self._live_users()
            users.discard(os.getpid())
            self._write_users(users)
            if not users and self.is_running():
                self._pg_ctl_stop("fast")
        self.started_here = False

    def _users_file(self) -> Path:
        return self.data_dir.parent / "users"

    def _live_users(self) -> set[int]:
        try:
            pids = {int(p) for p in self._users_file().read_text().split()}
        except (OSError, ValueError):
            return set()
        live = set()
        for pid in pids:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            except PermissionError:
                pass
            live.add(pid)
        return live

    def _write_users(self, users: set[int]) -> None:
        self._users_file().write_text(" ".join(str(p) for p in sorted(users)))

    def make_replica(self, data_dir: Path) -> EmbeddedServer:
        """A streaming replica of this running server in ``data_dir`` (a new folder), made
        with ``pg_basebackup -R``; start it with :meth:`start`. It listens on its own socket
        folder beside ``data_dir`` (initdb's default ``pg_hba.conf`` lets local replication
        connections in)."""
        replica = EmbeddedServer(data_dir)
        replica.data_dir.parent.mkdir(parents=True, exist_ok=True)
        replica.data_dir.mkdir(mode=0o700)
        replica._give_to_service_user(replica.data_dir)
        replica._run(
            self._bin / "pg_basebackup",
            "-D",
            str(replica.data_dir),
            "-d",
            self.url,
            "-R",
            "-X",
            "stream",
            "-c",
            "fast",
        )
        return replica

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        with self._lock():
            self._pg_ctl_start()

    # -- internals ---------------------------------------------------------------

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        with open(self.data_dir.parent / ".lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _initdb(self) -> None:
        if self.data_dir.exists():
            shutil.rmtree(self.data_dir)  # a half-made folder from an interrupted initdb
        self.data_dir.mkdir(mode=0o700)
        self._give_to_service_user(self.data_dir)
        self._run(
            self._bin / "initdb",
            "-D",
            str(self.data_dir),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
        )

    def _pg_ctl_start(self) -> None:
        sock = self.socket_dir
        sock.mkdir(parents=True, exist_ok=True)
        self._give_to_service_user(sock)
        listen = "127.0.0.1" if self.port else "''"
        options = (
            f"-c listen_addresses={listen} -c unix_socket_directories='{sock}' "
            f"-c port={self.port or 5432} -c max_connections=300 -c shared_buffers=128MB"
        )
        if not self.durable:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run(
            self._bin / "pg_ctl",
            "-D",
            str(self.data_dir),
            "-l",
            str(self.data_dir / "server.log"),
            "-o",
            options,
            "-w",
            "-t",
            str(PG_CTL_WAIT_S),
            "start",
        )
        self._wait_until_running(True, within_s=30)

    def _pg_ctl_stop(self, mode: str, *, wait: bool = True) -> None:
        waiting = ("-w", "-t", str(PG_CTL_WAIT_S)) if wait else ("-W",)
        self._run(self._bin / "pg_ctl", "-D", str(self.data_dir), "-m", mode, *waiting, "stop")

    def _wait_until_running(self, running: bool, *, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while self.is_running() != running:
            if time.monotonic() > deadline:
                what = "start" if running else "stop"
                raise EmbeddedServerError(f"the server in {self.data_dir} did not {what}")
            time.sleep(0.05)

    def _give_to_service_user(self, path: Path) -> None:
        if self._user is None:
            return
        import pwd

        try:
            entry = pwd.getpwnam(self._user)
        except KeyError:
            subprocess.run(
                [
                    "useradd",
                    "--system",
                    "--no-create-home",
                    "--shell",
                    "/usr/sbin/nologin",
                    self._user,
                ],
                check=True,
                capture_output=True,
            )
            entry = pwd.getpwnam(self._user)
        os.chown(path, entry.pw_uid, entry.pw_gid)
        # The service user must be able to reach the folder and run the binaries.
        for parent in [*path.parents, *self._bin.parents]:
            if parent == Path("/"):
                continue
            mode = parent.stat().st_mode
            if not mode & 0o001:
                parent.chmod(mode | 0o001)

    def _run(self, *argv: Path | str) -> None:
        args = [str(a) for a in argv]
        try:
            subprocess.run(
                args,
                check=True,
                capture_output=True,
                text=True,
                user=self._user,
                # Drop root's groups too: a 0701 folder owned by group root would deny us.
                group=self._user,
                extra_groups=[] if self._user else None,
                cwd=self.data_dir.parent,
                timeout=PG_CTL_WAIT_S + 60,
            )
        except subprocess.CalledProcessError as exc:
            log = self.data_dir / "server.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise EmbeddedServerError(
                f"{Path(args[0]).name} failed ({exc.returncode}): {exc.stderr.strip()}\n{tail}"
            ) from exc


@contextlib.contextmanager
def embedded_database(data_dir: Path | None = None, *, durable: bool = True) -> Iterator[str]:
    """Yield a database URL: ``$CYCLONE_DATABASE_URL``, or the embedded server's.

    The embedded server is shared by every process that uses the same data
    folder at once; the last of them to leave stops it. ``durable=False``: see
    :class:`EmbeddedServer` (the pytest plugin's test server).
    """
    configured = os.environ.get(ENV_URL)
    if configured:
        yield configured
        return
    server = EmbeddedServer(data_dir, durable=durable)
    url = server.acquire()
    try:
        yield url
    finally:
        server.release()
