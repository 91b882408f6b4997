"""Checks across fields that msgspec's per-field constraints cannot express (``check``: keys
named as in the JSON, with the variable that set one), and MindIE's adjustments of the values
once they passed (``adjust``: each returns a note for the launcher's log)."""
import ipaddress
import os
import typing
from typing import Mapping, Optional

from mindie.config.env_overrides import DEVICE_IDS_KEY
from mindie.config.provenance import ConfigError, env_for
from mindie.config.schema import (LOG_LEVELS, MAX_E2E_TIMEOUT_S, MAX_LORA_RANK, MAX_TOKEN_TIMEOUT_S, SPEC_METHODS,
                                  Config, kv_tcp_host, speculation_plugin)
from mindie.text.tool_parsers import names as tool_parser_names

ZERO_IPS = ("0.0.0.0", "::")


def check(config: Config, from_env: Mapping[str, str], source: Optional[str]) -> None:
    """Cross-field rules msgspec's per-field constraints cannot express (keys named as in the JSON)."""

    def fail(key: str, message: str) -> typing.NoReturn:
        raise ConfigError(message, key, env=env_for(key, from_env), source=source)

    s, b = config.server, config.backend
    d, sch = b.model_deploy, b.schedule
    for key, value in (("ipAddress", s.ip_address), ("managementIpAddress", s.management_ip_address)):
        try:
            ipaddress.ip_address(value)
        except ValueError:
            fail(f"ServerConfig.{key}", f"must be an IPv4 or IPv6 address, got {value!r}")
        if value in ZERO_IPS and not s.allow_all_zero_ip_listening:
            fail(f"ServerConfig.{key}", f"{value} listens on every interface; "
                 "set ServerConfig.allowAllZeroIpListening to true to allow it")
    if sch.max_prefill_batch_size > sch.max_batch_size:
        fail("BackendConfig.ScheduleConfig.maxPrefillBatchSize",
             f"must be <= maxBatchSize ({sch.max_batch_size}), got {sch.max_prefill_batch_size}")
    if sch.decode_hold_ms is not None and sch.decode_hold_ms >= s.token_timeout * 1000:
        fail("BackendConfig.ScheduleConfig.decodeHoldMs",
             f"must be < ServerConfig.tokenTimeout ({s.token_timeout} s): a stream held that long would end "
             f"with a token timeout, got {sch.decode_hold_ms} ms")
    if sch.max_iter_times > d.max_seq_len:
        fail("BackendConfig.ScheduleConfig.maxIterTimes",
             f"must be <= ModelDeployConfig.maxSeqLen ({d.max_seq_len}), got {sch.max_iter_times}")
    if sch.prompt_lookup_min > sch.prompt_lookup_max:
        fail("BackendConfig.ScheduleConfig.promptLookupMin",
             f"must be <= promptLookupMax ({sch.prompt_lookup_max}), got {sch.prompt_lookup_min}")
    for i, m in enumerate(d.models):
        try:
            plugin = speculation_plugin(m.plugin_params)
        except ValueError as e:
            fail(f"BackendConfig.ModelDeployConfig.ModelConfig[{i}].plugin_params", str(e))
        if plugin and i == 0 and d.speculation_gamma and d.speculation_gamma < plugin[2]:
            rule = "(level-1)*(window+guess_set_size)" if "level" in m.plugin_params else "decoding_length"
            fail("BackendConfig.ModelDeployConfig.speculationGamma",
                 f"must be >= plugin_params' {rule} ({plugin[2]}), got {d.speculation_gamma}")
    if sch.speculation_method not in SPEC_METHODS:
        fail("BackendConfig.ScheduleConfig.speculationMethod",
             f"must be one of {', '.join(SPEC_METHODS)}, got {sch.speculation_method!r}")
    ids = b.npu_device_ids
    if len({len(group) for group in ids}) > 1:
        fail(DEVICE_IDS_KEY, f"every entry must list the same number of devices, got {ids}")
    flat = [i for group in ids for i in group]
    if len(flat) != len(set(flat)):
        fail(DEVICE_IDS_KEY, f"a device id appears twice, got {ids}")
    names: set[str] = set()
    for i, lm in enumerate(d.lora_modules):
        key = f"BackendConfig.ModelDeployConfig.LoraModules[{i}]"
        if lm.base_model_name != d.models[0].model_name:
            fail(f"{key}.baseModelName", f"must be the served model's name, ModelConfig[0].modelName "
                 f"({d.models[0].model_name!r}), got {lm.base_model_name!r}")
        if lm.name == d.models[0].model_name:
            fail(f"{key}.name", f"must differ from the base model's name, got {lm.name!r}")
        if lm.name in names:
            fail(f"{key}.name", f"appears twice: {lm.name!r}")
        names.add(lm.name)
    if d.lora_modules and len(ids[0]) > 1:
        fail("BackendConfig.ModelDeployConfig.LoraModules", "LoRA adapters are not served by tensor-parallel "
             f"instances (npuDeviceIds entries of {len(ids[0])} devices): remove LoraModules or serve the model on "
             "one device per instance")
    seen_models: set[str] = set()
    for i, m in enumerate(d.models):
        key = f"BackendConfig.ModelDeployConfig.ModelConfig[{i}]"
        if m.model_name in seen_models:
            fail(f"{key}.modelName", f"appears twice: {m.model_name!r} (each model is served under its own name)")
        seen_models.add(m.model_name)
        if m.world_size and m.world_size != len(ids[0]):
            fail(f"{key}.worldSize", f"must equal the number of devices per npuDeviceIds entry "
                 f"({len(ids[0])}), got {m.world_size}")
        if m.npu_mem_size == 0:
            fail(f"{key}.npuMemSize", "must be -1 (auto) or >= 1 (GB), got 0")
        for model_type, opts in m.models.items():
            parser = opts.tool_call_options.tool_call_parser.strip()
            if parser and tool_parser_names.canonical(parser) is None:
                # MindIE falls back to the model's default parser; a typo is refused here instead
                fail(f"{key}.models.{model_type}.tool_call_options.tool_call_parser",
                     f"must be empty or one of {', '.join(sorted(tool_parser_names.ALIASES))}, got {parser!r}")
    _check_kv_link(config, fail, source)
    # Worker links (project extensions; mindie/runtime/curve.py).
    for key, host in [("BackendConfig.workerHost", b.worker_host)] + [
            (f"BackendConfig.workerHosts[{i}]", h) for i, h in enumerate(b.worker_hosts)]:
        if not host and key == "BackendConfig.workerHost":
            continue
        try:
            unspecified = ipaddress.ip_address(host).is_unspecified
        except ValueError:
            empty_ok = "empty (ipc sockets in runDir) or " if key == "BackendConfig.workerHost" else ""
            fail(key, f"must be {empty_ok}an IPv4 or IPv6 address, got {host!r}")
        if unspecified:
            fail(key, f"{host} is not an address front ends can connect to; give the address of the workers' host")
    # One spelling per address (ids and the "is this host" test compare strings).
    b.worker_hosts = [ipaddress.ip_address(h).compressed for h in b.worker_hosts]
    if b.worker_host:
        b.worker_host = ipaddress.ip_address(b.worker_host).compressed
    if len(set(b.worker_hosts)) != len(b.worker_hosts):
        fail("BackendConfig.workerHosts", f"a host appears twice, got {b.worker_hosts}")
    if b.worker_hosts and b.worker_host and b.worker_host not in b.worker_hosts:
        fail("BackendConfig.workerHosts", f"must list workerHost ({b.worker_host}), the host this config's device "
             f"workers bind, got {b.worker_hosts}")
    if b.worker_host or b.worker_hosts:
        from mindie.runtime.curve import CurveKeyError, check_key_dir

        n = len(b.npu_device_ids)
        if not 1024 <= b.worker_port <= 65535:
            fail("BackendConfig.workerPort", f"must be in [1024, 65535] when workerHost or workerHosts is set, "
                 f"got {b.worker_port}")
        if b.worker_port + 2 * n - 1 > 65535:
            fail("BackendConfig.workerPort", f"{n} workers use ports {b.worker_port}..{b.worker_port + 2 * n - 1} "
                 f"(two each): must be <= {65535 - 2 * n + 1}, got {b.worker_port}")
        key_dir = b.worker_curve_key_dir.strip()
        if not key_dir and not b.worker_insecure_tcp:
            fail("BackendConfig.workerCurveKeyDir", "tcp worker links (workerHost or workerHosts is set) need CURVE keys: set it to "
                 "a key directory (python -m mindie.ops.curve_keys DIR makes one), or set workerInsecureTcp: true "
                 "to allow plain tcp")
        if key_dir:  # the files, checked where _resolve_paths will take them from
            try:
                check_key_dir(os.path.join(os.path.dirname(source) if source else os.getcwd(),
                                           os.path.expanduser(key_dir)))
            except CurveKeyError as e:
                fail(e.key, e.message)
    for key, level in (("dynamicLogLevel", config.log.dynamic_log_level), ("logLevel", config.log.log_level)):
        if level.strip() and level.strip().lower() not in LOG_LEVELS:
            fail(f"LogConfig.{key}", f"must be empty or one of {', '.join(LOG_LEVELS)}, got {level!r}")


