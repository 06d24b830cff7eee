"""LISTEN on a dedicated connection (the channel is a constant identifier, never user data)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import sql

from cyclone_dsl.sql import Q

#: A listener whose ping gets no answer in this many seconds is cut and reconnected.
PING_TIMEOUT_S = 5.0


def listen(conn: psycopg.Connection[Any], channel: str, timeout: float = PING_TIMEOUT_S) -> None:
    """LISTEN on ``channel``; like :func:`ping`, give up if the server does not answer."""
    with answer_within(conn, timeout):
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))


def unlisten(conn: psycopg.Connection[Any], channel: str, timeout: float = PING_TIMEOUT_S) -> None:
    """UNLISTEN ``channel``, bounded as :func:`listen` is."""
    with answer_within(conn, timeout):
        conn.execute(sql.SQL("UNLISTEN {}").format(sql.Identifier(channel)))


def ping(conn: psycopg.Connection[Any], timeout: float = PING_TIMEOUT_S) -> None:
    """Round-trip on ``conn``; raise :class:`psycopg.OperationalError` if no answer in time.

    TCP keepalives notice a dead network, but not a peer that still acknowledges
    packets and never answers (a stuck proxy or pooler: a half-open connection).
    Without an answer, the socket is shut down under the blocked read, which
    makes psycopg raise, so the caller reconnects instead of waiting forever.
    """
    with answer_within(conn, timeout):
        conn.execute(Q.ping)


@contextlib.contextmanager
def answer_within(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], timeout: float
) -> Iterator[None]:
    """Shut ``conn``'s socket down if the block has not ended after ``timeout`` seconds.

    The statement waiting in the block then fails with
    :class:`psycopg.OperationalError` instead of waiting forever for a peer
    that acknowledges packets and never answers.
    """
    timer = threading.Timer(timeout, _shut_down, args=(conn,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _shut_down(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    try:
        fd = os.dup(conn.pgconn.socket)
    except (psycopg.Error, OSError):
        return  # already closed
    with socket.socket(fileno=fd) as sock, contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
