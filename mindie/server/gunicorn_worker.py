"""The gunicorn worker class of the front ends: uvicorn with uvloop + httptools, and a
graceful-shutdown bound so SIGTERM cannot hang on open SSE streams (UvicornWorker does not
forward gunicorn's graceful_timeout). A front end stops when its master dies, even by SIGKILL
(uvicorn workers never notice it on their own). Each listening socket (one per plane, see
mindie/server/listeners.py) gets its plane's TLS context, built from the files at boot; an HTTPS
socket answers plain HTTP with a 400 (mindie/server/http_conn.py). Requests must arrive within
ServerConfig.headTimeoutS / bodyTimeoutS (408), read from the config at boot as the app does."""
from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import socket
import ssl
import sys
import threading
import time
from dataclasses import dataclass

from gunicorn.arbiter import Arbiter
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import STARTUP_FAILURE, Server
from uvicorn_worker import UvicornWorker

from mindie.runtime.lifecycle import die_with_parent
from mindie.config import DEFAULT_DRAIN_TIMEOUT_S as DRAIN_DEFAULT, ServerConfig, load_config
from mindie.contract.http_error import ApiError
from mindie.server.http_conn import RECEIVE_TIMEOUT_KEY, TlsSniffingServer, error_answer, linger_close
from mindie.server.service_state import STOPPING
from mindie.server.listeners import read_listeners
from mindie.runtime.tls import server_context

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
CONFIRM_S = 0.001  # a receive timeout is acted on after one more poll of the sockets
TIMEOUT_SPREAD = 0.1  # a receive timeout acts between its value and 10 % later, at random


_DEFAULTS = ServerConfig()


class _EveryFew:
    """A log line at most every ``period`` seconds, telling how many were left out: 500 slow
    connections cut at once (an attack) log one line, not 500 (each costs the loop time)."""

    def __init__(self, period: float):
        self.period = period
        self.last = float("-inf")
        self.skipped = 0

    def due(self, now: float) -> int | None:
        """None: stay quiet; else log now, saying how many were left out since the last line."""
        if now - self.last < self.period:
            self.skipped += 1
            return None
        self.last, skipped, self.skipped = now, self.skipped, 0
        return skipped


_CUT_LOG = _EveryFew(10.0)  # receive timeouts


@dataclass(frozen=True)
class ReceiveTimeouts:
    """How long a connection may take to send a request (``ServerConfig.headTimeoutS`` and
    ``bodyTimeoutS``): the whole head from the connection's opening, or from the first byte of
    the next request on a kept-alive connection; the whole body from the end of the head."""

    head_s: float = _DEFAULTS.head_timeout_s
    body_s: float = _DEFAULTS.body_timeout_s

    @classmethod
    def of(cls, server: ServerConfig) -> "ReceiveTimeouts":
        return cls(server.head_timeout_s, server.body_timeout_s)


class JsonErrorHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with its 400 for an unparsable request (bad framing, bad
    Content-Length or chunk, NUL/CR/LF in the wrong place, invalid method or target) as JSON,
    a bound on the request head (httptools buffers a header line of any length): 431, receive
    timeouts for the head and the body (408), error answers that reach a client still sending
    (lingering close, mindie/server/http_conn.py), and a lost connection seen by every request on it,
    not only the last one parsed."""

    _head = -1  # bytes of the unfinished head of the current request (-1: not in a head)
    _heads = 0  # requests begun on this connection
    _head_too_large = False
    _cycles: tuple = ()  # requests of this connection whose answer is not complete
    _phase = ""  # what the client is sending: "head", "body", or "" (no request begun)
    _timer: asyncio.TimerHandle | None = None  # the receive timeout of the head or body
    _answered = False  # the connection wrote its own last answer (an error) and is lingering
    _discard = False  # a request came too slowly while an answer was being sent: ignore the rest
    _due = False  # the receive timeout fired: confirmed on the next turn of the loop

    def __init__(self, *args, timeouts: ReceiveTimeouts = ReceiveTimeouts(), **kwargs):
        super().__init__(*args, **kwargs)
        self.timeouts = timeouts

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(self.timeouts.head_s)  # the first head, from the opening (nothing sent: closed)

    # -- receive timeouts ----------------------------------------------------------------------
    def _arm(self, seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        # Spread: connections opened together (an attack) are not all cut in the same instant.
        self._timer = self.loop.call_later(seconds * (1.0 + TIMEOUT_SPREAD * random.random()), self._receive_timeout)
        self._due = False

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _receive_timeout(self) -> None:
        self._timer = None
        if self._answered or self.transport.is_closing():
            return
        if not self._due:
            # Due; decided one turn of the loop later, after it has read what already waits in the
            # socket (libuv runs timers before it polls): a front end that was itself held up past
            # the timeout does not blame a client whose bytes are there. What completes the head
            # or body meanwhile re-arms or disarms, which cancels this.
            self._timer = self.loop.call_later(CONFIRM_S, self._receive_timeout)
            self._due = True
            return
        phase, cycle = self._phase, self.cycle
        if self.flow.read_paused:
            # The server stopped reading (the app has not taken the body buffered so far, or a
            # pipelined request waits for the one before): not the client's delay.
            self._arm(self.timeouts.body_s if phase == "body" else self.timeouts.head_s)
            return
        if phase == "body" and cycle is not None and not cycle.response_started:
            self._timed_out("body", self.timeouts.body_s, cycle)
        elif cycle is not None and not cycle.response_complete:
            # An answer is on its way (to this request, or to the one before a head that is late):
            # it is sent in full, then the connection closes; what else comes is not read.
            cycle.keep_alive = False
            self._discard = True
        elif phase == "head":
            self._timed_out("head", self.timeouts.head_s, None)
        elif phase == "body":  # answered without its body, which still does not come
            self._end()
        else:  # no request begun (nothing sent, or only blank lines): closed without an answer,
            # as uvicorn's keep-alive timeout does; a 408 would be read as the answer to the
            # request such a client (a connection pool) sends next.
            self.transport.close()

    def _timed_out(self, what: str, seconds: float, cycle) -> None:
        msg = f"The request {what} was not received within {seconds:g} s."
        if cycle is not None:  # its app is reading the body: it learns why the body ended
            cycle.scope.setdefault("extensions", {})[RECEIVE_TIMEOUT_KEY] = msg
        who = "%s:%d" % self.client if self.client else "a client"
        if (more := _CUT_LOG.due(self.loop.time())) is not None:
            self.logger.info("%s: %s Answered 408%s.", who, msg,
                             f" ({more} other connections cut for the same kind of reason since the last such "
                             f"line)" if more else "")
        self._send_error(408, b"Request Timeout", msg)

    # -- parser callbacks ----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head = 0
        self._heads += 1
        self._phase = "head"
        if self._timer is None:
            self._arm(self.timeouts.head_s)

    def on_headers_complete(self) -> None:
        self._head = -1
        if len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers) > MAX_HEAD_BYTES:
            self._head_too_large = True
            raise ValueError("request head too large")  # httptools stops: send_400_response
        super().on_headers_complete()
        if self.cycle is not None and self.cycle not in self._cycles:
            self._cycles = (*(c for c in self._cycles if not c.response_complete), self.cycle)
        self._phase = "body"
        self._arm(self.timeouts.body_s)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._phase = ""
        self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        # uvicorn marks only self.cycle (the last request parsed): with pipelined requests the one
        # running went on generating for nobody, then wrote to the closed transport (a traceback).
        for cycle in self._cycles:
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._discard or self._answered:
            return
        if self._phase == "" and self._timer is None:
            self._arm(self.timeouts.head_s)  # the next request's first byte: its head's clock
        in_head, heads = self._head >= 0, self._heads
        super().data_received(data)
        # A head still unfinished: only chunks wholly inside it count (the first may hold the
        # previous request's tail), so it may overshoot the limit by one read before the 431,
        # never grow without bound. A finished head is measured exactly (on_headers_complete).
        if (in_head and self._head >= 0 and self._heads == heads and not self._answered
                and not self.transport.is_closing()):
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
        """The connection's last answer, then a lingering close (a client still sending reads it)."""
        self._end(error_answer(status, reason.decode(), msg, self.server_state.default_headers))

    def _end(self, answer: bytes = b"") -> None:
        """End the connection with ``answer`` (if any) and a lingering close."""
        if self._answered or self.transport.is_closing():
            return
        self._answered = True
        self._disarm()
        # The requests still due on this connection end here: their apps are told the client is
        # gone and write nothing more, not even a "100 Continue" (the transport is not closing
        # while it lingers, so uvicorn would write); an answer half sent is not followed by this one.
        writing = False
        for cycle in self._cycles:
            if not cycle.response_complete:
                writing = writing or cycle.response_started
                cycle.disconnected = True
                cycle.waiting_for_100_continue = False
                cycle.message_event.set()
        self.pipeline.clear()
        if answer and not writing:
            self.transport.write(answer)
        linger_close(self.transport, self.connection_lost)

    def _unsupported_upgrade_warning(self) -> None:
        pass  # Upgrade headers are ignored on purpose (ws "none"); uvicorn would log two warnings


