"""What a device worker needs to know, handed over by the supervisor as JSON on argv.

Keeping this a plain struct (not the whole server config) keeps the worker independent of
the config file's shape and lets tests start a worker directly.
"""
from __future__ import annotations

import msgspec


class WorkerSpec(msgspec.Struct, kw_only=True):
    worker_id: str
    job_endpoint: str
    pub_endpoint: str
    device_type: str = "cpu"  # npu | cuda | cpu (already resolved from "auto")
    device_ids: list[int] = []
    model_path: str = ""  # "" = built-in demo model
    model_name: str = "demo"
    dtype: str = "auto"
    kv_cache_gb: float = 0.0  # 0 = backend default
    block_size: int = 128
    max_seq_len: int = 2560
    max_iter_times: int = 512
    max_batch_size: int = 200
    max_prefill_batch_size: int = 50
    max_prefill_tokens: int = 8192
    enable_prefix_cache: bool = True
    threads: int = 0
    overlap: bool = False  # compute steps on a thread while the loop does the I/O (engine.Engine)
    # CPU: borrow the cores of idle sibling workers (workers/backends/core_share.py).
    core_share_file: str = ""
    worker_index: int = 0
    num_workers: int = 1
    null_model: bool = False  # no model compute: serving-stack benchmark
    null_step_ms: float = 0.0
    null_vocab_size: int = 32000
    watermark_gamma: float = 0.5
    watermark_delta: float = 2.0
    log_level: str = "INFO"


def encode_spec(spec: WorkerSpec) -> str:
    return msgspec.json.encode(spec).decode()


def decode_spec(text: str) -> WorkerSpec:
    return msgspec.json.decode(text, type=WorkerSpec)
