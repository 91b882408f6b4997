#!/usr/bin/env python3
"""Memory soak: the real server under steady mixed load; every process's RSS must stay flat.

Starts scripts/launch.sh (CPU device workers, one config written under /tmp), drives it with
mindie-bench for ``--seconds``: ``--clients`` streams with short prompts (the load of issue 13:
5-60 prompt tokens, 128 new tokens) beside ``--mix-clients`` streams with long prompts and short
outputs, all with fresh random prompt ids. Every ``--interval`` seconds it samples each server
process (launcher, supervisor, device workers, gunicorn master, front ends): VmRSS, and for a
device worker the part of it that is its KV cache (the CPU cache is shared anonymous memory,
``/dev/zero (deleted)`` in /proc/<pid>/smaps, resident as it fills, up to ``cpuMemSize``).

After ``--warmup`` seconds the baseline is taken (median of the first three samples); the end
value is the median of the last three. A process fails if its RSS outside the KV cache grew by
more than ``--max-growth`` percent, if it was replaced (a restart resets memory), if a worker's
KV cache is mapped or resident beyond cpuMemSize, or if requests failed. Exit status 0 = pass,
1 = a check failed, 2 = the run itself did not work.

    python -m mindie_bench.lab.soak                                  # 10 minutes, 3 % bound
    python -m mindie_bench.lab.soak --seconds 40 --warmup 10 --max-growth 7 --cpu-mem-gib 0.25   # the test's run

Also ``mindie-bench soak ...`` (mindie_bench/lab/__init__.py lists the lab's commands).

Public entry points only: ``scripts/launch.sh``, HTTP, ``mindie-bench run``, /proc; the model comes
from ``mindie_bench.lab.demo_model``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from mindie_bench.lab.tree_memory import children as _children

ROOT = Path(__file__).resolve().parents[2]
KV_MAPPING = "/dev/zero (deleted)"  # a shared anonymous mmap: how Python's mmap.mmap(-1, n) shows


# -- processes --------------------------------------------------------------------------------
def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def server_processes(launcher: int) -> dict[int, str]:
    """pid -> role of every long-lived process under the launcher (short-lived helpers, such as
    the prepare steps or a compiler, are left out)."""
    kids = _children()
    roles = {launcher: "launcher"}
    todo = [(launcher, "launcher")]
    while todo:
        pid, parent_role = todo.pop()
        for child in kids.get(pid, []):
            cmd = _cmdline(child)
            if "workers.supervisor" in cmd:
                role = "supervisor"
            elif "workers.worker" in cmd:
                role = "worker"
                m = re.search(r'"worker_id":\s*"([^"]*)"', cmd)  # the spec is JSON on argv
                if m:
                    role = f"worker {m.group(1)}"
            elif parent_role == "gunicorn master":
                role = "front end"
            elif "gunicorn" in cmd:
                role = "gunicorn master"
            else:
                continue
            roles[child] = role
            todo.append((child, role))
    # Several front ends: number them by pid so the table tells them apart.
    fronts = sorted(p for p, r in roles.items() if r == "front end")
    if len(fronts) > 1:
        for i, p in enumerate(fronts):
            roles[p] = f"front end {i}"
    return roles


def memory(pid: int) -> dict[str, int] | None:
    """VmRSS, and the KV cache's resident and mapped bytes (shared anonymous mappings), of pid."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        kv_rss = kv_size = 0
        in_kv = False
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split(None, 5)
                if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's header line
                    in_kv = len(head) == 6 and head[5].rstrip("\n") == KV_MAPPING
                elif in_kv and head[0] == "Size:":
                    kv_size += int(head[1]) * 1024
                elif in_kv and head[0] == "Rss:":
                    kv_rss += int(head[1]) * 1024
    except (OSError, StopIteration):
        return None
    return {"rss": rss, "kv_rss": kv_rss, "kv_size": kv_size, "heap": rss - kv_rss}


