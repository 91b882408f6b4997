#!/usr/bin/env python3
"""This machine's instruction sets, the CPU kernels a worker dispatches to here, and what they
reach: the products per row count (torch's oneDNN, packed as the worker packs them, and the C
kernels' ``linear_rows``, the fused decode step's products) in fp32 and bf16 (on AVX2 builds also
the C bf16 products' row and tiled paths forced, and oneDNN fp32 on the same values, the rate
``dtype: auto`` gets here), a prompt-only step of a preset model in fp32 and bf16, and the
attention kernels per call (decode and prompt chunks, the C kernels against torch).

    python -m mindie_bench.lab.isa --threads 1
    python -m mindie_bench.lab.isa --threads 1 --base-kernels /tmp/old/cpu_kernels.c   # A/B in one run
    python -m mindie_bench.lab.isa --threads 1 --skip dispatch,attention,flinear --shape 8192x2048 --prompt 0

``--base-kernels`` builds another version of cpu_kernels.c with the same flags and times its
kernels beside this checkout's (the A/B of a kernel change in one process, alternating). Each
figure is the best of ``--rounds`` rounds (the least disturbed by other work on a shared machine);
with ``--threads 1`` the clock is the thread's CPU time (``time.thread_time``: every product and
kernel then runs on the calling thread), so time slices other processes take are not counted.

Also ``mindie-bench isa ...`` (mindie_bench/lab/__init__.py lists the lab's commands).

Engine internals, on purpose: it calls the kernels through ``workers.kernels.cpu_kernels`` and the
CPU attention objects directly (the worker does not expose single kernels).
"""
from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mindie.contract.spec import cpu_flags  # noqa: E402
from workers.attention.cpu import CpuPagedAttention  # noqa: E402
from workers.attention.paged import PagedAttention  # noqa: E402
from workers.backends import cpu_linear  # noqa: E402
from workers.kernels import cpu_kernels  # noqa: E402
from workers.kernels.cpu_layout import pack  # noqa: E402

SHOWN_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
               "amx_tile", "amx_bf16", "amx_int8")


CLOCK = time.perf_counter  # main(): this thread's CPU time when everything runs on it (--threads 1)


def best_us(fns: list, reps: int, rounds: int) -> list[float]:
    """Each function's best per-call time (µs) over ``rounds`` rounds of ``reps`` calls, after one
    call; the functions take turns within each round (a disturbance hits them alike)."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t = CLOCK()
            for _ in range(reps):
                fn()
            best[i] = min(best[i], (CLOCK() - t) / reps)
    return [b * 1e6 for b in best]


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
        family = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("CPU family")), "?")
    except (OSError, subprocess.SubprocessError):
        model, family = "?", "?"
    flags = set(cpu_flags().split())
    have = " ".join(f for f in SHOWN_FLAGS if f in flags) or "none of them"
    missing = " ".join(f for f in SHOWN_FLAGS if f not in flags)
    return f"{model} (family {family}); has: {have}; lacks: {missing or '-'}"


def dispatch_line(preset: str, dtype: str) -> str:
    """The worker's dispatch decision for the preset model in this dtype (as a worker logs it)."""
    from workers.backends.cpu import CpuBackend
    from workers.models.demo import PRESETS, ensure_demo_model
    from workers.models.loader import load_model
    path = str(ensure_demo_model(**dataclasses.asdict(PRESETS[preset])))
    backend = CpuBackend()
    model = load_model(path, dtype=getattr(torch, dtype))[0]
    backend.prepare_model(model)
    return backend.dispatch.line()


def _forced(switch, rows_from: int, fn):
    """fn with a library's bf16 tiles (``switch``: its kernels_tile_rows, AVX2 register tiles, or
    kernels_amx_rows, AMX) taken from ``rows_from`` rows (1: always, huge: never)."""
    def call():
        before = switch(rows_from)
        try:
            fn()
        finally:
            switch(before)
    return call


