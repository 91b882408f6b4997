#!/usr/bin/env python3
"""Slow clients against the real server: normal clients' latency with and without 500 slowloris
connections (docs/reliability.md "Hostile input").

Starts scripts/launch.sh (a fresh config and run dir under /tmp; the null model by default, so
the figure is the HTTP stack's; one front end, so every connection lands on one event loop),
then runs ``--rounds`` rounds of two segments of ``--segment-s`` seconds each:

  baseline  ``--clients`` normal clients, each sending non-stream ``/infer_token`` requests back
            to back on its own kept-alive connection;
  attack    the same, while ``--connections`` slow connections are held open all the time: each
            sends a request line and then one header line every ``--gap-s`` seconds, never
            finishing its head (``--kind head``, the classic slowloris); or a head and then one
            body byte every ``--gap-s`` s (``--kind body``: these hold admission slots); or
            nothing at all (``--kind idle``). The server cuts each at its timeout
            (``ServerConfig.headTimeoutS`` / ``bodyTimeoutS``, set by ``--head-timeout-s`` /
            ``--body-timeout-s``) and the attacker opens another at once.

Prints per segment the normal clients' requests and latency (p50, p99, max) and, for attacks,
the slow connections opened, cut by the server with a 408 or closed silently, the longest any was
held, and how many were open on average; at the end the pooled p99 of the attack segments over
the pooled p99 of the baselines. Exits 1 when that ratio is above ``--max-ratio`` (1.2), when a
normal request failed, or when the server did not cut the slow connections at its timeout.

    python -m mindie_bench.lab.slowloris                       # 500 slow heads, 8 clients, 3 rounds
    python -m mindie_bench.lab.slowloris --kind body --body-timeout-s 10
    python -m mindie_bench.lab.slowloris --connections 2000 --segment-s 30

Also ``mindie-bench slowloris ...`` (mindie_bench/lab/__init__.py lists the lab's commands).
Public entry points only: ``scripts/launch.sh`` and HTTP over raw sockets (an asyncio client, so
that on a small box the load generator takes as little CPU from the server as it can).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from mindie_bench.lab import serving  # noqa: E402


def cpu_model() -> str:
    """lscpu's "Model name" (what docs/reliability.md quotes), else /proc/cpuinfo's."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def start_server(args, model: str) -> tuple[subprocess.Popen, Path, float]:
    """The server this benchmark loads (mindie_bench/lab/serving.py's start_server); returns
    (process, run dir with its server.log, launch->ready s)."""
    proc, _, ready_s = serving.start_server(
        model, args.port, workers=1, frontends=args.frontends, kv_gib=1.0,
        null_model=True, null_step_ms=args.null_step_ms,
        server={"maxLinkNum": args.max_link_num, "headTimeoutS": args.head_timeout_s, "bodyTimeoutS": args.body_timeout_s}, schedule={"maxBatchSize": 256, "maxIterTimes": 1024}, prefix="ms")
    return proc, proc.run_dir, ready_s


