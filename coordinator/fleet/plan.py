"""A local MindIE Motor fleet from MindIE's ``user_config.json``: one coordinator in front of N
server instances on this host (``scripts/motor.sh``).

    python -m coordinator.fleet.launcher plan --config user_config.json [--run-dir DIR]   # derive, write, print
    python -m coordinator.fleet.launcher run  --config user_config.json [--run-dir DIR] [-- LAUNCH.SH OPTIONS]

``user_config.json`` is MindIE Motor's deploy file (``deploy_config``, ``mindie_ms_controller_config``,
``mindie_ms_coordinator_config``, ``mindie_server_prefill_config``, ``mindie_server_decode_config``).
MindIE deploys it to Kubernetes; here it starts processes on one host. What is read:

- the deploy mode: ``mindie_ms_controller_config.deploy_mode`` and/or
  ``mindie_ms_coordinator_config.digs_scheduler_config.deploy_mode`` (they must agree; default
  ``single_node``). ``pd_separate``: ``deploy_config.p_instances_num`` prefill instances running
  ``mindie_server_prefill_config`` and ``d_instances_num`` decode instances running
  ``mindie_server_decode_config`` (a missing one: ``mindie_server_config``), the coordinator
  handing each request from a prefill to a decode instance (coordinator/pd.py); the port
  layout is the prefill config's, instances numbered prefill first. The other PD forms
  (``pd_disaggregation``, ``pd_disaggregation_single_container``) are refused.
- single_node: ``deploy_config.replicas`` instances (MindIE's name for the instance count of a
  single-node service, infer_server.json; default 1, at most 16 on one host), each running the
  server config ``mindie_server_config`` (a whole config.json; this project's name for the
  single_node form, after MindIE's ``mindie_server_prefill_config``/``_decode_config``).
- ``mindie_ms_coordinator_config``: the coordinator's ms_coordinator.json, less ``instances``,
  which is derived here.

Every other MindIE deploy key (images, pods, NPUs per pod, mounts, Kubernetes TLS, the
Controller's tunables) is accepted and reported as not applied on one host; an unknown key (a
typo) is refused naming it and the closest known key.

Derived per instance k (0-based): the server's three planes at ``ServerConfig.port`` (default:
the port after the coordinator's highest) + k x stride, each plane keeping its offset from
``port`` (default: management +1, as ``scripts/launch.sh -p`` moves it, and metrics on the
management port, where the coordinator reads each instance's /metrics), stride = the span of
the planes; ``ServerConfig.runDir`` = ``<run dir>/i<k>``. Files written to the run directory
(default ``$XDG_RUNTIME_DIR/mindie-motor/<predict_port>``, else
``/tmp/mindie-py-<uid>/motor-<predict_port>``): ``i<k>.json`` (each instance's config.json),
``ms_coordinator.json`` (with the ``instances`` list), ``plan.json``; the run writes each
process's output to ``i<k>.log`` and ``coordinator.log`` there.

Devices: with ``BackendConfig.deviceType`` npu or cuda, ``npuDeviceIds`` is instance 0's and
instance k's is moved up by k times its span (``[[0], [1]]``: i1 gets ``[[2], [3]]``).

Relative paths in the two configs (model weights, TLS files, chat templates, LoRA adapters) are
taken from the directory of ``user_config.json`` and written absolute.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

# Imported here, in the parent: the preexec_fn of a child must not dlopen (libc's prctl).
from mindie.runtime.lifecycle import die_with_parent

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "scripts" / "launch.sh"

SINGLE_NODE = "single_node"
PD_SEPARATE = "pd_separate"
PD_MODES = ("pd_separate", "pd_disaggregation", "pd_disaggregation_single_container")
PD_APPLIED = ("p_instances_num", "d_instances_num")  # deploy_config keys applied in pd_separate
MAX_INSTANCES = 16  # one host: each instance is a whole server (front ends + device workers)

TOP_KEYS = ("version", "deploy_config", "mindie_ms_controller_config", "mindie_ms_coordinator_config",
            "mindie_server_config", "mindie_server_prefill_config", "mindie_server_decode_config")
# MindIE's deploy_config keys (deploy_ac_job.py, validate_config.py): Kubernetes and NPU placement,
# accepted and not applied on one host. "replicas" is applied (single_node instance count).
DEPLOY_KEYS_NOT_APPLIED = (
    "p_instances_num", "d_instances_num", "single_p_instance_pod_num", "single_d_instance_pod_num",
    "p_pod_npu_num", "d_pod_npu_num", "p_instances_scale_num", "d_instances_scale_num", "model_id",
    "prefill_distribute_enable", "decode_distribute_enable", "image_name", "job_id", "hardware_type",
    "deploy_motor_on_intelligent_server", "mindie_env_path", "mindie_host_log_path",
    "mindie_container_log_path", "weight_mount_path", "coordinator_backup_cfg", "controller_backup_cfg",
    "deploy_mount_path", "tls_config")
# ms_controller.json's top-level keys (MindIE Motor src/config/ms_controller.json): there is no
# Controller in a local fleet; only deploy_mode is read.
CONTROLLER_KEYS = (
    "allow_all_zero_ip_listening", "check_role_attempt_times", "check_role_wait_seconds", "cluster_port",
    "cluster_status", "cluster_synchronization_seconds", "controller_alarm_port", "controller_backup_cfg",
    "default_d_rate", "default_p_rate", "deploy_mode", "digs_decode_slo", "digs_machine_config_path",
    "digs_model_config_path", "digs_periodic_role_decision", "digs_pp", "digs_prefill_slo",
    "digs_request_summary_input_length", "digs_request_summary_output_length",
    "disappeared_server_waiting_seconds", "fault_recovery_func_dict", "global_rank_table_file_path",
    "http_retries", "http_server", "http_timeout_seconds", "init_role_attempt_times", "initial_dist_server_port",
    "is_heterogeneous", "log_info", "mindie_ms_coordinator_external_port", "mindie_ms_coordinator_port",
    "mindie_server_control_port", "mindie_server_metric_port", "mindie_server_port", "model_type",
    "multi_node_infer_config", "node_manager_port", "process_manager", "rank_table_detecting_seconds",
    "role_decision_methods", "scaling_rule_file_path", "server_online_attempt_times",
    "server_online_wait_seconds", "tls_config", "transfer_type")
# Environment variables not passed to the instances: every override of a config key (launch.sh
# reads them over the config file, so they would move an instance off its derived config.json:
# mindie.config.ENV_OVERRIDES, added in instance_env()) and the launcher's own plumbing.
INSTANCE_ENV_DROPPED = ("MIES_CONFIG_JSON_PATH", "MINDIE_ROLE", "MINDIE_LAUNCHER_PID", "MINDIE_HUP_RESET")
COORDINATOR_ENV_DROPPED = ("MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH",)
# launch.sh options that the derivation sets: refused after "--".
LAUNCH_OPTIONS_DERIVED = ("-c", "--config", "-H", "--host", "-p", "--port", "--management-port",
                          "--metrics-port", "--run-dir", "--workers-only", "--frontends-only")

# Server config keys holding file paths (mindie.config._resolve_paths), relative to the config file.
SERVER_TLS_PATH_KEYS = ("tlsCaPath", "tlsCert", "tlsPk", "tlsPkPwd", "tlsCrlPath", "managementTlsCert",
                        "managementTlsPk", "managementTlsPkPwd", "managementTlsCrlPath", "metricsTlsCert",
                        "metricsTlsPk", "metricsTlsPkPwd", "metricsTlsCrlPath")
COORD_TLS_ITEM_PATHS = ("ca_cert", "tls_cert", "tls_key", "tls_passwd", "tls_crl")

DEFAULT_READY_TIMEOUT_S = 300.0
COORDINATOR_READY_TIMEOUT_S = 60.0
COORDINATOR_STOP_S = 10.0  # beyond its drainTimeoutS: the cut and the exit
RESTARTS = 3  # coordinator deaths within RESTART_WINDOW_S before the fleet gives up
RESTART_WINDOW_S = 60.0


class FleetError(Exception):
    """A user_config.json problem, worded ``<dotted key>: <what is wrong>``."""

    def __init__(self, message: str, key: Optional[str] = None):
        super().__init__(f"{key}: {message}" if key else message)


@dataclass
class Instance:
    id: int
    name: str           # i<k>
    config: str         # its config.json
    run_dir: str        # its ServerConfig.runDir
    log: str
    ip: str             # where the coordinator and probes connect (business plane)
    business_port: int
    mgmt_ip: str
    mgmt_port: int
    metrics_port: int
    https: bool
    drain_timeout_s: float
    role: str = ""      # pd_separate: prefill | decode


@dataclass
class Plan:
    run_dir: str
    source: str
    deploy_mode: str
    coordinator_config: str
    coordinator_log: str
    predict_url: str
    manage_url: str
    manage_host: str
    manage_port: int
    coordinator_drain_s: float = 30.0  # its http_config.drainTimeoutS: what its SIGTERM lets finish
    instances: list[Instance] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# -- reading -----------------------------------------------------------------------------------------
def _close(key: str, known) -> str:
    m = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f": did you mean {m[0]}?" if m else ""


def _obj(raw: dict, key: str, where: str) -> dict:
    v = raw.get(key, {})
    if not isinstance(v, dict):
        raise FleetError(f"must be a JSON object, got {type(v).__name__}", f"{where}{key}")
    return v


def _int(value: Any, key: str, lo: int, hi: int) -> int:
    """MindIE writes numbers as strings as often as not ("1025")."""
    try:
        n = int(str(value).strip()) if not isinstance(value, bool) else None
    except ValueError:
        n = None
    if n is None or not lo <= n <= hi:
        raise FleetError(f"must be an integer in [{lo}, {hi}], got {json.dumps(value)}", key)
    return n


def read_user_config(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except OSError as e:
        raise FleetError(f"cannot read {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise FleetError(f"{path}: line {e.lineno}, column {e.colno}: invalid JSON: {e.msg}") from None
    if not isinstance(raw, dict):
        raise FleetError(f"{path}: the top level must be a JSON object, got {type(raw).__name__}")
    return raw


def deploy_mode(raw: dict) -> str:
    ctl = _obj(raw, "mindie_ms_controller_config", "")
    coord = _obj(raw, "mindie_ms_coordinator_config", "")
    digs = _obj(coord, "digs_scheduler_config", "mindie_ms_coordinator_config.")
    modes = {k: v for k, v in (("mindie_ms_controller_config.deploy_mode", ctl.get("deploy_mode")),
                               ("mindie_ms_coordinator_config.digs_scheduler_config.deploy_mode",
                                digs.get("deploy_mode"))) if v is not None}
    if len(set(map(str, modes.values()))) > 1:
        (k1, v1), (k2, v2) = modes.items()
        raise FleetError(f"{json.dumps(v1)} disagrees with {k2} {json.dumps(v2)}", k1)
    key, mode = next(iter(modes.items()), ("deploy_mode", SINGLE_NODE))
    if mode in PD_MODES and mode != PD_SEPARATE:
        raise FleetError(f"{mode} is not supported by motor.sh: \"pd_separate\" starts prefill and decode "
                         "instances (deploy_config.p_instances_num, d_instances_num) behind the coordinator; "
                         "\"single_node\" starts N identical ones", key)
    if mode not in (SINGLE_NODE, PD_SEPARATE):
        raise FleetError(f"must be \"single_node\" or \"pd_separate\", got {json.dumps(mode)}", key)
    return mode


def _check_keys(raw: dict, mode: str = SINGLE_NODE) -> list[str]:
    """Refuse unknown keys naming every one; notes for MindIE keys not applied here."""
    notes: list[str] = []
    unknown: list[tuple[str, str]] = []  # (key, " (why)" or ": did you mean X?")
    for key in raw:
        if not key.startswith("//") and key not in TOP_KEYS:
            unknown.append((key, _close(key, TOP_KEYS) or " (not a MindIE user_config.json key)"))
    if mode != PD_SEPARATE:
        for key in ("mindie_server_prefill_config", "mindie_server_decode_config"):
            if key in raw:
                raise FleetError("belongs to deploy_mode pd_separate; single_node instances run "
                                 "mindie_server_config", key)
    dc = _obj(raw, "deploy_config", "")
    for key in dc:
        if key.startswith("//") or key == "replicas" or (mode == PD_SEPARATE and key in PD_APPLIED):
            continue
        if key in DEPLOY_KEYS_NOT_APPLIED:
            notes.append(f"deploy_config.{key}: accepted, not applied on one host (Kubernetes/NPU placement)")
        else:
            unknown.append((f"deploy_config.{key}", _close(key, DEPLOY_KEYS_NOT_APPLIED + ("replicas",))
                            or " (not a MindIE deploy_config key)"))
    ctl = _obj(raw, "mindie_ms_controller_config", "")
    for key in ctl:
        if key.startswith("//") or key == "deploy_mode":
            continue
        if key in CONTROLLER_KEYS:
            notes.append(f"mindie_ms_controller_config.{key}: accepted, not applied (no Controller in a local fleet)")
        else:
            unknown.append((f"mindie_ms_controller_config.{key}", _close(key, CONTROLLER_KEYS)
                            or " (not a MindIE ms_controller.json key)"))
    if len(unknown) == 1:
        raise FleetError("unknown key" + unknown[0][1], unknown[0][0])
    if unknown:
        raise FleetError(f"{len(unknown)} unknown keys: " + "; ".join(
            key + (f" ({why[2:]})" if why.startswith(": ") else why) for key, why in unknown))
    return notes


def _devices(cfg: dict, k: int) -> None:
    """Instance k's accelerators: ``npuDeviceIds`` as written for one instance, moved up by k
    times their span (``[[0], [1]]``: i0 ``[[0], [1]]``, i1 ``[[2], [3]]``), so the instances of one
    host do not share a device. Only for an explicit ``deviceType`` npu or cuda: CPU workers
    (and "auto", which may be either) keep the ids as written."""
    bc = cfg.get("BackendConfig")
    if not isinstance(bc, dict) or bc.get("deviceType") not in ("npu", "cuda") or not k:
        return
    ids = bc.get("npuDeviceIds", [[0]])
    try:
        flat = [int(d) for group in ids for d in group]
        span = max(flat) - min(flat) + 1
        bc["npuDeviceIds"] = [[int(d) + k * span for d in group] for group in ids]
    except (TypeError, ValueError):
        return  # malformed: the server's loader names it


def _absolute(value: Any, base: str) -> Any:
    if isinstance(value, str) and value.strip() and not os.path.isabs(os.path.expanduser(value.strip())):
        return os.path.join(base, value.strip())
    return value


def _server_paths_absolute(cfg: dict, base: str) -> None:
    """As the server's loader resolves them from its config's directory (mindie.config._resolve_paths)."""
    sc = cfg.get("ServerConfig")
    if isinstance(sc, dict):
        for k in SERVER_TLS_PATH_KEYS:
            if k in sc:
                sc[k] = _absolute(sc[k], base)
    bc = cfg.get("BackendConfig")
    if not isinstance(bc, dict):
        return
    for k in ("workerCurveKeyDir",):
        if k in bc:
            bc[k] = _absolute(bc[k], base)
    if isinstance(bc.get("cpuTuning"), dict) and "kernelCache" in bc["cpuTuning"]:
        bc["cpuTuning"]["kernelCache"] = _absolute(bc["cpuTuning"]["kernelCache"], base)
    md = bc.get("ModelDeployConfig")
    if not isinstance(md, dict):
        return
    for m in md.get("ModelConfig") or []:
        if isinstance(m, dict):
            if "modelWeightPath" in m:
                m["modelWeightPath"] = _absolute(m["modelWeightPath"], base)
            for opts in (m.get("models") or {}).values():
                if isinstance(opts, dict) and "chat_template" in opts:
                    opts["chat_template"] = _absolute(opts["chat_template"], base)
    for lm in md.get("LoraModules") or []:
        if isinstance(lm, dict) and "path" in lm:
            lm["path"] = _absolute(lm["path"], base)


def _coordinator_paths_absolute(cfg: dict, base: str) -> None:
    tls = cfg.get("tls_config")
    if isinstance(tls, dict):
        for items in tls.values():
            if isinstance(items, dict):
                for k in COORD_TLS_ITEM_PATHS:
                    if k in items:
                        items[k] = _absolute(items[k], base)
    log = cfg.get("log_info")
    if isinstance(log, dict):
        for k in ("run_log_path", "operation_log_path"):
            if k in log:
                log[k] = _absolute(log[k], base)


def default_run_dir(predict_port: int, env=os.environ) -> str:
    """$XDG_RUNTIME_DIR/mindie-motor/<port>, else <$TMPDIR or /tmp>/mindie-py-<uid>/motor-<port>
    (short: the instances' ipc sockets live below it)."""
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg) and os.path.isdir(xdg):
        return os.path.join(xdg, "mindie-motor", str(predict_port))
    return os.path.join(env.get("TMPDIR", "") or "/tmp", f"mindie-py-{os.getuid()}", f"motor-{predict_port}")


