"""Load shapes, sweeps, result files and plots.

A *segment* is one measured load: warm-up requests first (at the same concurrency, not
counted), then the measured requests under either

* fixed concurrency: ``c`` workers each send their next request as soon as their last
  one finished; or
* a request rate: Poisson arrivals (exponential gaps, seeded) of ``rate`` requests/s,
  optionally capped at ``c`` in flight (like ``vllm bench serve --max-concurrency``).

A run is one segment per concurrency level of a sweep; it writes one JSON file.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Coroutine, Optional, Sequence, TypeVar

from mindie_bench import stats as st
from mindie_bench.api_clients import Adapter, HttpClient, RequestResult
from mindie_bench.workload import RequestSpec, WorkloadFn

T = TypeVar("T")
WARMUP_SEED_OFFSET = 1_000_003  # warm-up prompts differ from measured ones (no prefix-cache help)


@dataclass
class LoadConfig:
    """How to load the server for one segment (see the CLI help for each field)."""

    concurrency: Optional[int] = 1
    request_rate: float = math.inf
    num_prompts: Optional[int] = None  # None: max(32, 4 * concurrency), or 100 without a cap
    duration: Optional[float] = None
    warmup: Optional[int] = None  # None: one request per concurrency slot
    seed: int = 0
    timeout: Optional[float] = 600.0
    progress: bool = True
    save_itl: bool = False
    insecure: bool = False

    def prompts(self) -> int:
        if self.num_prompts is not None:
            return self.num_prompts
        return max(32, 4 * self.concurrency) if self.concurrency else 100

    def warmups(self) -> int:
        if self.warmup is not None:
            return self.warmup
        return self.concurrency or 1


@dataclass
class Segment:
    """One measured segment: its results and run-level statistics."""

    label: str
    concurrency: Optional[int]
    request_rate: float
    results: list[RequestResult]
    duration: float
    t0: float
    stats: dict[str, Any] = field(default_factory=dict)

    def to_json(self, save_itl: bool = False) -> dict[str, Any]:
        reqs = []
        for r in sorted(self.results, key=lambda r: r.index):
            rec: dict[str, Any] = {
                "index": r.index, "ok": r.ok, "error": r.error, "start_s": r.start - self.t0,
                "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                "ttft_ms": None if r.ttft is None else r.ttft * 1e3, "e2e_ms": r.e2e * 1e3,
                "tpot_ms": None if (t := st.tpot(r)) is None else t * 1e3,
            }
            if save_itl:
                rec["token_times_ms"] = [(t - r.start) * 1e3 for t in r.chunk_times]
                rec["chunk_tokens"] = r.chunk_tokens
            reqs.append(rec)
        return {"label": self.label, "concurrency": self.concurrency,
                "request_rate": None if math.isinf(self.request_rate) else self.request_rate,
                "stats": self.stats, "requests": reqs}


# ----------------------------------------------------------------------------- progress bar


class Progress:
    """A one-line progress bar on stderr (redrawn 4x/s on a TTY, a line per 10 s otherwise)."""

    def __init__(self, label: str, total: Optional[int], duration: Optional[float], enabled: bool) -> None:
        self.label, self.total, self.duration = label, total, duration
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.done = self.errors = self.tokens = 0
        self.t0 = time.perf_counter()
        self._handle: Optional[asyncio.TimerHandle] = None

    def start(self) -> None:
        self.t0 = time.perf_counter()
        if self.enabled:
            self._tick()

    def update(self, r: RequestResult) -> None:
        self.done += 1
        self.errors += not r.ok
        self.tokens += r.output_tokens

    def _line(self) -> str:
        el = time.perf_counter() - self.t0
        if self.total:
            frac = min(1.0, self.done / self.total)
            count = f"{self.done}/{self.total}"
        elif self.duration:
            frac = min(1.0, el / self.duration)
            count = f"{self.done}"
        else:
            frac, count = 0.0, f"{self.done}"
        bar = "#" * int(frac * 24)
        return (f"{self.label} [{bar:<24}] {count} err {self.errors} "
                f"{el:6.1f}s {self.tokens / el if el > 0 else 0.0:8.1f} tok/s")

    def _tick(self) -> None:
        if self.tty:
            sys.stderr.write("\r" + self._line() + "\x1b[K")
            sys.stderr.flush()
        elif time.perf_counter() - self.t0 > 1.0:
            sys.stderr.write(self._line() + "\n")
        self._handle = asyncio.get_running_loop().call_later(0.25 if self.tty else 10.0, self._tick)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        if self.enabled:
            sys.stderr.write(("\r" if self.tty else "") + self._line() + ("\x1b[K\n" if self.tty else "\n"))
            sys.stderr.flush()


# ----------------------------------------------------------------------------- load shapes


async def drive(adapter: Adapter, client: HttpClient, specs: Sequence[RequestSpec], *,
                concurrency: Optional[int], request_rate: float = math.inf,
                duration: Optional[float] = None, seed: int = 0, timeout: Optional[float] = None,
                progress: Optional[Progress] = None) -> tuple[list[RequestResult], float, float]:
    """Send ``specs`` (cycled until ``duration`` if given) under the load shape; returns
    (results, wall seconds from first send to last completion, start time)."""
    if not specs:
        raise ValueError("no requests")
    if duration is None and concurrency is None and math.isinf(request_rate):
        concurrency = len(specs)
    if duration is not None and concurrency is None and math.isinf(request_rate):
        raise ValueError("--duration with an unlimited request rate needs a concurrency")
    results: list[RequestResult] = []
    n = len(specs)
    issued = 0
    t0 = time.perf_counter()
    deadline = t0 + duration if duration else None

    def next_spec() -> Optional[RequestSpec]:
        nonlocal issued
        if deadline is None:
            if issued >= n:
                return None
        elif time.perf_counter() >= deadline:
            return None
        i = issued
        issued += 1
        s = specs[i % n]
        return s if i < n else replace(s, index=i)

    async def one(spec: RequestSpec) -> None:
        r = await adapter.send(client, spec, timeout)
        results.append(r)
        if progress is not None:
            progress.update(r)

    if progress is not None:
        progress.start()
    try:
        if math.isinf(request_rate):
            async def worker() -> None:
                while (spec := next_spec()) is not None:
                    await one(spec)

            assert concurrency is not None
            await asyncio.gather(*(worker() for _ in range(min(concurrency, n) if deadline is None else concurrency)))
        else:
            rng = random.Random(seed)
            sem = asyncio.Semaphore(concurrency) if concurrency else None
            tasks: set[asyncio.Task[None]] = set()

            async def gated(spec: RequestSpec) -> None:
                try:
                    await one(spec)
                finally:
                    if sem is not None:
                        sem.release()

            next_t = t0
            while True:
                delay = next_t - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if sem is not None:
                    await sem.acquire()
                spec = next_spec()
                if spec is None:
                    if sem is not None:
                        sem.release()
                    break
                task = asyncio.create_task(gated(spec))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                next_t += rng.expovariate(request_rate)
            while tasks:
                await asyncio.gather(*list(tasks))
    finally:
        if progress is not None:
            progress.close()
    return results, time.perf_counter() - t0, t0


async def run_segment(adapter: Adapter, workload: WorkloadFn, cfg: LoadConfig, label: str = "") -> Segment:
    """Warm up, then measure one segment with a fresh connection pool."""
    client = HttpClient(insecure=cfg.insecure)
    try:
        nw = cfg.warmups()
        if nw > 0:
            warm = getattr(workload, "warmup", workload)  # the chat workload's own warm-up questions
            wspecs = warm(nw, cfg.seed + WARMUP_SEED_OFFSET)
            wres, _, _ = await drive(adapter, client, wspecs, concurrency=cfg.concurrency or nw,
                                     timeout=cfg.timeout,
                                     progress=Progress(f"{label} warm-up", nw, None, cfg.progress))
            bad = [r for r in wres if not r.ok]
            if bad and len(bad) == len(wres):
                print(f"warning: every warm-up request failed, e.g. {bad[0].error}", file=sys.stderr)
        specs = workload(cfg.prompts(), cfg.seed)
        cpu0 = time.process_time()
        results, dur, t0 = await drive(
            adapter, client, specs, concurrency=cfg.concurrency, request_rate=cfg.request_rate,
            duration=cfg.duration, seed=cfg.seed, timeout=cfg.timeout,
            progress=Progress(label, None if cfg.duration else len(specs), cfg.duration, cfg.progress))
        cpu = time.process_time() - cpu0
    finally:
        await client.aclose()
    seg = Segment(label, cfg.concurrency, cfg.request_rate, results, dur, t0)
    seg.stats = st.aggregate(results, dur)
    # The load generator's own CPU use (fraction of one core): near 1.0 means the client,
    # not the server, may be limiting the measurement.
    seg.stats["client_cpu_s"] = cpu
    seg.stats["client_cpu_util"] = cpu / dur if dur > 0 else math.nan
    if dur > 1.0 and cpu / dur > 0.8:
        print(f"warning: {label}: the load generator used {cpu / dur:.0%} of a core; it may be the bottleneck",
              file=sys.stderr)
    return seg


async def run_sweep(adapter: Adapter, workload: WorkloadFn, levels: Sequence[Optional[int]],
                    cfg: LoadConfig) -> list[Segment]:
    """One segment per concurrency level, in order."""
    segs = []
    for c in levels:
        label = f"{adapter.api} c={c}" if c else f"{adapter.api} rate={cfg.request_rate:g}"
        segs.append(await run_segment(adapter, workload, replace(cfg, concurrency=c), label))
    return segs


# ----------------------------------------------------------------------------- environment


def machine_info() -> dict[str, Any]:
    """Where the load generator ran."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": sys.version.split()[0],
        "python_impl": platform.python_implementation(),
        "hostname": platform.node(),
    }
    try:
        info["cpu_affinity"] = len(os.sched_getaffinity(0))
        info["loadavg"] = os.getloadavg()
    except (AttributeError, OSError):
        pass
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


