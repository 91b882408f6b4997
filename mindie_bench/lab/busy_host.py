#!/usr/bin/env python3
"""Adaptive step width on a busy host: cpuTuning.adaptiveThreads on against off, side by side.

Starts the real server twice on the same model (scripts/launch.sh, the benchmark configuration:
two CPU workers sharing the cores, or ``--workers 1``: one worker on all of them), one with
``cpuTuning.adaptiveThreads`` true (the default) and one with it false, then runs
``mindie-bench compare`` between them: first on the host as it is, then with ``--spinners`` busy
processes beside them (a noisy neighbour: default one per usable core), A B A B. Prints both
tables; the ratio is adaptive / fixed output tokens/s (on a quiet host it should stay near 1.0,
on a busy one above it) and the workers' "step width" log lines (what the policy chose).

    python -m mindie_bench.lab.busy_host --model default --concurrency 1 --num-prompts 8
    mindie-bench busy-host --model bench30m --workers 1 --spinners 2

Public entry points only (scripts/launch.sh, HTTP, ``mindie-bench compare``); the model presets
come from mindie_bench.lab.bench_models.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mindie.topology import usable_cores  # noqa: E402
from mindie_bench.lab.serving import start_server, stop_servers  # noqa: E402


@contextlib.contextmanager
def spinners(n: int, seconds: float = 120, ready_timeout: float = 60) -> Iterator[list[subprocess.Popen]]:
    """``n`` busy neighbours (one core's worth of pure Python each), entered once every one of them
    is spinning (each says so on its stdout first: the load is there from the next instruction on,
    not after a guessed sleep), killed on exit. Each is its own process and bounds itself
    (``seconds``): a killed caller leaves no spinner behind for long."""
    spin = ("import time\nprint('spinning', flush=True)\n"
            f"end = time.monotonic() + {seconds!r}\nwhile time.monotonic() < end: pass")
    procs = [subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE) for _ in range(n)]
    try:
        waiting, end = {p.stdout: p for p in procs}, time.monotonic() + ready_timeout
        while waiting and time.monotonic() < end:
            for out in select.select(list(waiting), [], [], max(0.0, end - time.monotonic()))[0]:
                if out.readline() != b"spinning\n":
                    raise RuntimeError("a spinner exited before it spun")
                del waiting[out]
        if waiting:
            raise TimeoutError(f"{len(waiting)} of {n} spinners not spinning after {ready_timeout} s")
        yield procs
    finally:
        for p in procs:  # by pid, ours only
            p.kill()
            p.wait(10)


def _compare(urls: tuple[str, str], args, label: str, vocab: int) -> None:
    print(f"\n== {label}", flush=True)
    cmd = [sys.executable, "-m", "mindie_bench", "compare", "--url-a", urls[0], "--label-a", "adaptive",
           "--url-b", urls[1], "--api-b", "native", "--label-b", "fixed", "--concurrency", args.concurrency,
           "--num-prompts", str(args.num_prompts), "--rounds", str(args.rounds), "--warmup", "1",
           "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len), "--vocab-size", str(vocab),
           "--out", args.out, "--no-progress"]
    subprocess.run(cmd, check=True, timeout=args.timeout)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench30m", help="bench30m | gpu1b | default | a model directory")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workers", type=int, default=2, help="CPU device workers per server (2: core sharing)")
    ap.add_argument("--spinners", type=int, default=0, help="busy processes beside the servers (0: one per core)")
    ap.add_argument("--concurrency", default="1")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--out", default="bench-results/busy-host")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds for each compare run")
    ap.add_argument("--quiet-only", action="store_true", help="skip the busy half")
    args = ap.parse_args(argv)

    import json
    from mindie_bench.lab.bench_models import resolve
    model = resolve(args.model, ours=True)
    vocab = json.loads((Path(resolve(args.model)) / "config.json").read_text())["vocab_size"]
    cores = usable_cores()
    print(f"model {args.model}: {model} (vocabulary {vocab}); {cores} usable cores; {args.workers} workers per server",
          flush=True)
    procs = []
    try:
        for i, adaptive in enumerate((True, False)):
            port = 18700 + 10 * i + os.getpid() % 7
            proc, url, took = start_server(model, port, workers=args.workers, dtype=args.dtype, prefix="busy",
                                           backend={"cpuTuning": {"adaptiveThreads": adaptive}})
            procs.append((proc, url))
            print(f"server {'adaptive' if adaptive else 'fixed'} at {url}, ready in {took:.0f} s", flush=True)
        urls = (procs[0][1], procs[1][1])
        _compare(urls, args, f"quiet host (load average {os.getloadavg()[0]:.1f})", vocab)
        if not args.quiet_only:
            n = args.spinners or cores
            with spinners(n, seconds=2 * args.timeout):  # outlasting the compare run's own bound
                _compare(urls, args, f"busy host: {n} spinning processes beside the servers", vocab)
    finally:
        stop_servers([proc for proc, _ in procs])


if __name__ == "__main__":
    main()
