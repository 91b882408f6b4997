"""Tests for mindie/config/: MindIE config.json shape, defaults, ranges, env overrides, messages."""
import copy
import json
import os
import re
import stat
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest

import msgspec

from mindie.config import (
    ENV_OVERRIDES, Config, ConfigError, Loaded, default_run_dir, ensure_run_dir, load_config, python_log_level,
    setting_source,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "deploy" / "config.example.json"

# A file shaped like MindIE Server's shipped default config.json (1.0 / 2.0 series): TLS, KMC, inter-node
# and scheduling keys this project does not use must load unchanged and be reported as ignored.
MINDIE_DEFAULT: dict[str, Any] = {
    "Version": "1.0.0",
    "LogConfig": {"logLevel": "Info", "logFileSize": 20, "logFileNum": 20, "logPath": "logs/mindie-server.log",
                  "dynamicLogLevel": "", "dynamicLogLevelValidHours": 2, "dynamicLogLevelValidTime": ""},
    "ServerConfig": {
        "ipAddress": "127.0.0.1", "managementIpAddress": "127.0.0.2", "port": 1025, "managementPort": 1026,
        "metricsPort": 1027, "allowAllZeroIpListening": False, "maxLinkNum": 1000, "httpsEnabled": True,
        "fullTextEnabled": False, "tlsCaPath": "security/ca/", "tlsCaFile": ["ca.pem"],
        "tlsCert": "security/certs/server.pem", "tlsPk": "security/keys/server.key.pem",
        "tlsPkPwd": "security/pass/key_pwd.txt", "tlsCrlPath": "security/certs/", "tlsCrlFiles": ["server_crl.pem"],
        "managementTlsCaFile": ["management_ca.pem"], "managementTlsCert": "security/certs/management/server.pem",
        "managementTlsPk": "security/keys/management/server.key.pem",
        "managementTlsPkPwd": "security/pass/management/key_pwd.txt",
        "managementTlsCrlPath": "security/management/certs/", "managementTlsCrlFiles": ["server_crl.pem"],
        "metricsTlsCaFile": ["metrics_ca.pem"], "metricsTlsCert": "security/certs/metrics/server.pem",
        "metricsTlsPk": "security/keys/metrics/server.key.pem", "metricsTlsPkPwd": "security/pass/metrics/key_pwd.txt",
        "metricsTlsCrlPath": "security/metrics/certs/", "metricsTlsCrlFiles": ["server_crl.pem"],
        "kmcKsfMaster": "tools/pmt/master/ksfa", "kmcKsfStandby": "tools/pmt/standby/ksfb",
        "inferMode": "standard", "interCommTLSEnabled": True, "interCommPort": 1121,
        "interCommTlsCaPath": "security/grpc/ca/", "interCommTlsCaFiles": ["ca.pem"],
        "openAiSupport": "vllm", "tokenTimeout": 600, "e2eTimeout": 600, "distDPServerEnabled": False,
        "HealthCheckConfig": {"npuUsageThreshold": 0},
    },
    "BackendConfig": {
        "backendName": "mindieservice_llm_engine", "modelInstanceNumber": 1, "npuDeviceIds": [[0, 1, 2, 3]],
        "tokenizerProcessNumber": 8, "multiNodesInferEnabled": False, "multiNodesInferPort": 1120,
        "interNodeTLSEnabled": True, "interNodeTlsCaPath": "security/grpc/ca/",
        "interNodeTlsCaFiles": ["ca.pem"], "interNodeTlsCert": "security/grpc/certs/server.pem",
        "interNodeTlsPk": "security/grpc/keys/server.key.pem",
        "ModelDeployConfig": {
            "maxSeqLen": 2560, "maxInputTokenLen": 2048, "truncation": False,
            "ModelConfig": [{
                "modelInstanceType": "Standard", "modelName": "llama_65b",
                "modelWeightPath": "/data/atb_testdata/weights/llama1-65b-safetensors", "worldSize": 4,
                "cpuMemSize": 5, "npuMemSize": -1, "backendType": "atb", "trustRemoteCode": False,
            }],
        },
        "ScheduleConfig": {
            "templateType": "Standard", "templateName": "Standard_LLM", "cacheBlockSize": 128,
            "maxPrefillBatchSize": 50, "maxPrefillTokens": 8192, "prefillTimeMsPerReq": 150,
            "prefillPolicyType": 0, "decodeTimeMsPerReq": 50, "decodePolicyType": 0, "maxBatchSize": 200,
            "maxIterTimes": 512, "maxPreemptCount": 0, "supportSelectBatch": False,
            "maxQueueDelayMicroseconds": 5000,
        },
    },
    "EnableDynamicAdjustTimeoutConfig": False,
}

MINDIE_IGNORED = {
    "LogConfig.dynamicLogLevelValidHours", "LogConfig.dynamicLogLevelValidTime",
    "ServerConfig.kmcKsfMaster", "ServerConfig.kmcKsfStandby",
    "ServerConfig.interCommTLSEnabled", "ServerConfig.interCommTlsCaPath",
    "ServerConfig.interCommTlsCaFiles", "ServerConfig.openAiSupport", "ServerConfig.distDPServerEnabled",
    "BackendConfig.backendName", "BackendConfig.modelInstanceNumber", "BackendConfig.tokenizerProcessNumber",
    "BackendConfig.multiNodesInferEnabled", "BackendConfig.multiNodesInferPort", "BackendConfig.interNodeTLSEnabled",
    "BackendConfig.interNodeTlsCaPath", "BackendConfig.interNodeTlsCaFiles", "BackendConfig.interNodeTlsCert",
    "BackendConfig.interNodeTlsPk",
    "BackendConfig.ModelDeployConfig.ModelConfig[0].modelInstanceType",
    "BackendConfig.ModelDeployConfig.ModelConfig[0].backendType",
    "BackendConfig.ModelDeployConfig.ModelConfig[0].trustRemoteCode",
    "BackendConfig.ScheduleConfig.templateType", "BackendConfig.ScheduleConfig.templateName",
    "BackendConfig.ScheduleConfig.prefillTimeMsPerReq", "BackendConfig.ScheduleConfig.prefillPolicyType",
    "BackendConfig.ScheduleConfig.decodeTimeMsPerReq", "BackendConfig.ScheduleConfig.decodePolicyType",
    "BackendConfig.ScheduleConfig.maxPreemptCount", "BackendConfig.ScheduleConfig.supportSelectBatch",
    "BackendConfig.ScheduleConfig.maxQueueDelayMicroseconds",
}


def write(tmp_path: Path, data: Any, name: str = "config.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data, indent=4))
    return str(path)


def with_value(dotted: str, value: Any, base: dict | None = None) -> dict:
    """A config dict with one key (dotted path, [i] for list items) set to value."""
    data = copy.deepcopy(base) if base is not None else {}
    tokens: list[Any] = [int(t[1:-1]) if t.startswith("[") else t
                         for t in re.findall(r"[^.\[]+|\[\d+\]", dotted)]
    node: Any = data
    for tok, nxt in zip(tokens, tokens[1:]):
        empty: Any = [] if isinstance(nxt, int) else {}
        if isinstance(tok, int):
            while len(node) <= tok:
                node.append(copy.deepcopy(empty))
            node = node[tok]
        else:
            node = node.setdefault(tok, empty)
    last = tokens[-1]
    if isinstance(last, int):
        while len(node) <= last:
            node.append(None)
    node[last] = value
    return data


def load_dict(tmp_path: Path, data: dict, env: dict | None = None) -> Loaded:
    return load_config(write(tmp_path, data), env=env or {})


def cfg(tmp_path: Path, data: dict, env: dict | None = None) -> Config:
    return load_dict(tmp_path, data, env).config


# ---------------------------------------------------------------------------------------------- keys

# Every JSON key the config has always had (MindIE's names plus the project's extensions): the
# snake_case Python names must encode to exactly these.
JSON_KEYS = {
    "": {"Version", "ServerConfig", "BackendConfig", "LogConfig", "EnableDynamicAdjustTimeoutConfig"},
    "ServerConfig": {
        "ipAddress", "managementIpAddress", "port", "managementPort", "metricsPort", "allowAllZeroIpListening",
        "maxLinkNum", "httpsEnabled", "fullTextEnabled", "tlsCaPath", "tlsCaFile", "tlsCert", "tlsPk", "tlsPkPwd", "tlsCrlPath",
        "tlsCrlFiles", "managementTlsCaFile", "managementTlsCert", "managementTlsPk", "managementTlsPkPwd",
        "managementTlsCrlPath", "managementTlsCrlFiles", "metricsTlsCaFile", "metricsTlsCert", "metricsTlsPk",
        "metricsTlsPkPwd", "metricsTlsCrlPath",
        "metricsTlsCrlFiles", "tokenTimeout", "e2eTimeout", "maxRequestLength", "HealthCheckConfig",
        "watermarkGamma", "watermarkDelta", "runDir", "frontendCount", "strictConfig", "drainTimeoutS",
        "responsesStorePath", "enablePromptTokensDetails",
        "inferMode", "pdRole", "kvTransferLeaseMs", "kvTransferTimeoutMs", "kvLoadFailurePolicy",
        "interCommPort", "kvTransferHost", "kvTransferTcpOnly", "headTimeoutS", "bodyTimeoutS"},
    "ServerConfig.HealthCheckConfig": {"npuUsageThreshold"},
    "BackendConfig": {"npuDeviceIds", "deviceType", "cpuThreadsPerWorker", "ModelDeployConfig", "ScheduleConfig",
                      "workerHost", "workerHosts", "workerPort", "workerCurveKeyDir", "workerInsecureTcp",
                      "tpStartTimeoutS", "tpCollectiveTimeoutS", "gcFreeze", "cpuTuning"},
    "BackendConfig.cpuTuning": {
        "kernels", "isa", "kernelCache", "nativeBf16", "linearBuckets", "prewarmGflop", "fusedDecode",
        "fusedDecodeRows", "fusedDecodeMb", "int8Rows", "adaptiveThreads", "prefillAttention",
        "prefillLinears", "ggufCompute"},
    "BackendConfig.ModelDeployConfig": {"maxSeqLen", "maxInputTokenLen", "truncation", "ModelConfig", "maxLoras",
                                        "maxLoraRank", "LoraModules", "speculationGamma", "loraRoot",
                                        "maxLoadedModels", "keepAlive", "enableSleepMode", "maxLoadedMemSize"},
    "BackendConfig.ModelDeployConfig.LoraModules[]": {"name", "path", "baseModelName"},
    "BackendConfig.ModelDeployConfig.ModelConfig[]": {
        "modelName", "modelWeightPath", "worldSize", "cpuMemSize", "npuMemSize", "dtype", "quantize",
        "moeParallel", "models", "reasoningParser", "embeddingPooling", "rerank", "rerankTemplate", "plugin_params"},
    "BackendConfig.ScheduleConfig": {
        "cacheBlockSize", "maxPrefillBatchSize", "maxPrefillTokens", "maxBatchSize", "maxIterTimes", "maxN",
        "enablePrefixCache", "overlapSteps", "prefillChunkTokens", "decodeHoldMs", "decodeHoldWave", "jumpForward",
        "batchInvariant", "speculativeDecoding", "speculationMethod", "promptLookupMin", "promptLookupMax", "speculationMaxBatch", "speculationMinAcceptance",
        "speculationMaxStretch"},
    "LogConfig": {"dynamicLogLevel", "logLevel", "logPath", "logFileSize", "logFileNum", "logFormat"},
}


def _encode_names(tp: Any, path: str, out: dict[str, set[str]]) -> dict[str, set[str]]:
    """{dotted section ("[]" = list items): set of JSON keys} of a Struct and the Structs inside it."""
    out[path] = set()
    for f in msgspec.structs.fields(tp):
        out[path].add(f.encode_name)
        inner, suffix = f.type, ""
        while typing.get_origin(inner) in (typing.Annotated, list):
            if typing.get_origin(inner) is list:
                suffix = "[]"
            inner = typing.get_args(inner)[0]
        if isinstance(inner, type) and issubclass(inner, msgspec.Struct):
            _encode_names(inner, f"{path}.{f.encode_name}".lstrip(".") + suffix, out)
    return out


def test_json_key_set_is_unchanged() -> None:
    assert _encode_names(Config, "", {}) == JSON_KEYS


def test_python_names_are_snake_case() -> None:
    c = Config()
    assert c.server.health_check.npu_usage_threshold == 10
    assert c.backend.model_deploy.models[0].model_name == "SmolLM2-135M-Instruct"
    assert c.backend.schedule.max_n == 128 and c.log.dynamic_log_level == ""
    assert c.version == "1.0.0" and c.enable_dynamic_adjust_timeout is False
    assert msgspec.to_builtins(Config())["BackendConfig"]["ScheduleConfig"]["maxN"] == 128


# ---------------------------------------------------------------------------------------------- defaults

def test_defaults_without_a_file() -> None:
    loaded = load_config(None, env={})
    c = loaded.config
    assert loaded.source is None and loaded.ignored == [] and loaded.notes == [] and loaded.env_overrides == {}
    s = c.server
    assert (s.ip_address, s.management_ip_address) == ("127.0.0.1", "127.0.0.2")
    assert (s.port, s.management_port, s.metrics_port) == (1025, 1026, 1027)
    assert s.https_enabled is False  # project default (MindIE: true)
    assert (s.token_timeout, s.e2e_timeout, s.max_request_length, s.max_link_num) == (600, 600, 40, 1000)
    assert s.health_check.npu_usage_threshold == 10
    assert (s.watermark_gamma, s.watermark_delta, s.frontend_count) == (0.5, 2.0, 0)
    assert s.run_dir == default_run_dir(1025, {}) == f"/tmp/mindie-py-{os.getuid()}/1025"
    b = c.backend
    assert b.npu_device_ids == [[0]] and b.device_type == "auto" and b.cpu_threads_per_worker == 0
    d = b.model_deploy
    assert (d.max_seq_len, d.max_input_token_len, d.truncation) == (2560, 2048, False)
    m = d.models[0]
    assert m.model_name == "SmolLM2-135M-Instruct" and m.model_weight_path == "" and m.world_size == 0
    assert (m.npu_mem_size, m.cpu_mem_size, m.dtype) == (-1, 1, "auto")
    sch = b.schedule
    assert (sch.cache_block_size, sch.max_prefill_batch_size, sch.max_prefill_tokens) == (128, 50, 8192)
    assert (sch.max_batch_size, sch.max_iter_times, sch.max_n, sch.enable_prefix_cache) == (200, 512, 128, True)
    assert sch.overlap_steps is None
    assert c.log.dynamic_log_level == "" and python_log_level(c.log.dynamic_log_level) == "INFO"


def test_empty_object_file_equals_defaults(tmp_path: Path) -> None:
    loaded = load_dict(tmp_path, {})
    assert loaded.config.backend == load_config(None, env={}).config.backend
    assert loaded.source == str(tmp_path / "config.json")


def test_config_path_from_env_and_explicit_path_wins(tmp_path: Path) -> None:
    a = write(tmp_path, {"ServerConfig": {"port": 2000}}, "a.json")
    b = write(tmp_path, {"ServerConfig": {"port": 3000}}, "b.json")
    assert load_config(None, env={"MIES_CONFIG_JSON_PATH": a}).config.server.port == 2000
    assert load_config(None, env={"MIES_CONFIG_JSON_PATH": a}).source == a
    assert load_config(b, env={"MIES_CONFIG_JSON_PATH": a}).config.server.port == 3000
    assert load_config(None, env={"MIES_CONFIG_JSON_PATH": ""}).config.server.port == 1025


def test_comment_keys_are_not_reported(tmp_path: Path) -> None:
    loaded = load_dict(tmp_path, {"//": "x", "ServerConfig": {"//port": "y", "kmcKsfMaster": "k"}})
    assert loaded.ignored == ["ServerConfig.kmcKsfMaster"]


def test_example_file_loads() -> None:
    loaded = load_config(str(EXAMPLE), env={})
    c = loaded.config
    # Starts clean: no key ignored or without effect (the // keys are comments), nothing adjusted.
    assert loaded.ignored == [] and loaded.notes == [] and loaded.unapplied == []
    assert c.backend.npu_device_ids == [[0]] and c.backend.device_type == "cpu"
    assert c.server.port == 1025 and c.server.https_enabled is False
    assert c.backend.model_deploy.models[0].model_weight_path == ""
    assert c.backend.schedule.max_prefill_batch_size <= c.backend.schedule.max_batch_size


def test_mindie_default_file_loads_unchanged_and_reports_ignored_keys(tmp_path: Path) -> None:
    path = write(tmp_path, MINDIE_DEFAULT)
    before = Path(path).read_bytes()
    loaded = load_config(path, env={})
    c = loaded.config
    assert Path(path).read_bytes() == before
    assert set(loaded.ignored) == MINDIE_IGNORED and len(loaded.ignored) == len(MINDIE_IGNORED)
    assert c.server.https_enabled is True  # honoured when the file says so
    m = c.backend.model_deploy.models[0]
    assert c.backend.npu_device_ids == [[0, 1, 2, 3]] and m.world_size == 4
    assert m.model_weight_path == "/data/atb_testdata/weights/llama1-65b-safetensors" and m.model_name == "llama_65b"
    assert m.cpu_mem_size == 5
    assert c.server.health_check.npu_usage_threshold == 0
    # The TLS paths of the file, made absolute against its directory.
    assert c.server.tls_cert == str(tmp_path / "security/certs/server.pem")
    # The key's password file (plain text here; MindIE's is KMC-encrypted), absolute too.
    assert c.server.tls_pk_pwd == str(tmp_path / "security/pass/key_pwd.txt")
    assert "kmcKsfMaster" not in msgspec.to_builtins(c)["ServerConfig"]  # ignored keys are dropped


# ---------------------------------------------------------------------------------------------- ranges

RANGE_CASES = [
    ("BackendConfig.ScheduleConfig.maxBatchSize", 0, "must be >= 1, got 0"),
    ("BackendConfig.ScheduleConfig.maxBatchSize", 819201, "must be <= 819200, got 819201"),
    ("BackendConfig.ScheduleConfig.maxPrefillBatchSize", 0, "must be >= 1, got 0"),
    ("BackendConfig.ScheduleConfig.maxPrefillTokens", 0, "must be >= 1, got 0"),
    ("BackendConfig.ScheduleConfig.maxIterTimes", 0, "must be >= 1, got 0"),
    ("BackendConfig.ScheduleConfig.maxN", 0, "must be >= 1, got 0"),
    ("BackendConfig.ScheduleConfig.cacheBlockSize", 24, "must be a multiple of 16, got 24"),
    ("BackendConfig.ScheduleConfig.cacheBlockSize", 0, "must be >= 16, got 0"),
    ("BackendConfig.ScheduleConfig.cacheBlockSize", 1040, "must be <= 1024, got 1040"),
    ("BackendConfig.ModelDeployConfig.maxSeqLen", 1, "must be >= 2, got 1"),
    ("BackendConfig.ModelDeployConfig.maxInputTokenLen", 0, "must be >= 1, got 0"),
    ("BackendConfig.ModelDeployConfig.maxInputTokenLen", 4194305, "must be <= 4194304, got 4194305"),
    ("BackendConfig.ModelDeployConfig.truncation", 2, "must be one of true, false, -1, 0, 1, got 2"),
    ("BackendConfig.ModelDeployConfig.ModelConfig", [], "must have length >= 1, got []"),
    ("BackendConfig.ModelDeployConfig.maxLoras", -1, "must be >= 0, got -1"),
    ("BackendConfig.ModelDeployConfig.maxLoras", 4097, "must be <= 4096, got 4097"),
    ("BackendConfig.ModelDeployConfig.maxLoraRank", -1, "must be >= 0, got -1"),
    ("BackendConfig.ModelDeployConfig.maxLoadedModels", -1, "must be >= 0, got -1"),
    ("BackendConfig.ModelDeployConfig.maxLoadedModels", 65, "must be <= 64, got 65"),
    ("BackendConfig.ModelDeployConfig.keepAlive", -2, "must be >= -1.0, got -2"),
    ("BackendConfig.ModelDeployConfig.maxLoadedMemSize", -1, "must be >= 0, got -1"),
    ("BackendConfig.ModelDeployConfig.LoraModules[0].name", "a b", "must match the pattern"),
    ("BackendConfig.ModelDeployConfig.ModelConfig[0].modelName", "bad name!", "must match the pattern"),
    ("BackendConfig.ModelDeployConfig.ModelConfig[0].modelName", "x" * 257, "must have length <= 256"),
    ("BackendConfig.ModelDeployConfig.ModelConfig[0].npuMemSize", -2, "must be >= -1, got -2"),
    ("BackendConfig.ModelDeployConfig.ModelConfig[0].cpuMemSize", -1, "must be >= 0, got -1"),
    ("BackendConfig.ModelDeployConfig.ModelConfig[0].dtype", "int8",
     'must be one of "auto", "float32", "bfloat16", "float16", got "int8"'),
    ("BackendConfig.deviceType", "gpu", 'must be one of "auto", "npu", "cuda", "cpu", got "gpu"'),
    ("BackendConfig.cpuThreadsPerWorker", -1, "must be >= 0, got -1"),
    ("BackendConfig.npuDeviceIds", [], "must have length >= 1, got []"),
    ("BackendConfig.npuDeviceIds[1]", [], "must have length >= 1, got []"),
    ("BackendConfig.npuDeviceIds[0][0]", -1, "must be >= 0, got -1"),
    ("ServerConfig.port", 80, "must be >= 1024, got 80"),
    ("ServerConfig.managementPort", 65536, "must be <= 65535, got 65536"),
    ("ServerConfig.metricsPort", 1023, "must be >= 1024, got 1023"),
    ("ServerConfig.maxLinkNum", 4097, "must be <= 4096, got 4097"),
    ("ServerConfig.tokenTimeout", 3601, "must be <= 3600, got 3601"),
    ("ServerConfig.tokenTimeout", 0, "must be >= 1, got 0"),
    ("ServerConfig.e2eTimeout", 65536, "must be <= 65535, got 65536"),
    ("ServerConfig.maxRequestLength", 101, "must be <= 100, got 101"),
    ("ServerConfig.HealthCheckConfig.npuUsageThreshold", 101, "must be <= 100, got 101"),
    ("ServerConfig.watermarkGamma", 1.0, "must be < 1.0, got 1.0"),
    ("ServerConfig.watermarkDelta", 0, "must be > 0.0, got 0"),
    ("ServerConfig.frontendCount", 65, "must be <= 64, got 65"),
]


@pytest.mark.parametrize("key,value,message", RANGE_CASES, ids=[f"{k}={v!r}"[:60] for k, v, _ in RANGE_CASES])
def test_range_violation_names_dotted_key(tmp_path: Path, key: str, value: Any, message: str) -> None:
    data = with_value(key, value, {"BackendConfig": {"npuDeviceIds": [[0], [1]]}} if "[1]" in key else None)
    with pytest.raises(ConfigError) as e:
        load_dict(tmp_path, data)
    assert str(e.value).startswith(f"{key}: {message}")
    assert e.value.key == key and str(tmp_path / "config.json") in str(e.value)


TYPE_CASES = [
    ("ServerConfig.port", "1025", 'must be an integer, got a string "1025"'),
    ("ServerConfig.httpsEnabled", "yes", 'must be true or false, got a string "yes"'),
    ("ServerConfig.ipAddress", 127, "must be a string, got an integer 127"),
    ("ServerConfig.tlsCaFile", "ca.pem", 'must be a list, got a string "ca.pem"'),
    ("ServerConfig.HealthCheckConfig", 5, "must be an object, got an integer 5"),
    ("BackendConfig.ScheduleConfig.maxBatchSize", True, "must be an integer, got a boolean true"),
    ("BackendConfig.ScheduleConfig.maxBatchSize", 1.5, "must be an integer, got a number 1.5"),
    ("BackendConfig.ModelDeployConfig.truncation", "x", 'must be true/false or -1/0/1, got a string "x"'),
    ("BackendConfig.npuDeviceIds", "0,1", 'must be a list, got a string "0,1"'),
    ("BackendConfig.ModelDeployConfig.ModelConfig", {"modelName": "a"}, "must be a list, got an object"),
    ("BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPath", None, "must be a string, got null"),
    ("BackendConfig", [], "must be an object, got a list []"),
    ("ServerConfig", None, "must be an object, got null (in "),  # once: before "got null null"
    ("EnableDynamicAdjustTimeoutConfig", 1, "must be true or false, got an integer 1"),
]


@pytest.mark.parametrize("key,value,message", TYPE_CASES, ids=[f"{k}={v!r}"[:60] for k, v, _ in TYPE_CASES])
def test_type_error_names_dotted_key(tmp_path: Path, key: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_dict(tmp_path, with_value(key, value))
    assert str(e.value).startswith(f"{key}: {message}")


@pytest.mark.parametrize("value", [False, 0, True, -1, 1])
def test_truncation_accepts_bool_and_minus_one_zero_one(tmp_path: Path, value: Any) -> None:
    c = cfg(tmp_path, with_value("BackendConfig.ModelDeployConfig.truncation", value))
    assert c.backend.model_deploy.truncation == value and type(c.backend.model_deploy.truncation) is type(value)


def test_cache_block_size_accepts_any_multiple_of_16_up_to_1024(tmp_path: Path) -> None:
    for size in (16, 48, 128, 256, 1024):
        assert cfg(tmp_path, with_value("BackendConfig.ScheduleConfig.cacheBlockSize", size)
                   ).backend.schedule.cache_block_size == size


@pytest.mark.parametrize("value,loaded", [(0, 1), (0.0, 1), (5, 5), (0.5, 0.5)])
def test_cpu_mem_size_zero_loads_as_one_gib(tmp_path: Path, value: Any, loaded: Any) -> None:
    c = cfg(tmp_path, with_value("BackendConfig.ModelDeployConfig.ModelConfig[0].cpuMemSize", value))
    assert c.backend.model_deploy.models[0].cpu_mem_size == loaded


# ---------------------------------------------------------------------------------------------- JSON / file

def test_json_syntax_error_has_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, '{\n    "ServerConfig": {\n        "port": 1025,\n    }\n}\n')
    with pytest.raises(ConfigError, match=r"config\.json: line 4, column 5: invalid JSON"):
        load_config(path, env={})


@pytest.mark.parametrize("text,message", [
    ('{"ServerConfig": {"watermarkDelta": NaN}}', "NaN is not valid JSON"),
    ("", "line 1, column 1: invalid JSON"),
    ("[1, 2]", "the top level must be a JSON object, got list"),
])
def test_bad_json_documents(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text), env={})


def test_utf8_bom_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"ServerConfig": {"port": 1999}}).encode())
    assert load_config(str(path), env={}).config.server.port == 1999


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "nope.json"), env={})


