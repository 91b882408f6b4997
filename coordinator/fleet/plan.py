"""Planning a local MindIE Motor fleet from MindIE's ``user_config.json`` (one coordinator in front
of N server instances on this host, ``scripts/motor.sh``): read and check the file, derive each
instance's config.json and ports and the coordinator's ms_coordinator.json, write them
(``derive``). Running the plan is coordinator/fleet/run.py; the command line coordinator/fleet/cli.py.

    python -m coordinator.fleet plan --config user_config.json [--run-dir DIR]   # derive, write, print
    python -m coordinator.fleet run  --config user_config.json [--run-dir DIR] [-- LAUNCH.SH OPTIONS]

``user_config.json`` is MindIE Motor's deploy file (``deploy_config``, ``mindie_ms_controller_config``,
``mindie_ms_coordinator_config``, ``mindie_server_prefill_config``, ``mindie_server_decode_config``).
MindIE deploys it to Kubernetes; here it starts processes on one host. What is read:

- the deploy mode: ``mindie_ms_controller_config.deploy_mode`` and/or
  ``mindie_ms_coordinator_config.digs_scheduler_config.deploy_mode`` (they must agree; default
  ``single_node``). ``pd_separate``: ``deploy_config.p_instances_num`` prefill instances running
  ``mindie_server_prefill_config`` and ``d_instances_num`` decode instances running
  ``mindie_server_decode_config`` (a missing one: ``mindie_server_config``), the coordinator
  handing each request from a prefill to a decode instance (coordinator/pd_pairing.py); the port
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

Cores: as each instance gets its own devices, it gets its own CPU cores (``cpu_cores``,
``core_sets``): the cores this process may run on, split into disjoint contiguous sets, one per
instance; motor.sh starts each instance bound to its set (CPU affinity, which the server's workers
inherit and size their thread pools by: mindie/topology.py ``usable_cores``), so one instance's
prompts do not take the cores another's decode steps run on. With fewer cores than instances, or
``deploy_config.cpuBinding: false`` (a project extension), nothing is bound and a note says so.

Relative paths in the two configs (model weights, TLS files, chat templates, LoRA adapters) are
taken from the directory of ``user_config.json`` and written absolute.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import msgspec

from coordinator import config as coordinator_config
from mindie.config import (ConfigError, ServerConfig, default_run_dir, did_you_mean, load_config,
                           refuse_unknown)
from mindie.config.paths import SERVER_TLS_PATHS

SINGLE_NODE = "single_node"
PD_SEPARATE = "pd_separate"
PD_MODES = ("pd_separate", "pd_disaggregation", "pd_disaggregation_single_container")
PD_APPLIED = ("p_instances_num", "d_instances_num")  # deploy_config keys applied in pd_separate
CPU_BINDING = "cpuBinding"  # deploy_config extension: false = the instances share the host's cores
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
# The file's own keys, for the unknown-key check (mindie.config's; the sections holding a server's
# config.json or the coordinator's ms_coordinator.json are checked by their own loaders), and why a
# key of each section that is none of them is refused.
FLEET_KEYS = (*TOP_KEYS, *(f"deploy_config.{k}" for k in (*DEPLOY_KEYS_NOT_APPLIED, "replicas", CPU_BINDING)),
              *(f"mindie_ms_controller_config.{k}" for k in CONTROLLER_KEYS))
WHY_NOT = {"": "not a MindIE user_config.json key", "deploy_config": "not a MindIE deploy_config key",
           "mindie_ms_controller_config": "not a MindIE ms_controller.json key"}
# launch.sh options that the derivation sets: refused after "--".
LAUNCH_OPTIONS_DERIVED = ("-c", "--config", "-H", "--host", "-p", "--port", "--management-port",
                          "--metrics-port", "--run-dir", "--workers-only", "--frontends-only")

# ServerConfig's TLS file keys (as the server's loader resolves them: mindie.config.paths), and the
# coordinator's TLS item keys holding file paths, relative to the config file.
SERVER_TLS_PATH_KEYS = tuple(f.encode_name for f in msgspec.structs.fields(ServerConfig) if f.name in SERVER_TLS_PATHS)
COORD_TLS_ITEM_PATHS = ("ca_cert", "tls_cert", "tls_key", "tls_passwd", "tls_crl")


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
    cpu_cores: list[int] = field(default_factory=list)  # its own cores (CPU affinity); [] = not bound


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
    """Refuse unknown keys naming every one (mindie.config's unknown-key check); notes for MindIE
    keys not applied here."""
    notes: list[str] = []
    outside = [key for key in raw if not key.startswith("//") and key not in TOP_KEYS]
    if mode != PD_SEPARATE:
        for key in ("mindie_server_prefill_config", "mindie_server_decode_config"):
            if key in raw:
                raise FleetError("belongs to deploy_mode pd_separate; single_node instances run "
                                 "mindie_server_config", key)
    dc = _obj(raw, "deploy_config", "")
    for key in dc:
        if key.startswith("//") or key in ("replicas", CPU_BINDING) or (mode == PD_SEPARATE and key in PD_APPLIED):
            continue
        if key in DEPLOY_KEYS_NOT_APPLIED:
            notes.append(f"deploy_config.{key}: accepted, not applied on one host (Kubernetes/NPU placement)")
        else:
            outside.append(f"deploy_config.{key}")
    ctl = _obj(raw, "mindie_ms_controller_config", "")
    for key in ctl:
        if key.startswith("//") or key == "deploy_mode":
            continue
        if key in CONTROLLER_KEYS:
            notes.append(f"mindie_ms_controller_config.{key}: accepted, not applied (no Controller in a local fleet)")
        else:
            outside.append(f"mindie_ms_controller_config.{key}")
    if (unknown := did_you_mean(outside, FLEET_KEYS)):
        key, message = refuse_unknown(unknown, why_not=WHY_NOT)
        raise FleetError(message, key)
    return notes


def _prefixed(unknown: list[tuple[str, Optional[str]]], prefix: str) -> list[tuple[str, Optional[str]]]:
    """Unknown keys of a section's own file (and their suggestions), named as keys of this file."""
    return [(prefix + key, close and prefix + close) for key, close in unknown]


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


def _connect_host(listen: str) -> str:
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(listen, listen)


def url(scheme: str, host: str, port: int) -> str:
    """``scheme://host:port``, an IPv6 host in brackets."""
    return f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}"


