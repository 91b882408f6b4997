"""Tests for mindie/config.py: MindIE config.json shape, defaults, ranges, env overrides, messages."""
import copy
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mindie.config import (
    Config, ConfigError, check_tls_files, config_notes, default_run_dir, dump_effective, ensure_run_dir,
    env_overrides_applied, ignored_keys, load_config, tls_files,
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
    "LogConfig.logLevel", "LogConfig.logFileSize", "LogConfig.logFileNum", "LogConfig.logPath",
    "LogConfig.dynamicLogLevelValidHours", "LogConfig.dynamicLogLevelValidTime",
    "ServerConfig.tlsPkPwd", "ServerConfig.managementTlsPkPwd", "ServerConfig.metricsTlsPkPwd",
    "ServerConfig.kmcKsfMaster", "ServerConfig.kmcKsfStandby", "ServerConfig.inferMode",
    "ServerConfig.interCommTLSEnabled", "ServerConfig.interCommPort", "ServerConfig.interCommTlsCaPath",
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


def load_dict(tmp_path: Path, data: dict, env: dict | None = None) -> Config:
    return load_config(write(tmp_path, data), env=env or {})


# ---------------------------------------------------------------------------------------------- defaults

def test_defaults_without_a_file() -> None:
    c = load_config(None, env={})
    assert c.source_path is None
    assert ignored_keys(c) == [] and config_notes(c) == []
    s = c.ServerConfig
    assert (s.ipAddress, s.managementIpAddress) == ("127.0.0.1", "127.0.0.2")
    assert (s.port, s.managementPort, s.metricsPort) == (1025, 1026, 1027)
    assert s.httpsEnabled is False  # project default (MindIE: true)
    assert (s.tokenTimeout, s.e2eTimeout, s.maxRequestLength, s.maxLinkNum) == (600, 600, 40, 1000)
    assert s.HealthCheckConfig.npuUsageThreshold == 10
    assert (s.watermarkGamma, s.watermarkDelta) == (0.5, 2.0)
    assert s.runDir == default_run_dir(1025, {}) == f"/tmp/mindie-py-{os.getuid()}/1025"
    assert c.BackendConfig.npuDeviceIds == [[0]] and c.instances == [[0]] and c.world_size == 1
    assert c.BackendConfig.deviceType == "auto" and c.BackendConfig.cpuThreadsPerWorker == 0
    assert (c.deploy.maxSeqLen, c.deploy.maxInputTokenLen, c.deploy.truncation) == (2560, 2048, False)
    assert c.model.modelName == "demo" and c.model.modelWeightPath == "" and c.model.is_demo
    assert (c.model.npuMemSize, c.model.cpuMemSize, c.model.cpu_kv_cache_gib, c.model.dtype) == (-1, 0, 1, "auto")
    sch = c.schedule
    assert (sch.cacheBlockSize, sch.maxPrefillBatchSize, sch.maxPrefillTokens) == (128, 50, 8192)
    assert (sch.maxBatchSize, sch.maxIterTimes, sch.maxN, sch.enablePrefixCache) == (200, 512, 128, True)
    assert c.max_input_len == 2048 and c.max_prefill_tokens == 8192
    assert (c.token_timeout, c.e2e_timeout, c.log_level) == (600, 600, "INFO")


def test_empty_object_file_equals_defaults(tmp_path: Path) -> None:
    c = load_dict(tmp_path, {})
    assert dump_effective(c)["BackendConfig"] == dump_effective(load_config(None, env={}))["BackendConfig"]
    assert c.source_path == str(tmp_path / "config.json")


def test_config_path_from_env_and_explicit_path_wins(tmp_path: Path) -> None:
    a = write(tmp_path, {"ServerConfig": {"port": 2000}}, "a.json")
    b = write(tmp_path, {"ServerConfig": {"port": 3000}}, "b.json")
    assert load_config(None, env={"MIES_CONFIG_JSON_PATH": a}).ServerConfig.port == 2000
    assert load_config(b, env={"MIES_CONFIG_JSON_PATH": a}).ServerConfig.port == 3000
    assert load_config(None, env={"MIES_CONFIG_JSON_PATH": ""}).ServerConfig.port == 1025


def test_example_file_loads() -> None:
    c = load_config(str(EXAMPLE), env={})
    assert ignored_keys(c) == [] and config_notes(c) == []
    assert c.BackendConfig.npuDeviceIds == [[0], [1]] and c.BackendConfig.deviceType == "cpu"
    assert c.ServerConfig.port == 1025 and c.ServerConfig.httpsEnabled is False
    assert c.model.is_demo and c.model.modelWeightPath == ""
    assert c.schedule.maxPrefillBatchSize <= c.schedule.maxBatchSize


def test_mindie_default_file_loads_unchanged_and_reports_ignored_keys(tmp_path: Path) -> None:
    path = write(tmp_path, MINDIE_DEFAULT)
    before = Path(path).read_bytes()
    c = load_config(path, env={})
    assert Path(path).read_bytes() == before
    assert set(ignored_keys(c)) == MINDIE_IGNORED and len(ignored_keys(c)) == len(MINDIE_IGNORED)
    assert c.ServerConfig.httpsEnabled is True  # honoured when the file says so
    assert c.BackendConfig.npuDeviceIds == [[0, 1, 2, 3]] and c.world_size == 4 and c.model.worldSize == 4
    assert c.model.modelWeightPath == "/data/atb_testdata/weights/llama1-65b-safetensors" and not c.model.is_demo
    assert c.model.cpuMemSize == 5 and c.model.cpu_kv_cache_gib == 5
    assert c.ServerConfig.HealthCheckConfig.npuUsageThreshold == 0
    eff = dump_effective(c)
    json.dumps(eff)  # plain JSON types only
    assert eff["Derived"]["ignoredKeys"] == ignored_keys(c) and eff["Derived"]["worldSize"] == 4
    assert "tlsPkPwd" not in eff["ServerConfig"]  # ignored keys (incl. password files) are not echoed


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
    ("EnableDynamicAdjustTimeoutConfig", 1, "must be true or false, got an integer 1"),
]