def test_unknown_keys_nested_in_lists_and_top_level(tmp_path: Path) -> None:
    data = {"Foo": 1, "BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"modelName": "a"}, {"bar": 2}]}}}
    loaded = load_dict(tmp_path, data)
    assert loaded.ignored == ["Foo", "BackendConfig.ModelDeployConfig.ModelConfig[1].bar"]
    assert loaded.config.backend.model_deploy.models[0].model_name == "a"
    assert any("each is served under its modelName" in n for n in loaded.notes)


def test_snake_case_keys_are_not_config_keys(tmp_path: Path) -> None:
    loaded = load_dict(tmp_path, {"ServerConfig": {"port": 2000, "max_link_num": 5}, "server": {}})
    assert loaded.config.server.max_link_num == 1000
    assert loaded.ignored == ["ServerConfig.max_link_num", "server"]


# ---------------------------------------------------------------------------------------------- env

def test_env_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    data = with_value("BackendConfig.ModelDeployConfig.ModelConfig[0].worldSize", 4,
                      {"BackendConfig": {"npuDeviceIds": [[0, 1, 2, 3]]}})
    env = {"MIES_CONTAINER_IP": "10.0.0.5", "MIES_CONTAINER_MANAGEMENT_IP": "10.0.0.6", "MINDIE_PORT": "18080",
           "MINDIE_MODEL_PATH": "weights/qwen", "MINDIE_DEVICE_TYPE": "CPU", "MINDIE_NPU_DEVICE_IDS": "0, 1"}
    loaded = load_dict(tmp_path, data, env)
    c = loaded.config
    assert (c.server.ip_address, c.server.management_ip_address) == ("10.0.0.5", "10.0.0.6")
    assert c.server.port == 18080 and c.server.run_dir.endswith("/18080")
    m = c.backend.model_deploy.models[0]
    assert m.model_weight_path == str(tmp_path / "weights" / "qwen")  # relative to the cwd, not the file
    assert c.backend.device_type == "cpu"
    assert c.backend.npu_device_ids == [[0], [1]] and m.world_size == 1  # worldSize follows the ids
    assert loaded.env_overrides["ServerConfig.port"] == "MINDIE_PORT"
    # MINDIE_PORT moves the other two planes with it (each keeps its offset): they name it too.
    assert (c.server.management_port, c.server.metrics_port) == (18081, 18082)
    assert loaded.env_overrides == {**{key: var for var, key in ENV_OVERRIDES.items() if var in env},
                                    "ServerConfig.managementPort": "MINDIE_PORT", "ServerConfig.metricsPort": "MINDIE_PORT"}
    assert len(loaded.env_overrides) == 8


def test_env_run_dir_relative_to_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "conf").mkdir()
    monkeypatch.chdir(tmp_path)
    data = {"ServerConfig": {"runDir": "from-file"}}
    loaded = load_config(write(tmp_path / "conf", data), env={"MINDIE_RUN_DIR": "run/here"})
    assert loaded.config.server.run_dir == str(tmp_path / "run" / "here")  # the cwd, not the file's dir
    assert loaded.env_overrides == {"ServerConfig.runDir": "MINDIE_RUN_DIR"}
    assert load_config(None, env={"MINDIE_RUN_DIR": "/srv/run"}).config.server.run_dir == "/srv/run"
    assert load_config(None, env={"MINDIE_RUN_DIR": " "}).config.server.run_dir == default_run_dir(1025, {})