# -- server and load ---------------------------------------------------------------------------
def write_config(path: Path, *, port: int, run_dir: str, model: str, dtype: str, workers: int,
                 cpu_mem_gib: float, block_size: int) -> None:
    path.write_text(json.dumps({
        "ServerConfig": {"ipAddress": "127.0.0.1", "port": port, "managementPort": port, "metricsPort": port, "httpsEnabled": False, "runDir": run_dir,
                         "maxLinkNum": 1000},
        "BackendConfig": {
            "npuDeviceIds": [[i] for i in range(workers)], "deviceType": "cpu",
            "ModelDeployConfig": {"maxSeqLen": 4096, "maxInputTokenLen": 2048, "ModelConfig": [{
                "modelName": "soak", "modelWeightPath": model, "dtype": dtype, "cpuMemSize": cpu_mem_gib}]},
            "ScheduleConfig": {"cacheBlockSize": block_size, "maxBatchSize": 256, "maxPrefillBatchSize": 64,
                               "maxPrefillTokens": 8192, "maxIterTimes": 4096},
        },
    }, indent=1))


def wait_ready(url: str, server: subprocess.Popen, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if server.poll() is not None:
            raise RuntimeError(f"server exited with {server.returncode}")
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return time.monotonic() - t0
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"server not ready in {timeout:.0f} s")


def start_load(url: str, out: Path, name: str, clients: int, prompt_len: str, output_len: str, seconds: float,
               seed: int) -> subprocess.Popen:
    """mindie-bench at fixed concurrency for ``seconds``; a pool of distinct prompts large enough
    that none repeats (a repeat would be served from the prefix cache)."""
    pool = max(1000, int(clients * seconds * 4))
    cmd = [sys.executable, "-m", "mindie_bench", "run", "--url", url, "--api", "native",
           "--prompt-len", prompt_len, "--output-len", output_len, "--concurrency", str(clients),
           "--duration", str(seconds), "--num-prompts", str(pool), "--warmup", "0", "--seed", str(seed),
           "--timeout", "120", "--out", str(out / name), "--no-progress", "--quiet"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(out / f"{name}.log", "wb"), stderr=subprocess.STDOUT)


# -- analysis ----------------------------------------------------------------------------------
def analyse(samples: list[dict], warmup: float, max_growth: float, cpu_mem_bytes: int) -> tuple[list[dict], list[str]]:
    """Per process: heap (RSS outside the KV cache) after warm-up and at the end, growth, KV."""
    after = [s for s in samples if s["t"] >= warmup]
    if len(after) < 4:
        return [], [f"only {len(after)} samples after the warm-up: run longer or sample more often"]
    base_set, end_set = after[:3], after[-3:]
    rows, failures = [], []
    pids = sorted(set(after[0]["procs"]) | set(after[-1]["procs"]), key=lambda p: after[0]["procs"].get(
        p, after[-1]["procs"].get(p, {})).get("role", ""))
    for pid in pids:
        role = (after[0]["procs"].get(pid) or after[-1]["procs"][pid])["role"]
        if pid not in after[0]["procs"] or pid not in after[-1]["procs"]:
            failures.append(f"{role} (pid {pid}) {'appeared' if pid not in after[0]['procs'] else 'vanished'} "
                            "after the warm-up (a restart?)")
            continue
        base = statistics.median(s["procs"][pid]["heap"] for s in base_set if pid in s["procs"])
        end = statistics.median(s["procs"][pid]["heap"] for s in end_set if pid in s["procs"])
        peak = max(s["procs"][pid]["heap"] for s in after if pid in s["procs"])
        last = after[-1]["procs"][pid]
        growth = 100.0 * (end - base) / base
        row = {"pid": pid, "role": role, "heap_after_warmup": base, "heap_end": end, "heap_peak": peak,
               "growth_pct": round(growth, 2), "rss_end": last["rss"], "kv_rss_end": last["kv_rss"],
               "kv_size": last["kv_size"]}
        rows.append(row)
        if growth > max_growth:
            failures.append(f"{role} (pid {pid}) grew {growth:.2f} % after the warm-up (bound {max_growth} %)")
        if role.startswith("worker"):
            kv_peak = max(s["procs"][pid]["kv_rss"] for s in samples if pid in s["procs"])
            row["kv_rss_peak"] = kv_peak
            if last["kv_size"] == 0:
                failures.append(f"{role} (pid {pid}): no KV-cache mapping found ({KV_MAPPING!r} in smaps)")
            if last["kv_size"] > cpu_mem_bytes or kv_peak > cpu_mem_bytes:
                failures.append(f"{role} (pid {pid}): KV cache {last['kv_size'] / 2**20:.0f} MiB mapped, "
                                f"{kv_peak / 2**20:.0f} MiB resident at peak, over cpuMemSize "
                                f"{cpu_mem_bytes / 2**20:.0f} MiB")
    return rows, failures


