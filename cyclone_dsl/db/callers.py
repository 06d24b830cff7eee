"""Engine work inside the caller's own transaction, on a sync or an async connection.

``submit_tx`` and its siblings run the engine's transitions on a connection
the application owns, so that a run exists exactly when the application
commits. The engine is written once, against :class:`~cyclone_dsl.db.tx.Tx`.
On an :class:`psycopg.AsyncConnection` it runs in a worker thread, and every
statement it issues is sent back to the event loop that owns the connection
(the thread waits for the rows); the loop stays free meanwhile, since the
calling coroutine is only awaiting that thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterator
from datetime import timedelta
from typing import Any, LiteralString, TypeVar

import psycopg
from psycopg.pq import Format, PipelineStatus, TransactionStatus
from psycopg.rows import dict_row, tuple_row

from cyclone_dsl.db.adapters import has_engine_adapters, use_engine_adapters
from cyclone_dsl.db.errors import first_line
from cyclone_dsl.db.tx import ConnectionTx, Row, Tx, with_shift
from cyclone_dsl.errors import DatabaseUnavailable, InvalidArgument, SchemaVersionMismatch
from cyclone_dsl.sql import Q

T = TypeVar("T")

#: The connections ``submit_tx`` and its siblings accept (re-exported for the clients).
Connection = psycopg.Connection[Any]
AsyncConnection = psycopg.AsyncConnection[Any]


_LOOP_LOOK_S = 0.5
"""How often a thread waiting for a statement on an event loop looks whether the loop
was closed."""

#: Read with psycopg's default loaders whatever the connection's: every type the engine's
#: rows hold but json and jsonb, which it reads with its own (see
#: :mod:`cyclone_dsl.db.adapters`). Frameworks replace loaders on the connections they own:
#: Django loads ``jsonb`` as text (its JSONField decodes it) and ``timestamptz`` in its own
#: zone, naive when ``USE_TZ`` is off; SQLAlchemy can plug its own JSON decoder; an
#: application may load ``int8`` as text.
_PSYCOPG_DEFAULT_TYPES = (
    "timestamptz",
    "timestamp",
    "interval",
    "numeric",
    "int2",
    "int4",
    "int8",
    "float4",
    "float8",
    "bool",
    "text",
    "varchar",
)


def with_engine_loaders(cursor: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any]) -> None:
    """Read as the engine reads on this cursor, whatever the connection's loaders are (a
    cursor's adapters are its own copy: the application's connection keeps its own)."""
    for name in _PSYCOPG_DEFAULT_TYPES:
        oid = psycopg.adapters.types[name].oid
        for fmt in (Format.TEXT, Format.BINARY):
            default = psycopg.adapters.get_loader(oid, fmt)
            if default is not None and cursor.adapters.get_loader(oid, fmt) is not default:
                cursor.adapters.register_loader(oid, default)
    if not has_engine_adapters(cursor):
        use_engine_adapters(cursor)


class CallersTx(ConnectionTx):
    """A :class:`ConnectionTx` on the application's connection: the engine reads its rows
    with its own loaders, whatever loaders the application configured."""

    __slots__ = ()

    def _cursor(self) -> psycopg.Cursor[Row]:
        cursor = super()._cursor()
        with_engine_loaders(cursor)
        return cursor


def in_callers_transaction(conn: Connection, work: Callable[[Tx], T], *, shift: timedelta) -> T:
    """Run ``work`` in the caller's transaction on ``conn``, all or nothing.

    Inside an open transaction, ``work`` runs in a savepoint: if it fails,
    what it wrote is rolled back and the caller's transaction stays usable.
    On an idle connection that is not in autocommit mode the caller's
    transaction is begun first, as the caller's own first statement would,
    so the caller still decides the commit. On an autocommit connection,
    ``work`` runs in a transaction of its own, committed when it returns.
    """
    _check_connection(conn, psycopg.Connection)
    with _one_at_a_time(conn):
        if conn.info.transaction_status == TransactionStatus.IDLE and not conn.autocommit:
            conn.execute(Q.ping)
        elif conn.info.transaction_status == TransactionStatus.INTRANS:
            with psycopg.Cursor(conn, row_factory=tuple_row) as cur:
                shift += _age(cur.execute(Q.transaction_age).fetchone())
        with _schema_errors_typed(), conn.transaction():
            return work(CallersTx(conn, shift))


@contextlib.contextmanager
def _schema_errors_typed() -> Iterator[None]:
    """A caller's connection that cannot see Cyclone's tables (another schema on its
    search_path, or one not migrated to this build) as a typed error; the savepoint has
    rolled back what the work wrote, and the caller's transaction goes on."""
    try:
        yield
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn) as exc:
        raise SchemaVersionMismatch(
            f"the connection passed in cannot see Cyclone's tables as this build expects "
            f"them ({first_line(exc)}): run `cyclone migrate` on the schema of its search_path, or "
            f"set its search_path to the schema Cyclone was migrated in"
        ) from exc


async def in_callers_async_transaction(
    conn: AsyncConnection, work: Callable[[Tx], T], *, shift: timedelta
) -> T:
    """:func:`in_callers_transaction` for an async connection (see the module docstring)."""
    _check_connection(conn, psycopg.AsyncConnection)
    async with _async_one_at_a_time(conn):
        # A cancel of this call never interrupts a statement on the caller's connection:
        # psycopg would ask the server to cancel the one in flight, which aborts the
        # caller's whole transaction (its own rows lost at its commit). The call goes on
        # to the end of its statement, then rolls back its savepoint (nothing of it is
        # kept), and the cancel goes through.
        cancelled = threading.Event()
        call = asyncio.ensure_future(_in_callers_async_transaction(conn, work, shift, cancelled))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            cancelled.set()
            with contextlib.suppress(Exception):
                await call
            raise


