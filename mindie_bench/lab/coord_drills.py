#!/usr/bin/env python3
"""Drills against the coordinator's manage port (issue 52), one table line each, loopback only.

    python -m mindie_bench.lab.coord_drills                       # every drill, 5,000-instance flood
    python -m mindie_bench.lab.coord_drills --drills flood --flood 300

One real server instance (scripts/launch.sh, the demo model, one device worker) behind the real
coordinator (``python -m coordinator``, ``pollIntervalMs`` 1000 as MindIE's default,
``max_res_num`` raised above the flood), then:

  flood    ``POST /v1/instances/refresh`` adding --flood instances at one closed port on as many
           127.x.y.z addresses; user requests (``/infer``, 2 tokens, one after another) through
           the predict port before it and while it is absorbed (until every added instance was
           polled once): p50 / p99 / max latency both times, how long the refresh took, the real
           instance's oldest poll seen, whether readiness ever left 200, and the coordinator's CPU
           while absorbing. Then the instances are deleted.
  hostile  refresh bodies a careless or hostile caller sends (CR/LF in ``ip``, ``"abc"`` slots,
           out-of-range ports, this coordinator's own ports, duplicates...): how many got a 400
           naming the field, how many a 5xx, whether anything was stored, and the real
           instance's poll age afterwards.
  decoy    ``python -m http.server`` serving a file named ``health`` (so ``GET /health`` is 200)
           added by refresh: seconds until it shows ``refused``, and how many of 20 requests
           went to it.

Every target is on 127.0.0.0/8; every loop is bounded. Needs a source checkout (it uses
tests/coord_harness.py, as chaos.py uses tests/harness.py). Also ``mindie-bench coord-drills``.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import httpx

BODY = {"inputs": "The quick brown fox", "parameters": {"max_new_tokens": 2}}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _lat(xs: list[float]) -> str:
    return f"p50 {statistics.median(xs) * 1000:.0f} / p99 {_pct(xs, 0.99) * 1000:.0f} / max {max(xs) * 1000:.0f} ms"


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    import os
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rec(iid: int, ip: str, port: int, **extra) -> dict:
    return {"id": iid, "ip": ip, "port": str(port), "metric_port": str(port), **extra}


class Drills:
    def __init__(self, coord, server, max_res: int) -> None:
        self.coord, self.server, self.max_res = coord, server, max_res

    def request(self) -> float:
        t0 = time.monotonic()
        r = httpx.post(self.coord.url + "/infer", json=BODY, timeout=60)
        if r.status_code != 200:
            raise RuntimeError(f"a user request got {r.status_code}: {r.text[:200]}")
        return time.monotonic() - t0

    def info(self) -> dict:
        return httpx.get(self.coord.manage + "/v1/coordinator_info", timeout=30).json()

    def refresh(self, body: dict) -> httpx.Response:
        return httpx.post(self.coord.manage + "/v1/instances/refresh", json=body, timeout=120)

    def poll_age(self) -> str:
        """The real instance's last poll, "<n> ms old" ("gone" when a refresh removed it)."""
        me = next((i for i in self.info()["instances"] if i["id"] == 0), None)
        if me is None:
            return "gone"
        return f"{me['last_poll_ms_ago']} ms old" if "last_poll_ms_ago" in me else "of unknown age"

    # -- drills ----------------------------------------------------------------------------------
    def window(self, seconds: float, until: Optional[Callable[[dict], bool]] = None,
               start: Optional[Callable[[], None]] = None) -> dict:
        """User requests one after another (a thread) while this thread checks readiness each
        0.5 s and reads coordinator_info each 2 s, for ``seconds`` and until ``until()`` says so
        (at most 600 s); ``start`` runs once the users are running. With thousands of instances
        coordinator_info is a few MB (tens of ms to build and parse on a 2-core machine): the
        requests that overlap one of the drill's own reads are left out of the latency figures
        (counted), so they measure the flood, not the monitoring."""
        import threading
        out: dict = {"lat": [], "errors": 0, "not_ready": 0, "checks": 0, "ages": [], "took": None, "left_out": 0}
        spans: list[tuple[float, float]] = []  # the drill's coordinator_info reads
        timed: list[tuple[float, float]] = []  # (start, end) of each user request
        stop = threading.Event()

        def users() -> None:
            while not stop.is_set():
                t = time.monotonic()
                try:
                    self.request()
                    timed.append((t, time.monotonic()))
                except (httpx.HTTPError, RuntimeError):
                    out["errors"] += 1
        cpu0, t0 = _cpu_s(self.coord.proc.pid), time.monotonic()
        th = threading.Thread(target=users, daemon=True)
        th.start()
        try:
            if start is not None:
                start()
                out["took"] = time.monotonic() - t0
            while True:
                out["checks"] += 1
                out["not_ready"] += httpx.get(self.coord.manage + "/v1/readiness", timeout=30).status_code != 200
                if out["checks"] % 4 == 1:
                    a = time.monotonic()
                    info = self.info()
                    spans.append((a, time.monotonic()))
                    me = next(i for i in info["instances"] if i["id"] == 0)
                    if "last_poll_ms_ago" in me:  # (a coordinator before issue 52 does not say)
                        out["ages"].append(me["last_poll_ms_ago"] or 0)
                    elapsed = time.monotonic() - t0
                    if (elapsed >= seconds and (until is None or until(info))) or elapsed > 600:
                        break
                time.sleep(0.5)
        finally:
            stop.set()
            th.join(120)
        for a, b in timed:
            if any(a < y and x < b for x, y in spans):
                out["left_out"] += 1
            else:
                out["lat"].append(b - a)
        out["seconds"] = time.monotonic() - t0
        out["cores"] = (_cpu_s(self.coord.proc.pid) - cpu0) / out["seconds"]
        return out

    @staticmethod
    def _said(w: dict) -> str:
        return (f"{_lat(w['lat']) if w['lat'] else 'none answered'} ({len(w['lat'])} requests; {w['errors']} "
                f"failed; {w['left_out']} overlapping the drill's coordinator_info reads left out), readiness 503 at "
                f"{w['not_ready']} of {w['checks']} checks, the real instance's oldest poll "
                f"{max(w['ages']) if w['ages'] else 'n/a'} ms, coordinator CPU {w['cores']:.2f} cores")

    def flood(self, n: int, seconds: float) -> str:
        from tests.harness import free_port
        closed = free_port()
        recs = [_rec(10000 + k, f"127.{1 + k // 62500}.{(k // 250) % 250 + 1}.{k % 250 + 1}", closed)
                for k in range(n)]
        base = self.window(seconds)

        def add() -> None:
            r = self.refresh({"event": "add", "instances": recs})
            if r.status_code != 200:
                raise RuntimeError(f"the flood's refresh got {r.status_code}: {r.text[:300]}")

        def absorbed(info: dict) -> bool:  # every added instance polled once
            return not any(i["id"] >= 10000 and i.get("last_poll_ms_ago", 0) is None for i in info["instances"])
        during = self.window(seconds, absorbed, add)
        routed = sum(1 for ln in self.coord.request_lines()[-len(during["lat"]):] if "-> instance 0(" not in ln)
        r = self.refresh({"event": "del", "instances": recs})
        if r.status_code != 200:
            raise RuntimeError(f"deleting the flood got {r.status_code}: {r.text[:300]}")
        return (f"{n} instances at a closed port (pollIntervalMs 1000): the refresh answered in {during['took']:.2f} s, "
                f"all polled once within {during['seconds']:.0f} s. User requests, {base['seconds']:.0f} s without: "
                f"{self._said(base)}; {during['seconds']:.0f} s from the refresh on: {self._said(during)}; "
                f"{routed} to a flood instance")

    def hostile(self) -> str:
        port, c = self.server.port, self.coord
        good = _rec(7, "127.0.0.1", port)
        cases: list[dict] = [
            {"ids": [0, 7], "instances": [_rec(7, "127.0.0.1\r\nX-Injected: 1", 40000)]},
            {"instances": [_rec(7, "127.0.0.1 evil", 40000)]},
            {"instances": [_rec(7, "0.0.0.0", 40000)]},
            {"instances": [_rec(7, "a" * 300, 40000)]},
            {"instances": [{**good, "static_info": {"total_slots_num": "abc"}}]},
            {"instances": [{**good, "static_info": {"total_block_num": -1}}]},
            {"instances": [{**good, "dynamic_info": {"avail_slots_num": 1e30}}]},
            {"instances": [{**good, "port": "70000"}]},
            {"instances": [{**good, "port": "http"}]},
            {"instances": [{**good, "id": -1}]},
            {"instances": [{**good, "model_name": 5}]},
            {"instances": [{"id": 7, "ip": "127.0.0.1", "port": "40000"}]},
            {"event": "drop", "instances": [good]},
            {"ids": "all", "instances": [good]},
            {"event": "add", "instances": [good, {**good, "port": "40002"}]},
            {"event": "add", "instances": [_rec(8, "127.0.0.1", port)]},
            {"event": "add", "instances": [_rec(9, "127.0.0.1", c.predict_port)]},
            {"event": "add", "instances": [_rec(9, "localhost", c.manage_port)]},
            {"event": "add", "instances": [_rec(20000 + k, f"127.0.8.{k % 250 + 1}", 40000 + k // 250)
                                           for k in range(self.max_res + 1)]},
        ]
        before = sorted(i["id"] for i in self.info()["instances"])
        got: dict[int, int] = {}
        named = 0
        for body in cases:
            r = self.refresh(body)
            got[r.status_code] = got.get(r.status_code, 0) + 1
            if r.status_code == 400:
                msg = r.json().get("error", "")
                named += ":" in msg or "max_res_num" in msg
        for raw in (b"{", b"[]", b"{" + b" " * (11 << 20) + b"}"):
            r = httpx.post(c.manage + "/v1/instances/refresh", content=raw, timeout=60)
            got[r.status_code] = got.get(r.status_code, 0) + 1
        after = sorted(i["id"] for i in self.info()["instances"])
        try:
            self.request()
            serving = "serving"
        except (httpx.HTTPError, RuntimeError) as e:
            serving = f"a request then: {e}"[:120]
        total = len(cases) + 3
        return (f"{total} bodies: " + ", ".join(f"{n}x {s}" for s, n in sorted(got.items()))
                + f"; {named} of {len(cases)} field errors name the field (or max_res_num); stored: "
                  f"{'nothing' if after == before else 'ids ' + str(after)}; the real instance's poll "
                  f"{self.poll_age()} after them; {serving}")

    def decoy(self, requests: int = 20) -> str:
        from tests.harness import free_port
        root = Path(tempfile.mkdtemp(prefix="decoy"))
        (root / "health").write_text("ok")
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                                 "--directory", str(root)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(300):
                try:
                    httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except httpx.HTTPError:
                    time.sleep(0.05)
            t0 = time.monotonic()
            r = self.refresh({"event": "add", "instances": [_rec(50, "127.0.0.1", port, model_name="demo")]})
            if r.status_code != 200:
                raise RuntimeError(f"the decoy's refresh got {r.status_code}: {r.text[:200]}")
            state, why = "", ""
            while time.monotonic() - t0 < 60:
                me = next(i for i in self.info()["instances"] if i["id"] == 50)
                state, why = me["state"], me["why_not_ready"]
                if state == "refused":
                    break
                time.sleep(0.05)
            took = time.monotonic() - t0
            failed = 0
            for _ in range(requests):
                try:
                    self.request()
                except RuntimeError:  # (before issue 52: the decoy's HTML 501 page)
                    failed += 1
            to_decoy = sum(1 for ln in self.coord.request_lines()[-requests:] if "-> instance 50(" in ln)
            self.refresh({"event": "del", "instances": [_rec(50, "127.0.0.1", port)]})
        finally:
            proc.kill()
            proc.wait(10)
        return (f"http.server answering /health 200: {state} after {took:.2f} s ({why.split(' (')[0]}); "
                f"{to_decoy} of {requests} requests went to it, {failed} failed")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drills", default="flood,hostile,decoy", help="comma-separated: flood, hostile, decoy")
    ap.add_argument("--flood", type=int, default=5000, help="instances the flood adds (at most 9999)")
    ap.add_argument("--seconds", type=float, default=25.0,
                    help="the flood's two windows (without it, then from the refresh on): at least this long each")
    args = ap.parse_args(argv)
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    from tests.coord_harness import Coordinator, start_instances
    tmp = Path(tempfile.mkdtemp(prefix="coorddrill"))
    servers = start_instances(tmp, 1)
    max_res = min(10000, max(6000, args.flood + 1))
    coord = Coordinator(tmp, servers, name="drill", config={
        "http_config": {"pollIntervalMs": 1000}, "digs_scheduler_config": {"max_res_num": max_res}})
    rows: list[tuple[str, str]] = []
    try:
        coord.wait_ready_line(60)
        coord.wait_ready(60)
        d = Drills(coord, servers[0], max_res)
        run: dict[str, Callable[[], str]] = {"flood": lambda: d.flood(args.flood, args.seconds),
                                             "hostile": d.hostile, "decoy": d.decoy}
        for name in args.drills.split(","):
            rows.append((name, run[name.strip()]()))
            print(f"| {name} | {rows[-1][1]} |", flush=True)
    finally:
        coord.stop()
        for s in servers:
            s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
