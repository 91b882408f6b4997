#!/usr/bin/env python3
"""Do several CPU device workers on one host slow each other down? (issue 16, item 0)

Starts the real server (scripts/launch.sh, built-in demo model, fp32, one front end) with one
CPU worker (npuDeviceIds [[0]]) and then with --workers N ([[0],[1],...]), and for each prompt
length sends max(--requests, 4 x concurrency) requests of --new-tokens tokens, at each
concurrency (1 = one after another), --repeat times. Prints the median wall time of each batch,
and the ratio N workers / one worker. (One wave of 16 requests on the demo model takes a
quarter of a second: too short to compare on a shared machine; hence the waves and repeats.)

    python -m mindie_bench.lab.multi_workers                      # 1 vs 2 workers, concurrency 1,16,64, prompts 5,120
    python -m mindie_bench.lab.multi_workers --workers 2 --concurrency 16 --prompts 120

Exits 1, loudly, when N workers under load (every concurrency of at least --load-from, default
16; the highest one if none is) take longer than one worker by more than --tolerance (default
1.25x: N workers must deliver at least 80 % of what one worker does on the same cores; they
should deliver as much or more).

Reproducing the slowdown of Intel hosts here (docs/performance.md, "Several CPU workers"):
``GOMP_SPINCOUNT=3000000`` makes OpenMP's idle threads spin about as long as Intel's long PAUSE
does; ``--threads 2`` oversubscribes a 2-core machine on purpose (2 workers x 2 threads).

Also ``mindie-bench multi-workers ...`` (mindie_bench/lab/__init__.py lists the lab's commands).

Public entry points for the server (``scripts/launch.sh`` through tests/harness.py's ``Server``,
HTTP); ``mindie.topology.usable_cores`` to size the threads as the launcher does. Needs a source
checkout (tests/).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from mindie.topology import usable_cores  # noqa: E402
from tests.harness import Server, free_port, short_run_dir, write_config  # noqa: E402


def cpu_flags() -> str:
    try:
        lines = open("/proc/cpuinfo").read().splitlines()
        flags = next(line for line in lines if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return platform.machine()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    spin = os.environ.get("GOMP_SPINCOUNT")
    return (f"{model}, {usable_cores()} usable cores ({os.cpu_count()} on the host), {' '.join(isa) or 'no AVX2'}"
            + (f", GOMP_SPINCOUNT={spin}" if spin else ""))


async def batch(url: str, prompt_len: int, requests: int, concurrency: int, new_tokens: int) -> float:
    """Seconds for ``requests`` requests, ``concurrency`` at a time; every reply checked."""
    sem = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        ids = [(i * 131 + j * 7) % 30000 + 3 for j in range(prompt_len)]
        body = {"input_id": ids, "parameters": {"max_new_tokens": new_tokens, "details": True}}
        async with sem:
            r = await client.post(url + "/infer_token", content=json.dumps(body), timeout=600)
        if r.status_code != 200 or r.json()["details"]["generated_tokens"] != new_tokens:
            raise RuntimeError(f"request {i}: {r.status_code} {r.text[:200]}")

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(requests)))
        return time.perf_counter() - t0


def run(workers: int, args, work: Path) -> dict[tuple[int, int], float]:
    port = free_port()
    cfg = write_config(work / f"config-{workers}.json", port=port, run_dir=short_run_dir(), workers=workers,
                       model={"dtype": "float32"})
    raw = json.loads(cfg.read_text())
    raw["BackendConfig"]["cpuThreadsPerWorker"] = args.threads  # 0, the default: cores shared automatically
    raw["BackendConfig"]["ScheduleConfig"]["cacheBlockSize"] = 128
    cfg.write_text(json.dumps(raw))
    srv = Server(cfg, port, env={"MINDIE_LOG_LEVEL": "WARNING"})
    out: dict[tuple[int, int], float] = {}
    try:
        print(f"  {workers} worker(s): starting ...", flush=True)
        srv.wait_ready(180)
        asyncio.run(batch(srv.url, 5, 2, 2, 4))  # warm-up: kernels, first allocations
        for prompt in args.prompts:
            for conc in args.concurrency:
                requests = max(args.requests, 4 * conc)
                times = sorted(asyncio.run(batch(srv.url, prompt, requests, conc, args.new_tokens))
                               for _ in range(args.repeat))
                dt = times[len(times) // 2]
                out[(prompt, conc)] = dt
                print(f"  {workers} worker(s)  prompt {prompt:4d}  concurrency {conc:3d}  {requests:4d} requests  "
                      f"median {dt:7.2f} s  ({', '.join(f'{t:.2f}' for t in times)})", flush=True)
    finally:
        srv.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2, help="workers of the multi-worker server (default 2)")
    ap.add_argument("--requests", type=int, default=16,
                    help="requests per batch, at least 4 x the concurrency (default 16)")
    ap.add_argument("--repeat", type=int, default=3, help="batches per cell; the median counts (default 3)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", default="5,120", help="prompt lengths, comma-separated")
    ap.add_argument("--concurrency", default="1,16,64", help="concurrency levels, comma-separated")
    ap.add_argument("--threads", type=int, default=0,
                    help="BackendConfig.cpuThreadsPerWorker of both servers (default 0: the cores shared automatically)")
    ap.add_argument("--tolerance", type=float, default=1.25,
                    help="fail when N workers take longer than one worker times this under load")
    ap.add_argument("--load-from", type=int, default=16,
                    help="concurrencies from this one up are 'under load' for --tolerance (default 16)")
    args = ap.parse_args(argv)
    args.prompts = [int(x) for x in args.prompts.split(",")]
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    print(f"machine: {cpu_flags()}; demo model fp32; max({args.requests}, 4 x concurrency) requests "
          f"x {args.new_tokens} new tokens, median of {args.repeat}")
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as d:
        one = run(1, args, Path(d))
        many = run(args.workers, args, Path(d))
    print(f"\n{'prompt':>6} {'conc':>5} {'1 worker s':>11} {f'{args.workers} workers s':>12} {'ratio':>6}")
    loaded = [c for c in args.concurrency if c >= args.load_from] or [max(args.concurrency)]
    worst, where = 0.0, None
    for key in one:
        ratio = many[key] / one[key]
        print(f"{key[0]:6d} {key[1]:5d} {one[key]:11.2f} {many[key]:12.2f} {ratio:6.2f}"
              + ("" if key[1] in loaded else "  (not checked)"))
        if key[1] in loaded and ratio > worst:
            worst, where = ratio, key
    if worst > args.tolerance:
        print(f"\nFAIL: under load (prompt {where[0]}, concurrency {where[1]}) {args.workers} workers take "
              f"{worst:.2f}x the time of one worker (limit {args.tolerance}x): the workers slow each other down",
              file=sys.stderr)
        return 1
    print(f"\nOK: under load (concurrency {','.join(map(str, loaded))}) {args.workers} workers take at most "
          f"{worst:.2f}x the time of one worker (limit {args.tolerance}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
