"""Connections for transactional handlers: the transaction a handler writes in, and that
records its step's completion.

A sync handler borrows a connection from a pool of the worker; an async handler from an
async pool created on the worker's event loop. Each transaction runs at the isolation
level the handler declared (``read committed`` unless it asked for another).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any, LiteralString

import psycopg
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from cyclone_dsl.db.connect import (
    CHECK_CLIENT_MS,
    CHECK_CLIENT_SINCE,
    connection_kwargs,
    iso_dates,
    iso_dates_async,
    keep_idle_session_async,
    make_pool,
)
from cyclone_dsl.sql import Q

#: The default is read committed whatever the session's or role's default level is (a
#: handler's ``SET SESSION CHARACTERISTICS``, a role's ``default_transaction_isolation``):
#: the engine reads a default handler's transaction as read committed.
_LEVELS = {
    None: psycopg.IsolationLevel.READ_COMMITTED,
    "read committed": psycopg.IsolationLevel.READ_COMMITTED,
    "repeatable read": psycopg.IsolationLevel.REPEATABLE_READ,
    "serializable": psycopg.IsolationLevel.SERIALIZABLE,
}


AnyConnection = psycopg.Connection[Any] | psycopg.AsyncConnection[Any]

#: Connections whose session their completion reset, in the transaction that committed:
#: the pool's reset, when the connection comes back, has nothing left to do.
_reset_by_completion: weakref.WeakSet[AnyConnection] = weakref.WeakSet()


def transaction_ended(conn: AnyConnection) -> bool:
    """Whether a handler ended the transaction the worker opened for it (a ``COMMIT`` or
    ``ROLLBACK`` sent as SQL: the connection is idle, in no transaction)."""
    return conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def _setup(conn: AnyConnection, pooled: bool) -> LiteralString:
    """What the completion runs first (see the queries): through a pooler, only the
    session's search_path back; else the whole session reset too."""
    if pooled:
        return Q.completion_setup
    watched = conn.info.server_version >= CHECK_CLIENT_SINCE
    return Q.completion_reset_watched if watched else Q.completion_reset


def _last_row(cur: psycopg.Cursor[tuple[Any, ...]]) -> tuple[Any, ...] | None:
    row = None
    while True:
        if cur.description is not None:
            row = cur.fetchone()
        if not cur.nextset():
            return row


async def _async_last_row(cur: psycopg.AsyncCursor[tuple[Any, ...]]) -> tuple[Any, ...] | None:
    row = None
    while True:
        if cur.description is not None:
            row = await cur.fetchone()
        if not cur.nextset():
            return row


def ready_for_completion(conn: psycopg.Connection[Any], *, pooled: bool) -> tuple[timedelta, str]:
    """Ready the handler's transaction for its completion, in one round trip: the session
    given back its search_path (and, on a session of the worker's own, reset); return how
    long ago the transaction began, and its isolation level as it is now (the handler may
    have set it). psycopg's own cursor class and rows, whatever the handler set on its
    connection."""
    with psycopg.Cursor(conn, row_factory=tuple_row) as cur:
        cur.execute(_setup(conn, pooled), prepare=False)
        return _completion_state(_last_row(cur))


async def async_ready_for_completion(
    conn: psycopg.AsyncConnection[Any], *, pooled: bool
) -> tuple[timedelta, str]:
    """:func:`ready_for_completion` on an async connection."""
    async with psycopg.AsyncCursor(conn, row_factory=tuple_row) as cur:
        await cur.execute(_setup(conn, pooled), prepare=False)
        return _completion_state(await _async_last_row(cur))


def _completion_state(row: tuple[Any, ...] | None) -> tuple[timedelta, str]:
    age_s, isolation = row or (0.0, "read committed")
    return timedelta(seconds=age_s), str(isolation)


def committed_after_reset(conn: AnyConnection, *, pooled: bool) -> None:
    """The completion's transaction, which reset the session, committed (the pool's reset
    then skips it once)."""
    if not pooled:
        _reset_by_completion.add(conn)


def _configure_handlers(conn: psycopg.Connection[Any]) -> None:
    """A transactional handler's connection keeps psycopg's loaders for the user's SQL (the
    engine sets its own on the cursors it opens there)."""
    conn.autocommit = True
    iso_dates(conn)


