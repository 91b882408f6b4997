"""Worker links over tcp (BackendConfig.workerHost): CURVE with keys from
BackendConfig.workerCurveKeyDir, plain tcp only with workerInsecureTcp. Config checks, the
worker's and the client's own refusals, and real processes (supervisor + a null-model worker on
tcp://127.0.0.1) served, or not, depending on the front end's keys."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from mindie.device_client import DeviceClient, NoWorkerError
from mindie.config import ConfigError, load_config
from mindie.contract import wire as P
from mindie.runtime.curve import CurveKeyError, insecure_warning
from mindie.contract.spec import WorkerSpec, encode_spec
from mindie.topology import build_deployment
from tests.coord_harness import consecutive_free_ports
from tests.harness import ROOT, free_port, short_run_dir, write_config, write_plan

pytestmark = pytest.mark.timeout(120)

KEY = "BackendConfig.workerCurveKeyDir"


def make_keys(path: Path) -> Path:
    """A key directory made the documented way: python -m mindie.ops.curve_keys DIR."""
    proc = subprocess.run([sys.executable, "-m", "mindie.ops.curve_keys", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return path


def mixed_keys(path: Path, *, worker_public: Path, frontend: Path) -> Path:
    """A front end's key directory: the workers' public key of one directory, the front-end
    keypair of another (a front end with a key the workers do not know, or the wrong server key)."""
    path.mkdir(mode=0o700)
    shutil.copy(worker_public / "worker.key", path / "worker.key")
    shutil.copy(frontend / "frontend.key_secret", path / "frontend.key_secret")
    os.chmod(path / "frontend.key_secret", 0o600)
    return path


def port_pair(n: int = 1) -> int:
    """A port P with P .. P + 2n - 1 free on 127.0.0.1 right now."""
    return consecutive_free_ports(2 * n)


def tcp_config(path: Path, demo_model: str = "", workers: int = 1, **backend) -> Path:
    port = free_port()
    # not one of the worker links' ports (free until the workers bind them: a collision leaves a
    # worker unable to bind its own)
    while "workerPort" in backend and port in range(backend["workerPort"], backend["workerPort"] + 2 * workers):
        port = free_port()
    write_config(path, port=port, run_dir=short_run_dir(), workers=workers, model_path=demo_model)
    cfg = json.loads(path.read_text())
    cfg["BackendConfig"].update(backend)
    path.write_text(json.dumps(cfg, indent=2))
    return path


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("keys")
    good, other = make_keys(tmp / "good"), make_keys(tmp / "other")
    return {
        "good": good,
        # A front end whose keypair is not in good/clients/.
        "stranger": mixed_keys(tmp / "stranger", worker_public=good, frontend=other),
        # A front end that trusts another server key.
        "wrong_server": mixed_keys(tmp / "wrong_server", worker_public=other, frontend=good),
    }


# -- config ---------------------------------------------------------------------------------------
def test_generated_key_dir_layout(keys) -> None:
    good = keys["good"]
    for name in ("worker.key_secret", "worker.key", "frontend.key_secret", "clients/frontend.key",
                 "clients/worker.key"):
        assert (good / name).is_file(), name
    for name in ("worker.key_secret", "frontend.key_secret"):
        assert (good / name).stat().st_mode & 0o077 == 0
    # the front ends may connect, and the workers' own key: prefill workers' KV transfers (pd_transfer.py)
    for name in ("frontend.key", "worker.key"):
        assert (good / "clients" / name).read_bytes() == (good / name).read_bytes()


def test_tcp_without_keys_is_refused_unless_insecure(tmp_path) -> None:
    path = tcp_config(tmp_path / "config.json", workerHost="127.0.0.1", workerPort=20000)
    with pytest.raises(ConfigError) as e:
        load_config(str(path), env={})
    assert str(e.value).startswith(KEY + ":") and "CURVE" in str(e.value) and "workerInsecureTcp: true" in str(e.value)
    path = tcp_config(tmp_path / "config.json", workers=2, workerHost="127.0.0.1", workerPort=20000,
                      workerInsecureTcp=True)
    dep = build_deployment(load_config(str(path), env={}).config)
    assert [(w.job_endpoint, w.pub_endpoint, w.curve_key_dir, w.insecure_tcp) for w in dep.workers] == [
        ("tcp://127.0.0.1:20000", "tcp://127.0.0.1:20001", "", True),
        ("tcp://127.0.0.1:20002", "tcp://127.0.0.1:20003", "", True)]
    # What the worker and the client log at start in that case.
    assert "plain tcp without CURVE" in insecure_warning(dep.workers[0].job_endpoint)


@pytest.mark.parametrize("backend,key,words", [
    ({"workerHost": "localhost", "workerPort": 20000, "workerInsecureTcp": True}, "BackendConfig.workerHost", "address"),
    ({"workerHost": "0.0.0.0", "workerPort": 20000, "workerInsecureTcp": True}, "BackendConfig.workerHost", "connect"),
    ({"workerHost": "127.0.0.1", "workerInsecureTcp": True}, "BackendConfig.workerPort", "[1024, 65535]"),
    ({"workerHost": "127.0.0.1", "workerPort": 65535, "workerInsecureTcp": True}, "BackendConfig.workerPort", "<= 65534"),
    ({"workerHosts": ["127.0.0.1", "hostb"], "workerPort": 20000, "workerInsecureTcp": True},
     "BackendConfig.workerHosts[1]", "IPv4 or IPv6 address, got 'hostb'"),
    ({"workerHosts": ["127.0.0.1", "127.0.0.1"], "workerPort": 20000, "workerInsecureTcp": True},
     "BackendConfig.workerHosts", "appears twice"),
    ({"workerHost": "127.0.0.3", "workerHosts": ["127.0.0.1", "127.0.0.2"], "workerPort": 20000,
      "workerInsecureTcp": True}, "BackendConfig.workerHosts", "must list workerHost (127.0.0.3)"),
    ({"workerHosts": ["127.0.0.1"], "workerInsecureTcp": True}, "BackendConfig.workerPort", "[1024, 65535]"),
])
def test_worker_host_and_port_checked(tmp_path, backend, key, words) -> None:
    path = tcp_config(tmp_path / "config.json", **backend)
    with pytest.raises(ConfigError) as e:
        load_config(str(path), env={})
    assert str(e.value).startswith(key + ":") and words in str(e.value), str(e.value)


def test_worker_hosts_plan(tmp_path) -> None:
    """workerHosts: every host serves every npuDeviceIds entry on the same ports; a worker's id
    names its host (the same on every host's plan), and only workerHost's are started here."""
    path = tcp_config(tmp_path / "config.json", workers=2, workerHost="10.0.0.3", workerPort=20000,
                      workerHosts=["10.0.0.2", "10.0.0.3"], workerInsecureTcp=True)
    dep = build_deployment(load_config(str(path), env={}).config)
    assert [(w.worker_id, w.job_endpoint, w.remote) for w in dep.workers] == [
        ("w0@10.0.0.2", "tcp://10.0.0.2:20000", True), ("w1@10.0.0.2", "tcp://10.0.0.2:20002", True),
        ("w0@10.0.0.3", "tcp://10.0.0.3:20000", False), ("w1@10.0.0.3", "tcp://10.0.0.3:20002", False)]
    # The other host's plan from the same list: the same ids, its own workers local.
    host_b = tcp_config(tmp_path / "b.json", workers=2, workerHost="10.0.0.2", workerPort=20000,
                        workerHosts=["10.0.0.2", "10.0.0.3"], workerInsecureTcp=True)
    assert [(w.worker_id, w.remote) for w in build_deployment(load_config(str(host_b), env={}).config).workers] == [
        ("w0@10.0.0.2", False), ("w1@10.0.0.2", False), ("w0@10.0.0.3", True), ("w1@10.0.0.3", True)]
    # Without workerHosts the ids stay w0, w1 (a single worker host, as before the key existed).
    single = tcp_config(tmp_path / "s.json", workers=2, workerHost="10.0.0.2", workerPort=20000,
                        workerInsecureTcp=True)
    assert [w.worker_id for w in build_deployment(load_config(str(single), env={}).config).workers] == ["w0", "w1"]
    ipv6 = tcp_config(tmp_path / "v6.json", workers=1, workerHost="::1", workerPort=20000,
                      workerHosts=["0:0::1", "fd00::2"], workerInsecureTcp=True)
    assert [(w.worker_id, w.remote) for w in build_deployment(load_config(str(ipv6), env={}).config).workers] == [
        ("w0@::1", False), ("w0@fd00::2", True)]


def test_ipv6_endpoints(tmp_path) -> None:
    path = tcp_config(tmp_path / "config.json", workerHost="::1", workerPort=20000, workerInsecureTcp=True)
    (w,) = build_deployment(load_config(str(path), env={}).config).workers
    assert (w.job_endpoint, w.pub_endpoint) == ("tcp://[::1]:20000", "tcp://[::1]:20001")


def test_key_dir_relative_to_the_config_file(tmp_path, keys) -> None:
    shutil.copytree(keys["good"], tmp_path / "curve")
    path = tcp_config(tmp_path / "config.json", workerHost="127.0.0.1", workerPort=20000, workerCurveKeyDir="curve")
    (w,) = build_deployment(load_config(str(path), env={}).config).workers
    assert w.curve_key_dir == str(tmp_path / "curve") and not w.insecure_tcp


@pytest.mark.parametrize("missing,named", [("worker.key_secret", "worker.key_secret"), ("worker.key", "worker.key "),
                                           ("frontend.key_secret", "frontend.key_secret"),
                                           ("clients/*.key", "clients holds no *.key file")])
def test_missing_key_file_is_refused(tmp_path, keys, missing, named) -> None:
    shutil.copytree(keys["good"], tmp_path / "curve")
    for path in (tmp_path / "curve").glob(missing):
        path.unlink()
    path = tcp_config(tmp_path / "config.json", workerHost="127.0.0.1", workerPort=20000,
                      workerCurveKeyDir=str(tmp_path / "curve"))
    with pytest.raises(ConfigError) as e:
        load_config(str(path), env={})
    assert str(e.value).startswith(KEY + ":") and named in str(e.value), str(e.value)


def test_readable_secret_key_is_refused(tmp_path, keys, monkeypatch) -> None:
    shutil.copytree(keys["good"], tmp_path / "curve")
    os.chmod(tmp_path / "curve" / "worker.key_secret", 0o644)
    path = tcp_config(tmp_path / "config.json", workerHost="127.0.0.1", workerPort=20000,
                      workerCurveKeyDir=str(tmp_path / "curve"))
    monkeypatch.delenv("MINDIE_TLS_CHECK_PERMISSIONS", raising=False)
    with pytest.raises(ConfigError) as e:
        load_config(str(path), env={})
    assert str(e.value).startswith(KEY + ":") and "worker.key_secret" in str(e.value) and "0644" in str(e.value)
    monkeypatch.setenv("MINDIE_TLS_CHECK_PERMISSIONS", "0")  # the documented override
    load_config(str(path), env={})


# -- each side refuses plain tcp on its own -------------------------------------------------------
def _tcp_spec(port: int, **kw) -> WorkerSpec:
    return WorkerSpec(worker_id="w0", job_endpoint=f"tcp://127.0.0.1:{port}",
                      pub_endpoint=f"tcp://127.0.0.1:{port + 1}", null_model=True, **kw)


def test_worker_refuses_tcp_without_keys() -> None:
    proc = subprocess.run([sys.executable, "-m", "workers.worker", "--spec", encode_spec(_tcp_spec(port_pair()))],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "refuses to start" in proc.stderr and KEY in proc.stderr and "workerInsecureTcp" in proc.stderr


def test_worker_reports_a_port_in_use() -> None:
    port = port_pair()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        proc = subprocess.run([sys.executable, "-m", "workers.worker", "--spec",
                               encode_spec(_tcp_spec(port, insecure_tcp=True))],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"cannot bind tcp://127.0.0.1:{port}: address already in use" in proc.stderr, proc.stderr[-2000:]


def test_client_refuses_tcp_without_keys() -> None:
    async def main():
        c = DeviceClient([_tcp_spec(port_pair())])
        with pytest.raises(CurveKeyError, match="workerCurveKeyDir"):
            await c.start()
        assert c.links == {}
        await c.close()

    asyncio.run(main())


# -- real processes -------------------------------------------------------------------------------
def _start(tmp: Path, demo_model: str, **backend):
    """A supervisor with one null-model worker on tcp://127.0.0.1; returns (proc, Deployment, log path)."""
    cfg = tcp_config(tmp / "config.json", demo_model, workerHost="127.0.0.1", workerPort=port_pair(), **backend)
    path, dep = write_plan(cfg, null_model=True)
    log_path = tmp / "supervisor.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "workers.supervisor", "--deployment", path], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
    return proc, dep, log_path


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def curve_cluster(tmp_path_factory, demo_model, keys):
    proc, dep, log_path = _start(tmp_path_factory.mktemp("curve"), demo_model, workerCurveKeyDir=str(keys["good"]))
    yield dep, log_path
    _stop(proc)


def _with_key_dir(dep, key_dir: Path | str, insecure: bool = False) -> list[WorkerSpec]:
    return [msgspec.structs.replace(w, curve_key_dir=str(key_dir), insecure_tcp=insecure) for w in dep.workers]


async def _generate(c: DeviceClient, n: int = 5) -> list[int]:
    stream = c.submit([5, 6, 7], P.SamplingParams(max_new_tokens=n))
    ids: list[int] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for f in await stream.get(max(0.01, deadline - time.monotonic())):
            assert f.error is None, f.error
            ids += f.token_ids
            if f.finish_reason:
                return ids
    raise AssertionError("request timed out")


def test_curve_link_serves_the_right_front_end_only(curve_cluster, keys) -> None:
    dep, log_path = curve_cluster
    assert dep.workers[0].job_endpoint.startswith("tcp://127.0.0.1:")

    async def main():
        good = DeviceClient(dep.workers)  # the spec's own key dir: keys["good"]
        strangers = {name: DeviceClient(_with_key_dir(dep, keys[name])) for name in ("stranger", "wrong_server")}
        # A client without CURVE (allowed to try plain tcp) against a CURVE worker.
        strangers["plain"] = DeviceClient(_with_key_dir(dep, "", insecure=True))
        clients = [good, *strangers.values()]
        try:
            for c in clients:
                await c.start()
            # The good front end is welcomed (the worker may still be starting: up to 60 s);
            # meanwhile the others have had the same time, and a few seconds more, to be welcomed.
            assert await good.wait_ready(60), f"no Welcome for the right keys:\n{log_path.read_text()[-3000:]}"
            ready = await asyncio.gather(*(c.wait_ready(3.0) for c in strangers.values()))
            assert dict(zip(strangers, ready)) == {name: False for name in strangers}
            for name, c in strangers.items():
                assert c.ready_links() == [], name
                with pytest.raises(NoWorkerError):
                    c.submit([5, 6, 7], P.SamplingParams(max_new_tokens=3))
            ids = await _generate(good)
            assert len(ids) == 5 and good.gaps == 0
        finally:
            for c in clients:
                await c.close()

    asyncio.run(main())
    assert "CURVE" in log_path.read_text()


def test_plain_tcp_with_the_insecure_flag(tmp_path, demo_model) -> None:
    proc, dep, log_path = _start(tmp_path, demo_model, workerInsecureTcp=True)
    try:
        assert dep.workers[0].insecure_tcp and not dep.workers[0].curve_key_dir

        async def main():
            c = DeviceClient(dep.workers)
            try:
                await c.start()
                assert await c.wait_ready(60), log_path.read_text()[-3000:]
                assert len(await _generate(c)) == 5
            finally:
                await c.close()

        asyncio.run(main())
    finally:
        _stop(proc)
    assert "plain tcp without CURVE" in log_path.read_text()
