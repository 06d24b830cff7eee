"""CPU time per step, of the server and of the process that drives the work.

Wall-clock rates on a shared machine swing by tens of percent; the CPU seconds a
scenario costs barely move. :class:`Meter` reads them for a local server (the embedded
one): the server's processes from ``/proc`` (the live backends, plus what the postmaster
reaped from backends that exited meanwhile), this process's from ``time.process_time``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psycopg

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()  # the fields after "(comm)"


class Meter:
    """CPU seconds spent between :meth:`start` and :meth:`stop` (``None``: no /proc, or a
    server on another machine)."""

    def __init__(self, dsn: str) -> None:
        self.postmaster: int | None = None
        try:
            with psycopg.connect(dsn) as conn:
                row = conn.execute("SELECT pg_backend_pid()").fetchone()
                backend = int(row[0]) if row else 0
                self.postmaster = int(_stat(backend)[1])  # ppid, read while the backend lives
        except (OSError, ValueError, psycopg.Error):
            self.postmaster = None
        self.server_s: float | None = None
        self.client_s = 0.0
        self._started: tuple[float, float] = (0.0, 0.0)

    def _server(self) -> float:
        assert self.postmaster is not None
        own = _stat(self.postmaster)
        ticks = sum(int(v) for v in own[11:15])  # utime, stime, cutime, cstime
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = _stat(int(entry.name))
            except (OSError, ValueError):
                continue  # exited meanwhile: the postmaster's cutime has it
            if int(fields[1]) == self.postmaster:
                ticks += int(fields[11]) + int(fields[12])
        return ticks / _TICK

    def start(self) -> None:
        server = self._server() if self.postmaster is not None else 0.0
        self._started = (server, time.process_time())

    def stop(self) -> None:
        if self.postmaster is not None:
            self.server_s = self._server() - self._started[0]
        self.client_s = time.process_time() - self._started[1]
