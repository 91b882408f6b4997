#!/usr/bin/env python3
"""What LoRA adapters cost: the real server (scripts/launch.sh) with N adapters loaded at run time.

1. output tokens/s at concurrency C (32) on the base model alone, then with every request naming
   one of the N (4) adapters in turn, so that each step mixes them (/infer_token streams,
   ``parameters.adapter_id``); alternated for ``--rounds``;
2. the inter-token latency (p50, p99, max) of C running streams while nothing else happens, and
   while adapters are loaded and unloaded over and over through /v1/load_lora_adapter (each load
   reads the files and prepares the tensors on the worker's reader thread, beside the steps).

The adapters are random (every projection of every layer, rank ``--rank``), written as peft writes
them (``adapter_config.json`` and ``adapter_model.safetensors``), so this needs no peft.

    python -m mindie_bench.lab.lora                       # the bench30m model, bf16, 4 adapters of rank 16
    python -m mindie_bench.lab.lora --model DIR --concurrency 32 --rank 16 --load-rank 64
    python -m mindie_bench.lab.lora --model default       # the default model (SmolLM2-135M-Instruct's GGUF)

Also ``mindie-bench lora ...`` (mindie_bench/lab/__init__.py lists the lab's commands). Public
entry points only: the server through ``scripts/launch.sh`` (``serving.start_server``), the load
from mindie-bench's runner (progress on stderr), the adapters through the HTTP routes; of the
engine only a GGUF file's metadata (``workers.models.gguf_file``, for the adapters' shapes) and the
default model's file.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from mindie_bench.api_clients import NativeAdapter
from mindie_bench.lab.serving import bench_model, start_server
from mindie_bench import stats as st
from mindie_bench.runner import LoadConfig, run_async, run_segment
from mindie_bench.workload import RequestSpec, make_workload

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(model_dir: str, out: Path, rank: int, seed: int) -> Path:
    """A random peft-format LoRA adapter of every linear projection of the model at ``model_dir``."""
    import torch
    from safetensors.torch import save_file

    if str(model_dir).endswith(".gguf"):  # a GGUF file: its metadata as a Hugging Face config
        from workers.models.gguf_file import hf_config, open_gguf
        cfg = hf_config(open_gguf(model_dir))[0]
    else:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hid, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or hid // heads
    shapes = {"q_proj": (heads * hd, hid), "k_proj": (kv * hd, hid), "v_proj": (kv * hd, hid),
              "o_proj": (hid, heads * hd), "gate_proj": (inter, hid), "up_proj": (inter, hid),
              "down_proj": (hid, inter)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for t in TARGETS:
            block = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            out_f, in_f = shapes[t]
            pre = f"base_model.model.model.layers.{i}.{block}.{t}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.02
            tensors[f"{pre}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "bias": "none", "base_model_name_or_path": model_dir}))
    return out


def post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, str]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class CyclingAdapter(NativeAdapter):
    """/infer_token requests naming ``names[index % len(names)]`` ("" = the base model)."""

    def __init__(self, url: str, names: list[str]):
        super().__init__(url)
        self.names = names

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        body = super().body(spec)
        name = self.names[spec.index % len(self.names)]
        if name:
            body["parameters"]["adapter_id"] = name
        return body


async def churn(url: str, path: str, stop: asyncio.Event, loads: list[float]) -> None:
    """Load and unload an adapter again and again until ``stop``; the time of each load."""
    n = 0
    while not stop.is_set():
        name = f"churn{n % 2}"
        t0 = time.perf_counter()
        status, text = await asyncio.to_thread(post, url + "/v1/load_lora_adapter",
                                               {"lora_name": name, "lora_path": path})
        if status != 200:
            raise RuntimeError(f"load failed: {status} {text}")
        loads.append(time.perf_counter() - t0)
        await asyncio.to_thread(post, url + "/v1/unload_lora_adapter", {"lora_name": name})
        n += 1


def steady_itl(results, skip: int = 8) -> dict:
    """The gaps between tokens of the streams while all of them were past their first ``skip``
    tokens and none had finished (the wave of prompts at the start of a segment, with its prefill
    steps, is not what a load would stall)."""
    ok = [r for r in results if r.ok and len(r.chunk_times) > skip + 1]
    if not ok:
        return st.summarize([])
    lo = max(r.chunk_times[skip] for r in ok)
    hi = min(r.chunk_times[-1] for r in ok)
    gaps = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:]) if a >= lo and b <= hi]
    return {**st.summarize(gaps, 1000.0), "window_s": max(0.0, hi - lo)}


async def itl_segment(url: str, names: list[str], cfg: LoadConfig, workload, label: str,
                      churn_path: str | None) -> tuple[dict, list[float]]:
    """One segment of streams; with ``churn_path`` adapters are loaded and unloaded throughout."""
    stop = asyncio.Event()
    loads: list[float] = []
    task = asyncio.create_task(churn(url, churn_path, stop, loads)) if churn_path else None
    try:
        seg = await run_segment(CyclingAdapter(url, names), workload, cfg, label)
    finally:
        stop.set()
        if task is not None:
            await task
    seg.stats["steady_itl_ms"] = steady_itl(seg.results)
    return seg.stats, loads


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model dir or GGUF file (default: the bench30m preset; "
                                              "'default': the default model, SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workers", type=int, default=1, help="CPU device workers (1: every request in one batch)")
    ap.add_argument("--threads", type=int, default=0,
                    help="cpuThreadsPerWorker (0: the cores shared out; 1 keeps a busy machine's spells from "
                         "stalling a worker's OpenMP barriers)")
    ap.add_argument("--adapters", type=int, default=4, help="adapters in the mixed batch")
    ap.add_argument("--rank", type=int, default=16, help="their rank (every projection of every layer)")
    ap.add_argument("--load-rank", type=int, default=64, help="rank of the adapter loaded during the ITL run")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-len", default="128")
    ap.add_argument("--output-len", default="128")
    ap.add_argument("--num-prompts", type=int, default=0, help="per segment (default: the concurrency, one wave)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the four segments, alternated")
    ap.add_argument("--port", type=int, default=18720)
    ap.add_argument("--out", default="bench-results/lora")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    model = args.model or bench_model()
    if model == "default":
        from workers.models.default_model import default_model_file
        model = str(default_model_file())
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench"))
    names = [f"lora{i}" for i in range(args.adapters)]
    paths = {n: write_adapter(model, tmp / n, args.rank, i) for i, n in enumerate(names)}
    churn_path = str(write_adapter(model, tmp / "churn", args.load_rank, 99))
    print(f"model {model}; {args.adapters} adapters of rank {args.rank} in {tmp}", file=sys.stderr)
    server, url, ready_s = start_server(model, args.port, workers=args.workers, dtype=args.dtype,
                                        deploy={"maxLoras": args.adapters + 2, "maxLoraRank": 64,
                                                "loraRoot": str(tmp)},
                                        backend={"cpuThreadsPerWorker": args.threads})
    print(f"launch -> ready: {ready_s:.2f} s", file=sys.stderr)
    n = args.num_prompts or args.concurrency
    cfg = LoadConfig(concurrency=args.concurrency, num_prompts=n, warmup=min(8, args.concurrency))
    workload = make_workload(prompt_len=args.prompt_len, output_len=args.output_len)
    rows: dict[str, list[dict]] = {"base": [], "adapters": [], "idle": [], "loading": []}
    load_times: list[float] = []
    try:
        for name, path in paths.items():
            status, text = post(url + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
            if status != 200:
                sys.exit(f"loading {name} failed: {status} {text}")

        async def measure() -> None:
            # Alternated, so that a busy spell of the machine hits both sides of each comparison.
            for r in range(args.rounds):
                for label, cycle in (("base", [""]), ("adapters", names)):
                    seg = await run_segment(CyclingAdapter(url, cycle), workload, cfg,
                                            f"{label} c={args.concurrency} round {r + 1}")
                    rows[label].append(seg.stats)
                for label, path in (("idle", None), ("loading", churn_path)):
                    stats, loads = await itl_segment(url, names, cfg, workload,
                                                     f"ITL {label} c={args.concurrency} round {r + 1}", path)
                    stats["loads"] = len(loads)
                    rows[label].append(stats)
                    load_times.extend(loads)

        run_async(measure())
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)

    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    print(f"\n{args.adapters} adapters of rank {args.rank} (all 7 projections) loaded at run time, concurrency "
          f"{args.concurrency}, prompt {args.prompt_len}, output {args.output_len}, {args.rounds} alternated rounds; "
          f"{model} ({args.dtype}, {args.workers} worker(s), cpuThreadsPerWorker {args.threads})")
    print(f"{'':<30}{'tok/s per round':>26}{'median':>8}{'ITL p50':>9}{'ITL p99':>9}{'failed':>7}")
    titles = {"base": "base model alone", "adapters": f"every request on one of {args.adapters}",
              "idle": f"{args.adapters} adapters, nothing loading", "loading": f"same, rank-{args.load_rank} loads"}
    for label, title in titles.items():
        s = rows[label]
        tok = [x["output_throughput"] for x in s]
        print(f"{title:<30}{', '.join(f'{x:.0f}' for x in tok):>26}{med(tok):>8.0f}"
              f"{med([x['itl_ms']['p50'] for x in s]):>9.1f}{med([x['itl_ms']['p99'] for x in s]):>9.1f}"
              f"{sum(x['failed'] for x in s):>7}")
    ratios = [a["output_throughput"] / b["output_throughput"] for a, b in zip(rows["adapters"], rows["base"])]
    print(f"adapters / base tokens/s per round: {', '.join(f'{x:.2f}' for x in ratios)} (median {med(ratios):.2f})")
    print("ITL of the running streams once every stream is past its 8th token (the steady part of a segment), ms:")
    for label in ("idle", "loading"):
        s = [x["steady_itl_ms"] for x in rows[label]]
        def each(key: str) -> str:
            return ", ".join(f"{x[key]:.1f}" for x in s)

        print(f"  {titles[label]:<28} p50 {each('p50')}; p99 {each('p99')}; max {each('max')} "
              f"({sum(x['n'] for x in s)} gaps in {sum(x.get('window_s', 0) for x in s):.1f} s)")
    itl = [a["steady_itl_ms"]["p99"] / b["steady_itl_ms"]["p99"] for a, b in zip(rows["loading"], rows["idle"])]
    print(f"steady ITL p99 while loading / idle per round: {', '.join(f'{x:.2f}' for x in itl)} (median {med(itl):.2f})")
    if load_times:
        print(f"{len(load_times)} loads during the 'loading' segments ({', '.join(str(x['loads']) for x in rows['loading'])}"
              f" per round), {med(load_times) * 1000:.0f} ms median each (request to answer, every worker read it)")
    (out / "lora-summary.json").write_text(json.dumps({
        "args": vars(args), "model": model, "ready_s": ready_s, "rows": rows, "ratios": ratios,
        "itl_p99_ratios": itl, "load_s": load_times}, indent=1))


if __name__ == "__main__":
    main()
