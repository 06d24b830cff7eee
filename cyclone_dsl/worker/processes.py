"""Many worker processes under one supervisor (``Worker(..., processes=N)``).

The supervisor holds no database connection. It starts N child processes, each a full
:class:`~cyclone_dsl.worker.worker.Worker` (its own pools, threads and listener) that
imports the handler modules by name, as ``cyclone worker`` does. It restarts a child
that dies (at once, then with a growing delay while it keeps dying at once); the
steps the dead child held come back through lease expiry, as with any killed worker.

Each child watches a pipe from the supervisor: when the supervisor closes it (it was
asked to stop) or dies, the child stops gracefully. Through a second pipe, each child
reports its completed steps and its settings every :data:`REPORT_INTERVAL_S` (the
supervisor's ``completed_count`` and ``reports``). Stopping through a pipe rather than
a signal keeps a child that also received the signal itself (a terminal's Ctrl-C, or
systemd signalling the whole control group) from taking it as a second, immediate stop.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from cyclone_dsl.dsl.step import StepDef
from cyclone_dsl.dsl.workflow import WorkflowDef
from cyclone_dsl.errors import InvalidArgument

log = logging.getLogger("cyclone.worker")

#: The environment variable that carries a child's settings (JSON), DSN included: the
#: environment of a process is readable by its own user only, its command line by all.
#: The signals a worker process holds back until it can take them as a stop.
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})

ENV_SPEC = "CYCLONE_WORKER_SPEC"
#: A child that ran at least this long before it died is restarted at once.
STABLE_S = 10.0
#: While a child keeps dying sooner, its restarts wait 1, 2, 4... seconds, up to this.
MAX_BACKOFF_S = 30.0
#: At a stop, children get their grace and this much more before they are killed.
STOP_MARGIN_S = 15.0
#: How often a child reports its completed steps and its settings (when they changed).
REPORT_INTERVAL_S = 0.2


def default_processes() -> int:
    """The cores this process may run on (``cyclone worker``'s default ``--processes``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def handler_refs(objects: Iterable[object]) -> list[str]:
    """How a child imports each of ``objects``: a module name, or ``module:attribute``.

    Raises :class:`InvalidArgument` for an object a child cannot import by name (defined
    in a script run as ``__main__``, or not bound to a name in its module).
    """
    refs = []
    for obj in objects:
        if isinstance(obj, str):
            refs.append(obj)
        elif isinstance(obj, types.ModuleType):
            refs.append(_importable(obj.__name__, obj))
        elif isinstance(obj, StepDef | WorkflowDef):
            module_name = obj.fn.__module__
            module = sys.modules.get(module_name)
            attribute = next(
                (k for k, v in vars(module).items() if v is obj) if module else iter(()), None
            )
            if attribute is None:
                raise InvalidArgument(
                    f"processes > 1: {obj.name!r} is not a module-level name of "
                    f"{module_name!r}, so a worker process cannot import it; pass its module"
                )
            refs.append(f"{_importable(module_name, obj)}:{attribute}")
        else:
            raise InvalidArgument(f"expected a module, a module name or a definition, not {obj!r}")
    return refs


def _importable(module_name: str, what: object) -> str:
    """The name a child imports ``module_name`` by (``python -m pkg.mod`` runs as
    ``__main__`` but imports as ``pkg.mod``)."""
    if module_name != "__main__":
        return module_name
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        return str(spec.name)
    raise InvalidArgument(
        f"processes > 1: {what!r} is defined in the script being run (__main__), which "
        "worker processes cannot import; move the handlers to a module, or use processes=1"
    )


def also_modules(workflows: Iterable[WorkflowDef]) -> list[str]:
    """The importable modules that define ``workflows`` (a child knows them too)."""
    names = set()
    for definition in workflows:
        try:
            names.add(_importable(definition.fn.__module__, definition))
        except InvalidArgument:
            continue  # a workflow of a script: the children cannot know it
    return sorted(names)


@attrs.define
class _Child:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    stop_fd: int | None = None  # the supervisor's end of the child's stop pipe
    report_fd: int | None = None  # the supervisor's end of the child's report pipe
    unread: bytes = b""  # the start of a report line not read in full yet
    report: dict[str, Any] | None = None  # the last report read
    started: float = 0.0
    quick_deaths: int = 0
    restart_at: float = 0.0


class Supervisor:
    """Runs ``processes`` worker processes from ``spec`` (see :mod:`.child`) until stopped.

    :meth:`run` blocks (signals stop it); :meth:`start`/:meth:`stop` run it in a thread.
    """

    def __init__(self, spec: Mapping[str, Any], processes: int, *, grace: float) -> None:
        self.spec = dict(spec)
        self.grace = grace
        self.children = [_Child(index=i) for i in range(1, processes + 1)]
        self._stopping = threading.Event()
        self._now = threading.Event()  # a second signal: kill the children at once
        self._thread: threading.Thread | None = None
        self.exit_code: int | None = None
        self._reports_lock = threading.Lock()
        self._retired = 0  # steps completed by children that have exited since

    @property
    def completed_count(self) -> int:
        """Steps the children completed, as they last reported (alive or exited)."""
        with self._reports_lock:
            return self._retired + sum(
                int(c.report["completed"]) for c in self.children if c.report is not None
            )

    def reports(self) -> list[dict[str, Any]]:
        """The last settings each running child reported (``Worker.settings()`` as a dict),
        one per child that has reported since it started."""
        with self._reports_lock:
            return [dict(c.report["settings"]) for c in self.children if c.report is not None]

    @property
    def pids(self) -> list[int]:
        """The pids of the children alive now."""
        return [c.proc.pid for c in self.children if c.proc is not None and c.proc.poll() is None]

    def run(self) -> int:
        """Run until SIGTERM or SIGINT (a second one kills the children at once); return 0
        when every child stopped cleanly, else 1."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, self._on_signal)
        try:
            return self._supervise()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def start(self) -> Supervisor:
        self._thread = threading.Thread(
            target=self._supervise, name="cyclone-supervisor", daemon=True
        )
        self._thread.start()
        return self

    def request_stop(self) -> None:
        """Begin a graceful stop of the children (as a first SIGTERM does); return at once."""
        self._stopping.set()

    def stop(self, timeout: float | None = None) -> int | None:
        """Stop the children gracefully; return the exit code :meth:`run` would, or None
        while they are still stopping after ``timeout`` seconds."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout if timeout is not None else self.grace + STOP_MARGIN_S + 5)
        return self.exit_code  # None: still stopping (or running in run(), told to stop)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._stopping.is_set():
            log.warning("second signal: killing the worker processes now")
            self._now.set()
            return
        log.info(
            "signal %s: stopping %d worker processes (grace %.0fs)",
            signum,
            len(self.children),
            self.grace,
        )
        self._stopping.set()

    def _supervise(self) -> int:
        log.info("supervisor %d: starting %d worker processes", os.getpid(), len(self.children))
        try:
            for child in self.children:
                self._spawn(child)
            while not self._stopping.wait(0.1):
                for child in self.children:
                    self._check(child)
        finally:
            self.exit_code = self._stop_all()
        return self.exit_code

    def _spawn(self, child: _Child) -> None:
        read_end, write_end = os.pipe()  # both ends non-inheritable: only pass_fds shares one
        report_read, report_write = os.pipe()
        os.set_blocking(report_read, False)
        spec = {**self.spec, "index": child.index, "stop_fd": read_end, "report_fd": report_write}
        # The child starts with SIGTERM and SIGINT blocked (a thread's signal mask survives
        # exec): a group signal while its interpreter starts and imports stays pending until
        # it has handlers of its own, which take it as a stop (cyclone_dsl.worker.child).
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            child.proc = subprocess.Popen(
                [sys.executable, "-m", "cyclone_dsl.worker.child"],
                env={**os.environ, ENV_SPEC: json.dumps(spec)},
                pass_fds=(read_end, report_write),
            )
        except BaseException:
            os.close(write_end)
            os.close(report_read)
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            os.close(read_end)
            os.close(report_write)
        child.stop_fd = write_end
        child.report_fd = report_read
        child.started = time.monotonic()
        log.info("worker process %d started (pid %d)", child.index, child.proc.pid)

    def _check(self, child: _Child) -> None:
        now = time.monotonic()
        if child.proc is None:
            if now >= child.restart_at:
                self._spawn(child)
            return
        code = child.proc.poll()
        if code is None:
            self._read_reports(child)
            return
        self._close_pipe(child)
        self._retire(child)
        lived = now - child.started
        child.quick_deaths = child.quick_deaths + 1 if lived < STABLE_S else 0
        delay = (
            0.0 if child.quick_deaths <= 1 else min(MAX_BACKOFF_S, 2.0 ** (child.quick_deaths - 2))
        )
        log.error(
            "worker process %d (pid %d) %s after %.1fs; restarting it %s; the steps it held "
            "are reclaimed when their leases expire",
            child.index,
            child.proc.pid,
            _how(code),
            lived,
            f"in {delay:.0f}s (it keeps dying soon after starting)" if delay else "now",
        )
        child.proc = None
        child.restart_at = now + delay
        if not delay:
            self._spawn(child)

    def _stop_all(self) -> int:
        """Ask every child to stop, wait for their grace, kill what is left."""
        running = [c for c in self.children if c.proc is not None]
        for child in running:
            self._close_pipe(child)
        deadline = time.monotonic() + self.grace + STOP_MARGIN_S
        clean = True
        for child in running:
            assert child.proc is not None
            while child.proc.poll() is None and time.monotonic() < deadline:
                if self._now.is_set():
                    break
                try:
                    child.proc.wait(0.1)
                except subprocess.TimeoutExpired:
                    continue
            if child.proc.poll() is None:
                if not self._now.is_set():
                    log.error(
                        "worker process %d (pid %d) did not stop in %.0fs: killing it",
                        child.index,
                        child.proc.pid,
                        self.grace + STOP_MARGIN_S,
                    )
                child.proc.kill()
                child.proc.wait()
            self._retire(child)
            code = child.proc.returncode
            if code != 0:
                clean = False
                log.error("worker process %d (pid %d) %s", child.index, child.proc.pid, _how(code))
        log.info("supervisor %d: all worker processes stopped", os.getpid())
        return 0 if clean else 1

    def _read_reports(self, child: _Child) -> None:
        """Read what ``child`` reported since the last call; keep its last report."""
        if child.report_fd is None:
            return
        chunks = [child.unread]
        while True:
            try:
                data = os.read(child.report_fd, 65536)
            except BlockingIOError:
                break
            if not data:  # the child exited: every report it wrote has been read
                os.close(child.report_fd)
                child.report_fd = None
                break
            chunks.append(data)
        *lines, child.unread = b"".join(chunks).split(b"\n")
        for line in reversed(lines):
            try:
                report = json.loads(line)
            except ValueError:  # not a report: never let it stop the supervisor
                continue
            with self._reports_lock:
                child.report = report
            break

    def _retire(self, child: _Child) -> None:
        """``child`` exited: read its last report, and count its steps as the retired's."""
        self._read_reports(child)
        if child.report_fd is not None:
            os.close(child.report_fd)
            child.report_fd = None
        with self._reports_lock:
            if child.report is not None:
                self._retired += int(child.report["completed"])
            child.report = None
        child.unread = b""

    @staticmethod
    def _close_pipe(child: _Child) -> None:
        if child.stop_fd is not None:
            os.close(child.stop_fd)
            child.stop_fd = None


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def base_name(name: str | None) -> str:
    """The children's registry names are ``<base>/1`` to ``<base>/N``."""
    return name or f"{socket.gethostname()}:{os.getpid()}"


def worker_spec(
    dsn: str,
    objects: Iterable[object],
    *,
    also: Iterable[WorkflowDef],
    name: str | None,
    options: Mapping[str, Any],
) -> dict[str, Any]:
    """What a child needs to build the same worker as this process (JSON-ready)."""
    return {
        "dsn": dsn,
        "refs": handler_refs(objects),
        "also": also_modules(also),
        "name": base_name(name),
        "options": dict(options),
        "sys_path": [p for p in sys.path if p],
        "log": log_settings(),
    }


def log_settings() -> dict[str, Any]:
    """This process's log level, and whether it logs JSON lines (``--log-format json``)."""
    from cyclone_dsl.observability.logs import JsonFormatter

    root = logging.getLogger()
    as_json = any(isinstance(h.formatter, JsonFormatter) for h in root.handlers)
    return {"json": as_json, "level": root.getEffectiveLevel()}