# -- derivation ------------------------------------------------------------------------------------
def host_cores() -> list[int]:
    """The cores this process may run on (its CPU affinity), in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def core_sets(n: int, cores: list[int]) -> list[list[int]]:
    """``n`` disjoint contiguous sets of ``cores``, as even as they go (the first ones one larger);
    ``n`` empty sets (nothing bound) when there are fewer cores than instances."""
    if n <= 0 or len(cores) < n:
        return [[] for _ in range(max(0, n))]
    q, r = divmod(len(cores), n)
    out, i = [], 0
    for k in range(n):
        m = q + (k < r)
        out.append(cores[i:i + m])
        i += m
    return out


def core_note(n: int, cores: list[int], binding: bool) -> Optional[str]:
    """The note on how the instances' cores were planned (None when each has its own)."""
    if not binding:
        return f"deploy_config.{CPU_BINDING} false: the {n} instance(s) share the host's {len(cores)} core(s)"
    if len(cores) < n:
        return (f"{n} instances on {len(cores)} usable core(s): not bound, the instances share them (their "
                "prompts slow each other's decode steps; give the host at least one core per instance)")
    return None


def derive(config_path: str, run_dir: Optional[str] = None, *, write: bool = True) -> Plan:
    """Validate ``user_config.json`` and derive (and write, with ``write``) the fleet's files.
    Raises FleetError naming the key."""
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

    run_dir = (os.path.abspath(os.path.expanduser(run_dir)) if run_dir
               else default_run_dir(predict_port, fleet=True))
    binding = dc.get(CPU_BINDING, True)
    if not isinstance(binding, bool):
        raise FleetError("must be true or false", f"deploy_config.{CPU_BINDING}")
    cores = host_cores()
    cpu_sets = core_sets(n if binding else 0, cores) or [[] for _ in range(n)]
    if (note := core_note(n, cores, binding)) is not None:
        notes.append(note)
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
            unknown.update(_prefixed(found, f"{tk}."))
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
                        drain_timeout_s=drain, role=roles[k], cpu_cores=cpu_sets[k])
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
        key, msg = refuse_unknown(list(unknown.items()))
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
                predict_url=url("https" if tls.get("request_server_tls_enable") else "http", predict_ip, predict_port),
                manage_url=url("https" if tls.get("controller_server_tls_enable") else "http", manage_ip, manage_port),
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
    try:
        loaded = coordinator_config.load(path, env={})
    except ConfigError as e:
        if e.unknown:  # named as keys of this file, as the servers' are
            key, msg = refuse_unknown(_prefixed(e.unknown, "mindie_ms_coordinator_config."),
                                      file=coordinator_config.FILE)
            raise FleetError(msg, key) from None
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