async def server_info(adapter: Adapter, insecure: bool = False) -> dict[str, Any]:
    """``GET /v1/models`` (and ``/info`` for TGI) of the server, or the error."""
    client = HttpClient(insecure=insecure)
    out: dict[str, Any] = {"url": adapter.base}
    paths = ["/v1/models"] + (["/info"] if adapter.api == "tgi" else [])
    try:
        for p in paths:
            try:
                out[p] = await client.get_json(adapter.base + p, timeout=10.0)
            except Exception as e:
                out[p] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        await client.aclose()
    return out


def run_async(coro: Coroutine[Any, Any, T], use_uvloop: bool = True) -> T:
    """Run ``coro`` on uvloop when installed (a cheaper event loop for the client)."""
    if use_uvloop:
        try:
            import uvloop

            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(coro)
        except ImportError:
            pass
    return asyncio.run(coro)


# ----------------------------------------------------------------------------- output


def _clean(obj: Any) -> Any:
    """NaN/inf to null so the file is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def result_path(out_dir: str | Path, kind: str, tag: str) -> Path:
    """``OUT/<kind>-<tag>-<UTC time>.json``; a suffix keeps files unique within a second."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    p = d / f"{kind}-{tag}-{stamp}.json"
    k = 1
    while p.exists():
        p = d / f"{kind}-{tag}-{stamp}-{k}.json"
        k += 1
    return p


