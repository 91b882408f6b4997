"""The falcon.asgi application of a front end (one per gunicorn worker).

    gunicorn -c deploy/gunicorn.conf.py  ->  mindie.server.app:create_app()
"""
from __future__ import annotations

import logging
import os

import falcon
import falcon.asgi

from mindie.api.anthropic import anthropic_routes
from mindie.api.embeddings import embedding_routes
from mindie.api.rerank import rerank_routes
from mindie.api.control import StopInferResource, StopServiceResource
from mindie.api.health import Health, HealthResource, LiveResource, ModelsResource, TimedHealthResource
from mindie.api.generate import GenerateResource
from mindie.api.infer import InferResource
from mindie.api.lora import LoadLoraResource, UnloadLoraResource
from mindie.api.metrics import MetricsJsonResource, MetricsResource
from mindie.api.ollama import ollama_routes
from mindie.api.ollama_models import RootResource, ollama_model_routes
from mindie.api.openai import openai_routes
from mindie.api.responses import responses_routes
from mindie.api.status import StatusRoutes
from mindie.api.tgi import TgiResource
from mindie.api.tokenizer import TokenizerResource
from mindie.api.triton import TritonResource
from mindie.contract import families
from mindie.contract.errors import error_type
from mindie.runtime.gc_freeze import freeze_heap
from mindie.contract.http_error import ApiError
from mindie.server.frontend import FrontEnd
from mindie.runtime.log_setup import setup_logging
from mindie.server.elsewhere import elsewhere_routes
from mindie.server.listeners import read_listeners
from mindie.server.response_store import ResponseStore
from mindie.api.pd_role import RoleResource
from mindie.pipeline import Pipeline
from mindie.text.pooling import load_pooling
from mindie.text.rerank import load_scorer

log = logging.getLogger("mindie.app")


def _serialize_error(req, resp, exc: falcon.HTTPError) -> None:
    """Every Falcon error (404, 405, ...) in MindIE's {"error", "error_type"} shape, whatever
    the Accept header says (Falcon's default would send an empty body to an SSE client); a path
    no route serves under ``/v1/`` in OpenAI's shape (Anthropic's under ``/v1/messages``, Ollama's
    under ``/api/``), which those clients read (mindie/contract/families.py ``unrouted``); any
    error on an Anthropic, Ollama, Responses or rerank path in that family's shape."""
    status = exc.status_code
    name = error_type(status)
    resp.content_type = falcon.MEDIA_JSON
    if isinstance(exc, falcon.HTTPRouteNotFound) and (fam := families.unrouted(req.path)) != families.OTHER:
        _, resp.data = families.error_answer(fam, ApiError(404, f"Invalid URL ({req.method} {req.path})"))
        return
    if (fam := families.family(req.path, None)) in (families.OLLAMA, families.ANTHROPIC, families.RESPONSES,
                                                    families.RERANK):
        # their clients read only their own shape: a wrong method (405) too
        _, resp.data = families.error_answer(fam, ApiError(status, exc.description or exc.title or "Error"))
        return
    resp.data = ApiError(status, exc.description or exc.title or "Error",
                         name if name != "Error" else exc.title or "Error").body()


async def _api_error(req, resp, ex: ApiError, params) -> None:
    """A request error, written by the codec of the request's API family (mindie/pipeline.py
    sets it on ``req.context``), else in MindIE's shape."""
    codec = getattr(req.context, "codec", None)
    status, body = codec.error(ex) if codec is not None else (ex.status, ex.body())
    resp.status = status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = body


async def _unexpected(req, resp, ex: Exception, params) -> None:
    if isinstance(ex, falcon.HTTPError):
        raise ex
    log.exception("unhandled error on %s %s", req.method, req.path)
    await _api_error(req, resp, ApiError(500, f"Server internal error: {type(ex).__name__}"), params)


def create_app():
    """The ASGI app of a front end: one Falcon app per listener with the routes of its planes
    (mindie/server/listeners.py), chosen by the local port of each connection."""
    setup_logging(f"frontend pid {os.getpid()}")
    fe = FrontEnd.from_env()
    listeners = read_listeners(os.environ["MINDIE_LISTENERS"])
    if fe.deployment.models_endpoint:  # several models, or sleep mode: the model host serves them
        return _many_models(fe, listeners)
    routes = plane_routes(fe)
    # Each listener also answers the other planes' paths with a 404 that says where they live.
    by_port = {li.port: _plane_app(fe, [r for plane in li.planes for r in routes[plane]]
                                   + elsewhere_routes(routes, listeners, li)) for li in listeners}
    router = plane_router(by_port, by_port[listeners[0].port])
    freeze_heap(log, f"front end pid {os.getpid()}", fe.deployment.workers[0].engine.gc_freeze)
    return router


