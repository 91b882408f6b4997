"""What an operator sees of scripts/launch.sh (issue 27): ports that move together, reload however
the server was started, one ready line, a quiet stop. Each test starts the real launch script."""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import time

import httpx
import pytest

from mindie.config import load_config
from mindie.runtime.lifecycle import leftovers
from tests.harness import ROOT, Server, alive, descendants, free_port, port_slice, process_roles, short_run_dir, write_config

LAUNCH = ROOT / "scripts" / "launch.sh"


def free_triple() -> int:
    """A base port P with P, P+1 and P+2 free on 127.0.0.1 and 127.0.0.2, from this test process's
    own slice (harness.port_slice): a port of the kernel's ephemeral range, free when chosen, could
    be an outgoing connection's source port by the time the server binds it (seen in CI: "already
    in use" at 57646), and another xdist worker's slice is that worker's to hand out."""
    ports = port_slice()
    for _ in range(200):
        base = random.randrange(ports.start, ports.stop - 3)
        try:
            with contextlib.ExitStack() as st:
                for host in ("127.0.0.1", "127.0.0.2"):
                    for p in range(base, base + 3):
                        s = st.enter_context(socket.socket())
                        s.bind((host, p))
            return base
        except OSError:
            continue
    raise RuntimeError("no three free ports in a row")


# -- ports ------------------------------------------------------------------------------------------
def test_help_lists_the_port_flags_and_their_variables():
    out = subprocess.run(["bash", str(LAUNCH), "--help"], capture_output=True, text=True, check=True).stdout
    for flag, var in (("-p, --port", "MINDIE_PORT"), ("--management-port", "MINDIE_MANAGEMENT_PORT"),
                      ("--metrics-port", "MINDIE_METRICS_PORT"), ("--drain-timeout", "MINDIE_GRACEFUL_TIMEOUT")):
        line = next((ln for ln in out.splitlines() if flag in ln), "")
        assert var in line, (flag, line)
    assert "offset" in out  # -p says how it moves the other planes


@pytest.mark.parametrize("file,env,want", [
    ({}, {"MINDIE_PORT": "18025"}, (18025, 18026, 18027)),  # MindIE's defaults, moved together
    ({"managementPort": 2000, "metricsPort": 2000, "port": 2000}, {"MINDIE_PORT": "3000"}, (3000, 3000, 3000)),
    ({"port": 2000, "managementPort": 2010, "metricsPort": 1990}, {"MINDIE_PORT": "5000"}, (5000, 5010, 4990)),
    ({}, {"MINDIE_PORT": "18025", "MINDIE_METRICS_PORT": "9100"}, (18025, 18026, 9100)),
    ({}, {"MINDIE_MANAGEMENT_PORT": "7001"}, (1025, 7001, 1027)),
])
def test_the_port_moves_every_plane_keeping_offsets(tmp_path, file, env, want):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"ServerConfig": file}))
    s = load_config(str(p), env=env).config.server
    assert (s.port, s.management_port, s.metrics_port) == want


def test_a_moved_plane_out_of_range_names_the_key_and_the_variable():
    from mindie.config import ConfigError
    with pytest.raises(ConfigError) as e:
        load_config(None, env={"MINDIE_PORT": "65534"})  # metrics would be 65536
    assert str(e.value) == "ServerConfig.metricsPort: must be <= 65535, got 65536 (from environment variable MINDIE_PORT)"


def test_two_servers_started_with_only_p_run_side_by_side(tmp_path):
    """The README's case: no config file, two servers, only -p differs. Both serve the demo model
    (--demo-model, the same flag for both): what lets them run side by side is the planes and the
    per-port run directories -p moves, not the model, and the default model's start without a
    config file (ten times the demo model's load) is tests/test_step_width.py's."""
    a, b = free_triple(), None
    while b is None or abs(b - a) < 3:
        b = free_triple()
    servers = [Server(None, base, frontends=1, args=["-p", str(base), "--demo-model"], env={"MINDIE_RUN_DIR": ""},
                      health_url=f"http://127.0.0.2:{base + 1}/health") for base in (a, b)]
    try:
        for s in servers:
            s.wait_ready(180)
        for s, base in zip(servers, (a, b)):
            r = httpx.post(f"http://127.0.0.1:{base}/infer_token",
                           json={"input_id": [1, 2], "parameters": {"max_new_tokens": 2}}, timeout=30)
            assert r.status_code == 200, r.text
            assert httpx.get(f"http://127.0.0.2:{base + 2}/metrics", timeout=10).status_code == 200
            assert f"management http://127.0.0.2:{base + 1}" in s.tail(400)
    finally:
        codes = [s.stop() for s in servers]
    assert codes == [0, 0], [s.tail() for s in servers]