def print_table(rows: list[dict], max_growth: float) -> None:
    mib = 2 ** 20
    print(f"{'process':<16} {'pid':>7} {'RSS-KV warm':>12} {'RSS-KV end':>11} {'peak':>8} {'growth':>8} "
          f"{'RSS end':>8} {'KV res.':>8} {'KV map':>8}")
    for r in rows:
        flag = "  FAIL" if r["growth_pct"] > max_growth else ""
        kv = f"{r['kv_rss_end'] / mib:>8.1f} {r['kv_size'] / mib:>8.0f}" if r["kv_size"] else f"{'-':>8} {'-':>8}"
        print(f"{r['role']:<16} {r['pid']:>7} {r['heap_after_warmup'] / mib:>12.1f} {r['heap_end'] / mib:>11.1f} "
              f"{r['heap_peak'] / mib:>8.1f} {r['growth_pct']:>7.2f}% {r['rss_end'] / mib:>8.1f} {kv}{flag}")
    print("(MiB; RSS-KV = resident memory outside the KV cache, median of 3 samples; KV res. / map = the "
          "worker's KV cache resident / mapped)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=600, help="load duration (default 600)")
    ap.add_argument("--warmup", type=float, default=0,
                    help="seconds of load before the baseline (default: a sixth of --seconds, at most 90)")
    ap.add_argument("--interval", type=float, default=5, help="seconds between RSS samples (default 5)")
    ap.add_argument("--max-growth", type=float, default=3.0, help="percent, per process (default 3)")
    ap.add_argument("--clients", type=int, default=8, help="streams with short prompts (default 8)")
    ap.add_argument("--prompt-len", default="5:60")
    ap.add_argument("--output-len", default="128")
    ap.add_argument("--mix-clients", type=int, default=2, help="streams with long prompts (default 2)")
    ap.add_argument("--mix-prompt-len", default="60:600")
    ap.add_argument("--mix-output-len", default="1:32")
    ap.add_argument("--model", default="", help="model dir (default: the built-in demo model, see --preset)")
    ap.add_argument("--preset", default="demo", choices=["demo", "bench30m"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--frontends", type=int, default=1)
    ap.add_argument("--cpu-mem-gib", type=float, default=0.5, help="cpuMemSize per worker (default 0.5)")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--port", type=int, default=0, help="default: a free port")
    ap.add_argument("--json", help="also write every sample and the result here")
    args = ap.parse_args(argv)
    warmup = args.warmup or min(90.0, args.seconds / 6)

    model = args.model
    if not model:
        from mindie_bench.lab import demo_model
        model = demo_model(args.preset)
    port = args.port
    if not port:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    tmp = Path(tempfile.mkdtemp(prefix="soak", dir="/tmp"))
    os.chmod(tmp, 0o700)
    cfg = tmp / "config.json"
    write_config(cfg, port=port, run_dir=str(tmp), model=model, dtype=args.dtype, workers=args.workers,
                 cpu_mem_gib=args.cpu_mem_gib, block_size=args.block_size)
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, MINDIE_LOG_LEVEL="WARNING", PYTHON=sys.executable)
    print(f"soak: {args.seconds:.0f} s of load ({args.clients} clients {args.prompt_len}/{args.output_len} tokens, "
          f"{args.mix_clients} clients {args.mix_prompt_len}/{args.mix_output_len}), warm-up {warmup:.0f} s, "
          f"{args.workers} workers x {args.cpu_mem_gib} GiB KV; files in {tmp}", file=sys.stderr)
    server = subprocess.Popen(["bash", str(ROOT / "scripts" / "launch.sh"), "--config", str(cfg), "--frontends",
                               str(args.frontends)], cwd=ROOT, env=env, stdout=open(tmp / "server.log", "wb"),
                              stderr=subprocess.STDOUT)
    samples: list[dict] = []
    loads: list[subprocess.Popen] = []
    try:
        try:
            ready = wait_ready(url, server, 120)
        except (RuntimeError, TimeoutError) as e:
            print(f"soak: {e}; log: {tmp / 'server.log'}", file=sys.stderr)
            return 2
        print(f"soak: ready in {ready:.1f} s", file=sys.stderr)
        loads.append(start_load(url, tmp, "short", args.clients, args.prompt_len, args.output_len, args.seconds, 1))
        if args.mix_clients:
            loads.append(start_load(url, tmp, "long", args.mix_clients, args.mix_prompt_len, args.mix_output_len,
                                    args.seconds, 2))
        t0 = time.monotonic()
        next_print = 0.0
        while any(p.poll() is None for p in loads):
            t = time.monotonic() - t0
            procs = {}
            for pid, role in server_processes(server.pid).items():
                m = memory(pid)
                if m is not None:
                    procs[pid] = {"role": role, **m}
            samples.append({"t": round(t, 1), "procs": procs})
            if t >= next_print:
                parts = ", ".join(f"{p['role']} {p['heap'] / 2**20:.1f}"
                                  + (f"+{p['kv_rss'] / 2**20:.0f} KV" if p["kv_size"] else "")
                                  for p in sorted(procs.values(), key=lambda p: p["role"]))
                print(f"  t={t:5.0f} s  MiB: {parts}", file=sys.stderr)
                next_print += 60
            if server.poll() is not None:
                print(f"soak: the server exited with {server.returncode}; log: {tmp / 'server.log'}",
                      file=sys.stderr)
                return 2
            time.sleep(max(0.0, args.interval - (time.monotonic() - t0 - t)))
    finally:
        for p in loads:
            if p.poll() is None:
                p.terminate()
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()

    load_stats = {}
    for name in ("short", "long")[:len(loads)]:
        files = sorted((tmp / name).glob("run-*.json"))
        if not files:
            print(f"soak: load generator {name!r} wrote no result; see {tmp / (name + '.log')}", file=sys.stderr)
            return 2
        st = json.loads(files[-1].read_text())["points"][0]["stats"]
        load_stats[name] = {k: st[k] for k in ("completed", "failed", "output_throughput", "errors")}
    cpu_mem = int(args.cpu_mem_gib * (1 << 30))
    rows, failures = analyse(samples, warmup, args.max_growth, cpu_mem)
    for name, st in load_stats.items():
        if st["failed"]:
            failures.append(f"{st['failed']} {name}-prompt requests failed: {st['errors']}")
        if not st["completed"]:
            failures.append(f"no {name}-prompt request completed")

    print(f"\nsoak: {args.seconds:.0f} s of load, baseline after {warmup:.0f} s, {len(samples)} samples every "
          f"{args.interval:.0f} s; requests completed: "
          + ", ".join(f"{n} {s['completed']} ({s['output_throughput']:.0f} tok/s)" for n, s in load_stats.items()))
    print_table(rows, args.max_growth)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "warmup": warmup, "load": load_stats,
                                               "rows": rows, "failures": failures, "samples": samples}))
    if failures:
        print("\nFAIL:\n  " + "\n  ".join(failures))
        return 1
    print(f"\nPASS: every process within {args.max_growth} % after the warm-up; KV caches within cpuMemSize")
    return 0


if __name__ == "__main__":
    sys.exit(main())
