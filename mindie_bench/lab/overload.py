#!/usr/bin/env python3
"""Overload benchmark of the admission (maxLinkNum): 10x the limit of concurrent streams.

Starts scripts/launch.sh (a fresh config and run dir under /tmp, `maxLinkNum` as given, N
front ends; the null model by default so the figure is the serving stack's), then per round
opens ``overload x maxLinkNum`` connections at once (or spread over --ramp-s) and sends one
streaming /infer_token request on each, while /health is probed every 20 ms and the resident
memory of the whole server tree is sampled. Prints, per round:

  rejection latency p50/p99/max (connect -> status line of the 503), whether every rejection
  had MindIE's JSON shape, the admitted count (exactly maxLinkNum expected) and whether every
  admitted stream delivered all its tokens, admitted throughput (tokens of admitted streams /
  burst start -> last admitted stream done), /health latency p50/p99/max, peak RSS.

The load generator is a minimal asyncio HTTP/1.1 client (no httpx), so that on a small box
it takes as little CPU from the server as it can. First it times Admission.try_acquire +
release in this process (the per-request cost every inference request pays).

    python -m mindie_bench.lab.overload                       # maxLinkNum 32, 320 streams, burst
    python -m mindie_bench.lab.overload --ramp-s 2 --rounds 1  # the same arrivals spread over 2 s
    python -m mindie_bench.lab.overload --model bench30m       # a real (CPU) model instead

Also ``mindie-bench overload ...`` (mindie_bench/lab/__init__.py lists the lab's commands).

Public entry points for the load (``scripts/launch.sh``, HTTP); one internal on purpose:
``mindie.server.admission.Admission``, whose per-request cost in this process is the first line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mindie_bench.lab import serving  # noqa: E402
from mindie_bench.lab.serving import RssSampler, bench_model  # noqa: E402
from mindie_bench.lab.tree_memory import tree_rss  # noqa: E402


def admission_cost(n: int = 100_000) -> tuple[float, float]:
    """(µs per acquire+release pair with room, µs per refused acquire at the limit) on a
    private temporary run dir, two owners."""
    from mindie.server.admission import Admission
    d = tempfile.mkdtemp(prefix="adm")
    a, b = Admission(d, 1000), Admission(d, 1)
    try:
        for _ in range(1000):
            a.try_acquire().release()
        t0 = time.perf_counter()
        for _ in range(n):
            a.try_acquire().release()
        pair = (time.perf_counter() - t0) / n * 1e6
        b2 = Admission(d, 1)
        s = b2.try_acquire()
        t0 = time.perf_counter()
        for _ in range(n):
            b.try_acquire()
        refuse = (time.perf_counter() - t0) / n * 1e6
        s.release()
        b2.close()
    finally:
        a.close()
        b.close()
    return pair, refuse


def start_server(args, model: str) -> tuple[subprocess.Popen, Path, float]:
    """The server this benchmark loads (mindie_bench/lab/serving.py's start_server); returns
    (process, run dir with its server.log, launch->ready s)."""
    proc, _, ready_s = serving.start_server(
        model, args.port, workers=args.workers, frontends=args.frontends, kv_gib=1.0,
        null_model=args.model == "null", null_step_ms=args.null_step_ms,
        server={"maxLinkNum": args.max_link_num}, schedule={"maxIterTimes": 4096}, prefix="mo")
    return proc, proc.run_dir, ready_s


@dataclass
class Reply:
    status: int = 0
    headers_s: float = 0.0  # connect -> status line
    done_s: float = 0.0  # since the round started
    frames: int = 0
    tokens_final: int = -1  # details.generated_tokens of the final frame
    json_error: bool = False  # {"error", "error_type": "Service Unavailable"}
    error: str = ""


async def request(port: int, payload: bytes, t_round: float) -> Reply:
    rep = Reply()
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as e:
        rep.error = f"connect: {e}"
        return rep
    try:
        writer.write(b"POST /infer_token HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        line = await reader.readline()
        rep.headers_s = time.perf_counter() - t0
        if not line:
            rep.error = "connection closed before a status line"
            return rep
        rep.status = int(line.split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip()
        if headers.get(b"transfer-encoding") == b"chunked":
            parts = []
            while True:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await reader.readline()
                    break
                parts.append(await reader.readexactly(size))
                await reader.readexactly(2)
            data = b"".join(parts)
        else:
            data = await reader.readexactly(int(headers.get(b"content-length", b"0")))
        if rep.status == 200:
            frames = data.split(b"\n\n")
            rep.frames = sum(1 for f in frames if f.startswith(b"data: "))
            last = [f for f in frames if f.startswith(b"data: ")][-1:]
            if last:
                details = json.loads(last[0][6:]).get("details") or {}
                rep.tokens_final = details.get("generated_tokens", -1)
        else:
            try:
                body = json.loads(data)
                rep.json_error = list(body) == ["error", "error_type"] and body["error_type"] == "Service Unavailable"
            except ValueError:
                rep.json_error = False
    except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as e:
        rep.error = f"{type(e).__name__}: {e}"
    finally:
        writer.close()
        rep.done_s = time.perf_counter() - t_round
    return rep


async def probe_health(port: int, stop: asyncio.Event) -> list[tuple[int, float]]:
    """(status, seconds) of GET /health every 20 ms on a keep-alive connection (reopened when
    the server closes it; status 0 = no answer)."""
    out = []
    conn = None
    while not stop.is_set():
        t = time.perf_counter()
        status = 0
        try:
            if conn is None:
                conn = await asyncio.open_connection("127.0.0.1", port)
            reader, writer = conn
            writer.write(b"GET /health HTTP/1.1\r\nHost: bench\r\n\r\n")
            status = int((await reader.readline()).split()[1])
            length, close = 0, False
            while (line := await reader.readline()) not in (b"\r\n", b""):
                k, _, v = line.partition(b":")
                if k.strip().lower() == b"content-length":
                    length = int(v)
                elif k.strip().lower() == b"connection" and v.strip().lower() == b"close":
                    close = True
            await reader.readexactly(length)
            if close:
                writer.close()
                conn = None
        except (OSError, IndexError, ValueError, asyncio.IncompleteReadError):
            if conn is not None:
                conn[1].close()
            conn = None
        out.append((status, time.perf_counter() - t))
        await asyncio.sleep(0.02)
    if conn is not None:
        conn[1].close()
    return out


async def one_round(args, n: int) -> tuple[list[Reply], list[tuple[int, float]], float]:
    payload = json.dumps({"input_id": list(range(5, 5 + args.prompt_len)), "stream": True, "parameters": {
        "max_new_tokens": args.output_len, "details": True}}).encode()
    stop = asyncio.Event()
    health = asyncio.create_task(probe_health(args.port, stop))
    await asyncio.sleep(0.3)
    t_round = time.perf_counter()
    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(request(args.port, payload, t_round)))
        if args.ramp_s:
            await asyncio.sleep(args.ramp_s / n)
    replies = await asyncio.gather(*tasks)
    stop.set()
    return replies, await health, t_round


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-link-num", type=int, default=32)
    ap.add_argument("--overload", type=float, default=10.0, help="streams sent = overload x maxLinkNum")
    ap.add_argument("--frontends", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1, help="CPU device workers")
    ap.add_argument("--model", default="null", help="'null' (no compute), 'bench30m', or a model directory")
    ap.add_argument("--null-step-ms", type=float, default=10.0)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--ramp-s", type=float, default=0.0, help="spread the arrivals over this many seconds")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=18731)
    args = ap.parse_args(argv)

    pair, refuse = admission_cost()
    print(f"admission: acquire+release {pair:.2f} us per pair; refused acquire at the limit {refuse:.2f} us")
    if args.model == "null":
        from mindie_bench.lab import demo_model
        model = demo_model()  # tokenizer and vocabulary only
    elif args.model == "bench30m":
        model = bench_model()
    else:
        model = args.model
    server, run_dir, ready_s = start_server(args, model)
    n = int(args.overload * args.max_link_num)
    print(f"server: maxLinkNum {args.max_link_num}, {args.frontends} front ends, {args.workers} worker(s), model "
          f"{args.model}{f' ({args.null_step_ms} ms/step)' if args.model == 'null' else ''}; ready in {ready_s:.1f} s")
    print(f"load: {n} streams ({args.overload:g}x), prompt {args.prompt_len}, output {args.output_len} tokens, "
          f"{'burst' if not args.ramp_s else f'ramp over {args.ramp_s} s'}")
    rss = RssSampler(server.pid)
    rss.start()
    time.sleep(0.5)
    idle_rss = tree_rss(server.pid)
    try:
        for rnd in range(1, args.rounds + 1):
            replies, health, _ = asyncio.run(one_round(args, n))
            ok = [r for r in replies if r.status == 200]
            rej = [r for r in replies if r.status == 503]
            other = [r for r in replies if r.status not in (200, 503)]
            full = sum(r.frames == args.output_len and r.tokens_final == args.output_len for r in ok)
            lat = [r.headers_s * 1e3 for r in rej]
            tokens = sum(r.frames for r in ok)
            span = max((r.done_s for r in ok), default=float("nan"))
            hl = [h * 1e3 for _, h in health]
            print(f"\nround {rnd}:")
            print(f"  admitted             {len(ok)} (limit {args.max_link_num}); complete with all "
                  f"{args.output_len} tokens: {full}")
            print(f"  rejected             {len(rej)} (JSON 503 shape: {sum(r.json_error for r in rej)}); "
                  f"other statuses/errors: {len(other)}" + (f" e.g. {other[0].status} {other[0].error}" if other else ""))
            print(f"  rejection latency    p50 {pct(lat, 50):.1f} ms, p99 {pct(lat, 99):.1f} ms, "
                  f"max {max(lat, default=float('nan')):.1f} ms")
            print(f"  admitted throughput  {tokens / span:.0f} tokens/s ({tokens} tokens in {span:.2f} s)")
            print(f"  /health              {len(hl)} probes, not 200: {sum(s != 200 for s, _ in health)}; "
                  f"p50 {pct(hl, 50):.1f} ms, p99 {pct(hl, 99):.1f} ms, max {max(hl, default=float('nan')):.1f} ms")
            time.sleep(1.0)
    finally:
        rss.stop = True
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    print(f"\npeak RSS of the server tree {rss.peak / 2**20:.0f} MiB (idle before the load: {idle_rss / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
