#!/usr/bin/env python3
"""Where a decode step's time goes on a CUDA GPU: engine steps timed as the worker runs them (step
overlap on), then again under torch.profiler with overlap off (every operator on this thread): the
host's wall time per step, the GPU's busy time per step (the sum of its kernels), kernels launched
per step and the operators that take the most host time. A step whose GPU is busy for a small
part of its wall time is bound by the host (Python, kernel launches), not by the GPU.

    python -m mindie_bench.lab.gpu_step_profile --preset gpu1b --batch 1,64

Also ``mindie-bench gpu-step-profile ...``. Needs a CUDA device (mindie_bench/lab/gpu_check.sh's
machine); ``--device cpu`` prints the same host-side figures for the CPU backend.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import msgspec
import torch


def _decoding_engine(runner, cfg, blocks: int, batch: int, context: int, budget: int, rng: random.Random):
    """An engine with ``batch`` sequences past their prompts, decoding one token per step each."""
    from mindie.contract.wire import SamplingParams, Submit
    from workers.engine.engine import Engine

    engine = Engine(runner, cfg, blocks)
    params = SamplingParams(max_new_tokens=budget + batch, ignore_eos=True)  # prompts take up to ``batch`` waves
    for i in range(batch):
        engine.add(Submit(f"r{i}", "p", [rng.randrange(3, runner.vocab_size) for _ in range(context)], params))
    while engine.num_waiting:
        engine.step()
    for _ in range(4):
        engine.step()
    return engine


def _drop(engine, batch: int) -> None:
    for i in range(batch):
        engine.abort(f"r{i}")
    while engine.has_work():
        engine.step()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model dir (default: the demo preset --preset)")
    ap.add_argument("--preset", default="gpu1b")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--context", type=int, default=500, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed, then as many profiled, per batch")
    ap.add_argument("--top", type=int, default=15, help="operators listed by host time")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("needs a CUDA device (or --device cpu)")
    from mindie_bench.lab.roofline import load

    model = args.model
    if not model:
        from workers.models.demo import PRESETS, ensure_demo_model
        model = str(ensure_demo_model(**dataclasses.asdict(PRESETS[args.preset])))
    batches = [int(b) for b in args.batch.split(",")]
    runner, cfg = load(model, args.dtype, 0, 128, args.device)
    budget = 4 + 2 * args.steps + 2
    blocks = max(batches) * -(-(args.context + budget + max(batches)) // 128) + 2
    runner.allocate_kv(blocks, 128)
    rng = random.Random(0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    for b in batches:
        walls: dict[str, list[float]] = {"overlap on": [], "overlap off": []}
        for mode, c in (("overlap on", cfg), ("overlap off", msgspec.structs.replace(cfg, overlap=False))):
            engine = _decoding_engine(runner, c, blocks, b, args.context, budget, rng)
            sync()
            prof = torch.profiler.profile(activities=acts) if mode == "overlap off" else None
            if prof is not None:
                prof.__enter__()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                engine.step()
                walls[mode].append(time.perf_counter() - t0)
            sync()
            if prof is not None:
                prof.__exit__(None, None, None)
            _drop(engine, b)
        events = prof.key_averages()
        on, off = (statistics.median(walls[m]) * 1e3 for m in ("overlap on", "overlap off"))
        line = f"batch {b}: step {on:.2f} ms (overlap on), {off:.2f} ms profiled (overlap off)"
        if cuda:
            kinds = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
            gpu_ms = sum(e.self_device_time_total for e in kinds) / 1e3 / args.steps
            line += (f"; GPU busy {gpu_ms:.2f} ms per step ({gpu_ms / off:.0%} of the profiled step), "
                     f"{sum(e.count for e in kinds) / args.steps:.0f} kernels per step")
        print(line, flush=True)
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=48), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
