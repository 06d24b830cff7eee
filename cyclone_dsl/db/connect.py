"""Connection pools with Cyclone's session settings."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

#: A pool of Cyclone connections (see :func:`make_pool`).
Pool = ConnectionPool[Any]

#: Worker and client sessions never sit idle inside a transaction for long (seconds).
IDLE_IN_TRANSACTION_S = 60.0


def _configure(conn: psycopg.Connection[Any]) -> None:
    conn.autocommit = True


def make_pool(
    conninfo: str,
    *,
    name: str,
    min_size: int = 1,
    max_size: int = 4,
    open_now: bool = True,
    idle_in_transaction_s: float = IDLE_IN_TRANSACTION_S,
) -> ConnectionPool[Any]:
    """A pool of autocommit connections (transactions are explicit) named ``name``; the
    server ends a transaction of theirs idle ``idle_in_transaction_s`` seconds."""
    pool: ConnectionPool[Any] = ConnectionPool(
        conninfo,
        min_size=min_size,
        max_size=max_size,
        kwargs=connection_kwargs(conninfo, name, idle_in_transaction_s=idle_in_transaction_s),
        configure=_configure,
        open=False,
        name=name,
        reconnect_timeout=3600,
    )
    if open_now:
        pool.open(wait=True, timeout=30)
    return pool


def _merge_options(conninfo: str, idle_in_transaction_s: float = IDLE_IN_TRANSACTION_S) -> str:
    existing = psycopg.conninfo.conninfo_to_dict(conninfo).get("options") or ""
    idle_ms = max(1, round(idle_in_transaction_s * 1000))
    return f"{existing} -c idle_in_transaction_session_timeout={idle_ms}".strip()


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


def connect(conninfo: str, *, name: str, autocommit: bool = True) -> psycopg.Connection[Any]:
    """A dedicated connection with keepalives (ignored on Unix sockets)."""
    return psycopg.connect(
        psycopg.conninfo.make_conninfo(conninfo, **_tcp_settings(conninfo)),
        autocommit=autocommit,
        application_name=name,
        options=_merge_options(conninfo),
    )


async def connect_async(conninfo: str, *, name: str) -> psycopg.AsyncConnection[Any]:
    """An async autocommit connection with the same settings as :func:`connect`."""
    return await psycopg.AsyncConnection.connect(
        psycopg.conninfo.make_conninfo(conninfo, **_tcp_settings(conninfo)),
        autocommit=True,
        application_name=name,
        options=_merge_options(conninfo),
    )


def connection_kwargs(
    conninfo: str, name: str, *, idle_in_transaction_s: float = IDLE_IN_TRANSACTION_S
) -> dict[str, str | int | None]:
    """The settings every Cyclone connection to ``conninfo`` gets (for a pool made elsewhere)."""
    return {
        "application_name": name,
        "options": _merge_options(conninfo, idle_in_transaction_s),
        **_tcp_settings(conninfo),
    }


def _tcp_settings(conninfo: str) -> dict[str, str | int | None]:
    """:data:`KEEPALIVE`, except what the connection string sets itself."""
    given = psycopg.conninfo.conninfo_to_dict(conninfo)
    return {key: value for key, value in KEEPALIVE.items() if key not in given}
