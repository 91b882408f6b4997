#!/usr/bin/env python3
"""HTTP/1.1 response parsing for the benchmark client: httptools vs the hand-written parser.

Feeds one chunked SSE response of N events (MindIE ``/infer_token`` frames) to
``mindie_bench.api_clients._Conn`` (httptools) and to the hand-written state machine it replaced
(``_Conn`` of mindie_bench/api_clients.py at --baseline-rev, read from git history), in three read
patterns: one chunk per read (what a streaming server's writes usually give), 64-byte reads and
16 KiB reads. Prints µs per event (best of --repeat) and checks that both deliver the same body
bytes and keep the connection reusable.

    python3 -m mindie_bench.lab.http_parser [--events 10000] [--repeat 5] [--baseline-rev 63b6701]

Also ``mindie-bench http-parser ...`` (mindie_bench/lab/__init__.py lists the lab's commands).

This package's internals, on purpose: it measures ``mindie_bench.api_clients._Conn``, the benchmark
client's own connection class, against its predecessor read from git history.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mindie_bench.api_clients import _Conn, _Exchange  # noqa: E402

BASELINE_REV = "63b6701"  # the last commit whose mindie_bench/api_clients.py has the hand-written parser
FRAME = b'data: {"prefill_time":null,"decode_time":16.80,"token":{"id":[17739],"text":" photograph"}}\n\n'
HEAD = (b"HTTP/1.1 200 OK\r\ndate: Mon, 01 Jan 2024 00:00:00 GMT\r\nserver: uvicorn\r\n"
        b"content-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")


def baseline_conn(rev: str) -> type:
    """``_Conn`` of mindie_bench/api_clients.py at git revision ``rev``, imported under another
    module name; exits with a message if git, the revision or the parser is not there."""
    what = f"{rev}:mindie_bench/api_clients.py"
    try:
        src = subprocess.run(["git", "show", what], cwd=ROOT, capture_output=True, check=True).stdout
    except FileNotFoundError:
        sys.exit("bench_http_parser: git is not installed; the hand-written baseline parser is read from "
                 "git history")
    except subprocess.CalledProcessError as e:
        sys.exit(f"bench_http_parser: cannot read {what} from git ({e.stderr.decode(errors='replace').strip() or e}); run in a clone "
                 f"that has that commit, or name another with --baseline-rev")
    name = "_adapters_baseline"
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"{name}.py"
        path.write_bytes(src)
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
    conn = getattr(mod, "_Conn", None)
    if conn is None or not hasattr(conn, "_parse"):
        sys.exit(f"bench_http_parser: {what} has no hand-written _Conn (no _parse method); name a revision "
                 f"before httptools with --baseline-rev")
    return conn


class _Transport:
    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


def reads(n: int, size: int) -> list[bytes]:
    """The response as the socket would hand it over: one chunk per read (size 0) or
    fixed-size reads."""
    chunk = b"%x\r\n" % len(FRAME) + FRAME + b"\r\n"
    if size == 0:
        return [HEAD] + [chunk] * n + [b"0\r\n\r\n"]
    raw = HEAD + chunk * n + b"0\r\n\r\n"
    return [raw[i:i + size] for i in range(0, len(raw), size)]


async def parse(cls: type, pieces: list[bytes]) -> tuple[float, int, bool]:
    """(seconds in data_received, body bytes delivered, connection reusable)."""
    got = 0

    def sink(data: bytes, t: float) -> None:
        nonlocal got
        got += len(data)

    fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    conn = cls()
    conn.connection_made(_Transport())
    conn.start(_Exchange(fut, lambda status, headers: sink), b"")
    t0 = time.perf_counter()
    for p in pieces:
        conn.data_received(p)
    dt = time.perf_counter() - t0
    return dt, got, await fut


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=10000)
    ap.add_argument("--repeat", type=int, default=5, help="best of this many runs")
    ap.add_argument("--baseline-rev", default=BASELINE_REV, metavar="REV",
                    help=f"git revision whose mindie_bench/api_clients.py has the hand-written parser "
                         f"(default {BASELINE_REV})")
    args = ap.parse_args(argv)
    n = args.events
    impls = {"hand-written": baseline_conn(args.baseline_rev), "httptools": _Conn}
    print(f"{n} SSE events of {len(FRAME)} bytes, chunked; µs per event (best of {args.repeat})")
    print(f"{'reads (count)':26} " + " ".join(f"{k:>13}" for k in impls))
    for size in (0, 64, 16384):
        pieces = reads(n, size)
        cells = []
        for cls in impls.values():
            runs = [asyncio.run(parse(cls, pieces)) for _ in range(args.repeat)]
            assert all(got == n * len(FRAME) and reusable for _, got, reusable in runs), cls
            cells.append(f"{min(dt for dt, _, _ in runs) / n * 1e6:13.3f}")
        label = "one chunk per read" if size == 0 else f"{size}-byte reads"
        print(f"{label + f' ({len(pieces)})':26} " + " ".join(cells))


if __name__ == "__main__":
    main()
