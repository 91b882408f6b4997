"""Health, model listing and metrics routes (mindie.md §2.2-2.4)."""
from __future__ import annotations

import falcon
import falcon.asgi
import msgspec

from mindie.client import DeviceClient
from mindie.errors import not_found
from mindie.metrics import Metrics


class HealthResource:
    """GET /health: 200 with an empty body when a device worker is ready, else 503 (MindIE
    answers both without a body)."""

    def __init__(self, client: DeviceClient):
        self.client = client

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.status = 200 if self.client.ready_links() else 503
        resp.data = b""


class LiveResource:
    """GET /v2/health/live and /v2/health/ready (the Kubernetes probes MindIE documents)."""

    def __init__(self, client: DeviceClient):
        self.client = client

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if self.client.ready_links():
            resp.status = 200
            resp.data = b""
        else:
            resp.status = 503
            resp.content_type = falcon.MEDIA_JSON
            resp.data = msgspec.json.encode({"message": "No device worker is ready"})


class ModelsResource:
    """GET /v1/models and GET /v1/models/{model}."""

    def __init__(self, model_name: str, model_dir: str, started: int):
        self.model_name = model_name
        self.model_dir = model_dir
        self.started = started

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.content_type = falcon.MEDIA_JSON
        resp.data = msgspec.json.encode({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "root": self.model_dir, "owned_by": "MindIE Server",
            "parent": None}]})

    async def on_get_model(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, model: str) -> None:
        if model != self.model_name:
            raise not_found(f"Model {model} not found.")
        resp.content_type = falcon.MEDIA_JSON
        resp.data = msgspec.json.encode({"id": self.model_name, "object": "model", "created": self.started,
                                         "owned_by": "MindIE Server"})


class MetricsResource:
    def __init__(self, metrics: Metrics, client: DeviceClient):
        self.metrics = metrics
        self.client = client

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        self.metrics.workers(*self.client.load())
        data, ctype = self.metrics.render()
        resp.content_type = ctype
        resp.data = data
