"""The model host: several models' worker groups under one process, loaded on demand.

Started in place of the plain supervisor loop when the launch plan lists several models
(``Deployment.models``; workers/supervisor.py ``main``). Each model is a worker group of its own
(its own ``workers.supervisor.Supervisor``: processes, restarts, start failures; its own ZeroMQ endpoints,
mindie/model_plan.py); front ends talk to its workers directly, as to a single model's, so a
model that loads, drains or unloads never stalls the requests of the others. This process only
decides which groups run, from what the front ends tell it over its ROUTER socket
(mindie/contract/model_wire.py):

- at start it loads the first ``max_loaded`` models (config order) that fit ``max_mem``;
- a model that requests wait for (or ``POST /models/load`` names) and that is not loaded is
  started; when ``max_loaded`` are resident, or its estimated memory (workers/model_memory.py)
  beside theirs would pass ``max_mem`` (``maxLoadedMemSize``), the least recently used loaded model is chosen
  first among the idle ones (no request running), and it is *drained*: front ends send it no
  new request, those running finish, and only then are its processes stopped (a busy model is
  never cut under a request). One eviction at a time; a model stays at least ``MIN_RESIDENT_S``
  so two models wanted in turn do not thrash;
- an idle model past its keep_alive (the config default, or an Ollama request's) is unloaded;
- ``POST /models/unload`` drains and stops one; its answer comes once the processes are gone;
- vLLM's ``POST /sleep`` drains and stops every model (no load while asleep: requests get a 503
  from their front end), ``POST /wake_up`` loads again those that were loaded.

A model whose estimate alone passes ``max_mem`` is refused for good: its requests and loads get
a 503 naming the key, at once. A model that fails to start ``START_ATTEMPTS`` times in a row stops the server when it was one
loaded at start (as a single model's supervisor does); loaded on demand, it goes back to
``unloaded`` with the reason, which the front ends give the requests waiting for it (503).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from mindie.contract import model_wire as W
from mindie.contract.spec import WorkerSpec
from workers.model_memory import GIB, resident_bytes

log = logging.getLogger("workers.model_host")

MIN_RESIDENT_S = 1.0
TICK_S = 0.05


@dataclass
class Hosted:
    """One model's worker group and where it stands."""

    name: str
    specs: list[WorkerSpec]
    sup: Any = None  # the group's workers.supervisor.Supervisor while resident
    state: str = W.UNLOADED
    initial: bool = False  # loaded at start: a start failure stops the server
    ever_loaded: bool = False
    load_started: float = 0.0
    loaded_at: float = 0.0  # monotonic
    loaded_wall: float = 0.0  # time.time()
    load_s: float = 0.0
    last_used: float = 0.0
    error: str = ""
    mem: int = 0  # estimated resident bytes (weights + KV budget of every worker)
    refused: str = ""  # why it is never loaded (alone more than maxLoadedMemSize)
    stopper: threading.Thread | None = None
    load_waiters: list[tuple[bytes, str]] = field(default_factory=list)
    unload_waiters: list[tuple[bytes, str]] = field(default_factory=list)

    @property
    def resident(self) -> bool:
        return self.state != W.UNLOADED

    def pids(self) -> list[int]:
        return [p.pid for c in self.sup.children for p in c.procs] if self.sup else []

    def ready(self) -> bool:
        return self.sup is not None and all(c.ready for c in self.sup.children)


