"""Health routes (mindie.md §2.3: /health, /v2/health/live|ready, /health/timed-N,
/v2/models/{m}/ready) and the model listing of the business plane (§2.2)."""
from __future__ import annotations

import time

import falcon
import falcon.asgi
import msgspec

from mindie.lora_adapters import Adapters
from mindie.server.admission import Admission
from mindie.device_client import DeviceClient, NoWorkerError
from mindie.contract import wire as P
from mindie.contract.http_error import STOPPED_MESSAGE, ApiError, not_found
from mindie.server.service_state import ServiceState


class Health:
    """The service's health as MindIE's probes report it (mindie.md §2.3), shared by the
    health routes of a front end.

    - stopped: ``/stopService`` was called (on any front end of this server);
    - starting: no device worker has been ready yet (MindIE's health flag is false);
    - abnormal: workers were ready once and none is now (all dead or restarting);
    - BUSY: the server cannot start more work now: every ready worker has requests waiting that
      it cannot admit (all ``maxBatchSize`` slots taken, or its KV cache at least
      ``BUSY_KV_USAGE`` full), or ``maxLinkNum`` requests are in progress (the next one would be
      refused with 503);
    - normal otherwise.
    """

    BUSY_KV_USAGE = 0.95

    def __init__(self, client: DeviceClient, state: ServiceState, admission: Admission | None):
        self.client = client
        self.state = state
        self.admission = admission

    def busy(self) -> bool:
        if self.admission is not None and self.admission.in_use() >= self.admission.limit:
            return True
        beats = self.client.heartbeats()
        if not beats:
            return False
        return all(_worker_busy(hb, self.BUSY_KV_USAGE) for hb in beats)


def _worker_busy(hb: P.Heartbeat, kv_limit: float) -> bool:
    if hb.waiting == 0:
        return False
    full_slots = hb.max_batch_size > 0 and hb.running >= hb.max_batch_size
    kv_full = hb.total_blocks > 0 and 1.0 - hb.free_blocks / hb.total_blocks >= kv_limit
    return full_slots or kv_full


def _json(resp: falcon.asgi.Response, status: int, body: dict) -> None:
    resp.status = status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = msgspec.json.encode(body)


def _no_body(resp: falcon.asgi.Response, status: int) -> None:
    resp.status = status
    resp.data = b""


def _stopped(resp: falcon.asgi.Response) -> None:
    resp.status = 503
    resp.content_type = falcon.MEDIA_JSON
    resp.data = ApiError(503, STOPPED_MESSAGE).body()


class HealthResource:
    """GET /health: 200 with an empty body when a device worker is ready; 503 without a body
    while starting (or with no ready worker); 503 "The service has been stopped." after
    /stopService. Also GET /v2/models/{model}/ready (404 for another model first)."""

    def __init__(self, health: Health, model_name: str):
        self.health = health
        self.model_name = model_name

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if self.health.state.stopped():
            return _stopped(resp)
        client = self.health.client
        _no_body(resp, 200 if client.ready_links() and client.started() else 503)

    async def on_get_model(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, model: str) -> None:
        if model != self.model_name:
            raise not_found(f"Model {model} not found.")
        await self.on_get(req, resp)


class LiveResource:
    """GET /v2/health/live and /v2/health/ready (``ready=True``), MindIE's Kubernetes probes:
    503 as /health while starting or stopped; 500 {"message": "Service is abnormal"} when no
    worker is ready any more; BUSY: live 200 {"message": "Service is alive but busy"}, ready
    503 with MindIE's advice; else 200 with an empty body."""

    def __init__(self, health: Health, ready: bool):
        self.health = health
        self.ready = ready

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        h = self.health
        if h.state.stopped():
            return _stopped(resp)
        if not h.client.started():
            return _no_body(resp, 503)
        if not h.client.ready_links():
            return _json(resp, 500, {"message": "Service is abnormal"})
        if h.busy():
            if self.ready:
                return _json(resp, 503, {"message": "Service is alive but busy. Consider reducing request frequency"})
            return _json(resp, 200, {"message": "Service is alive but busy"})
        _no_body(resp, 200)


