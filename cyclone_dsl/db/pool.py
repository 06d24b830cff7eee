"""A pooled database: short transactions for clients and workers, with typed connection errors.

Callers above this layer never see psycopg: a server that cannot be reached,
a connection lost mid-call and a pool with no free connection all become
:class:`~cyclone_dsl.errors.DatabaseUnavailable` naming the cause.

A pool survives ``os.fork()`` (gunicorn ``--preload``, prefork pools): the child gets
copies of the parent's sockets, which it must never use nor close (a close sends the
server the end of the parent's session). Right after a fork, the child points each
inherited socket at ``/dev/null`` and keeps the inherited pool unused for ever; its
first call opens a pool of its own.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from cyclone_dsl.db.connect import make_pool
from cyclone_dsl.db.diagnose import (
    check_reachable,
    describe_server,
    is_connection_loss,
    parse_dsn,
    read_only_error,
)
from cyclone_dsl.db.tx import Tx, in_autocommit, in_transaction
from cyclone_dsl.errors import ClientClosed, DatabaseUnavailable

T = TypeVar("T")


#: Every pooled database of this process, for the after-fork hook.
_LIVE: weakref.WeakSet[PooledDatabase] = weakref.WeakSet()
#: Pools inherited through a fork: kept, never used nor closed (see the module's docstring).
_INHERITED: list[ConnectionPool[Any]] = []


def _after_fork_in_child() -> None:
    for database in list(_LIVE):
        database._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _silence(pool: ConnectionPool[Any]) -> None:
    """Point the sockets of ``pool``'s idle connections at /dev/null: whatever this process
    would send on them (the end of a session, when they are garbage) reaches no server."""
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for conn in list(getattr(pool, "_pool", ())):  # psycopg_pool's idle connections
            try:
                os.dup2(devnull, conn.pgconn.socket)
            except (OSError, psycopg.Error):
                continue  # already closed: nothing to send on
    finally:
        os.close(devnull)


class PooledDatabase:
    """A connection pool named ``name`` (``application_name``) of at most ``max_size``
    (``pooled``: ``dsn`` goes through a transaction-mode pooler)."""

    def __init__(
        self,
        dsn: str,
        *,
        name: str,
        max_size: int,
        pooled: bool = False,
        first: psycopg.Connection[Any] | None = None,
    ) -> None:
        """``first``: a connection already open with the pool's settings, its first
        (:func:`~cyclone_dsl.migrate.checked_connection`'s)."""
        self.dsn = dsn
        self.pooled = pooled
        self._name = name
        self._max_size = max_size
        # The last call found the server gone: the next ones probe it before waiting for a
        # pooled connection (the pool's wait would last its whole timeout, 30 s).
        self._server_gone = False
        self._pid = os.getpid()
        self._replacing = threading.Lock()
        try:
            self._pool: ConnectionPool[Any] = make_pool(
                dsn, name=name, max_size=max_size, pooled=pooled, first=first
            )
        except PoolTimeout as exc:
            raise self._pool_unavailable(exc) from exc
        _LIVE.add(self)

    def _forked(self) -> None:
        """In a child just forked: leave the parent's pool alone, its sockets silenced."""
        if self._pid != os.getpid():
            _silence(self._pool)
            _INHERITED.append(self._pool)
            self._replacing = threading.Lock()  # the parent's may have been held

    def _own_pool(self, *, opened: bool = True) -> ConnectionPool[Any]:
        """This process's pool: a new one on the first call after a fork (``opened``: its
        connections opened, unless the parent's pool was closed)."""
        if self._pid != os.getpid():
            with self._replacing:
                if self._pid != os.getpid():
                    self._pool = make_pool(
                        self.dsn,
                        name=self._name,
                        max_size=self._max_size,
                        pooled=self.pooled,
                        open_now=opened and not self._pool.closed,
                    )
                    self._pid = os.getpid()
        return self._pool

    def close(self) -> None:
        # A child that only closes its inherited client opens no connection to do it.
        self._own_pool(opened=False).close()

    def is_closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._pool.closed

    def check_open(self) -> None:
        """:class:`ClientClosed` once :meth:`close` was called."""
        if self._pool.closed:
            raise ClientClosed(f"this client was closed ({self._name}): open a new one")

    @property
    def pool(self) -> ConnectionPool[Any]:
        return self._own_pool()

    def transaction(self, work: Callable[[Tx], T], *, one_statement: bool = False) -> T:
        """Run ``work`` in a transaction, or in autocommit mode when it is one statement
        (atomic on its own, and two round trips shorter without BEGIN and COMMIT).

        A deadlock or serialization failure retries the whole transaction.
        """
        self.check_open()
        pool = self._own_pool()
        if self._server_gone:
            self._probe()
        try:
            if one_statement:
                return in_autocommit(pool, work)
            return in_transaction(pool, work)
        except PoolTimeout as exc:
            self.check_open()  # closed while this call waited for a connection
            raise self._pool_unavailable(exc) from exc
        except psycopg.errors.ReadOnlySqlTransaction as exc:  # a write, on a standby
            raise read_only_error(self.dsn) from exc
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
