"""What a device worker is told, and where it listens.

``mindie/topology.py`` builds one ``WorkerSpec`` per ``npuDeviceIds`` entry from config.json
(the only place config keys become engine settings; the environment overrides of those keys are
applied before, by ``mindie.config``, from its one table) and writes them, as a ``Deployment``, to
``<runDir>/deployment.json``. ``python -m workers.prepare`` settles what only the device side
can know ("auto" device, the demo model's path, every device-dependent default: overlap, prefill
chunk, decode hold, the CPU's bf16 and fused-decode rows) in the same file, once, before any
process starts; the supervisor hands each spec to its worker, which applies ``spec.engine`` as
is (nothing downstream re-defaults a setting).
"""
from __future__ import annotations

import os

import msgspec

DEPLOYMENT_FILE = "deployment.json"


class CpuTuning(msgspec.Struct, kw_only=True, frozen=True):
    """The CPU backend's kernel settings (``BackendConfig.cpuTuning``, docs/config.md). ``None``
    = the host's default, settled in the plan by workers.prepare (``settle_cpu``)."""

    kernels: bool = True  # the C kernels (cpu_kernels.c); false = the portable torch attention, norms, rope
    isa: str = "native"  # native (-march=native) | avx2 (also -mno-avx512f) | avx512 (no avx512_bf16 / AMX)
    kernel_cache: str = ""  # where the kernels are built; "" = $XDG_CACHE_HOME (~/.cache)/mindie-py/kernels
    native_bf16: bool | None = None  # whether the CPU computes bf16 natively; None = detected
    linear_buckets: bool = True  # pad linear row counts to buckets (cpu_linear.py)
    prewarm_gflop: float = 0.0  # oneDNN primitive prewarm budget at start; 0 = off
    fused_decode: bool = True  # the whole decoder stack of a small decode step in one C call
    fused_decode_rows: int | None = None  # its largest batch (0-64); None = 64 with AVX-512 or AVX2+FMA, else 4
    fused_decode_mb: float = 256.0  # the largest weight copy it may keep (MiB)
    int8_rows: int = 24  # w8a16 without the C kernels: _weight_int8pack_mm up to this many rows
    adaptive_threads: bool = True  # each step's thread count chosen from measured step times (step_width.py)
    prefill_attention: str = "kernels"  # prompt chunks: kernels (paged_prefill) | sdpa (attention/cpu.py)
    prefill_linears: str = "kernels"  # bf16 linears on AMX: kernels (linear_rows' tiles) | onednn (cpu_linear.py)
    gguf_compute: str = "auto"  # GGUF linears: auto | dequantise (at load) | native (their blocks, gguf_kernels.c)


class EngineConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The engine's and the scheduler's settings (ScheduleConfig and maxSeqLen, as applied), and
    the worker process's own (tensor-parallel timeouts, gc freeze, CPU tuning).

    The three device-dependent ones are ``None`` in the plan mindie.ops.launch_plan writes (the device may
    still be "auto") and settled once by workers.prepare (``settle_engine``); an engine refuses
    ``None``. Their defaults here are what an engine built directly (tests, benchmarks) runs with."""

    block_size: int = 128  # cacheBlockSize
    max_seq_len: int = 2560  # input + output tokens
    max_batch_size: int = 200  # running sequences
    max_prefill_batch_size: int = 50  # sequences admitted in one step
    max_prefill_tokens: int = 8192  # token budget of one step (MindIE's raised value)
    # Prompt tokens per step while other requests run or wait (prefillChunkTokens); 0 =
    # max_prefill_tokens; None (in the plan) = the device's default, settled by workers.prepare.
    prefill_chunk_tokens: int | None = 0
    # Longest wait (ms) of a running request's next token while steps that complete prompts go
    # first (decodeHoldMs); 0 = every step decodes every running request; None (in the plan) = the
    # device's default, settled by workers.prepare.
    decode_hold_ms: float | None = 0.0
    # Past decode_hold_ms, hold on while the prompts completing were queued before the held
    # requests' last tokens (decodeHoldWave; Scheduler.hold_decodes), never past half the token
    # timeout (ServerConfig.tokenTimeout, s) of the request waiting longest.
    decode_hold_wave: bool = True
    token_timeout_s: float = 600.0
    enable_prefix_cache: bool = True
    # Structured output: emit the tokens a request's grammar forces (each the only token its mask
    # admits) without a model step of their own (jumpForward; workers/engine/constraints.py).
    jump_forward: bool = True
    # Speculative decoding without a draft model (workers/engine/speculative.py): the proposer
    # ("suffix" suffix decoding, "ngram" prompt lookup, "memory_decoding" suffix decoding with
    # recent requests remembered; "" = off), the most tokens proposed
    # per request and step (speculationGamma / decoding_length), the n-gram lengths looked up
    # (promptLookupMin/Max), no speculation in steps with more decoding requests than
    # spec_max_batch (speculationMaxBatch), and the recent acceptance under which a request backs
    # off (speculationMinAcceptance), and how many times its proposed rows may lengthen a step
    # (speculationMaxStretch; 0 = unbounded).
    spec_method: str = "suffix"
    spec_tokens: int = 16
    spec_lookup_min: int = 2
    spec_lookup_max: int = 5
    spec_max_batch: int = 8
    spec_min_acceptance: float = 0.3
    spec_max_stretch: float = 2.0
    # Compute each step on a thread while the worker loop does its I/O (overlapSteps); None (in
    # the plan) = the device's default, settled by workers.prepare.
    overlap: bool | None = False
    tp_start_timeout_s: float = 600.0  # tpStartTimeoutS: ranks waiting for each other at start
    tp_collective_timeout_s: float = 30.0  # tpCollectiveTimeoutS: one collective
    gc_freeze: bool = True  # gcFreeze: gc.freeze() the start-up heap
    # Batch-invariant mode (batchInvariant): every row of a step computed in one order whatever
    # else the step holds (docs/design.md, "Batch invariance"); None (in the plan) = the device's
    # default, settled by workers.prepare (batch_invariant_default; read as off where unsettled).
    batch_invariant: bool | None = False
    cpu: CpuTuning = CpuTuning()  # cpuTuning

    def unsettled(self) -> list[str]:
        """The device-dependent settings still ``None`` (a plan workers.prepare has not settled)."""
        names = [n for n in ("prefill_chunk_tokens", "decode_hold_ms", "overlap") if getattr(self, n) is None]
        return names + [f"cpu.{n}" for n in ("native_bf16", "fused_decode_rows") if getattr(self.cpu, n) is None]


def overlap_default(device_type: str) -> bool:
    """An accelerator computes while the host thread is free, so overlapping the worker loop's
    I/O with the step hides it; on CPU both share the cores and overlap measured neutral
    (docs/performance.md): off."""
    return device_type in ("cuda", "npu")


def prefill_chunk_default(device_type: str) -> int:
    """Prompt tokens per step while several requests have work. On CPU a step's time grows with
    its tokens from a few dozen up: 256-token chunks gave a wave of 32 prompts a p50 TTFT of
    88-96 ms against 278-295 ms in one step, p99 and output tokens/s unchanged; once decode steps
    got faster (the fused decode step, faster attention) 128 beat 256 on output tokens/s, TTFT
    p50 and the p99 gap between tokens, and 64 on TTFT p99 (64 has the smaller gap between
    tokens; docs/performance.md, "TTFT under load").
    Accelerators need bigger steps to be efficient: 2048 (vLLM's default token budget)."""
    return 128 if device_type == "cpu" else 2048


def decode_hold_default(device_type: str) -> int:
    """How long (ms) steps that complete prompts may hold the running requests' decodes. On CPU a
    decode row costs a step about what a prompt row does, so the decodes of a wave's first
    requests slow every later prompt of the wave: holding them up to 400 ms brought the p99 TTFT
    of 32 concurrent requests of 128 output tokens from 396-413 to 340-346 ms and their p99 gap
    between tokens from 30-31 to 18-20 ms (with 32 output tokens that gap's p99 rises to 203-222
    ms: docs/performance.md, "Prefill first"). On accelerators decode rows are nearly free beside
    a prompt chunk: 0."""
    return 400 if device_type == "cpu" else 0


def cpu_flags() -> str:
    """This host's CPU flags (the "flags" line of /proc/cpuinfo; "" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def native_bf16_default(cpu_flags: str) -> bool:
    """Whether a CPU with this /proc/cpuinfo "flags" line computes bf16 natively (AVX512-BF16 or
    AMX-BF16; AVX-512 alone has no bf16 dot products)."""
    return bool(set(cpu_flags.split()) & {"avx512_bf16", "amx_bf16"})


def fused_decode_rows_default(isa: str, cpu_flags: str) -> int:
    """The fused decode step's largest batch: 64 where the kernels are built with AVX-512
    (``-march=native`` on a CPU with avx512f) and where they take their AVX2+FMA loops (an AVX2
    CPU, or ``isa: avx2``: a bench30m fp32 decode step fused is 1.29x faster than eager at 32 rows
    and 1.16x at 64 on an AVX2-only Zen 3, docs/performance.md), 4 with the portable loops of a
    CPU without AVX2+FMA (slower than oneDNN from about 8 rows)."""
    flags = set(cpu_flags.split())
    if isa == "native" and "avx512f" in flags:
        return 64
    return 64 if {"avx2", "fma"} <= flags else 4


def batch_invariant_default(device_type: str) -> bool:
    """ScheduleConfig.batchInvariant's default: on for the CPU, whose C kernels compute each row in
    one order for a cost within 10 % at concurrency 32 (docs/performance.md, "Batch invariance");
    off on accelerators, where the mode is not implemented (docs/design.md)."""
    return device_type == "cpu"


def settle_engine(engine: EngineConfig, device_type: str, cpu_flags: str) -> EngineConfig:
    """``engine`` with every ``None`` replaced by its default for ``device_type`` and this host's
    CPU (``cpu_flags``: its /proc/cpuinfo "flags" line); values already set are kept."""
    cpu = engine.cpu
    if cpu.native_bf16 is None:
        cpu = msgspec.structs.replace(cpu, native_bf16=native_bf16_default(cpu_flags))
    if cpu.fused_decode_rows is None:
        cpu = msgspec.structs.replace(cpu, fused_decode_rows=fused_decode_rows_default(cpu.isa, cpu_flags))
    return msgspec.structs.replace(
        engine, cpu=cpu,
        overlap=overlap_default(device_type) if engine.overlap is None else engine.overlap,
        prefill_chunk_tokens=prefill_chunk_default(device_type) if engine.prefill_chunk_tokens is None
        else engine.prefill_chunk_tokens,
        decode_hold_ms=decode_hold_default(device_type) if engine.decode_hold_ms is None else engine.decode_hold_ms,
        batch_invariant=batch_invariant_default(device_type) if engine.batch_invariant is None
        else engine.batch_invariant)


# The model served when none is configured (workers/models/default_model.py), and its name.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEMO_MODEL_NAME = "demo"  # the random-weight demo model's (launch.sh --demo-model)


class LoraModule(msgspec.Struct, kw_only=True, frozen=True):
    """A LoRA adapter loaded at start (``ModelDeployConfig.LoraModules[]``; ``path`` absolute)."""

    name: str
    path: str
    base_model_name: str = ""


class WorkerSpec(msgspec.Struct, kw_only=True):
    """One device worker (one npuDeviceIds entry)."""

    worker_id: str
    job_endpoint: str  # ipc://<runDir>/... or tcp://HOST:PORT (worker_endpoints)
    pub_endpoint: str
    # tcp links (mindie/runtime/curve.py): CURVE key directory (absolute); "" = none, then plain
    # tcp only with insecure_tcp (BackendConfig.workerInsecureTcp). Unused for ipc.
    curve_key_dir: str = ""
    insecure_tcp: bool = False
    device_type: str = "cpu"  # npu | cuda | cpu; "auto" until workers.prepare settles it
    device_ids: list[int] = []
    model_path: str = ""  # "" until workers.prepare settles it: the default model, or the demo model
    model_name: str = "demo"
    dtype: str = "auto"
    cpu_mem_gb: float = 1.0  # KV cache GiB on the CPU backend
    npu_mem_gb: float = -1.0  # KV cache GB on an accelerator; -1 = a fraction of free memory
    threads: int = 0  # CPU: torch threads; 0 = torch's default
    # CPU: borrow the cores of idle sibling workers (workers/backends/core_share.py); "" = off.
    core_share_file: str = ""
    worker_index: int = 0
    num_workers: int = 1
    null_model: bool = False  # no model compute: serving-stack benchmark
    null_step_ms: float = 0.0
    null_vocab_size: int = 32000
    watermark_gamma: float = 0.5
    watermark_delta: float = 2.0
    log_level: str = "INFO"
    engine: EngineConfig = EngineConfig()
    # ModelConfig[].quantize: "" = the model dtype; "w8a16" = weight-only int8 linears; "w8a8" = int8
    # weights (Q8_0 blocks) and activations on the CPU.
    quantize: str = ""
    # ModelConfig[].moeParallel: "tp" | "ep" (a tensor-parallel instance's split of the routed experts).
    moe_parallel: str = "tp"
    # A worker on another host (BackendConfig.workerHosts): front ends connect to it, this host's
    # supervisor does not start it.
    remote: bool = False
    # LoRA adapters (ModelDeployConfig): those loaded at start, how many stay resident (maxLoras;
    # 0 = as many as LoraModules lists, and none loaded at run time) and the largest rank
    # (maxLoraRank; 0 = the most this server serves, 64).
    lora_modules: list[LoraModule] = []
    max_loras: int = 0
    max_lora_rank: int = 0
    # Prefill/decode disaggregation (workers/pd_transfer.py): this worker's KV endpoint ("" = none),
    # the lease of blocks held for a transfer, how long a decode request waits for its transfer, and
    # what a lost or late one does (ServerConfig.kvTransferLeaseMs, kvTransferTimeoutMs, kvLoadFailurePolicy).
    kv_endpoint: str = ""
    # Its tcp KV endpoint ("" = none; ServerConfig.interCommPort) and the CURVE key directory of KV
    # transfers on tcp, both ways (BackendConfig.workerCurveKeyDir; "" = plain tcp only with insecure_tcp).
    kv_tcp_endpoint: str = ""
    kv_curve_key_dir: str = ""
    kv_lease_ms: int = 30000
    kv_wait_ms: int = 10000
    kv_failure_policy: str = "recompute"


class Deployment(msgspec.Struct, kw_only=True):
    """The launch plan: every device worker of this server."""

    run_dir: str
    workers: list[WorkerSpec]
    demo_model: bool = False  # the built-in demo model (random weights), made by workers.prepare
    default_model: bool = False  # the default model (no model configured), found by workers.prepare
    # Several models (ModelConfig entries after the first; mindie/model_plan.py): each one's worker
    # group, hosted by workers/model_host.py, which loads, evicts and unloads them; ``workers``
    # stays the first model's. [] = one model, served as always.
    models: list[list[WorkerSpec]] = []
    max_loaded_models: int = 0  # ModelDeployConfig.maxLoadedModels as applied (1..number of models)
    keep_alive_s: float = -1.0  # ModelDeployConfig.keepAlive; negative = for good
    max_loaded_mem_gb: float = 0.0  # ModelDeployConfig.maxLoadedMemSize (GiB of resident models); 0 = no bound
    models_endpoint: str = ""  # the model host's control socket (front ends connect)

    @property
    def groups(self) -> list[list[WorkerSpec]]:
        """Every model's worker group, the first model's first."""
        return [self.workers, *self.models]

    @property
    def model_dir(self) -> str:
        return self.workers[0].model_path


def worker_endpoints(run_dir: str, index: int, host: str = "", port: int = 0) -> tuple[str, str]:
    """(job PULL, frame PUB) endpoints of worker ``index``: ipc sockets in the private run dir,
    or with ``host`` (BackendConfig.workerHost) tcp ports ``port + 2*index`` and the one after."""
    if host:
        h = f"[{host}]" if ":" in host else host  # an IPv6 address
        return f"tcp://{h}:{port + 2 * index}", f"tcp://{h}:{port + 2 * index + 1}"
    return f"ipc://{run_dir}/w{index}-jobs.ipc", f"ipc://{run_dir}/w{index}-frames.ipc"


def kv_endpoint(run_dir: str, index: int) -> str:
    """The KV endpoint of worker ``index`` (prefill/decode disaggregation: workers/pd_transfer.py)."""
    return f"ipc://{run_dir}/w{index}-kv.ipc"


def kv_tcp_endpoint(host: str, port: int, index: int) -> str:
    """The tcp KV endpoint of worker ``index``: ``host`` (an IP address) port ``port + index``."""
    h = f"[{host}]" if ":" in host else host  # an IPv6 address
    return f"tcp://{h}:{port + index}"


def deployment_path(run_dir: str) -> str:
    return os.path.join(run_dir, DEPLOYMENT_FILE)


def write_deployment(dep: Deployment, path: str | None = None) -> str:
    """Write atomically (readers never see half a file); returns the path."""
    path = path or deployment_path(dep.run_dir)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(dep)))
    os.replace(tmp, path)
    return path


def read_deployment(path: str) -> Deployment:
    with open(path, "rb") as f:
        return msgspec.json.decode(f.read(), type=Deployment)


def encode_spec(spec: WorkerSpec) -> str:
    return msgspec.json.encode(spec).decode()


def decode_spec(text: str) -> WorkerSpec:
    return msgspec.json.decode(text, type=WorkerSpec)