def _configure_handlers_watched(conn: psycopg.Connection[Any]) -> None:
    _configure_handlers(conn)
    if conn.info.server_version >= CHECK_CLIENT_SINCE:
        conn.execute(Q.watch_client, {"ms": CHECK_CLIENT_MS})


def _reset_handlers_session(conn: psycopg.Connection[Any]) -> None:
    """Give the next handler the session the first one got: a handler's ``SET``, temporary
    tables, advisory locks and row factory would otherwise change what the next one runs.
    Done by the completion in its transaction; after a rollback, here."""
    conn.row_factory = tuple_row
    if conn in _reset_by_completion:
        _reset_by_completion.discard(conn)
        return
    with psycopg.Cursor(conn) as cur:
        cur.execute(_setup(conn, pooled=False), prepare=False)


#: The async pool of a worker's transactional handlers.
AsyncPool = AsyncConnectionPool[Any]


def handler_pool(
    dsn: str, *, name: str, max_size: int, idle_s: float, pooled: bool = False
) -> ConnectionPool[Any]:
    """The pool sync transactional handlers borrow their connection from. The server ends a
    transaction of theirs idle ``idle_s`` seconds (a frozen worker's, whose lease expired,
    must not hold its row locks much longer); through a pooler (``pooled``), the pooler's
    ``idle_transaction_timeout`` does."""
    return make_pool(
        dsn,
        name=name,
        min_size=0,
        max_size=max_size,
        idle_in_transaction_s=idle_s,
        pooled=pooled,
        server_jit=True,  # the user's own SQL runs on these
        # A dead worker's statement must not hold its step (not through a pooler: a
        # session setting), and through a pooler sessions are the pooler's to reset.
        configure=_configure_handlers if pooled else _configure_handlers_watched,
        reset=None if pooled else _reset_handlers_session,
    )


@contextlib.contextmanager
def handler_connection(
    pool: ConnectionPool[Any], isolation: str | None
) -> Iterator[psycopg.Connection[Any]]:
    """A pooled connection whose transactions (``with conn.transaction():``) run at
    ``isolation``."""
    with pool.connection() as conn:
        conn.isolation_level = _LEVELS[isolation]
        try:
            yield conn
        finally:
            conn.isolation_level = None


def async_handler_pool(
    dsn: str, *, name: str, max_size: int, idle_s: float, pooled: bool = False
) -> AsyncConnectionPool[Any]:
    """The pool async transactional handlers borrow from (create it on the event loop that
    runs them; open it with ``await pool.open()``)."""

    async def configure(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.set_autocommit(True)
        await iso_dates_async(conn)
        if not pooled:
            await keep_idle_session_async(conn)
        if not pooled and conn.info.server_version >= CHECK_CLIENT_SINCE:
            await conn.execute(Q.watch_client, {"ms": CHECK_CLIENT_MS})

    async def reset(conn: psycopg.AsyncConnection[Any]) -> None:  # see _reset_handlers_session
        conn.row_factory = tuple_row
        if conn in _reset_by_completion:
            _reset_by_completion.discard(conn)
            return
        async with psycopg.AsyncCursor(conn) as cur:
            await cur.execute(_setup(conn, pooled=False), prepare=False)

    return AsyncConnectionPool(
        dsn,
        min_size=0,
        max_size=max_size,
        kwargs=connection_kwargs(
            dsn, name, idle_in_transaction_s=idle_s, pooled=pooled, server_jit=True
        ),
        configure=configure,
        reset=None if pooled else reset,
        open=False,
        name=name,
    )


@contextlib.asynccontextmanager
async def async_handler_connection(
    pool: AsyncConnectionPool[Any], isolation: str | None
) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """:func:`handler_connection` for async handlers."""
    async with pool.connection() as conn:
        await conn.set_isolation_level(_LEVELS[isolation])
        try:
            yield conn
        finally:
            await conn.set_isolation_level(None)


def interrupt(conn: object) -> None:
    """Cancel the statement a sync handler's connection is running (a timeout or cancel),
    from another thread; its transaction then rolls back. (An async handler's task is
    cancelled instead.)"""
    if isinstance(conn, psycopg.Connection):
        with contextlib.suppress(psycopg.Error):
            conn.cancel_safe(timeout=5.0)