def _check_kv_link(config: Config, fail, source: Optional[str]) -> None:
    """The KV transfer endpoint on tcp: a port range the workers fit in, an address peers can
    connect to, and CURVE keys (or the insecure flag) as for tcp worker links."""
    s, b = config.server, config.backend
    host = kv_tcp_host(s)
    if s.kv_transfer_tcp_only and not host:
        fail("ServerConfig.kvTransferTcpOnly", "needs the tcp KV endpoint: inferMode \"dmi\" and interCommPort > 0")
    if s.kv_transfer_host.strip() and not host:
        fail("ServerConfig.kvTransferHost", "is used only with inferMode \"dmi\" and interCommPort > 0")
    if not host:
        return
    n = len(b.npu_device_ids)
    if not 1024 <= s.inter_comm_port <= 65536 - n:
        fail("ServerConfig.interCommPort", f"must be 0 (KV over ipc only) or in [1024, {65536 - n}] ({n} workers "
             f"bind interCommPort + 0..{n - 1}), got {s.inter_comm_port}")
    key = "ServerConfig.kvTransferHost" if s.kv_transfer_host.strip() else "ServerConfig.ipAddress"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        fail(key, f"the KV transfer endpoint's address must be an IPv4 or IPv6 address, got {host!r}")
    if ip.is_unspecified:
        fail("ServerConfig.kvTransferHost", f"the KV transfer endpoint needs an address peers can connect to, not "
             f"{host} (ipAddress): set kvTransferHost (in Kubernetes MINDIE_KV_TRANSFER_HOST from status.podIP)")
    key_dir = b.worker_curve_key_dir.strip()
    if not key_dir and not b.worker_insecure_tcp:
        fail("BackendConfig.workerCurveKeyDir", "the tcp KV transfer endpoint (inferMode dmi, interCommPort "
             f"{s.inter_comm_port}) needs CURVE keys: set it to a key directory (python -m mindie.ops.curve_keys DIR "
             "makes one), set workerInsecureTcp: true to allow plain tcp, or interCommPort 0 for ipc only")
    if key_dir:
        from mindie.runtime.curve import CurveKeyError, check_kv_key_dir

        try:
            check_kv_key_dir(os.path.join(os.path.dirname(source) if source else os.getcwd(),
                                          os.path.expanduser(key_dir)))
        except CurveKeyError as e:
            fail(e.key, e.message)


