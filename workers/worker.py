"""Device worker process: one device, one engine, two ZeroMQ sockets.

Loop: drain the job socket without blocking (Submit / Cancel / Hello) -> one engine step ->
publish one FrameBatch per front end with new tokens. With step overlap (EngineConfig.overlap) the
step is launched first and computes on the engine's compute thread while the loop drains jobs
and publishes the previous step's frames. When idle it waits on the job socket for at most half
a heartbeat interval; heartbeats come from their own thread.

Run by the supervisor as ``python -m workers.worker --spec '<json>'``.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

from mindie.contract import wire as P
from mindie.runtime.curve import CurveKeyError, insecure_warning, kv_keys, link_mode, worker_keys
from mindie.contract.errors import FINISH_ABORT, FINISH_ERROR, UnknownAdapterError
from mindie.runtime.gc_freeze import freeze_heap
from mindie.runtime.lifecycle import lock_file
from mindie.runtime.log_setup import setup_logging
from mindie.runtime.start_report import StartReport
from mindie.contract.spec import WorkerSpec, decode_spec

from workers.backends.core_share import CoreShare
from workers.backends.step_width import StepThreads, narrow_threads_alone
from workers.models.config import ModelArgs
from workers.engine.assembly import build
from workers.engine.engine import CapacityError, ConstraintRefused, Engine, InFlight
from workers.pd_transfer import KvTransfer
from workers.tp_rank import follow

log = logging.getLogger("workers.worker")


@dataclass
class FrontendState:
    seq: int = 0  # last FrameBatch sequence number sent to this front end
    last_hello: float = field(default_factory=time.monotonic)
    requests: set[str] = field(default_factory=set)


def _lock_endpoint(endpoint: str) -> int | None:
    """A second bind on an ipc path silently steals it; a lock file makes it an error. Returns
    the descriptor holding the lock (None for a non-ipc endpoint)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://"):] + ".lock"
    fd = lock_file(path)
    if fd is None:
        raise SystemExit(f"another process already serves {endpoint} (lock {path} is held)")
    return fd


