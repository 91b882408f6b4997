#!/usr/bin/env python3
"""Serving benchmark of this server, side by side with its own engine, in one run.

For the ~30M-parameter benchmark Llama (built by `mindie-demo-model --preset bench30m`):
  1. start scripts/launch.sh (two CPU device workers, bf16) and time launch -> /health 200;
  2. drive /infer_token with mindie-bench at each concurrency (prompt 128, output 128), while
     sampling the resident memory of the whole server process tree (peak reported);
  3. stop the server and run the engine alone (mindie_bench/lab/engine.py) on the same load;
  4. print a table with the HTTP / engine-alone ratio per concurrency.
With --null-model it measures the serving stack alone (no model compute) instead: streamed
tokens/s at high concurrency and whether every token of every stream arrived.

    python -m mindie_bench.lab.serving --concurrency 1,8,32,64
    python -m mindie_bench.lab.serving --null-model --concurrency 256 --output-len 256

Also ``mindie-bench serving ...`` (mindie_bench/lab/__init__.py lists the lab's commands).

Public entry points only: the server through ``scripts/launch.sh`` and HTTP, the load from
``mindie-bench run``; the engine-alone side runs ``python -m mindie_bench.lab.engine``. The model
comes from ``mindie_bench.lab.demo_model`` (what ``mindie-demo-model`` prints).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from mindie_bench.lab.tree_memory import tree_rss

ROOT = Path(__file__).resolve().parents[2]


class RssSampler(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0, False

    def run(self) -> None:
        while not self.stop:
            self.peak = max(self.peak, tree_rss(self.pid))
            time.sleep(0.2)


def bench_model() -> str:
    """The bench30m preset's directory (built on first use)."""
    from mindie_bench.lab import demo_model
    return demo_model("bench30m")


def bench_config(model: str, port: int, run_dir: Path, *, workers: int = 2, dtype: str = "bfloat16",
                 kv_gib: float = 1.0, overlap: bool | None = None, server: dict | None = None,
                 schedule: dict | None = None, deploy: dict | None = None, backend: dict | None = None) -> dict:
    """The benchmark configuration (docs/performance.md): ``workers`` CPU device workers sharing
    ``kv_gib`` of KV cache, one model, MindIE's key names; the dicts override its sections."""
    return {
        "ServerConfig": {"ipAddress": "127.0.0.1", "port": port, "managementPort": port, "metricsPort": port,
                         "httpsEnabled": False, "runDir": str(run_dir), "maxLinkNum": 1000, **(server or {})},
        "BackendConfig": {
            "npuDeviceIds": [[i] for i in range(workers)], "deviceType": "cpu", **(backend or {}),
            "ModelDeployConfig": {"maxSeqLen": 4096, "maxInputTokenLen": 2048, "ModelConfig": [{
                "modelName": "bench", "modelWeightPath": model, "dtype": dtype,
                "cpuMemSize": kv_gib / workers}], **(deploy or {})},
            "ScheduleConfig": {"cacheBlockSize": 128, "maxBatchSize": 512, "maxPrefillBatchSize": 64,
                               "maxPrefillTokens": 8192, "maxIterTimes": 4096, "overlapSteps": overlap,
                               **(schedule or {})},
        },
    }