@pytest.mark.parametrize("key,value,message", TYPE_CASES, ids=[f"{k}={v!r}"[:60] for k, v, _ in TYPE_CASES])
def test_type_error_names_dotted_key(tmp_path: Path, key: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_dict(tmp_path, with_value(key, value))
    assert str(e.value).startswith(f"{key}: {message}")


@pytest.mark.parametrize("value,mode", [(False, "reject"), (0, "reject"), (True, "right"), (-1, "right"),
                                        (1, "left")])
def test_truncation_accepts_bool_and_minus_one_zero_one(tmp_path: Path, value: Any, mode: str) -> None:
    c = load_dict(tmp_path, with_value("BackendConfig.ModelDeployConfig.truncation", value))
    assert c.deploy.truncation == value and c.deploy.truncation_mode == mode


def test_cache_block_size_accepts_any_multiple_of_16_up_to_1024(tmp_path: Path) -> None:
    for size in (16, 48, 128, 256, 1024):
        assert load_dict(tmp_path, with_value("BackendConfig.ScheduleConfig.cacheBlockSize", size)
                         ).schedule.cacheBlockSize == size


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
    assert load_config(str(path), env={}).ServerConfig.port == 1999


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "nope.json"), env={})


def test_unknown_keys_nested_in_lists_and_top_level(tmp_path: Path) -> None:
    data = {"Foo": 1, "BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"modelName": "a"}, {"bar": 2}]}}}
    c = load_dict(tmp_path, data)
    assert ignored_keys(c) == ["Foo", "BackendConfig.ModelDeployConfig.ModelConfig[1].bar"]
    assert c.model.modelName == "a"
    assert any("only the first is served" in n for n in config_notes(c))


# ---------------------------------------------------------------------------------------------- env

def test_env_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    data = with_value("BackendConfig.ModelDeployConfig.ModelConfig[0].worldSize", 4,
                      {"BackendConfig": {"npuDeviceIds": [[0, 1, 2, 3]]}})
    env = {"MIES_CONTAINER_IP": "10.0.0.5", "MIES_CONTAINER_MANAGEMENT_IP": "10.0.0.6", "MINDIE_PORT": "18080",
           "MINDIE_MODEL_PATH": "weights/qwen", "MINDIE_DEVICE_TYPE": "CPU", "MINDIE_NPU_DEVICE_IDS": "0, 1"}
    c = load_dict(tmp_path, data, env)
    assert (c.ServerConfig.ipAddress, c.ServerConfig.managementIpAddress) == ("10.0.0.5", "10.0.0.6")
    assert c.ServerConfig.port == 18080 and c.ServerConfig.runDir.endswith("/18080")
    assert c.model.modelWeightPath == str(tmp_path / "weights" / "qwen")  # relative to the cwd, not the file
    assert c.BackendConfig.deviceType == "cpu"
    assert c.BackendConfig.npuDeviceIds == [[0], [1]] and c.model.worldSize == 1  # worldSize follows the ids
    assert env_overrides_applied(c)["ServerConfig.port"] == "MINDIE_PORT"
    assert len(env_overrides_applied(c)) == 6


def test_env_device_ids_json_form_and_empty_values_are_unset(tmp_path: Path) -> None:
    c = load_config(None, env={"MINDIE_NPU_DEVICE_IDS": "[[0,1],[2,3]]", "MINDIE_PORT": "", "MIES_CONTAINER_IP": " "})
    assert c.instances == [[0, 1], [2, 3]] and c.world_size == 2
    assert c.ServerConfig.port == 1025 and c.ServerConfig.ipAddress == "127.0.0.1"


def test_env_model_path_creates_model_entry() -> None:
    c = load_config(None, env={"MINDIE_MODEL_PATH": "/models/llama"})
    assert c.model.modelWeightPath == "/models/llama" and not c.model.is_demo


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
])
def test_cross_field_checks(tmp_path: Path, data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_dict(tmp_path, data)
    assert str(e.value).startswith(message)


def test_all_zero_ip_allowed_when_enabled(tmp_path: Path) -> None:
    c = load_dict(tmp_path, {"ServerConfig": {"ipAddress": "0.0.0.0", "allowAllZeroIpListening": True}})
    assert c.ServerConfig.ipAddress == "0.0.0.0"


def test_max_input_len_clamped_and_prefill_tokens_raised(tmp_path: Path) -> None:
    c = load_dict(tmp_path, {"BackendConfig": {
        "ModelDeployConfig": {"maxSeqLen": 4096, "maxInputTokenLen": 8192},
        "ScheduleConfig": {"maxPrefillTokens": 1024, "maxIterTimes": 256}}})
    assert c.max_input_len == 4095  # min(maxInputTokenLen, maxSeqLen - 1)
    assert c.max_prefill_tokens == 4096  # min(maxSeqLen, maxInputTokenLen + maxIterTimes)
    notes = config_notes(c)
    assert len(notes) == 2 and "limited to 4095" in notes[0] and "raised to 4096" in notes[1]
    c = load_dict(tmp_path, {"BackendConfig": {"ScheduleConfig": {"maxPrefillTokens": 1024, "maxIterTimes": 256}}})
    assert c.max_prefill_tokens == 2048 + 256


def test_dynamic_timeout_and_log_level(tmp_path: Path) -> None:
    c = load_dict(tmp_path, {"EnableDynamicAdjustTimeoutConfig": True, "LogConfig": {"dynamicLogLevel": "Warn"}})
    assert (c.token_timeout, c.e2e_timeout, c.log_level) == (3600, 65535, "WARNING")


# ---------------------------------------------------------------------------------------------- paths

def test_relative_paths_follow_the_config_file(tmp_path: Path) -> None:
    data = {"ServerConfig": {"runDir": "run"},
            "BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"modelWeightPath": "models/m"}]}}}
    c = load_dict(tmp_path, data)
    assert c.model.modelWeightPath == str(tmp_path / "models" / "m")
    assert c.ServerConfig.runDir == str(tmp_path / "run")


def test_default_run_dir_prefers_xdg_runtime_dir(tmp_path: Path) -> None:
    assert default_run_dir(1025, {"XDG_RUNTIME_DIR": str(tmp_path)}) == str(tmp_path / "mindie-py" / "1025")
    assert default_run_dir(7, {"XDG_RUNTIME_DIR": str(tmp_path / "missing"), "TMPDIR": str(tmp_path)}) == str(
        tmp_path / f"mindie-py-{os.getuid()}" / "7")


def test_ensure_run_dir_is_private(tmp_path: Path) -> None:
    path = default_run_dir(1025, {"XDG_RUNTIME_DIR": str(tmp_path)})
    assert ensure_run_dir(path) == path and ensure_run_dir(path) == path  # idempotent
    for d in (path, os.path.dirname(path)):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    os.chmod(path, 0o755)
    with pytest.raises(ConfigError, match="ServerConfig.runDir: .* mode 0700"):
        ensure_run_dir(path)


def test_tls_files_and_check(tmp_path: Path) -> None:
    c = load_dict(tmp_path, {"ServerConfig": {"httpsEnabled": True}})
    files = tls_files(c)
    assert files.cert == str(tmp_path / "security/certs/server.pem")
    assert files.ca_files == [str(tmp_path / "security/ca/ca.pem")]
    assert files.crl_files == [str(tmp_path / "security/certs/server_crl.pem")]
    assert tls_files(c, "management").ca_files == [str(tmp_path / "security/ca/management_ca.pem")]
    with pytest.raises(ConfigError, match="ServerConfig.tlsCert: file not found"):
        check_tls_files(c)
    for p in (files.cert, files.key):
        Path(p).parent.mkdir(parents=True, exist_ok=True)
        Path(p).write_text("x")
    assert check_tls_files(c) == files
    with pytest.raises(ConfigError, match="ServerConfig.metricsTlsCert: file not found"):
        check_tls_files(c, "metrics")


def test_config_module_does_not_import_torch() -> None:
    code = "import sys, mindie.config; bad = [m for m in ('torch', 'numpy') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("value,device,null_model,expected", [
    (None, "cpu", False, False), (None, "cuda", False, True), (None, "npu", False, True),
    (None, "cpu", True, True), (True, "cpu", False, True), (False, "cuda", False, False)])
def test_overlap_steps_reaches_the_worker_spec(tmp_path: Path, value, device, null_model, expected) -> None:
    from mindie.topology import worker_specs
    data = with_value("BackendConfig.ScheduleConfig.overlapSteps", value)
    data["BackendConfig"]["deviceType"] = device
    specs = worker_specs(load_dict(tmp_path, data), run_dir=str(tmp_path), null_model=null_model)
    assert [s.overlap for s, _env in specs] == [expected] * len(specs)


def test_overlap_steps_must_be_bool_or_null(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_dict(tmp_path, with_value("BackendConfig.ScheduleConfig.overlapSteps", "yes"))
    assert str(e.value).startswith("BackendConfig.ScheduleConfig.overlapSteps: ")