def adjust(config: Config) -> list[str]:
    """Apply MindIE's adjustments to the values (once, here); returns a note for each."""
    notes: list[str] = []
    d, sch, s = config.backend.model_deploy, config.backend.schedule, config.server
    # maxPrefillTokens is raised with the unclamped maxInputTokenLen, as MindIE does.
    prefill = sch.max_prefill_tokens
    if prefill < d.max_input_token_len:
        prefill = max(prefill, min(d.max_seq_len, d.max_input_token_len + sch.max_iter_times))
    if d.max_input_token_len > d.max_seq_len - 1:
        notes.append(f"BackendConfig.ModelDeployConfig.maxInputTokenLen {d.max_input_token_len} > maxSeqLen - 1: "
                     f"inputs are limited to {d.max_seq_len - 1} tokens")
        d.max_input_token_len = d.max_seq_len - 1
    if prefill != sch.max_prefill_tokens:
        notes.append(f"BackendConfig.ScheduleConfig.maxPrefillTokens {sch.max_prefill_tokens} < maxInputTokenLen: "
                     f"raised to {prefill}")
        sch.max_prefill_tokens = prefill
    if config.enable_dynamic_adjust_timeout:
        s.token_timeout, s.e2e_timeout = MAX_TOKEN_TIMEOUT_S, MAX_E2E_TIMEOUT_S
        notes.append(f"EnableDynamicAdjustTimeoutConfig: ServerConfig.tokenTimeout set to {MAX_TOKEN_TIMEOUT_S}, "
                     f"e2eTimeout to {MAX_E2E_TIMEOUT_S}")
    if len(d.models) > 1:
        notes.append(f"BackendConfig.ModelDeployConfig.ModelConfig has {len(d.models)} entries: each is served "
                     f"under its modelName, at most {d.max_loaded_models or len(d.models)} loaded at once "
                     "(maxLoadedModels)")
    for m in d.models:
        m.cpu_mem_size = m.cpu_mem_size or 1  # project: 0 = 1 GiB of CPU KV cache
    if d.max_lora_rank > MAX_LORA_RANK:
        notes.append(f"BackendConfig.ModelDeployConfig.maxLoraRank {d.max_lora_rank}: LoRA adapters of rank up to "
                     f"{MAX_LORA_RANK} are served (the most this server serves)")
    if d.max_loras and len(config.backend.npu_device_ids[0]) > 1:
        notes.append("BackendConfig.ModelDeployConfig.maxLoras: tensor-parallel instances serve no LoRA adapter "
                     "(/v1/load_lora_adapter is refused)")
    return notes
