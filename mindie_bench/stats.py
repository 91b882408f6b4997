"""Metric definitions, the same as ``vllm bench serve`` (vllm/benchmarks/serve.py).

Per successful request (times from ``time.perf_counter`` on the client):

* **TTFT**: first token frame's arrival minus the moment the request was sent.
* **E2E**: last token frame's arrival minus the moment the request was sent.
* **TPOT**: ``(E2E - TTFT) / (output_tokens - 1)``, only for requests with more than one
  output token; it excludes the first token (prefill and queueing).
* **ITL**: every gap between two consecutive token frames, pooled over all requests. A
  frame holding k tokens is one gap, as in vLLM (so ITL can exceed TPOT when a server
  batches tokens into frames).

Run level: ``duration`` is the wall time from the first request sent to the last request
finished (warm-up excluded); request throughput = successful requests / duration; output
tok/s = output tokens of successful requests / duration; total tok/s adds their prompt
tokens. Failed requests count only in ``failed`` and the error list.

Each latency distribution reports mean, std (population), min, max and the percentiles
p50/p90/p99 computed by **linear interpolation between closest ranks**, numpy's default
(``method="linear"``): for sorted x of length n, rank ``h = (n-1) * q/100`` and
``p = x[floor(h)] + (h - floor(h)) * (x[floor(h)+1] - x[floor(h)])``.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Any, Iterable, Optional, Sequence

from mindie_bench.api_clients import RequestResult

PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)
MAX_ERRORS_SHOWN = 5


def percentile(values: Iterable[float], q: float, *, presorted: bool = False) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation (numpy's default); NaN if empty."""
    xs: Sequence[float] = values if presorted and isinstance(values, Sequence) else sorted(values)
    n = len(xs)
    if n == 0:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError("q must be in [0, 100]")
    h = (n - 1) * q / 100.0
    lo = int(math.floor(h))
    hi = min(lo + 1, n - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def summarize(values: Iterable[float], scale: float = 1.0,
              percentiles: Sequence[float] = PERCENTILES) -> dict[str, float]:
    """mean/std/min/max/pNN of ``values * scale`` (``scale=1000`` turns seconds into ms)."""
    xs = sorted(v * scale for v in values)
    n = len(xs)
    out: dict[str, float] = {"n": n}
    if n == 0:
        out.update(mean=math.nan, std=math.nan, min=math.nan, max=math.nan)
        out.update({f"p{_pname(q)}": math.nan for q in percentiles})
        return out
    mean = math.fsum(xs) / n
    out["mean"] = mean
    out["std"] = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / n)
    out["min"], out["max"] = xs[0], xs[-1]
    for q in percentiles:
        out[f"p{_pname(q)}"] = percentile(xs, q, presorted=True)
    return out


def _pname(q: float) -> str:
    return str(int(q)) if float(q).is_integer() else str(q)


# ----------------------------------------------------------------------------- per request


def ttft(r: RequestResult) -> Optional[float]:
    """Seconds to the first token frame, or None if none arrived."""
    return r.ttft


def e2e(r: RequestResult) -> float:
    """Seconds to the last token frame."""
    return r.e2e


def tpot(r: RequestResult) -> Optional[float]:
    """``(E2E - TTFT) / (output_tokens - 1)``; None with fewer than two tokens."""
    t = r.ttft
    if t is None or r.output_tokens < 2:
        return None
    return (r.e2e - t) / (r.output_tokens - 1)


def itls(r: RequestResult) -> list[float]:
    """Gaps between consecutive token frames, in seconds."""
    ts = r.chunk_times
    return [b - a for a, b in zip(ts, ts[1:])]


# ----------------------------------------------------------------------------- per run


def aggregate(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    """Run-level metrics (latencies in ms) for one measured segment."""
    ok = [r for r in results if r.ok]
    bad = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    counts = Counter(r.error or "" for r in bad)
    first: list[str] = []
    for r in bad:  # first few distinct messages, in the order they happened
        if r.error not in first:
            first.append(r.error or "")
            if len(first) == MAX_ERRORS_SHOWN:
                break
    dur = duration if duration > 0 else math.nan
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(bad),
        "errors": first,
        "error_counts": dict(counts.most_common(20)),
        "output_len_mismatch": sum(1 for r in ok if r.output_tokens != r.expected_output_tokens),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / dur,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "ttft_ms": summarize((t for r in ok if (t := r.ttft) is not None), 1000.0),
        "tpot_ms": summarize((t for r in ok if (t := tpot(r)) is not None), 1000.0),
        "itl_ms": summarize((g for r in ok for g in itls(r)), 1000.0),
        "e2e_ms": summarize((r.e2e for r in ok), 1000.0),
        # answers of their own length (the chat workload): how long they were
        "output_len": summarize(r.output_tokens for r in ok),
    }


def format_report(stats: dict[str, Any], title: str = "") -> str:
    """A vllm-bench-style text block."""
    w = 50
    lines = [f"{(' ' + title + ' ') if title else '':=^{w}}"]

    def row(name: str, value: Any) -> None:
        v = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{name:<36}{v:>14}")

    row("Successful requests:", stats["completed"])
    row("Failed requests:", stats["failed"])
    row("Benchmark duration (s):", stats["duration_s"])
    row("Total input tokens:", stats["total_input_tokens"])
    row("Total generated tokens:", stats["total_output_tokens"])
    if stats["output_len_mismatch"]:
        row("Requests with other output length:", stats["output_len_mismatch"])
        ol = stats.get("output_len")
        if ol and ol["n"]:
            row("Output tokens per request (min):", int(ol["min"]))
            row("Output tokens per request (median):", ol["p50"])
            row("Output tokens per request (max):", int(ol["max"]))
    row("Request throughput (req/s):", stats["request_throughput"])
    row("Output token throughput (tok/s):", stats["output_throughput"])
    row("Total token throughput (tok/s):", stats["total_token_throughput"])
    if "client_cpu_util" in stats:
        row("Load generator CPU (share of a core):", stats["client_cpu_util"])
    for key, label in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2e_ms", "End-to-end Latency")):
        lines.append(f"{' ' + label + ' ':-^{w}}")
        s = stats[key]
        row(f"Mean {key[:-3].upper()} (ms):", s["mean"])
        for q in PERCENTILES:
            p = f"p{_pname(q)}"
            row(f"P{_pname(q)} {key[:-3].upper()} (ms):", s[p])
    if stats["errors"]:
        lines.append(f"{' Errors (first distinct) ':-^{w}}")
        for e in stats["errors"]:
            lines.append(f"  [{stats['error_counts'].get(e, 1)}x] {e[:300]}")
    lines.append("=" * w)
    return "\n".join(lines)
