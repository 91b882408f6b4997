"""Metrics routes: Prometheus ``GET /metrics`` (metrics plane, mindie.md §2.4) and
``GET /metrics-json`` (management plane, §2.3). docs/metrics.md says what each figure is."""
from __future__ import annotations

import os

import falcon
import falcon.asgi
import msgspec

from mindie.device_client import DeviceClient
from mindie.contract.http_error import ApiError
from mindie.server.metrics import Metrics, WorkerCollector, latency_mean_ms

MONITOR_ENV = "MIES_SERVICE_MONITOR_MODE"
MONITOR_OFF = ApiError(500, f"Environment variable {MONITOR_ENV} is not set.")


def monitor_enabled(env=os.environ) -> bool:
    """MindIE serves /metrics only with MIES_SERVICE_MONITOR_MODE=1. Decision: unset (or empty)
    also serves, so the metrics plane works without extra setup; any other value ("0") gets
    MindIE's 500."""
    value = env.get(MONITOR_ENV)
    return not value or value == "1"


class MetricsResource:
    """GET /metrics: the request metrics of every front end plus the device workers' figures as
    this front end's latest heartbeats show them, labelled ``model_name``."""

    def __init__(self, metrics: Metrics, client: DeviceClient):
        self.metrics = metrics
        self.client = client
        self.workers = WorkerCollector(metrics.model, client.heartbeats)
        self.others: list[WorkerCollector] = []  # the other models' of a server of several (app.py)

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if not monitor_enabled():
            resp.status = MONITOR_OFF.status
            resp.content_type = falcon.MEDIA_JSON
            resp.data = MONITOR_OFF.body()
            return
        data, ctype = self.metrics.render(self.workers, *self.others)
        resp.content_type = ctype
        resp.data = data


class MetricsJsonResource:
    """GET /metrics-json: MindIE's ``JsonHttpMetrics`` document, every value a string of an
    integer (MindIE ``std::to_string`` of integer figures): TTFT and TBT in ms (each worker's
    mean of its last 1000, weighted over workers), waiting requests, requests in the system
    (running + waiting + preempted) and free KV blocks, summed over the ready workers.
    ``instance`` is "<managementIpAddress>:<managementPort>". 503 without a body while no device
    worker is ready (MindIE's health pre-check)."""

    def __init__(self, client: DeviceClient, instance: str):
        self.client = client
        self.instance = instance

    def document(self) -> dict:
        hbs = self.client.heartbeats()
        values = (
            ("TTFT", int(latency_mean_ms(hbs, "ttft_ms"))),
            ("TBT", int(latency_mean_ms(hbs, "tbt_ms"))),
            ("waitingInferRequestNum", sum(max(0, hb.waiting - hb.swapped) for hb in hbs)),
            ("processingInferRequestNum", sum(hb.running + hb.waiting for hb in hbs)),
            ("remainBlocks", sum(hb.free_blocks for hb in hbs)),
        )
        return {"resultType": "vector", "result": [
            {"metric": [{"__name__": name, "job": "node", "instance": self.instance}], "value": str(value)}
            for name, value in values]}

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if not self.client.ready_links():
            resp.status = 503
            resp.data = b""
            return
        resp.content_type = falcon.MEDIA_JSON
        resp.data = msgspec.json.encode(self.document())
