"""Disaggregated prefill/decode against one hybrid instance under a mixed load (issue 32, item 6;
docs/performance.md, "Disaggregated prefill/decode"):

    python -m mindie_bench.lab.pd [--duration 40 --stream-rate 1.0 --long-rate 0.3 ...]

Two local fleets started by ``scripts/motor.sh``, one after the other, with the same total
cores: (A) one hybrid instance (``single_node``, ``--cores`` threads in its one device worker)
and (B) ``pd_separate``, one prefill plus one decode instance (``--cores``/2 threads each), both
behind the coordinator. The same seeded open-loop workload goes to each, through the
coordinator (TGI ``/generate_stream``, greedy, ``ignore_eos``):

- *decode streams*: short prompts (``--stream-prompt`` words) generating ``--stream-tokens``
  tokens, Poisson arrivals at ``--stream-rate`` per second;
- *long prompts*: ``--long-prompt`` words generating ``--long-tokens`` tokens, Poisson arrivals
  at ``--long-rate`` per second, landing while the streams decode;

and first, on each fleet, the decode streams alone (``--long-rate`` 0: the ITL with no prompts
arriving). Reported per fleet: ITL p50/p99 of the decode streams (the gaps between their
tokens), TTFT p50/p99 of every request, and goodput: requests per second that met both
``--ttft-target`` (TTFT) and ``--itl-target`` (their own p99 ITL), over the run.

This is a 2-core machine shared with other work: the figures are noisy; the side-by-side
ratios are the meaningful part.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from mindie_bench.lab.fleet import LocalFleet, _free_run, pct, words

ROOT = Path(__file__).resolve().parents[2]


def server_config(model: str, threads: int, max_batch: int) -> dict:
    # threads 0: cpuThreadsPerWorker left out, the server's default (its usable cores: motor.sh's
    # core binding, or the whole host without it)
    threads_key = {"cpuThreadsPerWorker": threads} if threads else {}
    return {"ServerConfig": {"ipAddress": "127.0.0.1", "httpsEnabled": False},
            "BackendConfig": {"npuDeviceIds": [[0]], "deviceType": "cpu", **threads_key,
                              "ModelDeployConfig": {"maxSeqLen": 4096, "maxInputTokenLen": 3072,
                                                    "ModelConfig": [{"modelName": "demo", "modelWeightPath": model,
                                                                     "cpuMemSize": 1, "dtype": "float32"}]},
                              "ScheduleConfig": {"cacheBlockSize": 16, "maxBatchSize": max_batch,
                                                 "maxPrefillBatchSize": max_batch, "maxPrefillTokens": 4096,
                                                 "maxIterTimes": 1024, "enablePrefixCache": False}}}


class PdFleet(LocalFleet):
    """scripts/motor.sh with deploy_mode pd_separate: one prefill and one decode instance."""

    def __init__(self, tmp: Path, *, server: dict, launch_args: list[str], p: int = 1, d: int = 1,
                 cpu_binding: bool = True):
        import os
        import signal  # noqa: F401
        import subprocess
        base = _free_run(2 + 2 * (p + d))
        self.predict, self.manage = base, base + 1
        srv = {**server, "ServerConfig": {**server.get("ServerConfig", {}), "port": base + 2}}
        # cpuBinding: each instance on its own cores (motor.sh's default) or all sharing the host's
        doc = {"deploy_config": {"p_instances_num": p, "d_instances_num": d, "cpuBinding": cpu_binding},
               "mindie_ms_controller_config": {"deploy_mode": "pd_separate"},
               "mindie_ms_coordinator_config": {
                   "http_config": {"predict_port": self.predict, "manage_port": self.manage},
                   "digs_scheduler_config": {"deploy_mode": "pd_separate", "algorithm_type": "load_balance"}},
               "mindie_server_prefill_config": srv, "mindie_server_decode_config": srv}
        self.config = tmp / "user_config-pd.json"
        self.config.write_text(json.dumps(doc, indent=1))
        self.run_dir = tempfile.mkdtemp(prefix="mp", dir="/tmp")
        self.log_path = tmp / "motor-pd.log"
        self.log = open(self.log_path, "wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MIES_", "MINDIE_"))}
        env.setdefault("PYTHON", sys.executable)
        self.proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "motor.sh"), "--config", str(self.config),
                                      "--run-dir", self.run_dir, "--ready-timeout", "240", "--", *launch_args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.predict}"
        self.manage_url = f"http://127.0.0.1:{self.manage}"


async def one(client, url: str, kind: str, prompt: str, tokens: int, t_sched: float, out: list) -> None:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": tokens, "do_sample": False, "ignore_eos": True}}
    t0 = time.perf_counter()
    stamps: list[float] = []
    status, error = 0, ""
    try:
        async with client.stream("POST", url + "/generate_stream", json=body) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    if '"error"' in line:
                        error = line[:200]
                    stamps.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001 - a failed request is a result here
        error = f"{type(e).__name__}: {e}"
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    out.append({"kind": kind, "status": status, "error": error, "sched": t_sched,
                "ttft_s": (stamps[0] - t0) if stamps else None, "itl_s": itl, "tokens": len(stamps),
                "e2e_s": time.perf_counter() - t0})


async def workload(url: str, args, long_rate: float) -> list[dict]:
    import httpx
    rng = random.Random(args.seed)
    events = []
    for kind, rate in (("stream", args.stream_rate), ("long", long_rate)):
        t = 0.0
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= args.duration:
                break
            n = args.stream_prompt if kind == "stream" else args.long_prompt
            events.append((t, kind, f"{kind} {len(events)}: " + words(rng, n),
                           args.stream_tokens if kind == "stream" else args.long_tokens))
    events.sort()
    out: list[dict] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=None)) as c:
        # warm-up: one request each kind, not counted
        await asyncio.gather(one(c, url, "warm", "warm up " + words(rng, args.long_prompt), 4, 0, []),
                             one(c, url, "warm", "warm up", 4, 0, []))
        t0 = time.perf_counter()
        tasks = []
        for t, kind, prompt, n in events:  # open loop: sent at their times whatever the answers do
            await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
            tasks.append(asyncio.create_task(one(c, url, kind, prompt, n, t, out)))
        await asyncio.gather(*tasks)
        out.append({"kind": "_wall", "wall_s": time.perf_counter() - t0})
    return out


def summarize(recs: list[dict], args) -> dict:
    wall = next(r["wall_s"] for r in recs if r["kind"] == "_wall")
    reqs = [r for r in recs if r["kind"] in ("stream", "long")]
    ok = [r for r in reqs if r["status"] == 200 and not r["error"] and r["ttft_s"] is not None]
    streams = [r for r in ok if r["kind"] == "stream"]
    itl = [x for r in streams for x in r["itl_s"]]
    good = [r for r in ok if r["ttft_s"] <= args.ttft_target / 1000
            and (not r["itl_s"] or pct(r["itl_s"], 0.99) <= args.itl_target / 1000)]
    return {"requests": len(reqs), "failed": len(reqs) - len(ok),
            "itl_p50_ms": round(pct(itl, 0.5) * 1000, 1), "itl_p99_ms": round(pct(itl, 0.99) * 1000, 1),
            "ttft_p50_ms": round(pct([r["ttft_s"] for r in ok], 0.5) * 1000, 1),
            "ttft_p99_ms": round(pct([r["ttft_s"] for r in ok], 0.99) * 1000, 1),
            "long_ttft_p50_ms": round(pct([r["ttft_s"] for r in ok if r["kind"] == "long"], 0.5) * 1000, 1),
            "goodput_rps": round(len(good) / wall, 3), "good": len(good), "wall_s": round(wall, 1)}


def run_fleet(name: str, fleet, args) -> dict:
    try:
        fleet.wait_ready(300)
        res = {}
        for label, lr in (("streams alone", 0.0), ("mixed", args.long_rate)):
            recs = asyncio.run(workload(fleet.url, args, lr))
            res[label] = summarize(recs, args)
            print(f"{name:8s} {label:14s} {json.dumps(res[label])}", flush=True)
        return res
    finally:
        fleet.stop()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mindie_bench.lab.pd", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per run")
    p.add_argument("--stream-rate", type=float, default=1.0)
    p.add_argument("--stream-prompt", type=int, default=8, help="words")
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--long-rate", type=float, default=0.3)
    p.add_argument("--long-prompt", type=int, default=600, help="words")
    p.add_argument("--long-tokens", type=int, default=4)
    p.add_argument("--cores", type=int, default=2,
                   help="total device-worker threads of each side (0: the server's default, its usable cores)")
    p.add_argument("--ttft-target", type=float, default=2000.0, help="ms")
    p.add_argument("--itl-target", type=float, default=200.0, help="ms, a request's own p99 ITL")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=("hybrid", "pd"), default=None)
    p.add_argument("--cpu-binding", choices=("on", "off"), default="on",
                   help="1P+1D: each instance on its own cores (motor.sh's default) or sharing them")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    from workers.models.demo import ensure_demo_model
    model = str(ensure_demo_model())
    tmp = Path(tempfile.mkdtemp(prefix="pd-bench-"))
    result = {"args": vars(args)}
    if args.only in (None, "hybrid"):
        result["hybrid"] = run_fleet("hybrid", LocalFleet(tmp, replicas=1, algorithm="load_balance",
                                                          server=server_config(model, args.cores, 64),
                                                          launch_args=[]), args)
    if args.only in (None, "pd"):
        half = max(1, args.cores // 2) if args.cores else 0
        result["pd"] = run_fleet("1P+1D", PdFleet(tmp, server=server_config(model, half, 64), launch_args=[],
                                                  cpu_binding=args.cpu_binding == "on"), args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
