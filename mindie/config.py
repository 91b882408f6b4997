"""Server configuration: MindIE Server's ``config.json``, decoded and range-checked with msgspec.

The Structs below mirror MindIE's key tree exactly (``ModelDeployConfig`` and ``ScheduleConfig``
sit inside ``BackendConfig``; ``ModelConfig`` is a list), so a user's existing MindIE file loads
unchanged. Only the keys this project acts on are fields; every other key is accepted, left
alone and reported by :func:`ignored_keys` so the launcher can log it once. Project-only keys
use MindIE's camelCase style and are marked "project extension". ``docs/config.md`` has the
full table.

Front ends import this module, so it must never import torch (or anything heavy).

Usage::

    config = load_config(path)          # raises ConfigError naming the key, e.g.
                                        # "BackendConfig.ScheduleConfig.maxBatchSize: must be >= 1, got 0"
    config.schedule.maxBatchSize, config.model.modelName, config.max_input_len
    for key in ignored_keys(config): log.info("config key ignored: %s", key)
"""
import ipaddress
import json
import os
import re
import stat
import typing
from typing import Annotated, Any, Literal, Mapping, NamedTuple, Optional, Union

import msgspec
from msgspec import Meta, field

__all__ = [
    "Config", "ConfigError", "ServerConfig", "HealthCheckConfig", "BackendConfig", "ModelDeployConfig",
    "ModelConfig", "ScheduleConfig", "LogConfig", "TlsFiles", "load_config", "ignored_keys", "config_notes",
    "dump_effective", "env_overrides_applied", "default_run_dir", "ensure_run_dir", "tls_files", "check_tls_files",
    "ENV_OVERRIDES",
]

# Ranges (mindie.md section 8). Constants so docs, checks and tests agree.
PORT = Meta(ge=1024, le=65535)
MAX_TOKEN_LEN = 4194304
MAX_TOKEN_TIMEOUT_S = 3600
MAX_E2E_TIMEOUT_S = 65535
CACHE_BLOCK_MAX = 1024  # project: MindIE allows [1,128]; any multiple of 16 up to 1024 here
LOG_LEVELS = ("debug", "info", "warn", "warning", "error", "critical", "fatal")
_ZERO_IPS = ("0.0.0.0", "::")

DeviceType = Literal["auto", "npu", "cuda", "cpu"]
DType = Literal["auto", "float32", "bfloat16", "float16"]


class ConfigError(Exception):
    """A config problem, worded as ``<dotted key>: <what is wrong>`` (plus where the value came from)."""

    def __init__(self, message: str, key: Optional[str] = None, env: Optional[str] = None,
                 source: Optional[str] = None) -> None:
        text = f"{key}: {message}" if key else message
        if env:
            text += f" (from environment variable {env})"
        elif source:
            text += f" (in {source})"
        super().__init__(text)
        self.key = key
        self.env = env
        self.source = source


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """Base of every section: unknown keys are accepted (collected separately by ignored_keys)."""


class HealthCheckConfig(_Section):
    # 0 disables the NPU-usage test; otherwise a failed probe with usage >= threshold reports BUSY.
    npuUsageThreshold: Annotated[int, Meta(ge=0, le=100)] = 10


_HealthCheckConfig = HealthCheckConfig  # aliases: a field may not share its annotation's name


