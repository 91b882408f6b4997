#!/usr/bin/env python3
"""Attention of one layer: the portable torch path against the CPU C kernels, side by side.

For each (batch, context) it fills a random paged KV cache, times one decode call (cache write +
attention) of `PagedAttention` and of `CpuPagedAttention` alternately, checks that they agree,
and prints microseconds per call and the speed-up. Shapes default to the bench30m model's
(8 heads, 4 KV heads, head size 64, blocks of 128). With --prefill N each sequence computes a
prompt chunk of N tokens after `context` cached ones instead (context 0: fresh prompts; the
torch side is SDPA on the padded batch, the kernel side paged_prefill), and a third column times
``CpuPagedAttention``'s SDPA route (one sequence at a time; ``cpuTuning.prefillAttention: sdpa``).
On AMX CPUs bf16 prompt chunks take the kernel's AMX tiles; a last column times its AVX-512 loops.

    python -m mindie_bench.lab.attention
    python -m mindie_bench.lab.attention --dtype float32 --batch 1,16 --context 512,2048
    python -m mindie_bench.lab.attention --prefill 128 --batch 1 --context 0,384,1920 --threads 1

Also ``mindie-bench attention ...`` (mindie_bench/lab/__init__.py lists the lab's commands).

Engine internals, on purpose: a kernel micro-benchmark of ``workers.kernels.cpu_kernels``,
``CpuPagedAttention`` and the portable ``PagedAttention``: what it measures is those classes, which
no public entry point exposes one call at a time.
"""
from __future__ import annotations

import argparse
import time

import torch

from workers.kernels import cpu_kernels
from workers.attention.cpu import CpuPagedAttention
from workers.attention.paged import PagedAttention


def per_call_us(fn, reps: int) -> float:
    for _ in range(10):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--batch", default="1,8,32,64")
    ap.add_argument("--context", default="150,1000")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--prefill", type=int, default=0, help="prompt-chunk tokens per sequence (0: decode)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args = ap.parse_args(argv)
    lib = cpu_kernels.load()
    if lib is None:
        raise SystemExit(f"kernels unavailable: {cpu_kernels.unavailable_reason()}")
    # bf16 prompt chunks on AMX tiles: a column for the AVX-512 loops they replace
    vec_col = bool(args.prefill and lib.prefill_amx and args.dtype == "bfloat16")
    if args.threads:
        torch.set_num_threads(args.threads)
    dt = getattr(torch, args.dtype)
    h, hkv, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    print(f"{args.dtype}, {h} heads / {hkv} KV heads x {d}, blocks of {bs}, {torch.get_num_threads()} threads")
    print(f"{'batch':>5} {'context':>7} {'torch us':>9} {'kernel us':>10} {'speed-up':>9} {'max |diff|':>11}"
          + (f" {'sdpa/seq us':>12} {'kernel/sdpa':>12}" if args.prefill else "")
          + (f" {'avx512 us':>10} {'avx512/amx':>11}" if vec_col else ""))
    g = torch.Generator().manual_seed(0)
    for ctx in (int(c) for c in args.context.split(",")):
        for B in (int(b) for b in args.batch.split(",")):
            new = max(1, args.prefill)
            per_seq = -(-(ctx + (new if args.prefill else 0)) // bs)
            nb = B * per_seq + 1
            ref = PagedAttention(1, nb, bs, hkv, d, dt, torch.device("cpu"))
            ker = CpuPagedAttention(1, nb, bs, hkv, d, dt, torch.device("cpu"))
            seq = CpuPagedAttention(1, nb, bs, hkv, d, dt, torch.device("cpu"))
            ker.route, seq.route = "kernels", "sdpa"  # both routes, whatever the key says
            for a, b, c in ((ref.k_cache[0], ker.k_cache[0], seq.k_cache[0]), (ref.v_cache[0], ker.v_cache[0], seq.v_cache[0])):
                a.copy_(torch.randn(a.shape, generator=g).to(dt))
                b.copy_(a)
                c.copy_(a)
            perm = torch.randperm(nb, generator=g).tolist()
            tables = [perm[i * per_seq:(i + 1) * per_seq] for i in range(B)]
            q = torch.randn(B * new, h, d, generator=g).to(dt)
            kv = torch.randn(B * new, hkv, d, generator=g).to(dt)
            with torch.inference_mode():
                for a in (ref, ker, seq):
                    if args.prefill:
                        a.prepare(tables, [ctx] * B, [new] * B)
                    else:
                        a.prepare(tables, [ctx - 1] * B, [1] * B)
                diff = (ref(0, q, kv, kv).float() - ker(0, q, kv, kv).float()).abs().max().item()
                t_ref = per_call_us(lambda: ref(0, q, kv, kv), args.reps)
                t_ker = per_call_us(lambda: ker(0, q, kv, kv), args.reps)
                extra = ""
                if args.prefill:
                    diff = max(diff, (ref(0, q, kv, kv).float() - seq(0, q, kv, kv).float()).abs().max().item())
                    t_seq = per_call_us(lambda: seq(0, q, kv, kv), args.reps)
                    extra = f" {t_seq:>12.0f} {t_ker / t_seq:>11.1f}x"
                if vec_col:
                    lib.kernels_prefill_amx(0)
                    try:
                        diff = max(diff, (ref(0, q, kv, kv).float() - ker(0, q, kv, kv).float()).abs().max().item())
                        t_vec = per_call_us(lambda: ker(0, q, kv, kv), args.reps)
                    finally:
                        lib.kernels_prefill_amx(1)
                    extra += f" {t_vec:>10.0f} {t_vec / t_ker:>10.1f}x"
            print(f"{B:>5} {ctx:>7} {t_ref:>9.0f} {t_ker:>10.0f} {t_ref / t_ker:>8.1f}x {diff:>11.4f}{extra}")


if __name__ == "__main__":
    main()
