#!/usr/bin/env python3
"""The cost of batch-invariant mode (ScheduleConfig.batchInvariant), side by side in one run.

Two servers on the same model through ``scripts/launch.sh`` (the benchmark configuration of
docs/performance.md: two CPU device workers, 1 GiB of KV), one with the mode on and one with it
off, both idle while the other is measured; ``mindie-bench compare`` drives them alternately
(A B A B, ``--rounds``) on the same seeded workload at each concurrency and prints the ratio of
output tokens/s (on / off) per round, with TTFT and ITL percentiles in its tables.

    python -m mindie_bench.lab.invariance --model default --concurrency 1,8,32
    python -m mindie_bench.lab.invariance --model gpu1b --concurrency 1,32 --output-len 64 --num-prompts 32

The default workload is chat-like: prompts of 64-512 tokens, answers of 64-256 (greedy, exact
lengths). ``--model`` is a bench_models name (``default``, ``gpu1b``, ``bench30m``) or a directory.
Also ``mindie-bench invariance ...``.
"""
from __future__ import annotations

import argparse
import subprocess
import sys

from mindie_bench.lab.bench_models import resolve
from mindie_bench.lab.serving import start_server, stop_servers


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="bench_models name or model directory (default: default)")
    ap.add_argument("--dtype", default="auto", help="ModelConfig dtype (default auto: what this CPU computes best)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompt-len", default="64:512")
    ap.add_argument("--output-len", default="64:256")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=18730, help="the mode-on server's port; the other uses the next one")
    ap.add_argument("--out", default=None, help="directory for compare's tables and JSON")
    args = ap.parse_args(argv)
    model = resolve(args.model, ours=True)
    servers = []
    try:
        urls = {}
        for i, (label, on) in enumerate((("invariant", True), ("default", False))):
            proc, url, ready = start_server(model, args.port + i, workers=args.workers, dtype=args.dtype,
                                            schedule={"batchInvariant": on}, prefix=f"inv{int(on)}")
            servers.append(proc)
            urls[label] = url
            print(f"{label}: batchInvariant {str(on).lower()}, ready in {ready:.1f} s at {url}", flush=True)
        cmd = [sys.executable, "-m", "mindie_bench", "compare", "--url-a", urls["invariant"], "--api-a", "native",
               "--label-a", "invariant", "--url-b", urls["default"], "--api-b", "native", "--label-b", "default",
               "--ratio", "a/b", "--rounds", str(args.rounds), "--concurrency", args.concurrency,
               "--prompt-len", args.prompt_len, "--output-len", args.output_len,
               "--vocab-size", str(args.vocab_size), "--no-progress"]
        if args.num_prompts:
            cmd += ["--num-prompts", str(args.num_prompts)]
        if args.out:
            cmd += ["--out", args.out]
        subprocess.run(cmd, check=True)
    finally:
        stop_servers(servers)


if __name__ == "__main__":
    main()
