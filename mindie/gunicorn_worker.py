"""The gunicorn worker class of the front ends: uvicorn with uvloop + httptools, and a
graceful-shutdown bound so SIGTERM cannot hang on open SSE streams (UvicornWorker does not
forward gunicorn's graceful_timeout). A front end stops when its master dies, even by SIGKILL
(uvicorn workers never notice it on their own). Each listening socket (one per plane, see
mindie/listeners.py) gets its plane's TLS context, built from the files at boot."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import ssl
import sys
import threading
import time

from gunicorn.arbiter import Arbiter
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import STARTUP_FAILURE, Server
from uvicorn_worker import UvicornWorker

from mindie.runtime.lifecycle import die_with_parent
from mindie.errors import ApiError
from mindie.config import DEFAULT_DRAIN_TIMEOUT_S as DRAIN_DEFAULT
from mindie.service_state import STOPPING
from mindie.listeners import read_listeners
from mindie.tls import server_context

TLS_HANDSHAKE_TIMEOUT_S = 10.0  # a client that opens a connection and never says hello is dropped

# Hostile input at the HTTP layer (docs/reliability.md "Hostile input"): every answer below the
# app is in MindIE's {"error", "error_type"} shape too.
HTTP_VERSIONS = frozenset(("1.0", "1.1"))  # what httptools may report: also "0.9" (no version), "2.0"


def http_version_guard(app):
    """The ASGI app, answering a request line of any other HTTP version than 1.0/1.1 (none =
    "0.9", "HTTP/2.0" sent as text) with 505 instead of Falcon's UnsupportedError (a plain 500)."""

    async def guarded(scope, receive, send):
        if scope["type"] == "http" and scope.get("http_version", "1.1") not in HTTP_VERSIONS:
            body = ApiError(505, f"HTTP/{scope['http_version']} is not supported: use HTTP/1.1.",
                            "HTTP Version Not Supported").body()
            await send({"type": "http.response.start", "status": 505, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        await app(scope, receive, send)

    return guarded


MAX_HEAD_BYTES = 64 * 1024  # request line + headers; httptools itself has no limit


class JsonErrorHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with its 400 for an unparsable request (bad framing, bad
    Content-Length or chunk, NUL/CR/LF in the wrong place, invalid method or target) as JSON,
    a bound on the request head (httptools buffers a header line of any length): 431, and a
    lost connection seen by every request on it, not only the last one parsed."""

    _head = -1  # bytes of the unfinished head of the current request (-1: not in a head)
    _heads = 0  # requests begun on this connection
    _head_too_large = False
    _cycles: tuple = ()  # requests of this connection whose answer is not complete

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head = 0
        self._heads += 1

    def on_headers_complete(self) -> None:
        self._head = -1
        if len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers) > MAX_HEAD_BYTES:
            self._head_too_large = True
            raise ValueError("request head too large")  # httptools stops: send_400_response
        super().on_headers_complete()
        if self.cycle is not None and self.cycle not in self._cycles:
            self._cycles = (*(c for c in self._cycles if not c.response_complete), self.cycle)

    def connection_lost(self, exc: Exception | None) -> None:
        # uvicorn marks only self.cycle (the last request parsed): with pipelined requests the one
        # running went on generating for nobody, then wrote to the closed transport (a traceback).
        for cycle in self._cycles:
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        in_head, heads = self._head >= 0, self._heads
        super().data_received(data)
        # A head still unfinished: only chunks wholly inside it count (the first may hold the
        # previous request's tail), so it may overshoot the limit by one read before the 431,
        # never grow without bound. A finished head is measured exactly (on_headers_complete).
        if in_head and self._head >= 0 and self._heads == heads and not self.transport.is_closing():
            self._head += len(data)
            if self._head > MAX_HEAD_BYTES:
                self._head_too_large = True
                self.send_400_response("")

    def send_400_response(self, msg: str) -> None:
        if self._head_too_large:
            self.logger.warning("Request head over %d bytes.", MAX_HEAD_BYTES)
            self._send_error(431, b"Request Header Fields Too Large",
                             f"Request line and headers exceed {MAX_HEAD_BYTES} bytes.")
        else:
            self._send_error(400, b"Bad Request", msg)

    def _send_error(self, status: int, reason: bytes, msg: str) -> None:
        body = ApiError(status, msg, reason.decode()).body()
        head = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
        head += [b"%s: %s\r\n" % kv for kv in self.server_state.default_headers]
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                    % len(body))
        self.transport.write(b"".join(head) + body)
        self.transport.close()

    def _unsupported_upgrade_warning(self) -> None:
        pass  # Upgrade headers are ignored on purpose (ws "none"); uvicorn would log two warnings


class PlaneServer(Server):
    """uvicorn's Server with one TLS context per listening socket (uvicorn hands the same
    ``config.ssl`` to every socket; the planes have their own certificates)."""

    def __init__(self, config, tls_by_port: dict[int, ssl.SSLContext]):
        super().__init__(config)
        self.tls_by_port = tls_by_port

    def handle_exit(self, sig, frame) -> None:
        STOPPING.set()  # a startup still waiting for a worker gives up (mindie/frontend.py)
        super().handle_exit(sig, frame)

    async def startup(self, sockets=None) -> None:
        if sockets is None:
            raise RuntimeError("PlaneServer serves the sockets gunicorn bound")
        await self.lifespan.startup()
        if self.lifespan.should_exit:
            sys.exit(STARTUP_FAILURE)
        config = self.config

        def create_protocol(_loop=None):
            return config.http_protocol_class(config=config, server_state=self.server_state,
                                              app_state=self.lifespan.state, _loop=_loop)

        loop = asyncio.get_running_loop()
        self.servers = []
        for sock in sockets:
            tls = self.tls_by_port.get(sock.getsockname()[1])
            # The loop owns and closes what it is given; gunicorn closes its own socket objects
            # too (an "[Errno 9] Bad file descriptor" line per plane at every stop): give it a copy.
            own = socket.socket(sock.family, sock.type, sock.proto, fileno=os.dup(sock.fileno()))
            self.servers.append(await loop.create_server(
                create_protocol, sock=own, ssl=tls, backlog=config.backlog,
                ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S if tls else None))
        self.started = True


class FrontEndWorker(UvicornWorker):
    CONFIG_KWARGS = {
        "loop": "uvloop",
        "http": JsonErrorHttpToolsProtocol,
        # No WebSocket endpoint exists: an Upgrade header is ignored (RFC 9110 §7.8) instead of
        # reaching a WebSocket handshake (a POST with "Upgrade: websocket" hung there).
        "ws": "none",
        "lifespan": "on",
        # A front end told to stop cuts its requests at the drain bound itself (mindie/drain.py),
        # so uvicorn's own bound, which would cancel them with a traceback, is never reached.
        "timeout_graceful_shutdown": int(float(os.environ.get("MINDIE_GRACEFUL_TIMEOUT") or DRAIN_DEFAULT)) + 5,
        # A memory safety net far above maxLinkNum (mindie/ops/prepare.py); requests past maxLinkNum
        # are refused server-wide with MindIE's JSON 503 by mindie/admission.py, not here.
        "limit_concurrency": int(os.environ.get("MINDIE_MAX_CONNECTIONS", "16384")),
    }

    def load_wsgi(self) -> None:
        super().load_wsgi()
        self.wsgi = http_version_guard(self.wsgi)

    async def _serve(self) -> None:
        # Certificates are read here, at every boot: a SIGHUP (new front ends) loads renewed files.
        tls_by_port = {li.port: server_context(li.tls) for li in read_listeners(os.environ["MINDIE_LISTENERS"])
                       if li.tls is not None}
        self.config.app = self.wsgi
        server = PlaneServer(self.config, tls_by_port)
        self._install_sigquit_handler()
        await server.serve(sockets=self.sockets)
        if not server.started:
            sys.exit(Arbiter.WORKER_BOOT_ERROR)

    def init_signals(self) -> None:
        super().init_signals()  # SIGTERM is SIG_DFL from here until uvicorn installs its handler
        # The master dies: SIGTERM now (uvicorn's graceful shutdown: stop accepting, let
        # requests end), from the kernel or, failing that, from a watch of our parent.
        die_with_parent(signal.SIGTERM, self.ppid)
        threading.Thread(target=_watch_parent, args=(self.ppid,), name="parent-watch", daemon=True).start()


def _watch_parent(ppid: int) -> None:
    while os.getppid() == ppid:
        time.sleep(1.0)
    logging.getLogger("mindie.frontend").error("gunicorn master (pid %d) is gone: stopping", ppid)
    os.kill(os.getpid(), signal.SIGTERM)  # uvicorn ignores a repeated SIGTERM: no harm if it fired
    # Graceful shutdown is bounded by timeout_graceful_shutdown; a front end hung past it goes anyway.
    time.sleep(FrontEndWorker.CONFIG_KWARGS["timeout_graceful_shutdown"] + 5)
    os._exit(1)
