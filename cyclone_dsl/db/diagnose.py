"""Connecting with a named cause: every way a connection fails becomes one typed error.

A wrong port, an unknown host or a missing database must fail in seconds with
an error that says which, not after a pool's 30 s timeout with
``PoolTimeout``. :func:`connect_checked` makes one direct attempt with a short
``connect_timeout`` and turns libpq's failure into
:class:`~cyclone_dsl.errors.DatabaseUnavailable` (or, for a DSN that does not
parse, :class:`~cyclone_dsl.errors.InvalidArgument`).
"""

from __future__ import annotations

import re
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cyclone_dsl.errors import DatabaseUnavailable, InvalidArgument

#: Seconds a start-up check waits for the server (unless the DSN sets connect_timeout).
CHECK_TIMEOUT_S = 5

#: libpq messages (no SQLSTATE is set on a failed connection) -> cause and advice.
_MESSAGES: tuple[tuple[re.Pattern[str], str, str], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), cause, advice)
    for pattern, cause, advice in (
        (
            r'database "[^"]*" does not exist',
            "database_missing",
            "create it, or fix the database name in the DSN",
        ),
        (
            r"password authentication failed|role \"[^\"]*\" does not exist"
            r"|no pg_hba.conf entry|authentication failed|password",
            "authentication_failed",
            "check the user name, the password and the server's pg_hba.conf",
        ),
        (
            r"too many (clients|connections)|remaining connection slots",
            "too_many_connections",
            "the server has no connection slot left: lower pool sizes, or use PgBouncer",
        ),
        (
            r"starting up|shutting down|in recovery mode|not yet accepting",
            "server_starting_or_stopping",
            "the server is starting or stopping: try again in a moment",
        ),
        (
            r"could not translate host name|failed to resolve host|Name or service not known"
            r"|nodename nor servname",
            "unknown_host",
            "check the host name in the DSN",
        ),
        (
            r"timeout expired|timed out",
            "timeout",
            "the server did not answer: check the host, the port and any firewall or proxy",
        ),
        (
            r"Connection refused|No such file or directory|invalid port",
            "connection_refused",
            "is PostgreSQL running there, and is the port right?",
        ),
    )
)

#: SQLSTATEs a server sends when it refuses a session.
_SQLSTATES = {
    "3D000": ("database_missing", "create it, or fix the database name in the DSN"),
    "28P01": ("authentication_failed", "check the user name and the password"),
    "28000": ("authentication_failed", "check the user name and the server's pg_hba.conf"),
    "53300": ("too_many_connections", "lower pool sizes, or use PgBouncer"),
    "57P03": ("server_starting_or_stopping", "try again in a moment"),
}


def parse_dsn(dsn: str) -> dict[str, Any]:
    """The DSN's parameters; :class:`InvalidArgument` for one that libpq cannot parse."""
    if not isinstance(dsn, str) or not dsn.strip():
        raise InvalidArgument("the DSN is empty: pass a PostgreSQL URL or conninfo string")
    try:
        return conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        hint = ""
        scheme = dsn.split("://", 1)[0] if "://" in dsn else None
        if scheme is not None and scheme not in ("postgresql", "postgres"):
            hint = f" (the URL scheme is {scheme!r}: it must be 'postgresql' or 'postgres')"
        raise InvalidArgument(f"the DSN cannot be parsed: {exc}{hint}") from None


def describe_server(params: dict[str, Any]) -> str:
    """``host:port/dbname`` (or the socket folder), without credentials."""
    host = str(params.get("host") or "localhost")
    port = str(params.get("port") or "5432")
    where = f"socket {host}:{port}" if host.startswith("/") else f"{host}:{port}"
    database = params.get("dbname")
    return f"{where} (database {database!r})" if database else where


def unavailable(exc: psycopg.Error, params: dict[str, Any]) -> DatabaseUnavailable:
    """The typed error for a failed connection attempt to the server of ``params``."""
    text = str(exc)
    where = describe_server(params)
    if exc.sqlstate in _SQLSTATES:
        cause, advice = _SQLSTATES[exc.sqlstate]
    else:
        cause, advice = "other", "check the DSN and that the server is up"
        for pattern, found_cause, found_advice in _MESSAGES:
            if pattern.search(text):
                cause, advice = found_cause, found_advice
                break
    detail = _libpq_detail(text)
    return DatabaseUnavailable(f"cannot connect to {where}: {detail}: {advice}", cause)


def _libpq_detail(text: str) -> str:
    """libpq's own reason, on one line and without its hints ("Is the server running...")."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    first = lines[0] if lines else "no detail"
    first = first.removeprefix("connection failed: ").removeprefix("connection is bad: ")
    if "failed: " in first:
        first = first.rsplit("failed: ", 1)[1]
    return first.replace("FATAL:  ", "").strip()


def connect_checked(
    dsn: str, *, name: str, timeout: int = CHECK_TIMEOUT_S, pooled: bool = False
) -> psycopg.Connection[Any]:
    """One autocommit connection, opened within ``timeout`` seconds, or a typed error
    (``pooled``: through a transaction-mode pooler, so no server-side prepared statements)."""
    params = parse_dsn(dsn)
    extra: dict[str, Any] = {} if "connect_timeout" in params else {"connect_timeout": timeout}
    prepare: dict[str, Any] = {"prepare_threshold": None} if pooled else {}
    try:
        return psycopg.connect(
            make_conninfo(dsn, **extra), autocommit=True, application_name=name, **prepare
        )
    except psycopg.OperationalError as exc:
        raise unavailable(exc, params) from exc
    except psycopg.ProgrammingError as exc:  # a parameter libpq rejects at connect time
        raise InvalidArgument(f"the DSN cannot be used: {exc}") from None


def check_reachable(dsn: str, *, name: str = "cyclone-check") -> None:
    """Raise :class:`DatabaseUnavailable` (or :class:`InvalidArgument`) unless a
    connection opens within a few seconds."""
    connect_checked(dsn, name=name).close()


#: SQLSTATE classes and codes that mean the session itself is gone (not a statement error).
_LOST_CLASSES = ("08",)
_LOST_CODES = frozenset({"57P01", "57P02", "57P03"})


def is_connection_loss(exc: BaseException) -> bool:
    """Whether ``exc`` is a lost or refused connection (not a failed statement)."""
    if not isinstance(exc, psycopg.OperationalError):
        return False
    state = exc.sqlstate
    return state is None or state.startswith(_LOST_CLASSES) or state in _LOST_CODES
