"""A dedicated connection that LISTENs, for one thread that waits on its notifications and on
a wake-up socket at once (a client's run watcher, a worker's wake-ups).

It connects on first use and again after a failure; every read is bounded
(:func:`~cyclone_dsl.db.listen.answer_within`), and a connection that fails, or does not
answer in time, raises :class:`ConnectionLost` after being closed.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
from collections.abc import Iterator, Sequence
from typing import Any, LiteralString

import psycopg
from psycopg.rows import dict_row

from cyclone_dsl.db.connect import connect
from cyclone_dsl.db.errors import first_line
from cyclone_dsl.db.listen import PING_TIMEOUT_S, answer_within, listen, ping, unlisten


class ConnectionLost(Exception):
    """The listener's connection failed (lost, refused, or silent past the ping timeout);
    it was closed, and the next use opens a new one."""


#: Connections inherited through a fork: kept, never used nor closed (a close would end
#: the parent's session).
_INHERITED: list[psycopg.Connection[Any]] = []


class Listener:
    """Reads and notifications on one connection to ``dsn`` named ``name``; LISTENs on
    ``channels`` unless ``listen`` is false (a transaction-mode pooler: reads only)."""

    def __init__(
        self,
        dsn: str,
        *,
        name: str,
        channels: Sequence[str],
        listen: bool = True,
        pooled: bool = False,
    ) -> None:
        self.dsn = dsn
        self.name = name
        self.channels = tuple(channels)
        self.listens = listen
        self.pooled = pooled
        self._conn: psycopg.Connection[Any] | None = None

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def rows(self, query: LiteralString, params: dict[str, object]) -> list[dict[str, Any]]:
        """Run one query (connecting first if need be); its rows."""
        conn = self._connection()
        with (
            self._lost_on_failure(),
            answer_within(conn, PING_TIMEOUT_S),
            conn.cursor(row_factory=dict_row) as cur,
        ):
            cur.execute(query, params)
            return cur.fetchall()

    def open(self) -> None:
        """Connect (and LISTEN) now unless connected: :class:`ConnectionLost` if it fails."""
        self._connection()

    def ping(self) -> None:
        """One round trip, bounded: a dead or half-open connection raises
        :class:`ConnectionLost` here (after being closed)."""
        conn = self._connection()
        with self._lost_on_failure():
            ping(conn)

    def listen_to(self, channels: Sequence[str]) -> None:
        """LISTEN on exactly ``channels`` from now on: on the open connection at once, and
        on the next one when it is made."""
        wanted = tuple(channels)
        conn = self._conn if self.listens else None
        if conn is not None and wanted != self.channels:
            with self._lost_on_failure():
                for channel in wanted:
                    if channel not in self.channels:
                        listen(conn, channel)
                for channel in self.channels:
                    if channel not in wanted:
                        unlisten(conn, channel)
        self.channels = wanted

    def wait(self, seconds: float, wake: socket.socket) -> tuple[list[tuple[str, str]], bool]:
        """Wait up to ``seconds`` for notifications or a byte on ``wake`` (drained); the
        notifications heard (channel, payload), and whether ``wake`` was. Without a
        connection (or LISTEN), only ``wake`` is watched."""
        conn = self._conn if self.listens else None
        with self._lost_on_failure():
            if conn is not None:
                # Notifications that came in during the last read are kept by psycopg.
                kept = [(n.channel, n.payload) for n in conn.notifies(timeout=0)]
                if kept:
                    return kept, False
            ready = readable(
                [wake.fileno()] if conn is None else [wake.fileno(), conn.pgconn.socket], seconds
            )
            woken = wake.fileno() in ready
            if woken:
                with contextlib.suppress(BlockingIOError):
                    wake.recv(4096)
            heard: list[tuple[str, str]] = []
            if conn is not None and conn.pgconn.socket in ready:
                heard = [(n.channel, n.payload) for n in conn.notifies(timeout=0)]
            return heard, woken

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def abandon(self) -> None:
        """In a child just forked: never use nor close the parent's connection; its socket
        is pointed at /dev/null and the connection kept for ever."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        devnull = os.open(os.devnull, os.O_RDWR)
        try:
            with contextlib.suppress(OSError, psycopg.Error):
                os.dup2(devnull, conn.pgconn.socket)
        finally:
            os.close(devnull)
        _INHERITED.append(conn)

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None:
            with self._lost_on_failure():
                conn = connect(self.dsn, name=self.name, pooled=self.pooled)
                try:
                    for channel in self.channels if self.listens else ():
                        listen(conn, channel)
                except BaseException:
                    conn.close()
                    raise
                self._conn = conn
        return self._conn

    @contextlib.contextmanager
    def _lost_on_failure(self) -> Iterator[None]:
        try:
            yield
        except psycopg.OperationalError as exc:
            self.close()
            raise ConnectionLost(first_line(exc)) from exc


def wake_pair() -> tuple[socket.socket, socket.socket]:
    """A socket pair for waking a thread in :meth:`Listener.wait`: it waits on the first,
    :func:`poke` writes to the second."""
    r, w = socket.socketpair()
    r.setblocking(False)
    w.setblocking(False)
    return r, w


def poke(pair: tuple[socket.socket, socket.socket] | None) -> None:
    """Wake the thread waiting on ``pair`` (nothing if there is none)."""
    if pair is not None:
        with contextlib.suppress(OSError):  # full (a poke is pending), or just closed
            pair[1].send(b"\0")


def readable(fds: Sequence[int], seconds: float) -> set[int]:
    """Which of ``fds`` can be read within ``seconds`` (a selector, not ``select()``: a busy
    process has descriptors past 1024, which ``select()`` refuses)."""
    with selectors.DefaultSelector() as selector:
        for fd in fds:
            selector.register(fd, selectors.EVENT_READ)
        return {key.fd for key, _ in selector.select(seconds)}