@pytest.mark.parametrize("how", ["config", "flag"])
def test_paths_relative_to_the_callers_directory(tmp_path, demo_model, how):
    """launch.sh started from another directory with relative paths: ``--config c.json`` whose
    modelWeightPath is relative (to the config file's directory), or ``-m model``. Every process
    starts in the checkout, so the paths must mean the same there: the server serves."""
    base = free_triple()
    (tmp_path / "model").symlink_to(demo_model)
    write_config(tmp_path / "c.json", port=base, run_dir=short_run_dir(), workers=1,
                 model_path="model" if how == "config" else "/nonexistent/model")
    args = ["--config", "c.json"] + (["-m", "model"] if how == "flag" else [])
    srv = Server(None, base, args=args, cwd=tmp_path)
    try:
        srv.wait_ready(120)
        r = httpx.post(srv.url + "/infer_token", json={"input_id": [5, 6, 7], "parameters": {"max_new_tokens": 3}},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert isinstance(r.json()["generated_text"], str), r.text
    finally:
        code = srv.stop()
    assert code == 0, srv.tail(3000)


# -- reload -----------------------------------------------------------------------------------------
def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.parametrize("how", ["nohup", "setsid", "pid1"])
def test_sighup_reloads_the_front_ends_however_the_server_was_started(tmp_path, demo_model, how):
    """nohup starts the launcher with SIGHUP ignored (bash cannot trap it then), setsid in a session
    of its own (as systemd does), unshare --pid as PID 1 of a PID namespace (a container)."""
    if how == "pid1" and not _unshare_works():
        pytest.skip("unshare --pid is refused here (needs CAP_SYS_ADMIN): no PID namespace to start in")
    wrap = {"nohup": ["nohup"], "setsid": ["setsid"], "pid1": ["unshare", "--pid", "--fork", "--mount-proc"]}[how]
    port = free_port()
    cfg = write_config(tmp_path / "config.json", port=port, run_dir=short_run_dir(), workers=1,
                       model_path=demo_model)
    srv = Server(cfg, port, frontends=1, wrap=wrap)
    try:
        srv.wait_ready(120)
        launcher = srv.launcher_pid()
        before = {p for p, r in process_roles(launcher).items() if r == "frontend"}
        workers = {p for p, r in process_roles(launcher).items() if r == "worker"}
        assert before and workers
        os.kill(launcher, signal.SIGHUP)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = {p for p, r in process_roles(launcher).items() if r == "frontend"}
            if now and not now & before:
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"the front ends were not replaced:\n{srv.tail()}")
        assert {p for p, r in process_roles(launcher).items() if r == "worker"} == workers  # models stay
        srv.wait_ready(30)
        r = httpx.post(srv.url + "/infer_token", json={"input_id": [1], "parameters": {"max_new_tokens": 2}},
                       timeout=30)
        assert r.status_code == 200
        log = srv.tail(2000)
        assert "SIGHUP: reloading the front ends" in log and "reload is unavailable" not in log
        os.kill(launcher, signal.SIGTERM)
        srv.proc.wait(60)
        assert srv.proc.returncode == 0, srv.tail()
    finally:
        srv.stop()


