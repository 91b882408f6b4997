"""``/metrics`` on the manage port: every instance's own metrics with an ``instance`` label
added (MindIE's names: ``request_received_total``, ``num_requests_running``, ... as each instance
reports them), then the coordinator's own counters. Instance scrapes are reused for
``prometheus_metrics_config.reuse_time`` seconds (MindIE's meaning).

Coordinator metrics (prefix ``coordinator_``; MindIE's request counter names after it):
``coordinator_request_received_total``, ``coordinator_request_success_total``,
``coordinator_request_failed_total`` (by ``code``), ``coordinator_request_refused_total`` (by
``reason``: max_requests), ``coordinator_retries_total`` (by ``reason``),
``coordinator_routing_decisions_total`` (by ``decision``: load, affinity_hit, affinity_miss,
affinity_busy, affinity_cold, and ``instance``), ``coordinator_breaker_trips_total`` (by ``instance``),
``coordinator_streams_cut_total``, ``coordinator_client_disconnects_total``,
``coordinator_requests_inflight`` and ``coordinator_instance_ready`` (by ``instance``),
``coordinator_e2e_request_latency_seconds`` and ``coordinator_time_to_first_token_seconds``
(histograms, as seen by the coordinator: relay and routing included).
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class CoordinatorMetrics:
    def __init__(self, coord: Any) -> None:
        self.coord = coord
        r = self.registry = CollectorRegistry()
        self.c_received = Counter("coordinator_request_received", "Requests received on the predict port.",
                                  registry=r)
        self.c_success = Counter("coordinator_request_success", "Requests answered with a 2xx status.", registry=r)
        self.c_failed = Counter("coordinator_request_failed", "Requests answered with an error status.", ["code"],
                                registry=r)
        self.c_refused = Counter("coordinator_request_refused", "Requests refused at once by request_limit.",
                                 ["reason"], registry=r)
        self.c_retries = Counter("coordinator_retries", "Requests sent again to another instance.", ["reason"],
                                 registry=r)
        self.c_routed = Counter("coordinator_routing_decisions", "Routing decisions.", ["decision", "instance"],
                                registry=r)
        self.c_trips = Counter("coordinator_breaker_trips", "Circuit breaker openings.", ["instance"], registry=r)
        self.c_cut = Counter("coordinator_streams_cut", "Streams ended with an error frame after the first token.",
                             registry=r)
        self.c_gone = Counter("coordinator_client_disconnects", "Clients that hung up before their answer ended.",
                              registry=r)
        self.g_inflight = Gauge("coordinator_requests_inflight", "Requests in flight on each instance.",
                                ["instance"], registry=r)
        self.g_ready = Gauge("coordinator_instance_ready", "1 when the instance takes requests.", ["instance"],
                             registry=r)
        self.h_e2e = Histogram("coordinator_e2e_request_latency_seconds", "Request time at the coordinator.",
                               buckets=BUCKETS, registry=r)
        self.h_ttft = Histogram("coordinator_time_to_first_token_seconds", "Time to the first byte of the answer.",
                                buckets=BUCKETS, registry=r)
        self._cache: tuple[float, bytes] = (0.0, b"")
        self._lock = asyncio.Lock()

    # -- events (called by the relay) ------------------------------------------------------------
    def received(self, path: str) -> None:
        self.c_received.inc()

    def refused(self, reason: str) -> None:
        self.c_refused.labels(reason).inc()

    def routed(self, decision: str, iid: int) -> None:
        self.c_routed.labels(decision, str(iid)).inc()

    def retry(self, reason: str) -> None:
        self.c_retries.labels(reason).inc()

    def breaker_trip(self, iid: int) -> None:
        self.c_trips.labels(str(iid)).inc()

    def cut(self) -> None:
        self.c_cut.inc()

    def disconnect(self) -> None:
        self.c_gone.inc()

    def inflight(self, iid: int, n: int) -> None:
        self.g_inflight.labels(str(iid)).set(n)

    def finished(self, rec: dict, seconds: float) -> None:
        status = rec.get("status") or 0
        if 200 <= status < 300 and rec.get("outcome", "") == "":
            self.c_success.inc()
        else:
            self.c_failed.labels(str(status)).inc()
        self.h_e2e.observe(seconds)
        if rec.get("ttft_ms") is not None:
            self.h_ttft.observe(rec["ttft_ms"] / 1000)

    # -- /metrics --------------------------------------------------------------------------------
    async def render(self) -> bytes:
        reuse = self.coord.config.prometheus_metrics_config.reuse_time
        async with self._lock:
            at, text = self._cache
            if time.monotonic() - at >= reuse:
                text = await self._scrape()
                self._cache = (time.monotonic(), text)
        for inst in list(self.coord.registry.instances.values()):
            self.g_ready.labels(str(inst.id)).set(1 if inst.ready() else 0)
        return text + generate_latest(self.registry)

    async def _scrape(self) -> bytes:
        # admitted instances only: an endpoint that is not a server (or not there) is not scraped
        insts = [i for i in self.coord.registry.instances.values() if i.admitted]

        async def one(inst):
            try:
                r = await self.coord.mgmt.get(inst.metrics_url, timeout=3.0)
                return inst, r.text if r.status_code == 200 else ""
            except httpx.HTTPError:
                return inst, ""
        results = await asyncio.gather(*(one(i) for i in insts))
        families: dict[str, tuple[str, str, list[str]]] = {}
        for inst, text in results:
            if not text:
                continue
            try:
                for fam in text_string_to_metric_families(text):
                    name = fam.name + "_total" if fam.type == "counter" else fam.name
                    entry = families.setdefault(name, (fam.type, fam.documentation, []))
                    for s in fam.samples:
                        if s.name.endswith("_created"):
                            continue
                        labels = dict(s.labels)
                        labels["instance"] = str(inst.id)
                        lab = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
                        entry[2].append(f"{s.name}{{{lab}}} {_num(s.value)}")
            except ValueError:
                continue  # an instance answered something that is not Prometheus text
        out = []
        for name, (typ, doc, lines) in families.items():
            out.append(f"# HELP {name} {doc}")
            out.append(f"# TYPE {name} {typ}")
            out += lines
        return ("\n".join(out) + "\n").encode() if out else b""


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if v != v or v in (float("inf"), float("-inf")):
        return {True: "NaN"}.get(v != v) or ("+Inf" if v > 0 else "-Inf")
    if v == int(v) and abs(v) < 1e15:
        return str(int(v))
    return repr(v)
