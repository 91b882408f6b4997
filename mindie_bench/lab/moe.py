#!/usr/bin/env python3
"""A mixture of experts' decode speed: the engine against transformers and against the roofline
of the activated experts' bytes.

Builds (once, in ``--dir``) a random Qwen3-MoE checkpoint with transformers (default: 16 experts,
top 4, hidden 1024, expert intermediate 512, 4 layers, vocabulary 32000, bf16; seeded), then for
each ``--concurrency``:

- the engine: ``roofline.measure_decode`` (the engine's decode steps timed one by one after a
  prefill and a few warm-up steps; runner from ``load_runner``, as mindie_bench/lab/roofline.py),
  with the experts each step activated counted from the routers, and the roofline
  ``batch x read bandwidth / bytes of the step`` (router, shared expert and activated experts
  only: ``roofline.step_bytes``);
- transformers: ``generate`` of the same checkpoint in the same dtype, the batch padded to one
  prompt length, greedy, ``--hf-tokens`` new tokens; decode tokens/s = batch x (new tokens - 1)
  / (time - the time of a 1-token generate, i.e. its prefill).

Both run in this process with the same torch threads, one after the other per batch size, so a
burst of load from other processes lands on both sides about equally; the output says so.

    python -m mindie_bench.lab.moe --concurrency 1,32 --json /tmp/moe.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build(path: Path, experts: int, top_k: int, hidden: int, inter: int, layers: int, vocab: int) -> Path:
    """The random Qwen3-MoE checkpoint (bf16 safetensors), made once."""
    if (path / "config.json").is_file():
        return path
    import transformers
    cfg = transformers.Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * inter,
                                      moe_intermediate_size=inter, num_hidden_layers=layers,
                                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                                      head_dim=64, num_experts=experts, num_experts_per_tok=top_k,
                                      norm_topk_prob=True, max_position_embeddings=4096, bos_token_id=1,
                                      eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_decode(model, batch: int, prompt: int, tokens: int, rng: random.Random) -> float:
    """transformers' decode tokens/s of ``batch`` greedy sequences (see the module docstring)."""
    ids = torch.tensor([[rng.randrange(3, model.config.vocab_size) for _ in range(prompt)] for _ in range(batch)])

    def run(n: int) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, top_k=None, top_p=None, temperature=None, pad_token_id=0)
        return time.perf_counter() - t0

    run(2)  # warm-up
    prefill = min(run(1) for _ in range(2))
    total = run(tokens)
    return batch * (tokens - 1) / max(1e-9, total - prefill)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=os.path.join(os.environ.get("MINDIE_CACHE_DIR", "/tmp"), "moe-bench"))
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512, help="each expert's intermediate size")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--context", type=int, default=128, help="mean context of the engine's timed decode steps")
    ap.add_argument("--steps", type=int, default=16, help="engine: timed decode steps per round")
    ap.add_argument("--repeat", type=int, default=3, help="engine rounds (the median step of all is used)")
    ap.add_argument("--hf-tokens", type=int, default=16, help="transformers: new tokens per generate")
    ap.add_argument("--bw-mib", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from mindie.topology import usable_cores
    from mindie_bench.lab import roofline as rl
    from workers.models.config import ModelArgs
    import transformers

    threads = args.threads or usable_cores()
    torch.set_num_threads(threads)
    path = build(Path(args.dir) / f"qwen3moe-e{args.experts}-k{args.top_k}-h{args.hidden}-i{args.inter}-"
                 f"l{args.layers}-v{args.vocab}", args.experts, args.top_k, args.hidden, args.inter, args.layers,
                 args.vocab)
    margs = ModelArgs.from_dir(path)
    batches = [int(c) for c in args.concurrency.split(",") if c.strip()]
    load_before = os.getloadavg()
    runner, engine_cfg = rl.load(str(path), args.dtype, threads, 16)
    warm = 2
    num_blocks = rl.blocks_needed(max(batches), args.context, args.steps, warm, 16)
    runner.allocate_kv(num_blocks, 16)
    elem = torch.empty((), dtype=runner.kv_dtype).element_size()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    bw = rl.Bandwidth(args.bw_mib << 20, threads)
    rng = random.Random(0)
    rows = []
    for b in batches:
        runs = []
        for r in range(args.repeat):
            bw.sample(2)
            runs.append(rl.measure_decode(runner, engine_cfg, num_blocks, b, args.context, args.steps, warm, rng))
        step = statistics.median(t for x in runs for t in x["step_s"])
        active = statistics.mean(a for x in runs for a in x["active_experts"])
        ctx = runs[0]["contexts"][len(runs[0]["contexts"]) // 2]
        sb = rl.step_bytes(margs, elem, ctx, active)
        hf_tok_s = hf_decode(hf, b, args.context, args.hf_tokens, rng)
        best = max(bw.samples)
        row = {"batch": b, "engine_tok_s": round(b / step, 1), "transformers_tok_s": round(hf_tok_s, 1),
               "active_experts_per_layer": round(active, 2), "step_mb": round(sb["total"] / 1e6, 2),
               "experts_mb": round(sb["w_experts"] / 1e6, 2), "all_experts_mb": round(
                   rl.weight_bytes(margs, elem, margs.moe.num_experts)["experts"] / 1e6, 2),  # type: ignore[union-attr]
               "roofline_tok_s": round(b * best * 1e9 / sb["total"], 1)}
        row["fraction"] = round(row["engine_tok_s"] / row["roofline_tok_s"], 3)
        row["vs_transformers"] = round(row["engine_tok_s"] / row["transformers_tok_s"], 2)
        rows.append(row)
        log(f"batch {b}: {row}")
    bwsum = bw.summary()
    bw.close()
    load_after = os.getloadavg()
    m = margs.moe
    print(f"model {path}: Qwen3-MoE, {margs.num_hidden_layers} layers, hidden {margs.hidden_size}, {m.num_experts} "
          f"experts top-{m.top_k}, expert intermediate {m.moe_intermediate_size}, vocab {margs.vocab_size}; "
          f"{args.dtype}, {threads} threads")
    print(f"read bandwidth: best {bwsum['best_gb_s']} GB/s, median {bwsum['median_gb_s']} GB/s")
    print(f"{'batch':>5} {'engine tok/s':>12} {'transformers tok/s':>18} {'x':>6} {'experts/layer':>13} "
          f"{'experts MB':>10} {'step MB':>8} {'roofline tok/s':>14} {'fraction':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['engine_tok_s']:>12.1f} {r['transformers_tok_s']:>18.1f} {r['vs_transformers']:>6.2f} "
              f"{r['active_experts_per_layer']:>13.2f} {r['experts_mb']:>10.2f} {r['step_mb']:>8.2f} "
              f"{r['roofline_tok_s']:>14.1f} {r['fraction']:>8.3f}")
    print(f"load average (1 min) before / after: {load_before[0]:.2f} / {load_after[0]:.2f} on {os.cpu_count()} CPUs "
          "(a shared machine: other processes' load lands on both sides of each row)")
    result = {"model": str(path), "dtype": args.dtype, "threads": threads, "bandwidth": bwsum, "results": rows,
              "loadavg_before": load_before, "loadavg_after": load_after, "args": vars(args)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
