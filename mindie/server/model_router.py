"""Several models in one front end: one complete app per model, a request routed by its model.

Each ``ModelConfig`` entry gets a front end of its own in this process (``FrontEnd``: its
tokenizer, chat template, limits, metrics and device client, linked to that model's worker group)
and the same routes as a single model's server (mindie/server/app.py ``plane_routes``), so every
API serves every model exactly as it serves one, its 404 for an unknown name included. This ASGI
layer in front of them:

- reads the model a request names: ``/v2/models/{m}/...`` and ``/v1/models/{m}`` from the path,
  else the JSON body's ``model`` (``name`` for Ollama's ``/api/show``); ``:latest`` is Ollama's
  tag. A name no model has (an adapter's, a typo) and a request naming none go to the first
  model, whose routes answer as they always did;
- before a business-plane POST reaches its model's app, ``acquire``s the model
  (mindie/model_link.py: loads it if needed, waiting up to ``ServerConfig.e2eTimeout``) and
  releases it when the answer ends, stream included, so the model host never evicts it under a
  running request; a model that cannot be loaded gets a 503 in the API's error shape;
- answers what spans the models: ``GET /v1/models`` and ``/api/tags`` (every model, with
  ``loaded`` and llama.cpp's ``status``), ``GET /api/ps`` (the loaded ones, with their
  keep_alive expiry), ``POST /models/load`` and ``/models/unload`` (llama.cpp's router bodies,
  ``{"model": name}``), and adds ``models`` (state, pids, thread and KV budget) to ``/v1/status``
  and ``/v2/status``.

Ollama's ``keep_alive`` (seconds, or a duration as "5m") is passed to the model host with the
request; the management and metrics planes are the first model's (health: any model's workers).
"""
from __future__ import annotations

import json
import logging
import re
from datetime import datetime, timezone
from typing import Any
from urllib.parse import unquote

import msgspec

from mindie.contract import families
from mindie.contract import model_wire as W
from mindie.contract.http_error import ApiError
from mindie.model_link import ModelLink, ModelUnavailable

log = logging.getLogger("mindie.model_router")

_PATH_MODEL = re.compile(r"^/v[12]/models/([^/]+)")
# Business-plane POSTs that never reach a worker: no load for them.
NO_LOAD = frozenset({"/api/show", "/v1/tokenizer", "/v1/messages/count_tokens"})
ORDERS = {"/models/load": "load", "/models/unload": "unload"}
SLEEP_ROUTES = frozenset({("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")})
_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class _Named(msgspec.Struct):
    model: Any = None
    name: Any = None
    keep_alive: Any = None