def _many_models(first: FrontEnd, listeners):
    """Several models (mindie/server/model_router.py): a front end and its plane apps per model."""
    from mindie.contract.spec import Deployment
    from mindie.model_plan import config_for
    from mindie.server.model_router import AnyModelClient, ModelRouter

    dep = first.deployment
    fronts = [first] + [FrontEnd(config_for(first.config, k), Deployment(run_dir=dep.run_dir, workers=group),
                                 shared=first) for k, group in enumerate(dep.models, start=1)]
    first.health_client = AnyModelClient([fe.client for fe in fronts])  # before the health routes take it
    apps, scrapes = [], []
    for fe in fronts:
        routes = plane_routes(fe)
        scrapes.append(next(res for path, res, _ in routes["metrics"] if path == "/metrics"))
        apps.append({li.port: _plane_app(fe, [r for plane in li.planes for r in routes[plane]]
                                         + elsewhere_routes(routes, listeners, li)) for li in listeners})
    # /metrics is the first model's route: it adds the other models' worker figures, each labelled
    # with its model_name (their request figures are in the shared multiprocess files already)
    scrapes[0].others = [res.workers for res in scrapes[1:]]
    router = ModelRouter(fronts, apps, {li.port for li in listeners if "business" in li.planes},
                         {li.port for li in listeners if "management" in li.planes}, dep.models_endpoint)
    freeze_heap(log, f"front end pid {os.getpid()}", dep.workers[0].engine.gc_freeze)
    return router


