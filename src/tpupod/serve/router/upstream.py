"""The router's client to its backends: HTTP/1.1 over a keep-alive pool of raw streams.

aiohttp's ``ClientSession.request`` built a request object, a URL, a header
multidict, a timer and a response object per request: about 60% of the router's
CPU per proxied request in a profile under load (BENCHMARKS.md, *Serving: the
fleet's router*). The router forwards bytes to servers it knows (tpupod's own,
uvicorn, aiohttp, vLLM, SGLang), so this module writes the request line and
headers itself and reads back only what it needs: the status, the content type,
and the body framed by ``Content-Length``, chunked encoding or the end of the
connection. Every socket sets TCP_NODELAY (a streamed token never waits on Nagle).

Errors: ``Refused`` when no connection could be made (nothing listens: the
backend is gone), ``Dropped`` when a connection broke before the answer was
whole. A kept-alive connection the backend closed while idle is retried once on
a new connection, before any answer was read (the backend never saw the request).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

CONNECT_TIMEOUT_S = 5.0
READ_LIMIT = 1 << 20  # the longest header block or chunk-size line accepted
IDLE_PER_BACKEND = 256  # kept-alive connections kept per backend; more are closed
NO_BODY = frozenset((204, 304))


class UpstreamError(Exception):
    """A backend could not answer; ``str()`` says why."""


class Refused(UpstreamError):
    """No connection could be made."""


class Dropped(UpstreamError):
    """The connection broke before the answer was whole."""


class Conn:
    __slots__ = ("aborted", "heard", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.aborted: str | None = None  # why the pool broke it (Pool.abort)
        self.heard = time.monotonic()  # the request sent, or the answer's last bytes

    def close(self) -> None:
        self.writer.close()

    def dropped(self, what: str) -> Dropped:
        """The error for a read that broke off: the pool's reason when it broke it."""
        return Dropped(self.aborted or what)


