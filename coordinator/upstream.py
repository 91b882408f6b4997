"""The relay's HTTP/1.1 client to the instances: asyncio transports, httptools' C parser, and a
keep-alive pool per instance that is O(1) per request.

Why not httpx for this one path: with thousands of streams open, httpcore's pool scans every
connection on each request and each release (quadratic in the streams in flight) and h11 parses
every chunk in Python; a profile of 128 concurrent streams spent most of the coordinator's CPU
there. httpx still makes the coordinator's other calls (polls, metrics, stopInfer).

A response's body is handed over as the parser yields it (chunked encoding removed, bytes as
the instance wrote them): one SSE event or vLLM frame per chunk, nothing gathered. A slow client
pauses reading from the instance (flow control), so memory stays bounded per stream.
"""
from __future__ import annotations

import asyncio
import collections
import ssl
import time
from typing import AsyncIterator, Optional

import httptools

HIGH_WATER = 1 << 20  # bytes queued from an instance before reading from it pauses
IDLE_S = 30.0  # a kept-alive connection idle longer is closed, not reused (gunicorn keeps 75 s)


class UpstreamError(Exception):
    """The instance's connection failed: refused, reset, closed early, or not HTTP."""


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: Optional[asyncio.Transport] = None
        self.closed = False
        self.idle_since = 0.0
        self.reset()

    def reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head: Optional[asyncio.Future] = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.queued = 0
        self.waiter: Optional[asyncio.Future] = None
        self.complete = False
        self.error: Optional[BaseException] = None
        self.got_bytes = False
        self.keep_alive = False
        self.paused = False

    # -- asyncio.Protocol --------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamError("the instance switched protocols"))
        except httptools.HttpParserError as e:
            self._fail(UpstreamError(f"malformed HTTP from the instance: {e}"))

    def connection_lost(self, exc) -> None:
        self.closed = True
        if not self.complete:
            self._fail(UpstreamError(f"connection closed by the instance{f': {exc}' if exc else ''}"))

    # -- httptools callbacks -----------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(bytes(body))
        self.queued += len(body)
        if self.queued > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # -- helpers -----------------------------------------------------------------------------------
    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        if self.head is not None and not self.head.done():
            self.head.set_exception(exc)
        self._wake()
        if self.transport is not None:
            self.transport.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Response:
    """An instance's answer: ``status``, ``headers`` (bytes pairs), and the body by ``chunks()``."""

    def __init__(self, pool: "Pool", key, conn: _Conn) -> None:
        self._pool, self._key, self._conn = pool, key, conn
        self.status = conn.status
        self.headers = conn.headers
        self._released = False

    async def chunks(self) -> AsyncIterator[bytes]:
        c = self._conn
        while True:
            if c.chunks:
                data = c.chunks.popleft()
                c.queued -= len(data)
                if c.paused and c.queued < HIGH_WATER // 2 and c.transport is not None:
                    c.paused = False
                    c.transport.resume_reading()
                yield data
                continue
            if c.complete:
                return
            if c.error is not None:
                raise c.error
            c.waiter = asyncio.get_running_loop().create_future()
            try:
                await c.waiter
            finally:
                c.waiter = None

    async def read(self, limit: int = 1 << 16) -> bytes:
        out = bytearray()
        async for chunk in self.chunks():
            out += chunk
            if len(out) >= limit:
                break
        return bytes(out)

    def release(self) -> None:
        """Back to the pool when the answer was read to its end, else the connection is closed
        (the instance takes a closed connection as a cancel)."""
        if self._released:
            return
        self._released = True
        c = self._conn
        if c.complete and c.keep_alive and not c.closed and c.error is None:
            c.reset()
            c.idle_since = time.monotonic()
            self._pool._idle.setdefault(self._key, []).append(c)
        else:
            c.close()


class Pool:
    """Kept-alive connections per (host, port, TLS); no limit on how many are open at once."""

    def __init__(self, ssl_context: Optional[ssl.SSLContext], connect_timeout: float = 5.0,
                 send_timeout: Optional[float] = None) -> None:
        self.ssl = ssl_context
        self.connect_timeout = connect_timeout
        self.send_timeout = send_timeout
        self._idle: dict[tuple, list[_Conn]] = {}

    async def _connect(self, host: str, port: int) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(
                _Conn, host, port, ssl=self.ssl, server_hostname=host if self.ssl else None), self.connect_timeout)
        except asyncio.TimeoutError:
            raise UpstreamError(f"connect to {host}:{port} timed out after {self.connect_timeout:g} s") from None
        except (OSError, ssl.SSLError) as e:
            raise UpstreamError(f"connect to {host}:{port}: {e.strerror or e}" if isinstance(e, OSError)
                                else f"TLS with {host}:{port}: {e}") from None
        return conn

    def _take(self, key) -> Optional[_Conn]:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            c = idle.pop()
            if not c.closed and now - c.idle_since < IDLE_S and c.transport is not None \
                    and not c.transport.is_closing():
                return c
            c.close()
        return None

    async def request(self, host: str, port: int, method: str, target: str,
                      headers: list[tuple[bytes, bytes]], body: bytes, timeout: Optional[float]) -> Response:
        """Send one request and wait (at most ``timeout`` s, None = no bound) for the answer's
        head. A kept-alive connection the instance closed meanwhile is replaced once, silently."""
        key = (host, port)
        host_header = f"{host}:{port}".encode() if ":" not in host else f"[{host}]:{port}".encode()
        head = [f"{method} {target} HTTP/1.1\r\n".encode("latin-1"), b"host: ", host_header, b"\r\n"]
        for k, v in headers:
            head += [k, b": ", v, b"\r\n"]
        if body or method not in ("GET", "HEAD"):
            head.append(b"content-length: %d\r\n" % len(body))
        head.append(b"\r\n")
        data = b"".join(head) + body
        for attempt in (0, 1):
            conn = self._take(key) if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = await self._connect(host, port)
            conn.head = asyncio.get_running_loop().create_future()
            conn.transport.write(data)
            try:
                await asyncio.wait_for(conn.head, timeout)
            except UpstreamError:
                conn.close()
                if reused and not conn.got_bytes:
                    continue  # the instance had closed the idle connection: a fresh one
                raise
            except BaseException:
                conn.close()  # timeout, cancel: the instance takes the closed connection as a cancel
                raise
            return Response(self, key, conn)
        raise UpstreamError("unreachable")

    def close(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()
