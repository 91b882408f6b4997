#!/usr/bin/env python3
"""A tiny DeepSeek-V3 shape (multi-head latent attention, grouped sigmoid routing, a shared expert):
engine-alone output tokens/s at each concurrency against transformers' ``generate`` on the same
weights, side by side in one process, and the KV bytes per token of the latent cache against full
per-head K/V.

    python -m mindie_bench.lab.deepseek --concurrency 1,32 --dtype bfloat16 --threads 1   # = mindie-bench deepseek

The model (random weights, built with transformers' DeepseekV3Config and saved once under
``--dir``): hidden 512, 4 layers (the first dense), 16 heads, q_lora_rank 192, kv_lora_rank 128,
qk_nope/rope/v head dims 32/16/32, 16 routed experts (top 4 in the 2 best of 4 groups) of 256 plus
one shared, vocabulary 16000. Each level runs one wave of ``c`` requests (random prompts of
``--prompt-len`` ids, ``--output-len`` tokens, greedy, EOS ignored): ours through
``mindie_bench.lab.engine`` (the worker's runner, its KV cache, the engine), transformers as one
``generate`` call over the ``c`` prompts (equal lengths, no padding; its own DynamicCache).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

SHAPE = dict(vocab_size=16000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
             num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=16,
             n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
             q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
             max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, routed_scaling_factor=2.5)


def build(path: Path) -> Path:
    """The tiny DeepSeek-V3 checkpoint at ``path`` (made once)."""
    if (path / "config.json").is_file():
        return path
    import transformers
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(**SHAPE)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0.0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return path


def hf_throughput(model, conc: int, prompt_len: int, output_len: int, vocab: int, rng: random.Random) -> dict:
    ids = torch.tensor([[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(conc)])
    with torch.no_grad():
        model.generate(ids[:1, :16], max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False)
    dt = time.perf_counter() - t0
    tokens = (out.shape[1] - prompt_len) * conc
    return {"concurrency": conc, "output_tokens": tokens, "seconds": round(dt, 2),
            "output_tok_s": round(tokens / dt, 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/mindie-bench-deepseek-v3-tiny", help="where the checkpoint is made")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for both (default 1: on a shared, loaded machine two OpenMP threads "
                         "spin against other processes and a step took 20x longer)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    import transformers

    from mindie_bench.lab.engine import load, throughput
    from workers.models.config import ModelArgs
    from workers.models.deepseek import kv_bytes_per_token

    path = build(Path(args.dir))
    margs = ModelArgs.from_dir(path)
    dtype = getattr(torch, args.dtype)
    latent, full = kv_bytes_per_token(margs, torch.empty((), dtype=dtype).element_size())
    runner, engine_cfg, num_blocks = load(str(path), args.dtype, threads=args.threads, block_size=16, kv_gb=0.5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    n_params = sum(p.numel() for p in hf.parameters())
    print(f"tiny DeepSeek-V3 ({n_params / 1e6:.1f}M parameters, {args.dtype}), {torch.get_num_threads()} threads; "
          f"KV bytes per token: {latent} (latent) against {full} (full K/V), {full / latent:.1f}x", file=sys.stderr)
    results = []
    for conc in [int(c) for c in args.concurrency.split(",")]:
        ours = throughput(runner, engine_cfg, num_blocks, conc, conc, args.prompt_len, args.output_len,
                          random.Random(conc))
        ref = hf_throughput(hf, conc, args.prompt_len, args.output_len, margs.vocab_size, random.Random(conc))
        row = {"concurrency": conc, "ours_tok_s": ours["output_tok_s"], "transformers_tok_s": ref["output_tok_s"],
               "ratio": round(ours["output_tok_s"] / ref["output_tok_s"], 2)}
        results.append(row)
        print(json.dumps(row))
    summary = {"args": vars(args), "parameters": n_params, "kv_bytes_per_token": {"mla": latent, "full_kv": full},
               "results": results}
    print(json.dumps(summary["kv_bytes_per_token"]))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
