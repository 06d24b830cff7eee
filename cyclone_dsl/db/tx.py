"""The transaction runner: named queries with dict rows, and retries of transient conflicts."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any, LiteralString, Protocol, TypeVar

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from cyclone_dsl.db import clock
from cyclone_dsl.db.adapters import has_engine_adapters, use_engine_adapters

log = logging.getLogger("cyclone.db")

T = TypeVar("T")
Row = dict[str, Any]

#: SQLSTATEs after which the whole transaction may be retried safely.
RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})


class Tx(Protocol):
    """One open transaction (or autocommit connection): what the engine's transitions run on.

    Every statement gets the clock ``shift``, added to the database's ``now()``
    in every time-sensitive query: zero in production; tests move time with it.
    """

    def rows(self, query: LiteralString, **params: object) -> list[Row]: ...

    def one(self, query: LiteralString, **params: object) -> Row | None: ...

    def run(self, query: LiteralString, **params: object) -> int: ...

    def savepoint(self) -> contextlib.AbstractContextManager[None]:
        """A nested transaction: an exception rolls back what the block wrote, and only that."""
        ...

    @property
    def commits_each_statement(self) -> bool:
        """Whether no transaction is open (autocommit): each statement commits on its own."""
        ...


def with_shift(params: Mapping[str, object], shift: timedelta) -> dict[str, object]:
    merged = dict(params)
    merged.setdefault("shift", shift)
    return merged


class ConnectionTx:
    """A :class:`Tx` on a synchronous psycopg connection."""

    __slots__ = ("conn", "shift")

    def __init__(self, conn: psycopg.Connection[Any], shift: timedelta | None = None) -> None:
        self.conn = conn
        self.shift = _shift_or_current(shift)

    def _cursor(self) -> psycopg.Cursor[Row]:
        # psycopg's own class, whatever cursor_factory the connection has (a RawCursor
        # takes no named parameters).
        cursor = psycopg.Cursor(self.conn, row_factory=dict_row)
        if not has_engine_adapters(cursor):  # a connection the engine did not open
            use_engine_adapters(cursor)
        return cursor

    def rows(self, query: LiteralString, **params: object) -> list[Row]:
        with self._cursor() as cur:
            cur.execute(query, with_shift(params, self.shift))
            return cur.fetchall() if cur.description else []

    def one(self, query: LiteralString, **params: object) -> Row | None:
        with self._cursor() as cur:
            cur.execute(query, with_shift(params, self.shift))
            return cur.fetchone() if cur.description else None

    def run(self, query: LiteralString, **params: object) -> int:
        with self._cursor() as cur:
            cur.execute(query, with_shift(params, self.shift))
            return cur.rowcount

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        with self.conn.transaction():
            yield

    @property
    def commits_each_statement(self) -> bool:
        return self.conn.info.transaction_status == TransactionStatus.IDLE


def in_transaction(
    pool: ConnectionPool[Any],
    work: Callable[[Tx], T],
    *,
    shift: timedelta | None = None,
    attempts: int = 5,
) -> T:
    """Run ``work`` in one transaction; retry it whole on serialization failure or deadlock.

    ``shift`` defaults to the process's clock shift (:mod:`cyclone_dsl.db.clock`).
    """
    for attempt in range(1, attempts + 1):
        try:
            with pool.connection() as conn, conn.transaction():
                return work(ConnectionTx(conn, _shift_or_current(shift)))
        except psycopg.errors.OperationalError as exc:
            if exc.sqlstate not in RETRYABLE_SQLSTATES or attempt == attempts:
                raise
            log.info("transaction conflict (%s), retrying", exc.sqlstate)
            time.sleep(0.01 * attempt)
    raise AssertionError("unreachable")


def in_autocommit(
    pool: ConnectionPool[Any], work: Callable[[Tx], T], *, shift: timedelta | None = None
) -> T:
    """Run ``work`` on a pooled autocommit connection: each statement commits on its own.

    Only for work whose statements are each complete transitions (a claim), where
    BEGIN and COMMIT would be two more round trips for nothing.
    """
    with pool.connection() as conn:
        return work(ConnectionTx(conn, _shift_or_current(shift)))


def _shift_or_current(shift: timedelta | None) -> timedelta:
    return clock.current_shift() if shift is None else shift
