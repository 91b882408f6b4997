"""``ms_coordinator.json``: MindIE MS's coordinator config, read with MindIE's key names and nesting.

MindIE's shipped file writes ports and most scheduler numbers as strings (``"predict_port":
"1025"``, ``"slots_thresh": "0.05"``): both strings and numbers are accepted. Every key is either
applied, or accepted and reported as not applied here (``NOT_APPLIED``, logged at INFO), or
refused with the reason; an unknown key (a typo) stops the start naming it and the closest known
key (mindie.config's one unknown-key check, which names every unknown key; values are worded by
the server's loader too). Project extensions are camelCase keys (``instances`` and the few ``*Ms``
tunables below); all are documented in docs/config.md, "Coordinator".
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
from typing import Annotated, Any, Literal, Mapping, NamedTuple, Optional

import msgspec

from mindie.config import (ConfigError, did_you_mean, key_templates, keys_outside, lookup, read_json,
                           refuse_unknown, translate)

Port = Annotated[int, msgspec.Meta(ge=1024, le=65535)]
Seconds = Annotated[int, msgspec.Meta(ge=0, le=3600)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class _S(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """Base of every section: the JSON keys are the field names (MindIE MS uses snake_case)."""


class HttpConfig(_S):
    allow_all_zero_ip_listening: bool = False
    predict_ip: str = "127.0.0.1"
    predict_port: Port = 1025
    manage_ip: str = "127.0.0.1"
    manage_port: Port = 1026
    alarm_port: Port = 1027
    external_port: Port = 1028
    status_port: Port = 1029
    server_thread_num: Annotated[int, msgspec.Meta(ge=1, le=10000)] = 10
    client_thread_num: Annotated[int, msgspec.Meta(ge=1, le=10000)] = 10
    http_timeout_seconds: Seconds = 600
    keep_alive_seconds: Seconds = 180
    server_name: str = "MindIE-MS"
    user_agent: str = "Coordinator/1.0"
    # project extensions
    pollIntervalMs: Annotated[int, msgspec.Meta(ge=50, le=60000)] = 1000  # instance status poll period
    drainTimeoutS: Annotated[int, msgspec.Meta(ge=0, le=3600)] = 30  # SIGTERM: in-flight requests get this long


class RequestLimit(_S):
    single_node_max_requests: Annotated[int, msgspec.Meta(ge=1, le=2000)] = 1000
    max_requests: Annotated[int, msgspec.Meta(ge=1, le=90000)] = 10000
    body_limit: Annotated[int, msgspec.Meta(ge=1, le=20)] = 10  # MB


class MetricsConfig(_S):
    enable: bool = False
    trigger_size: Annotated[int, msgspec.Meta(ge=1, le=10000)] = 100


class PrometheusMetricsConfig(_S):
    reuse_time: Annotated[int, msgspec.Meta(ge=1, le=100)] = 3


class ExceptionConfig(_S):
    max_retry: Annotated[int, msgspec.Meta(ge=0, le=10)] = 5
    schedule_timeout: Seconds = 600
    first_token_timeout: Seconds = 600
    infer_timeout: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 600
    tokenizer_timeout: Seconds = 300
    # project extensions: the circuit breaker (docs/config.md, "Coordinator")
    breakerFailures: Annotated[int, msgspec.Meta(ge=1, le=100)] = 3
    breakerOpenMs: Annotated[int, msgspec.Meta(ge=100, le=600000)] = 5000


class LogInfo(_S):
    log_level: Literal["CRITICAL", "ERROR", "WARN", "WARNING", "INFO", "DEBUG"] = "INFO"
    to_file: bool = False
    to_stdout: bool = True
    run_log_path: str = ""
    operation_log_path: str = ""
    max_log_str_size: Annotated[int, msgspec.Meta(ge=128, le=65535)] = 4096
    max_log_file_size: Annotated[int, msgspec.Meta(ge=1, le=500)] = 20
    max_log_file_num: Annotated[int, msgspec.Meta(ge=1, le=64)] = 10


class DigsSchedulerConfig(_S):
    deploy_mode: Literal["single_node", "pd_separate", "pd_disaggregation",
                         "pd_disaggregation_single_container"] = "single_node"
    scheduler_type: Literal["default_scheduler", "digs_scheduler"] = "default_scheduler"
    algorithm_type: Literal["load_balance", "cache_affinity"] = "load_balance"
    cache_size: Annotated[int, msgspec.Meta(ge=1, le=10000)] = 100
    slots_thresh: Fraction = 0.05
    block_thresh: Fraction = 0.05
    max_schedule_count: Annotated[int, msgspec.Meta(ge=1, le=90000)] = 10000
    reordering_type: Literal[1, 2, 3] = 1
    max_res_num: Annotated[int, msgspec.Meta(ge=1, le=10000)] = 5000
    res_limit_rate: Annotated[float, msgspec.Meta(ge=0.0, le=2000.0)] = 1.1
    select_type: Literal[1, 2] = 2
    load_cost_values: str = "1, 0"
    load_cost_coefficient: str = "0, 0.22, 1024, 24, 6, 0, 1, 0, 1"
    # project extension: tokens per hashed block for cache_affinity (the server's KV block size)
    affinityBlockTokens: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 128


class TlsItems(_S):
    ca_cert: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_passwd: str = ""  # a file holding the key's password in plain text (MindIE: KMC-encrypted)
    tls_crl: str = ""
    kmcKsfMaster: str = ""
    kmcKsfStandby: str = ""


# The tls_config planes: (enable key, items key). MindIE's spelling "mangment" is kept.
TLS_PLANES = ("controller_server", "request_server", "mindie_client", "mindie_mangment",
              "external", "status", "etcd_server", "alarm_client")


class TlsConfig(_S):
    controller_server_tls_enable: bool = False
    controller_server_tls_items: TlsItems = msgspec.field(default_factory=TlsItems)
    request_server_tls_enable: bool = False
    request_server_tls_items: TlsItems = msgspec.field(default_factory=TlsItems)
    mindie_client_tls_enable: bool = False
    mindie_client_tls_items: TlsItems = msgspec.field(default_factory=TlsItems)
    mindie_mangment_tls_enable: bool = False
    mindie_mangment_tls_items: TlsItems = msgspec.field(default_factory=TlsItems)
    external_tls_enable: bool = False
    external_tls_items: TlsItems = msgspec.field(default_factory=TlsItems)
    status_tls_enable: bool = False
    status_tls_items: TlsItems = msgspec.field(default_factory=TlsItems)
    etcd_server_tls_enable: bool = False
    etcd_server_tls_items: TlsItems = msgspec.field(default_factory=TlsItems)
    alarm_client_tls_enable: bool = False
    alarm_client_tls_items: TlsItems = msgspec.field(default_factory=TlsItems)


class BackupConfig(_S):
    database_server_dns: str = "etcd.default.svc.cluster.local"
    database_server_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 2379
    function_enable: bool = False


class InstanceRecord(_S):
    """One server instance, as Motor's endpoint records write it."""
    id: Annotated[int, msgspec.Meta(ge=0)]
    ip: str
    business_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    mgmt_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    # MindIE's refresh field: where the instance's /metrics is when its metrics plane has a port
    # of its own (ServerConfig.metricsPort != managementPort); None = the management port
    metric_port: Optional[Annotated[int, msgspec.Meta(ge=1, le=65535)]] = None
    # project extension (deploy_mode pd_separate): the instance's role until it reports its own
    # in /v2/status (coordinator/pd_pairing.py); "" = flex unless it reports one
    role: Literal["", "prefill", "decode", "flex"] = ""


