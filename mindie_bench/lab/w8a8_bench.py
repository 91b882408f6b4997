#!/usr/bin/env python3
"""bf16 against ``quantize: "w8a16"`` and ``"w8a8"`` on the CPU backend, engine alone: weight
bytes, decode tokens/s at each --concurrency after --prompt-len-token prompts (random ids,
speculation off, the three alternating round by round: medians and best), the time of one
--prompt-len-token prompt (best of --rounds), and each scheme's logits against bf16's over one
such prompt (the largest difference over the logits' spread; top-1 agreement per position).

    python -m mindie_bench.lab.w8a8_bench                    # SmolLM2-135M's shape, random bf16 weights
    python -m mindie_bench.lab.w8a8_bench --shape bench30m   # a demo preset
    python -m mindie_bench.lab.w8a8_bench --dtype auto --no-native-bf16   # as on a CPU without native bf16

The default shape is the default model's (hidden 576, 30 layers, 9 heads, 3 KV heads,
intermediate 1536, tied head; the demo's 32000-token vocabulary): its file is a GGUF, whose
blocks are not bf16 Hugging Face weights. Also ``mindie-bench w8a8 ...``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SMOL = dict(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, max_position_embeddings=2048,
            dtype="bfloat16")
SCHEMES = ("", "w8a16", "w8a8")


def model_dir(shape: str) -> str:
    from workers.models.demo import PRESETS, ensure_demo_model
    return str(ensure_demo_model(**(SMOL if shape == "smollm2-135m" else dataclasses.asdict(PRESETS[shape]))))


def load(path: str, quantize: str, threads: int, dtype: str = "bfloat16"):
    """(runner, engine config, KV blocks): as the worker builds it, speculation off."""
    from mindie.contract.spec import EngineConfig, WorkerSpec
    from workers.backends.cpu import CpuBackend
    from workers.engine.assembly import load_runner
    cfg = EngineConfig(block_size=16, max_seq_len=2048, max_batch_size=64, max_prefill_batch_size=64,
                       max_prefill_tokens=4096, enable_prefix_cache=False, spec_method="")
    spec = WorkerSpec(worker_id="bench", job_endpoint="", pub_endpoint="", model_path=path, dtype=dtype,
                      engine=cfg, quantize=quantize)
    runner = load_runner(spec, CpuBackend(threads))
    blocks = 1024
    runner.allocate_kv(blocks, 16)
    return runner, cfg, blocks


def prompt_ms(runner, cfg, blocks: int, ids: list[int]) -> float:
    """One prompt's step (its first token), milliseconds."""
    from mindie.contract.wire import SamplingParams, Submit
    from workers.engine.engine import Engine
    engine = Engine(runner, cfg, blocks)
    t = time.perf_counter()
    engine.add(Submit("p", "bench", ids, SamplingParams(max_new_tokens=1, ignore_eos=True)))
    while engine.has_work():
        engine.step()
    return (time.perf_counter() - t) * 1e3


def main(argv: list[str] | None = None) -> None:
    from mindie_bench.lab import engine as bench_engine
    from mindie_bench.lab.int8_quality import logits
    from workers.backends.int8 import weight_bytes
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m", help="smollm2-135m, or a demo preset (bench30m, demo)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", help="ModelConfig dtype of all three (auto: the worker's choice)")
    ap.add_argument("--no-native-bf16", action="store_true",
                    help="cpuTuning.nativeBf16 false: as on a CPU without avx512_bf16 / amx_bf16 (with --dtype auto)")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--rounds", type=int, default=3, help="0: weight bytes and logits only")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import logging
    logging.basicConfig(level=logging.WARNING)
    if args.no_native_bf16:
        from workers import settings
        settings.apply(settings.with_cpu(native_bf16=False))
    path = model_dir(args.shape)
    loaded = {q: load(path, q, args.threads, args.dtype) for q in SCHEMES}
    ids = [random.Random(1).randrange(3, 32000) for _ in range(args.prompt_len)]
    base = logits(loaded[""][0].model, ids).float()
    spread = float(base.max() - base.min())
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.shape} ({path}), dtype {args.dtype}"
          f"{', cpuTuning.nativeBf16 false' if args.no_native_bf16 else ''}: "
          + ", ".join(f"{q or 'bf16'} computes in {r.model.embed_tokens.weight.dtype}" for q, (r, _, _) in loaded.items()))
    for q, (runner, _, _) in loaded.items():
        got = logits(runner.model, ids).float()
        print(json.dumps({"scheme": q or "bf16", "weight_MiB": round(weight_bytes(runner.model) / 2**20, 1),
                          "max_logit_diff_over_spread_vs_bf16": round(float((got - base).abs().max()) / spread, 4),
                          "top1_agreement_vs_bf16": round(float((got.argmax(-1) == base.argmax(-1)).float().mean()), 3)}),
              flush=True)
    if not args.rounds:  # --rounds 0: bytes and logits only
        return
    levels = [int(c) for c in args.concurrency.split(",")]
    tok = {(q, c): [] for q in SCHEMES for c in levels}
    pre = {q: [] for q in SCHEMES}
    for r in range(args.rounds):
        for q, (runner, cfg, blocks) in loaded.items():  # alternating, same round
            pre[q].append(prompt_ms(runner, cfg, blocks, ids))
            for c in levels:
                out = bench_engine.throughput(runner, cfg, blocks, c, 2 * c, args.prompt_len, args.output_len,
                                              random.Random(c))
                tok[(q, c)].append(out["output_tok_s"])
    for q in SCHEMES:
        row = {"scheme": q or "bf16", f"prompt_{args.prompt_len}_ms_best": round(min(pre[q]), 1)}
        for c in levels:
            row[f"c{c}_tok_s_median"] = round(statistics.median(tok[(q, c)]), 1)
            row[f"c{c}_tok_s_best"] = round(max(tok[(q, c)]), 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
