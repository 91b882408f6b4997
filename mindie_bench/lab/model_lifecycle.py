#!/usr/bin/env python3
"""What several models cost to switch: the real server (scripts/launch.sh) holding one model under
two names (``a``, ``b``), ``maxLoadedModels`` 1, one CPU worker per model; over the HTTP routes
(docs/apis.md, "Several models"), each timed from the request to its answer:

1. ``POST /models/load`` of ``b`` while ``a`` is loaded and idle (``a`` drained and stopped first:
   an eviction and a load);
2. ``POST /models/unload`` of ``b``, and the resident memory it gave back (the RSS of its worker
   processes, pids from ``/v1/status``);
3. ``POST /sleep?level=1`` with ``a`` loaded (every worker stopped), the memory given back;
4. ``POST /wake_up`` (``a`` loaded again), and the time to the first answer after it.

Each round's figures are printed as JSON lines; ``--rounds`` repeats 2-4 after 1.

    python -m mindie_bench.lab.model_lifecycle                    # the default model (SmolLM2-135M GGUF)
    python -m mindie_bench.lab.model_lifecycle --model gpu1b      # the 1B shape (bench-models), bf16
    python -m mindie_bench.lab.model_lifecycle --model DIR --rounds 3

Also ``mindie-bench model-lifecycle ...``. Public entry points only: the server through
``scripts/launch.sh`` (``serving.start_server``), the routes over HTTP, the processes' RSS from /proc.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from mindie_bench.lab.serving import start_server


def call(url: str, method: str = "GET", body: dict | None = None, timeout: float = 600.0) -> tuple[int, dict]:
    """One HTTP request; (status, JSON body or {})."""
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw or b"{}")
    except ValueError:
        return status, {"text": raw.decode(errors="replace")}


def rss_mib(pids: list[int]) -> float:
    """The resident memory of ``pids`` (MiB; a process gone counts 0)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def models(url: str) -> dict:
    return call(url + "/v1/status")[1]["models"]


def wait_state(url: str, name: str, state: str, timeout: float = 600.0) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = models(url)[name]
        if st["state"] == state:
            return st
        time.sleep(0.05)
    raise SystemExit(f"model {name} not {state} after {timeout} s: {models(url)[name]}")


def timed(url: str, path: str, body: dict | None = None) -> float:
    """Seconds from sending a POST to its 200 answer (exits on another status)."""
    t0 = time.monotonic()
    status, reply = call(url + path, "POST", body)
    if status != 200:
        raise SystemExit(f"POST {path}: {status} {reply}")
    return time.monotonic() - t0


def first_answer(url: str, name: str) -> float:
    """Seconds to a 4-token greedy completion of model ``name``."""
    t0 = time.monotonic()
    status, reply = call(url + "/v1/completions", "POST", {"model": name, "prompt": "The capital of France is",
                                                          "max_tokens": 4, "temperature": 0})
    if status != 200:
        raise SystemExit(f"completion of {name}: {status} {reply}")
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default",
                    help="default (SmolLM2-135M-Instruct's GGUF), a bench-models name (gpu1b, bench30m, "
                         "qwen35-1b) or a model directory / GGUF file")
    ap.add_argument("--dtype", default="auto", help="ModelConfig dtype (default auto)")
    ap.add_argument("--kv-gib", type=float, default=0.5, help="each model's KV cache GiB (cpuMemSize)")
    ap.add_argument("--rounds", type=int, default=2, help="unload/sleep/wake rounds after the first load")
    ap.add_argument("--port", type=int, default=18460)
    args = ap.parse_args(argv)

    from mindie_bench.lab.bench_models import resolve
    path = args.model if Path(args.model).exists() else resolve(args.model, ours=True)
    entry = {"modelWeightPath": path, "dtype": args.dtype, "cpuMemSize": args.kv_gib}
    deploy = {"maxLoadedModels": 1, "ModelConfig": [{**entry, "modelName": "a"}, {**entry, "modelName": "b"}]}
    proc, url, ready = start_server(path, args.port, workers=1, deploy=deploy, prefix="mblife")
    rows = []
    try:
        wait_state(url, "a", "loaded")
        a_pids = models(url)["a"]["pids"]
        row = {"model": args.model, "start_s": round(ready, 2), "worker_rss_mib": round(rss_mib(a_pids), 1),
               "first_answer_s": round(first_answer(url, "a"), 2)}
        row["load_b_evicting_a_s"] = round(timed(url, "/models/load", {"model": "b"}), 2)
        print(json.dumps(row), flush=True)
        rows.append(row)
        for r in range(args.rounds):
            b = wait_state(url, "b", "loaded")
            held = rss_mib(b["pids"])
            row = {"round": r + 1, "unload_s": round(timed(url, "/models/unload", {"model": "b"}), 2),
                   "unload_freed_mib": round(held - rss_mib(b["pids"]), 1)}
            row["load_a_s"] = round(timed(url, "/models/load", {"model": "a"}), 2)
            a = wait_state(url, "a", "loaded")
            held = rss_mib(a["pids"])
            row["sleep_level1_s"] = round(timed(url, "/sleep?level=1"), 2)
            row["sleep_freed_mib"] = round(held - rss_mib(a["pids"]), 1)
            row["wake_up_s"] = round(timed(url, "/wake_up"), 2)
            row["first_answer_after_wake_s"] = round(first_answer(url, "a"), 2)
            row["load_b_evicting_a_s"] = round(timed(url, "/models/load", {"model": "b"}), 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except Exception:  # noqa: BLE001 - the launcher stops its children on TERM; KILL if it hangs
            proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
