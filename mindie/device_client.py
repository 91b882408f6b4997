"""Asyncio client of the device workers: what a front end (and the tests) use.

One PUSH socket per worker for jobs, one SUB socket connected to every worker for frames,
subscribed to this client's own id and to heartbeats. A worker is used only after its
``Welcome`` arrives on our topic (the subscription is then proven live). Every FrameBatch
carries a per-(worker, client) sequence number: a gap fails the affected requests instead
of emitting corrupted output. A worker silent for ``WORKER_TIMEOUT_S``, or one that comes
back as a new instance, fails its in-flight requests with an error.

A ``tcp://`` worker link is a CURVE client of the worker (keys from the spec's
``curve_key_dir``, mindie/runtime/curve.py); without keys it is refused unless the spec says
``insecure_tcp``. ``ipc://`` links need nothing: the run directory is private.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from mindie.contract import wire as P
from mindie.runtime.curve import frontend_keys, insecure_warning, link_mode
from mindie.contract.errors import FINISH_ERROR, UnknownAdapterError
from mindie.contract.spec import WorkerSpec

log = logging.getLogger("mindie.client")

# Some workers ready, others still loading: after this long the server counts as started with
# those ready (the health probes say ready, the ready line says "N of M").
STARTUP_PARTIAL_S = 30.0


class NoWorkerError(Exception):
    """No device worker is ready to take a request."""


@dataclass(eq=False)
class WorkerLink:
    ep: WorkerSpec
    push: zmq.Socket
    welcomed: bool = False
    instance: str = ""
    expected_seq: int = 0
    last_heard: float = 0.0
    heartbeat: P.Heartbeat | None = None
    inflight: dict[str, "RequestStream"] = field(default_factory=dict)

    def load(self) -> tuple[float, float]:
        hb = self.heartbeat
        kv_used = 1.0 - hb.free_blocks / hb.total_blocks if hb and hb.total_blocks else 0.0
        return (len(self.inflight) + (hb.waiting if hb else 0), kv_used)


class RequestStream:
    """Frames of one request, in order; ends with a finish reason or an error."""

    def __init__(self, request_id: str, link: WorkerLink):
        self.request_id = request_id
        self.link = link
        self.frames: collections.deque[P.TokenFrame] = collections.deque()
        self.event = asyncio.Event()
        self.finished = False
        self.cancelled = False  # ended by this front end (``DeviceClient.cancel``): no frame comes
        self.error: P.RequestError | None = None

    def _push(self, frame: P.TokenFrame) -> None:
        if self.finished:
            return
        self.frames.append(frame)
        if frame.finish_reason or frame.error is not None:
            self.finished = True
            self.error = frame.error
        self.event.set()

    def _fail(self, status: int, message: str) -> None:
        self._push(P.TokenFrame(self.request_id, finish_reason=FINISH_ERROR, error=P.request_error(status, message)))

    async def get(self, timeout: float | None) -> list[P.TokenFrame]:
        """Every frame received since the last call; waits up to ``timeout`` seconds for one.
        Returns [] on timeout, and at once for a request cancelled here (nothing more comes)."""
        if not self.frames:
            if self.finished:
                return []
            self.event.clear()
            try:
                await asyncio.wait_for(self.event.wait(), timeout)
            except asyncio.TimeoutError:
                # Frames may have come as the wait timed out: the reader task pushed them after the
                # timer fired, before this task resumed (wait_for then cancels a wait that has its
                # event). They are returned now, not left queued: a caller that sees [] and a
                # finished stream takes it as cancelled here, and the request's output was lost
                # (an empty 200 stream under load).
                pass
        out = list(self.frames)
        self.frames.clear()
        return out


class DeviceClient:
    def __init__(self, endpoints: list[WorkerSpec], frontend_id: str | None = None,
                 ctx: zmq.asyncio.Context | None = None):
        self.frontend_id = frontend_id or f"fe-{os.getpid()}-{secrets.token_hex(4)}"
        self.ctx = ctx or zmq.asyncio.Context()
        self._own_ctx = ctx is None
        # Jobs go out through plain sockets: a NOBLOCK send on an asyncio socket reports
        # zmq.Again through a future instead of raising, and these sends never block anyway.
        self.job_ctx = zmq.Context()
        self.endpoints = endpoints
        self.links: dict[str, WorkerLink] = {}
        self.sub: zmq.asyncio.Socket | None = None
        self.tasks: list[asyncio.Task] = []
        self.ready_event = asyncio.Event()
        # Called with each Welcome before its worker counts as ready: the model's vocabulary size
        # and maximum positions as the worker parsed them (FrontEnd.learn_model).
        self.on_welcome: Callable[[P.Welcome], None] | None = None
        # Called once a new worker instance (a start, a restart) is ready: mindie/lora_adapters.py restores
        # the LoRA adapters loaded at run time into it.
        self.on_new_instance: Callable[[WorkerLink], None] | None = None
        self.first_ready_at: float | None = None  # time.monotonic() of the first Welcome (None: none yet)
        self._started = False  # latched by ``started``
        self._stops: dict[str, tuple[asyncio.Future, set[str], list[int]]] = {}
        self._asks: dict[str, tuple[asyncio.Future, set[str], dict[str, P.AdapterAnswer]]] = {}
        self.gaps = 0  # sequence gaps seen (frames lost); tests assert it stays 0

    # -- lifecycle ------------------------------------------------------------------------
    def _link_keys(self) -> dict[str, tuple[bytes, bytes, bytes] | None]:
        """{worker id: CURVE keys (server public, own public, own secret) or None (ipc, or plain
        tcp allowed by insecure_tcp)}. Raises ``CurveKeyError`` for a tcp link it must not open."""
        out: dict[str, tuple[bytes, bytes, bytes] | None] = {}
        for ep in self.endpoints:
            modes = {link_mode(e, ep.curve_key_dir, ep.insecure_tcp) for e in (ep.job_endpoint, ep.pub_endpoint)}
            if "plain" in modes and "curve" not in modes:
                log.warning("%s", insecure_warning(ep.job_endpoint))
            out[ep.worker_id] = frontend_keys(ep.curve_key_dir) if "curve" in modes else None
        return out

    @staticmethod
    def _secure(sock: zmq.Socket, endpoint: str, keys: tuple[bytes, bytes, bytes] | None) -> None:
        """Socket options for ``endpoint``, set before connecting (they apply per connection)."""
        if endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        if keys is not None and endpoint.startswith("tcp://"):
            server, public, secret = keys
            sock.setsockopt(zmq.CURVE_SERVERKEY, server)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)

    async def start(self) -> None:
        """Connect to every worker. Raises ``CurveKeyError`` (nothing connected) for a tcp link
        without CURVE keys and without insecure_tcp, or for unusable key files."""
        link_keys = self._link_keys()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.frontend_id.encode())
        self.sub.setsockopt(zmq.SUBSCRIBE, P.HEARTBEAT_TOPIC)
        for ep in self.endpoints:
            push = self.job_ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.IMMEDIATE, 1)  # never queue jobs toward a worker that is not there
            push.setsockopt(zmq.SNDHWM, 0)
            self._secure(push, ep.job_endpoint, link_keys[ep.worker_id])
            push.connect(ep.job_endpoint)
            self._secure(self.sub, ep.pub_endpoint, link_keys[ep.worker_id])
            self.sub.connect(ep.pub_endpoint)
            self.links[ep.worker_id] = WorkerLink(ep, push)
        self.tasks = [asyncio.create_task(self._reader(), name="zmq-reader"),
                      asyncio.create_task(self._hello_loop(), name="zmq-hello")]

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        for link in self.links.values():
            for stream in list(link.inflight.values()):
                stream._fail(503, "The service has been stopped.")
            link.push.close(0)
        if self.sub is not None:
            self.sub.close(0)
        self.job_ctx.destroy(linger=0)
        if self._own_ctx:
            self.ctx.destroy(linger=0)

    async def wait_ready(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self.ready_event.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def started(self) -> bool:
        """Start-up is over: every worker has been ready once, or STARTUP_PARTIAL_S passed since
        the first was (the others still loading: serve with those ready). Latched: a worker that
        restarts later does not make the server "starting" again. The health probes answer 503
        "starting" until then, so an orchestrator sends traffic to a server that is fully up,
        the moment the ready line says so (mindie/server/ready_line.py)."""
        if not self._started and self.first_ready_at is not None:
            self._started = all(link.instance for link in self.links.values()) or \
                time.monotonic() - self.first_ready_at >= STARTUP_PARTIAL_S
        return self._started

    def ready_links(self) -> list[WorkerLink]:
        return [link for link in self.links.values() if link.welcomed]

    def heartbeats(self) -> list[P.Heartbeat]:
        """The last heartbeat of every ready worker."""
        return [link.heartbeat for link in self.ready_links() if link.heartbeat is not None]

    def load(self) -> tuple[int, int, float]:
        """(running, waiting, KV usage 0..1) over the ready workers, from their heartbeats."""
        running = waiting = free = total = 0
        for link in self.ready_links():
            hb = link.heartbeat
            if hb:
                running += hb.running
                waiting += hb.waiting
                free += hb.free_blocks
                total += hb.total_blocks
        return running, waiting, 1.0 - free / total if total else 0.0

    # -- requests -------------------------------------------------------------------------
    def submit(self, token_ids: list[int], params: P.SamplingParams, priority: int = 5,
               request_id: str | None = None, user_id: str = "", adapter: str = "",
               pd: P.PdOrder | None = None) -> RequestStream:
        """Send a request to the least loaded ready worker (with ``adapter``: of those that list that
        LoRA adapter; ``NoWorkerError`` when none is ready, ``UnknownAdapterError`` when none lists it)."""
        links = self.ready_links()
        if not links:
            raise NoWorkerError("no device worker is ready")
        if adapter:
            links = [lk for lk in links if lk.heartbeat is not None and any(a.name == adapter
                                                                             for a in lk.heartbeat.adapters)]
            if not links:
                raise UnknownAdapterError(adapter)
        if pd is not None and pd.op == "decode":  # the worker that receives the transfer
            links = [lk for lk in links if pd.kv_endpoint in (lk.ep.kv_endpoint, lk.ep.kv_tcp_endpoint)]
            if not links:
                raise NoWorkerError(f"no ready device worker of this instance has KV endpoint {pd.kv_endpoint}")
        rid = request_id or secrets.token_hex(8)
        data = P.encode(P.Submit(rid, self.frontend_id, token_ids, params, priority, time.time(), user_id, adapter, pd))
        # Least loaded first; a worker whose job socket has no peer yet (just restarted: its
        # heartbeats reach us before our push socket has reconnected to it) is skipped for the next.
        refused = []
        for link in sorted(links, key=lambda lk: lk.load()):
            try:
                link.push.send(data, zmq.NOBLOCK)
            except zmq.Again:
                refused.append(link.ep.worker_id)
                continue
            stream = RequestStream(rid, link)
            link.inflight[rid] = stream
            return stream
        raise NoWorkerError(f"device worker{'s' if len(refused) > 1 else ''} {', '.join(refused)} "
                            f"{'are' if len(refused) > 1 else 'is'} not connected")

    def cancel(self, stream: RequestStream) -> None:
        """Abort a request on its worker (client gone, timeout); safe to call twice."""
        link = stream.link
        if link.inflight.pop(stream.request_id, None) is None:
            return
        stream.finished = True
        stream.cancelled = True
        self._send_cancel(link, [stream.request_id])

    async def stop_user(self, user_id: str, timeout: float) -> tuple[int, bool]:
        """stopInfer: ask every ready worker to end the requests named ``user_id`` (whichever
        front end submitted them). Returns (requests ended, whether every worker answered in
        ``timeout`` seconds)."""
        links = self.ready_links()
        token = secrets.token_hex(8)
        fut = asyncio.get_running_loop().create_future()
        waiting = {link.ep.worker_id for link in links}
        found = [0]
        self._stops[token] = (fut, waiting, found)
        try:
            for link in links:
                try:
                    link.push.send(P.encode(P.Stop(self.frontend_id, user_id, token)), zmq.NOBLOCK)
                except zmq.Again:
                    waiting.discard(link.ep.worker_id)  # gone: it holds nothing
            if waiting:
                try:
                    await asyncio.wait_for(asyncio.shield(fut), timeout)
                except asyncio.TimeoutError:
                    pass
            return found[0], not waiting
        finally:
            self._stops.pop(token, None)

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters requests may name: {name: path} over the ready workers' heartbeats."""
        out: dict[str, str] = {}
        for link in self.ready_links():
            if link.heartbeat is not None:
                for a in link.heartbeat.adapters:
                    out.setdefault(a.name, a.path)
        return out

    def has_adapter(self, name: str) -> bool:
        return any(link.heartbeat is not None and any(a.name == name for a in link.heartbeat.adapters)
                   for link in self.ready_links())

    async def ask_workers(self, make: Callable[[str], P.Message], timeout: float,
                          links: list[WorkerLink] | None = None) -> tuple[dict[str, P.AdapterAnswer], list[str]]:
        """Send ``make(token)`` (a LoadAdapter or UnloadAdapter) to every ready worker (or to
        ``links``) and wait up to ``timeout`` s for each one's ``AdapterAnswer``. Returns
        ({worker id: answer}, the ids of the workers that did not answer)."""
        links = self.ready_links() if links is None else links
        token = secrets.token_hex(8)
        fut = asyncio.get_running_loop().create_future()
        waiting = {link.ep.worker_id for link in links}
        answers: dict[str, P.AdapterAnswer] = {}
        self._asks[token] = (fut, waiting, answers)
        try:
            data = P.encode(make(token))
            for link in links:
                try:
                    link.push.send(data, zmq.NOBLOCK)
                except zmq.Again:
                    waiting.discard(link.ep.worker_id)
                    answers[link.ep.worker_id] = P.AdapterAnswer(link.ep.worker_id, self.frontend_id, token, 503,
                                                                 f"device worker {link.ep.worker_id} is not connected")
            if waiting:
                try:
                    await asyncio.wait_for(asyncio.shield(fut), timeout)
                except asyncio.TimeoutError:
                    pass
            return answers, sorted(waiting)
        finally:
            self._asks.pop(token, None)

    def _on_adapter_answer(self, msg: P.AdapterAnswer) -> None:
        entry = self._asks.get(msg.token)
        if entry is None:
            return
        fut, waiting, answers = entry
        answers[msg.worker_id] = msg
        waiting.discard(msg.worker_id)
        if not waiting and not fut.done():
            fut.set_result(None)

    def link(self, worker_id: str) -> WorkerLink | None:
        return self.links.get(worker_id)

    def _on_stopped(self, msg: P.Stopped) -> None:
        entry = self._stops.get(msg.token)
        if entry is None:
            return
        fut, waiting, found = entry
        found[0] += msg.found
        waiting.discard(msg.worker_id)
        if not waiting and not fut.done():
            fut.set_result(None)

    def _send_cancel(self, link: WorkerLink, rids: list[str]) -> None:
        try:
            link.push.send(P.encode(P.Cancel(self.frontend_id, rids)), zmq.NOBLOCK)
        except zmq.Again:
            pass  # worker gone: it has nothing to cancel

    def in_flight(self) -> int:
        """Requests of this front end on its workers, not yet finished."""
        return sum(len(link.inflight) for link in self.links.values())

    def cut_all(self, status: int, message: str) -> int:
        """End every request in flight with an error (a stop's drain bound, mindie/server/frontend.py) and
        cancel them on their workers; returns how many were cut."""
        cut = 0
        for link in self.links.values():
            streams = list(link.inflight.values())
            link.inflight.clear()
            for s in streams:
                s._fail(status, message)
            if streams:
                cut += len(streams)
                self._send_cancel(link, [s.request_id for s in streams])
        return cut

    def _fail_link(self, link: WorkerLink, message: str) -> None:
        """End every in-flight request on ``link`` with an error, and cancel them on the worker
        in case it is still alive (a gap, a worker that was only slow)."""
        streams = list(link.inflight.values())
        link.inflight.clear()
        for s in streams:
            s._fail(500, message)
        if streams:
            log.error("%s: failed %d in-flight requests", message, len(streams))
            self._send_cancel(link, [s.request_id for s in streams])

    # -- background tasks -----------------------------------------------------------------
    async def _hello_loop(self) -> None:
        pid = os.getpid()
        while True:
            now = time.monotonic()
            for link in self.links.values():
                if link.welcomed and now - link.last_heard > P.WORKER_TIMEOUT_S:
                    link.welcomed = False
                    self._fail_link(link, f"Device worker {link.ep.worker_id} stopped responding "
                                          f"(no heartbeat for {now - link.last_heard:.1f} s)")
                try:
                    link.push.send(P.encode(P.Hello(self.frontend_id, pid, not link.welcomed)), zmq.NOBLOCK)
                except zmq.Again:
                    pass
            if not self.ready_links():
                self.ready_event.clear()
            await asyncio.sleep(P.HELLO_INTERVAL_S if self.ready_links() else 0.05)

    async def _reader(self) -> None:
        while True:
            topic, data = await self.sub.recv_multipart()
            try:
                msg = P.decode_pub(data)
            except Exception:
                log.exception("undecodable frame message on topic %r", topic)
                continue
            link = self.links.get(msg.worker_id)
            if link is None:
                continue
            link.last_heard = time.monotonic()
            if isinstance(msg, P.FrameBatch):
                self._on_frames(link, msg)
            elif isinstance(msg, P.Heartbeat):
                if link.welcomed and msg.instance != link.instance:
                    link.welcomed = False  # restarted: handshake again
                    self._fail_link(link, f"Device worker {link.ep.worker_id} restarted")
                elif not msg.ready and link.welcomed and msg.instance == link.instance:
                    # its last word: it is stopping (its requests got 503 frames just before);
                    # new requests go elsewhere or get a 503 now, not after the heartbeat timeout
                    link.welcomed = False
                    log.warning("device worker %s stopped", link.ep.worker_id)
                    self._fail_link(link, f"Device worker {link.ep.worker_id} stopped")
                link.heartbeat = msg
            elif isinstance(msg, P.Stopped):
                if msg.frontend_id == self.frontend_id:
                    self._on_stopped(msg)
            elif isinstance(msg, P.AdapterAnswer):
                if msg.frontend_id == self.frontend_id:
                    self._on_adapter_answer(msg)
            elif isinstance(msg, P.Welcome):
                if msg.frontend_id != self.frontend_id:
                    continue
                if link.instance and msg.instance != link.instance:
                    self._fail_link(link, f"Device worker {link.ep.worker_id} restarted")
                elif link.welcomed and msg.seq != link.expected_seq - 1:
                    # The worker forgot us (we were silent too long) and started counting again.
                    self._fail_link(link, f"Device worker {link.ep.worker_id} dropped this front end's requests "
                                          f"(no Hello for {P.FRONTEND_TIMEOUT_S:.0f} s)")
                    link.welcomed = False
                if not link.welcomed or msg.instance != link.instance:
                    if self.on_welcome is not None:
                        self.on_welcome(msg)
                    if msg.instance != link.instance:
                        link.heartbeat = None  # the old instance's load figures mean nothing now
                    new = msg.instance != link.instance
                    link.instance = msg.instance
                    link.expected_seq = msg.seq + 1
                    link.welcomed = True
                    log.info("device worker %s ready", link.ep.worker_id)
                    if self.first_ready_at is None:
                        self.first_ready_at = time.monotonic()
                    self.ready_event.set()
                    if new and self.on_new_instance is not None:
                        try:
                            self.on_new_instance(link)
                        except Exception:  # noqa: BLE001  (never let a hook stop the reader)
                            log.exception("on_new_instance hook failed for %s", link.ep.worker_id)

    def _on_frames(self, link: WorkerLink, batch: P.FrameBatch) -> None:
        if not link.welcomed or batch.instance != link.instance:
            return  # from before our handshake, or from a dead instance
        if batch.seq != link.expected_seq:
            self.gaps += 1
            lost = batch.seq - link.expected_seq
            link.expected_seq = batch.seq + 1
            self._fail_link(link, f"Lost {lost} frame messages from device worker {link.ep.worker_id} "
                                  f"(sequence gap); the affected requests were aborted")
            return
        link.expected_seq += 1
        for frame in batch.frames:
            stream = link.inflight.get(frame.request_id)
            if stream is None:
                continue  # cancelled here already
            stream._push(frame)
            if stream.finished:
                del link.inflight[frame.request_id]
