"""Helpers of the coordinator tests: server instances started by scripts/launch.sh and the real
coordinator process (``python -m coordinator``), all on loopback."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.harness import (ROOT, Server, alive, descendants, free_port, free_ports, plain_decode, short_run_dir,
                           write_config)

MOTOR = ROOT / "scripts" / "motor.sh"


def start_instances(tmp: Path, n: int = 2, args: list[str] | None = None, model_path: str | None = None,
                    **config) -> list[Server]:
    """``n`` one-worker demo-model instances (planes merged on one port), ready."""
    # The coordinator's tests hold long streams open (busy instances, drains, faults mid-stream):
    # one token a step (harness.plain_decode) unless the caller's schedule says otherwise.
    # ``per_instance``: each instance's own write_config arguments on top (a role, a key...).
    per_instance = config.pop("per_instance", None) or [{}] * n
    config["schedule"] = plain_decode(config.get("schedule"))
    servers = []
    for i, port in enumerate(free_ports(n)):
        d = tmp / f"inst{i}"
        d.mkdir(exist_ok=True)
        own = {**config, **per_instance[i]}
        cfg = write_config(d / "config.json", port=port, run_dir=short_run_dir(), workers=1,
                           model_path=model_path, **own)
        servers.append(Server(cfg, port, args=args))
    try:
        for s in servers:
            s.wait_ready(180)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


def motor_env() -> dict:
    """The environment scripts/motor.sh runs in here: none of the caller's MIES_/MINDIE_ settings."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MIES_", "MINDIE_"))}
    e["PYTHON"] = sys.executable
    return e


def consecutive_free_ports(n: int, avoid: tuple = ()) -> int:
    """The first of ``n`` consecutive ports free on loopback now (a fleet's instances take
    consecutive ports from ServerConfig.port)."""
    from mindie_bench.lab.fleet import _free_run
    from tests.harness import port_slice
    return _free_run(n, avoid, port_slice())


