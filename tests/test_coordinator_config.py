"""ms_coordinator.json (coordinator/config.py) through the real command line: MindIE's
shipped file accepted (numbers as strings), every typo refused naming the key and the closest
known one, ranges, modes this coordinator does not have refused with the reason, --help."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.harness import ROOT

# MindIE MS's shipped ms_coordinator.json (verylucky01/MindIE-Motor,
# mindie_service/management_service/config/ms_coordinator.json), deploy_mode and TLS switched to
# what a single-node test runs; everything else as shipped, strings included.
SHIPPED = {
    "http_config": {"allow_all_zero_ip_listening": False, "predict_ip": "127.0.0.1", "predict_port": "1025",
                    "manage_ip": "127.0.0.1", "manage_port": "1026", "alarm_port": "1027", "external_port": "1028",
                    "status_port": "1029", "server_thread_num": 10, "client_thread_num": 10,
                    "http_timeout_seconds": 600, "keep_alive_seconds": 180, "server_name": "MindIE-MS",
                    "user_agent": "Coordinator/1.0"},
    "request_limit": {"single_node_max_requests": 1000, "max_requests": 10000, "body_limit": 10},
    "metrics_config": {"enable": False, "trigger_size": 100},
    "prometheus_metrics_config": {"reuse_time": 3},
    "exception_config": {"max_retry": 5, "schedule_timeout": 600, "first_token_timeout": 600, "infer_timeout": 600,
                         "tokenizer_timeout": 300},
    "log_info": {"log_level": "INFO", "to_file": False, "to_stdout": True,
                 "run_log_path": "./logs/ms_coordinator_run_log.txt",
                 "operation_log_path": "./logs/ms_coordinator_operation_log.txt", "max_log_str_size": 4096,
                 "max_log_file_size": 20, "max_log_file_num": 10},
    "digs_scheduler_config": {"deploy_mode": "single_node", "scheduler_type": "default_scheduler",
                              "algorithm_type": "cache_affinity", "cache_size": "100", "slots_thresh": "0.05",
                              "block_thresh": "0.05", "max_schedule_count": "10000", "reordering_type": "1",
                              "max_res_num": "5000", "res_limit_rate": "1.1", "select_type": "2",
                              "load_cost_values": "1, 0", "load_cost_coefficient": "0, 0.22, 1024, 24, 6, 0, 1, 0, 1"},
    "string_token_rate": 4.02,
    "tls_config": {f"{p}_tls_enable": False for p in ("controller_server", "request_server", "mindie_client",
                                                      "mindie_mangment", "external", "status", "etcd_server",
                                                      "alarm_client")}
    | {"external_tls_items": {"ca_cert": "./security/external/security/certs/ca.pem", "tls_cert": "", "tls_key": "",
                              "tls_passwd": "", "kmcKsfMaster": "./ksfa", "kmcKsfStandby": "./ksfb", "tls_crl": ""}},
    "backup_config": {"database_server_dns": "etcd.default.svc.cluster.local", "database_server_port": 2379,
                      "function_enable": False},
    "instances": [{"id": 0, "ip": "127.0.0.1", "business_port": 1125, "mgmt_port": 1126}],
}


def check(tmp_path, cfg: dict, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "ms_coordinator.json"
    path.write_text(json.dumps(cfg))
    return subprocess.run([sys.executable, "-m", "coordinator", "--config", str(path), "--check", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


def with_(path: str, value) -> dict:
    cfg = json.loads(json.dumps(SHIPPED))
    node = cfg
    *parents, last = path.split(".")
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
    node[last] = value
    return cfg


def test_mindie_shipped_file_is_accepted(tmp_path):
    r = check(tmp_path, SHIPPED)
    assert r.returncode == 0, r.stderr
    assert "config ok: predict 127.0.0.1:1025, manage 127.0.0.1:1026, cache_affinity, 1 instance(s)" in r.stdout
    # keys with MindIE's meaning that do nothing here are said so
    assert "note: http_config.alarm_port: accepted, not applied here" in r.stdout
    assert "note: digs_scheduler_config.reordering_type: accepted, not applied here" in r.stdout
    # MindIE's four positional arguments override http_config
    r = check(tmp_path, SHIPPED, "127.0.0.2", "2025", "127.0.0.3", "2026")
    assert "predict 127.0.0.2:2025, manage 127.0.0.3:2026" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("key,value,message", [
    ("http_config.predict_prot", 1025, "http_config.predict_prot: unknown key: did you mean http_config.predict_port?"),
    ("exception_config.max_retires", 3, "exception_config.max_retires: unknown key: did you mean "
                                        "exception_config.max_retry?"),
    ("digs_scheduler_config.algorithm", "x", "digs_scheduler_config.algorithm: unknown key"),
    # a right name in the wrong section: pointed to where it belongs (the server's config.json's rule)
    ("http_config.max_retry", 3, "http_config.max_retry: unknown key: did you mean exception_config.max_retry?"),
    ("instances.0.mgmt_prt", 1, "instances[0].mgmt_prt: unknown key: did you mean instances[0].mgmt_port?"),
    ("tls_config.request_server_tls_items.tls_certs", "x",
     "tls_config.request_server_tls_items.tls_certs: unknown key: did you mean tls_config.request_server_tls_items.tls_cert?"),
    ("exception_config.max_retry", 11, "exception_config.max_retry: must be <= 10, got 11"),
    ("exception_config.max_retry", "three", 'exception_config.max_retry: must be an integer, got a string "three"'),
    ("http_config.predict_port", "80", "http_config.predict_port: must be >= 1024"),
    ("request_limit.body_limit", 0, "request_limit.body_limit: must be >= 1, got 0"),
    ("digs_scheduler_config.algorithm_type", "round_robin", "digs_scheduler_config.algorithm_type: must be one of \"load_balance\", \"cache_affinity\", got \"round_robin\""),
    ("digs_scheduler_config.deploy_mode", "pd_disaggregation", "digs_scheduler_config.deploy_mode: "
                                                               "\"pd_disaggregation\" is not supported by this coordinator: use \"pd_separate\""),
    ("instances", [{"id": 0, "ip": "127.0.0.1", "business_port": 1, "mgmt_port": 2, "role": "P"}],
     "instances[0].role: must be one of"),
    ("http_config.predict_ip", "0.0.0.0", "http_config.predict_ip: 0.0.0.0 listens on every interface"),
    ("http_config.manage_ip", "localhost:1", "http_config.manage_ip: must be an IPv4 or IPv6 address"),
    ("request_limit.single_node_max_requests", 2000, None),  # > max_requests? no: 2000 <= 10000 is fine
    ("backup_config.function_enable", True, "backup_config.function_enable: true needs an etcd"),
    ("request_server_tls", None, None),
])
def test_bad_keys_are_refused_naming_the_key(tmp_path, key, value, message):
    if key == "request_server_tls":  # TLS on without its files
        cfg = with_("tls_config.request_server_tls_enable", True)
        message = "tls_config.request_server_tls_items.tls_cert: must be set when tls_config.request_server_tls_enable is true"
    else:
        cfg = with_(key, value)
    r = check(tmp_path, cfg)
    if message is None:
        assert r.returncode == 0, r.stderr
        return
    assert r.returncode == 2, r.stdout
    assert r.stderr.startswith("mindie-coordinator: config refused: "), r.stderr
    assert message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_every_unknown_key_is_named(tmp_path):
    """Every typo of the file in one refusal, each with the closest known key where there is one
    (mindie.config's one unknown-key check: the server's config.json and the fleet's file alike)."""
    cfg = with_("http_config.predict_prot", 1025)
    cfg["exception_config"]["zzzqqq"] = 1
    r = check(tmp_path, cfg)
    assert r.returncode == 2, r.stdout
    assert r.stderr.strip() == (
        "mindie-coordinator: config refused: 2 unknown keys (not MindIE ms_coordinator.json keys nor project "
        "extensions): http_config.predict_prot (did you mean http_config.predict_port?); exception_config.zzzqqq "
        f"(in {tmp_path / 'ms_coordinator.json'})"), r.stderr


def test_duplicate_instance_ids_and_limits(tmp_path):
    cfg = with_("instances", [{"id": 0, "ip": "127.0.0.1", "business_port": 1125, "mgmt_port": 1126},
                              {"id": 0, "ip": "127.0.0.1", "business_port": 1225, "mgmt_port": 1226}])
    r = check(tmp_path, cfg)
    assert r.returncode == 2 and "instances[1].id: id 0 is already instances[0]'s" in r.stderr, r.stderr
    cfg = with_("request_limit.single_node_max_requests", 2000)
    cfg["request_limit"]["max_requests"] = 100
    r = check(tmp_path, cfg)
    assert r.returncode == 2 and "request_limit.single_node_max_requests: must be <= request_limit.max_requests" \
        in r.stderr, r.stderr


def test_environment_overrides_and_default_path(tmp_path):
    import os
    path = tmp_path / "ms_coordinator.json"
    path.write_text(json.dumps(SHIPPED))
    env = {**os.environ, "MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH": str(path),
           "MINDIE_MS_COORDINATOR_CONFIG_MAX_REQ": "50", "MINDIE_MS_COORDINATOR_CONFIG_SINGLE_NODE_MAX_REQ": "100"}
    r = subprocess.run([sys.executable, "-m", "coordinator", "--check"], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=60)
    # the environment wins over the file (MindIE's rule), and 100 > 50 is then refused
    assert r.returncode == 2 and "single_node_max_requests: must be <= request_limit.max_requests (50)" in r.stderr, \
        r.stdout + r.stderr


def test_help_explains(tmp_path):
    r = subprocess.run([sys.executable, "-m", "coordinator", "--help"], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0
    for word in ("ms_coordinator.json", "predict_port", "/v1/instances/refresh", "/v1/readiness", "instances",
                 "MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH", "docs/config.md"):
        assert word in r.stdout, word


def test_listen_failure_exits_1(tmp_path):
    """A port already taken: exit 1 with the reason, no hang."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cfg = with_("http_config.predict_port", port)
        cfg["instances"] = []
        path = tmp_path / "c.json"
        path.write_text(json.dumps(cfg | {"http_config": cfg["http_config"] | {"manage_port": port + 1 if port < 65535
                                                                               else port - 1}}))
        r = subprocess.run([sys.executable, "-m", "coordinator", "--config", str(path)], capture_output=True,
                           text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "could not listen" in r.stderr, r.stderr
