"""The manage port: MindIE MS's coordinator management API (intra-cluster interface).

GET  /v1/startup, /v1/health, /v2/health/live     200 while the process serves
GET  /v1/readiness, /v2/health/ready              200 when at least one instance is ready, else 503
GET  /v1/coordinator_info                         MindIE's body (schedule_info, request_num,
                                                  request_length_info) plus ``instances`` (extension)
GET  /recvs_info                                  {"is_master": true, "recv_flow": n since the last call}
GET  /metrics                                     coordinator/metrics.py
POST /v1/instances/refresh                        the instance set (MindIE's body, or the newer
                                                  ``event`` + ``endpoints`` form)
POST /v1/instances/offline | online               {"ids": [...]}: stop / resume routing to them
POST /v1/instances/query_tasks                    {"p_id", "d_id"} -> {"is_end": bool}
GET  /stopService[?mode=Force]                    every instance drained and stopped, then the coordinator

A malformed body is a 400 in MindIE's shape ({"error", "error_type"}) naming the field.
"""
from __future__ import annotations

import json
import logging
from typing import Any

import falcon
import falcon.asgi

from coordinator.pd_pairing import parse_role, role_from_static
from coordinator.registry import Instance
from mindie.contract.http_error import ApiError

log = logging.getLogger("mindie.coordinator.manage")


def _bad(message: str) -> ApiError:
    return ApiError(400, message)


async def _api_error(req, resp, err: ApiError, params) -> None:
    """A refusal of the management API, in MindIE's shape."""
    resp.status = err.status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = err.body()


def _serialize(req, resp, exc: falcon.HTTPError) -> None:
    """Falcon's own errors (an unknown route, a method not allowed) in MindIE's shape too."""
    resp.content_type = falcon.MEDIA_JSON
    resp.data = ApiError(exc.status_code, exc.description or exc.title or "Error", exc.title or "Error").body()


async def _json(req: falcon.asgi.Request) -> Any:
    raw = await req.stream.read()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(f"Request format is invalid: {e}") from None


def _int(v: Any, what: str, lo: int = 0, hi: int = 2 ** 64 - 1) -> int:
    """An integer (MindIE writes ports as strings) within [lo, hi], else a 400 naming ``what``."""
    if isinstance(v, bool):
        raise _bad(f"{what} must be an integer, got {json.dumps(v)}")
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise _bad(f"{what} must be an integer, got {json.dumps(v)}") from None
    if not lo <= n <= hi:
        raise _bad(f"{what} must be in [{lo}, {hi}], got {n}")
    return n


def _ids(body: Any, key: str = "ids") -> list[int]:
    if not isinstance(body, dict) or not isinstance(body.get(key), list):
        raise _bad(f"{key} must be a list of instance ids")
    return [_int(v, f"{key}[{i}]") for i, v in enumerate(body[key])]


class Probe:
    def __init__(self, coord: Any, ready: bool) -> None:
        self.coord, self.need_ready = coord, ready

    async def on_get(self, req, resp) -> None:
        if self.need_ready and (self.coord.stopping or not self.coord.registry.ready()):
            resp.status = 503
        resp.data = b""


class CoordinatorInfo:
    def __init__(self, coord: Any) -> None:
        self.coord = coord

    async def on_get(self, req, resp) -> None:
        insts = list(self.coord.registry.instances.values())
        stats = self.coord.relay_stats()
        resp.media = {
            "schedule_info": [{"id": i.id, "allocated_slots": i.inflight,
                               "allocated_blocks": max(0, i.total_blocks - i.avail_blocks)} for i in insts],
            "request_num": self.coord.relay.inflight,
            "request_length_info": stats,
            "instances": [i.describe() for i in insts],  # project extension
            "algorithm_type": self.coord.config.digs_scheduler_config.algorithm_type,
            "deploy_mode": self.coord.config.digs_scheduler_config.deploy_mode,
            "ready": bool(self.coord.registry.ready()),
        }