class Answer:
    """One backend's answer: status and content type at once, the body read on demand.

    Read the body with ``read()`` or ``chunks()``, then ``release()`` (also after an
    error: the connection is kept for the next request only when the body was read
    whole and the backend did not ask to close)."""

    def __init__(
        self, pool: Pool, conn: Conn, *, status: int, content_type: str, framing: str,
        length: int, keep: bool,
    ) -> None:  # fmt: skip
        self.pool, self.conn = pool, conn
        self.status, self.content_type = status, content_type
        self._framing, self._length = framing, length  # "length", "chunked" or "close"
        self._keep = keep and framing != "close"
        self._done = framing == "length" and length == 0

    async def read(self) -> bytes:
        if self._framing == "length":
            try:
                data = await self.conn.reader.readexactly(self._length)
            except (asyncio.IncompleteReadError, OSError) as exc:
                raise self.conn.dropped(f"the answer broke off: {exc}") from None
            self._done = True
            return data
        return b"".join([piece async for piece in self.chunks()])

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives: one piece per chunk the backend sent (an SSE event,
        with the servers here)."""
        reader = self.conn.reader
        try:
            if self._framing == "chunked":
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                    if size == 0:
                        while await reader.readuntil(b"\r\n") != b"\r\n":
                            pass  # trailers
                        break
                    piece = await reader.readexactly(size + 2)
                    self.conn.heard = time.monotonic()
                    yield piece[:-2]
            elif self._framing == "length":
                left = self._length
                while left:
                    piece = await reader.read(min(left, 65536))
                    if not piece:
                        raise asyncio.IncompleteReadError(b"", left)
                    left -= len(piece)
                    self.conn.heard = time.monotonic()
                    yield piece
            else:
                while piece := await reader.read(65536):
                    self.conn.heard = time.monotonic()
                    yield piece
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, OSError) as exc:
            what = f"the answer broke off: {type(exc).__name__} {exc}".strip()
            raise self.conn.dropped(what) from None
        if self.conn.aborted:  # an answer framed by the close: the pool's abort ended it
            raise self.conn.dropped("")
        self._done = True

    def release(self) -> None:
        self.pool.busy.discard(self.conn)
        if self._done and self._keep:
            self.pool.put(self.conn)
        else:
            self.conn.close()


class Pool:
    """Kept-alive connections to one backend (``host:port``)."""

    def __init__(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.host_header = address.encode()
        self.idle: list[Conn] = []
        self.busy: set[Conn] = set()  # sent a request, its answer not yet released

    def abort(self, reason: str, silent_for: float = 0.0) -> None:
        """The backend stopped answering (its health checks fail): break the connections
        that have heard nothing from it for ``silent_for`` s, and the idle ones. A request
        waiting on one ends now as ``Dropped(reason)`` (the router retries it elsewhere, or
        ends a begun stream) instead of when TCP gives up; a stream still receiving
        chunks (a busy backend whose /health is slow) goes on."""
        now = time.monotonic()
        for conn in [c for c in self.busy if now - c.heard >= silent_for]:
            conn.aborted = reason
            conn.writer.transport.abort()
            self.busy.discard(conn)
        self.close()

    def put(self, conn: Conn) -> None:
        if len(self.idle) < IDLE_PER_BACKEND and not conn.reader.at_eof():
            self.idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()

    async def connect(self) -> Conn:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, limit=READ_LIMIT), CONNECT_TIMEOUT_S
            )
        except (OSError, TimeoutError) as exc:
            raise Refused(str(exc) or type(exc).__name__) from None
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return Conn(reader, writer)

    async def request(self, method: str, target: str, headers: bytes, body: bytes) -> Answer:
        """Send one request; its answer once the status line and headers are in.

        ``headers``: the client's header lines to pass on (``b"Name: value\\r\\n"``...)."""
        message = b"".join(
            (
                f"{method} {target} HTTP/1.1\r\nHost: ".encode(),
                self.host_header,
                b"\r\n",
                headers,
                b"Content-Length: %d\r\n\r\n" % len(body),
                body,
            )
        )
        while self.idle:
            conn = self.idle.pop()
            with contextlib.suppress(_Stale):  # closed by the backend while idle: the next one
                return await self._exchange(conn, message)
        try:
            return await self._exchange(await self.connect(), message)
        except _Stale:
            raise Dropped("the backend closed the connection without answering") from None

    async def _exchange(self, conn: Conn, message: bytes) -> Answer:
        """:meth:`_send` on a connection counted busy until its answer is released."""
        conn.heard = time.monotonic()
        self.busy.add(conn)
        try:
            return await self._send(conn, message)
        except BaseException:
            self.busy.discard(conn)
            raise

    async def _send(self, conn: Conn, message: bytes) -> Answer:
        """Send, read the status line and headers; on any failure the connection is closed."""
        try:
            conn.writer.write(message)
            if len(message) > 65536:  # a long prompt: wait while the backend reads it
                await conn.writer.drain()
            return self._answer(conn, await conn.reader.readuntil(b"\r\n\r\n"))
        except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError) as exc:
            conn.close()
            if conn.aborted:
                raise conn.dropped("") from None
            if isinstance(exc, asyncio.IncompleteReadError) and exc.partial:
                raise Dropped("the answer broke off in its headers") from None
            raise _Stale from None
        except (OSError, asyncio.LimitOverrunError, ValueError) as exc:
            conn.close()
            raise Dropped(f"no HTTP/1.1 answer: {type(exc).__name__} {exc}".strip()) from None
        except BaseException:  # cancelled: the connection is in an unknown state
            conn.close()
            raise

    def _answer(self, conn: Conn, head: bytes) -> Answer:
        lines = head[:-4].split(b"\r\n")
        version, status_text = lines[0].split(b" ", 2)[:2]
        status = int(status_text)
        content_type, framing, length, close = "", "close", 0, version != b"HTTP/1.1"
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                framing, length = "length", int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                framing = "chunked"
            elif name == b"content-type":
                content_type = value.strip().decode("latin-1")
            elif name == b"connection" and b"close" in value.lower():
                close = True
        if status in NO_BODY or 100 <= status < 200:
            framing, length = "length", 0
        elif framing == "chunked":
            length = 0
        return Answer(
            self, conn, status=status, content_type=content_type, framing=framing,
            length=length, keep=not close,
        )  # fmt: skip


class _Stale(Exception):
    """A kept-alive connection was closed before any answer: safe to send again."""
