"""Deploying a prefill/decode fleet (issue 32, item 7), fast checks without a model:

- scripts/motor.sh derives MindIE's PD user_config.json (deploy_mode pd_separate,
  deploy_config.p_instances_num/d_instances_num, mindie_server_prefill_config/_decode_config):
  instances numbered prefill first, each running its role's config, the coordinator's records
  carrying the roles, the coordinator's loader taking the result;
- deploy/k8s/motor-pd/: two StatefulSets (prefill, decode) behind their headless Services, each
  on its role's config.json from the ConfigMap (loaded by the server's loader), their KV endpoints
  on tcp at the pod's IP with CURVE keys from a Secret (the init container that copies them run
  for real), and a coordinator
  whose init container renders (for real, with a stand-in resolver) a pd_separate config with
  both StatefulSets' pods and their roles, which the coordinator's loader takes; the sidecar's
  refresh carries MindIE's static_info role codes, which the coordinator reads back."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from mindie.config import load_config  # noqa: E402
from coordinator.config import load as load_coordinator  # noqa: E402
from coordinator.pd_pairing import role_from_static  # noqa: E402
from coordinator.fleet import discover  # noqa: E402
from mindie.ops.curve_keys import create_key_dir  # noqa: E402
from mindie.topology import build_deployment  # noqa: E402
from tests.harness import ROOT  # noqa: E402
from tests.test_motor import motor, server_config as motor_server_config  # noqa: E402

PD = ROOT / "deploy" / "k8s" / "motor-pd"


def pd_user_config(path: Path, *, predict: int, manage: int, p: int = 1, d: int = 1, model: str = "/m") -> Path:
    doc = {"version": "v1.0",
           "deploy_config": {"p_instances_num": p, "d_instances_num": d, "image_name": "mindie:any"},
           "mindie_ms_controller_config": {"deploy_mode": "pd_separate", "digs_prefill_slo": 1000},
           "mindie_ms_coordinator_config": {
               "http_config": {"predict_ip": "127.0.0.1", "predict_port": str(predict),
                               "manage_ip": "127.0.0.1", "manage_port": str(manage)},
               "exception_config": {"max_retry": 2, "first_token_timeout": 30, "infer_timeout": 60},
               "digs_scheduler_config": {"deploy_mode": "pd_separate", "algorithm_type": "load_balance"}},
           "mindie_server_prefill_config": motor_server_config(model),
           "mindie_server_decode_config": motor_server_config(model)}
    path.write_text(json.dumps(doc))
    return path


def test_motor_derives_a_pd_fleet(tmp_path) -> None:
    cfg = pd_user_config(tmp_path / "u.json", predict=21125, manage=21126, p=1, d=2)
    r = motor("plan", "--config", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["deploy_mode"] == "pd_separate"
    assert [(i["name"], i["role"]) for i in plan["instances"]] == [("i0", "prefill"), ("i1", "decode"),
                                                                   ("i2", "decode")]
    loaded = load_coordinator(plan["coordinator_config"], env={}).config
    assert loaded.digs_scheduler_config.deploy_mode == "pd_separate"
    assert [(i.id, i.role, i.business_port) for i in loaded.instances] == [
        (i["id"], i["role"], i["business_port"]) for i in plan["instances"]]
    # each instance starts in its role (the server's own key)
    for i in plan["instances"]:
        assert json.loads(Path(i["config"]).read_text())["ServerConfig"]["pdRole"] == i["role"]
    assert len({i["business_port"] for i in plan["instances"]}) == 3
    # p + d beyond one host's 16 instances: refused naming the key
    cfg = pd_user_config(tmp_path / "u2.json", predict=21125, manage=21126, p=10, d=7)
    r = motor("plan", "--config", str(cfg), "--run-dir", str(tmp_path / "run2"))
    assert r.returncode == 2 and "deploy_config.d_instances_num: p_instances_num + d_instances_num = 17" in r.stderr
    # a PD fleet with neither role's config: refused naming the missing key
    doc = json.loads(cfg.read_text())
    doc["deploy_config"].update(p_instances_num=1, d_instances_num=1)
    del doc["mindie_server_decode_config"]
    cfg.write_text(json.dumps(doc))
    r = motor("plan", "--config", str(cfg), "--run-dir", str(tmp_path / "run3"))
    assert r.returncode == 2 and "mindie_server_decode_config: is required with deploy_mode pd_separate" in r.stderr
    # typos in both roles' configs: named together, as in this file (one decode instance or two alike)
    doc["mindie_server_decode_config"] = motor_server_config("/m")
    doc["deploy_config"].update(d_instances_num=2)
    doc["mindie_server_prefill_config"]["ServerConfig"]["managmentPort"] = 1
    doc["mindie_server_decode_config"]["ServerConfig"]["zzzqqq"] = 1
    cfg.write_text(json.dumps(doc))
    r = motor("plan", "--config", str(cfg), "--run-dir", str(tmp_path / "run4"))
    assert r.returncode == 2 and (
        "2 unknown keys (not MindIE config.json keys nor project extensions): "
        "mindie_server_prefill_config.ServerConfig.managmentPort (did you mean "
        "mindie_server_prefill_config.ServerConfig.managementPort?); mindie_server_decode_config.ServerConfig.zzzqqq"
    ) in r.stderr, r.stderr


def docs() -> list[dict]:
    return [d for p in sorted(PD.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def named(kind: str, name: str) -> dict:
    (d,) = [d for d in docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    return d


def _pod_kv_link(pod: dict, tmp: Path) -> tuple[Path, dict]:
    """Run the pod's init container ``curve-keys`` for real (sh) on a stand-in of its Secret volume
    (a key directory made by mindie.ops.curve_keys, the Secret's items at their paths, group-readable
    as the kubelet leaves them with fsGroup): (the directory it filled, the server's env with the
    downward API's pod IP as 10.2.0.7)."""
    (init,) = [c for c in pod["initContainers"] if c["name"] == "curve-keys"]
    (svol,) = [v for v in pod["volumes"] if v["name"] == "curve-secret"]
    made = tmp / "made"
    create_key_dir(str(made))
    secret, out = tmp / "secret", tmp / "curve"
    out.mkdir()
    for it in svol["secret"]["items"]:
        # the Secret's keys: the file's path in the key directory, "/" written "."
        assert it["key"] == it["path"].replace("/", "."), it
        dst = secret / it["path"]
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(made / it["path"], dst)
        os.chmod(dst, 0o440)
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert init["command"][:2] == ["sh", "-c"]
    cmd = init["command"][2].replace(mounts["curve-secret"], str(secret)).replace(mounts["curve"], str(out))
    r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    (srv,) = pod["containers"]
    (host,) = [e for e in srv["env"] if e["name"] == "MINDIE_KV_TRANSFER_HOST"]
    assert host["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    return out, {"MINDIE_KV_TRANSFER_HOST": "10.2.0.7"}


def test_pd_manifests_two_statefulsets_behind_the_coordinator(tmp_path, monkeypatch) -> None:
    kinds = sorted(d["kind"] for d in docs())
    assert kinds == ["ConfigMap", "Deployment", "Service", "Service", "Service", "Service", "StatefulSet",
                     "StatefulSet"], kinds
    (cm,) = [d for d in docs() if d["kind"] == "ConfigMap"]
    sets = {}
    for role in ("prefill", "decode"):
        ss = named("StatefulSet", f"mindie-{role}")
        svc = named("Service", ss["spec"]["serviceName"])
        labels = ss["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"].items() <= labels.items()
        assert labels["app.kubernetes.io/component"] == role
        pod = ss["spec"]["template"]["spec"]
        (vol,) = [v for v in pod["volumes"] if v["name"] == "config"]
        assert vol["configMap"]["name"] == cm["metadata"]["name"]
        (item,) = vol["configMap"]["items"]
        assert item == {"key": f"{role}.json", "path": "config.json"}
        # KV over tcp + CURVE pod to pod: the keys as the init container leaves them, the pod's IP
        # from the downward API, the config as the server loads it
        key_dir, env = _pod_kv_link(pod, tmp_path / role)
        doc = json.loads(cm["data"][item["key"]])
        assert doc["ServerConfig"]["inferMode"] == "dmi" and doc["ServerConfig"]["interCommPort"] == 1121
        (mount,) = [m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] == "curve"]
        kd = doc["BackendConfig"]["workerCurveKeyDir"]
        assert kd.startswith(mount + "/")
        doc["BackendConfig"]["workerCurveKeyDir"] = str(key_dir / kd[len(mount) + 1:])
        p = tmp_path / f"{role}.json"
        p.write_text(json.dumps(doc))
        loaded = load_config(str(p), env=env)
        assert not loaded.unknown, loaded.unknown
        assert loaded.config.server.pd_role == role  # each StatefulSet's pods start in their role
        workers = build_deployment(loaded.config).workers
        assert [w.kv_tcp_endpoint for w in workers] == [f"tcp://10.2.0.7:{1121 + i}" for i in range(len(workers))]
        assert all(w.kv_endpoint.startswith("ipc://") for w in workers)  # and ipc for peers in the pod
        sets[role] = (ss, loaded.config.server)
    # the two roles' pods are told apart by their Services (neither selects the other's pods)
    for a, b in (("prefill", "decode"), ("decode", "prefill")):
        svc = named("Service", f"mindie-{a}")
        assert not svc["spec"]["selector"].items() <= sets[b][0]["spec"]["template"]["metadata"]["labels"].items()
    dep = named("Deployment", "mindie-ms-coordinator-pd")
    pod = dep["spec"]["template"]["spec"]
    (init,) = [c for c in pod["initContainers"] if c["name"] == "discover"]
    (side,) = [c for c in pod["initContainers"] if c["name"] == "refresh"]
    template = tmp_path / "t.json"
    template.write_text(cm["data"]["ms_coordinator.json"])
    out = tmp_path / "ms_coordinator.json"
    argv = list(init["command"][4:])
    argv[argv.index("--template") + 1] = str(template)
    argv[argv.index("--out") + 1] = str(out)
    argv[argv.index("--wait") + 1] = "1"
    monkeypatch.setenv("POD_NAMESPACE", "mindie")
    args = discover.parse_args(["render", *argv])
    names = {}
    for role, (ss, s) in sets.items():
        assert (args.business_port, args.mgmt_port) == (s.port, s.management_port)
        for k in range(ss["spec"]["replicas"] + 1):  # one more pod than the manifest: scaled up
            names[f"{ss['metadata']['name']}-{k}.{ss['spec']['serviceName']}.mindie.svc.cluster.local"] = "10.2.0.1"
    assert discover.render(args, resolver=names.get) == 0
    c = load_coordinator(str(out), env={}).config
    assert c.digs_scheduler_config.deploy_mode == "pd_separate"
    got = sorted((i.role, i.ip.split(".")[0]) for i in c.instances)
    want = sorted((role, f"{ss['metadata']['name']}-{k}") for role, (ss, _) in sets.items()
                  for k in range(ss["spec"]["replicas"] + 1))
    assert got == want
    assert len({i.id for i in c.instances}) == len(c.instances)
    # the sidecar's refresh: the same groups; its static_info codes read back as the roles
    wargs = discover.parse_args(side["command"][3:])
    assert wargs.group == args.group
    body = discover.refresh_body(discover.discover(wargs, names.get), 1026)
    assert sorted(role_from_static(i["static_info"]) for i in body["instances"]) == sorted(i.role for i in c.instances)
