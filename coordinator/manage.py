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

A malformed body is a 400 in MindIE's shape ({"error", "error_type"}) naming the field, and
nothing of it is stored (coordinator/refresh_schema.py); a body over ``request_limit.body_limit``
is a 413. An instance a refresh adds is routed to only once admitted (coordinator/admission_check.py).
With a bearer token configured (coordinator/manage_auth.py) every route but the probes needs it.
"""
from __future__ import annotations

import json
import logging
from typing import Any

import falcon
import falcon.asgi
import msgspec

from coordinator import refresh_schema
from coordinator.admission_check import own_by_address
from coordinator.manage_auth import middleware
from coordinator.pd_pairing import parse_role, role_from_static
from coordinator.registry import ADDED_LOGGED, POLL_CONCURRENCY, Instance
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


async def _raw(req: falcon.asgi.Request, limit: int) -> bytes:
    """The body, at most ``limit`` bytes (else 413): a manage call is small, whoever sends it."""
    if req.content_length is not None and req.content_length > limit:
        raise ApiError(413, f"The request body is larger than request_limit.body_limit ({limit >> 20} MB).")
    chunks, size = [], 0
    async for chunk in req.stream:
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"The request body is larger than request_limit.body_limit ({limit >> 20} MB).")
        chunks.append(chunk)
    return b"".join(chunks)


async def _json(req: falcon.asgi.Request, limit: int = 10 << 20) -> Any:
    raw = await _raw(req, limit)
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
        # msgspec: with thousands of instances the stdlib encoder held the event loop 8x longer
        resp.content_type = falcon.MEDIA_JSON
        resp.data = msgspec.json.encode({
            "schedule_info": [{"id": i.id, "allocated_slots": i.inflight,
                               "allocated_blocks": max(0, i.total_blocks - i.avail_blocks)} for i in insts],
            "request_num": self.coord.relay.inflight,
            "request_length_info": stats,
            "instances": [i.describe() for i in insts],  # project extension
            "algorithm_type": self.coord.config.digs_scheduler_config.algorithm_type,
            "deploy_mode": self.coord.config.digs_scheduler_config.deploy_mode,
            "ready": bool(self.coord.registry.ready()),
        })


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

    def _own(self, rec: refresh_schema.Rec) -> None:
        """A 400 when a port of ``rec`` is one of this coordinator's listeners (relayed to itself)."""
        own = self.coord.own_listeners()
        bkey = "business_port" if ".endpoints[" in rec.where else "port"
        for key, port in ((bkey, rec.business_port), ("mgmt_port", rec.mgmt_port), ("metric_port", rec.metric_port)):
            name = own_by_address(rec.ip, port, own) if port else None
            if name:
                raise _bad(f"{rec.where}.{key}: {rec.ip}:{port} is this coordinator's own {name} port, "
                           "not a server instance")

    @staticmethod
    def _instance(rec: refresh_schema.Rec) -> Instance:
        static = rec.static_info
        inst = Instance(id=rec.id, ip=rec.ip, business_port=rec.business_port, mgmt_port=rec.mgmt_port,
                        metric_port=rec.metric_port, model_name=rec.model_name, model_expected=rec.model_name,
                        source="refresh", static_info=static,
                        role_given=role_from_static(static) or parse_role(rec.role))
        # a first view until the poller's own
        inst.total_slots = int(static.get("total_slots_num") or 0)
        inst.total_blocks = int(static.get("total_block_num") or 0)
        dyn = rec.dynamic_info
        inst.avail_slots = (dyn.avail_slots_num if dyn else 0) or inst.total_slots
        inst.avail_blocks = (dyn.avail_block_num if dyn else 0) or inst.total_blocks
        return inst

    async def on_post(self, req, resp) -> None:
        coord = self.coord
        reg = coord.registry
        raw = await _raw(req, coord.config.request_limit.body_limit << 20)
        try:
            doc = refresh_schema.parse(raw)
            n = refresh_schema.count(doc)
            if n > reg.max_instances:  # bounded before any record is validated
                raise _bad(f"{n} instances, more than digs_scheduler_config.max_res_num ({reg.max_instances})")
            body = refresh_schema.validate(doc)
            recs = refresh_schema.records(body)
        except refresh_schema.RefreshError as e:
            raise _bad(str(e)) from None
        for r in recs:
            self._own(r)
        event = body.event
        ids = set(body.ids) if body.ids is not None else None
        mine = {r.id for r in recs}
        if ids is not None:
            missing = ids - mine - set(reg.instances)
            if missing:
                raise _bad(f"ids names {sorted(missing)}, which instances does not describe")
        total = len(set(reg.instances) | mine) if event != "set" else len(recs)
        if event != "del" and total > reg.max_instances:
            raise _bad(f"{total} instances, more than digs_scheduler_config.max_res_num ({reg.max_instances})")
        if event != "del":
            # an endpoint already another instance's (one kept by this refresh): two ids, one server
            kept = [i for iid, i in reg.instances.items() if iid not in mine
                    and (event == "add" or (ids is not None and iid in ids))]
            taken = {(i.ip.lower(), i.business_port): i.id for i in kept}
            for r in recs:
                other = taken.get((r.ip.lower(), r.business_port))
                if other is not None:
                    raise _bad(f"{r.where}.ip: {r.ip}:{r.business_port} is already instance {other}'s endpoint")
        # validated: stored from here on, nothing can fail half way
        gone: set[int] = set()
        added: list[Instance] = []
        if event == "del":
            gone = mine & set(reg.instances)
        else:
            for k, r in enumerate(recs):
                before = reg.instances.get(r.id)
                inst = reg.add(self._instance(r), quiet=k >= ADDED_LOGGED)
                if inst is not before:
                    added.append(inst)
            if event == "set":
                keep = ids if ids is not None else mine
                gone = {iid for iid in reg.instances if iid not in keep}
        for k, iid in enumerate(sorted(gone)):
            reg.remove(iid, quiet=k >= ADDED_LOGGED)
        coord.router.forget_all(gone)
        log.info("refresh (%s): %d record(s), %d instance(s) added, %d removed, %d in all", event, len(recs),
                 len(added), len(gone), len(reg.instances))
        if added and len(added) <= POLL_CONCURRENCY:
            # a few: routed to now if they answer (each poll has its own deadline), not at the next poll
            await coord.poller.poll_all(added, wait_s=coord.poller.timeout_s)
        coord.poller.kick()
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
        # the servers it reaches: not an endpoint never admitted (a decoy gets no stop call)
        insts = [i for i in coord.registry.instances.values() if i.admitted or i.reached]
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
    app = falcon.asgi.App(middleware=middleware())
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
