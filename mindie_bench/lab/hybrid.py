#!/usr/bin/env python3
"""A 1B-class Qwen3.5 shape (Gated DeltaNet + gated full attention, three to one): engine-alone
output tokens/s against transformers' ``generate`` on the same weights, side by side in one process,
and the memory a sequence costs against the same-size full-attention twin.

    python -m mindie_bench.lab.hybrid --concurrency 1,32 --threads 1   # = mindie-bench hybrid

The models are ``mindie-bench bench-models qwen35-1b`` and ``qwen35-1b-twin`` (hybrid_models.py;
``--preset qwen35-tiny`` is the same at a toy size). Each level runs one wave of ``c`` requests
(random prompts of ``--prompt-len`` ids, ``--output-len`` new tokens, greedy, EOS ignored): ours
through ``mindie_bench.lab.engine`` (the worker's runner with its KV cache and state pool, the
engine), transformers as one ``generate`` call over the ``c`` prompts (equal lengths, no padding;
its own cache), ours first then transformers, ``--rounds`` times. vLLM's CPU build is not in this
comparison: it is not installable on these machines.

Memory: computed from each config.json (a linear layer's conv state ``conv_dim x (kernel - 1)`` in
the model dtype, its recurrent state ``v_heads x k_dim x v_dim`` in fp32; a full-attention layer's K
and V ``kv_heads x head_dim`` per token), then checked against what the engine's load logs for the
same models (``load_runner``'s "KV cache" line, ``state_pool_budget``'s "state pool" line): a
mismatch fails the run. Per sequence at each ``--contexts`` length: hybrid = state + KV x tokens,
twin = KV x tokens.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import re
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root


def config_bytes(path: Path, elem: int) -> dict[str, int]:
    """(state bytes per sequence, KV bytes per token) from a checkpoint's config.json, ``elem`` the
    bytes of the model dtype; no state for a model without linear-attention layers."""
    cfg = json.loads((path / "config.json").read_text())
    types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    n_lin, n_full = types.count("linear_attention"), types.count("full_attention")
    kv = n_full * cfg["num_key_value_heads"] * cfg["head_dim"] * 2 * elem
    if not n_lin:
        return {"conv": 0, "recurrent": 0, "state": 0, "kv_per_token": kv}
    kd, vd = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    kh, vh = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    conv = n_lin * (2 * kh * kd + vh * vd) * (cfg["linear_conv_kernel_dim"] - 1) * elem
    rec = n_lin * vh * kd * vd * 4  # fp32, whatever the model dtype
    return {"conv": conv, "recurrent": rec, "state": conv + rec, "kv_per_token": kv}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.text: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.text.append(record.getMessage())


def logged_bytes(path: Path, dtype: str, threads: int, slots: int, keep: bool = False) -> tuple[dict[str, int], Any]:
    """What the engine's load logs for ``path``: {"state", "kv_per_token"}; the loaded
    (runner, engine config, KV blocks) too when ``keep``, else None (the model freed)."""
    from mindie_bench.lab.engine import load
    from workers.engine.assembly import state_pool_budget
    lines = _Lines()
    root = logging.getLogger()
    root.addHandler(lines)
    level = root.level
    root.setLevel(logging.INFO)
    try:
        loaded = load(str(path), dtype, threads=threads, kv_gb=0.25, max_batch_size=slots)
        runner = loaded[0]
        if runner.state_slots:
            state_pool_budget(runner, 1 << 40, runner.bytes_per_block(128), loaded[1])
    finally:
        root.removeHandler(lines)
        root.setLevel(level)
    text = "\n".join(lines.text)
    kv = re.search(r"KV cache:? (\d+) bytes per token", text)
    state = re.search(r"x (\d+) bytes per sequence", text)
    if kv is None:
        raise SystemExit(f"hybrid: no KV bytes per token in the load log of {path}:\n{text}")
    out = {"state": int(state.group(1)) if state else 0, "kv_per_token": int(kv.group(1))}
    if not keep:
        del loaded, runner
        gc.collect()
        return out, None
    return out, loaded


def memory_rows(hybrid: dict[str, int], twin: dict[str, int], contexts: list[int]) -> list[dict[str, Any]]:
    """Bytes one sequence holds at each context length, hybrid against twin."""
    rows = []
    for n in contexts:
        h, t = hybrid["state"] + hybrid["kv_per_token"] * n, twin["kv_per_token"] * n
        rows.append({"context": n, "hybrid_bytes": h, "twin_bytes": t, "twin_over_hybrid": round(t / h, 2)})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen35-1b", help="hybrid preset (its twin is PRESET-twin); default qwen35-1b")
    ap.add_argument("--concurrency", default="1,32", help="comma-separated levels (default 1,32)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=1, help="each level this many times (default 1)")
    ap.add_argument("--contexts", default="1024,8192,32768", help="context lengths of the memory table")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for both sides (default 1: on the shared 2-core machines two OpenMP "
                         "threads spin against other processes; a 32-token c=1 request took minutes)")
    ap.add_argument("--memory-only", action="store_true", help="the memory figures alone, no tokens/s")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]

    from mindie_bench.lab import hybrid_models
    from mindie_bench.lab.deepseek import hf_throughput
    from mindie_bench.lab.engine import throughput
    hybrid_dir = hybrid_models.ensure(args.preset)
    twin_dir = hybrid_models.ensure(f"{args.preset}-twin")
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    computed = {"hybrid": config_bytes(hybrid_dir, elem), "twin": config_bytes(twin_dir, elem)}
    logged_twin, _ = logged_bytes(twin_dir, args.dtype, args.threads, max(levels))
    logged_hybrid, loaded = logged_bytes(hybrid_dir, args.dtype, args.threads, max(levels), keep=not args.memory_only)
    for name, logged in (("hybrid", logged_hybrid), ("twin", logged_twin)):
        want = {k: computed[name][k] for k in logged}
        if logged != want:
            raise SystemExit(f"hybrid: the load log's bytes of the {name} model {logged} "
                             f"differ from its config's {want}")
    memory = memory_rows(computed["hybrid"], computed["twin"], [int(c) for c in args.contexts.split(",")])
    print(json.dumps({"bytes": computed, "load_log_agrees": True}))
    for row in memory:
        print(json.dumps(row))
    summary: dict[str, Any] = {"args": vars(args), "model": str(hybrid_dir), "twin": str(twin_dir),
                               "bytes": computed, "memory": memory, "results": []}
    if not args.memory_only:
        import transformers
        runner, engine_cfg, num_blocks = loaded
        hf = transformers.AutoModelForCausalLM.from_pretrained(hybrid_dir, dtype=getattr(torch, args.dtype)).eval()
        n_params = sum(p.numel() for p in hf.parameters())
        summary["parameters"] = n_params
        print(f"{args.preset}: {n_params / 1e9:.2f}B parameters, {args.dtype}, {torch.get_num_threads()} threads",
              file=sys.stderr)
        for rnd in range(args.rounds):
            for conc in levels:
                ours = throughput(runner, engine_cfg, num_blocks, conc, conc, args.prompt_len, args.output_len,
                                  random.Random(conc))["output_tok_s"]
                ref = hf_throughput(hf, conc, args.prompt_len, args.output_len, runner.vocab_size,
                                    random.Random(conc))["output_tok_s"]  # a warm-up generate first, untimed
                row = {"round": rnd + 1, "concurrency": conc, "ours_tok_s": round(ours, 2),
                       "transformers_tok_s": round(ref, 2), "ratio": round(ours / ref, 2)}
                summary["results"].append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
