"""The database driver's errors, for the layers that must not import the driver itself.

The engine, the worker and the scanners catch these; only ``cyclone_dsl.db``
and ``cyclone_dsl.migrate`` import psycopg (a ruff banned-api rule holds this).
"""

from __future__ import annotations

import copy
from typing import Final

import psycopg

#: The base class of every error the database driver raises.
DatabaseError = psycopg.Error
#: A lost connection, a server that went away mid-statement, a session the server ended
#: (it sat idle in a transaction past ``idle_in_transaction_session_timeout``: the
#: process stalled), a deadlock or a serialization failure (the SQLSTATE says which).
#: Nothing of the transaction was kept: it can be tried again on a new connection.
ConnectionFailure: Final = (
    psycopg.OperationalError,
    psycopg.errors.IdleInTransactionSessionTimeout,
)
#: A unique index refused a row (a submit key or unique key taken meanwhile).
UniqueViolation = psycopg.errors.UniqueViolation
SerializationFailure = psycopg.errors.SerializationFailure


def is_lock_wait_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` ended a wait for a lock at the session's ``lock_timeout`` or
    ``statement_timeout`` (a role's, say), not a cancel asked by someone."""
    if isinstance(exc, psycopg.errors.LockNotAvailable):
        return True
    return isinstance(exc, psycopg.errors.QueryCanceled) and "statement timeout" in (
        exc.diag.message_primary or ""
    )


__all__ = [
    "ConnectionFailure",
    "DatabaseError",
    "SerializationFailure",
    "UniqueViolation",
    "is_lock_wait_timeout",
]


def first_line(exc: BaseException) -> str:
    """The first non-blank line of ``exc``'s message (a driver error's later lines are its
    DETAIL and HINT), or its class name when it has none."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def own_copy(exc: Exception) -> Exception:
    """A copy of ``exc`` whose cause is ``exc``, for each of several callers that one error
    ended (one exception object raised in several threads at once would carry their
    tracebacks mixed); ``exc`` itself if it cannot be copied."""
    try:
        copied = copy.copy(exc)
    except Exception:  # noqa: BLE001 - an exception class that does not copy: shared
        return exc
    copied.__cause__ = exc
    return copied
