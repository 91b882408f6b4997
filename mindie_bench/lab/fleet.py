"""The coordinator's benchmarks (docs/performance.md, "Coordinator"), each on a real local fleet
started by ``scripts/motor.sh`` (coordinator + server instances through ``scripts/launch.sh``):

    python -m mindie_bench.lab.fleet affinity [--conversations 8 --turns 4 --first-words 600 ...]
    python -m mindie_bench.lab.fleet relay [--concurrency 256 --num-prompts 768 ...]

``affinity``: a multi-turn chat workload (OpenAI ``/v1/chat/completions``, streamed) over two
instances of the demo model, once with ``algorithm_type`` ``load_balance`` and once with
``cache_affinity`` (a fresh fleet each, so each instance's lifetime counters are the run's).
Each conversation opens with its own long user message and adds a short one per turn after the
assistant's reply, so a turn's prompt starts with the whole previous turn: on the instance that
served that turn it is a prefix-cache hit. Reported: the prefix-cache hit rate (each instance's
``npu_prefix_cache_hit_rate`` from its /metrics, weighted by its ``prompt_tokens_total``), TTFT
p50/p99 over all turns and over turns 2+ (client side: request sent -> first content chunk),
and how the coordinator decided (its ``/metrics`` routing counters).

``relay``: what the coordinator adds: one instance of the null model (a fixed step time, no
compute: the serving stack alone) called through the coordinator (A) and directly (B), A and B
alternated ``--rounds`` times on the same seeded workload by ``mindie-bench compare`` (native
``/infer_token``, streamed). Reported: TTFT and output tokens/s of each and their ratio.

This is a 2-core machine shared with other work: the figures are noisy; the ratios, taken side by
side in one run, are the meaningful part.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
MOTOR = ROOT / "scripts" / "motor.sh"


def _free_run(n: int, avoid: tuple = (), ports: range = range(20000, 60000)) -> int:
    """First of ``n`` consecutive free loopback ports within ``ports`` (none of ``avoid`` among
    them); the tests' fleets take theirs here too, from their process's own slice
    (tests/coord_harness.consecutive_free_ports)."""
    import socket
    for _ in range(200):
        base = random.randrange(ports.start, ports.stop - n)
        if any(base <= a < base + n for a in avoid):
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


class LocalFleet:
    """scripts/motor.sh running in the background until ``stop()``."""

    def __init__(self, tmp: Path, *, replicas: int, algorithm: str, server: dict, launch_args: list[str],
                 coordinator: Optional[dict] = None):
        base = _free_run(2 + 2 * replicas)
        self.predict, self.manage = base, base + 1
        doc = {"deploy_config": {"replicas": replicas},
               "mindie_ms_controller_config": {"deploy_mode": "single_node"},
               "mindie_ms_coordinator_config": {
                   "http_config": {"predict_port": self.predict, "manage_port": self.manage},
                   "digs_scheduler_config": {"deploy_mode": "single_node", "algorithm_type": algorithm},
                   **(coordinator or {})},
               "mindie_server_config": {**server, "ServerConfig": {**server.get("ServerConfig", {}), "port": base + 2}}}
        self.config = tmp / f"user_config-{algorithm}.json"
        self.config.write_text(json.dumps(doc, indent=1))
        self.run_dir = tempfile.mkdtemp(prefix="mf", dir="/tmp")
        self.log_path = tmp / f"motor-{algorithm}.log"
        self.log = open(self.log_path, "wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MIES_", "MINDIE_"))}
        env.setdefault("PYTHON", sys.executable)
        self.proc = subprocess.Popen(["bash", str(MOTOR), "--config", str(self.config), "--run-dir", self.run_dir,
                                      "--ready-timeout", "240", "--", *launch_args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.predict}"
        self.manage_url = f"http://127.0.0.1:{self.manage}"

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 300) -> dict:
        deadline = time.monotonic() + timeout
        while "mindie-motor ready:" not in self.text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fleet did not start:\n{self.text()[-3000:]}")
            time.sleep(0.2)
        return json.loads((Path(self.run_dir) / "plan.json").read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# -- scraping ------------------------------------------------------------------------------------------
METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")


def scrape(url: str) -> dict[str, float]:
    """{name{labels}: value} of a Prometheus text page (sums of samples that share the name
    without labels are not made: the caller picks)."""
    import httpx
    out = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        m = METRIC.match(line.strip())
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def pick(metrics: dict[str, float], name: str) -> float:
    """The sum over label sets of ``name`` (one model per instance here)."""
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


# -- the multi-turn chat workload ----------------------------------------------------------------------
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def conversation(client, url: str, model: str, idx: int, turns: int, first_words: int, turn_words: int,
                       max_tokens: int, records: list, seed: int) -> None:
    rng = random.Random(seed * 1000 + idx)
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": f"conversation {idx}: " + words(rng, first_words)}]
    for turn in range(turns):
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
                "temperature": 0, "ignore_eos": True}
        t0 = time.perf_counter()
        ttft, text, status = None, [], 0
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
                if delta.get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(delta["content"])
        records.append({"conversation": idx, "turn": turn, "status": status, "ttft_s": ttft,
                        "e2e_s": time.perf_counter() - t0})
        messages += [{"role": "assistant", "content": "".join(text)},
                     {"role": "user", "content": words(rng, turn_words)}]


async def chat_workload(url: str, args) -> list[dict]:
    import httpx
    records: list[dict] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=httpx.Limits(max_connections=None)) as c:
        model = (await c.get(url + "/v1/models")).json()["data"][0]["id"]
        await asyncio.gather(*(conversation(c, url, model, i, args.turns, args.first_words, args.turn_words,
                                            args.max_tokens, records, args.seed)
                               for i in range(args.conversations)))
    return records


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def affinity(args) -> dict:
    from workers.models.demo import ensure_demo_model
    model = str(ensure_demo_model())
    server = {"ServerConfig": {"ipAddress": "127.0.0.1", "httpsEnabled": False},
              "BackendConfig": {"npuDeviceIds": [[0]], "deviceType": "cpu", "cpuThreadsPerWorker": 1,
                                "ModelDeployConfig": {"maxSeqLen": 4096, "maxInputTokenLen": 3072,
                                                      "ModelConfig": [{"modelName": "demo", "modelWeightPath": model,
                                                                       "cpuMemSize": 1, "dtype": "float32"}]},
                                "ScheduleConfig": {"cacheBlockSize": 16, "maxBatchSize": 32, "maxPrefillBatchSize": 16,
                                                   "maxPrefillTokens": 8192, "maxIterTimes": 512,
                                                   "enablePrefixCache": True}}}
    out: dict[str, Any] = {}
    tmp = Path(tempfile.mkdtemp(prefix="fleet-affinity-"))
    for algorithm in ("load_balance", "cache_affinity"):
        fleet = LocalFleet(tmp, replicas=2, algorithm=algorithm, server=server, launch_args=["-w", "1"],
                           coordinator={"digs_scheduler_config": {"deploy_mode": "single_node", "algorithm_type": algorithm,
                                                                  "affinityBlockTokens": 16}})
        try:
            plan = fleet.wait_ready()
            t0 = time.perf_counter()
            records = asyncio.run(chat_workload(fleet.url, args))
            wall = time.perf_counter() - t0
            per = []
            for inst in plan["instances"]:
                m = scrape(f"http://127.0.0.1:{inst['mgmt_port']}/metrics")
                per.append((pick(m, "npu_prefix_cache_hit_rate"), pick(m, "prompt_tokens_total")))
            weight = sum(w for _, w in per)
            hit = sum(r * w for r, w in per) / weight if weight else 0.0
            coord = scrape(fleet.manage_url + "/metrics")
            decisions = {k: v for k, v in coord.items() if k.startswith("coordinator_routing_decisions_total")}
        finally:
            fleet.stop()
        bad = [r for r in records if r["status"] != 200 or r["ttft_s"] is None]
        ttft = [r["ttft_s"] * 1000 for r in records if r["ttft_s"] is not None]
        later = [r["ttft_s"] * 1000 for r in records if r["ttft_s"] is not None and r["turn"] > 0]
        out[algorithm] = {"requests": len(records), "errors": len(bad), "wall_s": round(wall, 2),
                          "prefix_hit_rate": round(hit, 4),
                          "per_instance": [{"hit_rate": round(r, 4), "prompt_tokens": w} for r, w in per],
                          "ttft_ms_p50": round(pct(ttft, 0.5), 1), "ttft_ms_p99": round(pct(ttft, 0.99), 1),
                          "ttft_ms_p50_turn2plus": round(pct(later, 0.5), 1),
                          "ttft_ms_p99_turn2plus": round(pct(later, 0.99), 1),
                          "coordinator_decisions": decisions}
        print(f"{algorithm:15s} hit {hit:6.1%}  TTFT p50 {pct(ttft, .5):7.1f} ms  p99 {pct(ttft, .99):7.1f} ms  "
              f"(turns 2+: p50 {pct(later, .5):7.1f} p99 {pct(later, .99):7.1f})  {len(records)} req, "
              f"{len(bad)} errors, {wall:.1f} s", flush=True)
    lb, ca = out["load_balance"], out["cache_affinity"]
    out["ratio_ttft_p50_turn2plus"] = round(ca["ttft_ms_p50_turn2plus"] / lb["ttft_ms_p50_turn2plus"], 3)
    out["ratio_ttft_p99_turn2plus"] = round(ca["ttft_ms_p99_turn2plus"] / lb["ttft_ms_p99_turn2plus"], 3)
    return out


# -- relay overhead ------------------------------------------------------------------------------------
def relay(args) -> dict:
    from workers.models.demo import ensure_demo_model
    model = str(ensure_demo_model())
    server = {"ServerConfig": {"ipAddress": "127.0.0.1", "httpsEnabled": False, "maxLinkNum": 2000},
              "BackendConfig": {"npuDeviceIds": [[0]], "deviceType": "cpu", "cpuThreadsPerWorker": 1,
                                "ModelDeployConfig": {"maxSeqLen": 2048, "maxInputTokenLen": 1024,
                                                      "ModelConfig": [{"modelName": "demo", "modelWeightPath": model,
                                                                       "cpuMemSize": 1, "dtype": "float32"}]},
                                "ScheduleConfig": {"cacheBlockSize": 16, "maxBatchSize": args.concurrency,
                                                   "maxPrefillBatchSize": args.concurrency,
                                                   "maxPrefillTokens": 65536, "maxIterTimes": 512}}}
    tmp = Path(tempfile.mkdtemp(prefix="fleet-relay-"))
    fleet = LocalFleet(tmp, replicas=1, algorithm="load_balance", server=server,
                       launch_args=["-w", str(args.frontends), "--null-model", "--null-step-ms", str(args.step_ms)],
                       coordinator={"request_limit": {"single_node_max_requests": 2000, "max_requests": 10000}})
    try:
        plan = fleet.wait_ready()
        inst = plan["instances"][0]
        direct = f"http://127.0.0.1:{inst['business_port']}"
        cmd = [sys.executable, "-m", "mindie_bench", "compare", "--url-a", fleet.url, "--api-a", "native",
               "--label-a", "coordinator", "--url-b", direct, "--api-b", "native", "--label-b", "instance",
               "--concurrency", str(args.concurrency), "--rounds", str(args.rounds), "--num-prompts",
               str(args.num_prompts), "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
               "--warmup", "8", "--out", str(tmp), "--no-progress"]
        print("$ " + " ".join(cmd), flush=True)
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=str(ROOT), timeout=900)
        print(p.stdout[-6000:], flush=True)
        if p.returncode != 0:
            print(p.stderr[-3000:], file=sys.stderr)
        return {"compare_stdout": p.stdout, "rc": p.returncode, "out_dir": str(tmp)}
    finally:
        fleet.stop()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mindie_bench.lab.fleet", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("affinity", help="cache_affinity against load_balance on a multi-turn chat workload")
    a.add_argument("--conversations", type=int, default=8)
    a.add_argument("--turns", type=int, default=4)
    a.add_argument("--first-words", type=int, default=600, help="words of each conversation's opening message")
    a.add_argument("--turn-words", type=int, default=20, help="words of each later user message")
    a.add_argument("--max-tokens", type=int, default=16)
    a.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("relay", help="through the coordinator against the instance alone (null model)")
    r.add_argument("--concurrency", type=int, default=256)
    r.add_argument("--num-prompts", type=int, default=768)
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--prompt-len", type=int, default=32)
    r.add_argument("--output-len", type=int, default=32)
    r.add_argument("--step-ms", type=float, default=20.0, help="the null model's fixed step time")
    r.add_argument("--frontends", type=int, default=1, help="the instance's front-end processes")
    for s in (a, r):
        s.add_argument("--json", metavar="FILE", help="also write the result here")
    args = p.parse_args(argv)
    result = affinity(args) if args.cmd == "affinity" else relay(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
