#!/usr/bin/env python3
"""Decode roofline: how close the engine's decode steps come to this machine's memory bandwidth.

A decode step of a small batch is bound by memory reads: every weight matrix (q/k/v, o,
gate/up, down per layer, the norms, the full LM head) is read once per step whatever the batch,
(a mixture of experts: the router, the shared expert and only the experts the step's tokens were
routed to, counted from the routers' picks during the timed steps), plus each sequence's KV cache (context x layers x 2 x kv_heads x head_dim). So the best a step
can do is ``bytes per step / read bandwidth`` seconds, and the roofline is

    tokens/s = batch x bandwidth / bytes per step

This script measures the read bandwidth (a streaming torch sum over a buffer far larger than the
caches, with torch threads = the cores this process may use, several repeats), computes the bytes
of a step from the model's config, runs the real engine (as mindie_bench/lab/engine.py does) with
``batch`` sequences at ``--context`` tokens and times steady decode steps only (the prefill and a
few warm-up steps are not timed), and prints measured / roofline. ``--repeat`` rounds each take
a few bandwidth samples and then run every batch once; measured tokens/s = batch / the median
timed step of all rounds (a step another process preempted is an outlier on a shared machine).
Progress goes to stderr, the table to stdout, everything with ``--json``.

    python -m mindie_bench.lab.roofline --preset bench30m --dtype bfloat16 --concurrency 1,8,32

Embedding reads (one row per sequence) are counted but negligible. Activations, logits and the
KV write of the new token are not counted: the roofline is an upper bound.

Also ``mindie-bench roofline ...`` (mindie_bench/lab/__init__.py lists the lab's commands).

Engine internals, as ``mindie_bench/lab/engine.py`` (the engine is what it measures: runner from
``load_runner``, steps of ``Engine`` timed one by one), plus ``workers.models.config.ModelArgs`` for
the bytes a step reads and ``workers.backends.get_backend`` for ``--device cuda``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
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


# ---------------------------------------------------------------------------------------------
# Bandwidth


class Bandwidth:
    """Read bandwidth in GB/s (1e9 bytes/s): ``torch.sum`` over a float32 buffer of ``nbytes``
    (filled at construction, so its pages are resident), with ``threads`` torch threads. ``sample``
    adds timed sums; the rounds of the engine measurement take theirs in between, so a burst of
    load from other processes does not land on one side only."""

    def __init__(self, nbytes: int, threads: int, device: str = "cpu") -> None:
        self.threads = threads
        self.device = device
        self.buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        self.samples: list[float] = []
        self.sample(1, keep=False)  # warm the code path

    def sample(self, repeats: int, keep: bool = True) -> None:
        old = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            n = self.buf.numel()
            for _ in range(repeats):
                if self.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                s = float(self.buf.sum())  # float() waits for the device
                dt = time.perf_counter() - t0
                if abs(s - n) > n * 1e-3:  # the sum must have read every element
                    raise RuntimeError(f"bandwidth buffer sum {s} != {n}")
                if keep:
                    self.samples.append(n * 4 / dt / 1e9)
        finally:
            torch.set_num_threads(old)

    def close(self) -> None:
        self.buf = torch.empty(0)

    def summary(self) -> dict[str, Any]:
        return {"bytes": self.buf.numel() * 4, "threads": self.threads, "repeats": len(self.samples),
                "best_gb_s": round(max(self.samples), 2), "median_gb_s": round(statistics.median(self.samples), 2),
                "samples_gb_s": [round(x, 2) for x in self.samples]}


# ---------------------------------------------------------------------------------------------
# Bytes a decode step reads


def expected_active_experts(moe, tokens: int) -> float:
    """Experts one sparse layer reads in a step of ``tokens`` rows, expected under uniform routing:
    each token picks ``top_k`` of ``E``, so an expert is missed by all with probability
    ``(1 - k/E) ** tokens``. 1 token: exactly top_k; many: all E."""
    e, k = moe.num_experts, moe.top_k
    return e * (1.0 - (1.0 - k / e) ** tokens)


def weight_bytes(args, elem: int, active: float | None = None) -> dict[str, int]:
    """Bytes of the weights one decode step reads, by part, for a Llama-family ModelArgs
    (workers/models/config.py) stored with ``elem`` bytes per element. The embedding matrix is
    read one row per sequence (see ``step_bytes``); a tied LM head is that same matrix, read in
    full. A mixture of experts (``args.moe``): each sparse layer reads its router, its shared
    expert and the ``active`` experts the step's tokens picked (workers/models/moe.py reads no
    other); None = top_k (a one-token step)."""
    if getattr(args, "deepseek", None) is not None:
        return deepseek_weight_bytes(args, elem, active)
    h, inter, v = args.hidden_size, args.intermediate_size, args.vocab_size
    q, kv = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
    qkv = h * (q + 2 * kv) + (q + 2 * kv if args.attention_bias else 0)
    o = q * h + (h if args.o_proj_bias else 0)
    gate_up = h * 2 * inter + (2 * inter if args.mlp_bias else 0)
    down = inter * h + (h if args.mlp_bias else 0)
    norms = 2 * h + (2 * args.head_dim if args.qk_norm else 0)
    layers = args.num_hidden_layers
    moe = getattr(args, "moe", None)
    sparse = moe.num_sparse_layers if moe is not None else 0
    dense = layers - sparse
    parts = {
        "qkv": layers * qkv, "o": layers * o, "gate_up": dense * gate_up, "down": dense * down,
        "norms": layers * norms + h,  # + the final norm
        "lm_head": v * h,
    }
    if moe is not None:
        k = moe.top_k if active is None else active
        shared = moe.shared_expert_intermediate_size
        parts["router"] = sparse * moe.num_experts * h
        parts["experts"] = round(sparse * k * 3 * h * moe.moe_intermediate_size)
        parts["shared_expert"] = sparse * (3 * h * shared + (h if moe.shared_expert_gate else 0))
    return {k: n * elem for k, n in parts.items()}


def deepseek_weight_bytes(args, elem: int, active: float | None = None) -> dict[str, int]:
    """``weight_bytes`` of a DeepSeek model (workers/models/deepseek.py): MLA's projections (q_a,
    q_b or q_proj, kv_a, kv_b, o), dense MLPs on its dense layers, and on its MoE layers the fp32
    router, the shared experts and the ``active`` routed experts (None: top_k)."""
    ds = args.deepseek
    h, v, heads = args.hidden_size, args.vocab_size, args.num_attention_heads
    b = 1 if args.attention_bias else 0
    if ds.q_lora_rank is None:
        q = h * heads * ds.qk_head_dim
    else:
        q = h * ds.q_lora_rank + b * ds.q_lora_rank + ds.q_lora_rank + ds.q_lora_rank * heads * ds.qk_head_dim
    kv = h * ds.latent_width + b * ds.latent_width + ds.kv_lora_rank + heads * (
        ds.qk_nope_head_dim + ds.v_head_dim) * ds.kv_lora_rank
    o = heads * ds.v_head_dim * h + b * h
    layers = args.num_hidden_layers
    sparse = sum(ds.is_moe_layer(i) for i in range(layers))
    k = ds.num_experts_per_tok if active is None else active
    parts = {"q": layers * q, "kv": layers * kv, "o": layers * o,
             "mlp": (layers - sparse) * 3 * h * args.intermediate_size, "norms": layers * 2 * h + h, "lm_head": v * h,
             "experts": round(sparse * k * 3 * h * ds.moe_intermediate_size),
             "shared_expert": sparse * 3 * h * ds.moe_intermediate_size * ds.n_shared_experts}
    out = {name: n * elem for name, n in parts.items()}
    out["router"] = sparse * (ds.n_routed_experts * h + (ds.n_routed_experts if ds.scoring == "sigmoid" else 0)) * 4
    return out


def _moe_view(args):
    """What ``expected_active_experts`` reads (num_experts, top_k), for MoeArgs and DeepSeek alike."""
    ds = getattr(args, "deepseek", None)
    if ds is not None and ds.n_routed_experts:
        from types import SimpleNamespace
        return SimpleNamespace(num_experts=ds.n_routed_experts, top_k=ds.num_experts_per_tok)
    return getattr(args, "moe", None)


def kv_bytes(args, elem: int, contexts: list[int]) -> int:
    """K and V read by one decode step: per sequence, ``context`` cached positions (including the
    new token's) x layers x 2 x kv_heads x head_dim x elem; a sliding-window layer reads at most
    its window."""
    per_pos = 2 * args.num_key_value_heads * args.head_dim * elem
    if getattr(args, "deepseek", None) is not None:  # MLA: one latent row per position and layer
        per_pos = args.deepseek.latent_width * elem
    total = 0
    for window in args.layer_windows:
        for c in contexts:
            total += (min(c, window) if window else c) * per_pos
    return total


def stored_weight_bytes(model) -> dict[str, int] | None:
    """Bytes of the weights one decode step reads as the model holds them, for a GGUF file whose
    linears keep their blocks (``cpuTuning.ggufCompute: native``: workers/backends/gguf_linear.py,
    the file's own bytes, read in place); None for a model without such linears (``weight_bytes``
    counts those from the config). The embedding matrix is read one row per sequence
    (``step_bytes``) unless it is the LM head as well."""
    from workers.backends.gguf_linear import GgufLinear
    linears = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, GgufLinear)]
    if not linears:
        return None
    head = sum(mod.nbytes() for name, mod in linears if name.rsplit(".", 1)[-1] in ("logits_linear", "lm_head"))
    emb = getattr(getattr(model, "embed_tokens", None), "weight", None)
    seen: set[int] = set()
    other = 0
    for _, p in model.named_parameters():
        if p.data_ptr() in seen or (emb is not None and p.data_ptr() == emb.data_ptr()):
            continue
        seen.add(p.data_ptr())
        other += p.numel() * p.element_size()
    if not head and emb is not None:  # a tied head computed on the embedding matrix itself
        head = emb.numel() * emb.element_size()
    return {"gguf_linears": sum(mod.nbytes() for _, mod in linears) - head, "lm_head": head, "other": other}


def step_bytes(args, elem: int, contexts: list[int], active: float | None = None,
               stored: dict[str, int] | None = None) -> dict[str, int]:
    """All bytes one decode step of ``len(contexts)`` sequences reads; a mixture of experts reads
    ``active`` experts per sparse layer (None: as many as uniform routing of ``len(contexts)``
    tokens activates, ``expected_active_experts``). ``stored``: the weights' bytes as the model
    holds them (``stored_weight_bytes``: a GGUF file's blocks) instead of the config's count."""
    moe = _moe_view(args)
    if moe is not None and active is None:
        active = expected_active_experts(moe, len(contexts))
    w = stored if stored is not None else weight_bytes(args, elem, active)
    weights = sum(w.values())
    emb = len(contexts) * args.hidden_size * elem
    kv = kv_bytes(args, elem, contexts)
    return {**{f"w_{k}": n for k, n in w.items()}, "weights": weights, "embedding_rows": emb, "kv": kv,
            "total": weights + emb + kv}


# ---------------------------------------------------------------------------------------------
# The engine's decode steps


def load(model: str, dtype: str, threads: int, block_size: int, device: str = "cpu", quantize: str = ""):
    """The engine's runner, set up as mindie_bench/lab/engine.py does (``device``: cpu or cuda;
    ``quantize``: ModelConfig quantize, "" or "w8a16")."""
    from mindie.contract.spec import EngineConfig, WorkerSpec
    from workers.backends import get_backend
    from workers.engine.assembly import load_runner

    engine_cfg = EngineConfig(block_size=block_size, max_seq_len=4096, max_batch_size=256,
                              max_prefill_batch_size=64, max_prefill_tokens=8192, enable_prefix_cache=False,
                              spec_method="")  # one token per sequence per step: the roofline times plain decodes
    spec = WorkerSpec(worker_id="roofline", job_endpoint="", pub_endpoint="", model_path=model, dtype=dtype,
                      engine=engine_cfg, device_type=device, quantize=quantize)
    backend = get_backend(device, threads)
    backend.setup()
    return load_runner(spec, backend), engine_cfg


def blocks_needed(batch: int, context: int, steps: int, warm: int, block_size: int) -> int:
    prompt_len = max(1, context - (warm + steps) // 2)
    return batch * math.ceil((prompt_len + warm + steps + 2 + batch) / block_size) + 2


def measure_decode(runner, engine_cfg, num_blocks: int, batch: int, context: int, steps: int, warm: int,
                   rng: random.Random) -> dict[str, Any]:
    """``batch`` sequences prefilled to about ``context - (warm + steps) // 2`` tokens, ``warm``
    decode steps untimed, then ``steps`` timed: every timed step must decode exactly one token
    per sequence. Returns tokens/s over the timed steps and the context of each sequence at each
    step (cached positions read, the new token's included)."""
    from mindie.contract.wire import SamplingParams, Submit
    from workers.engine.engine import Engine

    prompt_len = max(1, context - (warm + steps) // 2)
    engine = Engine(runner, engine_cfg, num_blocks)
    # The prompts are prefilled in waves (max_prefill_tokens), so the first wave decodes a few
    # steps ahead of the last: up to ``batch`` tokens of slack keep every sequence running through
    # the timed steps, and the sequences are aborted after them.
    params = SamplingParams(max_new_tokens=warm + steps + 2 + batch, ignore_eos=True)
    seqs = []
    for i in range(batch):
        ids = [rng.randrange(3, runner.vocab_size) for _ in range(prompt_len)]
        seqs.append(engine.add(Submit(f"r{i}", "roofline", ids, params)))
    # Prefill (untimed) until every sequence has its first token.
    first: set[int] = set()
    while len(first) < batch:
        for out in engine.step():
            if out.token_ids:
                first.add(id(out.seq))
    for _ in range(warm):
        engine.step()
    contexts: list[list[int]] = []
    times: list[float] = []
    # A mixture of experts: the experts each timed step's sparse layers actually read (their
    # routers' picks), so the roofline counts the activated experts' bytes, not all of them.
    picks: list[int] = []
    hooks = [m.gate.register_forward_hook(lambda _m, _i, out: picks.append(int(out[1].unique().numel())))
             for m in runner.model.modules() if hasattr(m, "experts_forward")]
    active: list[float] = []
    for _ in range(steps):
        picks.clear()
        ctx = [s.num_tokens for s in seqs]  # the step computes position num_tokens - 1: reads num_tokens
        t0 = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t0)
        produced = sum(len(o.token_ids) for o in outs)
        if produced != batch:
            raise RuntimeError(f"a timed step produced {produced} tokens, expected {batch} (not a pure decode step)")
        contexts.append(ctx)
        if picks:
            active.append(statistics.mean(picks))
    for hk in hooks:
        hk.remove()
    for i in range(batch):  # free the blocks
        engine.abort(f"r{i}")
    while engine.has_work():
        engine.step()
    total = sum(times)
    return {"prompt_len": prompt_len, "steps": steps, "tok_s": batch * steps / total,
            "step_ms_median": statistics.median(times) * 1e3, "step_s": times, "contexts": contexts,
            "active_experts": active}


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="Hugging Face model dir or a .gguf file (its linears' blocks counted "
                    "as stored where the server keeps them: cpuTuning.ggufCompute) (default: a demo model, see --preset)")
    ap.add_argument("--preset", default="bench30m", help="built-in demo model when --model is not given "
                    "(workers/models/demo.py PRESETS: demo, bench30m, gpu1b)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--context", type=int, default=192,
                    help="mean context of the timed decode steps (default 192: the middle of 128 + 128 tokens)")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per repeat")
    ap.add_argument("--warm", type=int, default=4, help="untimed decode steps before them")
    ap.add_argument("--repeat", type=int, default=5, help="rounds (bandwidth samples, then every batch once); "
                    "the median round is reported")
    ap.add_argument("--bw-mib", type=int, default=1024, help="bandwidth buffer size in MiB")
    ap.add_argument("--bw-repeat", type=int, default=3, help="bandwidth sums per round")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: usable cores)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: the engine on GPU 0 and the bandwidth of its memory (mindie_bench/lab/gpu_check.sh)")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    from mindie.topology import usable_cores
    from workers.models.config import ModelArgs

    threads = args.threads or usable_cores()
    torch.set_num_threads(threads)
    model = args.model
    if model.endswith(".gguf"):  # the file as the server reads it: its view directory, blocks kept
        from workers.models.gguf_view import ensure_view
        model = str(ensure_view(model))
    if not model:
        from workers.models.demo import PRESETS, ensure_demo_model
        if args.preset not in PRESETS:
            ap.error(f"--preset: one of {', '.join(PRESETS)}")
        model = str(ensure_demo_model(**dataclasses.asdict(PRESETS[args.preset])))
    margs = ModelArgs.from_dir(model)
    batches = [int(c) for c in args.concurrency.split(",") if c.strip()]

    load_before = os.getloadavg()
    log(f"loading {model} ({args.dtype}, {threads} threads) ...")
    runner, engine_cfg = load(model, args.dtype, threads, args.block_size, args.device)
    num_blocks = blocks_needed(max(batches), args.context, args.steps, args.warm, args.block_size)
    runner.allocate_kv(num_blocks, args.block_size)
    elem = torch.empty((), dtype=runner.kv_dtype).element_size()
    stored = stored_weight_bytes(runner.model)  # a GGUF file's blocks: its own bytes
    if stored is not None:
        log(f"weights as stored (GGUF blocks): {sum(stored.values()) / 2**20:.1f} MiB per step")
    bw_per_round = max(1, args.bw_repeat)
    log(f"bandwidth buffer: {args.bw_mib} MiB, {threads} threads, {bw_per_round} sums per round")
    bw = Bandwidth(args.bw_mib << 20, threads, args.device)
    rng = random.Random(0)
    runs: dict[int, list[dict[str, Any]]] = {b: [] for b in batches}
    # Rounds: bandwidth samples, then each batch once, so load from other processes is spread.
    round_bw: list[float] = []
    for r in range(args.repeat):
        bw.sample(bw_per_round)
        round_bw.append(max(bw.samples[-bw_per_round:]))
        log(f"round {r + 1}/{args.repeat}: bandwidth {' '.join(f'{x:.1f}' for x in bw.samples[-bw_per_round:])} GB/s")
        for b in batches:
            res = measure_decode(runner, engine_cfg, num_blocks, b, args.context, args.steps, args.warm, rng)
            runs[b].append(res)
            log(f"  batch {b}: {args.steps} decode steps at ~{args.context} tokens: {res['tok_s']:.1f} tok/s, "
                f"step {res['step_ms_median']:.2f} ms")
    bwsum = bw.summary()
    load_after = os.getloadavg()
    bw.close()
    rows = []
    for b in batches:
        # Bytes per step: the mean over the timed steps (the context grows by one each step).
        acts = runs[b][0]["active_experts"] or [None] * len(runs[b][0]["contexts"])
        per_step = [step_bytes(margs, elem, ctx, a, stored) for ctx, a in zip(runs[b][0]["contexts"], acts)]
        sb = {k: round(statistics.mean(p[k] for p in per_step)) for k in per_step[0]}
        mean_ctx = statistics.mean(c for ctx in runs[b][0]["contexts"] for c in ctx)
        # Measured: batch / the median of all timed steps of all rounds (a step that another
        # process preempted is an outlier, not the engine's pace); "window": tokens / time over
        # each round's timed steps, median of the rounds (preemption stalls included).
        step_med = statistics.median(t for x in runs[b] for t in x["step_s"])
        measured = b / step_med
        window = statistics.median(x["tok_s"] for x in runs[b])
        roof_best = b * bwsum["best_gb_s"] * 1e9 / sb["total"]
        roof_median = b * bwsum["median_gb_s"] * 1e9 / sb["total"]
        # Paired: each round's median step against the best bandwidth sample of the same round.
        # The VM's share of the memory bandwidth moves between plateaus from minute to minute;
        # this compares the engine with what the memory delivered while it ran.
        paired = [sb["total"] / (x["step_ms_median"] / 1e3) / (bw_r * 1e9)
                  for x, bw_r in zip(runs[b], round_bw)]
        rows.append({
            "batch": b, "mean_context": round(mean_ctx, 1), "bytes_per_step": sb,
            "roofline_tok_s": round(roof_best, 1), "roofline_tok_s_median_bw": round(roof_median, 1),
            "measured_tok_s": round(measured, 1), "step_ms_median": round(step_med * 1e3, 3),
            "fraction": round(measured / roof_best, 4),
            "fraction_paired": round(statistics.median(paired), 4),
            "fraction_paired_rounds": [round(x, 4) for x in paired],
            "round_best_gb_s": [round(x, 2) for x in round_bw],
            "step_ms_rounds": [round(x["step_ms_median"], 4) for x in runs[b]],
            "window_tok_s": round(window, 1), "window_tok_s_rounds": [round(x["tok_s"], 1) for x in runs[b]],
            "implied_gb_s": round(sb["total"] / step_med / 1e9, 2),
        })
        if _moe_view(margs) is not None:
            rows[-1]["active_experts_per_layer"] = round(statistics.mean(a for x in runs[b] for a in x["active_experts"]), 2)

    dtype_name = str(runner.kv_dtype).replace("torch.", "")
    where = f"{threads} threads" if args.device == "cpu" else torch.cuda.get_device_name(0)
    print(f"model {model}: {margs.num_hidden_layers} layers, hidden {margs.hidden_size}, "
          f"{margs.num_attention_heads}/{margs.num_key_value_heads} heads x {margs.head_dim}, "
          f"intermediate {margs.intermediate_size}, vocab {margs.vocab_size}; {dtype_name}, {where}")
    if margs.moe is not None:
        m = margs.moe
        print(f"mixture of experts: {m.num_experts} experts, top-{m.top_k}, expert intermediate "
              f"{m.moe_intermediate_size}, {m.num_sparse_layers} sparse layers; experts read per sparse layer and "
              "step (measured from the routers): " + ", ".join(f"batch {r['batch']}: {r['active_experts_per_layer']}"
                                                              for r in rows))
    elif getattr(margs, "deepseek", None) is not None and margs.deepseek.n_routed_experts:
        d = margs.deepseek
        print(f"DeepSeek (MLA, latent {d.latent_width} per token and layer): {d.n_routed_experts} experts, "
              f"top-{d.num_experts_per_tok}, expert intermediate {d.moe_intermediate_size}; experts read per MoE layer "
              "and step (measured from the routers): " + ", ".join(f"batch {r['batch']}: {r['active_experts_per_layer']}"
                                                                  for r in rows))
    print(f"read bandwidth: best {bwsum['best_gb_s']} GB/s, median {bwsum['median_gb_s']} GB/s "
          f"({bwsum['repeats']} x torch.sum over {bwsum['bytes'] >> 20} MiB)")
    hdr = (f"{'batch':>5} {'context':>7} {'weights MB':>10} {'KV MB':>8} {'step MB':>8} {'roofline tok/s':>14} "
           f"{'measured tok/s':>14} {'fraction':>8} {'paired':>6} {'step ms':>8} {'implied GB/s':>12} "
           f"{'window tok/s':>12}")
    print(hdr)
    for row in rows:
        sb = row["bytes_per_step"]
        print(f"{row['batch']:>5} {row['mean_context']:>7.1f} {sb['weights'] / 1e6:>10.2f} {sb['kv'] / 1e6:>8.2f} "
              f"{sb['total'] / 1e6:>8.2f} {row['roofline_tok_s']:>14.1f} {row['measured_tok_s']:>14.1f} "
              f"{row['fraction']:>8.3f} {row['fraction_paired']:>6.3f} {row['step_ms_median']:>8.2f} "
              f"{row['implied_gb_s']:>12.2f} "
              f"{row['window_tok_s']:>12.1f}")
    print(f"load average (1 min) before / after: {load_before[0]:.2f} / {load_after[0]:.2f} on {os.cpu_count()} CPUs")
    print("roofline = batch x best bandwidth / bytes per step; measured = batch / median decode step (all "
          "rounds); fraction = measured / roofline; paired = bytes per step / (a round's median step x the "
          "best bandwidth of the same round), median of the rounds; implied GB/s = bytes per step / median "
          "step; window = tokens / time of each round's timed steps, median of the rounds")
    result = {"model": model, "dtype": dtype_name, "threads": threads, "bandwidth": bwsum, "results": rows,
              "loadavg_before": load_before, "loadavg_after": load_after,
              "args": vars(args)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