class MotorFleet:
    """``scripts/motor.sh --config ...`` in the background (a local fleet), its output in a file."""

    def __init__(self, tmp: Path, config: Path, *, run_dir: str | None = None, args: tuple = ("-w", "1"),
                 ready_timeout: int | None = None, env: dict | None = None, name: str = "motor") -> None:
        self.run_dir = run_dir or short_run_dir()
        self.log_path = tmp / f"{name}.log"
        self.log = open(self.log_path, "wb")
        cmd = ["bash", str(MOTOR), "--config", str(config), "--run-dir", self.run_dir]
        if ready_timeout:
            cmd += ["--ready-timeout", str(ready_timeout)]
        self.proc = subprocess.Popen([*cmd, "--", *args], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env or motor_env(), cwd="/")

    def out(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float) -> None:
        """Until ``text`` is in the output; fails if motor.sh exits or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while text not in self.out():
            assert self.proc.poll() is None, f"motor.sh exited with {self.proc.returncode}:\n{self.out()}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout} s:\n{self.out()}"
            time.sleep(0.1)

    def wait_ready(self, timeout: float = 200) -> str:
        """The ready line, once motor.sh printed it."""
        self.wait_for("mindie-motor ready:", timeout)
        return next(ln for ln in self.out().splitlines() if "mindie-motor ready:" in ln)

    def plan(self) -> dict:
        return json.loads((Path(self.run_dir) / "plan.json").read_text())

    def pids(self) -> list[int]:
        return [self.proc.pid, *descendants(self.proc.pid)]

    def cleanup(self, extra: list[int] | tuple = (), grace: float = 0) -> None:
        """The ``finally`` of a fleet test: SIGTERM first when ``grace`` (seconds to stop by itself),
        then SIGKILL whatever is left (its processes, and ``extra``: processes seen earlier that may
        have been reparented); closes the log."""
        if self.proc.poll() is None and grace:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        left = [*extra, *descendants(self.proc.pid)]
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in left:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if not self.log.closed:
            self.log.close()


def kill9(server: Server) -> None:
    """SIGKILL every process of an instance at once (a box that died)."""
    pids = [server.proc.pid, *descendants(server.proc.pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    server.proc.wait(10)


class Coordinator:
    """``python -m coordinator`` in the background, its log in a file."""

    def __init__(self, tmp: Path, instances: list[Server] | None = None, config: dict | None = None,
                 name: str = "coord", env: dict | None = None, ports: tuple[int, int] | None = None,
                 tls=None) -> None:
        """``tls``: the client's ssl.SSLContext when both listeners speak HTTPS."""
        self.predict_port, self.manage_port = ports or free_ports(2)
        instances = [{"id": i, "ip": "127.0.0.1", "business_port": s.port, "mgmt_port": s.port}
                     for i, s in enumerate(instances or [])]
        cfg = {"http_config": {"predict_ip": "127.0.0.1", "predict_port": self.predict_port,
                               "manage_ip": "127.0.0.1", "manage_port": self.manage_port, "pollIntervalMs": 200},
               "digs_scheduler_config": {"deploy_mode": "single_node"},
               "exception_config": {"max_retry": 2, "first_token_timeout": 30, "infer_timeout": 120},
               "instances": instances}
        for k, v in (config or {}).items():
            if isinstance(v, dict) and isinstance(cfg.get(k), dict):
                cfg[k] = {**cfg[k], **v}
            else:
                cfg[k] = v
        self.config = cfg
        self.path = tmp / f"{name}.json"
        self.path.write_text(json.dumps(cfg, indent=1))
        self.log_path = tmp / f"{name}.log"
        self.env = env
        scheme = "https" if tls else "http"
        self.tls = tls
        self.url = f"{scheme}://127.0.0.1:{self.predict_port}"
        self.manage = f"{scheme}://127.0.0.1:{self.manage_port}"
        self.start()

    def start(self) -> None:
        e = dict(os.environ)
        e.update(self.env or {})
        e["PYTHONPATH"] = str(ROOT)
        self.log = open(self.log_path, "ab")
        self.log_start = self.log.tell()  # this run's lines begin here (the file is kept across restarts)
        self.proc = subprocess.Popen([sys.executable, "-m", "coordinator", "--config", str(self.path)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=e, cwd=ROOT)

    def wait_ready_line(self, timeout: float = 30.0) -> str:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            for line in self._text().splitlines()[::-1]:
                if "mindie-coordinator ready:" in line:
                    return line
            if self.proc.poll() is not None:
                raise RuntimeError(f"coordinator exited with {self.proc.returncode}:\n{self.tail()}")
            time.sleep(0.05)
        raise TimeoutError(f"no ready line after {timeout} s:\n{self.tail()}")

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until /v1/readiness says 200."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"coordinator exited with {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.manage + "/v1/readiness", timeout=2, verify=self.tls or True).status_code == 200:
                    return
            time.sleep(0.05)
        raise TimeoutError(f"coordinator not ready after {timeout} s:\n{self.tail()}")

    def info(self) -> dict:
        return httpx.get(self.manage + "/v1/coordinator_info", timeout=10, verify=self.tls or True).json()

    def wait_state(self, iid: int, state: str, timeout: float = 30.0) -> None:
        t0 = time.monotonic()
        seen = None
        while time.monotonic() - t0 < timeout:
            for i in self.info()["instances"]:
                if i["id"] == iid:
                    seen = i["state"]
                    if seen == state:
                        return
            time.sleep(0.05)
        raise TimeoutError(f"instance {iid} is {seen}, not {state}, after {timeout} s:\n{self.tail()}")

    def _text(self) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(self.log_start)
            return f.read().decode(errors="replace")

    def request_lines(self) -> list[str]:
        return [ln for ln in self._text().splitlines() if "coordinator.request:" in ln]

    def wait_request_lines(self, n: int, timeout: float = 15.0) -> list[str]:
        """The request log once it holds at least n lines: the coordinator writes a request's line
        after the client has its last byte, so a test reading it straight after a reply can be early."""
        t0 = time.monotonic()
        while len(lines := self.request_lines()) < n and time.monotonic() - t0 < timeout:
            time.sleep(0.05)
        return lines

    def settled_request_lines(self, timeout: float = 15.0) -> list[str]:
        """The request log once every request the coordinator has received has its line (the
        coordinator counts a request when it arrives and logs it after the client's last byte): a
        count taken from it is not short by an earlier request's late line. Only with no request
        in flight."""
        text = httpx.get(self.manage + "/metrics", timeout=10, verify=self.tls or True).text
        m = re.search(r"^coordinator_request_received_total (\S+)$", text, re.M)
        assert m, text[-2000:]
        n = int(float(m.group(1)))
        lines = self.wait_request_lines(n, timeout)
        assert len(lines) == n, (n, lines[-5:], self.tail())
        return lines

    def tail(self, n: int = 60) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self.log.close()
