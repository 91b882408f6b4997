#!/usr/bin/env python3
"""What step overlap gains: two servers, identical but for ScheduleConfig.overlapSteps, measured
alternately (A B A B ...) by `mindie-bench compare` in one run.

A = overlap on (each step computes on the engine's compute thread while the worker loop takes in
jobs and sends the previous step's frames), B = overlap off (jobs, step, frames in turn). The
ratio column is A/B output tokens/s.

    # the bench30m model on the CPU workers
    python -m mindie_bench.lab.overlap --concurrency 1,8,32,64
    # the null model with a fixed device time per step, as an accelerator would behave
    python -m mindie_bench.lab.overlap --null-model --null-step-ms 8 --concurrency 64,256 --output-len 256

Also ``mindie-bench overlap ...`` (mindie_bench/lab/__init__.py lists the lab's commands).

Public entry points only: two servers through ``scripts/launch.sh`` (via ``serving``), measured by
``mindie-bench compare``.
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys

from mindie_bench.lab.serving import bench_model, start_server


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model dir (default: the bench30m preset)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workers", type=int, default=2, help="CPU device workers per server")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--rounds", type=int, default=2, help="A/B rounds per level")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=0, help="per level and round (default max(32, 2 x c))")
    ap.add_argument("--null-model", action="store_true", help="no model compute: serving stack only")
    ap.add_argument("--null-step-ms", type=float, default=0.0)
    ap.add_argument("--port", type=int, default=18710, help="A's port; B uses the next one")
    ap.add_argument("--out", default="bench-results/overlap")
    args = ap.parse_args(argv)

    model = "" if args.null_model else (args.model or bench_model())
    servers = []
    try:
        for i, overlap in enumerate((True, False)):
            proc, url, ready_s = start_server(
                model, args.port + i, workers=args.workers, dtype=args.dtype, overlap=overlap,
                null_model=args.null_model, null_step_ms=args.null_step_ms)
            servers.append((proc, url))
            print(f"overlap {'on ' if overlap else 'off'}: {url} ready in {ready_s:.1f} s", file=sys.stderr)
        cmd = [sys.executable, "-m", "mindie_bench", "compare",
               "--url-a", servers[0][1], "--api-a", "native", "--label-a", "overlap-on",
               "--url-b", servers[1][1], "--api-b", "native", "--label-b", "overlap-off",
               "--concurrency", args.concurrency, "--rounds", str(args.rounds),
               "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len), "--out", args.out]
        if args.num_prompts:
            cmd += ["--num-prompts", str(args.num_prompts)]
        subprocess.run(cmd, check=True)
    finally:
        for proc, _url in servers:
            proc.send_signal(signal.SIGTERM)
        for proc, _url in servers:
            proc.wait(60)


if __name__ == "__main__":
    main()
