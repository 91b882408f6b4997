"""The deployment files agree with the server they deploy: deploy/k8s/*.yaml (the ConfigMap's
config.json loads with the server's own loader; ports, paths, scripts, probe modes, grace period
against the prestop wait), deploy/mindie.service and deploy/Dockerfile, whose entry command,
HEALTHCHECK and the Kubernetes probe and preStop commands are then run for real, outside any
container, on loopback with free ports."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")  # PyYAML: setup.cfg [test] extras

from mindie.ops import probe  # noqa: E402
from mindie.config import load_config  # noqa: E402
from mindie.server.listeners import plan_listeners  # noqa: E402
from tests.harness import ROOT, alive, free_port, free_ports, process_roles, short_run_dir, wait_gone, write_config  # noqa: E402

pytestmark = pytest.mark.timeout(300)

K8S = ROOT / "deploy" / "k8s"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
UNIT = ROOT / "deploy" / "mindie.service"
PLANE_PORT = {"business": "port", "management": "management_port", "metrics": "metrics_port"}
LAUNCHER_STOP_MARGIN_S = 10  # launch.sh after its drain: the front ends and the workers stop
CUT_GRACE_S = 3  # after the drain bound: the front ends cut what still runs (mindie/ops/launcher_drain.py)


def stop_deadline(wait: float, drain: float) -> float:
    """The stop deadline an orchestrator needs: the drain runs once, whichever comes first
    (preStop's /stopService or SIGTERM), and ends drainTimeoutS + the cut after it began; preStop
    returns by ``wait``; then the launcher stops what is left."""
    return max(wait, drain + CUT_GRACE_S) + LAUNCHER_STOP_MARGIN_S


# -- parsing -------------------------------------------------------------------------------------
def manifests() -> dict[str, list[dict]]:
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in sorted(K8S.glob("*.yaml"))}


def one(kind: str) -> list[dict]:
    return [d for docs in manifests().values() for d in docs if d["kind"] == kind]


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def docker_values(name: str) -> list[str]:
    return [rest for word, rest in dockerfile() if word == name]


def exec_form(text: str) -> list[str]:
    return json.loads(text) if text.startswith("[") else ["/bin/sh", "-c", text]


def image_root() -> str:
    return docker_values("WORKDIR")[-1]


def in_repo(path: str) -> Path:
    """The repository file an absolute path inside the image names."""
    root = image_root().rstrip("/") + "/"
    assert path.startswith(root), f"{path} is not inside the image's repository {root}"
    return ROOT / path[len(root):]


def local_command(cmd: list[str]) -> list[str]:
    """An image command run here: its script from this checkout, run by bash."""
    script = in_repo(cmd[0])
    assert script.is_file() and os.access(script, os.X_OK), f"{cmd[0]}: {script} is not an executable file"
    return ["bash", str(script), *cmd[1:]]


def unit() -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def configmap_config(tmp_path: Path) -> tuple[Path, object]:
    (cm,) = one("ConfigMap")
    path = tmp_path / "config.json"
    path.write_text(cm["data"]["config.json"])
    return path, load_config(str(path), env={})


def container() -> dict:
    (dep,) = one("Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


# -- Kubernetes ------------------------------------------------------------------------------------
def test_every_manifest_loads() -> None:
    found = manifests()
    assert set(found) == {"configmap.yaml", "deployment.yaml", "services.yaml"}, found
    kinds = sorted(d["kind"] for docs in found.values() for d in docs)
    assert kinds == ["ConfigMap", "Deployment", "Service", "Service", "Service"]
    for docs in found.values():
        for d in docs:
            assert d["apiVersion"] and d["metadata"]["name"], d


def test_configmap_config_loads_with_the_server_loader(tmp_path) -> None:
    path, loaded = configmap_config(tmp_path)
    cfg = loaded.config
    assert cfg.backend.device_type == "npu"
    assert cfg.backend.npu_device_ids == [[i] for i in range(8)]
    s = cfg.server
    assert s.ip_address == s.management_ip_address == "0.0.0.0" and s.allow_all_zero_ip_listening
    listeners = plan_listeners(s)
    assert [(li.host, li.port, li.planes) for li in listeners] == [
        ("0.0.0.0", 1025, ("business",)), ("0.0.0.0", 1026, ("management",)), ("0.0.0.0", 1027, ("metrics",))]
    assert not s.https_enabled and all(li.tls is None for li in listeners)
    # The probe asks the same planner: a pod's 0.0.0.0 is probed on loopback.
    t = probe.management_target(str(path), env={})
    assert (t.host, t.port) == ("127.0.0.1", 1026)
    # Without allowAllZeroIpListening the file would be refused.
    raw = json.loads(path.read_text())
    raw["ServerConfig"]["allowAllZeroIpListening"] = False
    path.write_text(json.dumps(raw))
    with pytest.raises(Exception, match="allowAllZeroIpListening"):
        load_config(str(path), env={})


def test_deployment_agrees_with_the_config_and_the_scripts(tmp_path) -> None:
    _, loaded = configmap_config(tmp_path)
    s = loaded.config.server
    (dep,) = one("Deployment")
    (cm,) = one("ConfigMap")
    pod = dep["spec"]["template"]["spec"]
    c = container()
    env = env_of(c)
    # One pod per 8-NPU node, all 8 NPUs: as many as npuDeviceIds has workers.
    n = len(loaded.config.backend.npu_device_ids)
    assert c["resources"]["limits"]["huawei.com/Ascend910"] == n == 8
    assert c["resources"]["requests"]["huawei.com/Ascend910"] == n
    labels = pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= labels.items()
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0  # no spare node to surge onto
    # The ConfigMap mounted where MIES_CONFIG_JSON_PATH points.
    cfg_path = env["MIES_CONFIG_JSON_PATH"]
    vols = {v["name"]: v for v in pod["volumes"]}
    mounts = [m for m in c["volumeMounts"] if cfg_path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(mounts) == 1, mounts
    vol = vols[mounts[0]["name"]]["configMap"]
    assert vol["name"] == cm["metadata"]["name"]
    item = {i["path"]: i["key"] for i in vol.get("items", [])}
    rel = cfg_path[len(mounts[0]["mountPath"].rstrip("/")) + 1:]
    assert item.get(rel, rel) == "config.json" and "config.json" in cm["data"]
    # The container runs the image's launcher from the image's repository.
    assert c["workingDir"] == image_root()
    assert local_command(c["command"])[1] == str(ROOT / "scripts" / "launch.sh")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {plane: getattr(s, attr) for plane, attr in PLANE_PORT.items()}
    # Probes: the repository's health_check.sh with a valid mode each, timeouts that fit.
    for kind, modes in (("startupProbe", {"startup"}), ("readinessProbe", {"readiness"}),
                        ("livenessProbe", {"liveness", "timed"})):
        p = c[kind]
        cmd = local_command(p["exec"]["command"])
        assert Path(cmd[1]).name == "health_check.sh", cmd
        args = probe.parse_args(cmd[2:])
        assert args.mode in modes, (kind, args.mode)
        limit = args.timeout or (args.n + 2 if args.mode == "timed" else probe.DEFAULT_TIMEOUT_S)
        assert p["timeoutSeconds"] >= limit + 1, (kind, "the kubelet must not cut the probe short")
    startup = c["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 600, "model load needs minutes"
    # preStop drains; the grace period covers its wait and the launcher's own stop after it.
    cmd = local_command(c["lifecycle"]["preStop"]["exec"]["command"])
    assert Path(cmd[1]).name == "prestop.sh"
    wait = float(env.get("MINDIE_PRESTOP_WAIT", probe.DEFAULT_STOP_WAIT_S))
    for i, a in enumerate(cmd):
        if a == "--wait":
            wait = float(cmd[i + 1])
    drain = load_config(str(configmap_config(tmp_path)[0]), env=env).config.server.drain_timeout_s
    assert drain >= 60, "let long generations finish"
    assert wait >= drain + CUT_GRACE_S, "preStop waits for the drain to end"
    assert pod["terminationGracePeriodSeconds"] >= stop_deadline(wait, drain), (wait, drain)


def test_services_match_the_planes(tmp_path) -> None:
    _, loaded = configmap_config(tmp_path)
    s = loaded.config.server
    c = container()
    (dep,) = one("Deployment")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    names = {p["name"]: p["containerPort"] for p in c["ports"]}
    by_plane = {}
    for svc in one("Service"):
        assert svc["spec"]["selector"].items() <= pod_labels.items(), svc["metadata"]["name"]
        (port,) = svc["spec"]["ports"]
        target = port["targetPort"]
        by_plane[port["name"]] = (port["port"], names[target] if isinstance(target, str) else target, svc)
    assert set(by_plane) == set(PLANE_PORT)
    for plane, attr in PLANE_PORT.items():
        port, target, _ = by_plane[plane]
        assert port == target == getattr(s, attr), plane
    ann = by_plane["metrics"][2]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) == s.metrics_port and ann["prometheus.io/path"] == "/metrics"
    assert ann.get("prometheus.io/scheme", "http") == ("https" if s.https_enabled else "http")
    # Only the business plane is for clients.
    for plane in ("management", "metrics"):
        assert by_plane[plane][2]["spec"].get("type", "ClusterIP") == "ClusterIP"


def test_k8s_readme_and_operations_doc_name_the_files() -> None:
    readme = (K8S / "README.md").read_text()
    for name in ("deployment.yaml", "configmap.yaml", "services.yaml", "health_check.sh", "prestop.sh"):
        assert name in readme, name
    ops = (ROOT / "docs" / "operations.md").read_text()
    for name in ("health_check.sh", "prestop.sh", "deploy/k8s", "mindie.service", "Dockerfile", "/stopService"):
        assert name in ops, name


# -- systemd ---------------------------------------------------------------------------------------
def test_systemd_unit_refers_to_existing_scripts() -> None:
    u = unit()
    svc = u["Service"]
    workdir = svc["WorkingDirectory"][0]
    assert workdir == image_root()  # the same layout as the image: /opt/mindie-py
    env = dict(e.partition("=")[::2] for e in svc.get("Environment", []))

    def local(cmdline: str) -> list[str]:
        words = shlex.split(re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), m.group(0)), cmdline))
        return local_command(words)

    (start,) = svc["ExecStart"]
    cmd = local(start)
    assert Path(cmd[1]).name == "launch.sh" and cmd[2:4] == ["--config", env["MIES_CONFIG_JSON_PATH"]], cmd
    (reload,) = svc["ExecReload"]
    assert re.fullmatch(r"/bin/kill -HUP \$MAINPID", reload), reload  # launch.sh: SIGHUP reloads
    stops = svc.get("ExecStop", [])
    for stop in stops:
        cmd = local(stop)
        assert Path(cmd[1]).name == "prestop.sh", cmd
    assert svc["KillSignal"] == ["SIGTERM"]
    assert svc["Restart"] == ["on-failure"]
    # Exit status 2 is a refused start (config, model, a worker that cannot start): not retried.
    assert svc["RestartPreventExitStatus"] == ["2"]
    wait = float(env.get("MINDIE_PRESTOP_WAIT", probe.DEFAULT_STOP_WAIT_S)) if stops else 0
    drain = load_config(None, env={k: v for k, v in env.items() if k != "MIES_CONFIG_JSON_PATH"}
                        ).config.server.drain_timeout_s  # the unit's MINDIE_GRACEFUL_TIMEOUT
    assert drain >= 60 and (not stops or wait >= drain + CUT_GRACE_S)
    assert float(svc["TimeoutStopSec"][0]) >= stop_deadline(wait, drain)


# -- Docker ------------------------------------------------------------------------------------------
def test_dockerfile_builds_what_the_readme_says(tmp_path) -> None:
    instr = dockerfile()
    args = dict(a.partition("=")[::2] for a in docker_values("ARG"))
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    assert instr[0][0] == "ARG" and docker_values("FROM") == ["${BASE_IMAGE}"]
    runs = " ".join(docker_values("RUN"))
    assert args["TORCH_SPEC"] == "torch==2.13.0" and "download.pytorch.org/whl/cpu" in args["TORCH_INDEX"]
    assert runs.index("$TORCH_SPEC") < runs.index("pip install \".")  # torch pinned first, then the project
    # The baked config, made here as the image makes it: it loads, and EXPOSE lists its planes.
    (bake,) = [r for r in docker_values("RUN") if "/etc/mindie/config.json" in r]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # A wrapper, not a symlink: a venv's python found through a link elsewhere loses its venv
    # (no pyvenv.cfg beside the link) and with it the project's dependencies.
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    etc = tmp_path / "etc-mindie"
    subprocess.run(["bash", "-c", bake.replace("/etc/mindie", str(etc))], cwd=ROOT, check=True,
                   env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    s = load_config(str(etc / "config.json"), env={}).config.server
    assert s.ip_address == s.management_ip_address == "0.0.0.0"
    exposed = sorted(int(p) for v in docker_values("EXPOSE") for p in v.split())
    assert exposed == sorted({s.port, s.management_port, s.metrics_port}) == [1025, 1026, 1027]
    env = docker_env()
    assert env["MIES_CONFIG_JSON_PATH"] == "/etc/mindie/config.json"
    # HEALTHCHECK: health_check.sh with a valid mode; the entry command: the launcher.
    (hc,) = docker_values("HEALTHCHECK")
    cmd = local_command(exec_form(hc.split(" CMD ", 1)[1]))
    assert Path(cmd[1]).name == "health_check.sh"
    assert probe.parse_args(cmd[2:]).mode in ("liveness", "readiness", "startup")
    assert Path(local_command(entry_command())[1]).name == "launch.sh"


def docker_env() -> dict[str, str]:
    env = {}
    for v in docker_values("ENV"):
        for word in shlex.split(v):
            k, _, val = word.partition("=")
            env[k] = val
    return env


def entry_command() -> list[str]:
    entry = exec_form(docker_values("ENTRYPOINT")[-1]) if docker_values("ENTRYPOINT") else []
    cmd = exec_form(docker_values("CMD")[-1]) if docker_values("CMD") else []
    return entry + cmd


def test_image_commands_run_a_real_server(tmp_path, demo_model) -> None:
    """The Dockerfile's ENTRYPOINT + CMD run here with its ENV (config moved to free loopback
    ports), then its HEALTHCHECK, the Deployment's three probes and its preStop hook: healthy,
    then drained, and nothing left running."""
    port, mport, xport = free_ports(3)
    cfg = write_config(tmp_path / "config.json", port=port, run_dir=short_run_dir(), model_path=demo_model,
                       workers=1, server={"managementIpAddress": "127.0.0.2", "managementPort": mport,
                                          "metricsPort": xport})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MIES_", "MINDIE_"))}
    env.update(docker_env())
    env.update(PYTHON=sys.executable, MIES_CONFIG_JSON_PATH=str(cfg), MINDIE_FRONTENDS="1")
    c = container()
    env.update({k: v for k, v in env_of(c).items() if k != "MIES_CONFIG_JSON_PATH"})  # the pod's too
    log = open(tmp_path / "server.log", "wb")
    server = subprocess.Popen(local_command(entry_command()), stdout=log, stderr=subprocess.STDOUT, env=env,
                              cwd=ROOT)

    def run(cmd: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(local_command(cmd), capture_output=True, text=True, env=env, timeout=60, cwd="/")

    def tail() -> str:
        log.flush()
        return (tmp_path / "server.log").read_text(errors="replace")[-3000:]

    try:
        (hc,) = docker_values("HEALTHCHECK")
        healthcheck = exec_form(hc.split(" CMD ", 1)[1])
        deadline = time.monotonic() + 90
        while (r := run(healthcheck)).returncode != 0:
            assert server.poll() is None, tail()
            assert time.monotonic() < deadline, (r.stderr, tail())
            time.sleep(0.3)
        assert r.stdout.startswith(f"healthy: 200 from http://127.0.0.2:{mport}/"), r.stdout
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            r = run(c[kind]["exec"]["command"])
            assert r.returncode == 0, (kind, r.stdout, r.stderr)
        pids = list(process_roles(server.pid))
        assert pids
        r = run(c["lifecycle"]["preStop"]["exec"]["command"])
        assert r.returncode == 0 and r.stdout.startswith("drained: "), (r.stdout, r.stderr, tail())
        assert server.wait(30) == 0, tail()
        assert wait_gone(pids, 30) is not None, [p for p in pids if alive(p)]
        r = run(c["readinessProbe"]["exec"]["command"])
        assert r.returncode == probe.NOT_RUNNING, r.stderr
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
        log.close()


def test_image_entry_command_stops_on_sigterm(tmp_path, demo_model) -> None:
    """docker stop: STOPSIGNAL to the entry command; exit 0 well within the default 10 s wait
    when nothing is in flight."""
    port = free_port()
    cfg = write_config(tmp_path / "config.json", port=port, run_dir=short_run_dir(), model_path=demo_model,
                       workers=1)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MIES_", "MINDIE_"))}
    env.update(docker_env())
    env.update(PYTHON=sys.executable, MIES_CONFIG_JSON_PATH=str(cfg), MINDIE_FRONTENDS="1")
    log = open(tmp_path / "server.log", "wb")
    server = subprocess.Popen(local_command(entry_command()), stdout=log, stderr=subprocess.STDOUT, env=env,
                              cwd=ROOT)
    try:
        (hc,) = docker_values("HEALTHCHECK")
        cmd = local_command(exec_form(hc.split(" CMD ", 1)[1]))
        deadline = time.monotonic() + 90
        while subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.3)
        stopsignal = (docker_values("STOPSIGNAL") or ["SIGTERM"])[-1]
        server.send_signal(getattr(signal, stopsignal))
        assert server.wait(10) == 0
    finally:
        if server.poll() is None:
            server.kill()
        log.close()