async def _in_callers_async_transaction(
    conn: AsyncConnection, work: Callable[[Tx], T], shift: timedelta, cancelled: threading.Event
) -> T:
    if conn.info.transaction_status == TransactionStatus.IDLE and not conn.autocommit:
        await conn.execute(Q.ping)
    elif conn.info.transaction_status == TransactionStatus.INTRANS:
        async with psycopg.AsyncCursor(conn, row_factory=tuple_row) as cur:
            shift += _age(await (await cur.execute(Q.transaction_age)).fetchone())
    if cancelled.is_set():
        raise asyncio.CancelledError
    loop = asyncio.get_running_loop()
    with _schema_errors_typed():
        return await _in_async_savepoint(conn, work, shift, loop, cancelled)


async def _in_async_savepoint(
    conn: AsyncConnection,
    work: Callable[[Tx], T],
    shift: timedelta,
    loop: asyncio.AbstractEventLoop,
    cancelled: threading.Event,
) -> T:
    async with conn.transaction():
        result = await asyncio.to_thread(work, AsyncConnectionTx(conn, loop, shift))
        if not cancelled.is_set():
            return result
        raise psycopg.Rollback  # cancelled meanwhile: back to the savepoint, nothing kept
    raise asyncio.CancelledError


def _check_connection(conn: object, wanted: type) -> None:
    """Refuse, before any statement, a connection the engine cannot work on."""
    if not isinstance(conn, wanted):
        raise TypeError(
            f"this call runs in your transaction on a {wanted.__module__}.{wanted.__name__}, "
            f"not a {type(conn).__module__}.{type(conn).__qualname__}"
        )
    assert isinstance(conn, psycopg.Connection | psycopg.AsyncConnection)
    if conn.info.pipeline_status != PipelineStatus.OFF:
        raise InvalidArgument(
            "the connection is in pipeline mode, where the engine cannot read a row between "
            "its statements: call it outside the conn.pipeline() block"
        )


#: One engine call at a time on a connection: two at once (asyncio.gather, two threads)
#: would interleave their savepoints, and a failed one could leave the other's rows.
_sync_locks: weakref.WeakKeyDictionary[Connection, threading.RLock] = weakref.WeakKeyDictionary()
_async_locks: weakref.WeakKeyDictionary[AsyncConnection, asyncio.Lock] = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()


def _one_at_a_time(conn: Connection) -> threading.RLock:
    with _locks_guard:
        return _sync_locks.setdefault(conn, threading.RLock())


def _async_one_at_a_time(conn: AsyncConnection) -> asyncio.Lock:
    with _locks_guard:
        return _async_locks.setdefault(conn, asyncio.Lock())


def _age(row: tuple[Any, ...] | None) -> timedelta:
    """How long the caller's transaction had been open (the engine reads the time as
    now(), its start), from ``Q.transaction_age``."""
    return timedelta(seconds=float(row[0])) if row is not None else timedelta(0)


class AsyncConnectionTx:
    """A :class:`Tx` whose statements run on an async connection's event loop.

    Used from a thread other than the loop's (see the module docstring). Like
    :class:`CallersTx`, it reads with the engine's loaders.
    """

    __slots__ = ("conn", "loop", "shift")

    def __init__(
        self, conn: AsyncConnection, loop: asyncio.AbstractEventLoop, shift: timedelta
    ) -> None:
        self.conn = conn
        self.loop = loop
        self.shift = shift

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        while True:
            try:
                return future.result(timeout=_LOOP_LOOK_S)
            except concurrent.futures.TimeoutError:
                # A loop closed under the statement (a worker's stop past its grace) never
                # answers: waiting on would keep this thread, and the interpreter's exit
                # that joins it, forever.
                if self.loop.is_closed():
                    future.cancel()
                    raise DatabaseUnavailable(
                        "the event loop running the statement was closed", "connection_lost"
                    ) from None

    def _cursor(self) -> psycopg.AsyncCursor[Row]:
        """psycopg's own class (see :meth:`ConnectionTx._cursor`), with the engine's
        adapters."""
        cursor = psycopg.AsyncCursor(self.conn, row_factory=dict_row)
        with_engine_loaders(cursor)
        return cursor

    async def _fetch(self, query: LiteralString, params: dict[str, object], many: bool) -> Any:
        async with self._cursor() as cur:
            await cur.execute(query, params)
            if cur.description is None:
                return [] if many else None
            return await (cur.fetchall() if many else cur.fetchone())

    async def _rowcount(self, query: LiteralString, params: dict[str, object]) -> int:
        async with self._cursor() as cur:
            await cur.execute(query, params)
            return cur.rowcount

    def rows(self, query: LiteralString, **params: object) -> list[Row]:
        found: list[Row] = self._call(self._fetch(query, with_shift(params, self.shift), True))
        return found

    def one(self, query: LiteralString, **params: object) -> Row | None:
        found: Row | None = self._call(self._fetch(query, with_shift(params, self.shift), False))
        return found

    def run(self, query: LiteralString, **params: object) -> int:
        return self._call(self._rowcount(query, with_shift(params, self.shift)))

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        block = self.conn.transaction()
        self._call(block.__aenter__())
        try:
            yield
        except BaseException as exc:
            if not self._call(block.__aexit__(type(exc), exc, exc.__traceback__)):
                raise
        else:
            self._call(block.__aexit__(None, None, None))

    @property
    def commits_each_statement(self) -> bool:
        return self.conn.info.transaction_status == TransactionStatus.IDLE