class CoordinatorConfig(_S):
    http_config: HttpConfig = msgspec.field(default_factory=HttpConfig)
    request_limit: RequestLimit = msgspec.field(default_factory=RequestLimit)
    metrics_config: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    prometheus_metrics_config: PrometheusMetricsConfig = msgspec.field(default_factory=PrometheusMetricsConfig)
    exception_config: ExceptionConfig = msgspec.field(default_factory=ExceptionConfig)
    log_info: LogInfo = msgspec.field(default_factory=LogInfo)
    digs_scheduler_config: DigsSchedulerConfig = msgspec.field(default_factory=DigsSchedulerConfig)
    string_token_rate: Annotated[float, msgspec.Meta(ge=1.0, le=100.0)] = 4.02
    tls_config: TlsConfig = msgspec.field(default_factory=TlsConfig)
    backup_config: BackupConfig = msgspec.field(default_factory=BackupConfig)
    instances: list[InstanceRecord] = []  # project extension: the static instance list


# Accepted with MindIE's meaning and not applied by this coordinator (logged at INFO when set):
# a one-process asyncio relay has no thread pools; the PD "digs" scheduler's tunables belong to
# the disaggregation issue; no Controller (alarms), etcd or external/status planes here.
NOT_APPLIED = {
    "http_config.alarm_port": "no Controller to report alarms to",
    "http_config.external_port": "no external query plane (the manage port answers coordinator_info)",
    "http_config.status_port": "no status plane (the manage port answers /v1/health and /v1/readiness)",
    "http_config.server_thread_num": "one asyncio event loop serves every connection",
    "http_config.client_thread_num": "one asyncio event loop serves every connection",
    "metrics_config.enable": "per-request timings are in the request log",
    "metrics_config.trigger_size": "per-request timings are in the request log",
    "digs_scheduler_config.scheduler_type": "single_node routes by algorithm_type",
    "digs_scheduler_config.max_schedule_count": "PD digs scheduler only (request_limit.max_requests bounds work)",
    "digs_scheduler_config.reordering_type": "requests are routed on arrival (no coordinator queue to reorder)",
    "digs_scheduler_config.res_limit_rate": "PD digs scheduler only",
    "digs_scheduler_config.select_type": "PD digs scheduler only",
    "digs_scheduler_config.load_cost_values": "PD digs scheduler only",
    "digs_scheduler_config.load_cost_coefficient": "PD digs scheduler only",
    "log_info.operation_log_path": "management calls are written to the run log",
    "backup_config.database_server_dns": "no active/standby pair (backup_config.function_enable false)",
    "backup_config.database_server_port": "no active/standby pair (backup_config.function_enable false)",
}
for _p in ("external", "status", "etcd_server", "alarm_client"):
    NOT_APPLIED[f"tls_config.{_p}_tls_items"] = "that plane does not exist here"