class RecvsInfo:
    def __init__(self, coord: Any) -> None:
        self.coord, self.last = coord, 0

    async def on_get(self, req, resp) -> None:
        now = self.coord.relay.received
        resp.media = {"is_master": True, "recv_flow": now - self.last}
        self.last = now


class Metrics:
    def __init__(self, coord: Any) -> None:
        self.coord = coord

    async def on_get(self, req, resp) -> None:
        resp.content_type = "text/plain; version=0.0.4; charset=utf-8"
        resp.data = await self.coord.metrics.render()


class Refresh:
    def __init__(self, coord: Any) -> None:
        self.coord = coord

    def _records(self, body: dict) -> tuple[str, list[Instance]]:
        """(event, instances) of either form: MindIE MS's (``ids`` + ``instances`` with ``port``)
        or the newer Motor's (``event`` + ``instances[].endpoints``)."""
        out: list[Instance] = []
        event = body.get("event", "set")
        if event not in ("add", "del", "set"):
            raise _bad(f'event must be "add", "del" or "set", got {json.dumps(event)}')
        items = body.get("instances")
        if not isinstance(items, list):
            raise _bad("instances must be a list")
        for n, it in enumerate(items):
            where = f"instances[{n}]"
            if not isinstance(it, dict):
                raise _bad(f"{where} must be an object")
            if isinstance(it.get("endpoints"), list):
                for m, ep in enumerate(it["endpoints"]):
                    w = f"{where}.endpoints[{m}]"
                    if not isinstance(ep, dict):
                        raise _bad(f"{w} must be an object")
                    out.append(self._one(ep, w, ep.get("business_port"), it.get("model_name", "")))
                continue
            out.append(self._one(it, where, it.get("port"), it.get("model_name", "")))
        return event, out

    def _one(self, it: dict, where: str, port: Any, model: Any) -> Instance:
        for k in ("id", "ip"):
            if k not in it:
                raise _bad(f"{where}.{k} is required")
        ip = it["ip"]
        if not isinstance(ip, str) or not ip:
            raise _bad(f"{where}.ip must be a non-empty string")
        if port is None:
            raise _bad(f"{where}.port (or business_port) is required")
        bport = _int(port, f"{where}.port", 1024, 65535)
        metric = _int(it["metric_port"], f"{where}.metric_port", 1024, 65535) if it.get("metric_port") else None
        mgmt = it.get("mgmt_port", metric)
        if mgmt is None:
            raise _bad(f"{where}.mgmt_port (or metric_port) is required: the instance's management port")
        static = it.get("static_info") or {}
        if not isinstance(static, dict):
            raise _bad(f"{where}.static_info must be an object")
        inst = Instance(id=_int(it["id"], f"{where}.id"), ip=ip, business_port=bport,
                        mgmt_port=_int(mgmt, f"{where}.mgmt_port", 1024, 65535), metric_port=metric,
                        model_name=model if isinstance(model, str) else "", source="refresh", static_info=static,
                        role_given=role_from_static(static) or parse_role(it.get("role")))
        dyn = it.get("dynamic_info") or {}
        if isinstance(dyn, dict):  # a first view until the poller's own
            inst.total_slots = int(static.get("total_slots_num") or 0)
            inst.total_blocks = int(static.get("total_block_num") or 0)
            inst.avail_slots = int(dyn.get("avail_slots_num") or inst.total_slots)
            inst.avail_blocks = int(dyn.get("avail_block_num") or inst.total_blocks)
        return inst

    async def on_post(self, req, resp) -> None:
        body = await _json(req)
        if not isinstance(body, dict):
            raise _bad("the body must be a JSON object")
        reg = self.coord.registry
        event, insts = self._records(body)
        ids = set(_ids(body)) if "ids" in body else None
        if ids is not None:
            missing = ids - {i.id for i in insts} - set(reg.instances)
            if missing:
                raise _bad(f"ids names {sorted(missing)}, which instances does not describe")
        total = len(set(reg.instances) | {i.id for i in insts}) if event != "set" else len(insts)
        if event != "del" and total > reg.max_instances:
            raise _bad(f"{total} instances, more than digs_scheduler_config.max_res_num ({reg.max_instances})")
        if event == "del":
            for i in insts:
                reg.remove(i.id)
                self.coord.router.forget(i.id)
        else:
            for i in insts:
                reg.add(i)
            if event == "set":
                keep = ids if ids is not None else {i.id for i in insts}
                for iid in [k for k in reg.instances if k not in keep]:
                    reg.remove(iid)
                    self.coord.router.forget(iid)
        await self.coord.poller.poll_all()  # route to them now, not at the next poll
        resp.data = b""


