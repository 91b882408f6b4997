"""The environment's overrides of config.json's keys (``ENV_OVERRIDES``: launch.sh's flags
arrive as these variables too, listed in MINDIE_SET_BY_FLAG), applied to the raw JSON before
validation so that an error names the variable (``apply_env``)."""
import json
import os
import re
from typing import Any, Mapping, Optional

from mindie.config.provenance import ConfigError
from mindie.runtime.env import ENGINE_ENV, engine_overrides, parse_number

ENV_OVERRIDES: dict[str, str] = {
    "MIES_CONTAINER_IP": "ServerConfig.ipAddress",
    "MIES_CONTAINER_MANAGEMENT_IP": "ServerConfig.managementIpAddress",
    "MINDIE_HOST": "ServerConfig.ipAddress",  # launch.sh --host; wins over MIES_CONTAINER_IP
    "MINDIE_PORT": "ServerConfig.port",  # launch.sh --port: moves the other planes with it (PLANE_PORTS)
    "MINDIE_MANAGEMENT_PORT": "ServerConfig.managementPort",  # launch.sh --management-port
    "MINDIE_METRICS_PORT": "ServerConfig.metricsPort",  # launch.sh --metrics-port
    "MINDIE_GRACEFUL_TIMEOUT": "ServerConfig.drainTimeoutS",  # the deploy files' name for it
    "MINDIE_RUN_DIR": "ServerConfig.runDir",
    "MINDIE_KV_TRANSFER_HOST": "ServerConfig.kvTransferHost",  # Kubernetes: the pod's IP (downward API)
    "MINDIE_FRONTENDS": "ServerConfig.frontendCount",
    "MINDIE_STRICT_CONFIG": "ServerConfig.strictConfig",  # launch.sh --strict-config
    "MINDIE_HEAD_TIMEOUT_S": "ServerConfig.headTimeoutS",
    "MINDIE_BODY_TIMEOUT_S": "ServerConfig.bodyTimeoutS",
    "MINDIE_MODEL_PATH": "BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPath",
    "MINDIE_MODEL_NAME": "BackendConfig.ModelDeployConfig.ModelConfig[0].modelName",
    "MINDIE_DEVICE_TYPE": "BackendConfig.deviceType",
    "MINDIE_NPU_DEVICE_IDS": "BackendConfig.npuDeviceIds",
    # The engine and kernel settings: mindie.runtime.env's table (parsed by engine_overrides).
    **{name: key for name, (key, _, _) in ENGINE_ENV.items()},
}
DEVICE_IDS_KEY = ENV_OVERRIDES["MINDIE_NPU_DEVICE_IDS"]


def section(raw: dict, *names: str) -> Optional[dict]:
    """raw[names[0]][names[1]]..., created when missing; None when something on the way is not an object."""
    node: Any = raw
    for name in names:
        node = node.setdefault(name, {})
        if not isinstance(node, dict):
            return None
    return node


def _parse_device_ids(text: str) -> list[list[int]]:
    """'0,1' -> [[0],[1]] (one worker per device); a JSON list such as '[[0,1],[2,3]]' as is."""
    text = text.strip()
    try:
        if text.startswith("["):
            value = json.loads(text)
            if isinstance(value, list) and all(isinstance(g, list) for g in value):
                return value
            raise ValueError
        return [[int(p)] for p in text.split(",")]
    except ValueError:
        raise ConfigError(f"expected device ids like '0,1' or '[[0,1],[2,3]]', got {text!r}",
                          DEVICE_IDS_KEY, env="MINDIE_NPU_DEVICE_IDS") from None


def _seconds(text: str) -> Any:
    """A number of seconds from an environment variable; anything else stays a string, so that
    validation reports it naming the variable."""
    try:
        return float(text)
    except ValueError:
        return text


