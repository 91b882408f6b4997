"""What a device worker is told, and where it listens.

``mindie/topology.py`` builds one ``WorkerSpec`` per ``npuDeviceIds`` entry from config.json
(the only place config keys become engine settings) and writes them, as a ``Deployment``, to
``<runDir>/deployment.json``. ``python -m workers.prepare`` settles what only the device side
can know ("auto" device, the demo model's path, the device's overlap default) in the same
file; the supervisor hands each spec to its worker, which passes ``spec.engine`` to the engine
and the scheduler as is.
"""
from __future__ import annotations

import os

import msgspec

DEPLOYMENT_FILE = "deployment.json"


class EngineConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The engine's and the scheduler's settings (ScheduleConfig and maxSeqLen, as applied)."""

    block_size: int = 128  # cacheBlockSize
    max_seq_len: int = 2560  # input + output tokens
    max_batch_size: int = 200  # running sequences
    max_prefill_batch_size: int = 50  # sequences admitted in one step
    max_prefill_tokens: int = 8192  # token budget of one step (MindIE's raised value)
    # Prompt tokens per step while other requests run or wait (prefillChunkTokens); 0 =
    # max_prefill_tokens; None = the device's default, settled by workers.prepare.
    prefill_chunk_tokens: int | None = None
    # Longest wait (ms) of a running request's next token while steps that complete prompts go
    # first (decodeHoldMs); 0 = every step decodes every running request; None = the device's
    # default, settled by workers.prepare (an engine built with None holds nothing).
    decode_hold_ms: float | None = None
    enable_prefix_cache: bool = True
    # Compute each step on a thread while the worker loop does its I/O; None = the device's
    # default, settled by workers.prepare.
    overlap: bool | None = None


class WorkerSpec(msgspec.Struct, kw_only=True):
    """One device worker (one npuDeviceIds entry)."""

    worker_id: str
    job_endpoint: str  # ipc://<runDir>/... or tcp://HOST:PORT (worker_endpoints)
    pub_endpoint: str
    # tcp links (mindie/contract/curve.py): CURVE key directory (absolute); "" = none, then plain
    # tcp only with insecure_tcp (BackendConfig.workerInsecureTcp). Unused for ipc.
    curve_key_dir: str = ""
    insecure_tcp: bool = False
    device_type: str = "cpu"  # npu | cuda | cpu; "auto" until workers.prepare settles it
    device_ids: list[int] = []
    model_path: str = ""  # "" until workers.prepare makes the built-in demo model
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
    # ModelConfig[].quantize: "" = the model dtype; "w8a16" = weight-only int8 linears.
    quantize: str = ""
    # A worker on another host (BackendConfig.workerHosts): front ends connect to it, this host's
    # supervisor does not start it.
    remote: bool = False


class Deployment(msgspec.Struct, kw_only=True):
    """The launch plan: every device worker of this server."""

    run_dir: str
    workers: list[WorkerSpec]

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
