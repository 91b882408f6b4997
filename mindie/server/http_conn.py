"""Connection handling of the front ends below the HTTP parser (docs/reliability.md "Hostile input").

- ``error_answer``: a whole HTTP/1.1 error response in MindIE's ``{"error", "error_type"}`` shape
  with ``connection: close``, for answers written by the connection itself (unparsable requests,
  an oversized head, a receive timeout, plain HTTP on an HTTPS port), where no app runs.
- ``linger_close``: how such a connection ends. Closing a socket that still holds unread bytes
  sends a reset, and a client still sending (a 1 MiB header flood answered 431 after its first
  64 KiB) then gets ``ECONNRESET`` instead of the answer. So the answer is followed by a FIN
  (``write_eof``, where the transport has one: plain TCP), and what the client still sends is
  read and discarded until it closes, stops sending for ``LINGER_IDLE_S``, ``LINGER_S`` have
  passed or ``LINGER_BYTES`` were discarded (nginx's lingering close); then the socket closes.
- ``TlsSniffingServer``: the accept loop of an HTTPS listener. It peeks at the first byte of
  each connection before the handshake: a TLS record starts with 0x16 (handshake), and the
  socket goes to TLS (``loop.connect_accepted_socket``); anything else is a client speaking
  plain HTTP to the HTTPS port, answered with nginx's 400 "The plain HTTP request was sent to
  HTTPS port" in plain text HTTP (instead of a handshake failure the client shows as an empty
  reply). Waiting for that byte and the handshake together stay within the TLS handshake
  timeout. uvloop's own TLS server (``create_server(ssl=...)``) reads the socket itself, so
  there is no way to look before it: hence this loop, whose object stands in for the
  ``asyncio.Server`` uvicorn keeps (``close``, ``wait_closed``).
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import ssl
from collections.abc import Callable, Iterable

from mindie.contract.http_error import ApiError

log = logging.getLogger("mindie.http")

LINGER_S = 5.0  # at most this long reading and discarding after an error answer
LINGER_IDLE_S = 1.0  # or until the client has sent nothing for this long
LINGER_BYTES = 16 * 1024 * 1024  # or this much was discarded
# The ASGI scope extension that tells an app its request body stopped at bodyTimeoutS (the
# message as value); the app then sees the body end (http.disconnect) and answers nothing more.
RECEIVE_TIMEOUT_KEY = "mindie.receive_timeout"
TLS_RECORD_HANDSHAKE = 0x16  # the first byte of a TLS ClientHello record
PLAIN_HTTP_ON_TLS = "The plain HTTP request was sent to HTTPS port."  # nginx's words
ACCEPT_RETRY_S = 1.0  # out of descriptors or memory: wait before accepting again (as asyncio does)


def error_answer(status: int, reason: str, message: str,
                 default_headers: Iterable[tuple[bytes, bytes]] = ()) -> bytes:
    """A whole error response, MindIE's JSON shape, ending the connection."""
    body = ApiError(status, message, reason).body()
    head = [b"HTTP/1.1 %d %s\r\n" % (status, reason.encode())]
    head += [b"%s: %s\r\n" % kv for kv in default_headers]
    head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body))
    return b"".join(head) + body


class Lingerer(asyncio.Protocol):
    """Takes a transport over once its last answer is written (see ``linger_close``)."""

    def __init__(self, transport: asyncio.BaseTransport, on_lost: Callable[[Exception | None], None] | None):
        self.transport = transport
        self.on_lost = on_lost
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + LINGER_S
        self.left = LINGER_BYTES
        self.got = 0  # bytes discarded since the last tick
        self.timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        t = self.transport
        t.set_protocol(self)
        if t.can_write_eof():  # the FIN goes after the answer: the client reads it, then its end
            t.write_eof()
        with contextlib.suppress(AttributeError, RuntimeError):
            t.resume_reading()  # flow control may have paused it: the client would be stuck sending
        self.timer = self.loop.call_later(LINGER_IDLE_S, self._tick)

    def _tick(self) -> None:
        self.timer = None
        if self.got == 0 or self.loop.time() >= self.deadline:
            self.transport.close()
            return
        self.got = 0
        self.timer = self.loop.call_later(min(LINGER_IDLE_S, max(0.0, self.deadline - self.loop.time())),
                                          self._tick)

    def data_received(self, data: bytes) -> None:
        self.got += len(data)
        self.left -= len(data)
        if self.left <= 0:
            self.transport.close()

    def eof_received(self) -> bool:
        return False  # the client is done too: the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.on_lost is not None:
            on_lost, self.on_lost = self.on_lost, None
            on_lost(exc)