class ModelHost:
    def __init__(self, groups: list[list[WorkerSpec]], max_loaded: int, keep_alive_s: float, endpoint: str,
                 parent: int, run_dir: str, make_group: Callable[..., Any], max_mem_gb: float = 0.0):
        """``make_group(specs, parent, run_dir)``: a worker group's supervisor (workers.supervisor.Supervisor,
        passed in by it: this module is its helper, not the other way round). ``max_mem_gb``:
        maxLoadedMemSize (0 = no bound)."""
        self.make_group = make_group
        self.models = {g[0].model_name: Hosted(g[0].model_name, g, mem=resident_bytes(g)) for g in groups}
        self.order = list(self.models)
        self.max_loaded = max(1, min(max_loaded or len(groups), len(groups)))
        self.max_mem_gb = max(0.0, max_mem_gb)
        self.max_mem = int(self.max_mem_gb * GIB)
        for m in self.models.values():
            if self.max_mem and m.mem > self.max_mem:
                m.refused = m.error = (f"model '{m.name}' needs about {m.mem / GIB:.2f} GiB (weights + KV budget), "
                                       f"more than ModelDeployConfig.maxLoadedMemSize {self.max_mem_gb:g} GiB: "
                                       "it is not loaded")
        self.keep_alive_s = keep_alive_s
        self.endpoint = endpoint
        self.parent = parent
        self.run_dir = run_dir
        self.stopping = False
        self.exit_status = 0
        self.failure = ""
        self.frontends: dict[bytes, tuple[float, W.ModelUse]] = {}
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._last_report = b""
        self._report_at = 0.0
        # vLLM's sleep mode: the level (0 = awake), the models to reload on wake_up, who waits
        self.sleeping = 0
        self.slept: list[str] = []
        self.sleep_waiters: list[tuple[bytes, str]] = []
        self.wake_waiters: list[tuple[bytes, str]] = []

    # -- loading and unloading ---------------------------------------------------------------
    def _load(self, m: Hosted, why: str) -> None:
        m.sup = self.make_group(m.specs, self.parent, self.run_dir)
        m.state, m.error, m.load_started = W.LOADING, "", time.monotonic()
        s = m.specs[0]
        log.info("loading model %s (%s): %d worker(s), %d CPU threads each, KV %s per worker, about %.2f GiB "
                 "resident", m.name, why, len(m.specs), s.threads, f"{s.cpu_mem_gb:g} GiB" if s.device_type == "cpu"
                 else f"{s.npu_mem_gb:g} GB" if s.npu_mem_gb > 0 else "auto", m.mem / GIB)
        m.sup.start()

    def _unload(self, m: Hosted, why: str) -> None:
        sup = m.sup
        m.state = W.UNLOADING
        log.info("unloading model %s (%s): pids %s", m.name, why, m.pids())
        t0 = time.monotonic()

        def stop() -> None:
            if sup is not None:
                sup.stop()
            log.info("model %s unloaded in %.2f s", m.name, time.monotonic() - t0)

        m.stopper = threading.Thread(target=stop, name=f"unload-{m.name}", daemon=True)
        m.stopper.start()

    def _answer(self, waiters: list[tuple[bytes, str]], status: int, message: str = "") -> None:
        for ident, token in waiters:
            if ident:  # b"": a wake_up's own mark, nobody to answer
                self._send(ident, W.ModelAnswer(token, status, message))
        waiters.clear()

    # -- front ends ------------------------------------------------------------------------
    def _send(self, ident: bytes, msg) -> None:
        try:
            self.sock.send_multipart([ident, W.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # that front end is gone

    def _receive(self) -> None:
        while True:
            try:
                ident, data = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = W.decode_to_host(data)
            except Exception:  # noqa: BLE001  (a malformed message is dropped, logged)
                log.warning("undecodable message on the model host's socket")
                continue
            if isinstance(msg, W.ModelUse):
                self.frontends[ident] = (time.monotonic(), msg)
            elif isinstance(msg, W.ModelOrder):
                self._order(ident, msg)

    def _order(self, ident: bytes, msg: W.ModelOrder) -> None:
        if msg.op == "sleep":
            return self._sleep(ident, msg)
        if msg.op == "wake_up":
            return self._wake(ident, msg)
        m = self.models.get(msg.model)
        if m is None:
            return self._send(ident, W.ModelAnswer(msg.token, 404, f"model '{msg.model}' not found"))
        if msg.op == "load":
            if m.refused:
                return self._send(ident, W.ModelAnswer(msg.token, 503, m.refused))
            if m.state == W.LOADED:
                return self._send(ident, W.ModelAnswer(msg.token, 200, "already loaded"))
            m.load_waiters.append((ident, msg.token))
            m.last_used = time.monotonic()
        elif msg.op == "unload":
            if m.state == W.UNLOADED:
                return self._send(ident, W.ModelAnswer(msg.token, 200, "not loaded"))
            m.unload_waiters.append((ident, msg.token))
            if m.state in (W.LOADED, W.LOADING):
                m.state = W.DRAINING if m.state == W.LOADED else m.state
                if m.state == W.LOADING:  # stop a load in progress at once: nothing runs on it yet
                    self._unload(m, "POST /models/unload")

    def _sleep(self, ident: bytes, msg: W.ModelOrder) -> None:
        """vLLM's POST /sleep: every model drained and stopped (both levels: the processes go, with
        their weights and KV cache); those that were loaded come back on wake_up."""
        if not self.sleeping:
            self.slept = [m.name for m in self.models.values() if m.state in (W.LOADING, W.LOADED, W.DRAINING)]
            log.info("sleep (level %d): stopping %s", msg.level, ", ".join(self.slept) or "nothing")
        self.sleeping = max(self.sleeping, msg.level, 1)
        self.sleep_waiters.append((ident, msg.token))
        for m in self.models.values():
            if m.state == W.LOADED:
                m.state = W.DRAINING
            elif m.state == W.LOADING:
                self._unload(m, "sleep")

    def _wake(self, ident: bytes, msg: W.ModelOrder) -> None:
        if not self.sleeping:
            return self._send(ident, W.ModelAnswer(msg.token, 200, "awake"))
        self.sleeping = 0
        self.wake_waiters.append((ident, msg.token))
        for name in self.slept:
            m = self.models[name]
            if m.state == W.UNLOADED:
                self._load(m, "wake_up")
            else:  # still stopping: loaded again once stopped (below, in tick)
                m.load_waiters.append((b"", ""))

    def _sleep_progress(self) -> None:
        if self.sleeping and self.sleep_waiters and all(m.state == W.UNLOADED for m in self.models.values()):
            log.info("asleep (level %d): every model's workers stopped", self.sleeping)
            self._answer(self.sleep_waiters, 200, "asleep")
        if not self.sleeping and self.wake_waiters and all(self.models[n].state == W.LOADED for n in self.slept):
            log.info("awake: %s loaded again", ", ".join(self.slept) or "nothing to load")
            self._answer(self.wake_waiters, 200, "awake")
            self.slept = []

    def _usage(self, now: float) -> tuple[dict[str, int], dict[str, int], dict[str, float]]:
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        keep: dict[str, float] = {}
        for ident, (heard, use) in list(self.frontends.items()):
            if now - heard > W.USE_TIMEOUT_S:
                del self.frontends[ident]  # a front end that died holds nothing
                continue
            for name, n in use.running.items():
                running[name] = running.get(name, 0) + n
            for name, n in use.waiting.items():
                waiting[name] = waiting.get(name, 0) + n
            keep.update(use.keep_alive)
        return running, waiting, keep

    # -- the policy ------------------------------------------------------------------------
    def tick(self) -> None:
        now = time.monotonic()
        running, waiting, keep = self._usage(now)
        for m in self.models.values():
            if running.get(m.name) or waiting.get(m.name):
                m.last_used = now
            if m.state == W.UNLOADING and m.stopper is not None and not m.stopper.is_alive():
                m.state, m.sup, m.stopper = W.UNLOADED, None, None
                self._answer(m.unload_waiters, 200, "unloaded")
            if m.sup is None or m.state == W.UNLOADING:
                continue
            m.sup.poll_once()
            if m.sup.exit_status:
                self._failed(m)
            elif m.state == W.LOADING and m.ready():
                m.state, m.loaded_at, m.loaded_wall, m.last_used = W.LOADED, now, time.time(), now
                m.load_s, m.ever_loaded = now - m.load_started, True
                log.info("model %s loaded in %.2f s (pids %s)", m.name, m.load_s, m.pids())
                self._answer(m.load_waiters, 200, "loaded")
            if m.state == W.DRAINING and not running.get(m.name):
                self._unload(m, "evicted" if not m.unload_waiters else "POST /models/unload")
        if not self.sleeping:
            self._admit(now, running, waiting)
        self._sleep_progress()
        for m in self.models.values():  # keep_alive
            ka = keep.get(m.name, self.keep_alive_s)
            if (m.state == W.LOADED and ka >= 0 and not running.get(m.name) and not waiting.get(m.name)
                    and not m.load_waiters and now - m.last_used >= ka):
                self._unload(m, f"idle for its keep_alive of {ka:g} s")
        self._report(now, running, keep)

    def fits(self, m: Hosted) -> bool:
        """Can ``m`` be loaded beside the resident models (maxLoadedModels, maxLoadedMemSize)?"""
        resident = [x for x in self.models.values() if x.resident]
        return len(resident) < self.max_loaded and (
            not self.max_mem or sum(x.mem for x in resident) + m.mem <= self.max_mem)

    def _admit(self, now: float, running: dict[str, int], waiting: dict[str, int]) -> None:
        """Start the models requests wait for, evicting one when the resident ones are at a bound
        (one eviction at a time: a load that needs the room of several evicts them in turn)."""
        for m in sorted(self.models.values(), key=lambda x: x.last_used):
            if m.state != W.UNLOADED or not (waiting.get(m.name) or m.load_waiters):
                continue
            if m.refused:  # front ends fail its requests from the report; a load order is answered here
                self._answer(m.load_waiters, 503, m.refused)
                continue
            if self.fits(m):
                self._load(m, "requested")
                continue
            if any(x.state in (W.DRAINING, W.UNLOADING) for x in self.models.values()):
                return  # an eviction is under way: its room goes to the first one waiting
            victims = [x for x in self.models.values() if x.state == W.LOADED and now - x.loaded_at >= MIN_RESIDENT_S
                       and not waiting.get(x.name) and not x.load_waiters]
            if not victims:
                return
            victim = min(victims, key=lambda x: (bool(running.get(x.name)), x.last_used))
            victim.state = W.DRAINING
            log.info("evicting model %s (least recently used%s) to load %s (maxLoadedModels %d%s)", victim.name,
                     ", idle" if not running.get(victim.name) else f", draining {running[victim.name]} request(s)",
                     m.name, self.max_loaded, f", maxLoadedMemSize {self.max_mem_gb:g} GiB" if self.max_mem else "")
            if not running.get(victim.name):
                self._unload(victim, "evicted")
            return

    def _failed(self, m: Hosted) -> None:
        why = m.sup.failure if m.sup else "failed"
        if m.initial and not m.ever_loaded:
            self.failure, self.exit_status, self.stopping = why, m.sup.exit_status, True
            return
        log.error("model %s failed to load: %s", m.name, why)
        m.error = why
        self._answer(m.load_waiters, 503, f"model '{m.name}' failed to load: {why}")
        self._unload(m, "its start failed")

    def _report(self, now: float, running: dict[str, int], keep: dict[str, float]) -> None:
        states = {}
        for m in self.models.values():
            ka = keep.get(m.name, self.keep_alive_s)
            idle = not running.get(m.name)
            expires = (time.time() + max(0.0, ka - (now - m.last_used)) if idle else time.time() + ka) \
                if m.state == W.LOADED and ka >= 0 else 0.0
            s = m.specs[0]
            states[m.name] = W.ModelState(
                state=m.state, pids=m.pids(), loaded_at=m.loaded_wall if m.state == W.LOADED else 0.0,
                load_s=m.load_s, expires_at=round(expires), running=running.get(m.name, 0), threads=s.threads,
                kv_gb=s.cpu_mem_gb if s.device_type == "cpu" else float(s.npu_mem_gb), error=m.error,
                refused=bool(m.refused), mem_gb=round(m.mem / GIB, 3))
        data = W.encode(W.ModelReport(states, self.max_loaded, self.sleeping, self.max_mem_gb))
        if data == self._last_report and now < self._report_at:
            return
        self._last_report, self._report_at = data, now + W.USE_INTERVAL_S
        for ident in self.frontends:
            try:
                self.sock.send_multipart([ident, data], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    # -- process ---------------------------------------------------------------------------
    def load_at_start(self) -> None:
        """The first ``max_loaded`` models, those of them that fit ``max_mem`` (config order)."""
        for name in self.order[:self.max_loaded]:
            m = self.models[name]
            if m.refused:
                log.error("%s", m.refused)
            elif self.fits(m):
                m.initial = True
                self._load(m, "at start")
            else:
                log.warning("model %s not loaded at start: beside those loaded it would pass "
                            "ModelDeployConfig.maxLoadedMemSize %g GiB (loaded on demand)", name, self.max_mem_gb)

    def run(self) -> None:
        self.sock.bind(self.endpoint)
        self.load_at_start()
        log.info("model host: %d models (%s), at most %d loaded at once%s, keep_alive %s; control socket %s",
                 len(self.models), ", ".join(f"{n} ~{self.models[n].mem / GIB:.2f} GiB" for n in self.order),
                 self.max_loaded, f" and {self.max_mem_gb:g} GiB (maxLoadedMemSize)" if self.max_mem else "",
                 "for good" if self.keep_alive_s < 0 else f"{self.keep_alive_s:g} s", self.endpoint)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stopping:
            if poller.poll(TICK_S * 1000):
                self._receive()
            self.tick()
            if os.getppid() != self.parent:
                log.error("launcher (pid %d) is gone: stopping", self.parent)
                break
        self.stop()
        if self.failure:
            log.error("%s: the server stops (supervisor exit status %d)", self.failure, self.exit_status)

    def stop(self) -> None:
        """Stop every model's workers (in parallel: each group gets its own grace period)."""
        self.stopping = True
        threads = [threading.Thread(target=m.sup.stop, daemon=True) for m in self.models.values()
                   if m.sup is not None and m.state != W.UNLOADING]
        threads += [m.stopper for m in self.models.values() if m.stopper is not None]
        for t in threads:
            if not t.is_alive() and t.ident is None:
                t.start()
        for t in threads:
            t.join()
        self.sock.close(0)
        self.ctx.term()
