#!/usr/bin/env python3
"""A model's whole steps with its linears on oneDNN's packed products against the C kernels' AMX
tiles (``cpuTuning.prefillLinears`` ``onednn`` against ``kernels``), in one process, the two
taking turns (A B, then B A: each side's cache state and position alike), on one model loaded
twice. A step as the worker runs it: the fused decode step, the C attention, norms and rope, the
LM head on the sampled rows; so each layer's weights come cold from memory, which an isolated
product benchmark (``mindie-bench isa``) does not show.

    python -m mindie_bench.lab.prompt_products --model bench30m --threads 1
    python -m mindie_bench.lab.prompt_products --model default --threads 1 --cases 4x128,16x128,32x1

Also ``mindie-bench prompt-products ...``. A case ``BxN`` is B sequences of N new tokens each
(N = 1: a decode step after ``--context`` cached tokens; else a fresh prompt chunk). Prints the
median step time of each side and their ratio (kernels / onednn: below 1, the tiles are faster).
The figures are in docs/performance.md ("Prompt products on AMX").

Engine internals, on purpose: it builds the CPU backend's model twice under two settings
(``workers.settings.with_cpu``) and drives ``model(ids, positions, attention)`` itself.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from workers import settings
from workers.backends.cpu import CpuBackend
from workers.backends.cpu_linear import KernelLinear
from workers.models.loader import load_model

DEFAULT_CASES = "4x128,1x512,1x1024,16x128,1x2048,32x1,8x1,1x1"
BLOCK = 128


def _build(path: str, route: str):
    settings.apply(settings.with_cpu(prefill_linears=route))
    backend = CpuBackend()
    backend.setup()
    model = load_model(path, dtype=torch.bfloat16)[0]
    backend.prepare_model(model)
    return backend, model


def _stepper(backend, model, b: int, new: int, ctx: int, seed: int):
    """A closure running one step of b sequences x new tokens after ctx cached (random ids)."""
    a = model.args
    per = -(-(ctx + new) // BLOCK)
    attn = backend.attention_class()(a.num_hidden_layers, b * per + 1, BLOCK, a.num_key_value_heads, a.head_dim,
                                     torch.bfloat16, torch.device("cpu"))
    tables = [list(range(i * per, (i + 1) * per)) for i in range(b)]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, a.vocab_size, (b * new,), generator=g)
    pos = torch.arange(ctx, ctx + new).repeat(b)
    last = torch.arange(new - 1, b * new, new)

    def step() -> None:
        attn.prepare(tables, [ctx] * b, [new] * b)
        model.compute_logits(model(ids, pos, attn)[last]).argmax(-1).tolist()
    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench30m",
                    help="a bench-models name (bench30m, default, gpu1b) or a model directory (default: bench30m)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cases", default=DEFAULT_CASES, help=f"BxN cases (default {DEFAULT_CASES})")
    ap.add_argument("--context", type=int, default=190, help="cached tokens before a decode case (N = 1)")
    ap.add_argument("--pairs", type=int, default=6, help="A/B pairs per case (each order half the time)")
    args = ap.parse_args(argv)
    from mindie_bench.lab.bench_models import resolve
    path = resolve(args.model)  # default: its bf16 export (a directory), the same values as the GGUF file
    torch.set_num_threads(args.threads)
    before = settings.engine()
    try:
        sides = {"onednn": _build(path, "onednn"), "kernels": _build(path, "kernels")}
    finally:
        settings.apply(before)
    kinds = {k: sum(isinstance(m, KernelLinear) for m in side[1].modules()) for k, side in sides.items()}
    if kinds["onednn"] == kinds["kernels"]:
        # without AMX the route changes nothing: oneDNN on AVX-512 / fp32, the C bf16 products on AVX2
        print("note: no AMX tiles here (or the model is not bf16): both sides run the same products")
    print(f"{path}, bf16, {args.threads} thread(s); median step ms, {args.pairs} pairs per case")
    print(f"{'case':>10} {'onednn':>10} {'kernels':>10} {'kernels/onednn':>15}")
    with torch.inference_mode():
        for i, case in enumerate(args.cases.split(",")):
            b, new = (int(v) for v in case.lower().split("x"))
            ctx = args.context if new == 1 else 0
            run = {k: _stepper(*side, b, new, ctx, seed=i) for k, side in sides.items()}
            for f in run.values():
                f()
                f()
            times: dict[str, list[float]] = {k: [] for k in run}
            for p in range(2 * args.pairs):
                for k in (("onednn", "kernels") if p % 2 else ("kernels", "onednn")):
                    t = time.perf_counter()
                    run[k]()
                    times[k].append(time.perf_counter() - t)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(f"{case:>10} {med['onednn']:>10.2f} {med['kernels']:>10.2f} {med['kernels'] / med['onednn']:>15.2f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
