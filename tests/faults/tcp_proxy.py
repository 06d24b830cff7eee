"""A TCP proxy for network-fault tests: cut, delay or blackhole connections.

It forwards to a TCP address, or to a server's Unix socket (``upstream_socket``: the
shared test server listens on one only).

The proxy sits between a client (a worker) and PostgreSQL and runs an asyncio
loop in a background thread, so a synchronous test drives it with plain
method calls::

    with TcpProxy("127.0.0.1", pg_port) as proxy:
        dsn = f"host=127.0.0.1 port={proxy.port} ... sslmode=disable"
        ...
        proxy.blackhole(b"cyclone-listen")  # only the worker's LISTEN connection

Faults:

- :meth:`TcpProxy.cut` closes both sides of the open connections (with a TCP
  RST by default, as a crashed middlebox would).
- :meth:`TcpProxy.blackhole` stops forwarding in both directions while the
  sockets stay open: a half-open connection. Bytes are read and dropped, so the
  sender's kernel sees them acknowledged and nothing ever answers. End-of-file
  is swallowed too; the sockets close only on :meth:`TcpProxy.cut` or
  :meth:`TcpProxy.stop`.
- ``blackhole(match, new=True)`` also blackholes later matching connections,
  whose startup message is then swallowed, until :meth:`TcpProxy.heal`.
- :meth:`TcpProxy.set_delay` delays every forwarded chunk, in both directions.

:meth:`~TcpProxy.cut` and :meth:`~TcpProxy.blackhole` affect the connections
open at the call only; later connections flow normally (unless ``new=True``). Both take a ``match``
marker: only connections whose PostgreSQL startup message contains it are
affected. libpq sends ``application_name`` in that message in clear text when
TLS is off (``sslmode=disable``; ``gssencmode=disable`` avoids a GSSAPI
negotiation), so ``b"cyclone-listen"`` selects a worker's LISTEN connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

_T = TypeVar("_T")

#: Request codes that come before the startup message (PostgreSQL protocol).
_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104
_CANCEL_REQUEST = 80877102
#: Client bytes kept while looking for the startup message.
_HEAD_LIMIT = 16384
_CHUNK = 65536
#: SO_LINGER on, timeout 0: closing the socket sends a TCP RST.
_LINGER_RST = struct.pack("ii", 1, 0)


class _Connection:
    """One proxied connection: both stream pairs and its fault state."""

    def __init__(
        self,
        number: int,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.number = number
        self.client_reader, self.client_writer = client
        self.upstream_reader, self.upstream_writer = upstream
        self.startup: bytes | None = None  # the startup message, once seen
        self._head = bytearray()
        self._looking = True
        self.blackholed = False
        self.closed = asyncio.Event()
        self.dropped_bytes = 0

    def matches(self, marker: bytes | None) -> bool:
        if marker is None:
            return True
        return self.startup is not None and marker in self.startup

    def feed_head(self, data: bytes) -> bytes | None:
        """Find the startup message among the client's first packets; return it once seen."""
        if not self._looking:
            return self.startup
        self._head += data
        while len(self._head) >= 8:
            length = int.from_bytes(self._head[:4], "big")
            if len(self._head) < length:
                break
            code = int.from_bytes(self._head[4:8], "big")
            packet = bytes(self._head[:length])
            del self._head[:length]
            if length >= 8 and code in (_SSL_REQUEST, _GSSENC_REQUEST):
                continue  # the server answers 'N' and the startup message follows
            if length >= 8 and code != _CANCEL_REQUEST:
                self.startup = packet
            self._looking = False
            break
        if len(self._head) > _HEAD_LIMIT:
            self._looking = False
        if not self._looking:
            self._head.clear()
        return self.startup

    def close(self, *, reset: bool) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for writer in (self.client_writer, self.upstream_writer):
            transport = writer.transport
            if reset:
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                transport.abort()
            else:
                transport.close()