def test_env_device_ids_json_form_and_empty_values_are_unset(tmp_path: Path) -> None:
    env = {"MINDIE_NPU_DEVICE_IDS": "[[0,1],[2,3]]", "MINDIE_PORT": "", "MIES_CONTAINER_IP": " "}
    c = load_config(None, env=env).config
    assert c.backend.npu_device_ids == [[0, 1], [2, 3]]
    assert c.server.port == 1025 and c.server.ip_address == "127.0.0.1"


def test_env_model_path_creates_model_entry() -> None:
    c = load_config(None, env={"MINDIE_MODEL_PATH": "/models/llama"}).config
    assert c.backend.model_deploy.models[0].model_weight_path == "/models/llama"


@pytest.mark.parametrize("env,message", [
    ({"MINDIE_PORT": "80"}, "ServerConfig.port: must be >= 1024, got 80 (from environment variable MINDIE_PORT)"),
    ({"MINDIE_PORT": "http"},
     'ServerConfig.port: must be an integer, got a string "http" (from environment variable MINDIE_PORT)'),
    ({"MINDIE_DEVICE_TYPE": "gpu"}, "BackendConfig.deviceType: must be one of"),
    ({"MINDIE_NPU_DEVICE_IDS": "a,b"}, "BackendConfig.npuDeviceIds: expected device ids like"),
    ({"MINDIE_NPU_DEVICE_IDS": "0,0"}, "BackendConfig.npuDeviceIds: a device id appears twice"),
    ({"MINDIE_NPU_DEVICE_IDS": "-1"}, "BackendConfig.npuDeviceIds[0][0]: must be >= 0, got -1"),
    ({"MIES_CONTAINER_IP": "0.0.0.0"}, "ServerConfig.ipAddress: 0.0.0.0 listens on every interface"),
    ({"MIES_CONTAINER_IP": "my-host"}, "ServerConfig.ipAddress: must be an IPv4 or IPv6 address"),
])
def test_env_errors_name_key_and_variable(env: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, env=env)
    assert message in str(e.value)
    assert f"(from environment variable {next(iter(env))})" in str(e.value)


