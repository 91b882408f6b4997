"""CPU backend: a "device" is a worker process with its share of the cores."""
from __future__ import annotations

import logging
import os
import time

import torch

from mindie.contract.spec import WorkerSpec, cpu_flags, native_bf16_default
from mindie.runtime import heap
from workers import settings
from workers.backends.base import Backend
from workers.backends.cpu_dispatch import Dispatch, decide
from workers.backends.cpu_specialise import specialise_cpu_model, warm_up_cpu_model
from workers.backends import w8a8
from workers.backends.gguf_linear import X16_ROW_COST, native_target
from workers.backends.int8 import CpuInt8Kernel
from workers.backends.step_width import narrow_threads_alone
from workers.kernels import cpu_kernels

log = logging.getLogger("workers.backends")

TRIM_INTERVAL_S = 5.0


def native_bf16(cpu_flags: str | None = None) -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX-BF16): ``cpuTuning.nativeBf16``
    as the plan settled it (detected unless set; ``MINDIE_CPU_BF16`` overrides the key). With
    ``cpu_flags`` (a /proc/cpuinfo "flags" line, tests): the detection from that line."""
    if cpu_flags is not None:
        return native_bf16_default(cpu_flags)
    value = settings.cpu().native_bf16
    if value is None:
        raise ValueError("cpuTuning.nativeBf16 is not settled (python -m workers.prepare settles the launch plan)")
    return value


def bf16_tiles() -> bool:
    """Whether bf16 products run on the C kernels' register-tiled AVX2 paths here (an AVX2 build,
    or an AVX-512 one without avx512_bf16: ``has_w16a32``; workers/backends/cpu_linear.py,
    ``KernelLinear``): on a CPU
    without native bf16 they beat oneDNN's fp32 products from 4 rows (docs/performance.md,
    "AVX2-only AMD EPYC (Zen 3)"). False with the kernels off or unbuilt."""
    from workers.kernels import cpu_kernels

    lib = cpu_kernels.load()
    return lib is not None and getattr(lib, "has_w16a32", False) and hasattr(lib, "kernels_tile_rows")


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, threads: int = 0):
        self.threads = threads
        self._next_trim = 0.0
        self.dispatch: Dispatch | None = None  # the kernels chosen for the model (prepare_model)

    def after_step(self) -> None:
        # glibc keeps the pages of freed blocks resident (a prefill step's activations reach
        # tens of MB, then decode steps need a fraction): hand free pages back every few seconds
        # (well under a millisecond each time; docs/reliability.md, "Flat memory").
        now = time.monotonic()
        if now >= self._next_trim:
            heap.trim()
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

    def prepare_model(self, model: torch.nn.Module) -> None:
        # the steps and their order: workers/backends/cpu_specialise.py
        specialise_cpu_model(model, bf16_weights=self.bf16_weights)
        self.dispatch = decide(model, cpu_kernels.load())
        log.info("cpu kernels: %s", self.dispatch.line())  # once per worker: its one model load

    def warm_up(self, model: torch.nn.Module, spec: WorkerSpec) -> None:
        """Create the oneDNN primitives of every (linear shape, row bucket, thread count) this
        worker can meet: its own share of the cores, and with core lending its share times 2 ..
        workers (workers/backends/core_share.py), or half its cores for a worker alone that
        steps narrow on a busy host (workers/backends/step_width.py). Its heap then starts at its plateau
        (docs/reliability.md, "Flat memory")."""
        base = self.threads if self.threads > 0 else torch.get_num_threads()
        lending = bool(spec.core_share_file) and spec.num_workers > 1
        counts = [base * k for k in range(1, spec.num_workers + 1)] if lending else [base]
        if narrow := narrow_threads_alone(spec):
            counts.append(narrow)  # a worker alone steps narrow on a busy host
        cfg = spec.engine
        warm_up_cpu_model(model, counts, max_rows=cfg.max_prefill_tokens, max_head_rows=cfg.max_batch_size)
        heap.trim()  # the warm-up's activations (up to 8192 rows) are freed: hand their pages back

    def int8_kernel(self):
        # torch._weight_int8pack_mm for decode-sized row counts, dequantise-then-matmul above.
        return CpuInt8Kernel()

    def w8a8_target(self):
        # the GGUF block kernels over Q8_0 blocks, whatever cpuTuning.ggufCompute says
        return w8a8.target()

    def gguf_target(self, dtype: torch.dtype = torch.bfloat16):
        # cpuTuning.ggufCompute: auto (gguf_linear.compute: by the CPU, batchInvariant and the
        # rows' dtype), native or dequantise
        flags = settings.cpu().native_bf16
        return native_target(bf16=native_bf16_default(cpu_flags()) if flags is None else flags, dtype=dtype)

    def spec_row_cost(self, model: torch.nn.Module) -> float | None:
        # the interleaved GGUF products make one row cheap and each further row compute-bound:
        # 7-34 % of a one-row step a row by build (mindie-bench speculative --row-cost), not the
        # 6-10 % of the other products (the engine's default)
        x16 = next((m for m in model.modules() if getattr(m, "x16", False)), None)
        return None if x16 is None else X16_ROW_COST.get(x16.lib.isa, X16_ROW_COST[2])

    def default_dtype(self) -> torch.dtype:
        return torch.float32

    bf16_weights = False  # resolve_dtype's choice for prepare_model: fp32 rows over bf16 weights

    def resolve_dtype(self, name: str, checkpoint_dtype: str | None, plain_weights: bool = True,
                      gguf: bool = False) -> torch.dtype:
        """"auto" = what this CPU computes fastest without losing the checkpoint's precision:
        never float16 (CPUs compute it slowly; bfloat16 has its range). bfloat16 where the CPU
        computes it natively or where the C kernels' tiled AVX2 bf16 products (``bf16_tiles``: an
        AVX2 CPU, 1.1x oneDNN fp32's rate on a prompt, 1.5-1.7x on decodes, measured before the
        one-row products' change) take a bf16 checkpoint's own linears (``plain_weights``);
        float32 elsewhere (torch's bf16 matmuls run several times slower than fp32 there; a bf16
        value is exact in fp32). int8 weights
        have products of their own; a GGUF file's quantised weights are not bf16 values, and
        bf16 activations flip near ties in their answers (the default model's README question
        on Zen 3, though 1.34-2.01x faster: docs/performance.md), so both stay float32 there; a GGUF
        file's weights are then kept in bf16 where the C kernels compute fp32 rows over them
        (``bf16_weights``: half the bytes a decode reads, fp32 activations). An explicit dtype is
        kept."""
        dtype = super().resolve_dtype(name, checkpoint_dtype)
        if name != "auto":
            return dtype
        if dtype is torch.float16:
            dtype = torch.bfloat16
        if dtype is torch.bfloat16 and not native_bf16():
            if plain_weights and bf16_tiles():
                log.info("dtype auto: bfloat16 (checkpoint %s) on the C kernels' AVX2 bf16 products "
                         "(no native bf16 here)", checkpoint_dtype)
                return dtype
            if gguf and bf16_tiles() and getattr(cpu_kernels.load(), "has_w16a32", False):
                self.bf16_weights = True
                log.info("dtype auto: the GGUF file's weights in bfloat16, computed in float32 (no native bf16 "
                         "here: the C kernels' AVX2 products on fp32 rows, bf16 activations would round its "
                         "answers); set ModelConfig dtype to float32 or bfloat16 for either alone")
                return torch.float32
            log.info("dtype auto: the checkpoint is %s; computing in float32, as this CPU has no native bf16 "
                     "(no avx512_bf16 / amx_bf16) and %s; set ModelConfig dtype to bfloat16 to keep it",
                     checkpoint_dtype, "the C kernels' AVX2 bf16 products are not available" if plain_weights
                     else "its int8 / GGUF weights are not bf16 values")
            return torch.float32
        log.info("dtype auto: %s (%s %s)", str(dtype).replace("torch.", ""),
                 "the GGUF file's model view says" if gguf else "checkpoint", checkpoint_dtype or "unknown")
        return dtype

    def describe(self) -> str:
        kernels = f"; kernels: {self.dispatch.line()}" if self.dispatch is not None else ""
        return f"cpu ({torch.get_num_threads()} threads, pid {os.getpid()}{kernels})"