# -- output -----------------------------------------------------------------------------------------
def test_probes_say_starting_then_one_ready_line_and_a_quiet_stop(tmp_path, demo_model):
    """Two workers, two front ends. One worker ready, the other still loading (held here with
    SIGSTOP): the probes answer 503 "starting" (an orchestrator must not count the server up at
    half its capacity), requests are served by the ready worker meanwhile, and no ready line is
    logged. Once the other worker is ready, the probes answer 200 and the ready line comes once,
    after both workers said ready, with every plane's URL and "2 of 2"; gunicorn's listen lines
    name the business plane; a clean stop logs no error and leaves nothing. (One start for what
    were test_probes_say_starting_until_every_worker_is_ready and test_one_ready_line_and_a_quiet_stop.)"""
    import re
    base = free_triple()
    run_dir = short_run_dir()
    cfg = write_config(tmp_path / "config.json", port=base, run_dir=run_dir, workers=2,
                       model_path=demo_model,
                       server={"managementPort": base + 1, "metricsPort": base + 2, "managementIpAddress": "127.0.0.1"})
    srv = Server(cfg, base, frontends=2, health_url=f"http://127.0.0.1:{base + 1}/health")
    mgmt = f"http://127.0.0.1:{base + 1}"
    held = None
    try:
        deadline = time.monotonic() + 60
        while (m := re.search(r"started worker w1 \(pid (\d+)", srv.tail(100000))) is None:
            assert time.monotonic() < deadline and srv.proc.poll() is None, srv.tail(3000)
            time.sleep(0.01)
        held = int(m.group(1))
        os.kill(held, signal.SIGSTOP)

        def seen_by_both(worker: str) -> bool:
            # Each front end logs "device worker wN ready" once it knows (its own link to the
            # worker): until both did, the one that answers may not know yet.
            return len(set(re.findall(rf"\[frontend pid (\d+)\] \S+: device worker {worker} ready$",
                                      srv.tail(100000), re.M))) == 2

        while not seen_by_both("w0"):
            assert time.monotonic() < deadline and srv.proc.poll() is None, srv.tail(3000)
            time.sleep(0.1)
        assert "device worker w1 ready" not in srv.tail(100000), "w1 was ready before it could be held"
        for path in ("/health", "/v2/health/ready", "/v2/health/live", "/health/timed-5"):
            assert httpx.get(mgmt + path, timeout=10).status_code == 503, f"{path}: not 503 with w1 still loading"
        r = httpx.post(srv.url + "/infer_token", json={"input_id": [5, 6, 7], "stream": False,
                                                       "parameters": {"max_new_tokens": 4}}, timeout=60)
        assert r.status_code == 200, f"not served by the ready worker while the other loads: {r.text}"
        assert "mindie-py ready:" not in srv.tail(100000), "a ready line with one of two workers ready"
        os.kill(held, signal.SIGCONT)
        held = None
        deadline = time.monotonic() + 60
        while not seen_by_both("w1"):
            assert time.monotonic() < deadline and srv.proc.poll() is None, srv.tail(3000)
            time.sleep(0.1)
        srv.wait_ready(60)
        for path in ("/health", "/v2/health/ready", "/v2/health/live"):
            assert httpx.get(mgmt + path, timeout=10).status_code == 200, f"{path}: not 200 with both workers ready"
        deadline = time.monotonic() + 30
        while "mindie-py ready:" not in srv.tail(100000) and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = descendants(srv.proc.pid)
    finally:
        if held is not None:
            os.kill(held, signal.SIGCONT)
        code = srv.stop()
    log = srv.log_path.read_text()
    ready = [ln for ln in log.splitlines() if "mindie-py ready:" in ln]
    assert len(ready) == 1, f"not one ready line: {ready}"
    line = ready[0]
    for want in (f"business http://127.0.0.1:{base}", f"management http://127.0.0.1:{base + 1}",
                 f"metrics http://127.0.0.1:{base + 2}", "model demo", "2 of 2 device workers ready", "2 front ends"):
        assert want in line, (want, line)
    # after both workers said ready
    assert log.index(line) > max(log.index("worker w0 ready"), log.index("worker w1 ready")), "ready line too early"
    listen = [ln for ln in log.splitlines() if "Listening at:" in ln]
    assert listen and all(f"http://127.0.0.1:{base}" in ln for ln in listen), listen
    assert code == 0, log[-3000:]
    for noise in ("Error while closing socket", "Traceback", "[ERROR]", " ERROR "):
        assert noise not in log, (noise, log[-3000:])
    assert not [p for p in pids if alive(p)], "a process outlived the stop"
    assert leftovers(run_dir) == []