class OnOff:
    def __init__(self, coord: Any, online: bool) -> None:
        self.coord, self.online = coord, online

    async def on_post(self, req, resp) -> None:
        ids = _ids(await _json(req))
        reg = self.coord.registry
        unknown = [i for i in ids if i not in reg.instances]
        if unknown:
            raise _bad(f"no instance with id {unknown[0]}")
        for i in ids:
            reg.instances[i].online = self.online
            log.info("instance %d %s by the management API", i, "online" if self.online else "offline")
        reg.note()
        resp.data = b""


class StopService:
    """GET /stopService[?mode=Force] (the server's route, on the manage port): the coordinator
    refuses new requests (503), sends the same call to every instance (each drains its requests in
    progress, then stops), answers 200 when they have, then stops itself as on SIGTERM. A second
    call: 500, as the server answers it."""

    def __init__(self, coord: Any) -> None:
        self.coord = coord

    async def on_get(self, req, resp) -> None:
        coord = self.coord
        if coord.stopping:
            resp.status = 500
            resp.data = b""
            return
        coord.stopping = True
        force = req.get_param("mode") == "Force"
        insts = list(coord.registry.instances.values())
        log.warning("/stopService%s: new requests are refused; stopping %d instance(s)", " (Force)" if force else "",
                    len(insts))

        async def one(inst):
            try:
                r = await coord.mgmt.get(f"{inst.mgmt_url}/stopService", params={"mode": "Force"} if force else None,
                                         timeout=None)
                return f"instance {inst.id}: {r.status_code}"
            except Exception as e:  # an instance already gone is stopped too
                return f"instance {inst.id}: {type(e).__name__}"
        import asyncio
        results = await asyncio.gather(*(one(i) for i in insts))
        log.warning("/stopService: %s", ", ".join(results) or "no instances")
        resp.data = b""
        resp.schedule_sync(coord.request_stop)


class QueryTasks:
    def __init__(self, coord: Any) -> None:
        self.coord = coord

    async def on_post(self, req, resp) -> None:
        body = await _json(req)
        if not isinstance(body, dict):
            raise _bad("the body must be a JSON object")
        p, d = _int(body.get("p_id"), "p_id"), _int(body.get("d_id"), "d_id")
        reg = self.coord.registry
        busy = sum(reg.instances[i].inflight for i in (p, d) if i in reg.instances)
        resp.media = {"is_end": busy == 0}


def manage_app(coord: Any) -> falcon.asgi.App:
    app = falcon.asgi.App()
    live = Probe(coord, ready=False)
    ready = Probe(coord, ready=True)
    for path, res in [("/v1/startup", live), ("/v1/health", live), ("/v2/health/live", live),
                      ("/v1/readiness", ready), ("/v2/health/ready", ready),
                      ("/v1/coordinator_info", CoordinatorInfo(coord)), ("/recvs_info", RecvsInfo(coord)),
                      ("/metrics", Metrics(coord)), ("/v1/instances/refresh", Refresh(coord)),
                      ("/v1/instances/offline", OnOff(coord, False)), ("/v1/instances/online", OnOff(coord, True)),
                      ("/v1/instances/query_tasks", QueryTasks(coord)), ("/stopService", StopService(coord))]:
        app.add_route(path, res)
    app.set_error_serializer(_serialize)
    app.add_error_handler(ApiError, _api_error)
    return app
