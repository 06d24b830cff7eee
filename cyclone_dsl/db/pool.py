"""A pooled database: short transactions for clients and workers, with typed connection errors.

Callers above this layer never see psycopg: a server that cannot be reached,
a connection lost mid-call and a pool with no free connection all become
:class:`~cyclone_dsl.errors.DatabaseUnavailable` naming the cause.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from cyclone_dsl.db.connect import make_pool
from cyclone_dsl.db.diagnose import check_reachable, describe_server, is_connection_loss, parse_dsn
from cyclone_dsl.db.tx import Tx, in_autocommit, in_transaction
from cyclone_dsl.errors import ClientClosed, DatabaseUnavailable

T = TypeVar("T")


class PooledDatabase:
    """A connection pool named ``name`` (``application_name``) of at most ``max_size``
    (``pooled``: ``dsn`` goes through a transaction-mode pooler)."""

    def __init__(self, dsn: str, *, name: str, max_size: int, pooled: bool = False) -> None:
        self.dsn = dsn
        self.pooled = pooled
        self._name = name
        # The last call found the server gone: the next ones probe it before waiting for a
        # pooled connection (the pool's wait would last its whole timeout, 30 s).
        self._server_gone = False
        try:
            self._pool: ConnectionPool[Any] = make_pool(
                dsn, name=name, max_size=max_size, pooled=pooled
            )
        except PoolTimeout as exc:
            raise self._pool_unavailable(exc) from exc

    def close(self) -> None:
        self._pool.close()

    def check_open(self) -> None:
        """:class:`ClientClosed` once :meth:`close` was called."""
        if self._pool.closed:
            raise ClientClosed(f"this client was closed ({self._name}): open a new one")

    @property
    def pool(self) -> ConnectionPool[Any]:
        return self._pool

    def transaction(self, work: Callable[[Tx], T], *, one_statement: bool = False) -> T:
        """Run ``work`` in a transaction, or in autocommit mode when it is one statement
        (atomic on its own, and two round trips shorter without BEGIN and COMMIT).

        A deadlock or serialization failure retries the whole transaction.
        """
        self.check_open()
        if self._server_gone:
            self._probe()
        try:
            if one_statement:
                return in_autocommit(self._pool, work)
            return in_transaction(self._pool, work)
        except PoolTimeout as exc:
            self.check_open()  # closed while this call waited for a connection
            raise self._pool_unavailable(exc) from exc
        except psycopg.OperationalError as exc:
            self.check_open()  # psycopg_pool's PoolClosed is an OperationalError
            if not is_connection_loss(exc):
                raise
            self._server_gone = True
            server = describe_server(parse_dsn(self.dsn))
            raise DatabaseUnavailable(
                f"the connection to {server} was lost: {str(exc).strip().splitlines()[0]}: "
                "the call did not finish (if it was a write, check whether it happened); "
                "the next call opens a new connection",
                "connection_lost",
            ) from exc

    def _probe(self) -> None:
        """After a call found the server gone: unless the pool holds a connection again,
        raise the server's named cause at once if it still cannot be reached."""
        if self._pool.get_stats().get("pool_available", 0) > 0:
            self._server_gone = False
            return
        check_reachable(self.dsn, name="cyclone-client-check")
        self._server_gone = False

    def _pool_unavailable(self, exc: PoolTimeout) -> DatabaseUnavailable:
        """Why the pool gave no connection: the server (named cause), or a busy pool."""
        try:
            check_reachable(self.dsn, name="cyclone-client-check")
        except DatabaseUnavailable as cause:
            self._server_gone = True
            return cause
        return DatabaseUnavailable(
            f"no pooled connection to {describe_server(parse_dsn(self.dsn))} became free in "
            f"time ({exc}): raise pool_size, or make fewer calls at once",
            "pool_exhausted",
        )
