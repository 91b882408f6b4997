"""scripts/motor.sh (coordinator/fleet/: plan.py, run.py): a coordinator and N server instances on this host from
MindIE Motor's user_config.json. The derivation (ports, run directories, the coordinator's
instance list; typos and the PD modes refused naming the key) through the real command, and a
real fleet on loopback: two instances started by scripts/launch.sh and the coordinator, a request
through the coordinator, the coordinator probes, SIGTERM drains everything and leaves no process."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.coord_harness import MOTOR, MotorFleet, consecutive_free_ports
from tests.coord_harness import motor_env as env
from tests.harness import ROOT, InferStreams, alive, free_ports, plain_decode, wait_gone

pytestmark = pytest.mark.timeout(300)

HEALTH_CHECK = ROOT / "scripts" / "health_check.sh"


def motor(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(MOTOR), *args], capture_output=True, text=True, env=env(), timeout=timeout,
                          cwd="/")


def server_config(model_path: str, port: int | None = None) -> dict:
    sc = {"ipAddress": "127.0.0.1", "httpsEnabled": False}
    if port:
        sc["port"] = port
    return {"ServerConfig": sc,
            "BackendConfig": {"npuDeviceIds": [[0]], "deviceType": "cpu", "cpuThreadsPerWorker": 1,
                              "ModelDeployConfig": {"maxSeqLen": 1024, "maxInputTokenLen": 512,
                                                    "ModelConfig": [{"modelName": "demo", "modelWeightPath": model_path,
                                                                     "cpuMemSize": 1, "dtype": "float32"}]},
                              # streams held across a SIGTERM must still run then: a token a step
                              "ScheduleConfig": plain_decode({"cacheBlockSize": 16, "maxBatchSize": 16,
                                                              "maxPrefillBatchSize": 8, "maxPrefillTokens": 1024,
                                                              "maxIterTimes": 512})}}


def user_config(path: Path, *, predict: int, manage: int, replicas: int = 2, server: dict | None = None,
                **extra) -> Path:
    doc = {"version": "v1.0",
           "deploy_config": {"replicas": replicas, "image_name": "mindie:any"},
           "mindie_ms_controller_config": {"deploy_mode": "single_node"},
           "mindie_ms_coordinator_config": {
               "http_config": {"predict_ip": "127.0.0.1", "predict_port": str(predict),
                               "manage_ip": "127.0.0.1", "manage_port": str(manage)},
               "exception_config": {"max_retry": 2, "first_token_timeout": 30},
               "digs_scheduler_config": {"deploy_mode": "single_node", "algorithm_type": "load_balance"}},
           "mindie_server_config": server if server is not None else {"ServerConfig": {"port": predict + 10}}}
    for k, v in extra.items():
        doc[k] = v
    path.write_text(json.dumps(doc, indent=1))
    return path


# -- derivation ----------------------------------------------------------------------------------------
def test_plan_derives_ports_run_dirs_and_the_instance_list(tmp_path) -> None:
    from mindie.config import load_config
    from coordinator.config import load
    run = tmp_path / "run"
    cfg = user_config(tmp_path / "u.json", predict=21025, manage=21026,
                      server={"ServerConfig": {"port": 21100, "managementPort": 21101, "metricsPort": 21102},
                              "BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"modelWeightPath": "w/m"}]}}})
    r = motor("plan", "--config", str(cfg), "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    assert "deploy_config.image_name: accepted, not applied" in r.stderr
    plan = json.loads(r.stdout)
    got = []
    for k in range(2):
        loaded = load_config(str(run / f"i{k}.json"), env={})
        s = loaded.config.server
        # Each plane keeps its offset from port; stride 3.
        got.append((s.port, s.management_port, s.metrics_port, s.management_ip_address, s.run_dir))
        # A relative path is taken from user_config.json's directory.
        assert loaded.config.backend.model_deploy.models[0].model_weight_path == str(tmp_path / "w" / "m")
    assert got == [(21100, 21101, 21102, "127.0.0.1", str(run / "i0")),
                   (21103, 21104, 21105, "127.0.0.1", str(run / "i1"))]
    c = load(str(run / "ms_coordinator.json"), env={}).config
    assert [(i.id, i.ip, i.business_port, i.mgmt_port, i.metric_port) for i in c.instances] == [
        (0, "127.0.0.1", 21100, 21101, 21102), (1, "127.0.0.1", 21103, 21104, 21105)]
    assert (c.http_config.predict_port, c.http_config.manage_port) == (21025, 21026)
    assert plan["predict_url"] == "http://127.0.0.1:21025" and len(plan["instances"]) == 2
    # Accelerators: npuDeviceIds is instance 0's; instance k's moves up by k times its span.
    cfg = user_config(tmp_path / "u3.json", predict=21025, manage=21026, replicas=3,
                      server={"BackendConfig": {"deviceType": "npu", "npuDeviceIds": [[0, 1], [2, 3]]}})
    r = motor("plan", "--config", str(cfg), "--run-dir", str(tmp_path / "run3"))
    assert r.returncode == 0, r.stderr
    assert [load_config(str(tmp_path / "run3" / f"i{k}.json"), env={}).config.backend.npu_device_ids
            for k in range(3)] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]
    # No ServerConfig.port: the instances start after the coordinator's highest port; metrics on
    # the management plane (the coordinator's default place for /metrics), stride 2.
    cfg = user_config(tmp_path / "u2.json", predict=21025, manage=21026, replicas=3, server={})
    r = motor("plan", "--config", str(cfg), "--run-dir", str(tmp_path / "run2"))
    assert r.returncode == 0, r.stderr
    assert [(i["business_port"], i["mgmt_port"], i["metrics_port"]) for i in json.loads(r.stdout)["instances"]] == [
        (21027, 21028, 21028), (21029, 21030, 21030), (21031, 21032, 21032)]
    assert all("metric_port" not in i for i in json.loads((tmp_path / "run2" / "ms_coordinator.json").read_text())["instances"])
    assert "deviceType auto: every instance uses the npuDeviceIds as written" in r.stderr


def test_plan_gives_each_instance_its_own_cores(tmp_path) -> None:
    """As each instance gets its own devices, it gets its own CPU cores (issue 52, finding 6):
    disjoint sets covering the cores motor.sh may run on; fewer cores than instances, or
    deploy_config.cpuBinding false: nothing bound, a note says so."""
    from coordinator.fleet.plan import core_sets
    assert core_sets(2, [0, 1, 2, 3, 4]) == [[0, 1, 2], [3, 4]]
    assert core_sets(1, [4, 5]) == [[4, 5]] and core_sets(3, [0, 1]) == [[], [], []]
    cores = sorted(os.sched_getaffinity(0))
    n = min(len(cores), 16)
    cfg = user_config(tmp_path / "u.json", predict=21025, manage=21026, replicas=n, server={})
    r = motor("plan", "--config", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    sets = [i["cpu_cores"] for i in json.loads(r.stdout)["instances"]]
    assert all(sets) and sorted(c for s in sets for c in s) == cores, sets  # disjoint, all used
    if n < 16:
        cfg = user_config(tmp_path / "u2.json", predict=21025, manage=21026, replicas=n + 1, server={})
        r = motor("plan", "--config", str(cfg), "--run-dir", str(tmp_path / "run2"))
        assert r.returncode == 0, r.stderr
        assert all(i["cpu_cores"] == [] for i in json.loads(r.stdout)["instances"])
        assert f"{n + 1} instances on {len(cores)} usable core(s): not bound" in r.stderr
    doc = json.loads(cfg.read_text())
    doc["deploy_config"].update(replicas=1, cpuBinding=False)
    cfg.write_text(json.dumps(doc))
    r = motor("plan", "--config", str(cfg), "--run-dir", str(tmp_path / "run3"))
    assert r.returncode == 0 and json.loads(r.stdout)["instances"][0]["cpu_cores"] == [], r.stderr
    assert "deploy_config.cpuBinding false" in r.stderr
    doc["deploy_config"]["cpuBinding"] = "no"
    cfg.write_text(json.dumps(doc))
    r = motor("plan", "--config", str(cfg), "--run-dir", str(tmp_path / "run4"))
    assert r.returncode == 2 and "deploy_config.cpuBinding: must be true or false" in r.stderr, r.stderr


def test_run_dir_parents_made_private(tmp_path) -> None:
    """motor.sh's default run dir is /tmp/mindie-py-<uid>/motor-<port>: the parent it creates is 0700,
    as a server's default ServerConfig.runDir beside it requires (a 0755 one made every later
    scripts/launch.sh on the defaults refuse to start)."""
    from mindie.config import ensure_run_dir
    from coordinator.fleet.run import claim
    parent = tmp_path / f"mindie-py-{os.getuid()}"
    lock = claim(str(parent / "motor-1025"))
    assert lock is not None
    os.close(lock)
    for d in (parent, parent / "motor-1025"):
        assert (d.stat().st_mode & 0o777) == 0o700, (d, oct(d.stat().st_mode))
    assert ensure_run_dir(str(parent / "server")) == str(parent / "server")


def test_example_user_config_plans(tmp_path) -> None:
    """deploy/user_config.example.json passes every loader as shipped."""
    r = motor("plan", "--config", str(ROOT / "deploy" / "user_config.example.json"), "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["predict_url"] == "http://127.0.0.1:1025"
    assert [(i["business_port"], i["mgmt_port"], i["metrics_port"]) for i in plan["instances"]] == [
        (1030, 1031, 1031), (1032, 1033, 1033)]


@pytest.mark.parametrize("edit,key", [
    (lambda d: d["deploy_config"].update(replica=2),
     "deploy_config.replica: unknown key: did you mean deploy_config.replicas?"),
    (lambda d: d.update(mindie_server_conf={}), "mindie_server_conf: unknown key"),
    (lambda d: d["mindie_ms_controller_config"].update(deploy_mod="single_node"),
     "mindie_ms_controller_config.deploy_mod: unknown key: did you mean mindie_ms_controller_config.deploy_mode?"),
    (lambda d: d["mindie_server_config"]["ServerConfig"].update(managementPrt=1),
     "mindie_server_config.ServerConfig.managementPrt: unknown key: did you mean "
     "mindie_server_config.ServerConfig.managementPort?"),
    (lambda d: d["mindie_server_config"]["ServerConfig"].update(managementPrt=1, maxBatchSize=4),
     "2 unknown keys (not MindIE config.json keys nor project extensions): "
     "mindie_server_config.ServerConfig.managementPrt (did you mean mindie_server_config.ServerConfig.managementPort?); "
     "mindie_server_config.ServerConfig.maxBatchSize (did you mean "
     "mindie_server_config.BackendConfig.ScheduleConfig.maxBatchSize?)"),
    (lambda d: d["mindie_server_config"]["ServerConfig"].update(managementPrt=1, zzzqqq=2, strictConfig=True),
     "2 unknown keys (not MindIE config.json keys nor project extensions): mindie_server_config.ServerConfig."
     "managementPrt (did you mean mindie_server_config.ServerConfig.managementPort?); "
     "mindie_server_config.ServerConfig.zzzqqq"),
    (lambda d: (d.update(extra=1), d["deploy_config"].update(replica=2)),
     "2 unknown keys: extra (not a MindIE user_config.json key); deploy_config.replica (did you mean "
     "deploy_config.replicas?)"),
    (lambda d: d["mindie_ms_coordinator_config"]["exception_config"].update(max_retri=1),
     "mindie_ms_coordinator_config.exception_config.max_retri: unknown key: did you mean "
     "mindie_ms_coordinator_config.exception_config.max_retry?"),
    # every unknown key of every section, each named as a key of this file, suggestions included
    (lambda d: d["mindie_ms_coordinator_config"]["exception_config"].update(max_retri=1, zzzqqq=2),
     "2 unknown keys (not MindIE ms_coordinator.json keys nor project extensions): "
     "mindie_ms_coordinator_config.exception_config.max_retri (did you mean "
     "mindie_ms_coordinator_config.exception_config.max_retry?); mindie_ms_coordinator_config.exception_config.zzzqqq"),
    # a right name in the wrong section: pointed to where it belongs (the one unknown-key check's rule)
    (lambda d: d["deploy_config"].update(deploy_mod="single_node"),
     "deploy_config.deploy_mod: unknown key: did you mean mindie_ms_controller_config.deploy_mode?"),
    (lambda d: d["mindie_ms_coordinator_config"].update(instances=[]), "mindie_ms_coordinator_config.instances: derived"),
    (lambda d: d["deploy_config"].update(replicas=17), "deploy_config.replicas: must be an integer in [1, 16]"),
    (lambda d: d["mindie_server_config"]["ServerConfig"].update(port=21026),
     "instance i0's mindie_server_config.ServerConfig.port would be 21026, which is "
     "mindie_ms_coordinator_config.http_config.manage_port"),
    (lambda d: d["mindie_server_config"]["ServerConfig"].update(port=65535),
     "outside [1024, 65535]"),
])
def test_refused_naming_the_key(tmp_path, edit, key) -> None:
    cfg = user_config(tmp_path / "u.json", predict=21025, manage=21026)
    doc = json.loads(cfg.read_text())
    edit(doc)
    cfg.write_text(json.dumps(doc))
    r = motor("plan", "--config", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2, r
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("motor: user_config.json refused: ") and key in line, line


def test_pd_forms_other_than_pd_separate_refused_with_the_reason(tmp_path) -> None:
    """pd_separate is derived (tests/test_pd_coordinator_deploy.py); MindIE's other PD forms are
    refused, saying what to use; the PD server configs belong to pd_separate only."""
    cfg = user_config(tmp_path / "u.json", predict=21025, manage=21026,
                      mindie_ms_controller_config={"deploy_mode": "pd_disaggregation", "digs_prefill_slo": 1000})
    doc = json.loads(cfg.read_text())
    del doc["mindie_ms_coordinator_config"]["digs_scheduler_config"]["deploy_mode"]
    cfg.write_text(json.dumps(doc))
    r = motor("plan", "--config", str(cfg))
    assert r.returncode == 2
    assert ("mindie_ms_controller_config.deploy_mode: pd_disaggregation is not supported by motor.sh: "
            "\"pd_separate\" starts prefill and decode instances") in r.stderr
    doc["mindie_ms_controller_config"]["deploy_mode"] = "single_node"
    doc["mindie_server_prefill_config"] = {}
    cfg.write_text(json.dumps(doc))
    r = motor("plan", "--config", str(cfg))
    assert r.returncode == 2 and "mindie_server_prefill_config: belongs to deploy_mode pd_separate" in r.stderr


# -- a real fleet (tests/coord_harness.py: MotorFleet) ---------------------------------------------------
def probe_coordinator(cfg: Path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(HEALTH_CHECK), "--coordinator", "--config", str(cfg), "--timeout", "5", mode],
                          capture_output=True, text=True, env=env(), timeout=30, cwd="/")


def test_fleet_starts_serves_and_drains(tmp_path, demo_model) -> None:
    predict, manage = free_ports(2)
    base = consecutive_free_ports(4, avoid=(predict, manage))
    cfg = user_config(tmp_path / "u.json", predict=predict, manage=manage, server=server_config(demo_model, base))
    fleet = MotorFleet(tmp_path, cfg, ready_timeout=180)
    proc, out, run = fleet.proc, fleet.out, fleet.run_dir
    try:
        ready = fleet.wait_ready(200)
        assert f"coordinator http://127.0.0.1:{predict}" in ready and "2 instance(s)" in ready, ready
        plan = fleet.plan()
        url = f"http://127.0.0.1:{predict}"
        body = {"input_id": [5, 6, 7, 8], "stream": False, "parameters": {"max_new_tokens": 6, "do_sample": False}}
        r = httpx.post(url + "/infer_token", json=body, timeout=60)
        assert r.status_code == 200, r.text
        # The same tokens as calling an instance directly (greedy).
        i0 = plan["instances"][0]
        direct = httpx.post(f"http://127.0.0.1:{i0['business_port']}/infer_token", json=body, timeout=60)
        assert direct.status_code == 200 and r.json() == direct.json(), (r.text, direct.text)
        # Both instances are known and ready to the coordinator.
        info = httpx.get(f"http://127.0.0.1:{manage}/v1/coordinator_info", timeout=10)
        assert info.status_code == 200, info.text
        # A second motor.sh on the same run directory is refused and leaves the files alone.
        before = (Path(run) / "i0.json").read_text()
        other = user_config(tmp_path / "u-other.json", predict=predict, manage=manage, replicas=1,
                            server=server_config(demo_model, base + 10))
        r = motor("--config", str(other), "--run-dir", run)
        assert r.returncode == 2 and "is in use by another motor.sh" in r.stderr, r
        assert (Path(run) / "i0.json").read_text() == before
        # health_check.sh --coordinator against the live coordinator.
        coord_cfg = Path(run) / "ms_coordinator.json"
        for mode in ("startup", "liveness", "readiness"):
            p = probe_coordinator(coord_cfg, mode)
            assert p.returncode == 0 and p.stdout.startswith("healthy: 200"), (mode, p.stdout, p.stderr)
        pids = fleet.pids()
        assert len(pids) >= 8, pids  # motor, coordinator, 2 x (launch.sh, supervisor, worker, gunicorn, front end)
        # SIGTERM with streams in flight through the coordinator: they finish in full (the
        # coordinator drains first, then the instances), nothing is cut.
        # 500 tokens (maxIterTimes 512): long enough that none can end between the poll that sees
        # them started and the signal (200 once did on a fast CI host).
        streams = InferStreams(url, 4, 500)
        streams.wait_started(3, timeout=60)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        at_signal = [len(e) for e in streams.events]
        streams.join(90)
        failed, full = streams.outcome()
        assert (failed, full) == ([], 4), [len(e) for e in streams.events]
        assert min(streams.ended) > t0 and max(at_signal) < streams.tokens, ("streams not in flight at SIGTERM", at_signal)
        assert proc.wait(90) == 0, out()
        gone = wait_gone(pids, 20)
        assert gone is not None, [p for p in pids if alive(p)]
        print(f"SIGTERM -> fleet gone in {time.monotonic() - t0:.1f} s")
        text = out()
        assert "stopping the coordinator" in text and "draining 2 instance(s)" in text and "motor: stopped" in text
        # Nothing listens any more; a probe now says "not running" (exit 3).
        p = probe_coordinator(coord_cfg, "liveness")
        assert p.returncode == 3, (p.stdout, p.stderr)
        for i in plan["instances"]:
            assert not any((Path(i["run_dir"]) / e).exists() for e in ("server.lock", "deployment.json")), i
    finally:
        fleet.cleanup()


def test_coordinator_killed_is_restarted_and_stop_service_drains_the_fleet(tmp_path, demo_model) -> None:
    """kill -9 of the coordinator: the instances keep serving, motor.sh starts a new one, which
    routes again; GET /stopService on the coordinator stops every instance and the coordinator,
    and motor.sh exits 0 leaving no process."""
    import contextlib
    predict, manage = free_ports(2)
    base = consecutive_free_ports(4, avoid=(predict, manage))
    cfg = user_config(tmp_path / "u.json", predict=predict, manage=manage, server=server_config(demo_model, base))
    fleet = MotorFleet(tmp_path, cfg, ready_timeout=180)
    proc, out, wait_for = fleet.proc, fleet.out, fleet.wait_for

    def coordinator_pid() -> int:
        lines = [line for line in out().splitlines() if line.startswith("motor: coordinator: pid ")]
        return int(lines[-1].split()[3].rstrip(","))

    body = {"input_id": [5, 6, 7], "stream": False, "parameters": {"max_new_tokens": 3}}
    try:
        fleet.wait_ready(200)
        plan = fleet.plan()
        first = coordinator_pid()
        os.kill(first, signal.SIGKILL)
        # The instances serve on their own ports meanwhile.
        for i in plan["instances"]:
            r = httpx.post(f"http://127.0.0.1:{i['business_port']}/infer_token", json=body, timeout=60)
            assert r.status_code == 200, r.text
        wait_for("the coordinator was killed by SIGKILL: restarting it", 20)
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.post(f"http://127.0.0.1:{predict}/infer_token", json=body, timeout=60)
                if r.status_code == 200:
                    break
            assert time.monotonic() < deadline, out()
            time.sleep(0.2)
        second = coordinator_pid()
        assert second != first and alive(second)
        pids = fleet.pids()
        # stopService on the coordinator: it stops every instance (each drains), then itself
        # (exit 0); motor.sh then waits for the instances' launchers and exits 0.
        r = httpx.get(f"http://127.0.0.1:{manage}/stopService", timeout=90)
        assert r.status_code == 200, r.text
        assert proc.wait(90) == 0, out()
        assert wait_gone(pids, 20) is not None, [p for p in pids if alive(p)]
        assert "the coordinator stopped by itself (exit 0, a stop it was asked for): stopping the instances" in out()
    finally:
        fleet.cleanup()


def test_tls_fleet(tmp_path, demo_model) -> None:
    """Mutual TLS everywhere, relative paths in user_config.json (taken from its directory):
    the instances' planes (httpsEnabled, client CA), the coordinator's predict and manage ports
    and its client side to the instances. motor.sh waits for both with the probes' client
    (MINDIE_PROBE_CERT/KEY), a request through the coordinator works over HTTPS, and
    health_check.sh --coordinator probes the HTTPS manage port. Then SIGKILL to motor.sh: every
    child gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and stops on its own (the instances
    drain), within a bound. (One fleet start for what were test_tls_fleet and
    test_motor_killed_leaves_no_process: the stop by SIGTERM is test_fleet_starts_serves_and_drains';
    motor.sh stops its children by signals, TLS or not.)"""
    import ssl
    from tests.certs import Pki
    pki = Pki(tmp_path)
    ca = str(tmp_path / "security" / "ca" / "ca.pem")
    client = ssl.create_default_context(cafile=ca)
    client.load_cert_chain(pki.client[0], pki.client[1])
    predict, manage = free_ports(2)
    base = consecutive_free_ports(2, avoid=(predict, manage))
    server = server_config(demo_model, base)
    server["ServerConfig"].update(pki.server_config(crl=False))
    items = lambda plane: {"ca_cert": "security/ca/ca.pem", "tls_cert": f"security/certs/{plane}/server.pem",  # noqa: E731
                           "tls_key": f"security/keys/{plane}/server.key.pem"}
    mine = {"ca_cert": "security/ca/ca.pem", "tls_cert": "clients/client.pem", "tls_key": "clients/client.key.pem"}
    cfg = user_config(tmp_path / "u.json", predict=predict, manage=manage, replicas=1, server=server)
    doc = json.loads(cfg.read_text())
    doc["mindie_ms_coordinator_config"]["tls_config"] = {
        "request_server_tls_enable": True, "request_server_tls_items": items("business"),
        "controller_server_tls_enable": True, "controller_server_tls_items": items("management"),
        "mindie_client_tls_enable": True, "mindie_client_tls_items": mine,
        "mindie_mangment_tls_enable": True, "mindie_mangment_tls_items": mine}
    cfg.write_text(json.dumps(doc))
    e = env() | {"MINDIE_PROBE_CERT": pki.client[0], "MINDIE_PROBE_KEY": pki.client[1]}
    fleet = MotorFleet(tmp_path, cfg, env=e)
    proc, run = fleet.proc, fleet.run_dir
    pids: list[int] = []
    try:
        fleet.wait_ready(200)
        text = fleet.out()
        assert f"coordinator https://127.0.0.1:{predict} (manage https://127.0.0.1:{manage})" in text, text
        assert f"i0 https://127.0.0.1:{base}" in text, text
        body = {"inputs": "hello there", "parameters": {"max_new_tokens": 4}}
        r = httpx.post(f"https://127.0.0.1:{predict}/infer", json=body, timeout=60, verify=client)
        assert r.status_code == 200, r.text
        p = subprocess.run(["bash", str(HEALTH_CHECK), "--coordinator", "--config", str(Path(run) / "ms_coordinator.json"),
                            "readiness"], capture_output=True, text=True, env=e, timeout=30, cwd="/")
        assert p.returncode == 0 and p.stdout.startswith("healthy: 200 from https://127.0.0.1:"), (p.stdout, p.stderr)
        pids[:] = fleet.pids()[1:]
        assert len(pids) >= 5, pids  # coordinator, launch.sh, supervisor, worker, gunicorn (+ front end)
        proc.kill()
        proc.wait()
        assert wait_gone(pids, 40) is not None, [p for p in pids if alive(p)]
    finally:
        fleet.cleanup(pids)  # what is left, reparented or not
