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


def create_app() -> falcon.asgi.App:
    logging.basicConfig(level=(os.environ.get("MINDIE_LOG_LEVEL") or "INFO").upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [frontend pid %(process)d] %(name)s: %(message)s")
    fe = FrontEnd.from_env()
    app = falcon.asgi.App(middleware=[fe])
    infer = InferResource(fe.client, fe.tokenizer, fe.limits, fe.metrics, fe.admission)
    app.add_route("/infer", infer)
    app.add_route("/infer_token", infer)
    app.add_route("/health", HealthResource(fe.client))
    live = LiveResource(fe.client)
    app.add_route("/v2/health/live", live)
    app.add_route("/v2/health/ready", live)
    models = ModelsResource(fe.model_name, fe.model_dir, fe.started)
    app.add_route("/v1/models", models)
    app.add_route("/v1/models/{model}", models, suffix="model")
    app.add_route("/metrics", MetricsResource(fe.metrics, fe.client))
    app.set_error_serializer(_serialize_error)
    app.add_error_handler(Exception, _unexpected)
    app.add_error_handler(ApiError, _api_error)
    return app
