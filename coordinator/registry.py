"""The instances the coordinator routes to, and the poller that keeps their state.

An instance comes from ``instances`` in the config or from ``POST /v1/instances/refresh``. Before
it is routed to it is *admitted* (coordinator/admission_check.py): its management plane must
answer the server's own routes in the server's shape, serving the model the refresh named, and
it must not be this coordinator. Each poll asks an admitted instance's management plane for
``/health`` (200 = its workers are ready) and ``/v2/status`` (free slots, free KV blocks, waiting
and running requests; the role it reports and a decode instance's KV endpoints, coordinator/pd_pairing.py;
which of its models are loaded, coordinator/model_index.py);
admission also reads ``/v1/config`` (model name, KV block size),
``/v2/models/{m}/getSlotCount`` (total slots), ``/v1/models`` and ``/api/tags`` (every model it
serves: coordinator/model_index.py), again after the instance was away. A refused or
reset poll makes an instance unreachable at once; a poll that times out (a busy instance answers
late) only the third time in a row. An instance is *ready* (routable) when its last poll
succeeded, it is online (not taken out by ``/v1/instances/offline``) and its circuit breaker
(coordinator/breaker.py) lets requests through. A restarted coordinator rebuilds this view from
the config and one poll; instances added by ``refresh`` are the caller's to send again (MindIE's
Controller re-sends its view).

Polling (``Poller``) is per instance, concurrent and bounded, so that no number of unreachable,
hung or refused endpoints slows user requests or the polls of the instances that serve:

- an answering instance is polled every ``pollIntervalMs``, at most ``POLL_CONCURRENCY`` at once;
- every other one (new, unreachable, refused) is polled apart: at most ``PROBE_CONCURRENCY`` at
  once and ``PROBES_PER_S`` started a second however many there are (instances that served before
  first, then new ones, then those never admitted, each by due time), first with a bare TCP
  connect (a closed port costs one refused connect); one never admitted backs off (doubling, at
  most ``BACKOFF_MAX_S``);
- each poll has its own deadline (min(5 s, 2 x ``pollIntervalMs``, ``http_timeout_seconds``) for
  all its calls together), and a failure of one (a bug, an odd answer) is that instance's only.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import httpx
import msgspec

from coordinator.admission_check import (ConfigShape, ModelsShape, Refused, SlotsShape, StatusShape,
                                         check_health, shaped, tcp_probe)
from coordinator.breaker import Breaker
from coordinator.model_index import ModelIndex, listed, loaded_names
from coordinator.pd_pairing import role_from_status

log = logging.getLogger("mindie.coordinator.registry")

POLL_TIMEOUTS_DOWN = 3  # polls in a row that time out before a ready instance counts as unreachable
POLL_CONCURRENCY = 32  # polls of answering instances in flight at once
PROBE_CONCURRENCY = 16  # polls of the others (new, unreachable, refused) in flight at once
PROBES_PER_S = 250.0  # polls of the others started per second, however many they are
BACKOFF_MAX_S = 5.0  # an instance never admitted that keeps failing is still tried this often
ADDED_LOGGED = 20  # a refresh logs this many added instances one by one, then a count


@dataclass
class Instance:
    id: int
    ip: str
    business_port: int
    mgmt_port: int
    metric_port: Optional[int] = None  # None: /metrics is on the management port
    model_name: str = ""  # the first model it serves (its /v1/config)
    models: dict = field(default_factory=dict)  # every model it serves: id -> its /v1/models item (model_index.py)
    tags: dict = field(default_factory=dict)  # the same as Ollama's /api/tags lists them: name -> its item
    loaded: Optional[frozenset] = None  # the models loaded or loading there (None: all it serves; model_index.py)
    source: str = "config"  # config | refresh
    static_info: dict = field(default_factory=dict)  # as refresh sent it
    online: bool = True  # False after /v1/instances/offline
    seen: bool = False  # ever admitted
    admitted: bool = False  # passed the admission check and reachable since (admission_check.py)
    refused: str = ""  # why the admission check refused it ("" = not refused)
    reached: bool = False  # the last poll reached a server (/health answered 200 or 503)
    model_expected: str = ""  # the model the refresh routed to it ("" = any)
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
    bad_polls: int = 0  # polls in a row that did not find it answering (the back-off)
    inflight_at_poll: int = 0  # ours when the last /v2/status was asked (its running + waiting include them)
    breaker: Breaker = field(default_factory=lambda: Breaker(3, 5.0))
    scheme: str = "http"
    mgmt_scheme: str = "http"
    role_given: str = ""  # from the record (instances[].role, refresh static_info); "" = not given
    role_reported: str = ""  # what the instance's /v2/status says (wins); "" = says nothing
    kv_endpoints: list = field(default_factory=list)  # a decode instance's KV endpoints (/v2/status pd)
    kv_curve_key: str = ""
    handoffs: int = 0  # handoffs sent to it as the decode side (round robin over its endpoints)
    # the poller's bookkeeping
    polling: bool = field(default=False, repr=False)
    next_due: float = field(default=0.0, repr=False)
    polled_at: float = field(default=0.0, repr=False)  # monotonic time its last poll ended (0: never)
    gen: int = field(default=0, repr=False)  # its current entry in the poller's queues
    _ok: bool = field(default=False, repr=False)
    _index: Optional[dict] = field(default=None, repr=False, compare=False)  # Registry._ok

    @property
    def polled_ok(self) -> bool:
        """The last poll answered and /health said 200."""
        return self._ok

    @polled_ok.setter
    def polled_ok(self, ok: bool) -> None:
        # the registry keeps the answering instances apart: routing scans them, not every record
        self._ok = ok
        if self._index is not None:
            if ok:
                self._index[self.id] = self
            else:
                self._index.pop(self.id, None)

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
        if self.refused:
            return "refused"
        if not self.polled_ok:
            return "unreachable" if self.seen else "starting"
        return {"closed": "ready", "open": "isolated", "half_open": "probing"}[self.breaker.state()]

    def describe(self) -> dict:
        return {"id": self.id, "ip": self.ip, "business_port": self.business_port, "mgmt_port": self.mgmt_port,
                "model_name": self.model_name, "models": list(self.models), "state": self.state(),
                "loaded": list(self.models) if self.loaded is None else sorted(self.loaded),
                "source": self.source,
                "role": self.role, "kv_endpoints": self.kv_endpoints,
                "avail_slots_num": self.avail_slots, "total_slots_num": self.total_slots,
                "avail_block_num": self.avail_blocks, "total_block_num": self.total_blocks,
                "waiting": self.waiting, "running": self.running, "inflight": self.inflight,
                "breaker": self.breaker.state(), "why_not_ready": "" if self.ready() else self.why_not,
                # project extension: how fresh this view is (None: not polled yet)
                "last_poll_ms_ago": round((time.monotonic() - self.polled_at) * 1000) if self.polled_at else None}


class Registry:
    """id -> Instance; every change goes through here so readiness changes are logged once."""

    def __init__(self, breaker_failures: int, breaker_open_s: float, business_tls: bool, mgmt_tls: bool,
                 max_instances: int) -> None:
        self.instances: dict[int, Instance] = {}
        self._ok: dict[int, Instance] = {}  # those whose last poll answered (Instance.polled_ok)
        self.breaker_failures = breaker_failures
        self.breaker_open_s = breaker_open_s
        self.scheme = "https" if business_tls else "http"
        self.mgmt_scheme = "https" if mgmt_tls else "http"
        self.max_instances = max_instances
        self.listeners: list[Callable[[Instance, bool], None]] = []
        self.on_add: list[Callable[[Instance], None]] = []  # the poller schedules a new instance
        self._was_ready: dict[int, bool] = {}
        self.models = ModelIndex()  # model name -> how many instances list it

    def set_models(self, inst: Instance, models: dict) -> None:
        """What ``inst`` serves now (its admission read it), counted in the model index while
        ``inst`` is the registered record of its id."""
        if self.instances.get(inst.id) is inst:
            self.models.change(inst.models, models)
        inst.models = models

    def add(self, inst: Instance, quiet: bool = False) -> Instance:
        inst.breaker = Breaker(self.breaker_failures, self.breaker_open_s)
        inst.scheme, inst.mgmt_scheme = self.scheme, self.mgmt_scheme
        old = self.instances.get(inst.id)
        if old is not None and (old.ip, old.business_port, old.mgmt_port) == (inst.ip, inst.business_port,
                                                                              inst.mgmt_port):
            # the same endpoint sent again (refresh): keep what the poller knows
            old.model_name = inst.model_name or old.model_name
            if inst.model_expected != old.model_expected:
                old.model_expected = inst.model_expected
                old.admitted = False  # its next poll checks the model it is now routed for
            old.static_info = inst.static_info or old.static_info
            old.role_given = inst.role_given or old.role_given
            old.source = inst.source
            return old
        if old is not None:
            self.models.change(old.models, ())
            old.polled_ok = False  # replaced: out of the routing index, and detached from it (a
            old._index = None  # poll of it still in flight must not put it back under this id)
            self._was_ready.pop(inst.id, None)
        self.instances[inst.id] = inst
        inst._index = self._ok
        inst.polled_ok = inst.polled_ok
        if not quiet:
            log.info("instance %d added (%s): business %s, management %s", inst.id, inst.source, inst.base_url,
                     inst.mgmt_url)
        for cb in self.on_add:
            cb(inst)
        return inst

    def remove(self, iid: int, quiet: bool = False) -> None:
        inst = self.instances.pop(iid, None)
        if inst is not None:
            self.models.change(inst.models, ())
            inst.polled_ok = False
            inst._index = None
            self._was_ready.pop(iid, None)
            if not quiet:
                log.info("instance %d removed (%s)", iid, inst.base_url)

    def ready(self) -> list[Instance]:
        now = time.monotonic()
        return [i for i in self._ok.values() if i.ready(now)]

    def note(self) -> None:
        """Log readiness changes (called after each breaker change, offline/online)."""
        now = time.monotonic()
        for inst in list(self.instances.values()):
            self.note_one(inst, now)

    def note_one(self, inst: Instance, now: Optional[float] = None) -> None:
        """Log a readiness change of ``inst`` (called after each of its polls)."""
        r = inst.ready(now)
        if self._was_ready.get(inst.id) != r:
            self._was_ready[inst.id] = r
            if r:
                log.info("instance %d %s ready: %d free slots, %d free blocks", inst.id, inst.base_url,
                         inst.avail_slots, inst.avail_blocks)
            elif not inst.refused:  # a refusal has its own line (Poller._refuse)
                log.warning("instance %d %s not ready: %s", inst.id, inst.base_url, inst.state()
                            if inst.state() != "unreachable" else inst.why_not)
            for cb in self.listeners:
                cb(inst, r)


class Poller:
    """Polls every instance's management plane: answering instances each ``interval_s``, the
    others apart, within a budget (module docstring)."""

    def __init__(self, registry: Registry, client: httpx.AsyncClient, interval_s: float,
                 http_timeout_s: float = 600, business: Optional[httpx.AsyncClient] = None,
                 own: Optional[list[tuple[str, int, str]]] = None) -> None:
        self.registry = registry
        self.client = client
        self.business = business or client  # for an instance whose business plane has its own port
        self.own = own or []  # this coordinator's listeners (ip, port, name): never an instance
        self.interval_s = interval_s
        # a poll that takes longer than this says "unreachable" (a hung instance must not stall polling)
        self.timeout_s = min(5.0, max(1.0, 2 * interval_s), http_timeout_s or 5.0)
        self._task: Optional[asyncio.Task] = None
        self.polls = 0
        self._tick = min(interval_s, 0.05)
        self._kick: Optional[asyncio.Event] = None
        # the instances not answering, by class: served before, new, never admitted; (due, n, gen, id)
        self._queues: tuple[list, list, list] = ([], [], [])
        self._seq = itertools.count()
        self._busy_ok = 0
        self._busy_other = 0
        self._tokens = PROBES_PER_S * self._tick
        self._tokens_at = time.monotonic()
        self._direct: Optional[asyncio.Semaphore] = None
        self._tasks: set[asyncio.Task] = set()
        registry.on_add.append(self._added)
        for inst in registry.instances.values():
            self._added(inst)

    # -- scheduling ------------------------------------------------------------------------------
    def _added(self, inst: Instance) -> None:
        inst.next_due = 0.0
        self._queue(inst, time.monotonic())
        if self._kick is not None:
            self._kick.set()

    def _queue(self, inst: Instance, due: float) -> None:
        inst.gen += 1
        cls = 0 if inst.seen else 1 if inst.bad_polls == 0 and not inst.refused else 2
        heapq.heappush(self._queues[cls], (due, next(self._seq), inst.gen, inst.id))

    def kick(self) -> None:
        """Look for due polls now (a refresh added instances)."""
        if self._kick is not None:
            self._kick.set()

    def start(self) -> None:
        self._kick = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name="coordinator-poller")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _loop(self) -> None:
        assert self._kick is not None
        while True:
            try:
                self._dispatch()
            except Exception:  # a scheduling bug must not end polling
                log.exception("poll scheduling failed")
            self._kick.clear()
            try:
                await asyncio.wait_for(self._kick.wait(), self._tick)
            except asyncio.TimeoutError:
                pass

    def _dispatch(self) -> None:
        now = time.monotonic()
        # answering instances: each at its interval
        for inst in list(self.registry._ok.values()):
            if self._busy_ok >= POLL_CONCURRENCY:
                break
            if not inst.polling and inst.next_due <= now:
                self._busy_ok += 1
                self._spawn(inst, True)
        # the others: within the budget, by class, oldest due first
        self._tokens = min(PROBES_PER_S * max(self._tick, 0.1),
                           self._tokens + (now - self._tokens_at) * PROBES_PER_S)
        self._tokens_at = now
        for q in self._queues:
            while q and q[0][0] <= now and self._busy_other < PROBE_CONCURRENCY and self._tokens >= 1:
                _, _, gen, iid = heapq.heappop(q)
                inst = self.registry.instances.get(iid)
                if inst is None or inst.gen != gen or inst.polling or inst.polled_ok:
                    continue  # gone, queued again since, or answering (polled above)
                self._tokens -= 1
                self._busy_other += 1
                self._spawn(inst, False)

    def _spawn(self, inst: Instance, answering: bool) -> asyncio.Task:
        inst.polling = True
        t = asyncio.create_task(self._run(inst, answering))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _run(self, inst: Instance, answering: Optional[bool]) -> None:
        """One poll of ``inst`` and its next due time; ``answering`` None: a direct poll (poll_all)."""
        started = time.monotonic()
        try:
            if answering is None:
                assert self._direct is not None
                async with self._direct:
                    await self.poll(inst)
            else:
                await self.poll(inst)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # one record's odd answer or a bug: that instance's failure only
            log.exception("poll of instance %d failed", inst.id)
            inst.polled_ok, inst.admitted = False, False
            inst.why_not = f"poll failed: {type(e).__name__}: {e}"
        finally:
            inst.polling = False
            if answering is True:
                self._busy_ok -= 1
            elif answering is False:
                self._busy_other -= 1
        self.polls += 1
        inst.polled_at = time.monotonic()
        if self.registry.instances.get(inst.id) is not inst:
            return  # removed or replaced meanwhile
        if inst.polled_ok:
            inst.bad_polls = 0
            inst.next_due = started + self.interval_s
        else:
            if inst.reached and not inst.refused:
                inst.bad_polls = 0  # a server starting (/health 503): not a failure to back off from
                delay = self.interval_s
            else:
                inst.bad_polls += 1
                delay = self.interval_s if inst.seen else \
                    min(max(BACKOFF_MAX_S, self.interval_s), self.interval_s * 2 ** min(inst.bad_polls, 16))
            self._queue(inst, time.monotonic() + delay)
        self.registry.note_one(inst)

    async def poll_all(self, insts: Optional[list[Instance]] = None, wait_s: Optional[float] = None) -> None:
        """Poll ``insts`` (default: every instance) now, ``POLL_CONCURRENCY`` at once; return when
        all have answered or after ``wait_s`` (the rest go on in the background)."""
        if self._direct is None:
            self._direct = asyncio.Semaphore(POLL_CONCURRENCY)
        todo = [i for i in (self.registry.instances.values() if insts is None else insts) if not i.polling]
        tasks = [self._spawn(i, None) for i in todo]
        if tasks:
            await asyncio.wait(tasks, timeout=wait_s)

    # -- one poll --------------------------------------------------------------------------------
    def _refuse(self, inst: Instance, why: str) -> None:
        if why != inst.refused:
            log.warning("instance %d %s refused: %s; not routed to", inst.id, inst.mgmt_url, why)
        inst.refused, inst.why_not = why, f"refused: {why}"
        inst.polled_ok = inst.admitted = False
        inst.reached = False

    def _away(self, inst: Instance, why: str) -> None:
        inst.polled_ok = inst.admitted = inst.reached = False
        inst.refused = ""
        inst.why_not = why
        if inst.breaker.probe_due():
            inst.breaker.failure()

    async def poll(self, inst: Instance) -> None:
        t = self.timeout_s
        asked_with = inst.inflight
        try:
            health, status = await asyncio.wait_for(self._ask(inst, t), t)
        except Refused as r:
            self._refuse(inst, str(r))
            return
        except (httpx.TimeoutException, asyncio.TimeoutError):
            # a busy instance answers its management plane late: not ready only after a few in a row
            inst.poll_timeouts += 1
            if inst.poll_timeouts < POLL_TIMEOUTS_DOWN and inst.polled_ok:
                return
            self._away(inst, f"management plane {inst.mgmt_url} did not answer within {t:g} s "
                             f"({inst.poll_timeouts} polls)")
            return
        except (httpx.HTTPError, ValueError, OSError) as e:  # refused, reset: down now
            self._away(inst, f"management plane {inst.mgmt_url} unreachable: {type(e).__name__}: {e}".rstrip(": "))
            return
        inst.poll_timeouts = 0
        inst.refused = ""
        inst.reached = True
        if status is not None:
            res = status.resource
            inst.avail_slots, inst.avail_blocks = res.availSlotsNum, res.availBlockNum
            inst.total_blocks = res.totalNpuBlockNums or inst.total_blocks
            inst.waiting, inst.running = res.waitingRequestNum, res.runningRequestNum
            inst.inflight_at_poll = asked_with
            inst.loaded = loaded_names(status.models)
        ok = health == 200 and inst.admitted
        inst.seen = inst.seen or ok
        inst.polled_ok = ok
        inst.why_not = "" if ok else f"/health answered {health}"
        if inst.breaker.probe_due():
            inst.breaker.success() if ok else inst.breaker.failure()

    async def _ask(self, inst: Instance, t: float) -> tuple[int, Optional[StatusShape]]:
        """(/health's status, /v2/status's body when /health said 200): the admission check
        first when the instance is not admitted. Raises ``Refused`` for an endpoint that is not a
        server instance (or not the one it is routed for)."""
        if not inst.polled_ok:
            # first contact, or back after being away: a bare connect first (cheap for a closed
            # port), which also finds this coordinator's own listeners behind a name
            await tcp_probe(inst.ip, inst.mgmt_port, self.own, t)
            if inst.business_port != inst.mgmt_port:
                await tcp_probe(inst.ip, inst.business_port, self.own, t)
        health, status = await asyncio.gather(self.client.get(f"{inst.mgmt_url}/health", timeout=t),
                                              self.client.get(f"{inst.mgmt_url}/v2/status", timeout=t))
        check_health(health.status_code)
        if health.status_code != 200:
            return health.status_code, None  # starting or draining: admitted once it says 200
        if status.status_code != 200:
            raise Refused(f"GET /v2/status answered {status.status_code}")
        body = shaped("GET /v2/status", status.content, StatusShape)
        try:
            role, eps, key = role_from_status(status.json())
        except ValueError:
            role, eps, key = "", [], ""
        if not inst.admitted:
            await self._admit(inst, t)
        if role != inst.role_reported and (role or inst.role_reported):
            log.info("instance %d %s role %s", inst.id, inst.base_url, role or inst.role_given or "flex")
        inst.role_reported, inst.kv_endpoints, inst.kv_curve_key = role, eps, key
        return 200, body

    async def _admit(self, inst: Instance, t: float) -> None:
        """The rest of the admission check (admission_check.py): /v1/config, the slot count, and
        the models its business plane lists (the management plane's when they share a port)."""
        conf = await self.client.get(f"{inst.mgmt_url}/v1/config", timeout=t)
        if conf.status_code != 200:
            raise Refused(f"GET /v1/config answered {conf.status_code}")
        c = shaped("GET /v1/config", conf.content, ConfigShape)
        slots = await self.client.get(f"{inst.mgmt_url}/v2/models/{c.modelName}/getSlotCount", timeout=t)
        if slots.status_code != 200:
            raise Refused(f"GET /v2/models/{c.modelName}/getSlotCount answered {slots.status_code}")
        n = shaped("GET getSlotCount", slots.content, SlotsShape).total_slots
        # every model it serves, from its business plane (the management plane when they share a port)
        split = inst.business_port != inst.mgmt_port
        where = f"its business plane {inst.base_url}: " if split else ""
        models = await (self.business.get(f"{inst.base_url}/v1/models", timeout=t) if split
                        else self.client.get(f"{inst.mgmt_url}/v1/models", timeout=t))
        if models.status_code != 200:
            raise Refused(f"{where}GET /v1/models answered {models.status_code}")
        shaped("GET /v1/models", models.content, ModelsShape)
        served = listed(models.content)
        if c.modelName not in served:
            raise Refused(f"{where}GET /v1/models does not list {c.modelName!r}")
        if inst.model_expected and inst.model_expected not in served:
            raise Refused(f"it serves the model{'s' * (len(served) > 1)} {', '.join(map(repr, served))}, "
                          f"not {inst.model_expected!r} it is routed for")
        self.registry.set_models(inst, served)
        # Ollama's names and cards for the fleet's /api/tags (optional: a server without it is still one)
        tags = await (self.business.get(f"{inst.base_url}/api/tags", timeout=t) if split
                      else self.client.get(f"{inst.mgmt_url}/api/tags", timeout=t))
        try:
            inst.tags = listed(tags.content, "models", "name") if tags.status_code == 200 else {}
        except (ValueError, AttributeError):  # not JSON, or not an object
            inst.tags = {}
        inst.model_name, inst.block_size, inst.total_slots = c.modelName, c.cacheBlockSize, n
        inst.admitted = True
        log.info("instance %d %s admitted: a server of %s, %d slots", inst.id, inst.base_url,
                 ", ".join(repr(m) for m in served), n)
