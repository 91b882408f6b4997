#!/usr/bin/env python3
"""Engine-alone throughput: the device worker's engine in this process, no sockets, no HTTP.

Keeps ``--concurrency`` requests in flight (a finished one is replaced at once) until
``--num-prompts`` have finished, and prints output tokens/s. Prompts are random token ids;
requests ignore EOS so every one generates exactly ``--output-len`` tokens.

    python -m mindie_bench.lab.engine --preset bench30m --dtype bfloat16 --concurrency 1,8,32,64

Also ``mindie-bench engine ...`` (mindie_bench/lab/__init__.py lists the lab's commands).

Engine internals, because the engine is what it measures, without the worker's sockets: the
runner comes from ``workers.engine.assembly.load_runner`` (what the device worker's builder
``workers.engine.assembly.build`` calls) and requests go straight to ``workers.engine.engine.Engine``.
``build`` itself is not used: it sizes the KV cache from the server's memory settings and
binds the worker's compute thread, and these figures keep their own KV size and no overlap so that
they stay comparable with the journal's. ``roofline`` and ``int8-quality`` take the same path.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root


def load(model: str, dtype: str, *, threads: int = 0, block_size: int = 128, kv_gb: float = 1.0,
         quantize: str = "", preset: str = "demo", max_batch_size: int = 256):
    """(runner, engine config, KV blocks): a CPU worker's model as load_runner builds it, KV allocated.
    ``model`` "" = the built-in demo model of ``preset``; ``max_batch_size`` also sizes a hybrid
    model's state pool (one slot a sequence)."""
    from mindie.contract.spec import EngineConfig, WorkerSpec
    from workers.backends.cpu import CpuBackend
    from workers.engine.assembly import load_runner

    if not model:
        from workers.models.demo import PRESETS, ensure_demo_model
        model = str(ensure_demo_model(**dataclasses.asdict(PRESETS[preset])))
    engine_cfg = EngineConfig(block_size=block_size, max_seq_len=4096, max_batch_size=max_batch_size,
                              max_prefill_batch_size=64, max_prefill_tokens=8192, enable_prefix_cache=False)
    spec = WorkerSpec(worker_id="bench", job_endpoint="", pub_endpoint="", model_path=model, dtype=dtype,
                      engine=engine_cfg, quantize=quantize)
    runner = load_runner(spec, CpuBackend(threads))
    num_blocks = int(kv_gb * (1 << 30)) // runner.bytes_per_block(block_size)
    runner.allocate_kv(num_blocks, block_size)
    return runner, engine_cfg, num_blocks


def throughput(runner, engine_cfg, num_blocks: int, conc: int, n_total: int, prompt_len: int, output_len: int,
               rng: random.Random) -> dict:
    """Keep ``conc`` requests in flight until ``n_total`` finished; output tokens/s."""
    from mindie.contract.wire import SamplingParams, Submit
    from workers.engine.engine import Engine

    engine = Engine(runner, engine_cfg, num_blocks)
    params = SamplingParams(max_new_tokens=output_len, ignore_eos=True)

    def submit(i: int) -> None:
        ids = [rng.randrange(3, runner.vocab_size) for _ in range(prompt_len)]
        engine.add(Submit(f"r{i}", "bench", ids, params))

    # Warm-up: one short request, so one-time costs are not measured.
    engine.add(Submit("warm", "bench", [5] * prompt_len, SamplingParams(max_new_tokens=4, ignore_eos=True)))
    while engine.has_work():
        engine.step()
    started = 0
    for _ in range(min(conc, n_total)):
        submit(started)
        started += 1
    done = tokens = 0
    t0 = time.perf_counter()
    last_print = t0
    while done < n_total:
        for out in engine.step():
            tokens += len(out.token_ids)
            if out.finish_reason:
                done += 1
                if started < n_total:
                    submit(started)
                    started += 1
        now = time.perf_counter()
        if now - last_print > 2:
            print(f"  c={conc}: {done}/{n_total} done, {tokens / (now - t0):.0f} tok/s", file=sys.stderr)
            last_print = now
    dt = time.perf_counter() - t0
    return {"concurrency": conc, "requests": n_total, "output_tokens": tokens, "seconds": round(dt, 2),
            "output_tok_s": round(tokens / dt, 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="Hugging Face model dir (default: a demo model, see --preset)")
    ap.add_argument("--preset", default="demo", choices=["demo", "bench30m"],
                    help="which built-in model to generate when --model is not given")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--quantize", default="", choices=["", "w8a16"], help="ModelConfig quantize (default: none)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", default="1,16", help="comma-separated list")
    ap.add_argument("--num-prompts", type=int, default=0, help="per concurrency level (default 2x concurrency, >= 8)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--kv-gb", type=float, default=1.0)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    runner, engine_cfg, num_blocks = load(args.model, args.dtype, threads=args.threads, block_size=args.block_size,
                                          kv_gb=args.kv_gb, quantize=args.quantize, preset=args.preset)
    print(f"model {args.model or args.preset} ({args.dtype}{', ' + args.quantize if args.quantize else ''}), "
          f"{torch.get_num_threads()} threads, {num_blocks} KV blocks", file=sys.stderr)
    rng = random.Random(0)
    results = []
    for conc in [int(c) for c in args.concurrency.split(",")]:
        n_total = args.num_prompts or max(8, 2 * conc)
        res = throughput(runner, engine_cfg, num_blocks, conc, n_total, args.prompt_len, args.output_len, rng)
        results.append(res)
        print(json.dumps(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