for _p in TLS_PLANES:
    for _k in ("kmcKsfMaster", "kmcKsfStandby"):
        NOT_APPLIED[f"tls_config.{_p}_tls_items.{_k}"] = "tls_passwd is read as a plain-text password file (no KMC)"

ENV_CONFIG_PATH = "MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH"
ENV_SINGLE_NODE_MAX_REQ = "MINDIE_MS_COORDINATOR_CONFIG_SINGLE_NODE_MAX_REQ"
ENV_MAX_REQ = "MINDIE_MS_COORDINATOR_CONFIG_MAX_REQ"


class Loaded(NamedTuple):
    config: CoordinatorConfig
    source: Optional[str]
    notes: list[str]  # INFO lines: keys accepted and not applied, environment overrides


KNOWN_KEYS = key_templates(CoordinatorConfig)  # for the unknown-key check
FILE = "MindIE ms_coordinator.json"  # whose keys these are, in an unknown key's message


def _present(raw: Any, key: str) -> bool:
    return lookup(raw, key, CoordinatorConfig)[0]


def _check_ip(key: str, ip: str, allow_zero: bool, source: Optional[str]) -> None:
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        raise ConfigError(f"must be an IPv4 or IPv6 address, got {json.dumps(ip)}", key, source=source) from None
    if addr.is_unspecified and not allow_zero:
        raise ConfigError(f"{ip} listens on every interface: set http_config.allow_all_zero_ip_listening "
                          "true to allow it (MindIE refuses it by default)", key, source=source)


def load(path: Optional[str] = None, env: Mapping[str, str] = os.environ,
         overrides: Optional[Mapping[str, str]] = None) -> Loaded:
    """Read, validate and check ``ms_coordinator.json``; ``path`` None -> $MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH,
    else all defaults. ``overrides``: http_config keys from the command line (MindIE's four
    positional arguments). Raises ``ConfigError`` naming the key."""
    if path is None:
        path = env.get(ENV_CONFIG_PATH, "").strip() or None
    source = os.path.abspath(os.path.expanduser(path)) if path else None
    raw: Any = read_json(source) if source else {}
    if not isinstance(raw, dict):
        raise ConfigError(f"the top level must be a JSON object, got {type(raw).__name__}", source=source)
    unknown = did_you_mean(keys_outside(raw, CoordinatorConfig), KNOWN_KEYS)  # every key that is not the coordinator's
    if unknown:
        key, message = refuse_unknown(unknown, file=FILE)
        e = ConfigError(message, key, source=source)
        e.unknown = unknown  # the fleet names them as keys of its own file
        raise e
    notes: list[str] = []
    if overrides:
        http = raw.setdefault("http_config", {})
        if isinstance(http, dict):
            http.update(overrides)
            notes += [f"http_config.{k} = {v} from the command line" for k, v in overrides.items()]
    limits = raw.setdefault("request_limit", {}) if isinstance(raw.get("request_limit", {}), dict) else None
    for name, var in (("single_node_max_requests", ENV_SINGLE_NODE_MAX_REQ), ("max_requests", ENV_MAX_REQ)):
        if limits is not None and env.get(var, "").strip():
            limits[name] = env[var].strip()
            notes.append(f"request_limit.{name} = {env[var].strip()} from {var}")
    try:
        # strict=False: MindIE writes numbers as strings ("1025", "0.05")
        config = msgspec.convert(raw, CoordinatorConfig, strict=False)
    except msgspec.ValidationError as e:
        key, message = translate(e, raw, CoordinatorConfig)
        raise ConfigError(message, key or "(top level)", source=source) from None
    _check(config, raw, source)
    for key, why in NOT_APPLIED.items():
        if _present(raw, key):
            notes.append(f"{key}: accepted, not applied here ({why})")
    return Loaded(config, source, notes)


