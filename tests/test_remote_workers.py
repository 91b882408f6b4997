"""Device workers on another host (issue 15, item 4), on loopback: a workers-only launch
(`scripts/launch.sh --workers-only`: supervisor and workers, tcp + CURVE, no HTTP) and a
front-end launch (`--frontends-only`) with the same BackendConfig and keys made at test time.
Requests are served through both workers; killing the workers' launcher fails the requests in
flight within seconds and the front ends say no worker is ready."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.harness import (ROOT, InferStreams, Server, alive, descendants, free_port, plain_decode, short_run_dir,
                           write_config)
from tests.test_worker_curve import make_keys, port_pair

pytestmark = pytest.mark.timeout(300)


def _plane_port(worker_port: int, n: int) -> int:
    """A free port for a server's planes outside the worker links' ports worker_port .. + 2n - 1:
    those are free but not bound until the workers start, so a plain free_port() can return one
    of them, and then a worker cannot bind it (seen in CI: 'cannot bind ...: address already in
    use', one worker of two)."""
    while (port := free_port()) in range(worker_port, worker_port + 2 * n):
        pass
    return port


def _config(path, demo_model, keys, worker_port):
    port = _plane_port(worker_port, 2)
    # one token per step (plain_decode): the long stream must still run when the test kills the host
    write_config(path, port=port, run_dir=short_run_dir(), workers=2, model_path=demo_model, schedule=plain_decode())
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


def _start_workers_host(tmp_path, name, demo_model, keys, wport, host, hosts):
    """A workers-only launch bound to ``host`` (its own process group, so that it can be stopped whole)."""
    d = tmp_path / name
    d.mkdir()
    # one token per step (plain_decode): the streams must still run when a test stops a host
    write_config(d / "config.json", port=_plane_port(wport, 1), run_dir=short_run_dir(), workers=1,
                 model_path=demo_model, schedule=plain_decode())
    cfg = json.loads((d / "config.json").read_text())
    cfg["BackendConfig"].update(workerHost=host, workerHosts=hosts, workerPort=wport, workerCurveKeyDir=str(keys))
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    log = open(d / "workers.log", "wb")
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "launch.sh"), "--config", str(d / "config.json"),
                             "--workers-only"], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                            env={**os.environ, "PYTHON": sys.executable, "MINDIE_LOG_LEVEL": "INFO"})
    return proc, log


def _slots(url):
    try:
        return httpx.get(url + "/v1/status", timeout=10).json()["resource"]["availSlotsNum"]
    except httpx.HTTPError:
        return None


def test_front_ends_over_two_worker_hosts_survive_a_partition(tmp_path, demo_model):
    """workerHosts lists two worker hosts (127.0.0.1 and 127.0.0.2, same ports): the front ends
    use both. Stopping one host's whole process group (SIGSTOP: a partition, as the front ends see
    it) fails the streams it served within seconds while the other host's finish and new requests
    are served; when the host comes back (SIGCONT) the front ends use it again."""
    keys = make_keys(tmp_path / "curve")
    wport = port_pair(1)
    hosts = ["127.0.0.1", "127.0.0.2"]
    a, alog = _start_workers_host(tmp_path, "a", demo_model, keys, wport, hosts[0], hosts)
    b, blog = _start_workers_host(tmp_path, "b", demo_model, keys, wport, hosts[1], hosts)
    (tmp_path / "f").mkdir()
    fe_port = _plane_port(wport, 1)
    write_config(tmp_path / "f" / "config.json", port=fe_port, run_dir=short_run_dir(), workers=1,
                 model_path=demo_model)
    cfg = json.loads((tmp_path / "f" / "config.json").read_text())
    cfg["BackendConfig"].update(workerHosts=hosts, workerPort=wport, workerCurveKeyDir=str(keys))
    (tmp_path / "f" / "config.json").write_text(json.dumps(cfg, indent=2))
    fe = Server(tmp_path / "f" / "config.json", fe_port, args=["--frontends-only"])
    try:
        fe.wait_ready(120)
        deadline = time.monotonic() + 60
        while _slots(fe.url) != 2 * 64 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _slots(fe.url) == 2 * 64, fe.tail()
        idle = httpx.get(fe.url + "/v2/status", timeout=10).json()["resource"]["dpInstMap"]
        assert len(idle) == 2, idle

        streams = InferStreams(fe.url, 6, 400, lambda i: [5, 6 + i])
        streams.wait_started(timeout=30)
        busy = httpx.get(fe.url + "/v2/status", timeout=10).json()["resource"]["dpInstMap"]
        assert all(busy[k] < idle[k] for k in idle), (idle, busy)  # streams on both hosts
        # Every process of host b stops (its launcher, supervisor and worker: the whole host).
        bprocs = [b.pid, *descendants(b.pid)]
        t0 = time.monotonic()
        for p in bprocs:
            os.kill(p, signal.SIGSTOP)
        streams.join(90)
        failed, finished = streams.outcome()
        assert failed and finished, [len(ev) for ev in streams.events]
        assert max(failed) - t0 < 10, "the stopped host's streams did not fail within seconds"
        for i in range(4):  # host a serves on
            r = httpx.post(fe.url + "/infer", json={"input_id": [7, i], "parameters": {
                "max_new_tokens": 4, "ignore_eos": True, "details": True}}, timeout=60)
            assert r.status_code == 200 and r.json()["details"]["generated_tokens"] == 4, r.text
        # The free slots are the last heartbeat's: the request that just ended may still run in it.
        deadline = time.monotonic() + 10
        while _slots(fe.url) != 64 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _slots(fe.url) == 64
        for p in bprocs:
            os.kill(p, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while _slots(fe.url) != 2 * 64 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _slots(fe.url) == 2 * 64, "host b did not come back after SIGCONT"
    finally:
        for p in [b.pid, *descendants(b.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)
        for p in (a, b):
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        for p in (a, b):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        alog.close()
        blog.close()
        assert fe.stop() == 0, fe.tail()