def _connect_host(listen: str) -> str:
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(listen, listen)


def _url(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}"


# -- derivation ------------------------------------------------------------------------------------
def derive(config_path: str, run_dir: Optional[str] = None, *, write: bool = True) -> Plan:
    """Validate ``user_config.json`` and derive (and write, with ``write``) the fleet's files.
    Raises FleetError naming the key."""
    from mindie.config import ConfigError, load_config, refuse_unknown

    source = os.path.abspath(os.path.expanduser(config_path))
    base = os.path.dirname(source)
    raw = read_user_config(source)
    mode = deploy_mode(raw)
    notes = _check_keys(raw, mode)
    dc = _obj(raw, "deploy_config", "")
    if mode == PD_SEPARATE:
        n_p = _int(dc.get("p_instances_num", 1), "deploy_config.p_instances_num", 1, MAX_INSTANCES)
        n_d = _int(dc.get("d_instances_num", 1), "deploy_config.d_instances_num", 1, MAX_INSTANCES)
        if n_p + n_d > MAX_INSTANCES:
            raise FleetError(f"p_instances_num + d_instances_num = {n_p + n_d}, more than {MAX_INSTANCES} "
                             "instances on one host", "deploy_config.d_instances_num")
        if "replicas" in dc:
            notes.append("deploy_config.replicas: not applied in pd_separate (p_instances_num, d_instances_num are)")
        n = n_p + n_d
        roles = ["prefill"] * n_p + ["decode"] * n_d
        templates = {}
        for role in ("prefill", "decode"):
            key = f"mindie_server_{role}_config"
            if key in raw:
                templates[role] = (key, _obj(raw, key, ""))
            elif "mindie_server_config" in raw:
                templates[role] = ("mindie_server_config", _obj(raw, "mindie_server_config", ""))
            else:
                raise FleetError("is required with deploy_mode pd_separate (a whole server config.json; "
                                 "or give mindie_server_config for both roles)", key)
        server_key = templates["prefill"][0]
    else:
        n = _int(dc.get("replicas", 1), "deploy_config.replicas", 1, MAX_INSTANCES)
        roles = [""] * n
        templates = {"": ("mindie_server_config", _obj(raw, "mindie_server_config", ""))}
        server_key = "mindie_server_config"

    coord = copy.deepcopy(_obj(raw, "mindie_ms_coordinator_config", ""))
    if "instances" in coord:
        raise FleetError("derived by motor.sh from deploy_config.replicas and mindie_server_config: "
                         "remove it (add instances to a running coordinator with POST /v1/instances/refresh)",
                         "mindie_ms_coordinator_config.instances")
    http = _obj(coord, "http_config", "mindie_ms_coordinator_config.")
    predict_port = _int(http.get("predict_port", 1025), "mindie_ms_coordinator_config.http_config.predict_port", 1024, 65535)
    manage_port = _int(http.get("manage_port", 1026), "mindie_ms_coordinator_config.http_config.manage_port", 1024, 65535)
    coord_ports = {predict_port: "mindie_ms_coordinator_config.http_config.predict_port",
                   manage_port: "mindie_ms_coordinator_config.http_config.manage_port"}

    def prepared(key: str, tmpl: dict) -> dict:
        srv = copy.deepcopy(tmpl)
        sc_ = _obj(srv, "ServerConfig", f"{key}.")
        srv["ServerConfig"] = sc_
        if "managementIpAddress" not in sc_:
            # MindIE's default management address (127.0.0.2) is not the business one, and Motor's
            # instance records carry one ip for both planes.
            sc_["managementIpAddress"] = sc_.get("ipAddress", "127.0.0.1")
        if "runDir" in sc_:
            notes.append(f"{key}.ServerConfig.runDir: replaced by <run dir>/i<k> per instance")
        _server_paths_absolute(srv, base)
        return srv

    servers = {role: prepared(key, tmpl) for role, (key, tmpl) in templates.items()}
    server = servers[roles[0]]
    sc = server["ServerConfig"]
    keys = {k: f"{server_key}.ServerConfig.{k}" for k in ("port", "managementPort", "metricsPort")}
    if "port" in sc:
        port0 = _int(sc["port"], keys["port"], 1024, 65535)
    else:
        port0 = max(coord_ports) + 1
    offsets = {"port": 0,
               "managementPort": _int(sc["managementPort"], keys["managementPort"], 1024, 65535) - port0
               if "managementPort" in sc else 1,
               "metricsPort": None}
    # Default: /metrics on the management plane, where the coordinator reads it (a static
    # instance record has no metrics port).
    offsets["metricsPort"] = (_int(sc["metricsPort"], keys["metricsPort"], 1024, 65535) - port0
                              if "metricsPort" in sc else offsets["managementPort"])
    stride = max(offsets.values()) - min(offsets.values()) + 1
    if mode == PD_SEPARATE and any(k in servers["decode"]["ServerConfig"] for k in keys) \
            and templates["decode"][0] != server_key:
        notes.append(f"{templates['decode'][0]}.ServerConfig ports: replaced; every instance takes the port "
                     f"layout of {server_key} (decode instances after the prefill ones)")
    for role, (key, _) in templates.items():
        bc = servers[role].get("BackendConfig") if isinstance(servers[role].get("BackendConfig"), dict) else {}
        if roles.count(role) > 1 and bc.get("deviceType", "auto") == "auto":
            notes.append(f"{key}.BackendConfig.deviceType auto: every instance uses the npuDeviceIds as "
                         "written (set npu or cuda to give each instance its own devices)")
    _coordinator_paths_absolute(coord, base)

    run_dir = os.path.abspath(os.path.expanduser(run_dir)) if run_dir else default_run_dir(predict_port)
    taken: dict[int, tuple[str, str]] = {p: ("coordinator", what) for p, what in coord_ports.items()}
    instances: list[Instance] = []
    configs: list[dict] = []
    for k in range(n):
        cfg = copy.deepcopy(servers[roles[k]])
        s = cfg["ServerConfig"]
        if roles[k]:
            s.update(_role_keys(roles[k], s))
        for plane, off in offsets.items():
            p = port0 + off + k * stride
            what = f"instance i{k}'s {keys[plane]}"
            if not 1024 <= p <= 65535:
                raise FleetError(f"{what} would be {p}, outside [1024, 65535]: lower it or deploy_config.replicas",
                                 keys[plane])
            if p in taken and taken[p][0] != f"i{k}":  # planes of one instance may share a port
                raise FleetError(f"{what} would be {p}, which is {taken[p][1]}: move ServerConfig.port "
                                 f"(instances take {stride} port(s) each from it) or the coordinator's ports",
                                 keys[plane] if plane in sc or plane == "port" else keys["port"])
            taken[p] = (f"i{k}", what)
            s[plane] = p
        s["runDir"] = os.path.join(run_dir, f"i{k}")
        _devices(cfg, k)
        configs.append(cfg)
    if write:
        make_private_dirs(run_dir)
    inst_records = []
    # Unknown keys of every instance template (prefill and decode alike), named as in this file:
    # always refused here (a fleet file is checked whole before anything starts), all in one message.
    unknown: dict[str, Optional[str]] = {}
    for k, cfg in enumerate(configs):
        path = os.path.join(run_dir, f"i{k}.json")
        if write:
            _write_json(path, cfg)
            tk = templates[roles[k]][0]
            try:
                loaded = load_config(path, env={})
                found = loaded.unknown
            except ConfigError as e:
                if not e.unknown:  # anything but its own ServerConfig.strictConfig refusing them
                    msg = str(e).replace(f" (in {path})", "")
                    raise FleetError((f"{tk}.{msg}" if e.key else msg)
                                     + (f" (instance i{k}, {path})" if k else "")) from None
                found = e.unknown
            unknown.update({f"{tk}.{key}": close and f"{tk}.{close}" for key, close in found})
            if unknown:
                continue
            s = loaded.config.server
            ip, mip, https, drain = s.ip_address, s.management_ip_address, s.https_enabled, s.drain_timeout_s
        else:
            ip = cfg["ServerConfig"].get("ipAddress", "127.0.0.1")
            mip = cfg["ServerConfig"].get("managementIpAddress", "127.0.0.2")
            https, drain = bool(cfg["ServerConfig"].get("httpsEnabled", False)), 20.0
        s = cfg["ServerConfig"]
        inst = Instance(id=k, name=f"i{k}", config=path, run_dir=s["runDir"], log=os.path.join(run_dir, f"i{k}.log"),
                        ip=_connect_host(ip), business_port=s["port"], mgmt_ip=_connect_host(mip),
                        mgmt_port=s["managementPort"], metrics_port=s["metricsPort"], https=https,
                        drain_timeout_s=drain, role=roles[k])
        instances.append(inst)
        rec = {"id": k, "ip": inst.ip, "business_port": inst.business_port, "mgmt_port": inst.mgmt_port}
        if inst.metrics_port != inst.mgmt_port:  # the coordinator reads /metrics there
            rec["metric_port"] = inst.metrics_port
        if roles[k]:  # until the instance reports its own role in /v2/status
            rec["role"] = roles[k]
        inst_records.append(rec)
        if inst.mgmt_ip != inst.ip:  # set apart by the user: Motor's records carry one ip
            raise FleetError(f"the management plane ({mip}) must be on the business plane's address ({ip}) "
                             "for the coordinator, whose instance records carry one ip",
                             f"{templates[roles[k]][0]}.ServerConfig.managementIpAddress")
    if unknown:
        key, msg = refuse_unknown(list(unknown.items()), None)
        raise FleetError(msg, key)
    coord["instances"] = inst_records
    digs = coord.setdefault("digs_scheduler_config", {})
    if isinstance(digs, dict):
        digs.setdefault("deploy_mode", mode)
    coord_path = os.path.join(run_dir, "ms_coordinator.json")
    coord_drain = 30.0
    if write:
        _write_json(coord_path, coord)
        coord_notes, coord_drain = _check_coordinator(coord_path)
        notes += coord_notes
    predict_ip = _connect_host(str(http.get("predict_ip", "127.0.0.1")))
    manage_ip = _connect_host(str(http.get("manage_ip", "127.0.0.1")))
    tls = coord.get("tls_config") if isinstance(coord.get("tls_config"), dict) else {}
    plan = Plan(run_dir=run_dir, source=source, deploy_mode=mode, coordinator_config=coord_path,
                coordinator_log=os.path.join(run_dir, "coordinator.log"),
                predict_url=_url("https" if tls.get("request_server_tls_enable") else "http", predict_ip, predict_port),
                manage_url=_url("https" if tls.get("controller_server_tls_enable") else "http", manage_ip, manage_port),
                manage_host=manage_ip, manage_port=manage_port, coordinator_drain_s=coord_drain,
                instances=instances, notes=notes)
    if write:
        _write_json(os.path.join(run_dir, "plan.json"), asdict(plan))
    return plan


