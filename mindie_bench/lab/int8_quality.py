#!/usr/bin/env python3
"""Weight-only int8 (ModelConfig quantize "w8a16") against the bf16 model, on the CPU backend.

For each model (the tiny test models of tests/test_int8.py, the demo model, the benchmark preset
bench30m): greedy agreement over --tokens tokens x --prompts prompts (free-running: positions
equal, tokens until the first divergence, identical sequences; teacher-forced: the int8 model's
top-1 on the bf16 model's own continuation), the largest logit difference from the bf16 model on
those sequences, and the int8 kernel's error against the dequantised fp32 reference (fp32 model).
Then weight bytes and RSS of a worker process, and engine-alone tokens/s at --concurrency,
int8 and bf16 alternating (--rounds rounds, medians and best; mindie_bench/lab/engine.py's functions), and
the per-matmul timings that chose the CPU kernel (--kernels).

    python -m mindie_bench.lab.int8_quality --kernels             # everything (about 10 minutes here)
    python -m mindie_bench.lab.int8_quality --models tiny-tied,demo --no-throughput

Also ``mindie-bench int8-quality ...`` (mindie_bench/lab/__init__.py lists the lab's commands).

Engine internals, on purpose: it compares the int8 kernel with a dequantised reference
(``workers.backends.int8``, ``load_model``, tests/reference_attention.py), counts weight bytes the
way the backend stores them, and takes engine-alone tokens/s from ``mindie_bench/lab/engine.py``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TINY = {"tiny-tied": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96, max_position_embeddings=512),
        "tiny-untied": dict(hidden=96, layers=3, heads=6, kv_heads=2, intermediate=160, max_position_embeddings=512,
                            tie_word_embeddings=False, seed=3)}


def model_dir(name: str) -> str:
    from workers.models.demo import PRESETS, ensure_demo_model
    if name in TINY:
        return str(ensure_demo_model(**TINY[name]))
    return str(ensure_demo_model(**dataclasses.asdict(PRESETS[name])))


def runner_for(path: str, dtype: str, quantize: str, threads: int, kv_blocks: int = 512):
    from mindie.contract.spec import EngineConfig, WorkerSpec
    from workers.backends.cpu import CpuBackend
    from workers.engine.assembly import load_runner
    spec = WorkerSpec(worker_id="q", job_endpoint="", pub_endpoint="", model_path=path, dtype=dtype, quantize=quantize,
                      engine=EngineConfig(block_size=16, max_seq_len=1024, max_prefill_tokens=4096))
    r = load_runner(spec, CpuBackend(threads))
    r.allocate_kv(kv_blocks, 16)
    return r


def greedy(runner, prompts: list[list[int]], max_new: int, kv_blocks: int = 512) -> list[list[int]]:
    from mindie.contract.spec import EngineConfig
    from mindie.contract.wire import SamplingParams, Submit
    from workers.engine.engine import Engine
    eng = Engine(runner, EngineConfig(block_size=16, max_seq_len=1024, max_prefill_tokens=4096,
                                      enable_prefix_cache=False), kv_blocks)
    for i, ids in enumerate(prompts):
        eng.add(Submit(f"r{i}", "q", ids, SamplingParams(max_new_tokens=max_new, ignore_eos=True)))
    out: dict[str, list[int]] = {}
    while eng.has_work():
        for o in eng.step():
            out.setdefault(o.seq.request_id, []).extend(o.token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


def logits(model, ids: list[int]) -> torch.Tensor:
    from tests.reference_attention import DenseCausalAttention
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)),
                                          DenseCausalAttention.from_lengths([len(ids)])))


def quality(name: str, prompts_n: int, tokens: int, threads: int) -> dict:
    from workers.backends.int8 import copy_dequantized_into
    from workers.models.loader import load_model
    path = model_dir(name)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(16)] for _ in range(prompts_n)]
    bf16, int8 = runner_for(path, "bfloat16", "", threads), runner_for(path, "bfloat16", "w8a16", threads)
    base, quant = greedy(bf16, prompts, tokens), greedy(int8, prompts, tokens)
    same = sum(a == b for x, y in zip(base, quant) for a, b in zip(x, y))
    prefix = []
    for x, y in zip(base, quant):
        k = next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
        prefix.append(k)
    forced = 0
    max_err = max_ref = 0.0
    for p, b in zip(prompts, base):
        seq = p + b
        lb, lq = logits(bf16.model, seq)[len(p) - 1:-1], logits(int8.model, seq)[len(p) - 1:-1]
        forced += int((lq.argmax(-1) == torch.tensor(b)).sum())
        max_err = max(max_err, float((lq - lb).abs().max()))
        max_ref = max(max_ref, float(lb.abs().max()))
    # The kernel against the dequantised fp32 reference: fp32 int8 model vs the fp32 model whose
    # matrices are the dequantised ones (the same check as tests/test_int8.py).
    q32 = runner_for(path, "float32", "w8a16", threads).model
    ref = copy_dequantized_into(load_model(path, torch.float32, torch.device("cpu"))[0], q32)
    kerr = 0.0
    for p, b in list(zip(prompts, base))[:4]:
        kerr = max(kerr, float((logits(q32, p + b) - logits(ref, p + b)).abs().max()))
    # Baseline: how far fp32 and bf16 of the same unquantised weights are apart by the same measures
    # (random weights give near-flat logits, where any rounding flips ties).
    f32 = runner_for(path, "float32", "", threads)
    full = greedy(f32, prompts, tokens)
    same32 = sum(a == b for x, y in zip(base, full) for a, b in zip(x, y))
    forced32 = sum(int((logits(f32.model, p + b)[len(p) - 1:-1].argmax(-1) == torch.tensor(b)).sum())
                   for p, b in zip(prompts, base))
    total = len(prompts) * tokens
    return {"model": name, "prompts": len(prompts), "tokens": tokens,
            "free_running_same_position": round(same / total, 4),
            "mean_tokens_before_divergence": statistics.mean(prefix),
            "identical_sequences": sum(k == tokens for k in prefix), "teacher_forced_top1": round(forced / total, 4),
            "max_logit_err_vs_bf16": round(max_err, 4), "max_abs_logit_bf16": round(max_ref, 2),
            "max_logit_err_kernel_vs_dequantised_fp32": kerr,
            "baseline_fp32_vs_bf16_same_position": round(same32 / total, 4),
            "baseline_fp32_vs_bf16_teacher_forced_top1": round(forced32 / total, 4)}


def rss_child(name: str, quantize: str, threads: int) -> None:
    """Print the weight bytes and the RSS of a process holding one loaded worker model (KV: 16 blocks)."""
    from workers.backends.int8 import weight_bytes
    r = runner_for(model_dir(name), "bfloat16", quantize, threads, kv_blocks=16)
    rss = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    print(json.dumps({"weight_bytes": weight_bytes(r.model), "rss_bytes": rss}))


def memory(name: str, threads: int) -> dict:
    out = {}
    for q in ("", "w8a16"):
        p = subprocess.run([sys.executable, __file__, "--rss-child", name, q, str(threads)], capture_output=True,
                           text=True, check=True, cwd=ROOT)
        out[q or "bf16"] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def kernels(threads: int) -> list[dict]:
    """One matmul of each bench30m shape: int8pack, dequantise-then-matmul, oneDNN bf16 (best of 5)."""
    import torch.nn.functional as F
    torch.set_num_threads(threads)

    def bench(f, n=20):
        for _ in range(3):
            f()
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(n):
                f()
            best = min(best, (time.perf_counter() - t) / n * 1e6)
        return round(best, 1)

    rows = []
    torch.manual_seed(0)
    for n, k in [(1024, 512), (1376, 512), (512, 688), (32000, 512)]:
        w = torch.randn(n, k)
        s = w.abs().amax(1) / 127
        q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
        sb = s.bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16())
        for m in (1, 4, 8, 16, 24, 32, 64, 128):
            x = torch.randn(m, k).bfloat16()
            rows.append({"N": n, "K": k, "M": m,
                         "int8pack_us": bench(lambda: torch._weight_int8pack_mm(x, q, sb)),
                         "dequant_mm_us": bench(lambda: F.linear(x, q.to(torch.bfloat16)) * sb),
                         "onednn_bf16_us": bench(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none",
                                                                                            [], ""))})
    return rows


def throughput(name: str, levels: list[int], rounds: int, threads: int, prompt_len: int, output_len: int) -> list[dict]:
    from mindie_bench.lab import engine as bench_engine
    loaded = {q: bench_engine.load("", "bfloat16", threads=threads, kv_gb=1.0, quantize=q, preset=name)
              for q in ("", "w8a16")}
    res = {(q, c): [] for q in loaded for c in levels}
    cpu = {(q, c): [] for q in loaded for c in levels}
    for _ in range(rounds):
        for c in levels:
            for q, (runner, cfg, blocks) in loaded.items():  # alternating, same round
                c0 = time.process_time()
                r = bench_engine.throughput(runner, cfg, blocks, c, max(8, 2 * c), prompt_len, output_len,
                                            random.Random(c))
                res[(q, c)].append(r["output_tok_s"])
                cpu[(q, c)].append((time.process_time() - c0) / r["output_tokens"] * 1e3)
    out = []
    for c in levels:
        b, i = res[("", c)], res[("w8a16", c)]
        out.append({"concurrency": c, "bf16_tok_s": statistics.median(b), "int8_tok_s": statistics.median(i),
                    "bf16_best": max(b), "int8_best": max(i), "ratio_of_best": round(max(i) / max(b), 2),
                    "ratio_of_medians": round(statistics.median(i) / statistics.median(b), 2),
                    "per_round_ratios": [round(x / y, 2) for x, y in zip(i, b)],
                    "bf16_cpu_ms_per_token": round(statistics.median(cpu[("", c)]), 2),
                    "int8_cpu_ms_per_token": round(statistics.median(cpu[("w8a16", c)]), 2)})
    return out


def main(argv: list[str] | None = None) -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rss-child":
        rss_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny-tied,tiny-untied,demo,bench30m")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bench-model", default="bench30m", help="model of the memory and throughput figures")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--no-throughput", action="store_true")
    ap.add_argument("--kernels", action="store_true", help="also time the three matmul paths per shape")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import logging
    logging.basicConfig(level=logging.WARNING)

    print(f"torch {torch.__version__}, {args.threads} threads")
    print("\n== greedy agreement with the bf16 model, logit error ==")
    for name in args.models.split(","):
        print(json.dumps(quality(name, args.prompts, args.tokens, args.threads)), flush=True)
    print(f"\n== memory of one worker ({args.bench_model}, bf16 vs w8a16; KV cache 16 blocks of 16) ==")
    mem = memory(args.bench_model, args.threads)
    for k, v in mem.items():
        print(f"{k:6s} weights {v['weight_bytes'] / 2**20:7.1f} MiB   RSS {v['rss_bytes'] / 2**20:7.1f} MiB")
    if not args.no_throughput:
        print(f"\n== engine alone, {args.bench_model}, {args.prompt_len} + {args.output_len} tokens, "
              f"{args.rounds} alternating rounds (medians and best) ==")
        for row in throughput(args.bench_model, [int(c) for c in args.concurrency.split(",")], args.rounds,
                              args.threads, args.prompt_len, args.output_len):
            print(json.dumps(row), flush=True)
    if args.kernels:
        print("\n== one matmul, microseconds (best of 5), bf16 activations ==")
        for row in kernels(args.threads):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
