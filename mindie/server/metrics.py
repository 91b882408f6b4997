"""Prometheus metrics with MindIE's names, types and buckets (mindie.md §2.4), labelled by
``model_name`` (docs/metrics.md).

Two sources, merged at scrape time by whichever front end the scrape lands on:

- Request figures a front end measures itself (``request_*_total``, ``prompt_tokens_total``,
  ``generation_tokens_total`` and the histograms): ``prometheus_client`` metrics in
  ``Metrics``. Under gunicorn PROMETHEUS_MULTIPROC_DIR (set by scripts/launch.sh before any
  import of prometheus_client) makes every front end write them to shared files, so any front
  end's /metrics sums all of them, dead front ends included.
- Device-worker figures (running / waiting / swapped requests, KV-cache usage, preemptions,
  prefix-cache hit rate, throughputs): computed at scrape time from the scraping front end's
  latest heartbeat of every ready worker (every front end hears every worker; a worker sends
  one right after a step that changed its load), never stored in multiprocess gauge files: a
  gauge file keeps whatever its front end last wrote, for as long as nobody scrapes that front
  end. ``failed_request_perc`` is derived from the summed counters in the same scrape.
"""
from __future__ import annotations

import collections
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from mindie.contract import wire as P

_MULTIPROC = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))

# MindIE's bucket boundaries (mindie.md §2.4).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5)
E2E_BUCKETS = (1, 2.5, 5, 10, 15, 20, 30, 40, 50, 60)
TOKENS_BUCKETS = (10, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 16000, 20000, 32000, 50000, 64000, 128000)

# What /metrics answers: Prometheus text format 0.0.4, which generate_latest writes
# (prometheus_client >= 0.22 calls CONTENT_TYPE_LATEST 1.0.0, which scrapers may not all know).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Throughput gauges: tokens over this many recent seconds.
RATE_WINDOW_S = 10.0
# How often a front end samples its workers' heartbeats for the throughput history.
SAMPLE_INTERVAL_S = P.HEARTBEAT_INTERVAL_S
# Weight of one worker in the TTFT / TBT / prefix-hit averages saturates here: a worker's
# TTFT and TBT are means of its last 1000 samples (mindie.md §2.3).
AVERAGE_WINDOW = 1000


class Metrics:
    """The request metrics of one front end (one per process; several are harmless: each has
    its own registry, and in multiprocess mode they all add up in the shared files)."""

    def __init__(self, model_name: str):
        self.model = model_name
        self.registry = CollectorRegistry()
        lab = ["model_name"]
        r = self.registry

        def counter(name: str, doc: str):
            return Counter(name, doc, lab, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, lab, buckets=buckets, registry=r).labels(model_name)

        self._received = counter("request_received", "Requests received")
        self._success = counter("request_success", "Requests finished successfully")
        self._failed = counter("request_failed", "Requests that ended with an error")
        self._prompt = counter("prompt_tokens", "Prompt tokens of the requests accepted")
        # Every token a request generated, however it ended (cancelled, cut by a deadline, stopped):
        # the work was done, as prompt_tokens counts the prompts of requests that later failed.
        self._gen = counter("generation_tokens", "Tokens generated, for every request however it ended")
        self._prompt_hist = histogram("request_prompt_tokens", "Prompt tokens per request", TOKENS_BUCKETS)
        self._gen_hist = histogram("request_generation_tokens", "Generated tokens per successful request",
                                   TOKENS_BUCKETS)
        self._ttft = histogram("time_to_first_token_seconds", "Time to first token, seconds", TTFT_BUCKETS)
        self._tpot = histogram("time_per_output_token_seconds",
                               "Mean time per output token after the first, seconds", TPOT_BUCKETS)
        self._e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency, seconds", E2E_BUCKETS)

    # -- what the inference route reports --------------------------------------------------
    def received(self) -> None:
        self._received.inc()

    def failed(self, generated: int = 0) -> None:
        """A request that ended with an error, after generating ``generated`` tokens (a client that
        hung up mid-stream, a deadline that cut it): those tokens are counted as generated."""
        self._failed.inc()
        if generated:
            self._gen.inc(generated)

    def succeeded(self, generated: int) -> None:
        self._success.inc()
        self._gen.inc(generated)
        self._gen_hist.observe(generated)

    def prompt_tokens(self, n: int) -> None:
        self._prompt.inc(n)
        self._prompt_hist.observe(n)

    def observe(self, ttft_s: float | None, tpot_s: float | None, e2e_s: float) -> None:
        """Latencies of one successful request: time to first token, mean time per output token
        after the first (None when not measured, e.g. a single token), end to end."""
        if ttft_s is not None:
            self._ttft.observe(ttft_s)
        if tpot_s is not None:
            self._tpot.observe(tpot_s)
        self._e2e.observe(e2e_s)

    # -- scraping ---------------------------------------------------------------------------
    def families(self) -> list[Metric]:
        """The request metrics of every front end (multiprocess mode) or of this one."""
        if _MULTIPROC:
            from prometheus_client import multiprocess
            return list(multiprocess.MultiProcessCollector(None).collect())
        return list(self.registry.collect())

    def render(self, *collectors: "WorkerCollector") -> tuple[bytes, str]:
        """The /metrics body and its content type: the request metrics, then what each of
        ``collectors`` derives from the workers and from those request metrics."""
        fams = self.families()
        extra: dict[str, Metric] = {}
        for c in collectors:
            for fam in c.collect(fams):
                # several models' collectors derive the same families: one family each (a name's
                # HELP and TYPE once, as the exposition format wants), a sample per model_name
                if fam.name in extra:
                    extra[fam.name].samples.extend(fam.samples)
                else:
                    extra[fam.name] = fam
        return generate_latest(_Families(fams + list(extra.values()))), CONTENT_TYPE


