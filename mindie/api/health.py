"""Health, model listing and metrics routes (mindie.md §2.2-2.4)."""
from __future__ import annotations

import falcon
import falcon.asgi
import msgspec

from mindie.errors import not_found
from mindie.frontend import FrontEnd


class HealthResource:
    """GET /health: 200 with an empty body when a device worker is ready, else 503 (MindIE
    answers both without a body)."""

    def __init__(self, fe: FrontEnd):
        self.fe = fe

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.status = 200 if self.fe.ready() else 503
        resp.data = b""


class LiveResource:
    """GET /v2/health/live and /v2/health/ready (the Kubernetes probes MindIE documents)."""

    def __init__(self, fe: FrontEnd, ready: bool):
        self.fe = fe
        self.is_ready_probe = ready

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if self.fe.ready():
            resp.status = 200
            resp.data = b""
        else:
            resp.status = 503
            resp.content_type = falcon.MEDIA_JSON
            resp.data = msgspec.json.encode({"message": "No device worker is ready"})


class ModelsResource:
    def __init__(self, fe: FrontEnd):
        self.fe = fe

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        fe = self.fe
        resp.content_type = falcon.MEDIA_JSON
        resp.data = msgspec.json.encode({"object": "list", "data": [{
            "id": fe.model_name, "object": "model", "root": fe.model_dir, "owned_by": "MindIE Server",
            "parent": None}]})


class ModelResource:
    def __init__(self, fe: FrontEnd):
        self.fe = fe

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, model: str) -> None:
        fe = self.fe
        if model != fe.model_name:
            e = not_found(f"Model {model} not found.")
            resp.status, resp.content_type, resp.data = e.status, falcon.MEDIA_JSON, e.body()
            return
        resp.content_type = falcon.MEDIA_JSON
        resp.data = msgspec.json.encode({"id": fe.model_name, "object": "model", "created": fe.started,
                                         "owned_by": "MindIE Server"})


class MetricsResource:
    def __init__(self, fe: FrontEnd):
        self.fe = fe

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        self.fe.refresh_gauges()
        data, ctype = self.fe.metrics.render()
        resp.content_type = ctype
        resp.data = data
