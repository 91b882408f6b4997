#!/usr/bin/env python3
"""Fault drills against the real launcher (scripts/launch.sh), under load, one table line each.

    python -m mindie_bench.lab.chaos                              # every drill: 2 device workers, 2 front ends
    python -m mindie_bench.lab.chaos --drills worker,master --clients 16 --tokens 400

Each drill runs against a server under load (--clients clients, each sending one streamed
/infer_token request after another, --tokens tokens each), injects its fault and watches:

  fault          what was done (kill -9 of a process kind, both at once, a second server, SIGTERM)
  in flight      client requests in progress at that moment
  failed         how many of those did not end normally
  client errors  what the clients saw, by kind: for the requests in flight, and for those sent
                 after the fault until recovery ("later"; a client whose request fails sends the
                 next one 0.1 s later, so these count attempts): "500 Incomplete Generation"
                 (error frame or body), "dropped" (connection closed mid-response), "refused"
                 (nothing listening), "503 Service Unavailable" (no device worker ready), ...
  down s         fatal faults: seconds until every process of the server had exited
  recover s      seconds from the fault until a request succeeds again; after a fatal fault the
                 launcher is started again on the same run directory, as a process manager would
  left           processes of the server that should have exited and had not, 20 s after the fault
  RSS MiB        resident memory of the whole server after recovery (after a stop: 0)
  launcher       the launcher's exit status and what it said; for restarts, what the new start
                 removed from the run directory; for a stop, what was left in it

Kills that the server survives (a device worker, a front end) must recover on their own; the
others must take the whole server down within seconds, leaving no process.

Prefill/decode drills (``--drills pd-prefill,pd-decode``; issue 32): a ``pd_separate`` fleet
started by ``scripts/motor.sh`` (one prefill and one decode instance behind the coordinator),
the load sent to the coordinator with longer prompts (``--pd-prompt`` ids, so a fault lands
during prefill and KV transfer), and ``kill -9`` of every process of the prefill instance
(``pd-prefill``: requests not yet at their first token are retried, here on the decode instance
alone) or of the decode instance (``pd-decode``: streams end with an error frame). The killed
instance is started again from its derived config, as a process manager would; "recover s" is
until a request through the coordinator succeeds with both instances ready again, "left" the
killed instance's processes still alive 20 s after the fault; no client may hang (client
timeout 60 s, ``exception_config`` bounds the coordinator's waits).

Also ``mindie-bench chaos ...`` (mindie_bench/lab/__init__.py lists the lab's commands).

Public entry points for the server (``scripts/launch.sh``, HTTP, signals); it reads process trees
with tests/harness.py and checks the run directory with ``mindie.runtime.lifecycle.leftovers``
(the launcher's own list of what a stop must leave), so it needs a source checkout.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from mindie.runtime.lifecycle import leftovers  # noqa: E402
from tests.harness import alive, free_port, process_roles as roles, rss_mib  # noqa: E402

DRILLS = ["worker", "frontend", "supervisor", "master", "supervisor+master", "launcher", "launcher+master",
          "second-server", "sigterm"]
PD_DRILLS = ["pd-prefill", "pd-decode"]  # a pd_separate fleet (PdChaos), not in the default list
FATAL = {"supervisor", "master", "supervisor+master", "launcher", "launcher+master"}


# -- the server -----------------------------------------------------------------------------------
class Server:
    def __init__(self, work: Path, port: int, run_dir: str, workers: int, frontends: int, tag: str):
        self.url = f"http://127.0.0.1:{port}"
        self.run_dir = run_dir
        cfg = {
            "ServerConfig": {"ipAddress": "127.0.0.1", "port": port, "managementPort": port, "metricsPort": port, "httpsEnabled": False, "runDir": run_dir},
            "BackendConfig": {
                "npuDeviceIds": [[i] for i in range(workers)], "deviceType": "cpu", "cpuThreadsPerWorker": 1,
                "ModelDeployConfig": {"maxSeqLen": 2560, "maxInputTokenLen": 2048, "ModelConfig": [
                    {"modelName": "demo", "modelWeightPath": os.environ.get("MINDIE_MODEL_PATH", ""),
                     "cpuMemSize": 1, "dtype": "float32"}]},
                "ScheduleConfig": {"cacheBlockSize": 16, "maxBatchSize": 64, "maxIterTimes": 2048},
            },
        }
        (work / "config.json").write_text(json.dumps(cfg))
        self.log_path = work / f"server-{tag}.log"
        self.log = open(self.log_path, "wb")
        env = dict(os.environ, PYTHON=sys.executable, MINDIE_LOG_LEVEL="INFO")
        self.proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "launch.sh"), "--config", str(work / "config.json"),
                                      "--frontends", str(frontends)], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, cwd=ROOT)

    def wait_ready(self, timeout: float = 120) -> None:
        t0 = time.monotonic()
        while not probe(self.url):
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.said()}")
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(self.said())
            time.sleep(0.1)

    def said(self, prefix: str = "launch.sh:") -> str:
        if not self.log.closed:
            self.log.flush()
        return "\n".join(line for line in self.log_path.read_text(errors="replace").splitlines()
                         if line.startswith(prefix) or prefix == "")

    def roles(self) -> dict[int, str]:
        return roles(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def probe(url: str) -> bool:
    try:
        return httpx.post(url + "/infer_token", json={"input_id": [1, 2], "parameters": {"max_new_tokens": 2}},
                          timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


# -- the load -------------------------------------------------------------------------------------
@dataclass
class Req:
    start: float
    end: float = 0.0
    outcome: str = ""  # "ok" or the kind of error the client saw


@dataclass
class Load:
    url: str
    clients: int
    tokens: int
    reqs: list[Req] = field(default_factory=list)
    stopping: bool = False
    prompt: int = 8  # input ids per request

    def start(self) -> None:
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping = True
        self.thread.join(120)

    def in_flight(self, t: float) -> int:
        return sum(1 for r in list(self.reqs) if r.start <= t and (not r.end or r.end > t))

    async def _main(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(60, connect=5),
                                     limits=httpx.Limits(max_connections=self.clients * 2)) as client:
            await asyncio.gather(*(self._client(client, i) for i in range(self.clients)))

    async def _client(self, client: httpx.AsyncClient, i: int) -> None:
        n = 0
        while not self.stopping:
            n += 1
            body = {"input_id": [(i * 97 + n * 13 + j) % 30000 + 3 for j in range(self.prompt)], "stream": True,
                    "parameters": {"max_new_tokens": self.tokens, "ignore_eos": True}}
            req = Req(time.monotonic())
            self.reqs.append(req)
            req.outcome = await self._one(client, body)
            req.end = time.monotonic()
            if req.outcome != "ok":
                await asyncio.sleep(0.1)

    @staticmethod
    async def _one(client: httpx.AsyncClient, body: dict) -> str:
        try:
            async with client.stream("POST", "/infer_token", content=json.dumps(body)) as r:
                raw = await r.aread()
                if r.status_code != 200:
                    try:
                        return f"{r.status_code} {json.loads(raw).get('error_type', '')}".strip()
                    except ValueError:
                        return f"{r.status_code}"
        except httpx.ConnectError:
            return "refused"
        except (httpx.RemoteProtocolError, httpx.ReadError):
            return "dropped"
        except httpx.TimeoutException:
            return "client timeout"
        frames = re.findall(rb"data: (\{.*?\})\n\n", raw, re.S)
        if not frames:
            return "empty stream"
        last = json.loads(frames[-1])
        if "error" in last:
            return f"500 {last.get('error_type', '')}"
        if "generated_text" not in last:
            return "timeout text" if b"timeout" in raw[-200:] else "truncated stream"
        return "ok"


# -- drills ---------------------------------------------------------------------------------------
@dataclass
class Row:
    fault: str
    in_flight: int = 0
    failed: int = 0
    errors: str = "-"
    down: str = "-"
    recover: str = "-"
    left: str = "0"
    rss: str = "-"
    launcher: str = ""


class Chaos:
    def __init__(self, args):
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="chaos-"))
        self.port = free_port()
        self.run_dir = tempfile.mkdtemp(prefix="mc", dir="/tmp")
        os.chmod(self.run_dir, 0o700)
        self.starts = 0
        self.server: Server | None = None

    def start(self, tag: str | None = None) -> Server:
        self.starts += 1
        work = self.work / f"s{self.starts}"
        work.mkdir()
        return Server(work, self.port, self.run_dir, self.args.workers, self.args.frontends, tag or str(self.starts))

    def ensure(self) -> Server:
        if self.server is None or self.server.proc.poll() is not None:
            self.server = self.start()
            self.server.wait_ready()
        return self.server

    def run(self, name: str) -> Row:
        srv = self.ensure()
        load = Load(srv.url, self.args.clients, self.args.tokens)
        load.start()
        time.sleep(self.args.warmup)
        row = Row(name)
        procs = srv.roles()
        everything = [srv.proc.pid, *procs]
        pid_of: dict[str, list[int]] = {}
        for p, r in procs.items():
            pid_of.setdefault(r, []).append(p)
        pid_of["launcher"] = [srv.proc.pid]
        t0 = time.monotonic()
        row.in_flight = load.in_flight(t0)
        if row.in_flight == 0:
            print(f"chaos: nothing in flight at the fault (too few --clients or --tokens?)", file=sys.stderr)
        t_recover = None
        if name in FATAL:
            row.fault = f"kill -9 {name}"
            for role in name.split("+"):
                os.kill(pid_of[role][0], signal.SIGKILL)
            t_down = None
            while time.monotonic() - t0 < 20:
                if not any(alive(p) for p in everything):
                    t_down = time.monotonic()
                    break
                time.sleep(0.05)
            row.down = f"{t_down - t0:.1f}" if t_down else "> 20"
            row.left = str(sum(1 for p in everything if alive(p)))
            code = srv.proc.wait(30) if "launcher" not in name else srv.proc.wait(5)
            said = [line[len("launch.sh: "):] for line in srv.said().splitlines()
                    if "stopping the server" in line or " too" in line]
            row.launcher = f"exit {code}" + (f": {'; '.join(said)}" if said else "")
            srv.stop()
            stale = leftovers(self.run_dir)
            # Started again on the same run dir, as a process manager would.
            self.server = srv = self.start()
            while not probe(srv.url):
                if srv.proc.poll() is not None:
                    raise RuntimeError(srv.said(""))
                time.sleep(0.05)
            t_recover = time.monotonic()
            removed = re.findall(r"uncleanly left in \S+: (.*)", srv.said(""))
            row.launcher += f"; restart removed {len(stale)} stale entries" if removed else \
                ("; nothing stale" if not stale else f"; {len(stale)} stale entries NOT removed")
        elif name in ("worker", "frontend"):
            row.fault = f"kill -9 {'device worker' if name == 'worker' else 'front end'}"
            victim = pid_of[name][0]
            os.kill(victim, signal.SIGKILL)
            want = sorted(procs.values())
            while True:
                now = srv.roles()
                if victim not in now and sorted(now.values()) == want and probe(srv.url):
                    t_recover = time.monotonic()
                    break
                if time.monotonic() - t0 > 120:
                    break
                time.sleep(0.05)
            row.left = str(int(alive(victim)))
            gunicorn_said = "respawned by gunicorn" if name == "frontend" else "restarted by the supervisor"
            row.launcher = f"running; {gunicorn_said}"
        elif name == "second-server":
            row.fault = "2nd server, same run dir"
            state = sorted(os.listdir(self.run_dir))
            second = self.start("second")
            code = second.proc.wait(60)
            second.stop()
            msg = second.said("cannot start:")
            row.launcher = f"2nd exit {code}: {msg[len('cannot start: '):].split(':')[0]}" if msg else f"2nd exit {code}"
            ok = sorted(os.listdir(self.run_dir)) == state and probe(srv.url) and srv.proc.poll() is None
            row.launcher += "; 1st untouched, serving" if ok else "; 1st DISTURBED"
            row.left = "0"
            t_recover = t0
        elif name == "sigterm":
            row.fault = "SIGTERM launcher (stop)"
            srv.proc.send_signal(signal.SIGTERM)
            code = srv.proc.wait(60)
            t_down = time.monotonic()
            row.down = f"{t_down - t0:.1f}"
            time.sleep(0.2)
            row.left = str(sum(1 for p in everything if alive(p)))
            srv.stop()
            left_files = leftovers(self.run_dir)
            row.launcher = f"exit {code}; run dir: " + (", ".join(left_files) if left_files else "nothing left")
        if t_recover is not None and name != "sigterm":
            row.recover = f"{t_recover - t0:.1f}"
        time.sleep(self.args.after)
        load.stop()
        reqs = list(load.reqs)
        in_flight = [r for r in reqs if r.start <= t0 < (r.end or float("inf"))]
        later = [r for r in reqs if t0 < r.start <= (t_recover or t0)]
        row.failed = sum(1 for r in in_flight if r.outcome != "ok")
        row.errors = f"in flight: {_kinds(in_flight)}" + (f"; later: {_kinds(later)}" if later else "")
        if name == "sigterm":
            row.rss = "0"
        else:
            row.rss = f"{rss_mib([srv.proc.pid, *srv.roles()]):.0f}"
        return row

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


class PdChaos:
    """The PD drills on a pd_separate fleet (scripts/motor.sh: 1 prefill + 1 decode instance)."""

    def __init__(self, args):
        from mindie_bench.lab.pd import PdFleet, server_config
        from workers.models.demo import ensure_demo_model
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="chaos-pd-"))
        self.fleet = PdFleet(self.work, server=server_config(str(ensure_demo_model()), 1, 64), launch_args=[])
        self.plan = self.fleet.wait_ready(300)
        self.restarted: list[subprocess.Popen] = []

    def _pids(self, name: str) -> list[int]:
        """launch.sh of instance ``name`` (i0, i1) and every process below it."""
        from tests.harness import descendants
        inst = next(i for i in self.plan["instances"] if i["name"] == name)
        out = []
        for pid in [self.fleet.proc.pid, *descendants(self.fleet.proc.pid)] + [p.pid for p in self.restarted]:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if inst["config"].encode() in cmd and b"launch.sh" in b" ".join(cmd):
                out += [pid, *descendants(pid)]
        return out

    def _states(self) -> dict:
        try:
            info = httpx.get(self.fleet.manage_url + "/v1/coordinator_info", timeout=5).json()
            return {i["role"]: i["state"] for i in info["instances"]}
        except (httpx.HTTPError, ValueError):
            return {}

    def run(self, name: str) -> Row:
        role = "prefill" if name == "pd-prefill" else "decode"
        inst = next(i for i in self.plan["instances"] if i["role"] == role)
        load = Load(self.fleet.url, self.args.clients, self.args.tokens, prompt=self.args.pd_prompt)
        load.start()
        time.sleep(self.args.warmup)
        row = Row(f"kill -9 {role} instance")
        victims = self._pids(inst["name"])
        t0 = time.monotonic()
        row.in_flight = load.in_flight(t0)
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        while time.monotonic() - t0 < 20 and any(alive(p) for p in victims):
            time.sleep(0.05)
        row.left = str(sum(1 for p in victims if alive(p)))
        row.down = f"{time.monotonic() - t0:.1f}"
        # started again from its derived config, as a process manager would
        log = open(self.work / f"{inst['name']}-restart.log", "ab")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MIES_", "MINDIE_"))}
        self.restarted.append(subprocess.Popen(["bash", str(ROOT / "scripts" / "launch.sh"), "--config",
                                                inst["config"]], stdout=log, stderr=subprocess.STDOUT, env=env))
        t_recover = None
        while time.monotonic() - t0 < 300:
            if self._states() == {"prefill": "ready", "decode": "ready"} and probe(self.fleet.url):
                t_recover = time.monotonic()
                break
            time.sleep(0.2)
        row.recover = f"{t_recover - t0:.1f}" if t_recover else "> 300"
        row.launcher = "restarted; coordinator: " + ", ".join(f"{k} {v}" for k, v in sorted(self._states().items()))
        time.sleep(self.args.after)
        load.stop()
        reqs = list(load.reqs)
        in_flight = [r for r in reqs if r.start <= t0 < (r.end or float("inf"))]
        later = [r for r in reqs if t0 < r.start <= (t_recover or t0)]
        row.failed = sum(1 for r in in_flight if r.outcome != "ok")
        row.errors = f"in flight: {_kinds(in_flight)}" + (f"; later: {_kinds(later)}" if later else "")
        hung = [r for r in in_flight if r.outcome == "client timeout"]
        if hung:
            row.errors += f" ({len(hung)} HUNG)"
        return row

    def close(self) -> None:
        for p in self.restarted:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        self.fleet.stop()
        for p in self.restarted:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(60)


def _kinds(reqs: list[Req]) -> str:
    kinds = Counter(r.outcome for r in reqs if r.outcome != "ok")
    return ", ".join(f"{n}x {k}" for k, n in kinds.most_common()) or "none"


def table(rows: list[Row]) -> str:
    head = ["fault", "in flight", "failed", "client errors", "down s", "recover s", "left", "RSS MiB", "launcher"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(x) for x in (r.fault, r.in_flight, r.failed, r.errors, r.down, r.recover,
                                                          r.left, r.rss, r.launcher)) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--drills", default=",".join(DRILLS), help=f"comma-separated, in order (default: {','.join(DRILLS)})")
    ap.add_argument("--workers", type=int, default=2, help="device workers (CPU)")
    ap.add_argument("--frontends", type=int, default=2)
    ap.add_argument("--clients", type=int, default=8, help="concurrent streaming clients")
    ap.add_argument("--tokens", type=int, default=200, help="max_new_tokens per request")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each fault")
    ap.add_argument("--after", type=float, default=1.0, help="seconds of load after recovery")
    ap.add_argument("--pd-prompt", type=int, default=300, help="PD drills: input ids per request")
    args = ap.parse_args(argv)
    drills = [d for d in args.drills.split(",") if d]
    unknown = set(drills) - set(DRILLS) - set(PD_DRILLS)
    if unknown:
        ap.error(f"unknown drills: {', '.join(sorted(unknown))}")
    if set(drills) & set(PD_DRILLS) and not set(drills) <= set(PD_DRILLS):
        ap.error("the PD drills (pd-prefill, pd-decode) run on a fleet of their own: give them alone")
    chaos = PdChaos(args) if set(drills) <= set(PD_DRILLS) else Chaos(args)
    rows: list[Row] = []
    failed = False
    t0 = time.monotonic()
    try:
        for name in drills:
            print(f"chaos: {name} ...", file=sys.stderr, flush=True)
            row = chaos.run(name)
            rows.append(row)
            print(table([row]).splitlines()[-1], file=sys.stderr, flush=True)
            failed |= row.left != "0" or (row.recover in ("-", "> 300") and name not in ("sigterm",)) \
                or "NOT" in row.launcher or "DISTURBED" in row.launcher or "HUNG" in row.errors
    finally:
        chaos.close()
    what = ("a pd_separate fleet (1 prefill + 1 decode instance, 1 CPU device worker each, demo model) behind "
            f"the coordinator, {args.pd_prompt}-id prompts" if isinstance(chaos, PdChaos)
            else f"{args.workers} device workers (CPU, demo model), {args.frontends} front ends")
    print(f"\n{what}, {args.clients} streaming clients x {args.tokens} tokens; {time.monotonic() - t0:.0f} s; "
          f"logs in {chaos.work}\n")
    print(table(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