class ServerConfig(_Section):
    ipAddress: str = "127.0.0.1"
    managementIpAddress: str = "127.0.0.2"
    port: Annotated[int, PORT] = 1025
    managementPort: Annotated[int, PORT] = 1026
    metricsPort: Annotated[int, PORT] = 1027
    allowAllZeroIpListening: bool = False
    maxLinkNum: Annotated[int, Meta(ge=1, le=4096)] = 1000
    # Project default false (MindIE: true) so the demo starts without certificates; true is honoured.
    httpsEnabled: bool = False
    fullTextEnabled: bool = False
    tlsCaPath: str = "security/ca/"
    tlsCaFile: list[str] = field(default_factory=lambda: ["ca.pem"])
    tlsCert: str = "security/certs/server.pem"
    tlsPk: str = "security/keys/server.key.pem"
    tlsCrlPath: str = "security/certs/"
    tlsCrlFiles: list[str] = field(default_factory=lambda: ["server_crl.pem"])
    managementTlsCaFile: list[str] = field(default_factory=lambda: ["management_ca.pem"])
    managementTlsCert: str = "security/certs/management/server.pem"
    managementTlsPk: str = "security/keys/management/server.key.pem"
    managementTlsCrlPath: str = "security/management/certs/"
    managementTlsCrlFiles: list[str] = field(default_factory=lambda: ["server_crl.pem"])
    metricsTlsCaFile: list[str] = field(default_factory=lambda: ["metrics_ca.pem"])
    metricsTlsCert: str = "security/certs/metrics/server.pem"
    metricsTlsPk: str = "security/keys/metrics/server.key.pem"
    metricsTlsCrlPath: str = "security/metrics/certs/"
    metricsTlsCrlFiles: list[str] = field(default_factory=lambda: ["server_crl.pem"])
    tokenTimeout: Annotated[int, Meta(ge=1, le=MAX_TOKEN_TIMEOUT_S)] = 600
    e2eTimeout: Annotated[int, Meta(ge=1, le=MAX_E2E_TIMEOUT_S)] = 600
    maxRequestLength: Annotated[int, Meta(ge=1, le=100)] = 40  # MB
    HealthCheckConfig: _HealthCheckConfig = field(default_factory=_HealthCheckConfig)
    # Project extensions.
    watermarkGamma: Annotated[float, Meta(gt=0.0, lt=1.0)] = 0.5  # green-list fraction (TGI default)
    watermarkDelta: Annotated[float, Meta(gt=0.0, le=100.0)] = 2.0  # logit bias of green tokens
    runDir: str = ""  # "" = default_run_dir(); resolved to an absolute path by load_config
    frontendCount: Annotated[int, Meta(ge=0, le=64)] = 0  # gunicorn workers; 0 = auto

    @property
    def frontend_workers(self) -> int:
        """Front-end processes to start: frontendCount, or min(4, max(1, cores // 4)) when 0."""
        return self.frontendCount or min(4, max(1, (os.cpu_count() or 1) // 4))


_ServerConfig = ServerConfig


class ModelConfig(_Section):
    modelName: Annotated[str, Meta(pattern=r"^[A-Za-z0-9._-]+$", max_length=256)] = "demo"  # MindIE's sample file says "llama_65b"; absent here means the demo model
    # "" = the built-in demo model. Relative paths: from the config file's directory (from the
    # current directory when set by MINDIE_MODEL_PATH); load_config makes it absolute.
    modelWeightPath: str = ""
    # Project: 0/absent = the length of each npuDeviceIds entry (MindIE: default 4, must match).
    worldSize: Annotated[int, Meta(ge=0, le=64)] = 0
    # MindIE: host swap GB. Project: KV-cache GiB on the CPU backend; 0 = 1 GiB (see cpu_kv_cache_gib).
    # A fraction (0.5) is accepted too, so several CPU workers can share one budget.
    cpuMemSize: Union[Annotated[int, Meta(ge=0, le=65536)], Annotated[float, Meta(ge=0, le=65536)]] = 0
    npuMemSize: Annotated[int, Meta(ge=-1, le=65536)] = -1  # KV-cache GB per NPU/GPU; -1 = auto fraction
    dtype: DType = "auto"  # project extension; "auto" = the checkpoint's torch_dtype

    @property
    def is_demo(self) -> bool:
        """True when no weights are configured and the built-in demo model is served."""
        return not self.modelWeightPath

    @property
    def cpu_kv_cache_gib(self) -> float:
        return self.cpuMemSize or 1


_ModelConfig = ModelConfig


class ModelDeployConfig(_Section):
    maxSeqLen: Annotated[int, Meta(ge=2, le=MAX_TOKEN_LEN)] = 2560
    maxInputTokenLen: Annotated[int, Meta(ge=1, le=MAX_TOKEN_LEN)] = 2048
    truncation: Union[bool, Literal[-1, 0, 1]] = False  # false/0 reject, true/-1 right, 1 left
    ModelConfig: Annotated[list[_ModelConfig], Meta(min_length=1)] = field(default_factory=lambda: [_ModelConfig()])

    @property
    def truncation_mode(self) -> Literal["reject", "right", "left"]:
        """MindIE's truncation as a word: 0/false reject, -1/true right, 1 left."""
        t = self.truncation
        if isinstance(t, bool):
            return "right" if t else "reject"
        return {-1: "right", 1: "left"}.get(t, "reject")


class ScheduleConfig(_Section):
    # Project range: any multiple of 16 in [16, 1024] (MindIE: multiple of 16 in [1, 128]).
    cacheBlockSize: Annotated[int, Meta(ge=16, le=CACHE_BLOCK_MAX, multiple_of=16)] = 128
    maxPrefillBatchSize: Annotated[int, Meta(ge=1, le=819200)] = 50  # also <= maxBatchSize
    maxPrefillTokens: Annotated[int, Meta(ge=1, le=MAX_TOKEN_LEN)] = 8192
    maxBatchSize: Annotated[int, Meta(ge=1, le=819200)] = 200
    maxIterTimes: Annotated[int, Meta(ge=1, le=MAX_TOKEN_LEN)] = 512  # also <= maxSeqLen
    maxN: Annotated[int, Meta(ge=1, le=819200)] = 128
    enablePrefixCache: bool = True  # project extension
    # Project extension: compute each step on a thread while the worker loop takes in jobs and
    # sends the previous step's frames. null = the device's default (topology.overlap_default).
    overlapSteps: bool | None = None


_ModelDeployConfig = ModelDeployConfig
_ScheduleConfig = ScheduleConfig


class BackendConfig(_Section):
    # One inner list per model instance (= one device worker); inner length = tensor-parallel size.
    npuDeviceIds: Annotated[
        list[Annotated[list[Annotated[int, Meta(ge=0, le=65535)]], Meta(min_length=1)]], Meta(min_length=1)
    ] = field(default_factory=lambda: [[0]])
    deviceType: DeviceType = "auto"  # project extension; "auto" = npu, else cuda, else cpu
    cpuThreadsPerWorker: Annotated[int, Meta(ge=0, le=4096)] = 0  # project extension; 0 = share evenly
    ModelDeployConfig: _ModelDeployConfig = field(default_factory=_ModelDeployConfig)
    ScheduleConfig: _ScheduleConfig = field(default_factory=_ScheduleConfig)


class LogConfig(_Section):
    # MindIE changes this level at run time for a while; the project applies it at start.
    dynamicLogLevel: str = ""


_BackendConfig = BackendConfig
_LogConfig = LogConfig


class Config(_Section, dict=True):
    """The whole config.json. ``dict=True`` lets load_config attach non-encoded load metadata."""

    Version: str = "1.0.0"
    ServerConfig: _ServerConfig = field(default_factory=_ServerConfig)
    BackendConfig: _BackendConfig = field(default_factory=_BackendConfig)
    LogConfig: _LogConfig = field(default_factory=_LogConfig)
    EnableDynamicAdjustTimeoutConfig: bool = False  # true = every inference timeout at its maximum

    @property
    def server(self) -> ServerConfig:
        return self.ServerConfig

    @property
    def backend(self) -> BackendConfig:
        return self.BackendConfig

    @property
    def deploy(self) -> ModelDeployConfig:
        return self.BackendConfig.ModelDeployConfig

    @property
    def schedule(self) -> ScheduleConfig:
        return self.BackendConfig.ScheduleConfig

    @property
    def model(self) -> ModelConfig:
        """The served model: the first ModelConfig entry (others are validated but unused)."""
        return self.BackendConfig.ModelDeployConfig.ModelConfig[0]

    @property
    def instances(self) -> list[list[int]]:
        """npuDeviceIds: one device worker per entry."""
        return self.BackendConfig.npuDeviceIds

    @property
    def world_size(self) -> int:
        return len(self.BackendConfig.npuDeviceIds[0])

    @property
    def max_input_len(self) -> int:
        """Longest accepted input: min(maxInputTokenLen, maxSeqLen - 1), as in MindIE."""
        return min(self.deploy.maxInputTokenLen, self.deploy.maxSeqLen - 1)

    @property
    def max_prefill_tokens(self) -> int:
        """maxPrefillTokens, raised as MindIE does when below maxInputTokenLen."""
        d, s = self.deploy, self.schedule
        if s.maxPrefillTokens >= d.maxInputTokenLen:
            return s.maxPrefillTokens
        return max(s.maxPrefillTokens, min(d.maxSeqLen, d.maxInputTokenLen + s.maxIterTimes))

    @property
    def token_timeout(self) -> int:
        return MAX_TOKEN_TIMEOUT_S if self.EnableDynamicAdjustTimeoutConfig else self.ServerConfig.tokenTimeout

    @property
    def e2e_timeout(self) -> int:
        return MAX_E2E_TIMEOUT_S if self.EnableDynamicAdjustTimeoutConfig else self.ServerConfig.e2eTimeout

    @property
    def log_level(self) -> str:
        """Python logging level name: LogConfig.dynamicLogLevel, INFO when empty."""
        level = self.LogConfig.dynamicLogLevel.strip().lower()
        return {"": "INFO", "warn": "WARNING", "fatal": "CRITICAL"}.get(level, level.upper())

    @property
    def source_path(self) -> Optional[str]:
        """Absolute path of the file this config came from (None = built-in defaults)."""
        return self.__dict__.get("_source")


# --------------------------------------------------------------------------------------------------
# Environment overrides, applied to the raw JSON before validation so that errors name them.

ENV_OVERRIDES: dict[str, str] = {
    "MIES_CONTAINER_IP": "ServerConfig.ipAddress",
    "MIES_CONTAINER_MANAGEMENT_IP": "ServerConfig.managementIpAddress",
    "MINDIE_PORT": "ServerConfig.port",
    "MINDIE_MODEL_PATH": "BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPath",
    "MINDIE_DEVICE_TYPE": "BackendConfig.deviceType",
    "MINDIE_NPU_DEVICE_IDS": "BackendConfig.npuDeviceIds",
}
_DEVICE_IDS_KEY = ENV_OVERRIDES["MINDIE_NPU_DEVICE_IDS"]


def _section(raw: dict, *names: str) -> Optional[dict]:
    """raw[names[0]][names[1]]..., created when missing; None when something on the way is not an object."""
    node = raw
    for name in names:
        node = node.setdefault(name, {}) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return None
    return node


def _env_for(key: str, from_env: Mapping[str, str]) -> Optional[str]:
    """The variable that set ``key`` or a key above it (npuDeviceIds covers npuDeviceIds[0][0])."""
    for k, name in from_env.items():
        if key == k or key.startswith((k + ".", k + "[")):
            return name
    return None


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
                          _DEVICE_IDS_KEY, env="MINDIE_NPU_DEVICE_IDS") from None


def _apply_env(raw: dict, env: Mapping[str, str]) -> dict[str, str]:
    """Apply the overrides that are set (empty = unset); returns {dotted key: env var}."""
    applied: dict[str, str] = {}

    def get(name: str) -> Optional[str]:
        value = env.get(name, "").strip()
        return value or None

    server = _section(raw, "ServerConfig")
    backend = _section(raw, "BackendConfig")
    for name, key in (("MIES_CONTAINER_IP", "ipAddress"), ("MIES_CONTAINER_MANAGEMENT_IP", "managementIpAddress")):
        if (v := get(name)) is not None and server is not None:
            server[key] = v
            applied[ENV_OVERRIDES[name]] = name
    if (v := get("MINDIE_PORT")) is not None and server is not None:
        # Non-numbers stay strings so validation reports them as a type error naming the variable.
        server["port"] = int(v) if re.fullmatch(r"[+-]?\d+", v) else v
        applied[ENV_OVERRIDES["MINDIE_PORT"]] = "MINDIE_PORT"
    if (v := get("MINDIE_DEVICE_TYPE")) is not None and backend is not None:
        backend["deviceType"] = v.lower()
        applied[ENV_OVERRIDES["MINDIE_DEVICE_TYPE"]] = "MINDIE_DEVICE_TYPE"
    if (v := get("MINDIE_NPU_DEVICE_IDS")) is not None and backend is not None:
        ids = _parse_device_ids(v)
        backend["npuDeviceIds"] = ids
        applied[_DEVICE_IDS_KEY] = "MINDIE_NPU_DEVICE_IDS"
        # New devices imply a new tensor-parallel size: keep the file's worldSize from contradicting it.
        models = _section(raw, "BackendConfig", "ModelDeployConfig")
        entries = models.get("ModelConfig") if models is not None else None
        if isinstance(entries, list) and ids and isinstance(ids[0], list):
            for m in entries:
                if isinstance(m, dict) and "worldSize" in m:
                    m["worldSize"] = len(ids[0])
    if (v := get("MINDIE_MODEL_PATH")) is not None:
        deploy = _section(raw, "BackendConfig", "ModelDeployConfig")
        if deploy is not None:
            entries = deploy.setdefault("ModelConfig", [])
            if isinstance(entries, list):
                if not entries:
                    entries.append({})
                if isinstance(entries[0], dict):
                    entries[0]["modelWeightPath"] = os.path.abspath(os.path.expanduser(v))
                    applied[ENV_OVERRIDES["MINDIE_MODEL_PATH"]] = "MINDIE_MODEL_PATH"
    return applied


# --------------------------------------------------------------------------------------------------
# Walking the raw JSON against the Struct types: ignored keys, value and type lookup for messages.

def _unwrap(tp: Any) -> Any:
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _struct_fields(tp: Any) -> dict[str, Any]:
    return {f.encode_name: f.type for f in msgspec.structs.fields(tp)}


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _collect_ignored(raw: Any, tp: Any, path: str, out: list[str]) -> None:
    tp = _unwrap(tp)
    if _is_struct(tp) and isinstance(raw, dict):
        fields = _struct_fields(tp)
        for key, value in raw.items():
            sub = f"{path}.{key}" if path else key
            if key in fields:
                _collect_ignored(value, fields[key], sub, out)
            else:
                out.append(sub)
    elif typing.get_origin(tp) is list and isinstance(raw, list):
        (elem,) = typing.get_args(tp)
        for i, item in enumerate(raw):
            _collect_ignored(item, elem, f"{path}[{i}]", out)


_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def _split(path: str) -> list[Union[str, int]]:
    return [name if name else int(index) for name, index in _SEGMENT.findall("." + path)]


def _lookup(raw: Any, path: str) -> tuple[bool, Any, Any]:
    """(found, raw value, declared type) of a dotted path such as 'A.B[0].c'."""
    value, tp, found = raw, Config, True
    for seg in _split(path):
        tp = _unwrap(tp)
        if isinstance(seg, int):
            tp = typing.get_args(tp)[0] if typing.get_origin(tp) is list else Any
            found = found and isinstance(value, list) and seg < len(value)
            value = value[seg] if found else None
        else:
            tp = _struct_fields(tp).get(seg, Any) if _is_struct(tp) else Any
            found = found and isinstance(value, dict) and seg in value
            value = value[seg] if found else None
    return found, value, _unwrap(tp)


def _literals(tp: Any) -> list[Any]:
    """The allowed values of a Literal (or a Union holding bool and Literals)."""
    if typing.get_origin(tp) is Literal:
        return list(typing.get_args(tp))
    out: list[Any] = []
    for arg in typing.get_args(tp):
        out += [True, False] if arg is bool else _literals(arg)
    return out


# msgspec type names -> words for "must be <want>, got <got> <value>".
_GOT_WORDS = {"int": "an integer", "float": "a number", "bool": "a boolean", "str": "a string",
              "array": "a list", "object": "an object", "null": "null"}
_WANT_WORDS = {**_GOT_WORDS, "bool": "true or false", "bool | int": "true/false or -1/0/1"}


def _translate(err: msgspec.ValidationError, raw: Any) -> tuple[str, str]:
    """msgspec's 'Expected `int` >= 1 - at `$.A.b`' -> ('A.b', 'must be >= 1, got 0')."""
    text = str(err)
    m = re.fullmatch(r"(.*?) - at `\$(.*)`", text, re.S)
    what, path = (m.group(1), m.group(2).lstrip(".")) if m else (text, "")
    found, value, tp = _lookup(raw, path) if path else (False, None, None)
    got = f", got {json.dumps(value)}" if found else ""
    if (t := re.fullmatch(r"Expected `([^`]+)`, got `([^`]+)`", what)):
        want = _WANT_WORDS.get(t.group(1), t.group(1))
        return path, f"must be {want}, got {_GOT_WORDS.get(t.group(2), t.group(2))}" + (
            f" {json.dumps(value)}" if found else "")
    if what.startswith("Invalid enum value"):
        allowed = ", ".join(json.dumps(v) for v in _literals(tp))
        return path, f"must be one of {allowed}{got}"
    if (c := re.fullmatch(r"Expected `[^`]+` (.+)", what)):
        rule = c.group(1).replace("that's ", "").replace("matching regex", "match the pattern")
        rule = re.sub(r"^of length", "have length", rule)
        rule = rule if rule.startswith(("match", "have")) else "be " + rule
        return path, f"must {rule}{got}"
    return path, what[0].lower() + what[1:] if what else what


# --------------------------------------------------------------------------------------------------
# Loading.

def _read_json(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        # utf-8-sig: files saved by Windows editors start with a BOM.
        return json.loads(data.decode("utf-8-sig"), parse_constant=no_constants)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: line {e.lineno}, column {e.colno}: invalid JSON: {e.msg}") from None
    except ValueError as e:
        raise ConfigError(f"{path}: invalid JSON: {e}") from None


def load_config(path: Optional[str] = None, env: Mapping[str, str] = os.environ) -> Config:
    """Read, override from ``env``, validate. ``path`` None -> $MIES_CONFIG_JSON_PATH, else all defaults.

    An explicit ``path`` wins over MIES_CONFIG_JSON_PATH (a command-line flag beats the environment).
    """
    if path is None:
        path = env.get("MIES_CONFIG_JSON_PATH", "").strip() or None
    source = os.path.abspath(os.path.expanduser(path)) if path else None
    raw: Any = _read_json(source) if source else {}
    if not isinstance(raw, dict):
        raise ConfigError(f"the top level must be a JSON object, got {type(raw).__name__}", source=source)
    ignored: list[str] = []
    _collect_ignored(raw, Config, "", ignored)
    from_env = _apply_env(raw, env)
    try:
        config = msgspec.convert(raw, Config, strict=True)
    except msgspec.ValidationError as e:
        key, message = _translate(e, raw)
        raise ConfigError(message, key or "(top level)", env=_env_for(key, from_env), source=source) from None
    base_dir = os.path.dirname(source) if source else os.getcwd()
    config.__dict__.update(_source=source, _ignored=ignored, _env=from_env, _notes=[])
    _check(config, from_env, source)
    _resolve_paths(config, base_dir, env)
    return config


def _check(config: Config, from_env: Mapping[str, str], source: Optional[str]) -> None:
    """Cross-field rules msgspec's per-field constraints cannot express."""

    def fail(key: str, message: str) -> typing.NoReturn:
        raise ConfigError(message, key, env=_env_for(key, from_env), source=source)

    s, d, b = config.ServerConfig, config.deploy, config.BackendConfig
    for key in ("ipAddress", "managementIpAddress"):
        value = getattr(s, key)
        try:
            ipaddress.ip_address(value)
        except ValueError:
            fail(f"ServerConfig.{key}", f"must be an IPv4 or IPv6 address, got {value!r}")
        if value in _ZERO_IPS and not s.allowAllZeroIpListening:
            fail(f"ServerConfig.{key}", f"{value} listens on every interface; "
                 "set ServerConfig.allowAllZeroIpListening to true to allow it")
    sch = config.schedule
    if sch.maxPrefillBatchSize > sch.maxBatchSize:
        fail("BackendConfig.ScheduleConfig.maxPrefillBatchSize",
             f"must be <= maxBatchSize ({sch.maxBatchSize}), got {sch.maxPrefillBatchSize}")
    if sch.maxIterTimes > d.maxSeqLen:
        fail("BackendConfig.ScheduleConfig.maxIterTimes",
             f"must be <= ModelDeployConfig.maxSeqLen ({d.maxSeqLen}), got {sch.maxIterTimes}")
    ids = b.npuDeviceIds
    if len({len(group) for group in ids}) > 1:
        fail(_DEVICE_IDS_KEY, f"every entry must list the same number of devices, got {ids}")
    flat = [i for group in ids for i in group]
    if len(flat) != len(set(flat)):
        fail(_DEVICE_IDS_KEY, f"a device id appears twice, got {ids}")
    for i, m in enumerate(d.ModelConfig):
        key = f"BackendConfig.ModelDeployConfig.ModelConfig[{i}]"
        if m.worldSize and m.worldSize != len(ids[0]):
            fail(f"{key}.worldSize", f"must equal the number of devices per npuDeviceIds entry "
                 f"({len(ids[0])}), got {m.worldSize}")
        if m.npuMemSize == 0:
            fail(f"{key}.npuMemSize", "must be -1 (auto) or >= 1 (GB), got 0")
    level = config.LogConfig.dynamicLogLevel.strip().lower()
    if level and level not in LOG_LEVELS:
        fail("LogConfig.dynamicLogLevel", f"must be empty or one of {', '.join(LOG_LEVELS)}, "
             f"got {config.LogConfig.dynamicLogLevel!r}")
    notes: list[str] = config.__dict__["_notes"]
    if d.maxInputTokenLen > d.maxSeqLen - 1:
        notes.append(f"BackendConfig.ModelDeployConfig.maxInputTokenLen {d.maxInputTokenLen} > maxSeqLen - 1: "
                     f"inputs are limited to {config.max_input_len} tokens")
    if config.max_prefill_tokens != sch.maxPrefillTokens:
        notes.append(f"BackendConfig.ScheduleConfig.maxPrefillTokens {sch.maxPrefillTokens} < maxInputTokenLen: "
                     f"raised to {config.max_prefill_tokens}")
    if len(d.ModelConfig) > 1:
        notes.append(f"BackendConfig.ModelDeployConfig.ModelConfig has {len(d.ModelConfig)} entries: "
                     "only the first is served")


def _resolve_paths(config: Config, base_dir: str, env: Mapping[str, str]) -> None:
    """Make file paths absolute so every process (whatever its cwd) agrees on them."""
    for m in config.deploy.ModelConfig:
        m.modelWeightPath = m.modelWeightPath.strip()
        if m.modelWeightPath:
            m.modelWeightPath = os.path.join(base_dir, os.path.expanduser(m.modelWeightPath))
    s = config.ServerConfig
    s.runDir = (os.path.join(base_dir, os.path.expanduser(s.runDir)) if s.runDir
                else default_run_dir(s.port, env))


def ignored_keys(config: Config) -> list[str]:
    """Dotted paths of the file's keys this project does not use (e.g. 'ServerConfig.inferMode')."""
    return list(config.__dict__.get("_ignored", []))


def config_notes(config: Config) -> list[str]:
    """Values load_config adjusted the way MindIE does (clamps, raised limits): log them once."""
    return list(config.__dict__.get("_notes", []))


def env_overrides_applied(config: Config) -> dict[str, str]:
    """{dotted key: environment variable} for each override that was applied."""
    return dict(config.__dict__.get("_env", {}))


def dump_effective(config: Config) -> dict[str, Any]:
    """The config as the server uses it (MindIE shape, defaults filled) plus derived values, for logging."""
    out = msgspec.to_builtins(config)
    out["Derived"] = {
        "configFile": config.source_path,
        "demoModel": config.model.is_demo,
        "maxInputLen": config.max_input_len,
        "maxPrefillTokens": config.max_prefill_tokens,
        "truncation": config.deploy.truncation_mode,
        "instances": len(config.instances),
        "worldSize": config.world_size,
        "cpuKvCacheGiB": config.model.cpu_kv_cache_gib,
        "tokenTimeout": config.token_timeout,
        "e2eTimeout": config.e2e_timeout,
        "logLevel": config.log_level,
        "frontendWorkers": config.ServerConfig.frontend_workers,
        "envOverrides": env_overrides_applied(config),
        "ignoredKeys": ignored_keys(config),
    }
    return out


# --------------------------------------------------------------------------------------------------
# Run directory and TLS files.

def default_run_dir(port: int, env: Mapping[str, str] = os.environ) -> str:
    """$XDG_RUNTIME_DIR/mindie-py/<port>, else <$TMPDIR or /tmp>/mindie-py-<uid>/<port>.

    The port keeps two servers on one host from binding the same ipc:// endpoints.
    """
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg) and os.path.isdir(xdg):
        return os.path.join(xdg, "mindie-py", str(port))
    tmp = env.get("TMPDIR", "") or "/tmp"
    return os.path.join(tmp, f"mindie-py-{os.getuid()}", str(port))


def ensure_run_dir(path: str) -> str:
    """Create ``path`` (and its mindie-py parent) mode 0700; refuse one another user could enter."""
    parent = os.path.dirname(path)
    for d in (parent, path):
        try:
            os.makedirs(d, 0o700, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create {d}: {e.strerror or e}", "ServerConfig.runDir") from None
        if d == parent and os.path.basename(d) not in ("mindie-py", f"mindie-py-{os.getuid()}"):
            continue  # a user-chosen parent (e.g. /var/run) is not ours to judge
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ConfigError(f"{d} must be a directory owned by uid {os.getuid()} with mode 0700 "
                              f"(found uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})", "ServerConfig.runDir")
    return path


class TlsFiles(NamedTuple):
    cert: str
    key: str
    ca_files: list[str]
    crl_files: list[str]


_TLS_KEYS = {  # plane -> (cert, key, CA files, CRL dir, CRL files) keys of ServerConfig
    "business": ("tlsCert", "tlsPk", "tlsCaFile", "tlsCrlPath", "tlsCrlFiles"),
    "management": ("managementTlsCert", "managementTlsPk", "managementTlsCaFile", "managementTlsCrlPath",
                   "managementTlsCrlFiles"),
    "metrics": ("metricsTlsCert", "metricsTlsPk", "metricsTlsCaFile", "metricsTlsCrlPath", "metricsTlsCrlFiles"),
}


def tls_files(config: Config, plane: Literal["business", "management", "metrics"] = "business") -> TlsFiles:
    """Absolute TLS paths of one plane. As in MindIE, CA files are names inside tlsCaPath and CRL
    files names inside the plane's CRL dir; relative paths are taken from the config file's
    directory (MindIE: from its install directory)."""
    s = config.ServerConfig
    base = os.path.dirname(config.source_path) if config.source_path else os.getcwd()
    cert, key, ca, crl_dir, crl = (getattr(s, k) for k in _TLS_KEYS[plane])
    ca_dir = os.path.join(base, s.tlsCaPath)
    crl_dir = os.path.join(base, crl_dir)
    return TlsFiles(cert=os.path.join(base, cert), key=os.path.join(base, key),
                    ca_files=[os.path.join(ca_dir, f) for f in ca],
                    crl_files=[os.path.join(crl_dir, f) for f in crl])


def check_tls_files(config: Config, plane: Literal["business", "management", "metrics"] = "business") -> TlsFiles:
    """tls_files(), failing with the key's name when the certificate or key file is missing.

    Not part of load_config: an unchanged MindIE file (httpsEnabled true) must load even where its
    certificates are absent; the launcher calls this only when it is about to serve HTTPS.
    """
    files = tls_files(config, plane)
    cert_key, pk_key = _TLS_KEYS[plane][:2]
    for key, path in ((cert_key, files.cert), (pk_key, files.key)):
        if not os.path.isfile(path):
            raise ConfigError(f"file not found: {path}", f"ServerConfig.{key}", source=config.source_path)
    return files