def _role_keys(role: str, sc: dict) -> dict:
    """The server config keys that start an instance in its PD role: ``ServerConfig.pdRole``
    (the section it came from decides: mindie_server_prefill_config -> prefill) and
    ``interCommPort`` 0 unless set (one host: the KV moves over ipc, and N instances would
    otherwise all bind MindIE's default tcp port 1121)."""
    from mindie.config import ServerConfig
    fields = ServerConfig.__struct_fields__
    out = {}
    if "pd_role" in fields:
        out["pdRole"] = role
    if "inter_comm_port" in fields and "interCommPort" not in sc:
        out["interCommPort"] = 0
    return out


def _check_coordinator(path: str) -> tuple[list[str], float]:
    """The coordinator's own loader on the derived file (its typos and ranges, keys named):
    its notes, and its drain bound (http_config.drainTimeoutS)."""
    from mindie.config import ConfigError
    from coordinator import config as ccfg
    try:
        loaded = ccfg.load(path, env={})
    except ConfigError as e:
        msg = str(e).replace(f" (in {path})", "")
        raise FleetError(f"mindie_ms_coordinator_config.{msg}" if e.key else msg) from None
    drain = float(getattr(loaded.config.http_config, "drainTimeoutS", 30))
    return [f"mindie_ms_coordinator_config.{n}" for n in loaded.notes], drain


