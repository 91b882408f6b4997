"""deploy/k8s/motor/: a coordinator Deployment in front of a server StatefulSet, checked as
tests/test_deploy.py checks deploy/k8s/: the ConfigMap's config.json loads with the server's
loader, its ms_coordinator.json template with the coordinator's; the init container's
discovery (coordinator.fleet.discover render, run here with the pods' DNS names answered by a stand-in
resolver) writes a config the coordinator's loader takes, with one instance per StatefulSet
replica on the server's ports; names, ports, mounts, probes and grace periods agree."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from mindie.config import load_config  # noqa: E402
from mindie.server.listeners import plan_listeners  # noqa: E402
from coordinator.fleet import discover  # noqa: E402
from mindie.ops import probe  # noqa: E402
from tests.harness import ROOT  # noqa: E402
from tests.test_deploy import CUT_GRACE_S, image_root, local_command, stop_deadline  # noqa: E402

MOTOR = ROOT / "deploy" / "k8s" / "motor"


def docs() -> list[dict]:
    return [d for p in sorted(MOTOR.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def kind(k: str) -> list[dict]:
    return [d for d in docs() if d["kind"] == k]


def named(k: str, name: str) -> dict:
    (d,) = [d for d in kind(k) if d["metadata"]["name"] == name]
    return d


def configmap() -> dict:
    (cm,) = kind("ConfigMap")
    return cm


def server_config(tmp_path: Path):
    p = tmp_path / "config.json"
    p.write_text(configmap()["data"]["config.json"])
    return p, load_config(str(p), env={})


def statefulset() -> dict:
    (ss,) = kind("StatefulSet")
    return ss


def coordinator_pod() -> dict:
    (dep,) = kind("Deployment")
    return dep["spec"]["template"]["spec"]


def container(pod: dict, name: str, init: bool = False) -> dict:
    (c,) = [c for c in pod["initContainers" if init else "containers"] if c["name"] == name]
    return c


def mount_of(pod: dict, c: dict, path: str) -> tuple[dict, str]:
    """(the volume a file path in container ``c`` lies on, the path inside that volume)."""
    ms = [m for m in c.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(ms) == 1, (c["name"], path, ms)
    vols = {v["name"]: v for v in pod["volumes"]}
    return vols[ms[0]["name"]], path[len(ms[0]["mountPath"].rstrip("/")) + 1:]


def arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_every_manifest_loads() -> None:
    kinds = sorted(d["kind"] for d in docs())
    assert kinds == ["ConfigMap", "Deployment", "Service", "Service", "Service", "StatefulSet"], kinds
    for d in docs():
        assert d["apiVersion"] and d["metadata"]["name"], d


def test_server_statefulset_agrees_with_its_config_and_headless_service(tmp_path) -> None:
    path, loaded = server_config(tmp_path)
    assert not loaded.unknown, loaded.unknown
    s = loaded.config.server
    listeners = {li.planes: li for li in plan_listeners(s)}
    # /metrics on the management plane: where the coordinator reads each instance's.
    assert set(listeners) == {("business",), ("management", "metrics")}, listeners
    ss = statefulset()
    svc = named("Service", ss["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    labels = ss["spec"]["template"]["metadata"]["labels"]
    assert ss["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    # The single-server manifests' Services (deploy/k8s/services.yaml) must not pick these pods up.
    old = [d for p in (ROOT / "deploy" / "k8s").glob("*.yaml") for d in yaml.safe_load_all(p.read_text())
           if d and d["kind"] == "Service"]
    for o in old:
        assert not o["spec"]["selector"].items() <= labels.items(), o["metadata"]["name"]
    pod = ss["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"business": s.port, "management": s.management_port}
    for p in svc["spec"]["ports"]:
        assert ports[p["targetPort"]] == p["port"]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    vol, rel = mount_of(pod, c, env["MIES_CONFIG_JSON_PATH"])
    assert vol["configMap"]["name"] == configmap()["metadata"]["name"]
    assert {i["path"]: i["key"] for i in vol["configMap"]["items"]}[rel] == "config.json"
    assert c["workingDir"] == image_root()
    assert local_command(c["command"])[1] == str(ROOT / "scripts" / "launch.sh")
    for probe_kind, mode in (("startupProbe", "startup"), ("readinessProbe", "readiness"), ("livenessProbe", "liveness")):
        cmd = local_command(c[probe_kind]["exec"]["command"])
        args = probe.parse_args(cmd[2:])
        assert Path(cmd[1]).name == "health_check.sh" and args.mode == mode and not args.coordinator
        assert c[probe_kind]["timeoutSeconds"] >= (args.timeout or probe.DEFAULT_TIMEOUT_S) + 1
    assert Path(local_command(c["lifecycle"]["preStop"]["exec"]["command"])[1]).name == "prestop.sh"
    wait = float(env["MINDIE_PRESTOP_WAIT"])
    assert wait >= s.drain_timeout_s + CUT_GRACE_S
    assert pod["terminationGracePeriodSeconds"] >= stop_deadline(wait, s.drain_timeout_s)


def test_discovery_renders_a_config_the_coordinator_loads(tmp_path, monkeypatch) -> None:
    from coordinator.config import load
    _, loaded = server_config(tmp_path)
    s = loaded.config.server
    ss = statefulset()
    pod = coordinator_pod()
    init = container(pod, "discover", init=True)
    cmd = init["command"]
    assert cmd[:4] == ["python3", "-m", "coordinator.fleet.discover", "render"] and init["workingDir"] == image_root()
    assert (ROOT / "coordinator" / "fleet" / "discover.py").is_file()
    # The template is the ConfigMap's ms_coordinator.json; the rendered file is on a volume the
    # coordinator container mounts, where its --config and the probes' variable point.
    tvol, trel = mount_of(pod, init, arg(cmd, "--template"))
    assert tvol["configMap"]["name"] == configmap()["metadata"]["name"]
    assert {i["path"]: i["key"] for i in tvol["configMap"]["items"]}[trel] == "ms_coordinator.json"
    out = arg(cmd, "--out")
    coord = container(pod, "coordinator")
    rvol, rrel = mount_of(pod, init, out)
    assert "emptyDir" in rvol and mount_of(pod, coord, out) == (rvol, rrel)
    assert coord["command"][:3] == ["python3", "-m", "coordinator"] and arg(coord["command"], "--config") == out
    env = {e["name"]: e.get("value") for e in coord["env"]}
    assert env["MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH"] == out
    # Render for real: the template from the ConfigMap, the pods' names answered by a stand-in
    # resolver (mindie-server-<k>.<headless service>.<namespace>.svc.cluster.local).
    template = tmp_path / "ms_coordinator.template.json"
    template.write_text(configmap()["data"]["ms_coordinator.json"])
    rendered = tmp_path / "ms_coordinator.json"
    argv = list(cmd[4:])
    argv[argv.index("--template") + 1] = str(template)
    argv[argv.index("--out") + 1] = str(rendered)
    argv[argv.index("--wait") + 1] = "1"
    monkeypatch.setenv("POD_NAMESPACE", "mindie")
    args = discover.parse_args(["render", *argv])
    n = ss["spec"]["replicas"]
    assert n <= args.max_replicas, "scaled past what discovery looks up"
    names = {f"{ss['metadata']['name']}-{k}.{ss['spec']['serviceName']}.mindie.svc.cluster.local": f"10.1.0.{k + 7}"
             for k in range(n)}
    assert discover.render(args, resolver=names.get) == 0
    c = load(str(rendered), env={}).config
    # The records carry the pods' DNS names (the coordinator resolves them at each connection).
    assert [(i.id, i.ip, i.business_port, i.mgmt_port) for i in c.instances] == [
        (k, name, s.port, s.management_port) for k, name in enumerate(names)]
    assert args.address == "name"
    args.address = "ip"  # or the addresses they resolve to now
    assert discover.render(args, resolver=names.get) == 0
    assert [i.ip for i in load(str(rendered), env={}).config.instances] == [f"10.1.0.{k + 7}" for k in range(n)]
    assert c.digs_scheduler_config.deploy_mode == "single_node"
    # Too few pods resolve within --wait: refused (exit 1), nothing written.
    rendered.unlink()
    args.min_instances = n + 1
    assert discover.render(args, resolver=names.get) == 1 and not rendered.exists()
    # The ports the coordinator listens on are its container's and its Services' targets.
    ports = {p["name"]: p["containerPort"] for p in coord["ports"]}
    h = c.http_config
    assert ports == {"predict": h.predict_port, "manage": h.manage_port}
    assert h.predict_ip == h.manage_ip == "0.0.0.0" and h.allow_all_zero_ip_listening
    labels = kind("Deployment")[0]["spec"]["template"]["metadata"]["labels"]
    for svc_name, port_name in (("mindie-ms-coordinator-infer", "predict"), ("mindie-ms-coordinator-manage", "manage")):
        svc = named("Service", svc_name)
        (p,) = svc["spec"]["ports"]
        assert svc["spec"]["selector"].items() <= labels.items() and p["targetPort"] == port_name
    # The sidecar keeps the instances current through the coordinator's manage port.
    side = container(pod, "refresh", init=True)
    assert side["restartPolicy"] == "Always"
    wargs = discover.parse_args(side["command"][3:])
    assert wargs.command == "watch" and wargs.manage == f"http://127.0.0.1:{h.manage_port}"
    for a in (args, wargs):
        assert (a.statefulset, a.service) == (ss["metadata"]["name"], ss["spec"]["serviceName"])
        assert (a.business_port, a.mgmt_port) == (s.port, s.management_port)


def test_coordinator_probes_are_coordinator_modes(tmp_path) -> None:
    coord = container(coordinator_pod(), "coordinator")
    for probe_kind, mode in (("startupProbe", "startup"), ("readinessProbe", "readiness"), ("livenessProbe", "liveness")):
        cmd = local_command(coord[probe_kind]["exec"]["command"])
        args = probe.parse_args(cmd[2:])
        assert Path(cmd[1]).name == "health_check.sh" and args.coordinator and args.mode == mode
        assert coord[probe_kind]["timeoutSeconds"] >= (args.timeout or probe.DEFAULT_TIMEOUT_S) + 1
    # The probe finds the manage port from the rendered config the container's variable names.
    cfg = tmp_path / "ms_coordinator.json"
    cfg.write_text(json.dumps({**json.loads(configmap()["data"]["ms_coordinator.json"]),
                               "instances": [{"id": 0, "ip": "10.0.0.1", "business_port": 1025, "mgmt_port": 1026}]}))
    from coordinator.probe import coordinator_target
    t = coordinator_target(None, env={"MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH": str(cfg)})
    assert (t.host, t.port, t.tls) == ("127.0.0.1", 1026, None)  # 0.0.0.0 probed on loopback


# -- the sidecar and the coordinator probes against a real coordinator ------------------------------
def test_refresh_sidecar_and_probes_against_a_real_coordinator(tmp_path, monkeypatch) -> None:
    """discover watch keeps a live coordinator's instance set equal to the pods that resolve (a
    scale-down removes one); health_check.sh --coordinator: live 200, not ready (503: exit 6)
    while no instance answers, not running (exit 3) once it stopped."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    import httpx

    from tests.harness import free_ports

    predict, manage, dead = free_ports(3)
    cfg = tmp_path / "ms_coordinator.json"
    doc = json.loads(configmap()["data"]["ms_coordinator.json"])
    doc["http_config"].update(predict_ip="127.0.0.1", manage_ip="127.0.0.1", predict_port=predict, manage_port=manage)
    cfg.write_text(json.dumps(doc))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MIES_", "MINDIE_"))}
    env["PYTHON"] = sys.executable
    log = open(tmp_path / "coordinator.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "coordinator", "--config", str(cfg)], cwd=str(ROOT),
                            env=env, stdout=log, stderr=subprocess.STDOUT)

    def check(mode: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(ROOT / "scripts" / "health_check.sh"), "--coordinator", "--config", str(cfg),
                               mode], capture_output=True, text=True, env=env, timeout=30, cwd="/")

    def instances() -> list[tuple]:
        info = httpx.get(f"http://127.0.0.1:{manage}/v1/coordinator_info", timeout=5).json()
        return sorted((i["id"], i["ip"], i["business_port"], i["mgmt_port"]) for i in info["instances"])

    try:
        deadline = time.monotonic() + 30
        while check("liveness").returncode != 0:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "coordinator.log").read_text()
            time.sleep(0.2)
        r = check("startup")
        assert r.returncode == 0 and r.stdout.startswith("healthy: 200"), r
        monkeypatch.setenv("POD_NAMESPACE", "ns1")
        args = discover.parse_args(["watch", "--address", "ip", "--manage", f"http://127.0.0.1:{manage}",
                                    "--business-port", str(dead),
                                    "--mgmt-port", str(dead), "--interval", "0.01", "--max-replicas", "4"])
        pods = {f"mindie-server-{k}.mindie-server.ns1.svc.cluster.local": f"127.0.0.{k + 1}" for k in range(2)}
        assert discover.watch(args, resolver=pods.get, rounds=1) == 0
        assert instances() == [(0, "127.0.0.1", dead, dead), (1, "127.0.0.2", dead, dead)]
        # Nothing answers on those ports: not ready (503), the probe says so with its own status.
        r = check("readiness")
        assert r.returncode == probe.STARTING and r.stderr.startswith("starting: 503"), r
        # Scale down: mindie-server-1 stops resolving after the first of 4 lookups. It is kept
        # through --drop-after (3) lookups in a row that miss it (a DNS hiccup takes nothing out),
        # then dropped.
        seen: list[tuple] = []
        calls = {"n": 0}

        def resolver(name: str):
            if name.startswith("mindie-server-0."):
                calls["n"] += 1
                if calls["n"] > 1:
                    seen.append(tuple(instances()))
            return None if name.startswith("mindie-server-1.") and calls["n"] > 1 else pods.get(name)

        assert discover.watch(args, resolver=resolver, rounds=4) == 0
        both = ((0, "127.0.0.1", dead, dead), (1, "127.0.0.2", dead, dead))
        assert seen == [both, both, both], seen  # before lookups 2, 3 and 4
        assert instances() == [(0, "127.0.0.1", dead, dead)]
        # Server modes are refused for a coordinator.
        r = check("timed")
        assert r.returncode == probe.USAGE and "server mode" in r.stderr, r
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    r = check("liveness")
    assert r.returncode == probe.NOT_RUNNING, r


