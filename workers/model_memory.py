"""A model's estimated resident memory, for ``ModelDeployConfig.maxLoadedMemSize``.

The model host (workers/model_host.py) decides from it, before starting a model's worker group,
whether the load fits beside the models already resident, and refuses for good a model that
alone does not fit (docs/design.md, "Several models"). Counted per worker of the group: the
weights (the checkpoint's tensors at the dtype the worker serves them in: a safetensors header
gives each tensor's shape and stored dtype; any other file, GGUF or a torch pickle, counts its
size on disk) plus its KV budget (``cpuMemSize`` GiB on a CPU, ``npuMemSize`` GB on an
accelerator when set). An estimate made without loading anything: torch's own heap and
activations are not in it, and an int8 quantisation is counted at the served dtype (an upper
bound).
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from mindie.contract.spec import WorkerSpec

GIB = 1 << 30
# bytes per element of the safetensors dtypes, and of the dtypes a worker may serve in
_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
          "F8_E4M3": 1, "F8_E5M2": 1, "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
_FLOAT = frozenset({"F64", "F32", "F16", "BF16"})  # converted to the served dtype; the rest kept as stored
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _safetensors_bytes(path: Path, dtype: str) -> int:
    """The tensors of one safetensors file at ``dtype`` ("auto": as stored)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    total = 0
    for name, t in header.items():
        if name == "__metadata__" or not isinstance(t, dict):
            continue
        count = 1
        for d in t.get("shape", []):
            count *= int(d)
        stored = t.get("dtype", "F32")
        per = _BYTES.get(dtype, 0) if stored in _FLOAT and dtype in _BYTES else _BYTES.get(stored, 4)
        total += count * per
    return total


def weight_bytes(model_path: str, dtype: str = "auto") -> int:
    """The checkpoint's weights as a worker holds them (0 when the path has none)."""
    p = Path(model_path) if model_path else None
    if p is None or not p.exists():
        return 0
    files = [p] if p.is_file() else [f for f in p.iterdir() if f.suffix in _WEIGHT_FILES and f.is_file()]
    if any(f.suffix == ".safetensors" for f in files):  # a checkpoint in both formats: counted once
        files = [f for f in files if f.suffix == ".safetensors"]
    total = 0
    for f in files:
        try:
            total += _safetensors_bytes(f, dtype) if f.suffix == ".safetensors" else os.path.getsize(f)
        except (OSError, ValueError, struct.error):
            total += os.path.getsize(f)
    return total


def kv_bytes(spec: WorkerSpec) -> int:
    """One worker's KV budget in bytes (an accelerator's ``npuMemSize`` -1, a share of free
    memory, is not known before the load: 0)."""
    if spec.device_type == "cpu":
        return int(spec.cpu_mem_gb * GIB)
    return int(spec.npu_mem_gb * 1e9) if spec.npu_mem_gb > 0 else 0


def resident_bytes(specs: list[WorkerSpec]) -> int:
    """A worker group's estimated memory: per worker, the weights and its KV budget."""
    if not specs:
        return 0
    weights = weight_bytes(specs[0].model_path, specs[0].dtype)
    return sum(weights + kv_bytes(s) for s in specs)
