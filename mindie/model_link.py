"""A front end's link to the model host (workers/model_host.py), several models.

The front end tells the host, over a DEALER socket, how many of its requests run on each model
and how many wait for one to load (``ModelUse``, its whole view each time); the host answers with
every model's state (``ModelReport``). A request ``acquire``s its model before it is dispatched:
at once when the model is loaded and its workers welcomed this front end, else it waits (counted
as waiting, which makes the host load the model) until then, bounded by the caller's timeout;
``release`` when it ends. A model being drained for eviction takes no new request: they wait for
its reload. Messages: mindie/contract/model_wire.py.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from mindie.contract import model_wire as W

log = logging.getLogger("mindie.model_link")


class ModelUnavailable(Exception):
    """The model could not be loaded in time, or its load failed (HTTP 503)."""


class ModelLink:
    def __init__(self, endpoint: str, frontend_id: str, ready: Callable[[str], bool]):
        """``ready(name)``: whether this front end has a welcomed worker of that model."""
        self.endpoint = endpoint
        self.frontend_id = frontend_id
        self.ready = ready
        self.running: collections.Counter[str] = collections.Counter()
        self.waiting: collections.Counter[str] = collections.Counter()
        self.keep_alive: dict[str, float] = {}
        self.states: dict[str, W.ModelState] = {}
        self.max_loaded = 0
        self.max_mem_gb = 0.0  # the host's maxLoadedMemSize (0 = no bound)
        self.sleeping = 0  # the model host's sleep level (vLLM's sleep mode), 0 = awake
        self.last_report = 0.0  # time.monotonic() of the host's last report
        self._changed = asyncio.Event()
        self._answers: dict[str, asyncio.Future] = {}
        self.ctx = zmq.asyncio.Context()
        self.sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, f"{self.frontend_id}-{secrets.token_hex(2)}".encode())
        self.sock.connect(self.endpoint)
        self._tasks = [asyncio.create_task(self._reader(), name="model-link-reader"),
                       asyncio.create_task(self._ticker(), name="model-link-ticker")]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.sock is not None:
            self.sock.close(0)
        self.ctx.destroy(linger=0)

    def host_alive(self) -> bool:
        """The model host reports (it can load a model on demand)."""
        return time.monotonic() - self.last_report < W.USE_TIMEOUT_S

    def state(self, name: str) -> str:
        s = self.states.get(name)
        return s.state if s else W.UNLOADED

    def loaded(self, name: str) -> bool:
        return self.state(name) == W.LOADED

    # -- requests ----------------------------------------------------------------------------
    async def acquire(self, name: str, timeout: float, keep_alive: float | None = None) -> None:
        """Count a request on ``name``, once the model is loaded and ready here (waits, making
        the host load it, up to ``timeout`` s); ``ModelUnavailable`` if it is not by then or its
        load failed. Pair with ``release``."""
        if keep_alive is None:  # as Ollama: each request sets it, the default when it names none
            self.keep_alive.pop(name, None)
        else:
            self.keep_alive[name] = keep_alive
        if self.sleeping:
            raise ModelUnavailable("The server is sleeping (POST /wake_up wakes it)")
        self._check_refused(name)
        if self.loaded(name) and self.ready(name):
            self.running[name] += 1
            self._send_use()
            return
        t0 = time.monotonic()
        deadline = t0 + timeout
        self.waiting[name] += 1
        self._send_use()
        seen_loading = False
        try:
            while not (self.loaded(name) and self.ready(name)):
                if self.sleeping:
                    raise ModelUnavailable("The server is sleeping (POST /wake_up wakes it)")
                self._check_refused(name)
                st = self.states.get(name)
                seen_loading = seen_loading or (st is not None and st.state == W.LOADING)
                if seen_loading and st is not None and st.state in (W.UNLOADING, W.UNLOADED) and st.error:
                    raise ModelUnavailable(f"model '{name}' failed to load: {st.error}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ModelUnavailable(f"model '{name}' was not loaded within {timeout:g} s "
                                           f"(state {self.state(name)})")
                self._changed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(left, 0.05))
            self.running[name] += 1
        finally:
            self.waiting[name] -= 1
            self._send_use()
        if time.monotonic() - t0 > 0.05:
            log.info("request waited %.2f s for model %s to load", time.monotonic() - t0, name)

    def _check_refused(self, name: str) -> None:
        """A model the host never loads (alone more than maxLoadedMemSize): fail at once, not
        after the request's whole timeout."""
        st = self.states.get(name)
        if st is not None and st.refused:
            raise ModelUnavailable(st.error)

    def release(self, name: str) -> None:
        self.running[name] -= 1
        self._send_use()

    async def order(self, op: str, name: str, timeout: float, level: int = 1) -> W.ModelAnswer:
        """``POST /models/load`` / ``unload`` / ``sleep`` / ``wake_up``: the host's answer once done
        (504 after ``timeout`` s)."""
        token = secrets.token_hex(8)
        fut = asyncio.get_running_loop().create_future()
        self._answers[token] = fut
        try:
            await self.sock.send(W.encode(W.ModelOrder(self.frontend_id, token, op, name, level)))
            answer = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return W.ModelAnswer(token, 504, f"model '{name}': {op} did not finish within {timeout:g} s")
        finally:
            self._answers.pop(token, None)
        end = time.monotonic() + timeout
        names = [name] if op == "load" else [n for n, st in self.states.items() if st.state == W.LOADED] \
            if op == "wake_up" else []
        # loaded: wait for this front end's own link to it (its Welcome) and the host's report
        while answer.status == 200 and time.monotonic() < end and (
                not all(self.ready(n) for n in names) or (op == "sleep") != bool(self.sleeping)):
            await asyncio.sleep(0.02)
        return answer

    # -- background ----------------------------------------------------------------------------
    def _send_use(self) -> None:
        if self.sock is None:
            return
        use = W.ModelUse(self.frontend_id, {k: v for k, v in self.running.items() if v},
                         {k: v for k, v in self.waiting.items() if v}, dict(self.keep_alive))
        with contextlib.suppress(zmq.ZMQError):
            self.sock.send(W.encode(use), zmq.NOBLOCK)

    async def _ticker(self) -> None:
        while True:
            self._send_use()
            await asyncio.sleep(W.USE_INTERVAL_S)

    async def _reader(self) -> None:
        while True:
            data = await self.sock.recv()
            try:
                msg = W.decode_to_frontend(data)
            except Exception:  # noqa: BLE001
                log.warning("undecodable message from the model host")
                continue
            if isinstance(msg, W.ModelReport):
                self.states, self.max_loaded, self.sleeping = msg.models, msg.max_loaded, msg.sleeping
                self.max_mem_gb = msg.max_mem_gb
                self.last_report = time.monotonic()
                self._changed.set()
            elif isinstance(msg, W.ModelAnswer):
                fut = self._answers.get(msg.token)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