def _write_json(path: str, doc: Any) -> None:
    tmp = f"{path}.tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


# -- running ---------------------------------------------------------------------------------------
def _say(msg: str) -> None:
    print(f"motor: {msg}", file=sys.stderr, flush=True)


def _child_env(drop) -> dict:
    return {k: v for k, v in os.environ.items() if k not in drop}


def instance_env() -> tuple[dict, list[str]]:
    """The instances' environment, and the overrides left out of it (named in a note)."""
    from mindie.config import ENV_OVERRIDES
    drop = set(INSTANCE_ENV_DROPPED) | set(ENV_OVERRIDES)
    return _child_env(drop), sorted(k for k in ENV_OVERRIDES if k in os.environ)


def _preexec() -> None:
    # A session of its own (a terminal's Ctrl-C reaches motor only, which stops the children in
    # order), and SIGTERM when motor dies, even by SIGKILL: launch.sh then drains as on a stop.
    os.setsid()
    die_with_parent(signal.SIGTERM)


def _how(rc: int) -> str:
    """How a child ended, from its Popen returncode."""
    if rc < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-rc).name}"
        return f"was killed by signal {-rc}"
    return f"exited with status {rc}"


def _tail(path: str, n: int = 20) -> str:
    with contextlib.suppress(OSError):
        lines = Path(path).read_text(errors="replace").splitlines()[-n:]
        return "\n".join("    " + line for line in lines)
    return "    (no log)"


