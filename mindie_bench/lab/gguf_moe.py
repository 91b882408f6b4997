#!/usr/bin/env python3
"""A GGUF mixture of experts on the CPU: its experts kept in their blocks and computed in one C call
per layer, against the same blocks one GgufLinear call at a time, and against the experts
dequantised at load; decode step time per batch and resident memory after the load.

Writes (once, in ``--dir``) a random Qwen3-MoE-shaped GGUF file the way llama.cpp's converter lays
one out (tests/tiny_gguf.py ``write_gguf``: stacked ``ffn_*_exps``; default 64 experts, top 8,
hidden 1024, expert intermediate 512, 8 layers, Q4_K gate/up and Q6_K down experts, Q8_0 elsewhere),
then for each mode a fresh process (so each one's memory is its own) loads it as a CPU worker does
(``load_model`` with or without the native target, ``CpuBackend.prepare_model``) and times decode
steps (attention metadata, forward, LM head, argmax) after a prompt of ``--context`` tokens per
sequence, the median of ``--steps``, in batch-invariant mode as a CPU worker runs by default
(``--no-invariant``: off). Modes, in rounds (A B C A B C ...):

- ``fused``: native blocks, a layer's routed experts in one call (workers/backends/gguf_experts.py);
- ``per-expert``: native blocks, ``SparseMoE.experts_forward`` over the GgufLinear experts;
- ``dequantised``: ``cpuTuning.ggufCompute: dequantise``'s load, stacked experts in the model dtype.

    python -m mindie_bench.lab.gguf_moe --batch 1,4,8 --threads 2 --rounds 2

Engine internals, on purpose (load_model, the backend's rewrites): the serving path's products are
these; a server's decode adds its scheduler and sockets (docs/performance.md for served figures).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODES = ("fused", "per-expert", "dequantised")


def build(path: Path, experts: int, top_k: int, hidden: int, inter: int, layers: int) -> Path:
    """The random GGUF file, written once."""
    if path.is_file():
        return path
    from gguf import GGMLQuantizationType as Q

    from tests.tiny_gguf import byte_level_tokenizer, gpt2_vocab, tiny_model, write_gguf
    vocab = gpt2_vocab(byte_level_tokenizer())
    hf = tiny_model("Qwen3MoeConfig", len(vocab["tokens"]), hidden_size=hidden, intermediate_size=hidden,
                    num_attention_heads=hidden // 128, num_key_value_heads=2, head_dim=128, num_experts=experts,
                    num_experts_per_tok=top_k, moe_intermediate_size=inter, num_hidden_layers=layers,
                    norm_topk_prob=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.gguf")
    write_gguf(tmp, hf, "qwen3moe", vocab, default=Q.Q8_0,
               types={"ffn_gate_exps": Q.Q4_K, "ffn_up_exps": Q.Q4_K, "ffn_down_exps": Q.Q6_K})
    tmp.replace(path)
    return path


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def measure(view: str, mode: str, batches: list[int], threads: int, context: int, steps: int,
            invariant: bool, dtype_name: str = "bfloat16") -> dict:
    """One mode in this process: resident MiB the load added, and the median decode step per batch."""
    import msgspec
    import torch

    from workers import settings
    from workers.backends.cpu import CpuBackend
    from workers.backends.gguf_linear import NativeTarget
    from workers.kernels import gguf_kernels
    from workers.models.loader import load_model
    torch.set_num_threads(threads)
    settings.apply(msgspec.structs.replace(settings.engine(), batch_invariant=invariant))
    dtype = getattr(torch, dtype_name)
    before = rss_mib()
    model, _ = load_model(view, dtype, gguf_native=None if mode == "dequantised" else NativeTarget(gguf_kernels.load()))
    backend = CpuBackend(threads)
    backend.prepare_model(model)
    if mode == "per-expert":
        for m in model.modules():
            if hasattr(m, "fused_experts"):
                m.fused_experts = None
    out = {"mode": mode, "rss_mib": round(rss_mib() - before, 1), "step_ms": {}}
    a = model.args
    per = -(-(context + steps + 8) // 16)
    for b in batches:
        attn = backend.attention_class()(a.num_hidden_layers, per * b, 16, a.num_key_value_heads, a.head_dim, dtype,
                                         torch.device("cpu"))
        tables = [list(range(i * per, (i + 1) * per)) for i in range(b)]
        g = torch.Generator().manual_seed(b)
        times = []
        with torch.inference_mode():
            attn.prepare(tables, [0] * b, [context] * b)
            model(torch.randint(3, 200, (context * b,), generator=g), torch.arange(context).repeat(b), attn)
            pos = context
            for i in range(steps + 3):
                t = time.perf_counter()
                attn.prepare(tables, [pos] * b, [1] * b)
                h = model(torch.randint(3, 200, (b,), generator=g), torch.tensor([pos] * b), attn)
                model.compute_logits(h).argmax(-1)
                if i >= 3:
                    times.append(time.perf_counter() - t)
                pos += 1
        out["step_ms"][str(b)] = round(statistics.median(times) * 1e3, 2)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=str(Path.home() / ".cache" / "mindie-py" / "bench-gguf-moe"),
                    help="where the GGUF file and its model view are kept")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024, help="a multiple of 256 (K-quant blocks)")
    ap.add_argument("--inter", type=int, default=512, help="expert intermediate size, a multiple of 256")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", default="1,4,8", help="decode batch sizes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=100, help="prompt tokens per sequence before the decode steps")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="activations (float32: what a CPU without native bf16 computes)")
    ap.add_argument("--no-invariant", action="store_true",
                    help="ScheduleConfig.batchInvariant off (on by default, as a CPU worker runs)")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: measure one mode, print its JSON
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    d = Path(args.dir)
    name = f"qwen3moe-{args.experts}x{args.top_k}-h{args.hidden}-i{args.inter}-l{args.layers}.gguf"
    if args.one:
        from workers.models.gguf_view import ensure_view
        view = str(ensure_view(d / name, d / "views"))
        print(json.dumps(measure(view, args.one, batches, args.threads, args.context, args.steps,
                                 not args.no_invariant, args.dtype)))
        return
    f = build(d / name, args.experts, args.top_k, args.hidden, args.inter, args.layers)
    print(f"{f.name}: {f.stat().st_size / 2**20:.1f} MiB, {args.dtype}, {args.threads} threads, context {args.context}, "
          f"batch-invariant {'off' if args.no_invariant else 'on'}", flush=True)
    modes = args.modes.split(",")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes:
            cmd = [sys.executable, "-m", "mindie_bench.lab.gguf_moe", "--dir", args.dir, "--experts", str(args.experts),
                   "--top-k", str(args.top_k), "--hidden", str(args.hidden), "--inter", str(args.inter),
                   "--layers", str(args.layers), "--batch", args.batch, "--threads", str(args.threads),
                   "--context", str(args.context), "--steps", str(args.steps), "--one", mode,
                   "--dtype", args.dtype, *(["--no-invariant"] if args.no_invariant else [])]
            res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
            if res.returncode != 0:
                raise SystemExit(f"{mode}: {res.stderr[-2000:]}")
            runs[mode].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {mode}: {runs[mode][-1]}", flush=True)
    print(f"\n{'mode':<12} {'RSS MiB':>8} " + " ".join(f"{'b=' + str(b) + ' ms':>10}" for b in batches))
    for mode in modes:
        rss = statistics.median(x["rss_mib"] for x in runs[mode])
        ms = [statistics.median(x["step_ms"][str(b)] for x in runs[mode]) for b in batches]
        print(f"{mode:<12} {rss:>8.0f} " + " ".join(f"{v:>10.2f}" for v in ms))


if __name__ == "__main__":
    main()
