"""The lab: benchmarks, profilers and drills of this repository (they were ``scripts/bench_*.py`` etc.).

Each module has a ``main(argv=None)`` and runs as ``python -m mindie_bench.lab.<module>`` or as
``mindie-bench <command>`` (the table below). Unlike ``mindie-bench run``/``compare``, which only
talk HTTP to a deployment, most of these need a source checkout: the serving ones start
``scripts/launch.sh`` and some use ``tests/harness.py``. What each imports of the engine, and why,
is in its docstring. The figures they give are in docs/performance.md.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

#: command -> (module or shell script in this package, one line of help)
COMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("engine", "engine-alone output tokens/s, in this process (no sockets, no HTTP)"),
    "serving": ("serving", "the real server (scripts/launch.sh) against its engine alone; --null-model: the stack"),
    "roofline": ("roofline", "decode tokens/s against this machine's memory-bandwidth roofline"),
    "moe": ("moe", "a mixture of experts' decode tokens/s against transformers and the activated-experts roofline"),
    "side-by-side": ("vllm_side_by_side.sh", "this server against vLLM's CPU build (installs vLLM in a venv)"),
    "llama-side-by-side": ("llama_server_side_by_side.sh", "this server against llama.cpp's llama-server on one GGUF file, chat workload, speculation on and off"),
    "bench-models": ("bench_models", "a benchmark model's directory by name (bench30m, gpu1b, qwen35-1b, default), built on first use"),
    "model-lifecycle": ("model_lifecycle", "several models: load (evicting the idle one), unload, sleep and wake times and the memory freed"),
    "overlap": ("overlap", "step overlap on against off: two servers, mindie-bench compare"),
    "invariance": ("invariance", "batch-invariant mode on against off: two servers, mindie-bench compare"),
    "overload": ("overload", "admission at 10x maxLinkNum: rejection latency, /health, RSS"),
    "slowloris": ("slowloris", "500 slow connections against 8 normal clients: their p99 with and without them"),
    "multi-workers": ("multi_workers", "one CPU device worker against N on one host"),
    "busy-host": ("busy_host", "adaptive step width (cpuTuning.adaptiveThreads) on against off, quiet host and beside busy processes"),
    "attention": ("attention", "kernel micro-benchmark: paged attention, torch path against the C kernels"),
    "decode-step": ("decode_step", "one decode step: the fused C step against the eager path"),
    "profile-step": ("profile_step", "where one decode step's time goes, per module kind"),
    "prompt-products": ("prompt_products", "a model's steps with its linears on oneDNN against the C kernels' AMX tiles, alternating"),
    "isa": ("isa", "this CPU's instruction sets, the kernels dispatched here, product GFLOP/s per row count, kernel timings"),
    "int8-quality": ("int8_quality", "w8a16 against bf16: agreement, logit error, weight bytes, tokens/s"),
    "w8a8": ("w8a8_bench", "bf16 vs quantize w8a16 vs w8a8, one thread: weight bytes, decode tokens/s, a prompt's time, logits vs bf16"),
    "gguf-moe": ("gguf_moe", "a GGUF mixture of experts: experts in their blocks in one C call per layer, one by one, dequantised"),
    "gguf-blocks": ("gguf_blocks", "a GGUF file's linears from their blocks against dequantised: decode/prompt steps, kernels"),
    "gguf-export": ("gguf_export", "a benchmark model (gpu1b, ...) as a GGUF file by llama.cpp's converter and llama-quantize, for both servers"),
    "tree-memory": ("tree_memory", "a server's process tree memory: summed Pss (shared pages split) and VmRSS"),
    "gguf-load": ("gguf_load", "a GGUF model's load time and peak memory against its weights, per dtype"),
    "detokenizer": ("detokenizer", "streaming detokenisation: mindie.text.detokenizer against DecodeStream"),
    "http-parser": ("http_parser", "the benchmark client's HTTP parser: httptools against the hand-written one"),
    "soak": ("soak", "memory soak: the real server under steady load, every process's RSS flat"),
    "chaos": ("chaos", "fault drills against the real launcher under load"),
    "lora": ("lora", "LoRA adapters: tokens/s with four in the batch against the base alone, ITL while one loads"),
    "structured": ("structured", "structured output: tokens/s constrained against none, compile time, jump-forward"),
    "coord-drills": ("coord_drills", "the coordinator's manage port: a 5,000-instance refresh flood, hostile refresh bodies, a decoy instance"),
    "constraint-drill": ("constraint_drill", "hostile structured-output constraints on a real server: refusal time, message, worker RSS"),
    "fleet": ("fleet", "the coordinator on a local fleet (scripts/motor.sh): cache_affinity against load_balance, relay overhead"),
    "deepseek": ("deepseek", "a tiny DeepSeek-V3 (MLA, grouped routing): tokens/s against transformers, KV bytes per token"),
    "hybrid": ("hybrid", "a 1B-class Qwen3.5 shape (Gated DeltaNet hybrid): tokens/s against transformers, memory per sequence against its full-attention twin"),
    "kv-transfer": ("kv_transfer", "PD disaggregation: KV block transfer GB/s over ipc, tcp and tcp+CURVE on loopback"),
    "pd": ("pd", "PD disaggregation: one hybrid instance against 1 prefill + 1 decode under a mixed load"),
    "speculative": ("speculative", "speculative decoding without a draft model: tokens/s on against off, copy-heavy tasks, chat, c=32"),
    "gpu-check": ("gpu_check.sh", "on a CUDA machine: the CUDA tests, then the decode roofline on GPU 0"),
    "gpu-step-profile": ("gpu_step_profile", "on a CUDA machine: a decode step's host wall time against its GPU busy time, top operators"),
}

HERE = Path(__file__).resolve().parent


def demo_model(preset: str = "demo") -> str:
    """The directory of a built-in demo model preset (what ``mindie-demo-model --preset P`` prints),
    generated on first use. The one place the serving-side lab modules touch the ``workers`` package."""
    import dataclasses

    from workers.models.demo import PRESETS, ensure_demo_model
    if preset not in PRESETS:
        raise SystemExit(f"unknown demo preset {preset!r}: one of {', '.join(PRESETS)}")
    return str(ensure_demo_model(**dataclasses.asdict(PRESETS[preset])))


def run(command: str, argv: Optional[Sequence[str]] = None) -> int:
    """Run one lab command with ``argv``; returns its exit status."""
    target = COMMANDS[command][0]
    args = list(sys.argv[1:] if argv is None else argv)
    if target.endswith(".sh"):
        return subprocess.call(["bash", str(HERE / target), *args], env=os.environ.copy())
    mod = importlib.import_module(f"{__name__}.{target}")
    saved = sys.argv
    sys.argv = [f"mindie-bench {command}", *args]  # argparse's prog in usage lines
    try:
        rc = mod.main(args)
    finally:
        sys.argv = saved
    return rc if isinstance(rc, int) else 0
