"""The transaction runner: named queries with dict rows, and retries of transient conflicts."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, LiteralString, TypeVar

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

log = logging.getLogger("cyclone.db")

T = TypeVar("T")
Row = dict[str, Any]

#: SQLSTATEs after which the whole transaction may be retried safely.
RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})


class Tx:
    """One open transaction (or autocommit connection) plus the engine's clock shift.

    ``shift`` is added to the database's ``now()`` in every time-sensitive
    query. It is zero in production; tests move time with it.
    """

    __slots__ = ("conn", "shift")

    def __init__(self, conn: psycopg.Connection[Any], shift: timedelta = timedelta(0)) -> None:
        self.conn = conn
        self.shift = shift

    def _params(self, params: Mapping[str, object]) -> dict[str, object]:
        merged = dict(params)
        merged.setdefault("shift", self.shift)
        return merged

    def rows(self, query: LiteralString, **params: object) -> list[Row]:
        with self.conn.cursor(row_factory=dict_row) as cur:
            cur.execute(query, self._params(params))
            return cur.fetchall() if cur.description else []

    def one(self, query: LiteralString, **params: object) -> Row | None:
        with self.conn.cursor(row_factory=dict_row) as cur:
            cur.execute(query, self._params(params))
            return cur.fetchone() if cur.description else None

    def run(self, query: LiteralString, **params: object) -> int:
        with self.conn.cursor() as cur:
            cur.execute(query, self._params(params))
            return cur.rowcount


def in_transaction(
    pool: ConnectionPool[Any],
    work: Callable[[Tx], T],
    *,
    shift: timedelta = timedelta(0),
    attempts: int = 5,
) -> T:
    """Run ``work`` in one transaction; retry it whole on serialization failure or deadlock."""
    for attempt in range(1, attempts + 1):
        try:
            with pool.connection() as conn, conn.transaction():
                return work(Tx(conn, shift))
        except psycopg.errors.OperationalError as exc:
            if exc.sqlstate not in RETRYABLE_SQLSTATES or attempt == attempts:
                raise
            log.info("transaction conflict (%s), retrying", exc.sqlstate)
            time.sleep(0.01 * attempt)
    raise AssertionError("unreachable")


def in_autocommit(
    pool: ConnectionPool[Any], work: Callable[[Tx], T], *, shift: timedelta = timedelta(0)
) -> T:
    """Run ``work`` on a pooled autocommit connection: each statement commits on its own.

    Only for work whose statements are each complete transitions (a claim), where
    BEGIN and COMMIT would be two more round trips for nothing.
    """
    with pool.connection() as conn:
        return work(Tx(conn, shift))