class TcpProxy:
    """Forward ``127.0.0.1:<port>`` to ``upstream_host:upstream_port``, with faults on demand."""

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        host: str = "127.0.0.1",
        upstream_socket: str | None = None,
    ) -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.upstream_socket = upstream_socket  # a Unix socket path: used instead of host:port
        self.host = host
        self.port = 0  # set by start()
        self._delay = 0.0
        self._blackhole_new: bytes | None = None  # a marker; b"" matches every connection
        self._connections: list[_Connection] = []
        self._handlers: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failed: BaseException | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> TcpProxy:
        if self._thread is not None:
            raise RuntimeError("the proxy is already started")
        self._thread = threading.Thread(target=self._run, name="tcp-proxy", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._failed is not None:
            raise RuntimeError("the proxy did not start") from self._failed
        if not self._ready.is_set():
            raise RuntimeError("the proxy did not start in time")
        return self

    def stop(self) -> None:
        """Close every connection and the listening socket, and end the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
            self._call(self._shutdown)
            loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- faults --------------------------------------------------------------------------

    def cut(self, match: bytes | None = None, *, reset: bool = True) -> int:
        """Close both sides of the open connections matching ``match``; return how many.

        ``reset=True`` sends a TCP RST (SO_LINGER 0), ``False`` an orderly FIN.
        Blackholed connections are closed too.
        """

        async def cut_now() -> int:
            hit = [c for c in self._open() if c.matches(match)]
            for conn in hit:
                conn.close(reset=reset)
            return len(hit)

        return self._call(cut_now)

    def blackhole(self, match: bytes | None = None, *, new: bool = False) -> int:
        """Stop forwarding on the open connections matching ``match``; return how many.

        The sockets stay open (a half-open connection). New connections are not
        affected, unless ``new=True``: then later connections whose startup message
        matches are blackholed too, before it is forwarded (their connect hangs),
        until :meth:`heal`.
        """

        async def blackhole_now() -> int:
            hit = [c for c in self._open() if c.matches(match) and not c.blackholed]
            for conn in hit:
                conn.blackholed = True
            if new:
                self._blackhole_new = match if match is not None else b""
            return len(hit)

        return self._call(blackhole_now)

    def heal(self) -> None:
        """Let new connections through again (blackholed ones stay blackholed)."""

        async def heal_now() -> None:
            self._blackhole_new = None

        self._call(heal_now)

    def set_delay(self, seconds: float) -> None:
        """Delay every chunk forwarded from now on by ``seconds`` (0 turns delays off)."""
        if seconds < 0:
            raise ValueError("delay must be >= 0")
        self._delay = seconds

    # -- observation ---------------------------------------------------------------------

    def seen(self, match: bytes | None = None) -> int:
        """How many connections matching ``match`` the proxy has accepted so far."""

        async def count() -> int:
            return sum(1 for c in self._connections if c.matches(match))

        return self._call(count)

    def open_connections(self, match: bytes | None = None) -> int:
        """How many connections matching ``match`` are open now (blackholed ones included)."""

        async def count() -> int:
            return sum(1 for c in self._open() if c.matches(match))

        return self._call(count)

    def dropped_bytes(self, match: bytes | None = None) -> int:
        """Bytes swallowed by blackholed connections matching ``match``."""

        async def count() -> int:
            return sum(c.dropped_bytes for c in self._connections if c.matches(match))

        return self._call(count)

    # -- internals (the loop thread) -----------------------------------------------------

    def _call(self, make: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
        if self._loop is None or not self._ready.is_set():
            raise RuntimeError("the proxy is not running")
        return asyncio.run_coroutine_threadsafe(make(), self._loop).result(timeout=10)

    def _open(self) -> list[_Connection]:
        return [c for c in self._connections if not c.closed.is_set()]

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._server = loop.run_until_complete(asyncio.start_server(self._accept, self.host, 0))
            self.port = self._server.sockets[0].getsockname()[1]
        except BaseException as exc:
            self._failed = exc
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(_cancel_the_rest())
            loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in self._open():
            conn.close(reset=False)
        if self._handlers:  # let them end on their own: a cancelled one gets logged
            await asyncio.wait(self._handlers, timeout=5)

    async def _accept(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        handler = asyncio.current_task()
        if handler is not None:
            self._handlers.add(handler)
            handler.add_done_callback(self._handlers.discard)
        try:
            if self.upstream_socket is not None:
                upstream = await asyncio.open_unix_connection(self.upstream_socket)
            else:
                upstream = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        except OSError:
            client_writer.transport.abort()
            return
        conn = _Connection(len(self._connections), (client_reader, client_writer), upstream)
        self._connections.append(conn)
        to_server = asyncio.create_task(
            self._pump(conn, conn.client_reader, conn.upstream_writer, from_client=True)
        )
        to_client = asyncio.create_task(
            self._pump(conn, conn.upstream_reader, conn.client_writer, from_client=False)
        )
        try:
            await conn.closed.wait()
        finally:
            for task in (to_server, to_client):
                task.cancel()
            await asyncio.gather(to_server, to_client, return_exceptions=True)
            conn.close(reset=False)

    async def _pump(
        self,
        conn: _Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        from_client: bool,
    ) -> None:
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data:
                    break
                if from_client and conn.startup is None:
                    startup = conn.feed_head(data)
                    rule = self._blackhole_new
                    if startup is not None and rule is not None and rule in startup:
                        conn.blackholed = True
                if self._delay > 0:
                    await asyncio.sleep(self._delay)
                if conn.blackholed:
                    conn.dropped_bytes += len(data)
                    continue
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        if conn.blackholed:
            await conn.closed.wait()  # swallow the end-of-file too: keep the other side open
        conn.close(reset=False)


async def _cancel_the_rest() -> None:
    """Cancel every other task of the running loop and wait for them to end."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
