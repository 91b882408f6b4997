"""KV transfer between device workers: prefill/decode disaggregation (docs/design.md,
"Disaggregated prefill/decode"; the protocol's names are mindie/contract/pd.py, the HTTP side
mindie/api/pd_role.py).

A prefill worker computes a request's prompt as usual (chunked) and, after every step, PUSHES the
full KV blocks that step completed to the decode worker's KV endpoint (a ROUTER socket every worker
binds: ``WorkerSpec.kv_endpoint``), so the transfer overlaps the prefill. One message per block:

    [KvBlock header (msgpack), K of layer 0, V of layer 0, K of layer 1, ...]

the payload frames sent zero-copy (``copy=False``) from the cache tensors' memory on the CPU, or
staged through host memory on an accelerator (``HostStaging``: the one place a device-to-device
transport would plug in). The header carries the transfer id, a sequence number (gapless from 0),
the block's token ids and a CRC-32 of the payload: a gap, a wrong size or a corrupted frame fails
the transfer loudly. ``KvDone`` ends it; the decode worker answers ``KvAck`` (ok or why not).

Only the blocks a request can reuse are sent: the full blocks before the prompt's last token (the
decode worker computes the rest, under one block and the last token, and samples the first token
itself, so the client's stream comes from one instance and seeded sampling is unchanged).

The decode worker writes each received block into a free block of its own cache and publishes it in
its prefix cache (a block it already holds is reused, the payload dropped). A block that finds every
block in use cuts the transfer: it and those after it are dropped, the transfer is acknowledged all
the same, and the decode request computes the rest of its prompt itself. A decode request
(``Submit.pd.op == "decode"``) is parked until its transfer is complete and its prompt's ids match
the received ones; then it is added as any request, and the prefix cache hands it those blocks.

Addressing: a worker binds its KV endpoint as ``ipc://<runDir>/w<i>-kv.ipc`` (peers on this host)
and, with ``inferMode: dmi`` and ``ServerConfig.interCommPort``, also ``tcp://<host>:<interCommPort+i>``
(``WorkerSpec.kv_tcp_endpoint``: peers on other hosts). A tcp endpoint is a CURVE server with the
workers' keypair (``BackendConfig.workerCurveKeyDir``), clients authenticated by ZAP against
``clients/*.key``; the prefill side connects as a CURVE client with the same workers' keypair and,
as the server key, the decode instance's ``kvCurvePublicKey`` (its /v2/status; the X-Mindie-PD
header) or else its own ``worker.key`` (one fleet, one key directory). A refused handshake (wrong
key either way) fails the transfer at once with a 503 that says so, instead of waiting for the
lease; plain tcp only with ``workerInsecureTcp``.

Leases: the prefill side holds the blocks it still has to send (and those sent) until the Ack, at
most ``kv_lease_ms`` after the prompt finished; the decode side holds received blocks until the
decode request took them, at most ``kv_lease_ms`` after the transfer's last frame (a prefill worker
killed mid-transfer frees them then). A decode request whose transfer failed or did not complete
within ``kv_wait_ms`` follows ``kv_failure_policy``: ``recompute`` (computed here from scratch) or
``fail`` (a 503 frame).
"""
from __future__ import annotations

import logging
import os
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from mindie.contract import wire as P
from mindie.contract.pd import IPC, KV_SCHEMES, TCP
from mindie.runtime.curve import CurveKeyError, insecure_warning, kv_keys, link_mode
from mindie.contract.errors import FINISH_ABORT, FINISH_ERROR
from workers.engine.block_manager import chain_hash

log = logging.getLogger("workers.pd_transfer")

# Handshake outcomes a tcp KV link watches (ZeroMQ socket monitor): a failure ends the transfers on
# that link at once (a CURVE client otherwise retries silently until the lease ends).
_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | \
    zmq.EVENT_HANDSHAKE_FAILED_AUTH