class Readiness:
    """One readiness check of a management plane with scripts/health_check.sh's client
    (mindie/ops/probe.py): the same TLS rules (the plane's CA, MINDIE_PROBE_CERT/KEY for mutual
    TLS), so a fleet of HTTPS instances is waited for as its probes would see it."""

    def __init__(self, config: str, coordinator: bool):
        from mindie.ops import probe
        self.probe = probe
        self.coordinator = coordinator
        self.target = probe.coordinator_target(config, env={}) if coordinator else probe.management_target(config, env={})
        self.ctx = None
        if self.target.tls:
            e = os.environ
            self.ctx = probe.client_context(self.target.tls, cacert=e.get("MINDIE_PROBE_CACERT", ""),
                                            cert=e.get("MINDIE_PROBE_CERT", ""), key=e.get("MINDIE_PROBE_KEY", ""),
                                            key_password_file=e.get("MINDIE_PROBE_KEY_PASSWORD_FILE", ""))
        self.last = ""

    def ready(self, timeout: float = 2.0) -> bool:
        p = self.probe
        prober = p.Prober(self.target, time.monotonic() + timeout, self.ctx,
                          os.environ.get("MINDIE_PROBE_SERVER_NAME", ""), bool(os.environ.get("MINDIE_PROBE_CERT")))
        try:
            code, self.last = p.probe(prober, "readiness", 0, self.coordinator)
        except p.ProbeFailure as f:
            code, self.last = f.code, f.message
        except p._Deadline:
            code, self.last = p.TIMEOUT, f"timeout: no answer within {timeout:g} s"
        return code == p.OK