class PlaneServer(Server):
    """uvicorn's Server with one TLS context per listening socket (uvicorn hands the same
    ``config.ssl`` to every socket; the planes have their own certificates), HTTPS sockets
    served by ``TlsSniffingServer`` (plain HTTP on them gets a 400), and the receive timeouts
    given to every connection's protocol."""

    def __init__(self, config, tls_by_port: dict[int, ssl.SSLContext], timeouts: ReceiveTimeouts = ReceiveTimeouts()):
        super().__init__(config)
        self.tls_by_port = tls_by_port
        self.timeouts = timeouts

    def handle_exit(self, sig, frame) -> None:
        STOPPING.set()  # a startup still waiting for a worker gives up (mindie/server/frontend.py)
        super().handle_exit(sig, frame)

    async def startup(self, sockets=None) -> None:
        if sockets is None:
            raise RuntimeError("PlaneServer serves the sockets gunicorn bound")
        await self.lifespan.startup()
        if self.lifespan.should_exit:
            sys.exit(STARTUP_FAILURE)
        config = self.config
        timeouts = self.timeouts

        def create_protocol(_loop=None):
            return config.http_protocol_class(config=config, server_state=self.server_state,
                                              app_state=self.lifespan.state, _loop=_loop, timeouts=timeouts)

        loop = asyncio.get_running_loop()
        self.servers = []
        for sock in sockets:
            tls = self.tls_by_port.get(sock.getsockname()[1])
            if tls is None:
                # The loop owns and closes what it is given; gunicorn closes its own socket objects
                # too (an "[Errno 9] Bad file descriptor" line per plane at every stop): a copy.
                own = socket.socket(sock.family, sock.type, sock.proto, fileno=os.dup(sock.fileno()))
                self.servers.append(await loop.create_server(create_protocol, sock=own, backlog=config.backlog))
            else:
                self.servers.append(TlsSniffingServer(sock, create_protocol, tls, TLS_HANDSHAKE_TIMEOUT_S))
        self.started = True


class FrontEndWorker(UvicornWorker):
    CONFIG_KWARGS = {
        "loop": "uvloop",
        "http": JsonErrorHttpToolsProtocol,
        # No WebSocket endpoint exists: an Upgrade header is ignored (RFC 9110 §7.8) instead of
        # reaching a WebSocket handshake (a POST with "Upgrade: websocket" hung there).
        "ws": "none",
        "lifespan": "on",
        # A front end told to stop cuts its requests at the drain bound itself (mindie/server/drain.py),
        # so uvicorn's own bound, which would cancel them with a traceback, is never reached.
        "timeout_graceful_shutdown": int(float(os.environ.get("MINDIE_GRACEFUL_TIMEOUT") or DRAIN_DEFAULT)) + 5,
        # A memory safety net far above maxLinkNum (mindie/ops/launch_plan.py); requests past maxLinkNum
        # are refused server-wide with MindIE's JSON 503 by mindie/server/admission.py, not here.
        "limit_concurrency": int(os.environ.get("MINDIE_MAX_CONNECTIONS", "16384")),
    }

    def load_wsgi(self) -> None:
        super().load_wsgi()
        self.wsgi = http_version_guard(self.wsgi)

    async def _serve(self) -> None:
        # Certificates are read here, at every boot: a SIGHUP (new front ends) loads renewed files.
        tls_by_port = {li.port: server_context(li.tls) for li in read_listeners(os.environ["MINDIE_LISTENERS"])
                       if li.tls is not None}
        # The receive timeouts, from the config as the app read it (mindie/server/frontend.py): a SIGHUP
        # (new front ends) applies a changed value.
        timeouts = ReceiveTimeouts.of(load_config().config.server)
        self.config.app = self.wsgi
        server = PlaneServer(self.config, tls_by_port, timeouts)
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