# ---------------------------------------------------------------------------------------------- cross-field

@pytest.mark.parametrize("data,message", [
    ({"BackendConfig": {"ScheduleConfig": {"maxBatchSize": 10, "maxPrefillBatchSize": 11}}},
     "BackendConfig.ScheduleConfig.maxPrefillBatchSize: must be <= maxBatchSize (10), got 11"),
    ({"BackendConfig": {"ScheduleConfig": {"maxIterTimes": 3000}}},
     "BackendConfig.ScheduleConfig.maxIterTimes: must be <= ModelDeployConfig.maxSeqLen (2560), got 3000"),
    ({"ServerConfig": {"ipAddress": "0.0.0.0"}}, "ServerConfig.ipAddress: 0.0.0.0 listens on every interface"),
    ({"ServerConfig": {"managementIpAddress": "::"}}, "ServerConfig.managementIpAddress: :: listens on every"),
    ({"ServerConfig": {"ipAddress": "localhost"}}, "ServerConfig.ipAddress: must be an IPv4 or IPv6 address"),
    ({"BackendConfig": {"npuDeviceIds": [[0, 1], [2]]}},
     "BackendConfig.npuDeviceIds: every entry must list the same number of devices"),
    ({"BackendConfig": {"npuDeviceIds": [[0, 1], [1, 2]]}}, "BackendConfig.npuDeviceIds: a device id appears twice"),
    (with_value("BackendConfig.ModelDeployConfig.ModelConfig[0].worldSize", 4),
     "BackendConfig.ModelDeployConfig.ModelConfig[0].worldSize: must equal the number of devices per "
     "npuDeviceIds entry (1), got 4"),
    (with_value("BackendConfig.ModelDeployConfig.ModelConfig[0].npuMemSize", 0),
     "BackendConfig.ModelDeployConfig.ModelConfig[0].npuMemSize: must be -1 (auto) or >= 1 (GB), got 0"),
    ({"LogConfig": {"dynamicLogLevel": "verbose"}}, "LogConfig.dynamicLogLevel: must be empty or one of"),
    ({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"modelName": "m"}],
                                              "LoraModules": [{"name": "a", "path": "x", "baseModelName": "llama"}]}}},
     "BackendConfig.ModelDeployConfig.LoraModules[0].baseModelName: must be the served model's name, "
     "ModelConfig[0].modelName ('m'), got 'llama'"),
    ({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"modelName": "m"}], "LoraModules": [
        {"name": "a", "path": "x", "baseModelName": "m"}, {"name": "a", "path": "y", "baseModelName": "m"}]}}},
     "BackendConfig.ModelDeployConfig.LoraModules[1].name: appears twice: 'a'"),
    ({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"modelName": "m"}],
                                              "LoraModules": [{"name": "m", "path": "x", "baseModelName": "m"}]}}},
     "BackendConfig.ModelDeployConfig.LoraModules[0].name: must differ from the base model's name"),
    ({"BackendConfig": {"npuDeviceIds": [[0, 1]], "ModelDeployConfig": {
        "ModelConfig": [{"modelName": "m"}], "LoraModules": [{"name": "a", "path": "x", "baseModelName": "m"}]}}},
     "BackendConfig.ModelDeployConfig.LoraModules: LoRA adapters are not served by tensor-parallel instances"),
    ({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"modelName": "m"}, {"modelName": "m"}]}}},
     "BackendConfig.ModelDeployConfig.ModelConfig[1].modelName: appears twice: 'm'"),
])
def test_cross_field_checks(tmp_path: Path, data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_dict(tmp_path, data)
    assert str(e.value).startswith(message)
    assert str(e.value).endswith(f"(in {tmp_path / 'config.json'})")


def test_lora_keys_mindie_example(tmp_path: Path) -> None:
    """MindIE's own example (maxLoras 4, maxLoraRank 296, one LoraModules entry) loads: the path is
    taken from the config's directory, the rank is served up to 64 (a note says so)."""
    loaded = load_dict(tmp_path, {"BackendConfig": {"ModelDeployConfig": {
        "ModelConfig": [{"modelName": "llama3.1-70b"}], "maxLoras": 4, "maxLoraRank": 296,
        "LoraModules": [{"name": "adapter1", "path": "loras/a1", "baseModelName": "llama3.1-70b"}]}}})
    d = loaded.config.backend.model_deploy
    assert (d.max_loras, d.max_lora_rank) == (4, 296)
    assert [(m.name, m.path, m.base_model_name) for m in d.lora_modules] == [
        ("adapter1", str(tmp_path / "loras/a1"), "llama3.1-70b")]
    assert any("maxLoraRank 296: LoRA adapters of rank up to 64 are served" in n for n in loaded.notes)
    assert loaded.ignored == []
    c = Config()
    assert (c.backend.model_deploy.max_loras, c.backend.model_deploy.max_lora_rank) == (0, 0)  # MindIE's defaults


def test_all_zero_ip_allowed_when_enabled(tmp_path: Path) -> None:
    c = cfg(tmp_path, {"ServerConfig": {"ipAddress": "0.0.0.0", "allowAllZeroIpListening": True}})
    assert c.server.ip_address == "0.0.0.0"


# ---------------------------------------------------------------------------------------------- adjustments

def test_max_input_token_len_clamped_and_prefill_tokens_raised(tmp_path: Path) -> None:
    loaded = load_dict(tmp_path, {"BackendConfig": {
        "ModelDeployConfig": {"maxSeqLen": 4096, "maxInputTokenLen": 8192},
        "ScheduleConfig": {"maxPrefillTokens": 1024, "maxIterTimes": 256}}})
    d, sch = loaded.config.backend.model_deploy, loaded.config.backend.schedule
    assert d.max_input_token_len == 4095  # min(maxInputTokenLen, maxSeqLen - 1)
    assert sch.max_prefill_tokens == 4096  # min(maxSeqLen, unclamped maxInputTokenLen + maxIterTimes)
    assert len(loaded.notes) == 2 and "limited to 4095" in loaded.notes[0] and "raised to 4096" in loaded.notes[1]
    c = cfg(tmp_path, {"BackendConfig": {"ScheduleConfig": {"maxPrefillTokens": 1024, "maxIterTimes": 256}}})
    assert c.backend.schedule.max_prefill_tokens == 2048 + 256 and c.backend.model_deploy.max_input_token_len == 2048


def test_values_within_limits_are_not_adjusted(tmp_path: Path) -> None:
    loaded = load_dict(tmp_path, {"BackendConfig": {
        "ModelDeployConfig": {"maxSeqLen": 4096, "maxInputTokenLen": 4095},
        "ScheduleConfig": {"maxPrefillTokens": 4095}}})
    assert loaded.notes == []
    assert loaded.config.backend.model_deploy.max_input_token_len == 4095
    assert loaded.config.backend.schedule.max_prefill_tokens == 4095


def test_dynamic_timeout_sets_timeouts_to_their_maximum(tmp_path: Path) -> None:
    loaded = load_dict(tmp_path, {"EnableDynamicAdjustTimeoutConfig": True,
                                  "ServerConfig": {"tokenTimeout": 5, "e2eTimeout": 6}})
    assert (loaded.config.server.token_timeout, loaded.config.server.e2e_timeout) == (3600, 65535)
    assert len(loaded.notes) == 1 and "EnableDynamicAdjustTimeoutConfig" in loaded.notes[0]
    c = cfg(tmp_path, {"ServerConfig": {"tokenTimeout": 5, "e2eTimeout": 6}})
    assert (c.server.token_timeout, c.server.e2e_timeout) == (5, 6)


@pytest.mark.parametrize("text,level", [("", "INFO"), (" ", "INFO"), ("Warn", "WARNING"), ("warning", "WARNING"),
                                        ("fatal", "CRITICAL"), ("debug", "DEBUG"), ("ERROR", "ERROR")])
def test_python_log_level(tmp_path: Path, text: str, level: str) -> None:
    c = cfg(tmp_path, {"LogConfig": {"dynamicLogLevel": text}})
    assert c.log.dynamic_log_level == text and python_log_level(text) == level


# ---------------------------------------------------------------------------------------------- paths

def test_relative_paths_follow_the_config_file(tmp_path: Path) -> None:
    data = {"ServerConfig": {"runDir": "run"},
            "BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"modelWeightPath": "models/m"}]}}}
    c = cfg(tmp_path, data)
    assert c.backend.model_deploy.models[0].model_weight_path == str(tmp_path / "models" / "m")
    assert c.server.run_dir == str(tmp_path / "run")


def test_tls_paths_follow_the_config_file(tmp_path: Path) -> None:
    s = cfg(tmp_path, {"ServerConfig": {"httpsEnabled": True, "metricsTlsPk": "/etc/keys/m.pem",
                                        "tlsCrlFiles": ["server_crl.pem"]}}).server
    assert s.tls_cert == str(tmp_path / "security/certs/server.pem")
    assert s.tls_pk == str(tmp_path / "security/keys/server.key.pem")
    assert s.management_tls_cert == str(tmp_path / "security/certs/management/server.pem")
    assert s.metrics_tls_pk == "/etc/keys/m.pem"  # absolute paths stay as they are
    # CA and CRL files are names inside their (now absolute) directories.
    assert [os.path.join(s.tls_ca_path, f) for f in s.tls_ca_file] == [str(tmp_path / "security/ca/ca.pem")]
    assert [os.path.join(s.tls_ca_path, f) for f in s.management_tls_ca_file] == [
        str(tmp_path / "security/ca/management_ca.pem")]
    assert [os.path.join(s.tls_crl_path, f) for f in s.tls_crl_files] == [
        str(tmp_path / "security/certs/server_crl.pem")]
    assert os.path.join(s.metrics_tls_crl_path, "x") == str(tmp_path / "security/metrics/certs/x")
    assert s.management_tls_crl_files == [] and s.tls_pk_pwd == ""  # project defaults: no CRL, clear key


def test_tls_paths_without_a_file_follow_the_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert load_config(None, env={}).config.server.tls_cert == str(tmp_path / "security/certs/server.pem")


def test_default_run_dir_prefers_xdg_runtime_dir(tmp_path: Path) -> None:
    assert default_run_dir(1025, {"XDG_RUNTIME_DIR": str(tmp_path)}) == str(tmp_path / "mindie-py" / "1025")
    assert default_run_dir(7, {"XDG_RUNTIME_DIR": str(tmp_path / "missing"), "TMPDIR": str(tmp_path)}) == str(
        tmp_path / f"mindie-py-{os.getuid()}" / "7")
    # A fleet's (scripts/motor.sh, by its coordinator's predict port): the same rule, its own names.
    assert default_run_dir(1025, {"XDG_RUNTIME_DIR": str(tmp_path)}, fleet=True) == str(tmp_path / "mindie-motor" / "1025")
    assert default_run_dir(7, {"TMPDIR": str(tmp_path)}, fleet=True) == str(tmp_path / f"mindie-py-{os.getuid()}" / "motor-7")


def test_ensure_run_dir_is_private(tmp_path: Path) -> None:
    path = default_run_dir(1025, {"XDG_RUNTIME_DIR": str(tmp_path)})
    assert ensure_run_dir(path) == path and ensure_run_dir(path) == path  # idempotent
    for d in (path, os.path.dirname(path)):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    os.chmod(path, 0o755)
    with pytest.raises(ConfigError, match="ServerConfig.runDir: .* mode 0700"):
        ensure_run_dir(path)


def test_config_package_does_not_import_torch() -> None:
    code = "import sys, mindie.config; bad = [m for m in ('torch', 'numpy') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("value,null_model,expected", [
    (None, False, None), (True, False, True), (False, False, False), (None, True, True)])
