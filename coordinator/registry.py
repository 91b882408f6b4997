"""The instances the coordinator routes to, and the poller that keeps their state.

An instance comes from ``instances`` in the config or from ``POST /v1/instances/refresh``. Each
poll (``http_config.pollIntervalMs``) asks every instance's management plane for ``/health``
(200 = its workers are ready) and ``/v2/status`` (free slots, free KV blocks, waiting and
running requests); ``/v1/config`` (model name, KV block size) and
``/v2/models/{m}/getSlotCount`` (total slots) once, and again after the instance was away; the
role an instance reports in ``/v2/status`` (and a decode instance's KV endpoints) each poll
(coordinator/pd_pairing.py). A refused
or reset poll makes an instance unreachable at once; a poll that times out (a busy instance
answers late) only the third time in a row. An
instance is *ready* (routable) when its last poll succeeded, it is online (not taken out by
``/v1/instances/offline``) and its circuit breaker (coordinator/breaker.py) lets requests
through. A restarted coordinator rebuilds this view from the config and one poll; instances
added by ``refresh`` are the caller's to send again (MindIE's Controller re-sends its view).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import httpx

from coordinator.breaker import Breaker
from coordinator.pd_pairing import role_from_status

log = logging.getLogger("mindie.coordinator.registry")

POLL_TIMEOUTS_DOWN = 3  # polls in a row that time out before a ready instance counts as unreachable


@dataclass
class Instance:
    id: int
    ip: str
    business_port: int
    mgmt_port: int
    metric_port: Optional[int] = None  # None: /metrics is on the management port
    model_name: str = ""
    source: str = "config"  # config | refresh
    static_info: dict = field(default_factory=dict)  # as refresh sent it
    online: bool = True  # False after /v1/instances/offline
    polled_ok: bool = False  # the last poll answered and /health said 200
    seen: bool = False  # a poll ever succeeded
    why_not: str = "not polled yet"
    total_slots: int = 0
    avail_slots: int = 0
    total_blocks: int = 0
    avail_blocks: int = 0
    waiting: int = 0
    running: int = 0
    block_size: int = 128
    inflight: int = 0  # requests this coordinator has on it now
    poll_timeouts: int = 0  # polls in a row that timed out
    inflight_at_poll: int = 0  # ours when the last /v2/status was asked (its running + waiting include them)
    breaker: Breaker = field(default_factory=lambda: Breaker(3, 5.0))
    scheme: str = "http"
    mgmt_scheme: str = "http"
    role_given: str = ""  # from the record (instances[].role, refresh static_info); "" = not given
    role_reported: str = ""  # what the instance's /v2/status says (wins); "" = says nothing
    kv_endpoints: list = field(default_factory=list)  # a decode instance's KV endpoints (/v2/status pd)
    kv_curve_key: str = ""
    handoffs: int = 0  # handoffs sent to it as the decode side (round robin over its endpoints)

    @property
    def role(self) -> str:
        """prefill | decode | flex (coordinator/pd_pairing.py)."""
        return self.role_reported or self.role_given or "flex"

    @property
    def host(self) -> str:
        return f"[{self.ip}]" if ":" in self.ip else self.ip

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.business_port}"

    @property
    def mgmt_url(self) -> str:
        return f"{self.mgmt_scheme}://{self.host}:{self.mgmt_port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.mgmt_scheme}://{self.host}:{self.metric_port or self.mgmt_port}/metrics"

    def ready(self, now: Optional[float] = None) -> bool:
        return self.online and self.polled_ok and self.breaker.allows(now)

    def state(self) -> str:
        if not self.online:
            return "offline"
        if not self.polled_ok:
            return "unreachable" if self.seen else "starting"
        return {"closed": "ready", "open": "isolated", "half_open": "probing"}[self.breaker.state()]

    def describe(self) -> dict:
        return {"id": self.id, "ip": self.ip, "business_port": self.business_port, "mgmt_port": self.mgmt_port,
                "model_name": self.model_name, "state": self.state(), "source": self.source,
                "role": self.role, "kv_endpoints": self.kv_endpoints,
                "avail_slots_num": self.avail_slots, "total_slots_num": self.total_slots,
                "avail_block_num": self.avail_blocks, "total_block_num": self.total_blocks,
                "waiting": self.waiting, "running": self.running, "inflight": self.inflight,
                "breaker": self.breaker.state(), "why_not_ready": "" if self.ready() else self.why_not}


class Registry:
    """id -> Instance; every change goes through here so readiness changes are logged once."""

    def __init__(self, breaker_failures: int, breaker_open_s: float, business_tls: bool, mgmt_tls: bool,
                 max_instances: int) -> None:
        self.instances: dict[int, Instance] = {}
        self.breaker_failures = breaker_failures
        self.breaker_open_s = breaker_open_s
        self.scheme = "https" if business_tls else "http"
        self.mgmt_scheme = "https" if mgmt_tls else "http"
        self.max_instances = max_instances
        self.listeners: list[Callable[[Instance, bool], None]] = []
        self._was_ready: dict[int, bool] = {}

    def add(self, inst: Instance) -> Instance:
        inst.breaker = Breaker(self.breaker_failures, self.breaker_open_s)
        inst.scheme, inst.mgmt_scheme = self.scheme, self.mgmt_scheme
        old = self.instances.get(inst.id)
        if old is not None and (old.ip, old.business_port, old.mgmt_port) == (inst.ip, inst.business_port,
                                                                              inst.mgmt_port):
            # the same endpoint sent again (refresh): keep what the poller knows
            old.model_name = inst.model_name or old.model_name
            old.static_info = inst.static_info or old.static_info
            old.role_given = inst.role_given or old.role_given
            old.source = inst.source
            return old
        self.instances[inst.id] = inst
        log.info("instance %d added (%s): business %s, management %s", inst.id, inst.source, inst.base_url,
                 inst.mgmt_url)
        return inst

    def remove(self, iid: int) -> None:
        inst = self.instances.pop(iid, None)
        if inst is not None:
            self._was_ready.pop(iid, None)
            log.info("instance %d removed (%s)", iid, inst.base_url)

    def ready(self) -> list[Instance]:
        now = time.monotonic()
        return [i for i in self.instances.values() if i.ready(now)]

    def note(self) -> None:
        """Log readiness changes (called after each poll and each breaker change)."""
        now = time.monotonic()
        for inst in self.instances.values():
            r = inst.ready(now)
            if self._was_ready.get(inst.id) != r:
                self._was_ready[inst.id] = r
                if r:
                    log.info("instance %d %s ready: %d free slots, %d free blocks", inst.id, inst.base_url,
                             inst.avail_slots, inst.avail_blocks)
                else:
                    log.warning("instance %d %s not ready: %s", inst.id, inst.base_url, inst.state()
                                if inst.state() != "unreachable" else inst.why_not)
                for cb in self.listeners:
                    cb(inst, r)


class Poller:
    """Polls every instance's management plane each ``interval_s``."""

    def __init__(self, registry: Registry, client: httpx.AsyncClient, interval_s: float,
                 http_timeout_s: float = 600) -> None:
        self.registry = registry
        self.client = client
        self.interval_s = interval_s
        # a poll that takes longer than this says "unreachable" (a hung instance must not stall polling)
        self.timeout_s = min(5.0, max(1.0, 2 * interval_s), http_timeout_s or 5.0)
        self._task: Optional[asyncio.Task] = None
        self.polls = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="coordinator-poller")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            try:
                await self.poll_all()
            except asyncio.CancelledError:
                raise
            except Exception:  # a poll bug must not end polling
                log.exception("poll failed")
            await asyncio.sleep(self.interval_s)

    async def poll_all(self) -> None:
        insts = list(self.registry.instances.values())
        if insts:
            await asyncio.gather(*(self.poll(i) for i in insts))
        self.polls += 1
        self.registry.note()

    async def poll(self, inst: Instance) -> None:
        t = self.timeout_s
        asked_with = inst.inflight
        try:
            health, status = await asyncio.gather(self.client.get(f"{inst.mgmt_url}/health", timeout=t),
                                                  self.client.get(f"{inst.mgmt_url}/v2/status", timeout=t))
            if not inst.seen or not inst.model_name or not inst.total_slots:
                conf = await self.client.get(f"{inst.mgmt_url}/v1/config", timeout=t)
                if conf.status_code == 200:
                    c = conf.json()
                    inst.model_name = c.get("modelName") or inst.model_name
                    inst.block_size = int(c.get("cacheBlockSize") or inst.block_size)
                if inst.model_name:
                    slots = await self.client.get(f"{inst.mgmt_url}/v2/models/{inst.model_name}/getSlotCount",
                                                  timeout=t)
                    if slots.status_code == 200:
                        inst.total_slots = int(slots.json().get("total_slots") or 0)
        except httpx.TimeoutException as e:
            # a busy instance answers its management plane late: not ready only after a few in a row
            inst.poll_timeouts += 1
            if inst.poll_timeouts < POLL_TIMEOUTS_DOWN and inst.polled_ok:
                return
            inst.polled_ok = False
            inst.why_not = f"management plane {inst.mgmt_url} did not answer within {t:g} s ({inst.poll_timeouts} polls)"
            if inst.breaker.probe_due():
                inst.breaker.failure()
            return
        except (httpx.HTTPError, ValueError, OSError) as e:  # refused, reset: down now
            inst.polled_ok = False
            inst.why_not = f"management plane {inst.mgmt_url} unreachable: {type(e).__name__}: {e}".rstrip(": ")
            if inst.breaker.probe_due():
                inst.breaker.failure()
            return
        if status.status_code == 200:
            try:
                res = status.json().get("resource", {})
                inst.avail_slots = int(res.get("availSlotsNum", 0))
                inst.avail_blocks = int(res.get("availBlockNum", 0))
                inst.total_blocks = int(res.get("totalNpuBlockNums", 0)) or inst.total_blocks
                inst.waiting = int(res.get("waitingRequestNum", 0))
                inst.running = int(res.get("runningRequestNum", 0))
                inst.inflight_at_poll = asked_with
            except (ValueError, AttributeError, TypeError):
                pass
            try:
                role, eps, key = role_from_status(status.json())
            except ValueError:
                role, eps, key = "", [], ""
            if role != inst.role_reported and (role or inst.role_reported):
                log.info("instance %d %s role %s", inst.id, inst.base_url, role or inst.role_given or "flex")
            inst.role_reported, inst.kv_endpoints, inst.kv_curve_key = role, eps, key
        inst.poll_timeouts = 0
        ok = health.status_code == 200
        inst.seen = inst.seen or ok
        inst.polled_ok = ok
        inst.why_not = "" if ok else f"/health answered {health.status_code}"
        if inst.breaker.probe_due():
            inst.breaker.success() if ok else inst.breaker.failure()
