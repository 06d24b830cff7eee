"""Connections for transactional handlers: the transaction a handler writes in, and that
records its step's completion.

A sync handler borrows a connection from a pool of the worker; an async handler from an
async pool created on the worker's event loop. Each transaction runs at the isolation
level the handler declared (``read committed`` unless it asked for another).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from cyclone_dsl.db.connect import (
    CHECK_CLIENT_MS,
    CHECK_CLIENT_SINCE,
    connection_kwargs,
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


def ready_for_completion(conn: psycopg.Connection[Any]) -> timedelta:
    """How long ago the open transaction on ``conn`` began, whatever row factory the handler
    set on its connection; the rest of the transaction gets the session's own search_path
    back (see ``Q.completion_setup``)."""
    with conn.cursor(row_factory=tuple_row) as cur:
        age_s, _ = cur.execute(Q.completion_setup).fetchone() or (0.0, None)
    return timedelta(seconds=age_s)


async def async_ready_for_completion(conn: psycopg.AsyncConnection[Any]) -> timedelta:
    """:func:`ready_for_completion` on an async connection."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        age_s, _ = await (await cur.execute(Q.completion_setup)).fetchone() or (0.0, None)
    return timedelta(seconds=age_s)


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
        for_handlers=True,
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
        if not pooled and conn.info.server_version >= CHECK_CLIENT_SINCE:
            await conn.execute(Q.watch_client, {"ms": CHECK_CLIENT_MS})

    async def reset(conn: psycopg.AsyncConnection[Any]) -> None:  # see _reset_handlers_session
        conn.row_factory = tuple_row
        await conn.execute(Q.discard_session)
        if conn.info.server_version >= CHECK_CLIENT_SINCE:
            await conn.execute(Q.watch_client, {"ms": CHECK_CLIENT_MS})

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
