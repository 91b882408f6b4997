#!/usr/bin/env python3
"""Where one decode step's time goes: the benchmark model on the CPU backend as the worker runs it
(prepacked linears, C kernels unless MINDIE_CPU_KERNELS=0), timed per part with wall clocks
around the modules: linear layers, LM head, attention (cache write included), RMSNorm, rope,
and the rest (embedding, residual adds, SwiGLU, metadata, argmax).

    python -m mindie_bench.lab.profile_step --batch 1,8,32,64

Also ``mindie-bench profile-step ...`` (mindie_bench/lab/__init__.py lists the lab's commands).

Engine internals, on purpose: it wraps the model's modules (``load_model`` on a ``CpuBackend``)
with timers; a breakdown per module kind needs the modules themselves.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import time

import torch

from workers.backends.cpu import CpuBackend
from workers.models.loader import load_model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model dir (default: the bench30m preset)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=190, help="tokens already cached per sequence")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prefill", type=int, default=0,
                    help="profile prompt chunks of this many tokens instead (one sequence per batch entry, "
                         "from position --context)")
    args = ap.parse_args(argv)
    path = args.model
    if not path:
        from workers.models.demo import PRESETS, ensure_demo_model
        path = str(ensure_demo_model(**dataclasses.asdict(PRESETS["bench30m"])))
    backend = CpuBackend()
    backend.setup()
    model = load_model(path, dtype=getattr(torch, args.dtype))[0]
    backend.prepare_model(model)
    a = model.args
    bs = 128
    per_seq = -(-(args.context + max(1, args.prefill)) // bs)
    max_b = max(int(b) for b in args.batch.split(","))
    attn = backend.attention_class()(a.num_hidden_layers, max_b * per_seq + 1, bs, a.num_key_value_heads,
                                     a.head_dim, getattr(torch, args.dtype), torch.device("cpu"))
    spent: dict[str, float] = collections.defaultdict(float)

    def timed(fn, key):
        def wrapper(*xs, **kw):
            t = time.perf_counter()
            out = fn(*xs, **kw)
            spent[key] += time.perf_counter() - t
            return out
        return wrapper

    head = model.logits_linear or model.lm_head
    for name, mod in model.named_modules():
        kind = type(mod).__name__
        if "Linear" in kind and not name.startswith("lm_head"):
            mod.forward = timed(mod.forward, "linear layers")
        elif "RMSNorm" in kind:
            mod.forward = timed(mod.forward, "RMSNorm")
    model.rope.rotate = timed(model.rope.rotate, "rope")
    attn_call = type(attn).__call__
    type(attn).__call__ = lambda self, *xs, **kw: timed(attn_call, "attention")(self, *xs, **kw)
    if model.logits_linear is not None:
        model.logits_linear = timed(head, "LM head")
    else:
        model.compute_logits = timed(model.compute_logits, "LM head")
    print(f"{path} ({args.dtype}), {torch.get_num_threads()} threads, context {args.context}, "
          f"attention {type(attn).__name__}")
    with torch.inference_mode():
        for b in (int(x) for x in args.batch.split(",")):
            tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
            new = max(1, args.prefill)  # tokens per sequence this step
            ids = torch.randint(0, a.vocab_size, (b * new,))
            pos = torch.arange(args.context, args.context + new).repeat(b)
            last = torch.arange(new - 1, b * new, new)
            totals = []
            for i in range(args.steps):
                if i == args.steps // 4:
                    spent.clear()
                    totals.clear()
                t = time.perf_counter()
                attn.prepare(tables, [args.context] * b, [new] * b)
                model.compute_logits(model(ids, pos, attn)[last]).argmax(-1).tolist()
                totals.append(time.perf_counter() - t)
            n = len(totals)
            step = statistics.fmean(totals) * 1000
            parts = {k: v / n * 1000 for k, v in spent.items()}
            rest = step - sum(parts.values())
            shown = ", ".join(f"{k} {v:.2f} ({v / step:.0%})" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
            print(f"batch {b:>3}: step {step:.2f} ms = {shown}, rest {rest:.2f} ({rest / step:.0%})")


if __name__ == "__main__":
    main()