def _check(c: CoordinatorConfig, raw: dict, source: Optional[str]) -> None:
    h = c.http_config
    _check_ip("http_config.predict_ip", h.predict_ip, h.allow_all_zero_ip_listening, source)
    _check_ip("http_config.manage_ip", h.manage_ip, h.allow_all_zero_ip_listening, source)
    if h.predict_port == h.manage_port and h.predict_ip == h.manage_ip:
        raise ConfigError(f"must differ from http_config.predict_port ({h.predict_port}) on the same address",
                          "http_config.manage_port", source=source)
    d = c.digs_scheduler_config
    if d.deploy_mode not in ("single_node", "pd_separate"):
        raise ConfigError(f"{json.dumps(d.deploy_mode)} is not supported by this coordinator: use \"pd_separate\" "
                          "(prefill then decode instances, each request handed off) or \"single_node\"",
                          "digs_scheduler_config.deploy_mode", source=source)
    if c.request_limit.single_node_max_requests > c.request_limit.max_requests:
        raise ConfigError(f"must be <= request_limit.max_requests ({c.request_limit.max_requests}), "
                          f"got {c.request_limit.single_node_max_requests}",
                          "request_limit.single_node_max_requests", source=source)
    if c.backup_config.function_enable:
        raise ConfigError("true needs an etcd active/standby pair, which this coordinator does not have: "
                          "run one coordinator (a restarted one rebuilds its view from config and polling)",
                          "backup_config.function_enable", source=source)
    seen: dict[int, int] = {}
    for i, inst in enumerate(c.instances):
        try:
            ipaddress.ip_address(inst.ip)
        except ValueError:
            if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", inst.ip):
                raise ConfigError(f"must be an IP address or a host name, got {json.dumps(inst.ip)}",
                                  f"instances[{i}].ip", source=source) from None
        if inst.id in seen:
            raise ConfigError(f"id {inst.id} is already instances[{seen[inst.id]}]'s", f"instances[{i}].id", source=source)
        seen[inst.id] = i
    if len(c.instances) > d.max_res_num:
        raise ConfigError(f"{len(c.instances)} instances, more than digs_scheduler_config.max_res_num "
                          f"({d.max_res_num})", "instances", source=source)
    for plane in ("controller_server", "request_server", "mindie_client", "mindie_mangment"):
        if getattr(c.tls_config, f"{plane}_tls_enable"):
            items: TlsItems = getattr(c.tls_config, f"{plane}_tls_items")
            need = ("tls_cert", "tls_key") if plane.endswith("server") else ("ca_cert",)
            for k in need:
                if not getattr(items, k):
                    raise ConfigError(f"must be set when tls_config.{plane}_tls_enable is true",
                                      f"tls_config.{plane}_tls_items.{k}", source=source)
            _resolve(items, os.path.dirname(source) if source else os.getcwd())
    for plane in ("external", "status", "etcd_server", "alarm_client"):
        if getattr(c.tls_config, f"{plane}_tls_enable") and _present(raw, f"tls_config.{plane}_tls_enable"):
            pass  # the plane does not exist here; noted through NOT_APPLIED of its items


def _resolve(items: TlsItems, base: str) -> None:
    """Relative TLS paths are relative to the config file's directory, as the server's are."""
    for k in ("ca_cert", "tls_cert", "tls_key", "tls_passwd", "tls_crl"):
        v = getattr(items, k)
        if v and not os.path.isabs(v):
            setattr(items, k, os.path.normpath(os.path.join(base, os.path.expanduser(v))))
