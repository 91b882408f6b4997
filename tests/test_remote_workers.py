"""Device workers on another host (issue 15, item 4), on loopback: a workers-only launch
(`scripts/launch.sh --workers-only`: supervisor and workers, tcp + CURVE, no HTTP) and a
front-end launch (`--frontends-only`) with the same BackendConfig and keys made at test time.
Requests are served through both workers; killing the workers' launcher fails the requests in
flight within seconds and the front ends say no worker is ready."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.harness import ROOT, Server, alive, descendants, free_port, short_run_dir, write_config
from tests.test_worker_curve import make_keys, port_pair

pytestmark = pytest.mark.timeout(300)


def _config(path, demo_model, keys, worker_port):
    port = free_port()
    write_config(path, port=port, run_dir=short_run_dir(), workers=2, model_path=demo_model)
    cfg = json.loads(path.read_text())
    cfg["BackendConfig"].update(workerHost="127.0.0.1", workerPort=worker_port, workerCurveKeyDir=str(keys))
    path.write_text(json.dumps(cfg, indent=2))
    return port


def test_front_ends_and_workers_on_two_hosts(tmp_path, demo_model):
    keys = make_keys(tmp_path / "curve")
    wport = port_pair(2)
    (tmp_path / "w").mkdir()
    (tmp_path / "f").mkdir()
    _config(tmp_path / "w" / "config.json", demo_model, keys, wport)
    fe_port = _config(tmp_path / "f" / "config.json", demo_model, keys, wport)
    env = {**os.environ, "PYTHON": sys.executable, "MINDIE_LOG_LEVEL": "INFO"}
    wlog = open(tmp_path / "workers.log", "wb")
    workers = subprocess.Popen(["bash", str(ROOT / "scripts" / "launch.sh"), "--config",
                                str(tmp_path / "w" / "config.json"), "--workers-only"],
                               stdout=wlog, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    fe = Server(tmp_path / "f" / "config.json", fe_port, args=["--frontends-only"])
    try:
        fe.wait_ready(120)
        # The workers host runs no HTTP and no gunicorn; the front-end host no device worker.
        assert fe.workers() == []
        wkids = descendants(workers.pid)
        cmdlines = [open(f"/proc/{p}/cmdline", "rb").read() for p in wkids if alive(p)]
        assert sum(b"workers.worker" in c for c in cmdlines) == 2 and not any(b"gunicorn" in c for c in cmdlines)
        # /health is 200 once one worker is ready; wait for both (each offers 64 slots).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            st = httpx.get(fe.url + "/v1/status", timeout=10).json()["resource"]
            if st["availSlotsNum"] == 2 * 64:
                break
            time.sleep(0.1)
        assert st["availSlotsNum"] == 2 * 64, st

        def one(i):
            r = httpx.post(fe.url + "/infer", json={"input_id": [5, 6, 7 + i], "parameters": {
                "max_new_tokens": 8, "ignore_eos": True, "details": True}}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["details"]["generated_tokens"] == 8

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        wlog.flush()
        served = (tmp_path / "workers.log").read_text(errors="replace")
        assert "CURVE" in served, served[-2000:]

        # A long stream, then the worker host's launcher is killed (-9): its processes follow it.
        frames: list[bytes] = []
        ended: list[float] = []

        def stream():
            with httpx.stream("POST", fe.url + "/infer", json={"input_id": [5, 6], "stream": True, "parameters": {
                    "max_new_tokens": 2000, "ignore_eos": True}}, timeout=60) as r:
                for chunk in r.iter_bytes():
                    frames.append(chunk)
            ended.append(time.monotonic())

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 30
        while len(frames) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert frames, "the stream did not start"
        t0 = time.monotonic()
        os.kill(workers.pid, signal.SIGKILL)
        t.join(30)
        assert ended and ended[0] - t0 < 10, "the stream did not end within seconds"
        last = b"".join(frames).strip().split(b"\n\n")[-1]
        assert b'"error"' in last, last[-300:]
        r = httpx.post(fe.url + "/infer", json={"input_id": [5], "parameters": {"max_new_tokens": 2}}, timeout=30)
        assert r.status_code == 503, r.text
        assert httpx.get(fe.url + "/health", timeout=10).status_code == 503
        deadline = time.monotonic() + 15
        while any(alive(p) for p in wkids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in wkids if alive(p)], "worker-host processes outlived their launcher"
    finally:
        if workers.poll() is None:
            workers.kill()
        workers.wait(30)
        wlog.close()
        assert fe.stop() == 0, fe.tail()


def test_split_roles_need_tcp(tmp_path, demo_model):
    """--workers-only / --frontends-only without workerHost: refused at start, naming the key."""
    port = free_port()
    cfg = write_config(tmp_path / "config.json", port=port, run_dir=short_run_dir(), workers=1, model_path=demo_model)
    for flag in ("--workers-only", "--frontends-only"):
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "launch.sh"), "--config", str(cfg), flag],
                              capture_output=True, text=True, timeout=120, cwd=ROOT,
                              env={**os.environ, "PYTHON": sys.executable})
        assert proc.returncode == 2, (flag, proc.stderr[-2000:])
        assert "BackendConfig.workerHost" in proc.stderr, proc.stderr[-2000:]