def test_overlap_steps_reaches_the_worker_spec(tmp_path: Path, value, null_model, expected) -> None:
    # null = the device's default, settled on the worker side (workers/prepare.py); the null model overlaps.
    from mindie.topology import build_deployment
    data = with_value("BackendConfig.ScheduleConfig.overlapSteps", value,
                      {"BackendConfig": {"npuDeviceIds": [[0], [1]]}})
    dep = build_deployment(cfg(tmp_path, data), null_model=null_model)
    assert [w.engine.overlap for w in dep.workers] == [expected, expected]


def test_overlap_steps_must_be_bool_or_null(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_dict(tmp_path, with_value("BackendConfig.ScheduleConfig.overlapSteps", "yes"))
    assert str(e.value).startswith("BackendConfig.ScheduleConfig.overlapSteps: ")


def test_model_name_follows_the_checkpoint_unless_given(tmp_path: Path) -> None:
    """A checkpoint configured without modelName is served under its directory's name, never as
    "demo"; modelName in the file or MINDIE_MODEL_NAME (launch.sh --model-name) wins."""
    loaded = load_config(None, env={"MINDIE_MODEL_PATH": "/models/Qwen2.5-7B-Instruct"})
    assert loaded.config.backend.model_deploy.models[0].model_name == "Qwen2.5-7B-Instruct"
    assert any("modelName not set" in n for n in loaded.notes)
    odd = load_config(None, env={"MINDIE_MODEL_PATH": "/models/my model (v2)/"}).config
    assert odd.backend.model_deploy.models[0].model_name == "my-model-v2"
    gguf = load_config(None, env={"MINDIE_MODEL_PATH": "/models/SmolLM2-135M-Instruct.Q4_1.gguf"}).config
    assert gguf.backend.model_deploy.models[0].model_name == "SmolLM2-135M-Instruct.Q4_1"
    named = load_config(None, env={"MINDIE_MODEL_PATH": "/models/x", "MINDIE_MODEL_NAME": "qwen"})
    assert named.config.backend.model_deploy.models[0].model_name == "qwen" and not named.notes
    assert named.env_overrides["BackendConfig.ModelDeployConfig.ModelConfig[0].modelName"] == "MINDIE_MODEL_NAME"
    f = write(tmp_path, {"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [
        {"modelName": "llama_65b", "modelWeightPath": "w"}]}}})
    assert load_config(str(f), env={}).config.backend.model_deploy.models[0].model_name == "llama_65b"
    # No checkpoint: the default model's name; the demo model (launch.sh --demo-model) as "demo".
    assert load_config(None, env={}).config.backend.model_deploy.models[0].model_name == "SmolLM2-135M-Instruct"
    demo = {"MINDIE_DEMO_MODEL": "1"}
    assert load_config(None, env=demo).config.backend.model_deploy.models[0].model_name == "demo"
    f = write(tmp_path, {"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"dtype": "float32"}]}}})
    assert load_config(str(f), env=demo).config.backend.model_deploy.models[0].model_name == "demo"
    assert load_config(str(f), env={}).config.backend.model_deploy.models[0].model_name == "SmolLM2-135M-Instruct"
    with pytest.raises(ConfigError, match=r"ModelConfig\[0\].modelName.*MINDIE_MODEL_NAME"):
        load_config(None, env={"MINDIE_MODEL_NAME": "bad name!"})


def test_frontend_count_from_file_and_environment(tmp_path: Path) -> None:
    f = write(tmp_path, {"ServerConfig": {"frontendCount": 3}})
    assert load_config(str(f), env={}).config.server.frontend_count == 3
    assert load_config(str(f), env={"MINDIE_FRONTENDS": "2"}).config.server.frontend_count == 2
    with pytest.raises(ConfigError, match="ServerConfig.frontendCount.*MINDIE_FRONTENDS"):
        load_config(None, env={"MINDIE_FRONTENDS": "65"})


def test_receive_timeouts_from_file_and_environment(tmp_path: Path) -> None:
    """headTimeoutS / bodyTimeoutS (the front end's receive timeouts; their effect:
    tests/test_fuzz.py, tests/test_admission.py): defaults, the file, the variables, the range."""
    s = load_config(None, env={}).config.server
    assert (s.head_timeout_s, s.body_timeout_s) == (10.0, 60.0)
    f = write(tmp_path, {"ServerConfig": {"headTimeoutS": 3, "bodyTimeoutS": 7.5}})
    s = load_config(str(f), env={}).config.server
    assert (s.head_timeout_s, s.body_timeout_s) == (3.0, 7.5)
    loaded = load_config(str(f), env={"MINDIE_HEAD_TIMEOUT_S": "2.5", "MINDIE_BODY_TIMEOUT_S": "30"})
    assert (loaded.config.server.head_timeout_s, loaded.config.server.body_timeout_s) == (2.5, 30.0)
    assert loaded.env_overrides == {"ServerConfig.headTimeoutS": "MINDIE_HEAD_TIMEOUT_S",
                                    "ServerConfig.bodyTimeoutS": "MINDIE_BODY_TIMEOUT_S"}
    with pytest.raises(ConfigError, match=r"ServerConfig\.headTimeoutS: must be >= 0\.5, got 0\.1 \(from environment "
                                          r"variable MINDIE_HEAD_TIMEOUT_S\)"):
        load_config(None, env={"MINDIE_HEAD_TIMEOUT_S": "0.1"})
    with pytest.raises(ConfigError, match=r"ServerConfig\.bodyTimeoutS: must be a number, got a string \"soon\""):
        load_config(None, env={"MINDIE_BODY_TIMEOUT_S": "soon"})
    with pytest.raises(ConfigError, match=r"ServerConfig\.bodyTimeoutS: must be <= 3600"):
        load_config(str(write(tmp_path, {"ServerConfig": {"bodyTimeoutS": 7200}})), env={})


# -- typos: unknown keys are named, with the closest known key; strict mode refuses them -------------

TYPO_FILE = {"ServerConfig": {"managmentPort": 1999, "kmcKsfMaster": "k"},
             "BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"modelWeightPth": "/m"}]},
                               "ScheduleConfig": {"maxBatchSzie": 8}}}


def test_unknown_keys_are_told_from_mindie_keys_with_the_closest_known_key(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(TYPO_FILE))
    loaded = load_config(str(path), env={})
    assert dict(loaded.unknown) == {
        "ServerConfig.managmentPort": "ServerConfig.managementPort",
        "BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPth":
            "BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPath",
        "BackendConfig.ScheduleConfig.maxBatchSzie": "BackendConfig.ScheduleConfig.maxBatchSize"}
    assert "ServerConfig.kmcKsfMaster" in loaded.ignored  # MindIE's own key: not a typo
    assert loaded.config.server.management_port == 1026  # the typo set nothing


def test_a_key_in_the_wrong_section_is_pointed_to_where_it_belongs(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"ServerConfig": {"maxBatchSize": 8, "prot": 1025},
                                "BackendConfig": {"ScheduleConfig": {"speculationGama": 4, "npuMemSize": 2}}}))
    assert dict(load_config(str(path), env={}).unknown) == {
        "ServerConfig.maxBatchSize": "BackendConfig.ScheduleConfig.maxBatchSize",  # right name, wrong section
        "ServerConfig.prot": "ServerConfig.port",  # its own section's key is as close as any
        # closer elsewhere than its own section's speculationMaxBatch
        "BackendConfig.ScheduleConfig.speculationGama": "BackendConfig.ModelDeployConfig.speculationGamma",
        "BackendConfig.ScheduleConfig.npuMemSize": "BackendConfig.ModelDeployConfig.ModelConfig[0].npuMemSize"}
    # A suggestion in the key's own list entry keeps its index; a mapping's own keys are shown as such;
    # a close key of its own section (baseModelName) wins over the same name elsewhere (ModelConfig's modelName).
    path.write_text(json.dumps({"BackendConfig": {"ModelDeployConfig": {
        "ModelConfig": [{"modelName": "m"}, {"modelName": "m2", "chat_template": "t.jinja"}],
        "LoraModules": [{"name": "a", "path": "/a", "baseModelName": "m"},
                        {"name": "c", "path": "/c", "baseModelName": "m", "modelName": "m"}]}}}))
    deploy = "BackendConfig.ModelDeployConfig."
    assert dict(load_config(str(path), env={}).unknown) == {
        deploy + "ModelConfig[1].chat_template": deploy + "ModelConfig[1].models.<model_type>.chat_template",
        deploy + "LoraModules[1].modelName": deploy + "LoraModules[1].baseModelName"}


