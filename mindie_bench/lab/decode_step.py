#!/usr/bin/env python3
"""One decode step of the benchmark model, the fused C step against the eager path, side by side.

Loads the model as a CPU worker does (prepacked linears, C kernels, the fused decode step of
workers/backends/cpu_decode.py), then for each batch times whole decode steps (attention
metadata, forward, LM head, greedy argmax) with the fused step on and off, alternating in rounds
within this one process so that a noisy machine shifts both sides alike. Prints the median step
of each side and the ratio (bf16 on AVX2 builds: also the fused step with the C kernels' tiled
products off, ``kernels_tile_rows``; bf16 on AMX CPUs: also without the AMX tiles, ``kernels_amx_rows``). The row limit is ``MINDIE_CPU_FUSED_DECODE_ROWS`` (batches above it
run eager on both sides).

    python -m mindie_bench.lab.decode_step --batch 1,8,16 --threads 1
    MINDIE_CPU_FUSED_DECODE_ROWS=8 python -m mindie_bench.lab.decode_step --dtype float32

Also ``mindie-bench decode-step ...`` (mindie_bench/lab/__init__.py lists the lab's commands).

Engine internals, on purpose: it loads the model with ``workers.models.loader.load_model`` on a
``CpuBackend`` and toggles the fused decode step between calls of the same process, which only the
backend's own objects allow (the worker picks one path for its lifetime).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from workers.backends.cpu import CpuBackend  # noqa: E402
from workers.kernels import cpu_kernels  # noqa: E402
from workers.models.loader import load_model  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model dir (default: the bench30m preset)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batch", default="1,8,16")
    ap.add_argument("--context", type=int, default=190, help="tokens already cached per sequence")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=25, help="steps per side per round (the first 5 not timed)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model
    if not path:
        from workers.models.demo import PRESETS, ensure_demo_model
        path = str(ensure_demo_model(**dataclasses.asdict(PRESETS["bench30m"])))
    dtype = getattr(torch, args.dtype)
    backend = CpuBackend()
    backend.setup()
    model = load_model(path, dtype=dtype)[0]
    backend.prepare_model(model)
    fused = model.fast_decode
    if fused is None:
        sys.exit("the fused decode step is off for this model or setting (see the worker log line above)")
    batches = [int(b) for b in args.batch.split(",")]
    a, bs = model.args, 128
    per = -(-(args.context + 1) // bs)
    attn = backend.attention_class()(a.num_hidden_layers, max(batches) * per + 1, bs, a.num_key_value_heads,
                                     a.head_dim, dtype, torch.device("cpu"))
    # bf16 products past the dot products: AMX tiles (cpu_kernels.c kernels_amx_rows) on AMX CPUs,
    # register tiles on AVX2 builds (kernels_tile_rows); a third side times the fused step without them
    lib = cpu_kernels.load()
    switch, without = None, ""
    if dtype == torch.bfloat16 and lib is not None:
        if getattr(lib, "amx_rows", 0):
            switch, without = lib.kernels_amx_rows, "without AMX tiles (avx512_bf16 dot products)"
        elif lib.has_avx2 and hasattr(lib, "kernels_tile_rows"):
            switch, without = lib.kernels_tile_rows, "with untiled bf16 products"
    tiles_from = switch(0) if switch is not None else 0
    print(f"{path} ({args.dtype}), {torch.get_num_threads()} threads, context {args.context}, "
          f"fused step up to {fused.max_rows} rows")
    with torch.inference_mode():
        for b in batches:
            tables = [list(range(i * per, (i + 1) * per)) for i in range(b)]
            ids = torch.randint(0, a.vocab_size, (b,))
            pos = torch.full((b,), args.context)
            sides = [("fused", fused, tiles_from), ("eager", None, tiles_from)]
            if tiles_from:  # the fused step with the dot products / row path only (tiles off)
                sides.append(("fused rows", fused, 1 << 40))
            res: dict[str, list[float]] = {name: [] for name, _, _ in sides}
            for _ in range(args.rounds):
                for name, hook, rows_from in sides:
                    model.fast_decode = hook
                    if tiles_from:
                        switch(rows_from)
                    ts = []
                    for _ in range(args.steps):
                        t = time.perf_counter()
                        attn.prepare(tables, [args.context] * b, [1] * b)
                        model.compute_logits(model(ids, pos, attn)).argmax(-1).tolist()
                        ts.append(time.perf_counter() - t)
                    res[name].append(statistics.median(ts[5:]) * 1e3)
            model.fast_decode = fused
            if tiles_from:
                switch(tiles_from)
            f, e = statistics.median(res["fused"]), statistics.median(res["eager"])
            note = "" if b <= fused.max_rows else " (above the row limit: both eager)"
            extra = ""
            if tiles_from:
                r = statistics.median(res["fused rows"])
                extra = f", fused {without} {r:.2f} ms (/ fused {r / f:.2f})"
            print(f"batch {b:>3}: fused {f:.2f} ms, eager {e:.2f} ms, eager / fused {e / f:.2f}{extra}{note}",
                  flush=True)


if __name__ == "__main__":
    main()