def keep_alive_seconds(value: Any) -> float | None:
    """Ollama's keep_alive as seconds (a number is seconds; a Go duration "5m", "1h30m", "0";
    negative = for good, as -1); None when absent or unreadable."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return -1.0 if value < 0 else float(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            return keep_alive_seconds(float(text))
        except ValueError:
            parts = _DURATION.findall(text)
            if parts and "".join(n + u for n, u in parts) == text:
                total = sum(float(n) * _UNITS[u] for n, u in parts)
                return -1.0 if total < 0 else total
    return None


class AnyModelClient:
    """The health probes' view of several models' device clients: ready while any model's
    workers are, or while the model host answers (it loads models on demand: no model loaded,
    evicted, unloaded by keep_alive or asleep is a healthy server, not one to restart)."""

    def __init__(self, clients: list[Any]):
        self.clients = clients
        self.link: ModelLink | None = None  # set by ModelRouter

    def ready_links(self) -> list:
        links = [lk for c in self.clients for lk in c.ready_links()]
        if not links and self.link is not None and self.link.host_alive() and self.started():
            return [None]  # truthy: the probes' "a worker is ready" holds for a server that can load one
        return links

    def started(self) -> bool:
        return self.clients[0].started() or any(c.started() for c in self.clients[1:])

    def heartbeats(self) -> list:
        return [hb for c in self.clients for hb in c.heartbeats()]

    def submit(self, *args, **kwargs):
        client = next((c for c in self.clients if c.ready_links()), self.clients[0])
        return client.submit(*args, **kwargs)

    def cancel(self, stream) -> None:
        for c in self.clients:
            c.cancel(stream)


class _Captured:
    """What an inner app sent (for the answers that merge every model's)."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: list = []
        self.body = b""

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status, self.headers = message["status"], message.get("headers", [])
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")


async def _json_answer(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ModelRouter:
    def __init__(self, fronts: list[Any], apps: list[dict[int, Any]], business_ports: set[int],
                 management_ports: set[int], endpoint: str):
        """``fronts``: every model's FrontEnd, the first model's first; ``apps``: each one's
        {listener port: ASGI app}."""
        self.fronts = fronts
        self.apps = apps
        self.names = [fe.model_name for fe in fronts]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.business_ports = business_ports
        self.management_ports = management_ports
        first = fronts[0]
        self.max_body = first.config.server.max_request_length * 1024 * 1024
        self.wait_s = float(first.config.server.e2e_timeout)
        self.link = ModelLink(endpoint, first.client.frontend_id, self._ready)
        if isinstance(first.health_client, AnyModelClient):
            first.health_client.link = self.link

    def _ready(self, name: str) -> bool:
        i = self.index.get(name)
        return i is not None and bool(self.fronts[i].client.ready_links())

    def resolve(self, name: Any) -> int:
        """The index of the model ``name`` means (0: none, or not one of the models)."""
        if not isinstance(name, str):
            return 0
        return self.index.get(name, self.index.get(name.removesuffix(":latest"), 0))

    # -- ASGI --------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        port = scope.get("server", (None, None))[1] if scope.get("server") else None
        first_app = self.apps[0].get(port) or next(iter(self.apps[0].values()))
        if scope["type"] != "http":
            return await first_app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        if port in self.management_ports and method == "GET" and path in ("/v1/status", "/v2/status"):
            return await self._status(first_app, scope, receive, send)
        if port not in self.business_ports:  # management, metrics: the first model's, or the one the path names
            m = _PATH_MODEL.match(path)
            app = self.apps[self.resolve(unquote(m.group(1)))].get(port) if m else None
            return await (app or first_app)(scope, receive, send)
        if method == "GET" and path in ("/v1/models", "/api/tags", "/api/ps"):
            return await self._listing(path, port, scope, receive, send)
        if (method, path) in SLEEP_ROUTES:
            return await self._sleep_route(path, scope, send)
        body, receive = await self._peek(scope, receive) if method == "POST" else (b"", receive)
        named = _Named()
        if body:
            try:
                named = msgspec.json.decode(body, type=_Named)
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass
        if method == "POST" and path in ORDERS:
            return await self._order(ORDERS[path], named.model, send)
        m = _PATH_MODEL.match(path)
        i = self.resolve(unquote(m.group(1)) if m else named.model if named.model is not None else named.name)
        app = self.apps[i].get(port) or first_app
        if method != "POST" or path in NO_LOAD or path.endswith("/stopInfer"):
            return await app(scope, receive, send)
        name = self.names[i]
        keep = keep_alive_seconds(named.keep_alive) if path.startswith("/api/") else None
        try:
            await self.link.acquire(name, self.wait_s, keep)
        except ModelUnavailable as e:
            obj = None
            with_json = body[:1] == b"{"
            if with_json:
                try:
                    obj = json.loads(body)
                except ValueError:
                    obj = None
            status, data = families.error_answer(families.family(path, obj), ApiError(503, str(e)))
            return await _json_answer(send, status, data)
        try:
            await app(scope, receive, send)
        finally:
            self.link.release(name)

    async def _peek(self, scope, receive):
        """The request body (up to maxRequestLength; a longer one is left to the app, which
        refuses it) and a ``receive`` that gives the app the whole body again."""
        chunks, size, more = [], 0, True
        while more and size <= self.max_body:
            message = await receive()
            if message["type"] != "http.request":
                chunks.append(None)
                pending = [message]
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
        else:
            pending = []
        parts = [c for c in chunks if c is not None]
        queued = [{"type": "http.request", "body": b"".join(parts), "more_body": more}] + pending

        async def replay():
            return queued.pop(0) if queued else await receive()

        return (b"".join(parts) if not more else b""), replay

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.link.start()
                    await self._start_fronts()
                except Exception as e:  # noqa: BLE001  (the server must say why it cannot start)
                    log.exception("front end start failed")
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for fe in self.fronts:
                    await fe.process_shutdown(None, None)
                await self.link.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _start_fronts(self) -> None:
        """Start every model's front end; wait (bounded) only for those loaded at start."""
        for i, fe in enumerate(self.fronts):
            fe.wait_at_start = i == 0
            await fe.process_startup(None, None)
        names = ", ".join(self.names)
        log.info("front end serves %d models: %s (the first is the default of requests that name none)",
                 len(self.names), names)

    # -- what spans the models ---------------------------------------------------------------------
    async def _inner(self, app, scope, path: str) -> tuple[int, Any]:
        """GET ``path`` on ``app`` in this process: (status, decoded JSON)."""
        cap = _Captured()
        inner = {**scope, "path": path, "raw_path": path.encode(), "query_string": b"", "method": "GET"}

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        await app(inner, receive, cap.send)
        return cap.status, json.loads(cap.body or b"null")

    def _state(self, name: str) -> W.ModelState:
        return self.link.states.get(name) or W.ModelState()

    async def _listing(self, path: str, port: int, scope, receive, send) -> None:
        key = "data" if path == "/v1/models" else "models"
        out: list = []
        for i, name in enumerate(self.names):
            st = self._state(name)
            if path == "/api/ps" and st.state not in (W.LOADED, W.DRAINING):
                continue
            app = self.apps[i].get(port) or next(iter(self.apps[i].values()))
            status, body = await self._inner(app, scope, path)
            if status != 200 or not isinstance(body, dict):
                continue
            items = body.get(key) or []
            for item in items:
                if path == "/v1/models":
                    if item.get("parent") is None:  # the model itself (adapters name it as parent)
                        item["loaded"] = st.state == W.LOADED
                        item["status"] = {"value": st.state}
                elif path == "/api/tags":
                    item["loaded"] = st.state == W.LOADED
                elif path == "/api/ps" and st.expires_at:
                    item["expires_at"] = _iso(st.expires_at)
            out += items
        await _json_answer(send, 200, msgspec.json.encode({"object": "list", "data": out} if key == "data"
                                                          else {"models": out}))

    async def _order(self, op: str, model: Any, send) -> None:
        """``POST /models/load`` / ``unload`` ({"model": name}); OpenAI's error shape, as llama.cpp."""
        if not isinstance(model, str) or not model:
            err = ApiError(400, "model is required", param="model")
        elif self.resolve(model) == 0 and model.removesuffix(":latest") != self.names[0]:
            err = ApiError(404, f"model '{model}' not found", param="model")
        else:
            answer = await self.link.order(op, self.names[self.resolve(model)], self.wait_s)
            if answer.status == 200:
                return await _json_answer(send, 200, msgspec.json.encode({"success": True,
                                                                          "message": answer.message}))
            err = ApiError(answer.status, answer.message)
        status, data = families.error_answer(families.OPENAI, err)
        await _json_answer(send, status, data)

    async def _sleep_route(self, path: str, scope, send) -> None:
        """vLLM's sleep mode: ``POST /sleep?level=1|2`` (answered once every model's workers are
        stopped), ``POST /wake_up`` (once those loaded before are ready again), ``GET /is_sleeping``."""
        if path == "/is_sleeping":
            return await _json_answer(send, 200, msgspec.json.encode({"is_sleeping": bool(self.link.sleeping)}))
        level = 1
        if path == "/sleep":
            query = dict(p.split("=", 1) for p in scope.get("query_string", b"").decode().split("&") if "=" in p)
            if query.get("level", "1") not in ("1", "2"):
                status, data = families.error_answer(families.OPENAI, ApiError(
                    400, f"level must be 1 or 2, got {query.get('level')!r}", param="level"))
                return await _json_answer(send, status, data)
            level = int(query.get("level", "1"))
        answer = await self.link.order(path.strip("/"), "", self.wait_s, level)
        if answer.status != 200:
            status, data = families.error_answer(families.OPENAI, ApiError(answer.status, answer.message))
            return await _json_answer(send, status, data)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    async def _status(self, app, scope, receive, send) -> None:
        """``/v1/status`` and ``/v2/status`` of the first model, with every model's state and
        budgets (``models``): the coordinator's poll of ``/v2/status`` learns from it which models
        are loaded here (coordinator/model_index.py)."""
        cap = _Captured()
        await app(scope, receive, cap.send)
        try:
            body = json.loads(cap.body)
        except ValueError:
            body = None
        if cap.status == 200 and isinstance(body, dict):
            body["models"] = {name: msgspec.to_builtins(self._state(name)) for name in self.names}
            body["maxLoadedModels"] = self.link.max_loaded
            body["maxLoadedMemSize"] = self.link.max_mem_gb
            return await _json_answer(send, 200, msgspec.json.encode(body))
        await send({"type": "http.response.start", "status": cap.status, "headers": cap.headers})
        await send({"type": "http.response.body", "body": cap.body})
