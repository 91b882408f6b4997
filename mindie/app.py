"""The falcon.asgi application of a front end (one per gunicorn worker).

    gunicorn -c deploy/gunicorn.conf.py  ->  mindie.app:create_app()
"""
from __future__ import annotations

import logging
import os
import sys

import falcon
import falcon.asgi

from mindie.api.health import HealthResource, LiveResource, MetricsResource, ModelsResource
from mindie.api.infer import InferResource
from mindie.contract.errors import error_type
from mindie.errors import ApiError
from mindie.frontend import FrontEnd
from mindie.listeners import read_listeners

log = logging.getLogger("mindie.app")


def _serialize_error(req, resp, exc: falcon.HTTPError) -> None:
    """Every Falcon error (404, 405, ...) in MindIE's {"error", "error_type"} shape, whatever
    the Accept header says (Falcon's default would send an empty body to an SSE client)."""
    status = exc.status_code
    name = error_type(status)
    resp.content_type = falcon.MEDIA_JSON
    resp.data = ApiError(status, exc.description or exc.title or "Error",
                         name if name != "Error" else exc.title or "Error").body()


async def _api_error(req, resp, ex: ApiError, params) -> None:
    resp.status = ex.status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = ex.body()


async def _unexpected(req, resp, ex: Exception, params) -> None:
    if isinstance(ex, falcon.HTTPError):
        raise ex
    log.exception("unhandled error on %s %s", req.method, req.path)
    await _api_error(req, resp, ApiError(500, f"Server internal error: {type(ex).__name__}"), params)


def create_app():
    """The ASGI app of a front end: one Falcon app per listener with the routes of its planes
    (mindie/listeners.py), chosen by the local port of each connection."""
    logging.basicConfig(level=(os.environ.get("MINDIE_LOG_LEVEL") or "INFO").upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [frontend pid %(process)d] %(name)s: %(message)s")
    fe = FrontEnd.from_env()
    infer = InferResource(fe.client, fe.tokenizer, fe.limits, fe.metrics, fe.admission, full_text=fe.full_text)
    models = ModelsResource(fe.model_name, fe.model_dir, fe.started)
    live = LiveResource(fe.client)
    routes = {
        "business": [("/infer", infer, None), ("/infer_token", infer, None), ("/v1/models", models, None),
                     ("/v1/models/{model}", models, "model")],
        "management": [("/health", HealthResource(fe.client), None), ("/v2/health/live", live, None),
                       ("/v2/health/ready", live, None)],
        "metrics": [("/metrics", MetricsResource(fe.metrics, fe.client), None)],
    }
    listeners = read_listeners(os.environ["MINDIE_LISTENERS"])
    by_port = {li.port: _plane_app(fe, [r for plane in li.planes for r in routes[plane]]) for li in listeners}
    return plane_router(by_port, by_port[listeners[0].port])


def _plane_app(fe: FrontEnd, routes) -> falcon.asgi.App:
    app = falcon.asgi.App(middleware=[fe])
    for path, resource, suffix in routes:
        app.add_route(path, resource, **({"suffix": suffix} if suffix else {}))
    app.set_error_serializer(_serialize_error)
    app.add_error_handler(Exception, _unexpected)
    app.add_error_handler(ApiError, _api_error)
    return app


def plane_router(by_port: dict, first):
    """Each HTTP request to the app of the listener it came in on (a route of another plane is a
    404 there); lifespan events to ``first`` only, so the front end starts and stops once."""

    async def route(scope, receive, send):
        app = first
        if scope["type"] == "http" and scope.get("server"):
            app = by_port.get(scope["server"][1], first)
        await app(scope, receive, send)

    return route