class Fleet:
    """The running fleet: N launch.sh processes and one coordinator, each in its own session."""

    def __init__(self, plan: Plan, launch_args: list[str], ready_timeout: float):
        self.plan, self.launch_args, self.ready_timeout = plan, launch_args, ready_timeout
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: list = []
        self.signals = 0
        self.coordinator_deaths: list[float] = []

    # signals: the first drains, the second forces (launch.sh's second SIGTERM cuts the requests
    # in progress), the third kills every process group
    def on_signal(self, signum, frame) -> None:
        self.signals += 1
        if self.signals == 2:
            _say(f"{signal.Signals(signum).name} again: cutting the requests in progress")
            for p in self.procs.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
        elif self.signals >= 3:
            _say("asked a third time: killing every process now")
            self.kill_all()

    def kill_all(self) -> None:
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)

    def _spawn(self, name: str, argv: list[str], log: str, env: dict) -> subprocess.Popen:
        f = open(log, "ab")
        self.logs.append(f)
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env,
                             cwd=str(ROOT), preexec_fn=_preexec)
        self.procs[name] = p
        return p

    def start_instances(self) -> None:
        env, dropped = instance_env()
        if dropped:
            _say(f"note: not passed to the instances (their derived config.json is): {', '.join(dropped)}")
        env.setdefault("PYTHON", sys.executable)
        for inst in self.plan.instances:
            p = self._spawn(inst.name, ["bash", str(LAUNCH), "--config", inst.config, *self.launch_args],
                            inst.log, env)
            _say(f"instance {inst.name}: launch.sh pid {p.pid}, business {_url('http', inst.ip, inst.business_port)}, "
                 f"management {_url('http', inst.mgmt_ip, inst.mgmt_port)}, log {inst.log}")

    def start_coordinator(self) -> subprocess.Popen:
        env = _child_env(COORDINATOR_ENV_DROPPED)
        p = self._spawn("coordinator", [sys.executable, "-m", "coordinator", "--config",
                                        self.plan.coordinator_config], self.plan.coordinator_log, env)
        _say(f"coordinator: pid {p.pid}, predict {self.plan.predict_url}, manage {self.plan.manage_url}, "
             f"log {self.plan.coordinator_log}")
        return p

    def wait_instances(self) -> bool:
        deadline = time.monotonic() + self.ready_timeout
        pending = {i.name: i for i in self.plan.instances}
        checks = {i.name: Readiness(i.config, coordinator=False) for i in self.plan.instances}
        while pending:
            if self.signals:
                return False
            for name, inst in list(pending.items()):
                p = self.procs[name]
                if p.poll() is not None:
                    _say(f"instance {name} failed to start: launch.sh {_how(p.returncode)}; "
                         f"its log ({inst.log}) ends:\n{_tail(inst.log)}")
                    return False
                if checks[name].ready():
                    _say(f"instance {name} ready")
                    del pending[name]
            if time.monotonic() > deadline:
                for name, inst in pending.items():
                    _say(f"instance {name} not ready after {self.ready_timeout:g} s (--ready-timeout; last probe: "
                         f"{checks[name].last}); its log ({inst.log}) ends:\n{_tail(inst.log)}")
                return False
            time.sleep(0.2)
        return True

    def wait_coordinator(self, p: subprocess.Popen) -> bool:
        deadline = time.monotonic() + COORDINATOR_READY_TIMEOUT_S
        check = Readiness(self.plan.coordinator_config, coordinator=True)
        while time.monotonic() < deadline and not self.signals:
            if p.poll() is not None:
                _say(f"the coordinator {_how(p.returncode)} while starting; its log "
                     f"({self.plan.coordinator_log}) ends:\n{_tail(self.plan.coordinator_log)}")
                return False
            if check.ready():
                return True
            time.sleep(0.2)
        if not self.signals:
            _say(f"the coordinator was not ready after {COORDINATOR_READY_TIMEOUT_S:g} s (last probe: {check.last}); its log "
                 f"({self.plan.coordinator_log}) ends:\n{_tail(self.plan.coordinator_log)}")
        return False

    def ready_line(self) -> str:
        inst = ", ".join(f"{i.name}{' ' + i.role if i.role else ''} "
                         f"{_url('https' if i.https else 'http', i.ip, i.business_port)}"
                         for i in self.plan.instances)
        return (f"mindie-motor ready: coordinator {self.plan.predict_url} (manage {self.plan.manage_url}) | "
                f"{len(self.plan.instances)} instance(s): {inst} | run dir {self.plan.run_dir}")

    def supervise(self) -> int:
        """Until a stop signal or the coordinator's own stop (/stopService): exit status."""
        dead_instances: set[str] = set()
        while not self.signals:
            coord = self.procs["coordinator"]
            if coord.poll() is not None:
                rc = coord.returncode
                if rc == 0:
                    _say("the coordinator stopped by itself (exit 0, a stop it was asked for): stopping the instances")
                    return 0
                now = time.monotonic()
                self.coordinator_deaths = [t for t in self.coordinator_deaths if now - t < RESTART_WINDOW_S] + [now]
                how = _how(rc)
                if len(self.coordinator_deaths) > RESTARTS:
                    _say(f"the coordinator {how}, {len(self.coordinator_deaths)} times in "
                         f"{RESTART_WINDOW_S:g} s: giving up; its log ends:\n{_tail(self.plan.coordinator_log)}")
                    return 1
                _say(f"the coordinator {how}: restarting it (the instances kept serving)")
                self.start_coordinator()
            for inst in self.plan.instances:
                p = self.procs[inst.name]
                if inst.name not in dead_instances and p.poll() is not None:
                    dead_instances.add(inst.name)
                    _say(f"instance {inst.name} stopped (launch.sh {_how(p.returncode)}): the coordinator "
                         f"routes around it; its log ({inst.log}) ends:\n{_tail(inst.log, 5)}")
            time.sleep(0.2)
        return 0

    def stop(self) -> None:
        """Coordinator first (its requests in flight finish on the instances), then every instance
        at once (launch.sh drains on SIGTERM); each wait bounded, SIGKILL to what is left."""
        coord = self.procs.get("coordinator")
        drain = max((i.drain_timeout_s for i in self.plan.instances), default=20.0)
        if coord is not None and coord.poll() is None:
            _say(f"stopping the coordinator (its requests in flight get up to {self.plan.coordinator_drain_s:g} s)")
            with contextlib.suppress(ProcessLookupError):
                os.kill(coord.pid, signal.SIGTERM)
            self._wait([coord], self.plan.coordinator_drain_s + COORDINATOR_STOP_S, "the coordinator")
        live = [self.procs[i.name] for i in self.plan.instances if i.name in self.procs]
        if any(p.poll() is None for p in live):
            _say(f"draining {sum(p.poll() is None for p in live)} instance(s) (up to {drain:g} s each, in parallel)")
            for p in live:
                if p.poll() is None and self.signals < 2:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGTERM)
            # launch.sh's own stop: drain + cut + front ends (+10 s) + workers (15 s)
            self._wait(live, drain + 35.0, "instances")
        # What any child left in its process group (it should be nothing).
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        for f in self.logs:
            f.close()

    def _wait(self, procs: list, bound: float, what: str) -> None:
        deadline = time.monotonic() + bound
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline and self.signals < 3:
            time.sleep(0.1)
        left = [p for p in procs if p.poll() is None]
        if left:
            _say(f"{what} still running after {bound:g} s: SIGKILL to pid {' '.join(str(p.pid) for p in left)}")
            for p in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
            for p in left:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(5)