def apply_env(raw: dict, env: Mapping[str, str]) -> dict[str, str]:
    """Apply the overrides that are set (empty = unset); returns {dotted key: env var}."""
    applied: dict[str, str] = {}

    def put(name: str, node: Optional[dict], key: str, value: Any) -> None:
        if node is not None:
            node[key] = value
            applied[ENV_OVERRIDES[name]] = name

    get = {name: v for name in ENV_OVERRIDES if (v := env.get(name, "").strip())}
    server = section(raw, "ServerConfig")
    backend = section(raw, "BackendConfig")
    if (v := get.get("MIES_CONTAINER_IP")):
        put("MIES_CONTAINER_IP", server, "ipAddress", v)
    if (v := get.get("MINDIE_HOST")):
        put("MINDIE_HOST", server, "ipAddress", v)
    if (v := get.get("MINDIE_KV_TRANSFER_HOST")):
        put("MINDIE_KV_TRANSFER_HOST", server, "kvTransferHost", v)
    if (v := get.get("MIES_CONTAINER_MANAGEMENT_IP")):
        put("MIES_CONTAINER_MANAGEMENT_IP", server, "managementIpAddress", v)
    if server is not None:
        _apply_ports(server, get, applied)
    if (v := get.get("MINDIE_GRACEFUL_TIMEOUT")):
        put("MINDIE_GRACEFUL_TIMEOUT", server, "drainTimeoutS", parse_number(v))
    if (v := get.get("MINDIE_FRONTENDS")):
        put("MINDIE_FRONTENDS", server, "frontendCount", int(v) if re.fullmatch(r"[+-]?\d+", v) else v)
    if (v := get.get("MINDIE_STRICT_CONFIG")):
        put("MINDIE_STRICT_CONFIG", server, "strictConfig", {"1": True, "true": True, "0": False, "false": False}
            .get(v.lower(), v))
    for name, key in (("MINDIE_HEAD_TIMEOUT_S", "headTimeoutS"), ("MINDIE_BODY_TIMEOUT_S", "bodyTimeoutS")):
        if (v := get.get(name)):
            put(name, server, key, _seconds(v))
    if (v := get.get("MINDIE_RUN_DIR")):
        put("MINDIE_RUN_DIR", server, "runDir", os.path.abspath(os.path.expanduser(v)))
    if (v := get.get("MINDIE_DEVICE_TYPE")):
        put("MINDIE_DEVICE_TYPE", backend, "deviceType", v.lower())
    if (v := get.get("MINDIE_NPU_DEVICE_IDS")):
        ids = _parse_device_ids(v)
        put("MINDIE_NPU_DEVICE_IDS", backend, "npuDeviceIds", ids)
        # New devices imply a new tensor-parallel size: keep the file's worldSize from contradicting it.
        deploy = section(raw, "BackendConfig", "ModelDeployConfig")
        entries = deploy.get("ModelConfig") if deploy is not None else None
        if isinstance(entries, list) and ids and isinstance(ids[0], list):
            for m in entries:
                if isinstance(m, dict) and "worldSize" in m:
                    m["worldSize"] = len(ids[0])
    for name, value in engine_overrides(env).items():
        *sections, key = ENGINE_ENV[name][0].split(".")
        put(name, section(raw, *sections), key, value)
    first_model: Optional[dict] = None
    for name, key in (("MINDIE_MODEL_PATH", "modelWeightPath"), ("MINDIE_MODEL_NAME", "modelName")):
        if (v := get.get(name)):
            if first_model is None:  # ModelConfig[0], created when the file has none
                deploy = section(raw, "BackendConfig", "ModelDeployConfig")
                entries = deploy.setdefault("ModelConfig", []) if deploy is not None else None
                if isinstance(entries, list):
                    if not entries:
                        entries.append({})
                    first_model = entries[0] if isinstance(entries[0], dict) else None
            put(name, first_model, key, os.path.abspath(os.path.expanduser(v)) if name == "MINDIE_MODEL_PATH" else v)
    return applied


# The planes' port keys with their defaults: MINDIE_PORT (launch.sh --port) moves all three, each
# keeping its offset from the business port (MindIE's defaults: +1 and +2); the per-plane
# variables place one plane and win over that move.
PLANE_PORTS = (("port", "MINDIE_PORT", 1025), ("managementPort", "MINDIE_MANAGEMENT_PORT", 1026),
               ("metricsPort", "MINDIE_METRICS_PORT", 1027))


def _apply_ports(server: dict, get: Mapping[str, str], applied: dict[str, str]) -> None:
    """MINDIE_PORT sets the business port and moves the other two planes with it (each keeps its
    offset from the business port, as the file or the defaults give it); MINDIE_MANAGEMENT_PORT and
    MINDIE_METRICS_PORT place one plane and win over that move."""
    if (base := get.get("MINDIE_PORT")) is not None:
        new, old = parse_number(base), server.get("port", PLANE_PORTS[0][2])
        server["port"] = new
        applied["ServerConfig.port"] = "MINDIE_PORT"
        if _is_int(new) and _is_int(old):
            for key, name, default in PLANE_PORTS[1:]:
                mine = server.get(key, default)
                if not get.get(name) and _is_int(mine):
                    server[key] = new + (mine - old)
                    applied[f"ServerConfig.{key}"] = "MINDIE_PORT"
    for key, name, _ in PLANE_PORTS[1:]:
        if (v := get.get(name)):
            server[key] = parse_number(v)
            applied[f"ServerConfig.{key}"] = name


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)

