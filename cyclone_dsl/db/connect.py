"""Connection pools with Cyclone's session settings, direct or through a pooler.

A *pooled* DSN goes through a transaction-mode pooler (PgBouncer): each transaction may
run on another server session, so its connections carry no session state. They send no
``options`` startup parameter (PgBouncer refuses it) and never prepare statements on
the server (psycopg prepares a query after its 5th execution; the prepared statement
would exist on one server session only). LISTEN never goes over a pooled DSN: see
:func:`listen_target`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Self, cast

import psycopg
from psycopg_pool import ConnectionPool

from cyclone_dsl.db.adapters import use_engine_adapters
from cyclone_dsl.sql import Q

#: A pool of Cyclone connections (see :func:`make_pool`).
Pool = ConnectionPool[Any]

#: Worker and client sessions never sit idle inside a transaction for long (seconds).
IDLE_IN_TRANSACTION_S = 10.0


#: ``$CYCLONE_POOLED`` (``1``/``true``/``yes``): the DSN goes through a transaction-mode pooler.
ENV_POOLED = "CYCLONE_POOLED"
#: ``$CYCLONE_LISTEN_URL``: a direct connection for LISTEN when the DSN is pooled.
ENV_LISTEN_URL = "CYCLONE_LISTEN_URL"
#: ``$CYCLONE_READ_URL``: a read replica the dashboard and the read-only commands read from.
ENV_READ_URL = "CYCLONE_READ_URL"


def resolve_pooled(pooled: bool | None) -> bool:
    """``pooled``, or when it is ``None``, whether ``$CYCLONE_POOLED`` says so."""
    if pooled is not None:
        return pooled
    return os.environ.get(ENV_POOLED, "").strip().lower() in ("1", "true", "yes", "on")


def resolve_listen_dsn(listen_dsn: str | None) -> str | None:
    """``listen_dsn``, or when it is ``None``, ``$CYCLONE_LISTEN_URL`` (``""``: none)."""
    if listen_dsn is None:
        listen_dsn = os.environ.get(ENV_LISTEN_URL)
    return listen_dsn or None


def listen_target(dsn: str, *, pooled: bool, listen_dsn: str | None) -> str | None:
    """Where to LISTEN: ``listen_dsn`` if given, else ``dsn`` unless it is pooled (a
    transaction-mode pooler would register the LISTEN on whichever server session ran
    it, and deliver its notifications to nobody); ``None``: no LISTEN, poll."""
    if listen_dsn:
        return listen_dsn
    return None if pooled else dsn


def configure_connection(conn: psycopg.Connection[Any]) -> None:
    """An engine connection's settings: autocommit, read committed, the engine's adapters."""
    conn.autocommit = True
    conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED  # see _merge_options
    use_engine_adapters(conn)
    iso_dates(conn)


def keep_idle_session(conn: psycopg.Connection[Any]) -> None:
    """Turn off a role's ``idle_session_timeout`` for this direct session (see the
    ``keep_idle_session`` statement); never through a pooler, whose server sessions are its
    own (it opens new ones when the server ends them)."""
    conn.execute(Q.keep_idle_session)
    if not conn.autocommit:
        conn.commit()


async def keep_idle_session_async(conn: psycopg.AsyncConnection[Any]) -> None:
    """:func:`keep_idle_session` on an async connection (autocommit)."""
    await conn.execute(Q.keep_idle_session)


def _direct_too(
    configure: Callable[[psycopg.Connection[Any]], None], *, pooled: bool
) -> Callable[[psycopg.Connection[Any]], None]:
    """A pool's ``configure``, plus :func:`keep_idle_session` on a direct connection."""
    if pooled:
        return configure

    def configure_direct(conn: psycopg.Connection[Any]) -> None:
        configure(conn)
        keep_idle_session(conn)

    return configure_direct


def iso_dates(conn: psycopg.Connection[Any]) -> None:
    """Dates in the ISO style, which psycopg reads (see _merge_options), on a session that
    got no ``options`` (``pooled``: PgBouncer keeps a client's DateStyle on whichever
    server session it lends); free when they already are (the server reports the style)."""
    if not _dates_are_iso(conn):
        conn.execute(Q.iso_dates)
        if not conn.autocommit:
            conn.commit()


async def iso_dates_async(conn: psycopg.AsyncConnection[Any]) -> None:
    """:func:`iso_dates` on an async connection (autocommit)."""
    if not _dates_are_iso(conn):
        await conn.execute(Q.iso_dates)