def make_private_dirs(path: str) -> None:
    """``path`` and every missing directory above it, each mode 0700. (os.makedirs gives the mode to
    the leaf only: a 0755 ``/tmp/mindie-py-<uid>`` made here would make every later server on the
    default run directory refuse to start, as ServerConfig.runDir must sit in a private parent.)"""
    missing = []
    d = os.path.abspath(path)
    while not os.path.isdir(d):
        missing.append(d)
        d = os.path.dirname(d)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass


def claim(run_dir: str) -> Optional[int]:
    """An open descriptor holding the run directory's lock (``motor.lock``), or None (with a
    message) when another motor.sh holds it: its files are not touched."""
    make_private_dirs(run_dir)
    lock_path = os.path.join(run_dir, "motor.lock")
    lock = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        _say(f"the run directory {run_dir} is in use by another motor.sh (its lock {lock_path} is held): "
             "stop that one first or pass --run-dir")
        return None
    return lock


def run(plan: Plan, lock: int, launch_args: list[str], ready_timeout: float) -> int:
    fleet = Fleet(plan, launch_args, ready_timeout)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, fleet.on_signal)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the terminal going away does not stop a fleet
    status = 1
    try:
        fleet.start_instances()
        if not fleet.wait_instances():
            status = 0 if fleet.signals else 1
            return status
        coord = fleet.start_coordinator()
        if not fleet.wait_coordinator(coord):
            status = 0 if fleet.signals else 1
            return status
        print(fleet.ready_line(), file=sys.stderr, flush=True)
        status = fleet.supervise()
        if fleet.signals:
            _say("stop requested: draining the fleet")
        return status
    finally:
        fleet.stop()
        _say("stopped" + ("" if status == 0 else f" (exit status {status})"))
        os.close(lock)