def products(libs: dict, k: int, n: int, rows: list[int], reps: int, rounds: int, skip: set | None = None) -> dict:
    """Prints the table; returns each dtype's best GFLOP/s (any method, any row count).

    Columns: torch's oneDNN on the weight packed as the worker packs it (bf16 where this CPU packs
    bf16), torch's ``F.linear`` (unless ``skip`` has "flinear"), each kernel build's
    ``linear_rows`` as it dispatches; for bf16 on builds with the tiled AVX2 path also each of its
    two paths forced ("rows": bf16_rows8, "tiles": the register-tiled one), on AMX builds the
    AVX512-BF16 dot products and the AMX tiles forced ("dots", "amx"), and oneDNN fp32 on
    the same values (what ``dtype: auto`` runs here) with the ratio of the dispatched C path to it."""
    skip = skip or set()
    print(f"\nproducts x[M, {k}] @ W[{n}, {k}]^T, GFLOP/s (best of {rounds} rounds)")
    tiled = {name: lib for name, lib in libs.items() if getattr(lib, "has_avx2", False)
             and hasattr(lib, "kernels_tile_rows")}
    names = ["torch packed"] + ([] if "flinear" in skip else ["torch F.linear"]) + [f"C {name}" for name in libs]
    for name, lib in tiled.items():
        names += [f"C {name} rows", f"C {name} tiles"]
        print(f"(C {name}: bf16 tiled path from {lib.kernels_tile_rows(0)} rows)")
    amx = {name: lib for name, lib in libs.items() if getattr(lib, "amx_rows", 0)}
    for name, lib in amx.items():
        names += [f"C {name} dots", f"C {name} amx"]
        print(f"(C {name}: bf16 AMX tiles from {lib.kernels_amx_rows(0)} rows)")
    names += ["fp32 oneDNN", "C/fp32"]
    print(f"{'dtype':>8} {'rows':>5} " + " ".join(f"{h:>14}" for h in names))
    g = torch.Generator().manual_seed(0)
    peak: dict = {}
    for dt in (torch.float32, torch.bfloat16):
        w = (torch.randn(n, k, generator=g) * 0.05).to(dt)
        packed = cpu_linear._pack(w)
        pw = pack(w)
        code = 1 if dt == torch.bfloat16 else 0
        w32 = cpu_linear._pack(w.float()) if dt != torch.float32 else None
        for m in rows:
            x = torch.randn(m, k, generator=g).to(dt)
            x32 = x.float()
            out = torch.empty(m, n, dtype=dt)
            flop = 2.0 * m * n * k
            fns = [] if packed is None else [
                lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")]
            if "flinear" not in skip:
                fns.append(lambda: F.linear(x, w))

            def c_call(lib):
                return lambda: lib.linear_rows(code, x.data_ptr(), m, k, pw.data_ptr(), None, n, None, out.data_ptr())

            fns += [c_call(lib) for lib in libs.values()]
            if code == 1:
                for lib in tiled.values():
                    fns += [_forced(lib.kernels_tile_rows, 1 << 40, c_call(lib)),
                            _forced(lib.kernels_tile_rows, 1, c_call(lib))]
                for lib in amx.values():
                    fns += [_forced(lib.kernels_amx_rows, 1 << 40, c_call(lib)),
                            _forced(lib.kernels_amx_rows, 1, c_call(lib))]
                fns.append(lambda: torch.ops.mkldnn._linear_pointwise(x32, w32, None, "none", [], ""))
            with torch.inference_mode():
                cells = [flop / us / 1e3 for us in best_us(fns, reps, rounds)]
            if packed is None:
                cells.insert(0, None)
            if code == 1:  # this checkout's C column (the last build's) over oneDNN fp32
                cells.append(cells[1 + ("flinear" not in skip) + len(libs) - 1] / cells[-1])
            else:
                cells += [None] * (2 * len(tiled) + 2 * len(amx)) + [None, None]
            print(f"{str(dt).replace('torch.', ''):>8} {m:>5} "
                  + " ".join(f"{'-' if c is None else f'{c:.1f}':>14}" if i < len(cells) - 1 or c is None
                             else f"{c:>13.2f}x" for i, c in enumerate(cells)))
            peak[dt] = max([peak.get(dt, 0.0)] + [c for c in cells[:len(cells) - 2] if c is not None])
    return peak


def attention(libs: dict, batches: list[int], contexts: list[int], prefill: int, reps: int, rounds: int) -> None:
    h, hkv, d, bs = 8, 4, 64, 128  # bench30m's attention
    print(f"\nattention, one layer call (cache write included), {h} / {hkv} heads x {d}, blocks of {bs}, µs "
          f"(best of {rounds} rounds)")
    print(f"{'dtype':>8} {'kind':>8} {'batch':>5} {'context':>7} {'torch':>9} " + " ".join(f"{'C ' + nm:>12}" for nm in libs))
    g = torch.Generator().manual_seed(1)
    for dt in (torch.float32, torch.bfloat16):
        for kind, new in (("decode", 1), ("prefill", prefill)):
            if not new:
                continue
            for ctx in contexts:
                if kind == "decode" and ctx < 1:
                    continue
                for B in batches if kind == "decode" else [1]:
                    start = ctx - 1 if kind == "decode" else ctx
                    per_seq = -(-(start + new) // bs)
                    nb = B * per_seq + 1
                    ref = PagedAttention(1, nb, bs, hkv, d, dt, torch.device("cpu"))
                    for a in (ref.k_cache[0], ref.v_cache[0]):
                        a.copy_(torch.randn(a.shape, generator=g).to(dt))
                    perm = torch.randperm(nb, generator=g).tolist()
                    tables = [perm[i * per_seq:(i + 1) * per_seq] for i in range(B)]
                    q = torch.randn(B * new, h, d, generator=g).to(dt)
                    kv = torch.randn(B * new, hkv, d, generator=g).to(dt)
                    kers = []
                    for lib in libs.values():  # one attention object per build, same cache contents
                        other = CpuPagedAttention(1, nb, bs, hkv, d, dt, torch.device("cpu"))
                        other.k_cache[0].copy_(ref.k_cache[0])
                        other.v_cache[0].copy_(ref.v_cache[0])
                        other.lib = lib
                        other._prefill_ok = lib.has_prefill and d % 16 == 0
                        kers.append(other)
                    with torch.inference_mode():
                        for a in [ref] + kers:
                            a.prepare(tables, [start] * B, [new] * B)
                        cells = best_us([lambda a=a: a(0, q, kv, kv) for a in [ref] + kers], reps, rounds)
                    print(f"{str(dt).replace('torch.', ''):>8} {kind:>8} {B:>5} {ctx:>7} {cells[0]:>9.0f} "
                          + " ".join(f"{c:>12.0f}" for c in cells[1:]))


def prompt_step(preset: str, tokens: int, rounds: int, peak: dict) -> None:
    """A prompt-only step of the preset model as a worker runs it (specialised, C kernels): one
    fresh prompt of ``tokens`` tokens and the logits of its last row; its GFLOP/s (products and
    attention) against the best product GFLOP/s measured above for the same dtype. fp32 and bf16
    (and bf16 with the C kernels' tiled products turned off, where the build has them; on AMX
    builds bf16 with the prompt attention on the AVX-512 loops, and through SDPA) take turns
    within each round, so their ratio is measured under the same conditions."""
    from workers.backends.cpu import CpuBackend
    from workers.models.demo import PRESETS, ensure_demo_model
    from workers.models.loader import load_model
    path = str(ensure_demo_model(**dataclasses.asdict(PRESETS[preset])))
    print(f"\nprompt-only step, {preset}, one fresh prompt of {tokens} tokens (best of {rounds} rounds)")
    runs: list[tuple[str, torch.dtype, object]] = []
    flop = 0.0
    for dt in (torch.float32, torch.bfloat16):
        backend = CpuBackend()
        model = load_model(path, dtype=dt)[0]
        backend.prepare_model(model)
        a = model.args
        bs = 128
        attn = backend.attention_class()(a.num_hidden_layers, -(-tokens // bs) + 1, bs, a.num_key_value_heads,
                                         a.head_dim, dt, torch.device("cpu"))
        ids = torch.randint(3, a.vocab_size, (tokens,))
        pos = torch.arange(tokens)

        def step(model=model, attn=attn, ids=ids, pos=pos):
            attn.prepare([list(range(-(-tokens // bs)))], [0], [tokens])
            model.compute_logits(model(ids, pos, attn)[-1:])

        name = str(dt).replace("torch.", "")
        runs.append((name, dt, step))
        lib = cpu_kernels.load()
        if dt == torch.bfloat16 and lib is not None and lib.has_avx2 and hasattr(lib, "kernels_tile_rows"):
            runs.append((f"{name} (C rows path only)", dt, _forced(lib.kernels_tile_rows, 1 << 40, step)))
        if dt == torch.bfloat16 and lib is not None and getattr(lib, "prefill_amx", False):
            # prompt attention on the kernel's AVX-512 loops instead of its AMX tiles, and through
            # torch's SDPA per sequence (cpuTuning.prefillAttention: sdpa)
            runs.append((f"{name} (attention avx512)", dt, _forced(lib.kernels_prefill_amx, 0, step)))
            sdpa = backend.attention_class()(a.num_hidden_layers, -(-tokens // bs) + 1, bs, a.num_key_value_heads,
                                             a.head_dim, dt, torch.device("cpu"))
            sdpa.route = "sdpa"
            runs.append((f"{name} (attention sdpa)", dt,
                         lambda model=model, attn=sdpa, ids=ids, pos=pos: step(model, attn, ids, pos)))
        proj = a.hidden_size * (a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim \
            + a.num_attention_heads * a.head_dim * a.hidden_size + 3 * a.hidden_size * a.intermediate_size
        flop = a.num_hidden_layers * (2.0 * tokens * proj + 2.0 * a.num_attention_heads * a.head_dim * tokens * tokens) \
            + 2.0 * a.hidden_size * a.vocab_size
    with torch.inference_mode():
        times = best_us([fn for _, _, fn in runs], 1, rounds)
    for (name, dt, _), us in zip(runs, times):
        gf = flop / us / 1e3
        best = peak.get(dt)
        print(f"{name:>28}: {us / 1e3:.1f} ms ({times[0] / us:.2f}x float32's rate), {flop / 1e9:.2f} GFLOP, "
              f"{gf:.1f} GFLOP/s" + (f" = {gf / best:.0%} of the best product rate above ({best:.1f})" if best else ""))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--base-kernels", default="", help="another cpu_kernels.c to time beside this one")
    ap.add_argument("--shape", default="2048x2048", help="product K x N (default: the 1B shape's hidden)")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,512")
    ap.add_argument("--batch", default="1,16", help="decode batches of the attention timings")
    ap.add_argument("--context", default="190,1000")
    ap.add_argument("--prefill", type=int, default=128, help="prompt-chunk tokens of the prefill timing (0: none)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=0, help="calls per round (default: by work size)")
    ap.add_argument("--preset", default="bench30m", help="model of the dispatch line and the prompt-only step")
    ap.add_argument("--prompt", type=int, default=512, help="tokens of the prompt-only step (0: none)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: dispatch, products, flinear (its column), prompt, attention")
    args = ap.parse_args(argv)
    global CLOCK
    if args.threads:
        torch.set_num_threads(args.threads)
    CLOCK = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    lib = cpu_kernels.load()
    if lib is None:
        raise SystemExit(f"kernels unavailable: {cpu_kernels.unavailable_reason()}")
    libs = {"new": lib}
    if args.base_kernels:
        libs = {"base": cpu_kernels.build_other(Path(args.base_kernels)), "new": lib}
    skip = set(filter(None, args.skip.split(",")))
    print(f"machine: {machine()}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, clock "
          f"{'thread CPU time' if CLOCK is time.thread_time else 'wall'}; kernels built with "
          f"{' '.join(cpu_kernels.build_flags()[:2] + cpu_kernels.build_flags()[-1:])} "
          f"(isa {cpu_kernels.isa()}): avx512 {lib.has_avx512}, avx2 paths {lib.has_avx2}, "
          f"avx512_bf16 {lib.has_dpbf16}")
    if "dispatch" not in skip:
        for dt in ("float32", "bfloat16"):
            print(f"dispatch ({args.preset}, {dt}): {dispatch_line(args.preset, dt)}")
    peak: dict = {}
    if "products" not in skip:
        k, n = (int(v) for v in args.shape.split("x"))
        peak = products(libs, k, n, [int(r) for r in args.rows.split(",")], args.reps or 5, args.rounds, skip)
    if "prompt" not in skip and args.prompt:
        prompt_step(args.preset, args.prompt, args.rounds, peak)
    if "attention" not in skip:
        attention(libs, [int(b) for b in args.batch.split(",")], [int(c) for c in args.context.split(",")],
                  args.prefill, args.reps or 20, args.rounds)


if __name__ == "__main__":
    main()