def test_typos_under_a_model_type_are_named_and_mindie_options_there_are_not(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    model = "BackendConfig.ModelDeployConfig.ModelConfig[0].models.llama."
    path.write_text(json.dumps({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"models": {"llama": {
        "chat_templat": "t.jinja", "tool_call_options": {"tool_call_parsr": "hermes"}, "ep_level": 2}}}]}}}))
    loaded = load_config(str(path), env={})
    assert dict(loaded.unknown) == {model + "chat_templat": model + "chat_template",
                                    model + "tool_call_options.tool_call_parsr": model + "tool_call_options.tool_call_parser"}
    assert model + "ep_level" in loaded.ignored  # one of MindIE's many per-model-type options: reported at INFO


def test_an_unknown_key_without_a_close_one_has_no_suggestion(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"ServerConfig": {"zzzqqq": 1}, "Nonsense": {}}))
    assert load_config(str(path), env={}).unknown == [("ServerConfig.zzzqqq", None), ("Nonsense", None)]


def test_mindie_default_file_has_no_unknown_key(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MINDIE_DEFAULT))
    assert load_config(str(path), env={}).unknown == []


def test_strict_config_refuses_an_unknown_key_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"ServerConfig": {"managmentPort": 1999, "strictConfig": True}}))
    with pytest.raises(ConfigError) as e:
        load_config(str(path), env={})
    assert str(e.value).startswith("ServerConfig.managmentPort: unknown key") \
        and "did you mean ServerConfig.managementPort?" in str(e.value)
    path.write_text(json.dumps({"ServerConfig": {"managmentPort": 1999}}))
    with pytest.raises(ConfigError, match=r"\(ServerConfig\.strictConfig, set by environment variable MINDIE_STRICT_CONFIG, "
                                          r"refuses it\): did you mean ServerConfig\.managementPort\? \(in .*c\.json\)$"):
        load_config(str(path), env={"MINDIE_STRICT_CONFIG": "1"})
    assert load_config(str(path), env={"MINDIE_STRICT_CONFIG": "0"}).unknown  # off: loads, keys reported
    path.write_text(json.dumps({"ServerConfig": {"strictConfig": True, "kmcKsfMaster": "k"}}))
    assert load_config(str(path), env={}).config.server.strict_config is True  # MindIE's keys still load