# -- command line ----------------------------------------------------------------------------------
EPILOG = """\
examples:
  scripts/motor.sh --config user_config.json                 # the fleet, until SIGTERM/SIGINT
  scripts/motor.sh --config user_config.json -- --null-model --null-step-ms 20 -w 1
  python -m coordinator.fleet.launcher plan --config user_config.json   # derive and print, start nothing

A minimal user_config.json (two instances of the demo model behind a cache-affine coordinator):

  {"deploy_config": {"replicas": 2},
   "mindie_ms_controller_config": {"deploy_mode": "single_node"},
   "mindie_ms_coordinator_config": {
       "http_config": {"predict_port": "1025", "manage_port": "1026"},
       "digs_scheduler_config": {"deploy_mode": "single_node", "algorithm_type": "cache_affinity"}},
   "mindie_server_config": {"ServerConfig": {"port": 1030},
                            "BackendConfig": {"npuDeviceIds": [[0]], "deviceType": "cpu"}}}

Stop: SIGTERM or SIGINT (Ctrl-C) stops the coordinator first (its requests in flight finish),
then drains every instance (launch.sh's drain: ServerConfig.drainTimeoutS); a second signal
cuts the requests in progress, a third kills. The coordinator's own stop (stopService) stops
the instances the same way. A coordinator that dies is restarted (at most 3 times a minute);
an instance that stops is left stopped (the coordinator routes around it). Every wait is
bounded. Exit status: 0 stopped on request, 1 a start failed, 2 user_config.json refused (one
line naming the key) or the run directory in use. docs/operations.md, "Fleet".
"""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    launch_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, launch_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog=os.environ.get("MINDIE_MOTOR_PROG") or "python -m coordinator.fleet.launcher",
                                description="A local MindIE Motor fleet from user_config.json: a coordinator "
                                            "in front of N server instances on this host.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", choices=("run", "plan"), default="run",
                   help="run (default): start the fleet and supervise it; plan: derive, write and print the "
                        "files, start nothing")
    p.add_argument("-c", "--config", required=True, metavar="user_config.json", help="MindIE Motor's deploy file")
    p.add_argument("--run-dir", metavar="DIR", default=None,
                   help="where the derived files, logs and the instances' run directories go (default: "
                        "$XDG_RUNTIME_DIR/mindie-motor/<predict_port>, else /tmp/mindie-py-<uid>/motor-<predict_port>)")
    p.add_argument("--ready-timeout", type=float, default=DEFAULT_READY_TIMEOUT_S, metavar="S",
                   help=f"seconds the instances get to load their models (default {DEFAULT_READY_TIMEOUT_S:g})")
    args = p.parse_args(argv)
    for a in launch_args:
        if a.split("=", 1)[0] in LAUNCH_OPTIONS_DERIVED:
            p.error(f"launch.sh option {a} after -- is derived from user_config.json per instance")
    if not args.ready_timeout > 0:
        p.error(f"--ready-timeout must be > 0, got {args.ready_timeout}")
    return args, launch_args


def main(argv: Optional[list[str]] = None) -> int:
    args, launch_args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        # First without writing: the run directory (from the ports) is claimed before its files
        # are written, so a fleet running there keeps its own.
        plan = derive(args.config, args.run_dir, write=False)
        lock = claim(plan.run_dir)
        if lock is None:
            return 2
        plan = derive(args.config, args.run_dir, write=True)
    except FleetError as e:
        print(f"motor: user_config.json refused: {e}", file=sys.stderr, flush=True)
        return 2
    for note in plan.notes:
        _say(f"note: {note}")
    if args.command == "plan":
        print(json.dumps(asdict(plan), indent=2))
        os.close(lock)
        return 0
    return run(plan, lock, launch_args, args.ready_timeout)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C before anything was started (the run has its own handler)
        sys.exit(130)
