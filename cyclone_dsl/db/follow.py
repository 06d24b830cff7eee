"""Following the database with LISTEN: one plan, run by a sync or an async driver.

Following a run's events is a loop of reads and waits for notifications, with
reconnects when the connection dies. Such a loop is written once, as a *plan*: a
generator that yields what it wants done (:class:`Listen`, :class:`ReadAll`,
:class:`Notifications`, :class:`Pause`, :class:`Output`) and gets the result sent
back. :func:`stream` runs a plan on a blocking connection and yields what it
outputs; :func:`stream_async` does the same on an asyncio connection. Neither knows
what the plan is for. (Waiting for runs to end is the client's run watcher's job:
one connection for every wait of a client, see ``cyclone_dsl.client.watch``.)

When the connection fails (lost, refused, or silent for longer than
:data:`~cyclone_dsl.db.listen.PING_TIMEOUT_S`), the driver closes it and
throws :class:`ConnectionLost` into the plan, which decides whether to give
up or :class:`Pause` and go on; the next :class:`Listen` opens a new
connection. Every read is bounded, so a plan's own deadline holds whatever
the network does.

Without LISTEN (``listen=False``: the DSN goes through a transaction-mode pooler
and no direct connection was given), :class:`Listen` only opens the connection
and :class:`Notifications` sleeps its timeout: the plan then reads at its own
re-check interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator
from typing import Any, LiteralString, TypeVar

import attrs
import psycopg
from psycopg.rows import dict_row

from cyclone_dsl.db.clock import current_shift
from cyclone_dsl.db.connect import connect, connect_async
from cyclone_dsl.db.errors import first_line
from cyclone_dsl.db.listen import PING_TIMEOUT_S, answer_within, listen_async
from cyclone_dsl.db.listen import listen as listen_on
from cyclone_dsl.db.tx import with_shift

T = TypeVar("T")


@attrs.frozen
class Listen:
    """Make sure a connection is open and LISTENs on ``channels`` (reply: None)."""

    channels: tuple[str, ...]


@attrs.frozen
class ReadAll:
    """Run one named query (reply: all its rows, as a list)."""

    query: LiteralString
    params: dict[str, object] = attrs.field(factory=dict)


@attrs.frozen
class Notifications:
    """Wait up to ``timeout`` seconds for notifications (reply: their payloads, perhaps
    none); returns as soon as one arrives."""

    timeout: float


@attrs.frozen
class Pause:
    """Sleep (reply: None)."""

    seconds: float


@attrs.frozen
class Output:
    """Hand ``values`` to whoever iterates a streamed plan (:func:`stream`), in order
    (reply: None, once they were taken)."""

    values: tuple[Any, ...]


Request = Listen | ReadAll | Notifications | Pause | Output
Plan = Generator[Request, Any, T]


class ConnectionLost(Exception):
    """Thrown into a plan when its connection failed; the next :class:`Listen` reconnects."""


def stream(
    dsn: str, plan: Plan[None], *, name: str, listen: bool = True, pooled: bool = False
) -> Iterator[Any]:
    """Run ``plan`` on blocking connections to ``dsn``, yielding every value it
    :class:`Output` s; the connection closes when the plan ends or the iterator is
    closed."""
    with contextlib.closing(_drive(dsn, plan, name=name, listen=listen, pooled=pooled)) as driven:
        yield from driven


async def stream_async(
    dsn: str, plan: Plan[None], *, name: str, listen: bool = True, pooled: bool = False
) -> AsyncIterator[Any]:
    """:func:`stream` on asyncio connections: never blocks the event loop."""
    async with contextlib.aclosing(
        _drive_async(dsn, plan, name=name, listen=listen, pooled=pooled)
    ) as driven:
        async for item in driven:
            yield item


def _drive(
    dsn: str, plan: Plan[Any], *, name: str, listen: bool = True, pooled: bool = False
) -> Generator[Any, None, None]:
    """Run ``plan``: yield what it outputs."""
    conn: psycopg.Connection[Any] | None = None
    reply: object = None
    failure: ConnectionLost | None = None
    try:
        while True:
            try:
                request = plan.throw(failure) if failure is not None else plan.send(reply)
            except StopIteration:
                return
            failure, reply = None, None
            if isinstance(request, Output):
                yield from request.values
                continue
            try:
                if isinstance(request, Pause):
                    time.sleep(request.seconds)
                elif isinstance(request, Listen):
                    if conn is None:
                        conn = connect(dsn, name=name, pooled=pooled)
                        for channel in request.channels if listen else ():
                            listen_on(conn, channel)
                elif conn is None:
                    failure = ConnectionLost("no connection: the plan must Listen first")
                elif isinstance(request, ReadAll):
                    with (
                        answer_within(conn, PING_TIMEOUT_S),
                        conn.cursor(row_factory=dict_row) as cur,
                    ):
                        cur.execute(request.query, with_shift(request.params, current_shift()))
                        reply = cur.fetchall()
                elif not listen:
                    time.sleep(request.timeout)
                    reply = []
                else:
                    reply = [
                        n.payload for n in conn.notifies(timeout=request.timeout, stop_after=1)
                    ]
            except psycopg.OperationalError as exc:
                if conn is not None:
                    conn.close()
                conn = None
                failure = ConnectionLost(first_line(exc))
    finally:
        plan.close()
        if conn is not None:
            conn.close()


async def _drive_async(
    dsn: str, plan: Plan[Any], *, name: str, listen: bool = True, pooled: bool = False
) -> AsyncGenerator[Any, None]:
    """:func:`_drive` on asyncio connections."""
    conn: psycopg.AsyncConnection[Any] | None = None
    reply: object = None
    failure: ConnectionLost | None = None
    try:
        while True:
            try:
                request = plan.throw(failure) if failure is not None else plan.send(reply)
            except StopIteration:
                return
            failure, reply = None, None
            if isinstance(request, Output):
                for value in request.values:
                    yield value
                continue
            try:
                if isinstance(request, Pause):
                    await asyncio.sleep(request.seconds)
                elif isinstance(request, Listen):
                    if conn is None:
                        conn = await connect_async(dsn, name=name, pooled=pooled)
                        for channel in request.channels if listen else ():
                            await listen_async(conn, channel)
                elif conn is None:
                    failure = ConnectionLost("no connection: the plan must Listen first")
                elif isinstance(request, ReadAll):
                    reply = await _read_async(conn, request)
                elif not listen:
                    await asyncio.sleep(request.timeout)
                    reply = []
                else:
                    reply = [
                        n.payload
                        async for n in conn.notifies(timeout=request.timeout, stop_after=1)
                    ]
            except psycopg.OperationalError as exc:
                if conn is not None:
                    await conn.close()
                conn = None
                failure = ConnectionLost(first_line(exc))
    finally:
        plan.close()
        if conn is not None:
            await conn.close()


async def _read_async(conn: psycopg.AsyncConnection[Any], request: ReadAll) -> object:
    with answer_within(conn, PING_TIMEOUT_S):
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(request.query, with_shift(request.params, current_shift()))
            return await cur.fetchall()
