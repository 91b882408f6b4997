"""Compare mode: two endpoints measured alternately, A B A B ..., on the same workload.

On a shared machine the background load drifts; measuring A and B back to back in
several rounds and taking the **median of the per-round ratios** keeps a slow minute
from deciding the result. Each segment (one endpoint, one round, one concurrency level)
has its own warm-up and connection pool; both endpoints get the same seeded requests.

The ratio direction is explicit everywhere: ``"a/b"`` (default) means
``metric(A) / metric(B)``, so with A = this server and B = vLLM a throughput ratio above
1 means this server is faster.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

from mindie_bench.api_clients import Adapter
from mindie_bench.runner import LoadConfig, Segment, run_segment
from mindie_bench.workload import WorkloadFn

# (key in the JSON, human name, path into the stats dict)
RATIO_METRICS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("output_throughput", "output tok/s", ("output_throughput",)),
    ("ttft_p50", "p50 TTFT", ("ttft_ms", "p50")),
    ("itl_p99", "p99 ITL", ("itl_ms", "p99")),
    ("tpot_p50", "p50 TPOT", ("tpot_ms", "p50")),
)


@dataclass
class Endpoint:
    """One side of the comparison."""

    label: str
    adapter: Adapter


def _get(stats: dict[str, Any], path: tuple[str, ...]) -> float:
    v: Any = stats
    for k in path:
        v = v[k]
    return float(v)


def _ratio(x: float, y: float) -> float:
    return x / y if y else float("nan")


def _median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]  # a round where one side produced nothing
    return statistics.median(xs) if xs else float("nan")


async def run_compare(a: Endpoint, b: Endpoint, workload: WorkloadFn, levels: Sequence[Optional[int]],
                      rounds: int, cfg: LoadConfig, direction: str = "a/b",
                      ) -> tuple[dict[str, Any], dict[tuple[Optional[int], str], list[Segment]]]:
    """Measure A then B, ``rounds`` times per level. Returns (JSON section, segments by
    (level, "A"|"B") for plotting)."""
    if direction not in ("a/b", "b/a"):
        raise ValueError("direction must be 'a/b' or 'b/a'")
    segs: dict[tuple[Optional[int], str], list[Segment]] = {}
    out_levels = []
    for c in levels:
        lcfg = replace(cfg, concurrency=c)
        rows: list[dict[str, Any]] = []
        for rnd in range(1, rounds + 1):
            pair = {}
            for side, ep in (("A", a), ("B", b)):
                tag = f"c={c}" if c else f"rate={cfg.request_rate:g}"
                seg = await run_segment(ep.adapter, workload, lcfg, f"{side} {ep.label} {tag} r{rnd}/{rounds}")
                segs.setdefault((c, side), []).append(seg)
                pair[side] = seg
            sa, sb = pair["A"].stats, pair["B"].stats
            num, den = (sa, sb) if direction == "a/b" else (sb, sa)
            rows.append({
                "round": rnd,
                "A": pair["A"].to_json(cfg.save_itl),
                "B": pair["B"].to_json(cfg.save_itl),
                "ratio": {k: _ratio(_get(num, p), _get(den, p)) for k, _, p in RATIO_METRICS},
            })
        out_levels.append({
            "concurrency": c,
            "rounds": rows,
            "median": {
                "A": {k: _median([_get(r["A"]["stats"], p) for r in rows]) for k, _, p in RATIO_METRICS},
                "B": {k: _median([_get(r["B"]["stats"], p) for r in rows]) for k, _, p in RATIO_METRICS},
                "ratio": {k: _median([r["ratio"][k] for r in rows]) for k, _, _ in RATIO_METRICS},
            },
        })
    section = {
        "ratio_direction": direction,
        "ratio_meaning": (f"{direction.upper()}: " + (f"{a.label} / {b.label}" if direction == "a/b"
                                                      else f"{b.label} / {a.label}")),
        "A": {"label": a.label, **a.adapter.describe()},
        "B": {"label": b.label, **b.adapter.describe()},
        "rounds": rounds,
        "order": "A then B in every round",
        "levels": out_levels,
    }
    return section, segs


def compare_table(section: dict[str, Any]) -> str:
    """Per-round and median rows for every level."""
    d = section["ratio_direction"].upper()
    lines = [f"A = {section['A']['label']} ({section['A']['api']} {section['A']['url']})",
             f"B = {section['B']['label']} ({section['B']['api']} {section['B']['url']})",
             f"ratio = {section['ratio_meaning']}  (per round; 'median' = median of the per-round ratios)"]
    head = (f"{'conc':>5} {'round':>6} {'A tok/s':>9} {'B tok/s':>9} {d + ' tok/s':>9} "
            f"{'A TTFT50':>9} {'B TTFT50':>9} {'A ITL99':>8} {'B ITL99':>8} {'fail A/B':>9}")
    lines += [head, "-" * len(head)]
    for lv in section["levels"]:
        c = lv["concurrency"] if lv["concurrency"] is not None else "-"
        for r in lv["rounds"]:
            sa, sb = r["A"]["stats"], r["B"]["stats"]
            lines.append(f"{c:>5} {r['round']:>6} {sa['output_throughput']:>9.1f} {sb['output_throughput']:>9.1f} "
                         f"{r['ratio']['output_throughput']:>9.3f} {sa['ttft_ms']['p50']:>9.1f} "
                         f"{sb['ttft_ms']['p50']:>9.1f} {sa['itl_ms']['p99']:>8.2f} {sb['itl_ms']['p99']:>8.2f} "
                         f"{str(sa['failed']) + '/' + str(sb['failed']):>9}")
        m = lv["median"]
        lines.append(f"{c:>5} {'median':>6} {m['A']['output_throughput']:>9.1f} {m['B']['output_throughput']:>9.1f} "
                     f"{m['ratio']['output_throughput']:>9.3f} {m['A']['ttft_p50']:>9.1f} {m['B']['ttft_p50']:>9.1f} "
                     f"{m['A']['itl_p99']:>8.2f} {m['B']['itl_p99']:>8.2f} {'':>9}")
        lines.append("")
    lines.append("(latencies in ms)")
    return "\n".join(lines)