TIMED_DEFAULT_S = 10
TIMED_MAX_S = 600


def timed_wait(text: str | None) -> int:
    """N of /health/timed-N (None: /health/timed): MindIE's checks and 404 messages."""
    if text is None:
        return TIMED_DEFAULT_S
    if len(text) > 3:
        raise not_found(f"Max wait time is {TIMED_MAX_S}, input is invalid or too long")
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= TIMED_MAX_S:
        raise not_found(f"Wait time should be in range of [1, {TIMED_MAX_S}], input is not valid")
    return int(text)


class TimedHealthResource:
    """GET /health/timed and /health/timed-N: a real one-token inference through a device
    worker (highest priority, not counted in the request metrics), answered 200
    {"status": "healthy"} when it finishes within N seconds and 500 (Incomplete Generation)
    when it fails or does not. As MindIE: 503 without a body while starting; 200 healthy
    without an inference when BUSY (the probe must not add load to a saturated server) and
    after /stopService."""

    HEALTHY = msgspec.json.encode({"status": "healthy"})

    def __init__(self, health: Health, probe_token: int):
        self.health = health
        self.probe_token = probe_token

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        await self._probe(resp, TIMED_DEFAULT_S)

    async def on_get_n(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, n: str) -> None:
        await self._probe(resp, timed_wait(n))

    async def _probe(self, resp: falcon.asgi.Response, wait_s: int) -> None:
        h = self.health
        resp.content_type = falcon.MEDIA_JSON
        if h.state.stopped():
            resp.data = self.HEALTHY
            return
        if not h.client.started():
            return _no_body(resp, 503)
        if not h.client.ready_links():  # workers were up and are gone or stalled
            raise ApiError(500, "Virtual inference failed: no device worker is ready")
        if h.busy():
            resp.data = self.HEALTHY
            return
        deadline = time.monotonic() + wait_s
        params = P.SamplingParams(max_new_tokens=1, ignore_eos=True)
        try:
            stream = h.client.submit([self.probe_token], params, priority=1)
        except NoWorkerError as e:
            raise ApiError(500, f"Virtual inference failed: {e}")
        try:
            while True:
                left = deadline - time.monotonic()
                frames = await stream.get(max(0.0, left)) if left > 0 else []
                for f in frames:
                    if f.error is not None:
                        raise ApiError(500, f"Virtual inference failed: {f.error.message}")
                    if f.finish_reason:
                        resp.data = self.HEALTHY
                        return
                if not frames and time.monotonic() >= deadline:
                    raise ApiError(500, f"Virtual inference did not finish within {wait_s} s")
        finally:
            if not stream.finished:
                h.client.cancel(stream)


class ModelsResource:
    """GET /v1/models and GET /v1/models/{model}: the base model, then every LoRA adapter the
    workers serve (``adapters``: mindie/lora_adapters.py) with its folder as ``root`` and the base model
    as ``parent``, as MindIE and vLLM list them."""

    def __init__(self, model_name: str, model_dir: str, started: int, adapters: Adapters | None = None):
        self.model_name = model_name
        self.model_dir = model_dir
        self.started = started
        self.adapters = adapters or Adapters()

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.content_type = falcon.MEDIA_JSON
        data = [{"id": self.model_name, "object": "model", "root": self.model_dir, "owned_by": "MindIE Server",
                 "parent": None}]
        data += [{"id": name, "object": "model", "root": path, "owned_by": "MindIE Server", "parent": self.model_name}
                 for name, path in sorted(self.adapters.listing().items())]
        resp.data = msgspec.json.encode({"object": "list", "data": data})

    async def on_get_model(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, model: str) -> None:
        resp.content_type = falcon.MEDIA_JSON
        if model == self.model_name:
            resp.data = msgspec.json.encode({"id": self.model_name, "object": "model", "created": self.started,
                                             "owned_by": "MindIE Server"})
        elif model in self.adapters:
            resp.data = msgspec.json.encode({"id": model, "object": "model", "created": self.started,
                                             "owned_by": "MindIE Server", "parent": self.model_name})
        else:
            raise not_found(f"Model {model} not found.")