def test_discovery_sidecar_sends_the_manage_ports_bearer_token(tmp_path, monkeypatch, capsys) -> None:
    """A coordinator whose manage port needs a bearer token (MINDIE_MS_COORDINATOR_MANAGE_TOKEN_FILE):
    the watch sidecar, given the same variable, sends the token with its refresh (200, the
    instances stored); without it the refresh is a 401, said on stderr; a token it cannot use
    (mode 644) stops it at once with the reason."""
    import httpx
    from tests.coord_harness import Coordinator
    from tests.harness import free_port
    token = tmp_path / "manage.token"
    token.write_text("s3cret-token\n")
    token.chmod(0o600)
    coord = Coordinator(tmp_path, [], name="tok-discover",
                        env={"MINDIE_MS_COORDINATOR_MANAGE_TOKEN_FILE": str(token)})
    try:
        coord.wait_ready_line()
        dead = free_port()
        monkeypatch.setenv("POD_NAMESPACE", "ns1")
        monkeypatch.delenv("MINDIE_MS_COORDINATOR_MANAGE_TOKEN", raising=False)
        monkeypatch.delenv("MINDIE_TLS_CHECK_PERMISSIONS", raising=False)
        args = discover.parse_args(["watch", "--address", "ip", "--manage", coord.manage, "--business-port",
                                    str(dead), "--mgmt-port", str(dead), "--interval", "0.01", "--max-replicas", "2"])
        pods = {"mindie-server-0.mindie-server.ns1.svc.cluster.local": "127.0.0.1"}
        monkeypatch.delenv("MINDIE_MS_COORDINATOR_MANAGE_TOKEN_FILE", raising=False)
        assert discover.watch(args, resolver=pods.get, rounds=1) == 0
        assert "answered 401" in capsys.readouterr().err
        monkeypatch.setenv("MINDIE_MS_COORDINATOR_MANAGE_TOKEN_FILE", str(token))
        assert discover.watch(args, resolver=pods.get, rounds=1) == 0
        assert "discover: refreshed 1 instance(s): 0 127.0.0.1" in capsys.readouterr().out
        info = httpx.get(coord.manage + "/v1/coordinator_info", timeout=5,
                         headers={"Authorization": "Bearer s3cret-token"}).json()
        assert [(i["id"], i["business_port"]) for i in info["instances"]] == [(0, dead)], info
        token.chmod(0o644)
        assert discover.watch(args, resolver=pods.get, rounds=1) == 2
        assert "chmod 600" in capsys.readouterr().err
    finally:
        coord.stop()