def start_server(model: str, port: int, *, workers: int = 2, frontends: int = 1, dtype: str = "bfloat16",
                 kv_gib: float = 1.0, overlap: bool | None = None, null_model: bool = False,
                 null_step_ms: float = 0.0, server: dict | None = None, schedule: dict | None = None,
                 prefix: str = "mb", deploy: dict | None = None,
                 backend: dict | None = None) -> tuple[subprocess.Popen, str, float]:
    """Start scripts/launch.sh on a fresh config (and run dir, with its server.log) under /tmp;
    returns (process, url, launch->ready s); the process's ``run_dir`` is that directory.
    ``server`` / ``schedule`` / ``deploy`` / ``backend``: ServerConfig / ScheduleConfig /
    ModelDeployConfig / BackendConfig keys over the defaults here (maxLoras, cpuThreadsPerWorker, ...)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(tmp, 0o700)
    cfg = bench_config(model, port, tmp, workers=workers, dtype=dtype, kv_gib=kv_gib, overlap=overlap,
                       server=server, schedule=schedule, deploy=deploy, backend=backend)
    cfg_path = tmp / "config.json"
    cfg_path.write_text(json.dumps(cfg, indent=1))
    env = dict(os.environ, MINDIE_LOG_LEVEL="WARNING", PYTHON=sys.executable)
    launch = [str(ROOT / "scripts" / "launch.sh"), "--config", str(cfg_path), "--frontends", str(frontends)]
    if null_model:
        launch += ["--null-model", "--null-step-ms", str(null_step_ms)]
    t0 = time.monotonic()
    # Same session as this script (no setsid): the kernel groups CPU scheduling by session.
    proc = subprocess.Popen(["bash", *launch], env=env, stdout=open(tmp / "server.log", "wb"),
                            stderr=subprocess.STDOUT)
    proc.run_dir = tmp
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() - t0 < 120:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}; log: {tmp / 'server.log'}")
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return proc, url, time.monotonic() - t0
        except OSError:
            time.sleep(0.05)
    proc.terminate()
    sys.exit(f"server not ready in 120 s; log: {tmp / 'server.log'}")


def stop_servers(procs: list[subprocess.Popen]) -> None:
    """Stop servers start_server started: SIGTERM to each (their drains run together), then wait up
    to 30 s for each before SIGKILL."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model dir (default: the bench30m preset)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workers", type=int, default=2, help="CPU device workers")
    ap.add_argument("--frontends", type=int, default=1)
    ap.add_argument("--kv-gib", type=float, default=1.0, help="KV cache in GiB for the whole server")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=0, help="per level (default max(32, 2 x c))")
    ap.add_argument("--port", type=int, default=18700)
    ap.add_argument("--null-model", action="store_true", help="no model compute: serving stack only")
    ap.add_argument("--null-step-ms", type=float, default=0.0)
    ap.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                    help="ScheduleConfig.overlapSteps (auto = the device's default)")
    ap.add_argument("--no-engine", action="store_true", help="skip the engine-alone runs")
    ap.add_argument("--out", default="bench-results")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in args.concurrency.split(",")]

    model = args.model or bench_model()
    print(f"model {model}; server: {args.workers} workers, {args.frontends} front ends", file=sys.stderr)
    server, url, ready_s = start_server(
        model, args.port, workers=args.workers, frontends=args.frontends, dtype=args.dtype, kv_gib=args.kv_gib,
        overlap={"auto": None, "on": True, "off": False}[args.overlap], null_model=args.null_model,
        null_step_ms=args.null_step_ms)
    print(f"launch -> ready: {ready_s:.2f} s", file=sys.stderr)
    rss = RssSampler(server.pid)
    rss.start()
    http: dict[int, dict] = {}
    try:
        for c in levels:
            n = args.num_prompts or max(32, 2 * c)
            res_dir = out / f"http-c{c}"
            cmd = [sys.executable, "-m", "mindie_bench", "run", "--url", url, "--api", "native",
                   "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
                   "--num-prompts", str(n), "--concurrency", str(c), "--warmup", str(min(c, 8)),
                   "--out", str(res_dir), "--quiet"]
            subprocess.run(cmd, check=True)
            result = json.loads(sorted(res_dir.glob("run-*.json"))[-1].read_text())
            http[c] = result["points"][0]["stats"]
            print(f"  http c={c}: {http[c]['output_throughput']:.1f} tok/s", file=sys.stderr)
    finally:
        rss.stop = True
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    engine: dict[int, float] = {}
    if not args.no_engine and not args.null_model:
        for c in levels:
            n = args.num_prompts or max(32, 2 * c)
            r = subprocess.run([sys.executable, "-m", "mindie_bench.lab.engine", "--model", model,
                                "--dtype", args.dtype, "--concurrency", str(c), "--num-prompts", str(n),
                                "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
                                "--kv-gb", str(args.kv_gib)], capture_output=True, text=True, check=True, cwd=ROOT)
            engine[c] = json.loads(r.stdout.strip().splitlines()[-1])["output_tok_s"]
            print(f"  engine c={c}: {engine[c]:.1f} tok/s", file=sys.stderr)

    print(f"\nlaunch -> ready {ready_s:.2f} s; peak server RSS {rss.peak / 2**20:.0f} MiB "
          f"({args.workers} workers, {args.kv_gib} GiB KV in all)")
    print(f"{'conc':>5} {'http tok/s':>11} {'engine tok/s':>13} {'http/engine':>12} {'TTFT p50':>9} "
          f"{'ITL p99':>8} {'fail':>5} {'short':>6}")
    summary = []
    for c in levels:
        s = http[c]
        e = engine.get(c)
        ratio = s["output_throughput"] / e if e else None
        print(f"{c:>5} {s['output_throughput']:>11.1f} {e or float('nan'):>13.1f} "
              f"{ratio if ratio else float('nan'):>12.2f} {s['ttft_ms']['p50']:>9.1f} {s['itl_ms']['p99']:>8.1f} "
              f"{s['failed']:>5} {s['output_len_mismatch']:>6}")
        summary.append({"concurrency": c, "http": s, "engine_tok_s": e, "ratio": ratio})
    (out / "serving-summary.json").write_text(json.dumps({
        "args": vars(args), "ready_s": ready_s, "peak_rss_bytes": rss.peak, "levels": summary}, indent=1))


if __name__ == "__main__":
    main()