class KvBlock(msgspec.Struct, array_like=True, tag=1):
    transfer_id: str
    seq: int  # 0, 1, 2, ...: the block's index in the prompt
    token_ids: list[int]
    crc: int  # CRC-32 over the payload frames, in order
    nbytes: int  # payload bytes


class KvDone(msgspec.Struct, array_like=True, tag=2):
    transfer_id: str
    blocks: int
    prompt_tokens: int


class KvAbort(msgspec.Struct, array_like=True, tag=3):
    transfer_id: str
    why: str


class KvAck(msgspec.Struct, array_like=True, tag=4):
    transfer_id: str
    ok: bool
    why: str = ""


KvMsg = KvBlock | KvDone | KvAbort | KvAck
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(KvMsg)


def crc_of(buffers) -> int:
    crc = 0
    for b in buffers:
        crc = zlib.crc32(b, crc)
    return crc


class HostStaging:
    """Moves one block between the cache tensors and host memory. On the CPU both ways are views of
    the cache itself (zero-copy out, one copy in); on an accelerator the block is copied to host
    memory first. A device-to-device transport replaces this class."""

    def __init__(self, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor]):
        self.k, self.v = k_cache, v_cache
        self.layers = len(k_cache)
        self.block_bytes = k_cache[0][0].numel() * k_cache[0].element_size()
        # bytes of each frame (layer by layer, K then V): layers may differ (Gemma 4's split cache)
        self.frame_bytes = [c[0].numel() * c.element_size() for c in k_cache for _ in (0, 1)]

    def export(self, block_id: int) -> list[memoryview]:
        out = []
        for layer in range(self.layers):
            for cache in (self.k, self.v):
                t = cache[layer][block_id]
                if t.device.type != "cpu":
                    t = t.to("cpu")  # staged through host memory
                out.append(memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B"))
        return out

    def load(self, block_id: int, frames: list) -> None:
        i = 0
        for layer in range(self.layers):
            for cache in (self.k, self.v):
                dst = cache[layer][block_id]
                src = torch.frombuffer(frames[i], dtype=torch.uint8).view(dst.dtype).view(dst.shape)
                dst.copy_(src)
                i += 1


@dataclass
class _Out:
    """A transfer this (prefill) worker sends."""

    transfer_id: str
    endpoint: str
    seq: object  # the engine's Sequence
    limit: int  # blocks to send
    link: tuple = ()  # (endpoint, CURVE server key or b""): the dealer this transfer goes out on
    next: int = 0
    ids: list[int] = field(default_factory=list)  # held block ids, in order (sent or to send)
    finished: bool = False
    done_sent: bool = False
    frame: P.TokenFrame | None = None  # the request's final frame, held until the Ack
    deadline: float = 0.0  # lease end (monotonic), set when the prompt finished
    bytes: int = 0


@dataclass
class _In:
    """A transfer this (decode) worker receives."""

    transfer_id: str
    ident: bytes
    sock: zmq.Socket | None = None  # the endpoint it arrived on (ipc or tcp): the Ack goes back there
    tokens: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # held block ids
    # Blocks written by this transfer, published in the prefix cache only once it completed (a failed
    # transfer must leave nothing a later request could match): (block id, previous hash, token ids).
    unpublished: list[tuple[int, int | None, tuple[int, ...]]] = field(default_factory=list)
    prev: int | None = None
    next: int = 0  # blocks received and checked
    # The block at which this cache was full (None: every block so far was written): it and the
    # blocks after it are dropped, and the decode worker computes that part of the prompt itself.
    cut: int | None = None
    done: bool = False
    failed: str = ""
    last: float = field(default_factory=time.monotonic)
    adopted_by: str = ""  # the decode request that took the blocks


class KvTransfer:
    """Both sides of KV transfer for one worker; driven by the worker loop (one thread)."""

    def __init__(self, ctx: zmq.Context, engine, endpoint: str, lease_ms: int, wait_ms: int, policy: str,
                 add: Callable[[P.Submit], None], emit: Callable[[str, P.TokenFrame], None],
                 tcp_endpoint: str = "", key_dir: str = "", insecure: bool = False):
        """``endpoint`` the ipc one ("" = none), ``tcp_endpoint`` the tcp one ("" = none): bound with
        CURVE from ``key_dir`` (the worker's ZAP handler must already run on ``ctx``), plain only
        with ``insecure``. Raises ``CurveKeyError`` for a tcp endpoint it must not open."""
        self.ctx, self.engine, self.endpoint, self.tcp_endpoint = ctx, engine, endpoint, tcp_endpoint
        self.key_dir, self.insecure = key_dir, insecure
        self.keys: tuple[bytes, bytes, str] | None = None  # (public, secret, clients dir) of the workers
        self.key_error = ""
        if key_dir:
            try:
                self.keys = kv_keys(key_dir)
            except CurveKeyError as e:
                if tcp_endpoint:
                    raise
                self.key_error = str(e)  # only tcp transfers out are refused, each saying why
        self.lease_s, self.wait_s, self.policy = lease_ms / 1000.0, wait_ms / 1000.0, policy
        self.add, self.emit = add, emit
        self.bm = engine.blocks
        attn = getattr(engine.runner, "attn", None)
        self.staging = HostStaging(attn.k_cache, attn.v_cache) if attn is not None and hasattr(attn, "k_cache") else None
        self.outs: dict[str, _Out] = {}  # by request id
        self.ins: dict[str, _In] = {}  # by transfer id
        self.parked: dict[str, tuple[P.Submit, float]] = {}  # decode requests by transfer id
        self.adopted: dict[str, _In] = {}  # by request id: blocks held until the request took them
        self.dealers: dict[tuple, zmq.Socket] = {}  # by (endpoint, CURVE server key or b"")
        self.monitors: dict[tuple, zmq.Socket] = {}  # their handshake monitors (tcp)
        self.routers: list[zmq.Socket] = []  # where blocks arrive: ipc and/or tcp
        self.router_monitor: zmq.Socket | None = None
        if endpoint and self.staging is not None:
            if endpoint.startswith(IPC):
                path = endpoint[len(IPC):]
                if os.path.exists(path):
                    os.unlink(path)  # a dead predecessor's socket file
            self.routers.append(self._router(endpoint, None))
        if tcp_endpoint and self.staging is not None:
            mode = link_mode(tcp_endpoint, key_dir, insecure)
            if mode == "plain":
                log.warning("%s", insecure_warning(tcp_endpoint))
            sock = self._router(tcp_endpoint, self.keys if mode == "curve" else None)
            self.routers.append(sock)
            # A peer refused by ZAP (its key is not in clients/) is logged here: the decode side's
            # view of a wrong key (the request itself follows kvLoadFailurePolicy).
            self.router_monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED)
            log.info("KV transfer endpoint %s (%s)", tcp_endpoint, "CURVE" if mode == "curve" else "plain tcp")
        engine.finish_hook = self._finished
        # Read by the heartbeat thread: plain ints the loop thread replaces after every poll.
        self.held = 0
        self.active = 0

    def _router(self, endpoint: str, keys: tuple[bytes, bytes, str] | None) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if endpoint.startswith(TCP + "["):
            sock.setsockopt(zmq.IPV6, 1)
        if keys is not None:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys[0])
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys[1])
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            sock.close(0)
            raise SystemExit(f"cannot bind the KV transfer endpoint {endpoint}: {e.strerror} "
                             "(ServerConfig.interCommPort picks the tcp ports)") from None
        return sock

    @property
    def router(self) -> zmq.Socket | None:
        """The first endpoint's socket (None: this worker receives no KV blocks)."""
        return self.routers[0] if self.routers else None

    @property
    def endpoints(self) -> list[str]:
        return [e for e in (self.endpoint, self.tcp_endpoint) if e]

    # -- state ---------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Work the loop must poll for soon (received frames wake it by themselves; the decode side's
        leases are checked at the idle wait's pace, well under a second)."""
        return bool(self.outs or self.parked or self.adopted)

    @property
    def held_blocks(self) -> int:
        return sum(len(o.ids) for o in self.outs.values()) + sum(len(i.ids) for i in self.ins.values()) \
            + sum(len(i.ids) for i in self.adopted.values())

    # -- prefill side --------------------------------------------------------------------------
    def start(self, sub: P.Submit, seq) -> str:
        """A prefill request was added: "" or why it cannot be sent."""
        if self.staging is None:
            return "this device worker cannot export its KV cache (no cache tensors)"
        ep = sub.pd.kv_endpoint
        if ep.startswith(IPC) and not os.path.exists(ep[len(IPC):]):
            return f"KV endpoint {ep} not found (no decode worker listens there)"
        if not ep.startswith(KV_SCHEMES):
            return f"KV endpoint {ep} is not ipc:// or tcp://"
        server_key = b""
        if ep.startswith(TCP):
            try:
                mode = link_mode(ep, self.key_dir, self.insecure)
            except CurveKeyError as e:
                return f"KV endpoint {ep}: {e}"
            if mode == "curve":
                if self.keys is None:
                    return f"KV endpoint {ep}: {self.key_error}"
                server_key = (getattr(sub.pd, "kv_server_key", "") or "").encode() or self.keys[0]
        limit = (len(sub.token_ids) - 1) // self.bm.block_size
        self.outs[sub.request_id] = _Out(sub.pd.transfer_id, ep, seq, limit, (ep, server_key))
        return ""

    def cancel(self, rid: str) -> None:
        """The front end cancelled a request: a parked decode request leaves, a prefill transfer
        that still waits for its Ack ends (its held blocks freed)."""
        for tid, (sub, _) in list(self.parked.items()):
            if sub.request_id == rid:
                del self.parked[tid]
        if rid in self.outs and self.outs[rid].finished:
            self._abort_out(rid, "the prefill request was cancelled")

    def _dealer(self, link: tuple) -> zmq.Socket:
        """The socket to a decode worker's endpoint (one per endpoint and server key, kept)."""
        sock = self.dealers.get(link)
        if sock is None:
            endpoint, server_key = link
            sock = self.dealers[link] = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            if endpoint.startswith(TCP + "["):
                sock.setsockopt(zmq.IPV6, 1)
            if server_key:
                sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
                sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys[0])
                sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys[1])
            if endpoint.startswith(TCP):
                self.monitors[link] = sock.get_monitor_socket(_HANDSHAKE_FAILED)
            sock.connect(endpoint)
        return sock

    def _drop_dealer(self, link: tuple) -> None:
        sock, mon = self.dealers.pop(link, None), self.monitors.pop(link, None)
        if mon is not None:
            sock.disable_monitor()
            mon.close(0)
        if sock is not None:
            sock.close(0)

    def _check_links(self) -> None:
        """Handshake failures on tcp links: every transfer on that link fails now, loudly, and the
        link is dropped (a later transfer connects afresh)."""
        for link, mon in list(self.monitors.items()):
            why = ""
            while True:
                try:
                    ev = recv_monitor_message(mon, zmq.NOBLOCK)
                except zmq.Again:
                    break
                if ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    why = (f"the decode worker at {link[0]} refused this worker's CURVE key (ZAP status "
                           f"{ev['value']}: its BackendConfig.workerCurveKeyDir/clients/ does not hold this "
                           "instance's worker.key)")
                elif ev["event"] & _HANDSHAKE_FAILED and not why:
                    why = (f"CURVE handshake with {link[0]} failed: its public key is not "
                           f"{link[1][:8].decode(errors='replace')}... (kvCurvePublicKey, or this instance's "
                           "workerCurveKeyDir/worker.key), or it is not a CURVE endpoint")
            if not why:
                continue
            log.warning("kv link %s: %s", link[0], why)
            for rid, out in list(self.outs.items()):
                if out.link == link:
                    self._end_out(rid, False, why)
            self._drop_dealer(link)
        if self.router_monitor is not None:
            while True:
                try:
                    ev = recv_monitor_message(self.router_monitor, zmq.NOBLOCK)
                except zmq.Again:
                    break
                log.warning("KV transfer endpoint %s: a peer's handshake failed (%s, status %s): a prefill "
                            "instance with another CURVE key?", self.tcp_endpoint, zmq.Event(ev["event"]).name,
                            ev["value"])

    def _finished(self, seq) -> None:
        """Engine hook: a sequence ends; a prefill transfer holds the blocks it has yet to send."""
        out = self.outs.get(seq.request_id)
        if out is None or out.finished:
            return
        out.finished = True
        if seq.finish_reason == FINISH_ABORT:
            self._abort_out(seq.request_id, "the prefill request was cancelled")
            return
        avail = min(out.limit, seq.num_computed // self.bm.block_size)
        for i in range(len(out.ids), avail):
            self.bm.hold(seq.block_table[i])
            out.ids.append(seq.block_table[i])
        out.limit = avail
        out.deadline = time.monotonic() + self.lease_s

    def hold_frame(self, frame: P.TokenFrame) -> bool:
        """The final frame of a prefill request waits for its transfer's Ack."""
        out = self.outs.get(frame.request_id)
        if out is None:
            return False
        out.frame = frame
        return True

    def _send_blocks(self, rid: str, out: _Out) -> None:
        seq = out.seq
        if not out.finished:
            avail = min(out.limit, seq.num_computed // self.bm.block_size)
            for i in range(len(out.ids), avail):
                self.bm.hold(seq.block_table[i])
                out.ids.append(seq.block_table[i])
        sock = self._dealer(out.link)
        while out.next < len(out.ids):
            i = out.next
            views = self.staging.export(out.ids[i])
            nbytes = sum(v.nbytes for v in views)
            head = KvBlock(out.transfer_id, i, list(seq.tokens[i * self.bm.block_size:(i + 1) * self.bm.block_size]),
                           crc_of(views), nbytes)
            try:
                # Never block the device loop: with no connected peer (a refused CURVE handshake
                # drops the pipe before _check_links reads the monitor, a decode worker gone) a
                # DEALER's send would wait forever. Sent again at the next poll; the monitor or
                # the lease ends the transfer.
                sock.send_multipart([_enc.encode(head), *views], copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            out.bytes += nbytes
            out.next += 1
        if out.finished and not out.done_sent and out.next == out.limit:
            try:
                sock.send(_enc.encode(KvDone(out.transfer_id, out.limit, seq.prompt_len)), zmq.NOBLOCK)
            except zmq.Again:
                return
            out.done_sent = True

    def _abort_out(self, rid: str, why: str) -> None:
        out = self.outs.pop(rid, None)
        if out is None:
            return
        for b in out.ids:
            self.bm.unhold(b)
        try:
            self._dealer(out.link).send(_enc.encode(KvAbort(out.transfer_id, why)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _end_out(self, rid: str, ok: bool, why: str) -> None:
        out = self.outs.pop(rid)
        for b in out.ids:
            self.bm.unhold(b)
        seq = out.seq
        if ok and out.frame is not None:
            self.emit(seq.frontend_id, out.frame)
        elif not ok:
            self.fail(seq.frontend_id, rid, P.request_error(
                503, f"KV transfer {out.transfer_id} to {out.endpoint} failed: {why}"))
        log.info("kv transfer %s: %d blocks, %d bytes to %s: %s", out.transfer_id, out.limit, out.bytes,
                 out.endpoint, "ok" if ok else why)

    def fail(self, fid: str, rid: str, err: P.RequestError) -> None:
        self.emit(fid, P.TokenFrame(rid, finish_reason=FINISH_ERROR, error=err))

    # -- decode side ---------------------------------------------------------------------------
    def park(self, sub: P.Submit) -> None:
        """A decode request waits for its transfer (at most kv_wait_ms)."""
        self.parked[sub.pd.transfer_id] = (sub, time.monotonic() + self.wait_s)

    def _receive(self, sock: zmq.Socket, frames: list) -> None:
        ident, head = frames[0].bytes, frames[1].bytes
        msg = _dec.decode(head)
        if isinstance(msg, KvAck):
            return
        t = self.ins.get(msg.transfer_id)
        if t is None:
            if isinstance(msg, KvAbort) or any(a.transfer_id == msg.transfer_id for a in self.adopted.values()):
                return
            t = self.ins[msg.transfer_id] = _In(msg.transfer_id, ident, sock)
        t.last = time.monotonic()
        if isinstance(msg, KvAbort):
            self._fail_in(t, f"the prefill side gave up: {msg.why}")
            return
        if t.failed:
            if isinstance(msg, KvDone):
                self._ack(t, False, t.failed)
            return
        if isinstance(msg, KvDone):
            if msg.blocks != t.next:
                self._fail_in(t, f"{t.next} blocks received, the prefill side sent {msg.blocks}")
                self._ack(t, False, t.failed)
                return
            for block, prev, ids in t.unpublished:
                self.bm.publish(block, prev, ids)
            t.unpublished = []
            t.done = True
            self._ack(t, True, "")
            return
        payload = [f.buffer for f in frames[2:]]
        bs = self.bm.block_size
        if msg.seq != t.next:
            self._fail_in(t, f"sequence gap: block {msg.seq} arrived, {t.next} expected")
        elif len(payload) != 2 * self.staging.layers or any(
                p.nbytes != n for p, n in zip(payload, self.staging.frame_bytes)):
            self._fail_in(t, f"block {msg.seq}: payload of {len(payload)} frames / {msg.nbytes} bytes does not "
                          f"match this cache's layout ({2 * self.staging.layers} frames of "
                          f"{sorted(set(self.staging.frame_bytes))} bytes)")
        elif crc_of(payload) != msg.crc:
            self._fail_in(t, f"block {msg.seq}: checksum mismatch (corrupted payload)")
        elif len(msg.token_ids) != bs:
            self._fail_in(t, f"block {msg.seq}: {len(msg.token_ids)} token ids, block size is {bs}")
        if t.failed:
            return
        if t.cut is not None:  # the blocks after a cut are of no use: a request's blocks are a prefix
            t.next += 1
            return
        ids = tuple(msg.token_ids)
        h = chain_hash(t.prev, ids)
        have = self.bm.hash_to_block.get(h)
        if have is not None and self.bm.blocks[have].token_ids == ids:
            self.bm.hold(have)  # already in this worker's prefix cache: the payload is dropped
            block = have
        else:
            if self.bm.num_free == 0:
                # Every block is in use (running requests, other transfers): keep what arrived, and
                # the decode request computes the rest as any prompt, when the scheduler admits it
                # (waiting here instead could hold half the cache each for two transfers, forever).
                t.cut = msg.seq
                t.next += 1
                log.info("kv transfer %s: the KV cache is full (all %d blocks in use) at block %d; the decode "
                         "worker computes the prompt from token %d", t.transfer_id, self.bm.num_blocks, msg.seq,
                         msg.seq * bs)
                return
            block = self.bm.take()
            self.staging.load(block, payload)
            t.unpublished.append((block, t.prev, ids))
        t.ids.append(block)
        t.prev = h
        t.tokens.extend(ids)
        t.next += 1

    def _ack(self, t: _In, ok: bool, why: str) -> None:
        try:
            t.sock.send_multipart([t.ident, _enc.encode(KvAck(t.transfer_id, ok, why))], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _fail_in(self, t: _In, why: str) -> None:
        log.warning("kv transfer %s failed: %s", t.transfer_id, why)
        t.failed = why
        t.unpublished = []  # (never published: freed as unhashed blocks, first in line for reuse)
        for b in t.ids:
            self.bm.unhold(b)
        t.ids = []

    # -- the loop's hooks ----------------------------------------------------------------------
    def poll(self, after_step: bool = True) -> None:
        """Between steps: frames in, blocks out, parked requests admitted, leases enforced."""
        for router in self.routers:
            while True:
                try:
                    frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    self._receive(router, frames)
                except Exception:  # a malformed message must never kill the device loop
                    log.exception("bad KV message ignored")
        if self.monitors or self.router_monitor is not None:
            self._check_links()
        for sock in self.dealers.values():
            while True:
                try:
                    ack = _dec.decode(sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                except Exception:
                    log.exception("bad KV answer ignored")
                    continue
                if isinstance(ack, KvAck):
                    rid = next((r for r, o in self.outs.items() if o.transfer_id == ack.transfer_id), None)
                    if rid is not None:
                        self._end_out(rid, ack.ok, ack.why or "refused by the decode worker")
        now = time.monotonic()
        for rid, out in list(self.outs.items()):
            if rid not in self.outs:
                continue
            try:
                self._send_blocks(rid, out)
            except zmq.ZMQError as e:
                out.ids, ids = [], out.ids
                for b in ids:
                    self.bm.unhold(b)
                self.outs.pop(rid)
                self.fail(out.seq.frontend_id, rid, P.request_error(503, f"KV transfer {out.transfer_id}: {e}"))
                continue
            if out.finished and now > out.deadline:
                self._end_out(rid, False, f"no acknowledgement from the decode worker within the lease "
                                          f"(ServerConfig.kvTransferLeaseMs = {self.lease_s * 1000:.0f})")
        for tid, (sub, deadline) in list(self.parked.items()):
            t = self.ins.get(tid)
            why = ""
            if t is not None and t.done:
                n = len(t.tokens)
                if sub.token_ids[:n] != t.tokens or n > len(sub.token_ids) - 1:
                    why = "the transferred token ids differ from this request's prompt"
                    self._fail_in(t, why)
                else:
                    del self.parked[tid]
                    del self.ins[tid]
                    t.adopted_by = sub.request_id
                    self.adopted[sub.request_id] = t
                    self.add(sub)
                    continue
            elif t is not None and t.failed:
                why = t.failed
            elif now > deadline:
                why = (f"not complete within ServerConfig.kvTransferTimeoutMs = {self.wait_s * 1000:.0f} ms"
                       if t is not None else f"never arrived within ServerConfig.kvTransferTimeoutMs = "
                                             f"{self.wait_s * 1000:.0f} ms")
            if not why:
                continue
            del self.parked[tid]
            if t is not None and not t.failed:
                self._fail_in(t, why)  # its blocks freed now (a late frame starts a new lease)
            self.ins.pop(tid, None)
            if self.policy == "recompute":
                log.warning("kv transfer %s of request %s: %s; recomputing the prompt here", tid,
                            sub.request_id, why)
                self.add(sub)
            else:
                self.fail(sub.frontend_id, sub.request_id, P.request_error(
                    503, f"KV transfer {tid} failed: {why}; ServerConfig.kvLoadFailurePolicy is fail"))
        for rid, t in list(self.adopted.items()):
            seq = self.engine.requests.get(rid)
            if seq is None or seq.block_table:  # it holds the blocks itself now (or it ended)
                for b in t.ids:
                    self.bm.unhold(b)
                del self.adopted[rid]
        for tid, t in list(self.ins.items()):
            if tid in self.parked:
                continue
            if t.failed or now - t.last > self.lease_s:
                if not t.failed:
                    log.warning("kv transfer %s: lease expired (%d blocks freed)", tid, len(t.ids))
                    self._fail_in(t, "lease expired")
                if now - t.last > self.lease_s:
                    del self.ins[tid]
        self._count()

    def _count(self) -> None:
        self.held = self.held_blocks
        self.active = len(self.outs) + len(self.ins) + len(self.parked)

    def close(self) -> None:
        for link in list(self.dealers):
            self._drop_dealer(link)
        if self.router_monitor is not None:
            self.routers[-1].disable_monitor()
            self.router_monitor.close(0)
        for router in self.routers:
            router.close(0)
        if self.routers:
            if self.endpoint.startswith(IPC):
                try:
                    os.unlink(self.endpoint[len(IPC):])
                except OSError:
                    pass