def linger_close(transport: asyncio.BaseTransport,
                 on_lost: Callable[[Exception | None], None] | None = None) -> None:
    """End a connection whose answer was just written: FIN where possible, read and discard
    within bounds, then close. ``on_lost``: called once when the connection is gone (the
    protocol that owned the transport, which no longer hears of it)."""
    if transport.is_closing():  # closing already: connection_lost still reaches its protocol
        return
    Lingerer(transport, on_lost).start()


class PlainHttpOnTlsPort(asyncio.Protocol):
    """A connection to an HTTPS listener whose first byte is not a TLS handshake: answered
    400 in plain HTTP, then closed (lingering: its request is read and dropped)."""

    answer = error_answer(400, "Bad Request", PLAIN_HTTP_ON_TLS)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.answer)  # type: ignore[attr-defined]
        linger_close(transport)


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fd = sock.fileno()
    ready = loop.create_future()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)


class TlsSniffingServer:
    """Serves one listening socket over TLS, answering plain HTTP on it with a 400."""

    def __init__(self, sock: socket.socket, protocol_factory: Callable[[], asyncio.Protocol],
                 context: ssl.SSLContext, handshake_timeout: float):
        self.sock = sock
        self.factory = protocol_factory
        self.context = context
        self.handshake_timeout = handshake_timeout
        self.loop = asyncio.get_running_loop()
        self.pending: set[asyncio.Task] = set()  # connections not yet handed to TLS or answered
        sock.setblocking(False)
        self.accepting = self.loop.create_task(self._accept())

    async def _accept(self) -> None:
        while True:
            try:
                conn, _ = await self.loop.sock_accept(self.sock)
            except asyncio.CancelledError:
                raise
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.error("accepting a connection on %s failed (%s): retrying in %.0f s",
                              self.sock.getsockname(), e, ACCEPT_RETRY_S)
                    await asyncio.sleep(ACCEPT_RETRY_S)
                elif e.errno == errno.EBADF or self.sock.fileno() < 0:
                    return  # the listening socket was closed
                continue  # ECONNABORTED and the like: that one client is gone
            task = self.loop.create_task(self._serve(conn))
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)

    async def _serve(self, conn: socket.socket) -> None:
        start = self.loop.time()
        try:
            conn.setblocking(False)
            try:
                await asyncio.wait_for(_readable(self.loop, conn), self.handshake_timeout)
                first = conn.recv(1, socket.MSG_PEEK)
            except (asyncio.TimeoutError, OSError):
                conn.close()  # silent for the handshake timeout, as the TLS server was
                return
            if not first:  # closed before saying anything
                conn.close()
                return
            if first[0] != TLS_RECORD_HANDSHAKE:
                log.info("plain HTTP (or not TLS) from %s on an HTTPS port: answered 400", _peer(conn))
                await self.loop.connect_accepted_socket(PlainHttpOnTlsPort, conn)
                return
            left = max(0.1, self.handshake_timeout - (self.loop.time() - start))
            await self.loop.connect_accepted_socket(self.factory, conn, ssl=self.context, ssl_handshake_timeout=left)
        except asyncio.CancelledError:
            conn.close()
            raise
        except (OSError, ssl.SSLError, asyncio.TimeoutError, ConnectionError) as e:
            # A refused or failed handshake (no client certificate, unknown CA, old TLS, timeout):
            # the client was told by TLS itself; uvloop closed the socket.
            log.debug("TLS connection from %s failed: %r", _peer(conn), e)
            conn.close()

    # -- what uvicorn's Server uses of an asyncio.Server -----------------------------------------
    def close(self) -> None:
        self.accepting.cancel()
        for task in list(self.pending):
            task.cancel()

    async def wait_closed(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await self.accepting
        if self.pending:
            await asyncio.gather(*self.pending, return_exceptions=True)


def _peer(conn: socket.socket) -> str:
    try:
        host, port = conn.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "a client that left"