def frontend_cpu_s(launcher: int) -> float:
    """CPU seconds (user + system) used so far by the server's front ends: the gunicorn
    processes below the launcher whose parent is the gunicorn master."""
    procs: dict[int, tuple[int, bytes, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        procs[int(entry)] = (int(fields[1]), cmd, (int(fields[11]) + int(fields[12])) / tick)
    masters = {p for p, (ppid, cmd, _) in procs.items() if ppid == launcher and b"gunicorn" in cmd}
    return sum(cpu for p, (ppid, cmd, cpu) in procs.items() if ppid in masters and b"gunicorn" in cmd)


# -- normal clients ------------------------------------------------------------------------------
async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """(status, body, connection: close) of one response with a Content-Length."""
    line = await reader.readline()
    if not line:
        raise ConnectionError("closed before a status line")
    status = int(line.split()[1])
    length, close = 0, False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.partition(b":")
        k = k.strip().lower()
        if k == b"content-length":
            length = int(v)
        elif k == b"connection" and v.strip().lower() == b"close":
            close = True
    return status, await reader.readexactly(length), close


async def normal_client(port: int, request: bytes, stop: asyncio.Event, lat_ms: list[float],
                        errors: list[str]) -> None:
    conn = None
    while not stop.is_set():
        try:
            if conn is None:
                conn = await asyncio.open_connection("127.0.0.1", port)
            reader, writer = conn
            t0 = time.perf_counter()
            writer.write(request)
            status, body, close = await read_response(reader)
            dt = (time.perf_counter() - t0) * 1e3
            if status != 200:
                errors.append(f"{status} {body[:120]!r}")
            else:
                lat_ms.append(dt)
            if close:
                writer.close()
                conn = None
        except (OSError, ConnectionError, ValueError, IndexError, asyncio.IncompleteReadError) as e:
            errors.append(f"{type(e).__name__}: {e}")
            if conn is not None:
                conn[1].close()
            conn = None
            await asyncio.sleep(0.05)
    if conn is not None:
        conn[1].close()


# -- slow connections (in a process of their own: they must not share the measuring loop) --------
class Slow:
    """Counters of the attacking process, shared with the parent."""

    def __init__(self, ctx) -> None:
        self.opened = ctx.Value("q", 0)
        self.open_now = ctx.Value("q", 0)
        self.cut_408 = ctx.Value("q", 0)  # the server answered 408 and closed
        self.closed_silent = ctx.Value("q", 0)  # closed without an answer (idle connections)
        self.other = ctx.Value("q", 0)  # any other ending (a reset, another answer)
        self.connect_errors = ctx.Value("q", 0)
        self.max_held = ctx.Value("d", 0.0)  # longest connect -> closed by the server, s
        self.open_samples: list[int] = []

    @staticmethod
    def add(v, n: int = 1) -> None:
        with v.get_lock():
            v.value += n


def slow_start(kind: str) -> tuple[bytes, bytes]:
    """(what a slow connection sends first, what it sends every gap)."""
    if kind == "head":
        return b"GET /health HTTP/1.1\r\nHost: slowloris\r\n", b"X-Slow: 1\r\n"
    if kind == "body":
        return (b"POST /infer_token HTTP/1.1\r\nHost: slowloris\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100000\r\n\r\n{\"input_id\": [5, 6"), b" "
    return b"", b""


async def slow_connection(port: int, kind: str, gap: float, st: Slow) -> None:
    first, drip = slow_start(kind)

    async def dripping(writer: asyncio.StreamWriter) -> None:
        while True:  # a timer per gap: the load generator itself stays light
            await asyncio.sleep(gap)
            writer.write(drip)

    while True:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            st.add(st.connect_errors)
            await asyncio.sleep(0.1)
            continue
        st.add(st.opened)
        st.add(st.open_now)
        t0 = time.monotonic()
        got = b""
        dripper = asyncio.create_task(dripping(writer)) if drip else None
        try:
            if first:
                writer.write(first)
            while chunk := await reader.read(65536):  # until the server closes it
                got += chunk
            if got.startswith(b"HTTP/1.1 408 "):
                st.add(st.cut_408)
            elif not got:
                st.add(st.closed_silent)
            else:
                st.add(st.other)
        except (OSError, ConnectionError):
            st.add(st.other)
        except asyncio.CancelledError:  # the segment ended: not a connection the server cut
            st.add(st.open_now, -1)
            writer.close()
            raise
        finally:
            if dripper is not None:
                dripper.cancel()
        held = time.monotonic() - t0
        with st.max_held.get_lock():
            st.max_held.value = max(st.max_held.value, held)
        st.add(st.open_now, -1)
        writer.close()


def attacker(port: int, kind: str, gap: float, n: int, st: Slow, stop) -> None:
    """The attacking process: ``n`` slow connections, each replaced as soon as the server cuts it."""
    async def run() -> None:
        tasks = [asyncio.create_task(slow_connection(port, kind, gap, st)) for _ in range(n)]
        while not stop.is_set():
            await asyncio.sleep(0.1)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    run_loop(run())


def run_loop(coro):
    """asyncio.run with uvloop where installed (as the server's front ends use)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# -- segments ------------------------------------------------------------------------------------
def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


async def measure(args, label: str, st: Slow | None) -> tuple[list[float], list[str]]:
    """The normal clients for one segment."""
    payload = json.dumps({"input_id": list(range(5, 5 + args.prompt_len)),
                          "parameters": {"max_new_tokens": args.output_len}}).encode()
    request = (b"POST /infer_token HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    stop = asyncio.Event()
    lat: list[float] = []
    errors: list[str] = []
    clients = [asyncio.create_task(normal_client(args.port, request, stop, lat, errors)) for _ in range(args.clients)]
    t_end = time.monotonic() + args.segment_s
    while time.monotonic() < t_end:
        await asyncio.sleep(min(1.0, max(0.0, t_end - time.monotonic())))
        if st is not None:
            st.open_samples.append(st.open_now.value)
        left = max(0.0, t_end - time.monotonic())
        if round(left) % 5 == 0:
            extra = (f", slow: {st.open_now.value} open, {st.cut_408.value} cut with 408, "
                     f"{st.closed_silent.value} closed silently" if st is not None else "")
            print(f"  [{label}] {len(lat)} requests, {len(errors)} errors{extra}; {left:.0f} s left",
                  file=sys.stderr, flush=True)
    stop.set()
    await asyncio.gather(*clients)
    return lat, errors


def segment(args, attack: bool, label: str) -> tuple[list[float], list[str], Slow | None, float]:
    """The normal clients' latencies and errors, the attack's counters, and the front ends' CPU
    use (cores) while the normal clients ran."""
    if not attack:
        cpu0 = frontend_cpu_s(args.launcher)
        lat, errors = run_loop(measure(args, label, None))
        return lat, errors, None, (frontend_cpu_s(args.launcher) - cpu0) / args.segment_s
    ctx = multiprocessing.get_context("fork")
    st, stop = Slow(ctx), ctx.Event()
    proc = ctx.Process(target=attacker, args=(args.port, args.kind, args.gap_s, args.connections, st, stop),
                       daemon=True)
    proc.start()
    try:
        t0 = time.monotonic()
        while st.open_now.value < args.connections and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        print(f"  [{label}] {st.open_now.value} slow connections open after {time.monotonic() - t0:.1f} s",
              file=sys.stderr, flush=True)
        cpu0 = frontend_cpu_s(args.launcher)
        lat, errors = run_loop(measure(args, label, st))
        cpu = (frontend_cpu_s(args.launcher) - cpu0) / args.segment_s
    finally:
        stop.set()
        proc.join(15)
        if proc.is_alive():
            proc.kill()
    return lat, errors, st, cpu


def report(label: str, lat: list[float], errors: list[str], st: Slow | None, segment_s: float, cpu: float) -> None:
    print(f"  {label:8s} {len(lat):6d} requests ({len(lat) / segment_s:6.1f}/s), errors {len(errors)}; "
          f"latency p50 {pct(lat, 50):6.1f} ms, p99 {pct(lat, 99):6.1f} ms, "
          f"max {max(lat, default=float('nan')):6.1f} ms; front-end CPU {cpu * 100:5.1f} % of a core")
    if errors:
        print(f"           first error: {errors[0]}")
    if st is not None:
        mean_open = sum(st.open_samples) / len(st.open_samples) if st.open_samples else float("nan")
        print(f"           slow connections: {st.opened.value} opened, {mean_open:.0f} open on average; cut by "
              f"the server: {st.cut_408.value} with a 408, {st.closed_silent.value} silently; held at most "
              f"{st.max_held.value:.1f} s; other endings {st.other.value}; connect errors {st.connect_errors.value}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=500, help="slow connections held open during attacks")
    ap.add_argument("--kind", choices=("head", "body", "idle"), default="head")
    ap.add_argument("--gap-s", type=float, default=1.0, help="seconds between a slow connection's bytes")
    ap.add_argument("--clients", type=int, default=8, help="normal clients")
    ap.add_argument("--rounds", type=int, default=3, help="baseline + attack segment pairs")
    ap.add_argument("--segment-s", type=float, default=20.0)
    ap.add_argument("--head-timeout-s", type=float, default=10.0, help="ServerConfig.headTimeoutS")
    ap.add_argument("--body-timeout-s", type=float, default=60.0, help="ServerConfig.bodyTimeoutS")
    ap.add_argument("--max-link-num", type=int, default=1000, help="ServerConfig.maxLinkNum")
    ap.add_argument("--frontends", type=int, default=1)
    ap.add_argument("--null-step-ms", type=float, default=5.0)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--max-ratio", type=float, default=1.2, help="pass: attack p99 <= this x baseline p99")
    ap.add_argument("--port", type=int, default=18741)
    args = ap.parse_args(argv)

    # Both ends need a descriptor per connection (the server inherits this limit).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, 2 * args.connections + 1024))
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))

    from mindie_bench.lab import demo_model
    model = demo_model()  # tokenizer and vocabulary only: the null model computes nothing
    server, run_dir, ready_s = start_server(args, model)
    args.launcher = server.pid
    print(f"CPU: {cpu_model()} ({os.cpu_count()} CPUs); server: {args.frontends} front end(s), null model "
          f"{args.null_step_ms} ms/step, headTimeoutS {args.head_timeout_s:g}, bodyTimeoutS {args.body_timeout_s:g}; "
          f"ready in {ready_s:.1f} s")
    print(f"load: {args.clients} normal clients (non-stream /infer_token, {args.prompt_len} prompt / "
          f"{args.output_len} new tokens, back to back); attack: {args.connections} slow connections "
          f"({args.kind}, a byte every {args.gap_s:g} s); {args.rounds} rounds of {args.segment_s:g} s + "
          f"{args.segment_s:g} s")
    base_all: list[float] = []
    attack_all: list[float] = []
    cpu_base: list[float] = []
    cpu_attack: list[float] = []
    failed: list[str] = []
    timeout = args.head_timeout_s if args.kind in ("head", "idle") else args.body_timeout_s
    try:
        for rnd in range(1, args.rounds + 1):
            print(f"\nround {rnd}:")
            for attack in (False, True):
                label = "attack" if attack else "baseline"
                print(f"  [{label}] round {rnd} starts", file=sys.stderr, flush=True)
                lat, errors, st, cpu = segment(args, attack, label)
                report(label, lat, errors, st, args.segment_s, cpu)
                (cpu_attack if attack else cpu_base).append(cpu)
                (attack_all if attack else base_all).extend(lat)
                if errors:
                    failed.append(f"round {rnd} {label}: {len(errors)} normal requests failed")
                if st is not None:
                    cut = st.cut_408.value + st.closed_silent.value
                    if args.segment_s > timeout + 2 and cut < args.connections:
                        failed.append(f"round {rnd}: only {cut} slow connections were cut")
                    if st.other.value:
                        failed.append(f"round {rnd}: {st.other.value} slow connections ended otherwise than cut")
                    if st.max_held.value > timeout + 2:
                        failed.append(f"round {rnd}: a slow connection was held {st.max_held.value:.1f} s "
                                      f"(timeout {timeout:g} s)")
                time.sleep(1.0)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    b99, a99 = pct(base_all, 99), pct(attack_all, 99)
    ratio = a99 / b99 if b99 else float("nan")
    print(f"\nnormal clients, all rounds: baseline p50 {pct(base_all, 50):.1f} ms, p99 {b99:.1f} ms "
          f"({len(base_all)} requests); under attack p50 {pct(attack_all, 50):.1f} ms, p99 {a99:.1f} ms "
          f"({len(attack_all)} requests)")
    if cpu_base and cpu_attack:
        print(f"front-end CPU: {sum(cpu_base) / len(cpu_base) * 100:.1f} % of a core in the baselines, "
              f"{sum(cpu_attack) / len(cpu_attack) * 100:.1f} % under attack")
    verdict = "PASS" if ratio <= args.max_ratio and not failed else "FAIL"
    print(f"p99 under attack / baseline: {ratio:.3f} (limit {args.max_ratio:g}): {verdict}")
    for f in failed:
        print(f"  {f}")
    print(f"server log: {run_dir / 'server.log'}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