def test_strict_config_names_every_unknown_key(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"ServerConfig": {"managmentPort": 1999, "zzzqqq": 1},
                                "BackendConfig": {"ScheduleConfig": {"maxBatchSzie": 8}}}))
    with pytest.raises(ConfigError) as e:
        load_config(str(path), env={"MINDIE_STRICT_CONFIG": "1"})
    assert str(e.value) == (
        "3 unknown keys (ServerConfig.strictConfig, set by environment variable MINDIE_STRICT_CONFIG, refuses them): "
        "ServerConfig.managmentPort (did you mean ServerConfig.managementPort?); ServerConfig.zzzqqq; "
        f"BackendConfig.ScheduleConfig.maxBatchSzie (did you mean BackendConfig.ScheduleConfig.maxBatchSize?) (in {path})")


def test_a_setting_made_by_a_launch_flag_names_the_flag() -> None:
    flags = {"MINDIE_SET_BY_FLAG": "MINDIE_PORT=--port MINDIE_STRICT_CONFIG=--strict-config"}
    assert setting_source("MINDIE_PORT", flags) == "launch.sh --port"
    assert setting_source("MINDIE_STRICT_CONFIG", flags) == "launch.sh --strict-config"
    assert setting_source("MINDIE_HOST", flags) == "environment variable MINDIE_HOST"
    assert setting_source("MINDIE_PORT", {}) == "environment variable MINDIE_PORT"
    # a flag given twice: the last one set the value
    assert setting_source("MINDIE_PORT", {"MINDIE_SET_BY_FLAG": "MINDIE_PORT=-p MINDIE_PORT=--port"}) == "launch.sh --port"
    # load_config words it from the environment it reads, not the process's
    with pytest.raises(ConfigError, match=r"got 80 \(from launch\.sh -p\)$"):
        load_config(None, env={"MINDIE_PORT": "80", "MINDIE_SET_BY_FLAG": "MINDIE_PORT=-p"})