def _dates_are_iso(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    return (conn.info.parameter_status("DateStyle") or "ISO").startswith("ISO")


#: How often the server checks, while a statement runs, that the client of a watched
#: connection is still there (``client_connection_check_interval``, PostgreSQL 14+).
#: Without it, a worker that dies mid-statement leaves its statement running until it
#: ends, and its transaction holding its locks (and its step, see ``hold_lease``).
CHECK_CLIENT_MS = 2000
CHECK_CLIENT_SINCE = 140000


def make_pool(
    conninfo: str,
    *,
    name: str,
    min_size: int = 1,
    max_size: int = 4,
    open_now: bool = True,
    idle_in_transaction_s: float = IDLE_IN_TRANSACTION_S,
    pooled: bool = False,
    server_jit: bool = False,
    configure: Callable[[psycopg.Connection[Any]], None] = configure_connection,
    reset: Callable[[psycopg.Connection[Any]], None] | None = None,
    first: psycopg.Connection[Any] | None = None,
) -> ConnectionPool[Any]:
    """A pool of autocommit connections (transactions are explicit) named ``name``; the
    server ends a transaction of theirs idle ``idle_in_transaction_s`` seconds (unless
    ``pooled``: then the pooler's or the role's settings apply). ``server_jit``: keep
    the server's JIT setting (see :func:`connection_kwargs`). ``configure`` and ``reset``:
    as psycopg_pool's (by default, the engine's autocommit connections, not reset: see
    :mod:`cyclone_dsl.db.handler_tx` for those of transactional handlers). ``first``: a
    connection already open with these settings (a start-up check's), which the pool
    takes as its first instead of opening one (closed if the pool cannot be made)."""
    try:
        pool: ConnectionPool[Any] = ConnectionPool(
            conninfo,
            connection_class=psycopg.Connection if first is None else _handing_over(first),
            min_size=min_size,
            max_size=max_size,
            kwargs=connection_kwargs(
                conninfo,
                name,
                idle_in_transaction_s=idle_in_transaction_s,
                pooled=pooled,
                server_jit=server_jit,
            ),
            configure=_direct_too(configure, pooled=pooled),
            reset=reset,
            open=False,
            name=name,
            reconnect_timeout=3600,
        )
        if open_now:
            pool.open(wait=True, timeout=30)
    except BaseException:
        if first is not None:  # given to a pool that failed: nobody else closes it
            first.close()
        raise
    return pool


def _handing_over(first: psycopg.Connection[Any]) -> type[psycopg.Connection[Any]]:
    """A connection class for a pool: its first ``connect`` returns ``first``, already
    open, and the later ones connect. A client or worker checks the database on one
    connection, then gives it to its pool: it starts with one server session, not two."""
    handed = [first]

    class HandedOver(psycopg.Connection[Any]):
        @classmethod
        def connect(cls, conninfo: str = "", **kwargs: Any) -> Self:
            try:
                return cast(Self, handed.pop())
            except IndexError:  # handed over already (pop: one thread gets it)
                return super().connect(conninfo, **kwargs)

    return HandedOver


def _merge_options(conninfo: str, idle_in_transaction_s: float, *, server_jit: bool) -> str:
    existing = str(psycopg.conninfo.conninfo_to_dict(conninfo).get("options") or "")
    idle_ms = max(1, round(idle_in_transaction_s * 1000))
    # The engine's statements are written for read committed, whatever the role's or the
    # database's default_transaction_isolation (autocommit statements included).
    # psycopg reads dates and intervals in their ISO and postgres styles only (a role's
    # DateStyle of 'SQL, DMY' made every timestamp read fail); the input order is kept.
    options = (
        f"{existing} -c idle_in_transaction_session_timeout={idle_ms}"
        " -c default_transaction_isolation=read\\ committed"
        " -c DateStyle=ISO -c IntervalStyle=postgres"
    )
    if not server_jit and "jit" not in existing:
        options += " -c jit=off"
    return options.strip()


#: TCP settings of every connection (pooled ones live long too): a half-open connection
#: (a failover, a NAT that forgot it) is noticed in seconds instead of hanging forever,
#: and a connection attempt that gets no answer (a stuck proxy or pooler that accepts the
#: TCP handshake and stays silent) gives up after ``connect_timeout`` seconds.
KEEPALIVE: dict[str, str | int | None] = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 3,
    "keepalives_count": 3,
    "tcp_user_timeout": 20_000,
}


def connect(
    conninfo: str, *, name: str, autocommit: bool = True, pooled: bool = False
) -> psycopg.Connection[Any]:
    """A dedicated connection with keepalives (ignored on Unix sockets), reading ``jsonb``
    as the engine does."""
    conn = psycopg.connect(
        conninfo, autocommit=autocommit, **connection_kwargs(conninfo, name, pooled=pooled)
    )
    conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED  # see _merge_options
    use_engine_adapters(conn)
    iso_dates(conn)
    if not pooled:
        keep_idle_session(conn)
    return conn


async def connect_async(
    conninfo: str, *, name: str, pooled: bool = False
) -> psycopg.AsyncConnection[Any]:
    """An async autocommit connection with the same settings as :func:`connect`."""
    conn = await psycopg.AsyncConnection.connect(
        conninfo, autocommit=True, **connection_kwargs(conninfo, name, pooled=pooled)
    )
    try:
        await conn.set_isolation_level(psycopg.IsolationLevel.READ_COMMITTED)
        use_engine_adapters(conn)
        await iso_dates_async(conn)
        if not pooled:
            await keep_idle_session_async(conn)
    except BaseException:
        # A cancel (a caller's timeout) landing here would leave the open connection to
        # the garbage collector: nobody else holds it yet. (close() does not yield.)
        await conn.close()
        raise
    return conn


def connection_kwargs(
    conninfo: str,
    name: str,
    *,
    idle_in_transaction_s: float = IDLE_IN_TRANSACTION_S,
    pooled: bool = False,
    server_jit: bool = False,
) -> dict[str, Any]:
    """The settings every Cyclone connection to ``conninfo`` gets (for a pool made elsewhere).

    ``pooled``: no ``options`` startup parameter and no server-side prepared statements
    (``prepare_threshold=None``), so no session state is left on a pooler's server session.

    JIT is off (unless the DSN's ``options`` set ``jit``, or ``server_jit`` asks to keep
    the server's setting, as a transactional handler's connection does for the user's
    own SQL): Cyclone's statements are short, and compiling one takes milliseconds.
    """
    if pooled:
        return {"application_name": name, "prepare_threshold": None, **_tcp_settings(conninfo)}
    return {
        "application_name": name,
        "options": _merge_options(conninfo, idle_in_transaction_s, server_jit=server_jit),
        **_tcp_settings(conninfo),
    }


def _tcp_settings(conninfo: str) -> dict[str, str | int | None]:
    """:data:`KEEPALIVE`, except what the connection string sets itself."""
    given = psycopg.conninfo.conninfo_to_dict(conninfo)
    return {key: value for key, value in KEEPALIVE.items() if key not in given}