def _unlink_endpoint(endpoint: str, lock: int | None) -> None:
    """After a clean stop: remove the socket file and then the lock file of an endpoint whose lock
    this process still holds (nobody else can be bound there), then drop the lock."""
    if lock is None:
        return
    path = endpoint[len("ipc://"):]
    for p in (path, path + ".lock"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
    os.close(lock)


def link_security(spec: WorkerSpec) -> tuple[str, tuple[bytes, bytes, str] | None]:
    """("ipc" | "curve" | "plain", the CURVE keys (public, secret, allowed clients' dir) or None).
    Exits with the reason for a tcp endpoint without keys and without the insecure flag, or for
    unusable key files (mindie/runtime/curve.py)."""
    try:
        modes = {link_mode(ep, spec.curve_key_dir, spec.insecure_tcp) for ep in (spec.job_endpoint, spec.pub_endpoint)}
        mode = "curve" if "curve" in modes else "plain" if "plain" in modes else "ipc"
        return mode, worker_keys(spec.curve_key_dir) if mode == "curve" else None
    except CurveKeyError as e:
        raise SystemExit(f"worker {spec.worker_id} refuses to start: {e}") from None


def _bind(sock: zmq.Socket, endpoint: str, keys: tuple[bytes, bytes, str] | None) -> None:
    """Bind ``sock``, as a CURVE server when ``keys`` are given (tcp); a bind error exits with
    the endpoint named (a tcp port in use raises EADDRINUSE, nothing else guards it)."""
    if endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    if keys is not None and endpoint.startswith("tcp://"):
        public, secret, _ = keys
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        why = ("address already in use (another worker or program holds this port: BackendConfig.workerPort "
               "picks the ports)" if e.errno == errno.EADDRINUSE else e.strerror)
        raise SystemExit(f"cannot bind {endpoint}: {why}") from None


def _max_positions(spec: WorkerSpec, runner) -> int:
    """The model's max_position_embeddings as ModelArgs parsed it (the null model: its checkpoint's,
    when it has one); 0 = unknown (the front end then does not check it)."""
    args = getattr(getattr(runner, "model", None), "args", None)
    if args is None and spec.model_path:
        try:
            args = ModelArgs.from_dir(spec.model_path)
        except Exception:  # noqa: BLE001  (the null model may serve a directory of any kind)
            args = None
    return int(getattr(args, "max_position_embeddings", 0) or 0)


class Worker:
    def __init__(self, spec: WorkerSpec, tp_store: str = ""):
        self.spec = spec
        self.exit_code = 0
        self.instance = secrets.token_hex(6)
        self.stop = False
        self.stop_reason = "stopping"  # said in the error frames of requests a stop ends
        self.frontends: dict[str, FrontendState] = {}
        mode, keys = link_security(spec)  # before the model loads: a refused link fails fast
        t0 = time.perf_counter()
        built = build(spec, tp_store=tp_store)  # workers/engine/assembly.py
        self.engine: Engine = built.engine
        self.device = built.device
        self.group = built.group  # this process is rank 0 of a tensor-parallel instance
        self.max_positions = _max_positions(spec, self.engine.runner)
        self.t_built = time.monotonic()  # the engine's counters start here (Heartbeat.uptime_s)
        if self.engine.grammars is not None:
            # llguidance builds its tokenizer holding the GIL, seconds on end for a large vocabulary
            # (Gemma 3's 262k tokens: 9 s of 24 on a busy host), which would stop the heartbeat
            # thread and get a serving worker declared dead: built before the worker is ready
            self.engine.grammars.wait_tokenizer()
        freeze_heap(log, f"worker {spec.worker_id}", spec.engine.gc_freeze)
        self._locks = [_lock_endpoint(spec.job_endpoint), _lock_endpoint(spec.pub_endpoint)]
        self.ctx = zmq.Context()
        self.auth = None
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 0)  # jobs are small; never drop one
        self.pub = self.ctx.socket(zmq.PUB)
        # PUB drops silently at the HWM; sequence numbers detect it. High enough that it
        # takes a front end stalled for many seconds at full load to reach it.
        self.pub.setsockopt(zmq.SNDHWM, 200_000)
        self.pub.setsockopt(zmq.LINGER, 0)
        try:
            if keys is not None:
                # ZAP: only front ends whose public key is in clients/ complete the handshake.
                self.auth = ThreadAuthenticator(self.ctx, log=logging.getLogger("workers.worker.zap"))
                self.auth.start()
                self.auth.configure_curve(domain="*", location=keys[2])
                log.info("worker links: CURVE, front ends allowed by the public keys in %s", keys[2])
            elif mode == "plain":
                log.warning("%s", insecure_warning(spec.job_endpoint))
            _bind(self.pull, spec.job_endpoint, keys)
            _bind(self.pub, spec.pub_endpoint, keys)
        except BaseException:
            self._close_sockets()
            raise
        # Prefill/decode disaggregation: this worker's KV endpoint (workers/pd_transfer.py).
        self.kv: KvTransfer | None = None
        if (spec.kv_endpoint or spec.kv_tcp_endpoint) and self.group is None:
            try:
                if spec.kv_tcp_endpoint and spec.kv_curve_key_dir and self.auth is None:
                    # ZAP for the tcp KV endpoint: peers whose public key is in clients/ (the workers' own
                    # key is there: prefill workers of the fleet authenticate with it).
                    _, _, clients = kv_keys(spec.kv_curve_key_dir)
                    self.auth = ThreadAuthenticator(self.ctx, log=logging.getLogger("workers.worker.zap"))
                    self.auth.start()
                    self.auth.configure_curve(domain="*", location=clients)
                self.kv = KvTransfer(self.ctx, self.engine, spec.kv_endpoint, spec.kv_lease_ms, spec.kv_wait_ms,
                                     spec.kv_failure_policy, self._add_parked, self._emit,
                                     tcp_endpoint=spec.kv_tcp_endpoint, key_dir=spec.kv_curve_key_dir,
                                     insecure=spec.insecure_tcp)
            except CurveKeyError as e:
                self._close_sockets()
                raise SystemExit(f"worker {spec.worker_id} refuses to start its KV transfer endpoint: {e}") from None
            except BaseException:
                self._close_sockets()
                raise
        self.poller = zmq.Poller()
        self.poller.register(self.pull, zmq.POLLIN)
        for router in self.kv.routers if self.kv is not None else ():
            self.poller.register(router, zmq.POLLIN)
        # The PUB socket is shared with the heartbeat thread: every send holds this lock
        # (ZeroMQ sockets may change threads only behind a full memory barrier).
        self.pub_lock = threading.Lock()
        self.heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self.pending: dict[str, list[P.TokenFrame]] = {}
        self.idle_wait_ms = int(P.HEARTBEAT_INTERVAL_S * 1000 / 2)
        self._last_load: tuple[int, int, int] = (0, 0, 0)
        self._listing: tuple = ()
        self._infos: list[P.AdapterInfo] = []
        self.cores = None
        self.step_threads = None
        if spec.device_type == "cpu" and not spec.null_model:
            adaptive = spec.engine.cpu.adaptive_threads
            if spec.core_share_file:
                self.cores = CoreShare(spec.core_share_file, spec.worker_index, spec.num_workers, max(1, spec.threads))
                self.step_threads = StepThreads(self.cores, adaptive=adaptive)
            elif narrow_threads_alone(spec):
                self.step_threads = StepThreads(threads=spec.threads)
            if self.step_threads is not None:
                log.info("step width: %s", self.step_threads.describe())
        # Last: "ready" only once the sockets are bound too (a port in use fails the start).
        log.info("worker %s ready in %.2f s (model %s, vocab %d)", spec.worker_id, time.perf_counter() - t0,
                 spec.model_name, self.engine.runner.vocab_size)

    # -- messages ---------------------------------------------------------------------------
    def _frontend(self, fid: str) -> FrontendState:
        st = self.frontends.get(fid)
        if st is None:
            st = self.frontends[fid] = FrontendState()
            log.info("front end %s connected", fid)
        return st

    def _welcome(self, fid: str, st: FrontendState) -> None:
        # What the front end checks requests against: the model as this worker parsed it.
        self._send(fid.encode(), P.Welcome(self.spec.worker_id, self.instance, fid, st.seq,
                                           self.engine.runner.vocab_size, self.max_positions))
        # Our load right behind it: the front end's status routes count this worker at once.
        self._send_heartbeat()

    def _emit(self, fid: str, frame: P.TokenFrame) -> None:
        self.pending.setdefault(fid, []).append(frame)

    def _fail(self, fid: str, request_id: str, err: P.RequestError) -> None:
        self._emit(fid, P.TokenFrame(request_id, finish_reason=FINISH_ERROR, error=err))

    def _add_parked(self, msg: P.Submit) -> None:
        """A decode request whose KV transfer arrived (or failed, with the recompute policy)."""
        self._add(msg, self.frontends.get(msg.frontend_id) or self._frontend(msg.frontend_id))

    def handle(self, msg: P.JobMessage) -> None:
        if isinstance(msg, P.Submit):
            known = msg.frontend_id in self.frontends
            st = self._frontend(msg.frontend_id)
            if not known:
                self._welcome(msg.frontend_id, st)
            if msg.pd is not None and msg.pd.op == "decode":
                if self.kv is None:
                    self._fail(msg.frontend_id, msg.request_id,
                               P.request_error(503, "this device worker has no KV endpoint (PD decode refused)"))
                    return
                st.requests.add(msg.request_id)
                self.kv.park(msg)  # added once its KV blocks arrived (workers/pd_transfer.py)
                return
            self._add(msg, st)
        elif isinstance(msg, P.Cancel):
            st = self.frontends.get(msg.frontend_id)
            for rid in msg.request_ids:
                if self.kv is not None:
                    self.kv.cancel(rid)
                if self.engine.abort(rid) is not None and st is not None:
                    st.requests.discard(rid)
        else:
            self._handle_other(msg)

    def _add(self, msg: P.Submit, st: FrontendState) -> None:
        """Queue a request on the engine (a prefill request also starts its KV transfer)."""
        try:
            seq = self.engine.add(msg)
        except CapacityError as e:
            self._fail(msg.frontend_id, msg.request_id, P.request_error(424, str(e)))
        except UnknownAdapterError as e:  # unloaded since the front end saw it listed
            self._fail(msg.frontend_id, msg.request_id, P.request_error(404, str(e)))
        except ConstraintRefused as e:  # a constraint known bad (cached) or not enforceable here
            self._fail(msg.frontend_id, msg.request_id, P.request_error(e.status, str(e)))
        except Exception as e:  # a request the front end should not have sent (AssertionError)
            log.error("request %s refused: %s", msg.request_id, e)
            self._fail(msg.frontend_id, msg.request_id, P.request_error(500, f"Request refused by the device worker: {e}"))
        else:
            st.requests.add(msg.request_id)
            if msg.pd is not None and msg.pd.op == "prefill":
                why = "this device worker has no KV cache to send" if self.kv is None else self.kv.start(msg, seq)
                if why:
                    self.engine.abort(msg.request_id)
                    self._fail(msg.frontend_id, msg.request_id, P.request_error(503, why))

    def _handle_other(self, msg: P.JobMessage) -> None:
        if isinstance(msg, P.Stop):
            self._stop_user(msg)
        elif isinstance(msg, P.LoadAdapter):
            answer = self.engine.lora.begin_load(msg.name, msg.path, (msg.frontend_id, msg.token))
            if answer is not None:
                self._answer([answer])
        elif isinstance(msg, P.UnloadAdapter):
            self._answer([self.engine.lora.unload(msg.name, (msg.frontend_id, msg.token))])
        elif isinstance(msg, P.Hello):
            known = msg.frontend_id in self.frontends
            st = self._frontend(msg.frontend_id)
            st.last_hello = time.monotonic()
            # An unknown front end always gets a Welcome: if it was reaped while silent, the
            # new sequence start tells it that its requests here are gone.
            if msg.want_welcome or not known:
                self._welcome(msg.frontend_id, st)

    def _stop_user(self, msg: P.Stop) -> None:
        """stopInfer: end the named requests now (their blocks are freed by ``abort``), give
        each owner a final frame, and answer the asker whether any was found."""
        found = self.engine.with_user_id(msg.user_id)
        for seq in found:
            self.engine.abort(seq.request_id)
            st = self.frontends.get(seq.frontend_id)
            if st is not None:
                st.requests.discard(seq.request_id)
            self._emit(seq.frontend_id, P.TokenFrame(seq.request_id, finish_reason=FINISH_ABORT))
        if found:
            log.info("stopInfer %r: ended %d request(s)", msg.user_id, len(found))
            self.publish()  # at once, not after the step that may be computing
        self._send(msg.frontend_id.encode(), P.Stopped(self.spec.worker_id, msg.frontend_id, msg.token, len(found)))

    def _answer(self, answers) -> None:
        """Answers to LoRA loads and unloads, each to its asker; a heartbeat first, so every front
        end lists the change before the asker's client hears of it."""
        self._send_heartbeat()
        for a in answers:
            fid, token = a.reply
            self._send(fid.encode(), P.AdapterAnswer(self.spec.worker_id, fid, token, a.status, a.message))

    def poll_lora(self) -> None:
        """Between steps: LoRA reads done (answers sent, waiting requests scheduled, requests whose
        adapter could not be read failed), and grammars compiled (their requests scheduled, or
        failed with a 400 when the constraint did not compile)."""
        answers, failed = self.engine.poll_lora()
        if answers:
            self._answer(answers)
        for out in failed + self.engine.poll_constraints():
            self._fail(out.seq.frontend_id, out.seq.request_id, P.request_error(out.error_status, out.error))

    def _idle_wait_ms(self) -> int:
        """How long an idle loop waits for jobs: shorter while a LoRA read or a grammar's compile is
        in progress (its requests and its answer wait for the next poll)."""
        return 5 if self.engine.lora_busy or self.engine.grammar_busy else self.idle_wait_ms

    def drain(self, timeout_ms: int) -> None:
        if self.kv is not None:
            if self.kv.busy:
                timeout_ms = min(timeout_ms, 2)  # transfers and leases move between steps
            ready = dict(self.poller.poll(timeout_ms))
            self.kv.poll()
            if self.pull not in ready:
                return
        elif not self.pull.poll(timeout_ms):
            return
        while True:
            try:
                data = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self.handle(P.decode_job(data))
            except Exception:  # a malformed job must never kill the device loop
                log.exception("bad job message (%d bytes) ignored", len(data))

    # -- housekeeping -----------------------------------------------------------------------
    def reap(self) -> None:
        """Cancel the requests of front ends whose Hellos stopped."""
        now = time.monotonic()
        for fid, st in list(self.frontends.items()):
            if now - st.last_hello > P.FRONTEND_TIMEOUT_S:
                for rid in st.requests:
                    if self.kv is not None:
                        self.kv.cancel(rid)  # a decode request still waiting for its KV blocks
                    self.engine.abort(rid)
                log.warning("front end %s silent for %.1f s: cancelled its %d requests", fid,
                            now - st.last_hello, len(st.requests))
                del self.frontends[fid]

    def publish(self) -> None:
        for fid, frames in self.pending.items():
            st = self.frontends.get(fid)
            if st is None:
                continue  # front end gone; its requests were cancelled
            for f in frames:
                if f.finish_reason:
                    st.requests.discard(f.request_id)
            st.seq += 1
            self._send(fid.encode(), P.FrameBatch(self.spec.worker_id, self.instance, st.seq, frames))
        self.pending.clear()

    def _send(self, topic: bytes, msg: P.Message) -> None:
        data = P.encode(msg)
        with self.pub_lock:
            self.pub.send_multipart([topic, data])

    def heartbeat(self) -> P.Heartbeat:
        """This worker's load and counters, as front ends see them (/v1/status, /metrics), and the
        LoRA adapters requests may name."""
        eng, bm = self.engine, self.engine.blocks
        return P.Heartbeat(
            self.spec.worker_id, self.instance, self.device, os.getpid(), self.spec.model_name,
            eng.num_running, eng.num_waiting, bm.num_free, bm.num_blocks, eng.scheduler.num_preemptions,
            bm.hit_rate, bm.block_size, eng.steps, True, eng.cfg.max_batch_size, eng.prompt_tokens,
            eng.generated_tokens, eng.ttft_ms.mean, eng.tbt_ms.mean, eng.num_swapped, eng.scheduler.num_decode_holds,
            self._adapter_infos(), self.kv.held if self.kv is not None else 0,
            self.kv.active if self.kv is not None else 0, eng.speculator.drafts, eng.speculator.draft_tokens,
            eng.speculator.accepted_tokens, list(eng.speculator.accepted_per_pos),
            time.monotonic() - self.t_built)

    def _adapter_infos(self) -> list[P.AdapterInfo]:
        """``Heartbeat.adapters``, rebuilt only when the manager's listing changed (the heartbeat
        thread reads the listing, a tuple the loop thread replaces whole)."""
        lora = self.engine.lora
        listing = lora.listing if lora is not None else ()
        if listing is not self._listing:
            self._infos = [P.AdapterInfo(name, path) for name, path in listing]
            self._listing = listing
        return self._infos

    def _send_heartbeat(self) -> None:
        self._last_load = self._load()
        self._send(P.HEARTBEAT_TOPIC, self.heartbeat())

    def _load(self) -> tuple[int, int, int]:
        return self.engine.num_running, self.engine.num_waiting, self.engine.blocks.num_free

    def _heartbeat_if_changed(self) -> None:
        """A heartbeat right after a step that changed the load, so /metrics, /v1/status and the
        front ends' dispatch are never more than one step behind (the timed ones alone would
        leave a finished request "running" for up to a heartbeat interval)."""
        if self._load() != self._last_load:
            self._send_heartbeat()

    def _heartbeat_loop(self) -> None:
        """Heartbeats from their own thread, so a long engine step (a big prefill on CPU) never
        looks like a dead worker. Torch releases the GIL while it computes."""
        while not self.stop:
            try:
                self._send_heartbeat()
            except zmq.ZMQError:
                return  # socket closed: shutting down
            time.sleep(P.HEARTBEAT_INTERVAL_S)

    # -- main loop --------------------------------------------------------------------------
    def run(self) -> None:
        log.info("worker %s serving: jobs %s, frames %s", self.spec.worker_id, self.spec.job_endpoint,
                 self.spec.pub_endpoint)
        self.heartbeat_thread.start()
        try:
            while not self.stop:
                if self.engine.overlap:
                    self._iterate_overlapped()
                else:
                    self._iterate()
        except BaseException as e:
            self.stop_reason = f"failed: {type(e).__name__}"
            raise
        finally:
            self.stop = True
            self.heartbeat_thread.join(2 * P.HEARTBEAT_INTERVAL_S)
            try:
                self.farewell()
            except Exception:  # best effort: the front ends' heartbeat timeout still ends them
                log.exception("worker %s: farewell frames not sent", self.spec.worker_id)
            self.close()

    def farewell(self) -> None:
        """Stopping: every request this worker holds (running, waiting, parked for its KV blocks,
        or still queued on the jobs socket) ends now with a 503 error frame, and a last heartbeat
        says ``ready=False``, so front ends answer at once (a coordinator retries a 503 elsewhere)
        instead of waiting out the heartbeat timeout for a worker that is gone."""
        why = (f"Device worker {self.spec.worker_id} stopped ({self.stop_reason}) before the request "
               "finished")
        err = P.request_error(503, why)
        while True:  # jobs that arrived while the last step computed
            try:
                msg = P.decode_job(self.pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            except Exception:
                continue  # undecodable: nothing to answer
            if isinstance(msg, P.Submit):
                self._frontend(msg.frontend_id)  # publish() sends only to front ends it knows
                self._fail(msg.frontend_id, msg.request_id, err)
            elif isinstance(msg, P.Cancel):
                st = self.frontends.get(msg.frontend_id)
                if st is not None:
                    st.requests.difference_update(msg.request_ids)
        self.publish()  # frames already due go out first, and their requests leave st.requests
        ended = 0
        for fid, st in self.frontends.items():
            for rid in st.requests:
                self._fail(fid, rid, err)
                ended += 1
        self.publish()
        self._send(P.HEARTBEAT_TOPIC, msgspec.structs.replace(self.heartbeat(), ready=False))
        if ended:
            log.warning("worker %s stopping: %d unfinished request(s) ended with a 503 frame", self.spec.worker_id,
                        ended)

    def _iterate(self) -> None:
        """Jobs in, one step computed, its frames out."""
        busy = self.engine.has_work()
        if not busy:
            self._set_busy(False)  # before the idle wait: siblings may borrow our cores meanwhile
        self.drain(0 if busy else self._idle_wait_ms())
        self.reap()
        self.poll_lora()
        flight = self._launch() if self._set_busy(self.engine.has_work()) else None
        if flight is not None:
            self._collect(flight)
        elif self.group is not None:
            self._keepalive()
        self.publish()
        self._heartbeat_if_changed()

    def _iterate_overlapped(self) -> None:
        """Step launched first; while it computes on the compute thread, jobs come in and the
        previous step's frames go out (ZeroMQ and msgpack release or barely need the GIL)."""
        # Jobs that arrived during the last step join the next one (without this they would wait
        # a step more than in the sequential loop: the other drain runs after the launch).
        self.drain(0)
        self.poll_lora()
        flight = self._launch() if self._set_busy(self.engine.has_work()) else None
        if flight is None and self.pending:
            self.publish()  # error frames of a failed launch go out before an idle wait
        if flight is None and self.group is not None:
            self._keepalive()
        self.drain(0 if flight is not None else self._idle_wait_ms())
        self.reap()
        self.publish()
        if flight is not None:
            self._collect(flight)
            # Right away rather than after the next launch: a finished request's last frame
            # (and an idle worker's only frames) must not wait for another step.
            if not self.engine.has_work():
                self.publish()
            self._heartbeat_if_changed()

    def _set_busy(self, busy: bool) -> bool:
        if self.cores is not None:
            self.cores.set_busy(busy)
        return busy

    def _launch(self) -> InFlight | None:
        try:
            st = self.step_threads
            return self.engine.launch(before=None if st is None else st.before, after=None if st is None else st.after)
        except Exception as e:
            self._fail_all(e)
            return None

    def _collect(self, flight: InFlight) -> None:
        try:
            outputs = self.engine.collect(flight)
        except Exception as e:
            self._fail_all(e)
            return
        finally:
            if self.cores is not None:
                self.cores.release()  # borrowed cores back to their idle owners after every step
        for out in outputs:
            seq = out.seq
            if out.error:  # its constraint could not be followed (workers/engine/constraints.py)
                self._fail(seq.frontend_id, seq.request_id, P.request_error(out.error_status, out.error))
                continue
            frame = P.TokenFrame(seq.request_id, out.token_ids, out.finish_reason, out.prefill_ms, out.decode_ms,
                                 logprobs=out.logprobs, top_logprobs=out.top_logprobs,
                                 prompt_logprobs=out.prompt_logprobs, spec_draft=out.spec_draft,
                                 spec_accepted=out.spec_accepted, embedding=out.embedding,
                                 cached_tokens=out.cached_tokens)
            if self.kv is not None and self.kv.hold_frame(frame):
                continue  # a prefill request's frame waits for its KV transfer's Ack
            self._emit(seq.frontend_id, frame)
        if self.kv is not None:
            self.kv.poll()  # the blocks this step completed go out now (transfer overlaps prefill)

    def _keepalive(self) -> None:
        try:
            self.group.keepalive()
        except Exception as e:
            self._fail_all(e)

    def _fail_all(self, e: Exception) -> None:
        """One bad batch must not take the worker down: end this worker's requests with errors.
        In a tensor-parallel instance the ranks may now be out of step (one raised before a
        collective the others wait in): the frames go out and the worker exits, so that the
        supervisor restarts the whole group."""
        log.error("engine step failed: aborting the %d requests of this worker", len(self.engine.requests),
                  exc_info=e)
        err = P.request_error(500, f"Device step failed: {type(e).__name__}: {e}")
        for rid, seq in list(self.engine.requests.items()):
            self.engine.abort(rid)
            self._fail(seq.frontend_id, rid, err)
        if self.group is not None:
            self.publish()
            log.error("tensor-parallel instance %s cannot go on: exiting so that its group restarts",
                      self.spec.worker_id)
            self.stop_reason = "its tensor-parallel group broke"
            self.stop = True
            self.exit_code = 3

    def close(self) -> None:
        """Stop cleanly: the compute thread, the sockets, then this worker's files in the run
        directory (its two ipc sockets and their locks; the shared cores.busy and the rest are
        the launcher's to remove once every process stopped)."""
        self.engine.close()
        if self.group is not None and not self.exit_code:
            self.group.stop()
        if self.cores is not None:
            self.cores.close()
        self._close_sockets()
        log.info("worker %s stopped", self.spec.worker_id)

    def _close_sockets(self) -> None:
        if getattr(self, "kv", None) is not None:
            self.kv.close()
        self.pull.close(0)
        self.pub.close(300)  # up to 0.3 s to flush the farewell frames (their subscribers are local)
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        self.ctx.term()
        for endpoint, lock in zip((self.spec.job_endpoint, self.spec.pub_endpoint), self._locks):
            _unlink_endpoint(endpoint, lock)
        self._locks = [None, None]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="MindIE-py device worker (started by the supervisor).")
    ap.add_argument("--spec", required=True, help="WorkerSpec as JSON (mindie/contract/spec.py)")
    ap.add_argument("--rank", type=int, default=0, help="rank in a tensor-parallel instance (0 = the worker)")
    ap.add_argument("--tp-store", default="", help="rendezvous file of a tensor-parallel instance")
    ap.add_argument("--start-report-fd", type=int, default=None,
                    help="pipe on which to report 'ready' or why the start failed (mindie/runtime/start_report.py)")
    args = ap.parse_args(argv)
    report = StartReport(args.start_report_fd)
    spec = decode_spec(args.spec)
    from workers import settings
    settings.apply(spec.engine)  # the plan's engine and CPU tuning, for the modules that read them
    if args.rank > 0:
        setup_logging(f"worker {spec.worker_id} rank {args.rank} pid {os.getpid()}", spec.log_level)
        code = 3
        try:
            code = follow(spec, args.rank, args.tp_store, ready=report.ready)
        except BaseException as e:
            report.failed(e)  # ignored once ready: then this is a failure while serving
            log.exception("rank %d of instance %s failed", args.rank, spec.worker_id)
        logging.shutdown()
        os._exit(code)  # no interpreter teardown: a broken process group may hang in it
    setup_logging(f"worker {spec.worker_id} pid {os.getpid()}", spec.log_level)
    log.debug("spec: %s", args.spec)
    try:
        worker = Worker(spec, args.tp_store)
    except BaseException as e:
        # The supervisor counts this as a start failure and logs the reason (workers/supervisor.py).
        report.failed(e)
        raise
    report.ready()

    def _stop(signum, _frame):
        log.info("signal %s: stopping", signal.Signals(signum).name)
        worker.stop_reason = f"signal {signal.Signals(signum).name}"
        worker.stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    worker.run()
    if worker.exit_code:
        # A broken tensor-parallel group: its sockets are closed and its frames sent; exit now
        # rather than risk the process group's teardown hanging at interpreter exit.
        logging.shutdown()
        os._exit(worker.exit_code)


if __name__ == "__main__":
    main()