def test_launcher_warns_on_a_typo_and_refuses_it_with_strict_config(tmp_path: Path) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"ServerConfig": {"managmentPort": 1999, "runDir": str(tmp_path / "run")}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINDIE_", "MIES_"))}
    # The launch step (what scripts/launch.sh runs first) says which key and what was meant.
    r = subprocess.run([sys.executable, "-m", "mindie.ops.launch_plan"], cwd=ROOT, capture_output=True, text=True,
                       env={**env, "MIES_CONFIG_JSON_PATH": str(cfg)}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert ("WARNING [launch] config key ServerConfig.managmentPort is unknown (neither this server's nor MindIE's): "
            "ignored; did you mean ServerConfig.managementPort?") in r.stderr
    assert "config: 1 unknown key ignored (ServerConfig.managmentPort)" in r.stderr
    subprocess.run([sys.executable, "-m", "mindie.ops.run_dir", "release", str(tmp_path / "run")], cwd=ROOT,
                   capture_output=True, timeout=60)
    # The launcher with --strict-config stops before anything starts, exit 2, naming the key.
    r = subprocess.run(["bash", str(ROOT / "scripts" / "launch.sh"), "--config", str(cfg), "--strict-config"],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "config error: ServerConfig.managmentPort: unknown key" in r.stderr + r.stdout
    assert ("config error: ServerConfig.managmentPort: unknown key (ServerConfig.strictConfig, set by launch.sh "
            f"--strict-config, refuses it): did you mean ServerConfig.managementPort? (in {cfg})") in r.stderr + r.stdout
    # A flag that needs a value, given none: said so, exit 2 (before: bash's "unbound variable").
    r = subprocess.run(["bash", str(ROOT / "scripts" / "launch.sh"), "--config", str(cfg), "--port"],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert (r.returncode, r.stderr.strip()) == (2, "launch.sh: --port needs a value (see --help)")
    # ... or followed by another of its flags (before: -n --demo-model served a model named "--demo-model")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "launch.sh"), "-n", "--demo-model"],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert (r.returncode, r.stderr.strip()) == (2, "launch.sh: -n needs a value, got the flag --demo-model (see --help)")
    # --flag=value is --flag value; a flag that takes none says so
    r = subprocess.run(["bash", str(ROOT / "scripts" / "launch.sh"), "--config", str(cfg), "--port=80"],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "ServerConfig.port: must be >= 1024, got 80 (from launch.sh --port)" in r.stderr, r.stderr
    r = subprocess.run(["bash", str(ROOT / "scripts" / "launch.sh"), "--strict-config=1"],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert (r.returncode, r.stderr.strip()) == (2, "launch.sh: --strict-config takes no value (see --help)")


def test_launch_step_refuses_a_missing_model_path_and_a_bad_log_level_naming_their_source(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINDIE_", "MIES_"))}
    env["MINDIE_RUN_DIR"] = str(tmp_path / "run")
    key = "config error: BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPath: "

    def prepare(**extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "mindie.ops.launch_plan"], cwd=ROOT, capture_output=True, text=True,
                              env={**env, **extra}, timeout=60)

    r = prepare(MINDIE_MODEL_PATH="/nowhere", MINDIE_SET_BY_FLAG="MINDIE_MODEL_PATH=-m")
    assert r.returncode == 2 and r.stdout.strip() == "exit 2", r.stdout + r.stderr
    assert key + "/nowhere does not exist (a Hugging Face model directory or a .gguf file is expected) " \
        "(from launch.sh -m)" in r.stderr, r.stderr
    r = prepare(MINDIE_MODEL_PATH="/nowhere")
    assert "(from environment variable MINDIE_MODEL_PATH)" in r.stderr, r.stderr
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"modelWeightPath": "/nowhere"}]}}}))
    r = prepare(MIES_CONFIG_JSON_PATH=str(cfg))
    assert r.returncode == 2 and f"does not exist (a Hugging Face model directory or a .gguf file is expected) " \
        f"(in {cfg})" in r.stderr, r.stderr
    # before: a traceback from logging.basicConfig, then launch.sh's false "claimed by another start"
    r = prepare(MINDIE_LOG_LEVEL="LOUD")
    assert (r.returncode, r.stdout.strip()) == (2, "exit 2") and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == ("config error: LogConfig.dynamicLogLevel: must be one of debug, info, warn, warning, "
                                "error, critical, fatal, got 'LOUD' (from environment variable MINDIE_LOG_LEVEL)")