def write_json(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(json.dumps(_clean(doc), indent=1) + "\n", encoding="utf-8")
    return path


def sweep_table(rows: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """Compact table: one row per (label, stats)."""
    head = (f"{'segment':<22}{'req/s':>8}{'out tok/s':>11}{'tot tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
            f"{'TPOT p50':>10}{'ITL p99':>9}{'E2E p50':>10}{'fail':>6}")
    lines = [head, "-" * len(head)]
    for label, s in rows:
        lines.append(f"{label:<22}{s['request_throughput']:>8.2f}{s['output_throughput']:>11.1f}"
                     f"{s['total_token_throughput']:>11.1f}{s['ttft_ms']['p50']:>10.1f}{s['ttft_ms']['p99']:>10.1f}"
                     f"{s['tpot_ms']['p50']:>10.2f}{s['itl_ms']['p99']:>9.2f}{s['e2e_ms']['p50']:>10.1f}"
                     f"{s['failed']:>6}")
    return "\n".join(lines) + "\n(latencies in ms)"


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install 'mindie-py[bench]')", file=sys.stderr)
        return None


_METRICS: tuple[tuple[str, str, Callable[[RequestResult], list[float]]], ...] = (
    ("ttft", "TTFT (ms)", lambda r: [] if r.ttft is None else [r.ttft * 1e3]),
    ("tpot", "TPOT (ms)", lambda r: [] if (t := st.tpot(r)) is None else [t * 1e3]),
    ("itl", "ITL (ms)", lambda r: [g * 1e3 for g in st.itls(r)]),
    ("e2e", "E2E latency (ms)", lambda r: [r.e2e * 1e3]),
)


def _save(plt: Any, fig: Any, path: Path, title: str) -> Path:
    """Grid and legend on every axis of ``fig``, the title, and the PNG written to ``path``."""
    for ax in fig.axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_cdfs(series: Sequence[tuple[str, Sequence[RequestResult]]], path: Path, title: str = "") -> Optional[Path]:
    """Latency CDFs (TTFT, TPOT, ITL, E2E), one line per series, in one PNG."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (_, name, fn) in zip(axes.flat, _METRICS):
        for label, results in series:
            xs = sorted(v for r in results if r.ok for v in fn(r))
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=label)
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of samples")
    return _save(plt, fig, path, title)


def plot_sweep(series: Sequence[tuple[str, Sequence[tuple[int, dict[str, Any]]]]], path: Path,
               title: str = "") -> Optional[Path]:
    """Output tok/s and p99 TTFT against concurrency; ``series`` = (label, [(c, stats)])."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for label, pts in series:
        cs = [c for c, _ in pts]
        a1.plot(cs, [s["output_throughput"] for _, s in pts], marker="o", label=label)
        a2.plot(cs, [s["ttft_ms"]["p99"] for _, s in pts], marker="o", label=label)
    ticks = sorted({c for _, pts in series for c, _ in pts})
    for ax, yl in ((a1, "output tokens/s"), (a2, "p99 TTFT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(c) for c in ticks])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(yl)
    return _save(plt, fig, path, title)


def run_document(argv: Sequence[str], kind: str, config: dict[str, Any]) -> dict[str, Any]:
    """The common head of every result file."""
    return {
        "kind": kind,
        "command": " ".join(argv),
        "argv": list(argv),
        "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "config": config,
    }
