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
from urllib.parse import unquote

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cyclone_dsl.db.errors import ConnectionFailure
from cyclone_dsl.errors import DatabaseUnavailable, InvalidArgument
from cyclone_dsl.sql import Q

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
            r"unsupported startup parameter",
            "unsupported_parameter",
            "a transaction-mode pooler (PgBouncer) refuses the settings a direct connection "
            "sends: pass pooled=True (CYCLONE_POOLED=1, cyclone --pooled) for a DSN through it",
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


#: A URL's scheme (``mysql://``); a key=value conninfo string has none.
_SCHEME = re.compile(r"^\s*([A-Za-z][A-Za-z0-9+.\-]*)://")
_SCHEMES = ("postgresql", "postgres")
#: The password of a URL's user info (``scheme://user:PASSWORD@host``).
_URL_PASSWORD = re.compile(r"(://[^:/@\s]*:)([^@\n]*)(@)")
#: The password of a key=value conninfo string, quoted or not.
_KEY_PASSWORD = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)
MASK = "****"


def _passwords(dsn: str) -> set[str]:
    """The password(s) written in ``dsn``, raw and percent-decoded, found without libpq (which
    may be what failed)."""
    found: set[str] = set()
    for match in _URL_PASSWORD.finditer(dsn):
        found.add(match.group(2))
    for match in _KEY_PASSWORD.finditer(dsn):
        value = match.group(2)
        found.add(value)
        if value.startswith("'") and value.endswith("'") and len(value) >= 2:
            found.add(value[1:-1])
    found |= {unquote(value) for value in found}
    return {value for value in found if value}


def mask_passwords(text: str, dsn: str | None = None, *, password: str | None = None) -> str:
    """``text`` with every password hidden: those of URLs and ``password=`` settings it
    contains, and, given ``dsn`` (or the ``password`` itself), that password wherever it
    appears (libpq quotes pieces of a DSN it cannot parse)."""
    text = _URL_PASSWORD.sub(lambda m: f"{m.group(1)}{MASK}{m.group(3)}", text)
    text = _KEY_PASSWORD.sub(lambda m: f"{m.group(1)}{MASK}", text)
    known = _passwords(dsn) if dsn else set()
    if password:
        known.add(password)
    for secret in sorted(known, key=len, reverse=True):
        # Whole words only: a password "b" must not turn "database" into "data****ase".
        text = re.sub(rf"(?<!\w){re.escape(secret)}(?!\w)", MASK, text)
    return text


#: A DSN that may carry a password: a password setting, or a URL's user:password@.
_MENTIONS_PASSWORD = re.compile(r"password|://[^/@]*:[^/@]*@", re.IGNORECASE)


def _one_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else "no detail"


def parse_dsn(dsn: str) -> dict[str, Any]:
    """The DSN's parameters; :class:`InvalidArgument` for one that libpq cannot parse.

    The message is one line and never shows the DSN's password.
    """
    if not isinstance(dsn, str) or not dsn.strip():
        raise InvalidArgument("the DSN is empty: pass a PostgreSQL URL or conninfo string")
    scheme = _SCHEME.match(dsn)
    if scheme is not None and scheme.group(1) not in _SCHEMES:
        raise InvalidArgument(
            f"the DSN cannot be parsed: its URL scheme is {scheme.group(1)!r}: a PostgreSQL "
            "URL starts with postgresql:// or postgres://"
        )
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        detail = mask_passwords(_one_line(str(exc)), dsn)
        if _MENTIONS_PASSWORD.search(dsn):
            # libpq quotes the piece it stumbled on, which may be part of the password (an
            # unquoted space splits it): no quoted piece is shown then.
            detail = re.sub(
                r'"([^"]*)"', lambda m: m.group(0) if m.group(1) == "=" else f'"{MASK}"', detail
            )
        raise InvalidArgument(f"the DSN cannot be parsed: {detail}") from None
    for port in str(params.get("port") or "").split(","):
        # libpq takes a list of ports (one per host); an empty entry is the default
        if port.strip() and not (port.strip().isdigit() and 1 <= int(port) <= 65535):
            raise InvalidArgument(
                f"the DSN cannot be used: its port {port.strip()!r} is not a port number "
                "(1 to 65535)"
            )
    return params


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
    detail = mask_passwords(_libpq_detail(text), password=params.get("password"))
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
    dsn: str,
    *,
    name: str,
    timeout: int = CHECK_TIMEOUT_S,
    pooled: bool = False,
    settings: dict[str, Any] | None = None,
) -> psycopg.Connection[Any]:
    """One autocommit connection, opened within ``timeout`` seconds, or a typed error
    (``pooled``: through a transaction-mode pooler, so no server-side prepared statements).
    ``settings``: more connection parameters (a pool's, for a connection it adopts); the
    check's ``timeout`` still applies."""
    params = parse_dsn(dsn)
    extra: dict[str, Any] = {} if "connect_timeout" in params else {"connect_timeout": timeout}
    given = {key: value for key, value in (settings or {}).items() if key != "connect_timeout"}
    kwargs: dict[str, Any] = {"application_name": name, **given}
    if pooled:
        kwargs["prepare_threshold"] = None
    try:
        return psycopg.connect(make_conninfo(dsn, **extra), autocommit=True, **kwargs)
    except psycopg.OperationalError as exc:
        raise unavailable(exc, params) from exc
    except psycopg.ProgrammingError as exc:  # a parameter libpq rejects at connect time
        detail = mask_passwords(_one_line(str(exc)), dsn)
        raise InvalidArgument(f"the DSN cannot be used: {detail}") from None


def check_reachable(dsn: str, *, name: str = "cyclone-check") -> None:
    """Raise :class:`DatabaseUnavailable` (or :class:`InvalidArgument`) unless a
    connection opens within a few seconds."""
    connect_checked(dsn, name=name).close()


#: SQLSTATE classes and codes that mean the session itself is gone (not a statement error):
#: a shutdown, and the server's idle-in-transaction and idle-session timeouts.
_LOST_CLASSES = ("08",)
_LOST_CODES = frozenset({"57P01", "57P02", "57P03", "57P05", "25P03"})


def is_connection_loss(exc: BaseException) -> bool:
    """Whether ``exc`` is a lost or refused connection (not a failed statement)."""
    if not isinstance(exc, ConnectionFailure):
        return False
    state = exc.sqlstate
    return state is None or state.startswith(_LOST_CLASSES) or state in _LOST_CODES


def read_only_error(dsn: str) -> DatabaseUnavailable:
    """The typed error for a write refused because the session is read-only."""
    return DatabaseUnavailable(
        f"{describe_server(parse_dsn(dsn))} is read-only for this session: it is a standby "
        "(a read replica, or the old primary after a failover), or the role or the database "
        "sets default_transaction_read_only: point the DSN at the primary with a role that "
        "may write",
        "read_only",
    )


def require_writable(conn: psycopg.Connection[Any], dsn: str) -> None:
    """Raise :func:`read_only_error` unless ``conn``'s transactions may write (a worker or
    a scanner writes at once; a client may read from a replica)."""
    row = conn.execute(Q.read_only).fetchone()
    if row is not None and row[0]:
        raise read_only_error(dsn)
