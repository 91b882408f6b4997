"""CPU backend: a "device" is a worker process with its share of the cores."""
from __future__ import annotations

import ctypes
import os
import time

import torch

from mindie.contract.spec import WorkerSpec
from workers.backends.base import Backend

TRIM_INTERVAL_S = 5.0


def _malloc_trim():
    try:
        fn = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    fn.argtypes = [ctypes.c_size_t]
    return fn


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, threads: int = 0):
        self.threads = threads
        self._trim = _malloc_trim()
        self._next_trim = 0.0

    def after_step(self) -> None:
        # glibc keeps the pages of freed blocks resident (a prefill step's activations reach
        # tens of MB, then decode steps need a fraction): hand free pages back every few seconds
        # (well under a millisecond each time; docs/reliability.md, "Flat memory").
        if self._trim is not None:
            now = time.monotonic()
            if now >= self._next_trim:
                self._trim(0)
                self._next_trim = now + TRIM_INTERVAL_S

    def setup(self) -> None:
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        # One interop thread: the worker runs one forward at a time.
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass

    def bind_thread(self) -> None:
        # OpenMP's thread count is per thread: a new thread would otherwise start with every core.
        torch.set_num_threads(self.threads if self.threads > 0 else torch.get_num_threads())

    def device(self) -> torch.device:
        return torch.device("cpu")

    def free_memory(self) -> int:
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 4 << 30

    def kv_cache_bytes(self, spec: WorkerSpec, fraction: float = 0.8) -> int:
        # cpuMemSize GiB (1 unless configured): never most of the host's RAM by default.
        return int((spec.cpu_mem_gb if spec.cpu_mem_gb > 0 else 1.0) * (1 << 30))

    def prepare_model(self, model: torch.nn.Module) -> None:
        from workers.backends.cpu_fused import fuse_model
        from workers.backends.cpu_linear import pack_linears
        pack_linears(model)
        fuse_model(model)

    def attention_class(self) -> type:
        from workers.backends import cpu_kernels
        if cpu_kernels.load() is None:
            return super().attention_class()
        from workers.backends.cpu_attention import CpuPagedAttention
        return CpuPagedAttention

    def default_dtype(self) -> torch.dtype:
        return torch.float32

    def resolve_dtype(self, name: str, checkpoint_dtype: str | None) -> torch.dtype:
        dtype = super().resolve_dtype(name, checkpoint_dtype)
        # "auto" never picks float16 here: CPUs compute it slowly; bfloat16 has its range.
        return torch.bfloat16 if name == "auto" and dtype is torch.float16 else dtype

    def describe(self) -> str:
        return f"cpu ({torch.get_num_threads()} threads, pid {os.getpid()})"
