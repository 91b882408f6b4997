"""Prometheus metrics with MindIE's names (mindie.md §2.4), labelled by model_name.

Under gunicorn, PROMETHEUS_MULTIPROC_DIR (set by scripts/launch.sh before any import of
prometheus_client) makes every front end write to shared files; /metrics aggregates them.
"""
from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_MULTIPROC = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)
E2E_BUCKETS = (1, 2.5, 5, 10, 15, 20, 30, 40, 50, 60)
TOKENS_BUCKETS = (10, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 16000, 20000, 32000, 50000, 64000, 128000)


class Metrics:
    def __init__(self, model_name: str):
        self.model = model_name
        lab = ["model_name"]
        self._received = Counter("request_received", "Requests received", lab).labels(model_name)
        self._success = Counter("request_success", "Requests finished successfully", lab).labels(model_name)
        self._failed = Counter("request_failed", "Requests that ended with an error", lab).labels(model_name)
        self._prompt = Counter("prompt_tokens", "Prompt tokens received", lab).labels(model_name)
        self._gen = Counter("generation_tokens", "Tokens generated", lab).labels(model_name)
        self._prompt_hist = Histogram("request_prompt_tokens", "Prompt tokens per request", lab,
                                      buckets=TOKENS_BUCKETS).labels(model_name)
        self._gen_hist = Histogram("request_generation_tokens", "Generated tokens per request", lab,
                                   buckets=TOKENS_BUCKETS).labels(model_name)
        kw = {"multiprocess_mode": "livemax"} if _MULTIPROC else {}
        self.running = Gauge("num_requests_running", "Requests running on the device workers", lab,
                             **kw).labels(model_name)
        self.waiting = Gauge("num_requests_waiting", "Requests waiting on the device workers", lab,
                             **kw).labels(model_name)
        self.cache_usage = Gauge("npu_cache_usage_perc", "KV-cache usage (1 = 100%)", lab, **kw).labels(model_name)

    def received(self) -> None:
        self._received.inc()

    def failed(self) -> None:
        self._failed.inc()

    def succeeded(self, generated: int) -> None:
        self._success.inc()
        self._gen.inc(generated)
        self._gen_hist.observe(generated)

    def prompt_tokens(self, n: int) -> None:
        self._prompt.inc(n)
        self._prompt_hist.observe(n)

    def workers(self, running: int, waiting: int, usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.cache_usage.set(usage)

    @staticmethod
    def render() -> tuple[bytes, str]:
        if _MULTIPROC:
            from prometheus_client import multiprocess
            registry = CollectorRegistry(support_collectors_without_names=True)
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        from prometheus_client import REGISTRY
        return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