class _Families:
    def __init__(self, fams: list[Metric]):
        self.fams = fams

    def collect(self) -> Iterable[Metric]:
        return self.fams


def counter_value(fams: Iterable[Metric], name: str, model_name: str) -> float:
    """The value of counter ``name`` (without ``_total``) for ``model_name`` in ``fams``."""
    total = 0.0
    for fam in fams:
        if fam.name != name:
            continue
        for s in fam.samples:
            if s.name == name + "_total" and s.labels.get("model_name") == model_name:
                total += s.value
    return total


# -- throughput history -------------------------------------------------------------------------
@dataclass(frozen=True)
class _Sample:
    t: float
    instance: str
    prompt: int
    generated: int


class HeartbeatHistory:
    """Per-worker history of the cumulative token counters of the heartbeats a front end heard,
    for the throughput gauges. Counters belong to a worker *instance*: a restarted worker starts
    again from 0, which counts as an increase of its whole new value (Prometheus ``rate()``
    semantics), never as a negative one; a worker first heard within a window of its start
    (``Heartbeat.uptime_s``) counts from 0 at its start. Thread-safe (a sampler thread records; scrapes record
    and read)."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window_s = window_s
        self._lock = threading.Lock()
        self._by_worker: dict[str, collections.deque[_Sample]] = {}

    def record(self, heartbeats: Iterable[P.Heartbeat], now: float) -> None:
        with self._lock:
            for hb in heartbeats:
                q = self._by_worker.get(hb.worker_id)
                if q is None:
                    q = self._by_worker[hb.worker_id] = collections.deque()
                    if 0 < hb.uptime_s <= self.window_s:
                        # First heard within a window of its start (a model loaded on demand
                        # serves at once): its counters were 0 then, so the tokens of its first
                        # moments count, instead of making the first sample the baseline.
                        q.append(_Sample(now - hb.uptime_s, hb.instance, 0, 0))
                if q and q[-1].t > now:
                    continue  # out of order (two recorders): keep the history monotonic
                q.append(_Sample(now, hb.instance, hb.prompt_tokens, hb.generated_tokens))
            self._prune(now)

    def _prune(self, now: float) -> None:
        """Drop samples older than the window, keeping the newest of them as the baseline (and
        forget a worker not heard of for two windows)."""
        start = now - self.window_s
        for wid in list(self._by_worker):
            q = self._by_worker[wid]
            while len(q) >= 2 and q[1].t <= start:
                q.popleft()
            if len(q) == 1 and q[0].t < start - self.window_s:
                del self._by_worker[wid]

    def rates(self, now: float) -> tuple[float, float]:
        """(prompt tokens/s, generated tokens/s) over the last ``window_s`` seconds (or over the
        history there is, when shorter), summed over the workers."""
        with self._lock:
            self._prune(now)
            prompt = gen = 0.0
            for q in self._by_worker.values():
                if len(q) < 2:
                    continue
                # From the baseline (the newest sample at or before the window's start) or,
                # with a shorter history, from the oldest sample.
                span = now - q[0].t
                if span <= 0:
                    continue
                dp = dg = 0
                prev = q[0]
                for s in list(q)[1:]:
                    if s.instance == prev.instance:
                        dp += max(0, s.prompt - prev.prompt)
                        dg += max(0, s.generated - prev.generated)
                    else:  # a restarted worker: its new counters started from 0
                        dp += s.prompt
                        dg += s.generated
                    prev = s
                prompt += dp / span
                gen += dg / span
            return prompt, gen


class _Sampler(threading.Thread):
    """Records ``client.heartbeats()`` into ``history`` every ``interval`` seconds, so the
    throughputs cover the last window even when /metrics was not scraped during it. Reads only
    (the links' dict and attributes, atomic under the GIL); stops with the owner or the process."""

    def __init__(self, heartbeats: Callable[[], list[P.Heartbeat]], history: HeartbeatHistory,
                 interval: float, owner: object):
        super().__init__(name="metrics-sampler", daemon=True)
        self.heartbeats = heartbeats
        self.history = history
        self.interval = interval
        self.owner = weakref.ref(owner)
        self.stopped = threading.Event()

    def run(self) -> None:
        while self.owner() is not None:
            try:
                self.history.record(self.heartbeats(), time.monotonic())
            except RuntimeError:  # a dict changed size while read: next tick
                pass
            if self.stopped.wait(self.interval):
                return


# -- scrape-time worker figures ------------------------------------------------------------------
def weighted_mean(values: Sequence[tuple[float, float]]) -> float:
    """Mean of (value, weight) pairs; 0 when the weights add up to 0."""
    wsum = sum(w for _, w in values)
    return sum(v * w for v, w in values) / wsum if wsum > 0 else 0.0


def prefix_hit_rate(heartbeats: Sequence[P.Heartbeat]) -> float:
    """The workers' prefix-cache hit rates weighted by the prompt tokens each looked up
    (computed prompt tokens / (1 - hit rate): only the misses are computed)."""
    pairs = []
    for hb in heartbeats:
        rate = min(max(hb.prefix_hit_rate, 0.0), 1.0)
        looked_up = hb.prompt_tokens / (1.0 - rate) if rate < 1.0 else hb.prompt_tokens
        pairs.append((rate, looked_up))
    return weighted_mean(pairs)


def latency_mean_ms(heartbeats: Sequence[P.Heartbeat], field: str) -> float:
    """TTFT or TBT (``field`` "ttft_ms" / "tbt_ms") over the workers: each worker's mean of its
    last 1000 samples, weighted by how full that window is (its generated tokens, up to 1000).
    Workers without a sample yet (0.0) are left out."""
    return weighted_mean([(getattr(hb, field), min(AVERAGE_WINDOW, max(1, hb.generated_tokens)))
                          for hb in heartbeats if getattr(hb, field) > 0])


def worker_families(model_name: str, heartbeats: Sequence[P.Heartbeat], rates: tuple[float, float],
                    received: float, failed: float) -> list[Metric]:
    """The worker-derived metric families (docs/metrics.md) from the latest heartbeat of each
    ready worker, the throughputs ``rates`` and the request counters summed over front ends."""
    lab = ["model_name"]
    out: list[Metric] = []

    def gauge(name: str, doc: str, value: float) -> None:
        g = GaugeMetricFamily(name, doc, labels=lab)
        g.add_metric([model_name], value)
        out.append(g)

    running = sum(hb.running for hb in heartbeats)
    swapped = sum(hb.swapped for hb in heartbeats)
    waiting = sum(max(0, hb.waiting - hb.swapped) for hb in heartbeats)
    free = sum(hb.free_blocks for hb in heartbeats)
    total = sum(hb.total_blocks for hb in heartbeats)
    gauge("num_requests_running", "Requests running on the device workers", running)
    gauge("num_requests_waiting", "Requests waiting to be scheduled (not preempted ones)", waiting)
    gauge("num_requests_swapped", "Preempted requests waiting to be recomputed", swapped)
    c = CounterMetricFamily("num_preemptions", "Preemptions since the device workers started", labels=lab)
    c.add_metric([model_name], sum(hb.preempted for hb in heartbeats))
    out.append(c)
    c = CounterMetricFamily("num_decode_holds", "Engine steps that held the running requests' decodes for "
                            "prompts (ScheduleConfig.decodeHoldMs) since the device workers started", labels=lab)
    c.add_metric([model_name], sum(hb.decode_holds for hb in heartbeats))
    out.append(c)
    gauge("avg_prompt_throughput_toks_per_s", f"Prompt tokens computed per second, last {RATE_WINDOW_S:g} s",
          rates[0])
    gauge("avg_generation_throughput_toks_per_s", f"Tokens generated per second, last {RATE_WINDOW_S:g} s",
          rates[1])
    gauge("failed_request_perc", "request_failed_total / request_received_total (1 = 100%)",
          failed / received if received > 0 else 0.0)
    gauge("npu_cache_usage_perc", "Device KV-cache usage (1 = 100%)", 1.0 - free / total if total else 0.0)
    gauge("cpu_cache_usage_perc", "Host (swap) KV-cache usage: always 0, there is no swap space", 0.0)
    gauge("npu_prefix_cache_hit_rate", "Prefix-cache hit rate of prompt tokens (1 = 100%)",
          prefix_hit_rate(heartbeats))
    # Speculative decoding (workers/engine/speculative.py), vLLM's counter names.
    for name, doc, field in (
            ("vllm:spec_decode_num_drafts", "Verify steps of a request with proposed tokens", "spec_drafts"),
            ("vllm:spec_decode_num_draft_tokens", "Tokens proposed by speculative decoding", "spec_draft_tokens"),
            ("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted", "spec_accepted_tokens")):
        c = CounterMetricFamily(name, doc + " since the device workers started", labels=lab)
        c.add_metric([model_name], sum(getattr(hb, field) for hb in heartbeats))
        out.append(c)
    per_pos: list[int] = []
    for hb in heartbeats:
        for j, v in enumerate(hb.spec_accepted_per_pos):
            per_pos.extend([0] * (j + 1 - len(per_pos)))
            per_pos[j] += v
    if per_pos:  # (no speculating worker: no positions)
        c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Proposed tokens accepted, by "
                                "position in the proposal (0 = the first), since the device workers started",
                                labels=lab + ["position"])
        for j, v in enumerate(per_pos):
            c.add_metric([model_name, str(j)], v)
        out.append(c)
    return out


class WorkerCollector:
    """The worker-derived figures of one front end's /metrics, computed at each scrape from its
    DeviceClient's latest heartbeats. Starts a sampler thread (``sample=True``) that keeps the
    heartbeat history the throughputs need."""

    def __init__(self, model_name: str, heartbeats: Callable[[], list[P.Heartbeat]],
                 history: HeartbeatHistory | None = None, sample: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.model_name = model_name
        self.heartbeats = heartbeats
        self.history = history or HeartbeatHistory()
        self.clock = clock
        self.sampler: _Sampler | None = None
        if sample:
            self.sampler = _Sampler(heartbeats, self.history, SAMPLE_INTERVAL_S, self)
            self.sampler.start()

    def collect(self, front_end_families: Iterable[Metric]) -> list[Metric]:
        hbs = self.heartbeats()
        now = self.clock()
        self.history.record(hbs, now)
        fams = list(front_end_families)
        return worker_families(self.model_name, hbs, self.history.rates(now),
                               counter_value(fams, "request_received", self.model_name),
                               counter_value(fams, "request_failed", self.model_name))

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.stopped.set()