def plane_routes(fe: FrontEnd) -> dict[str, list[tuple[str, object, str | None]]]:
    """{plane: [(path, resource, responder suffix)]}: MindIE's route sets (mindie.md §2)."""
    pipeline = Pipeline(fe.client, fe.tokenizer, fe.limits, fe.metrics, fe.admission, fe.state, roles=fe.roles)
    infer = InferResource(pipeline, full_text=fe.full_text, model_name=fe.model_name)
    models = ModelsResource(fe.model_name, fe.model_dir, fe.started, pipeline.adapters)
    generate, tgi = GenerateResource(pipeline, fe.model_name), TgiResource(pipeline, fe.model_name)
    triton = TritonResource(pipeline, fe.model_name, full_text=fe.full_text)
    completions, chat = openai_routes(fe, pipeline)
    ollama_chat, ollama_generate = ollama_routes(pipeline, completions.codec, chat.codec)  # mindie/api/ollama.py
    ollama = ollama_model_routes(fe, chat.codec, pipeline.adapters)
    pooling = load_pooling(fe.model_dir, fe.config.backend.model_deploy.models[0].embedding_pooling)
    log.info("embeddings: %s pooling%s (%s)", pooling.kind, ", normalised" if pooling.normalize else "", pooling.source)
    embeddings, ollama_embed = embedding_routes(fe, pipeline, pooling, pipeline.adapters)  # mindie/api/embeddings.py
    model_cfg = fe.config.backend.model_deploy.models[0]
    scorer = load_scorer(fe.model_dir, fe.tokenizer, model_cfg.rerank, model_cfg.rerank_template)
    log.info("rerank: %s", f"{scorer.kind} ({scorer.source})" if scorer.kind else "off")
    pipeline.score_only = scorer.generation_refusal  # a cross-encoder generates nothing
    rerank_v1, rerank_v2, score = rerank_routes(fe, pipeline, scorer, pipeline.adapters)  # mindie/api/rerank.py
    messages, count_tokens = anthropic_routes(pipeline, chat.codec, fe.limits.max_request_length_mb)
    store = ResponseStore(fe.config.server.responses_store_path or os.path.join(fe.run_dir, "responses"))
    responses, stored_response = responses_routes(pipeline, chat.codec, store)  # mindie/api/responses.py
    status = StatusRoutes(fe.config, fe.client, fe.model_name, fe.model_dir, engine=fe.deployment.workers[0].engine,
                          roles=fe.roles)
    health = Health(fe.health_client, fe.state, fe.admission)
    healthz = HealthResource(health, fe.model_name)
    timed = TimedHealthResource(health, probe_token=min(1, max(0, fe.vocab_size - 1)))
    fe.model_listeners.append(lambda vocab: setattr(timed, "probe_token", min(1, max(0, vocab - 1))))
    server = fe.config.server
    return {
        "business": [
            ("/infer", infer, None), ("/infer_token", infer, None),
            ("/v1/models", models, None), ("/v1/models/{model}", models, "model"),
            ("/v1/tokenizer", TokenizerResource(fe.tokenizer, fe.limits), None),
            ("/v2", status, "v2"), ("/v2/models/{model}", status, "v2_model"),
            ("/v2/models/{model}/config", status, "v2_model_config"),
            ("/v2/models/{model}/stopInfer",
             StopInferResource(fe.client, fe.model_name, server.max_request_length), None),
            # TGI / vLLM (mindie/api/generate.py tells their /generate bodies apart), Triton; TGI clients
            # read /info here too.
            ("/generate", generate, None), ("/generate_stream", tgi, "stream"),
            ("/", RootResource(tgi), None),  # POST: TGI's compat route; GET, HEAD: Ollama's "is running"
            ("/info", status, "info"),
            ("/v2/models/{model}/infer", triton, "infer"), ("/v2/models/{model}/generate", triton, "generate"),
            ("/v2/models/{model}/generate_stream", triton, "generate_stream"),
            ("/v1/completions", completions, None), ("/v1/chat/completions", chat, None),  # mindie/api/openai.py
            # Ollama (mindie/api/ollama.py, ollama_models.py): generation on the OpenAI codecs, model routes.
            ("/api/chat", ollama_chat, None), ("/api/generate", ollama_generate, None),
            ("/api/tags", ollama, "tags"), ("/api/ps", ollama, "ps"), ("/api/version", ollama, "version"),
            ("/api/show", ollama, "show"), ("/api/embed", ollama_embed, None),
            ("/v1/embeddings", embeddings, None),
            ("/rerank", rerank_v1, None), ("/v1/rerank", rerank_v1, None), ("/v2/rerank", rerank_v2, None),
            ("/score", score, None), ("/v1/score", score, None),
            ("/v1/messages", messages, None),  # mindie/api/anthropic.py
            ("/v1/messages/count_tokens", count_tokens, None),
            ("/v1/responses", responses, None), ("/v1/responses/{response_id}", stored_response, None),
        ],
        "management": [
            ("/health", healthz, None), ("/v2/models/{model}/ready", healthz, "model"),
            ("/v2/health/live", LiveResource(health, ready=False), None),
            ("/v2/health/ready", LiveResource(health, ready=True), None),
            ("/health/timed", timed, None), ("/health/timed-{n}", timed, "n"),
            ("/info", status, "info"), ("/v1/config", status, "v1_config"), ("/v1/status", status, "v1_status"),
            ("/v2/status", status, "v2_status"), ("/v2/models/{model}/getSlotCount", status, "slots"),
            # Prefill/decode roles (mindie/api/pd_role.py): MindIE's Controller routes and bodies.
            ("/v1/role/{role}", RoleResource(fe.roles, server.max_request_length, 1), None),
            ("/v2/role/{role}", RoleResource(fe.roles, server.max_request_length, 2), None),
            ("/stopService", StopServiceResource(fe.client, fe.state, fe.admission, fe.run_dir,
                                                 server.drain_timeout_s), None),
            ("/metrics-json", MetricsJsonResource(fe.client, f"{server.management_ip_address}:{server.management_port}"),
             None),
            # LoRA adapters at run time (mindie/api/lora.py): MindIE's routes, vLLM's bodies too.
            ("/v1/load_lora_adapter", LoadLoraResource(fe.client, fe.model_name, server.max_request_length,
                                                        fe.loaded_adapters,
                                                        fe.config.backend.model_deploy.lora_root), None),
            ("/v1/unload_lora_adapter", UnloadLoraResource(fe.client, server.max_request_length, fe.loaded_adapters),
             None),
        ],
        "metrics": [("/metrics", MetricsResource(fe.metrics, fe.client), None)],
    }


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
