"""The interface every device backend implements."""
from __future__ import annotations

import torch

from mindie.contract.spec import WorkerSpec
from workers import attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Backend:
    name = "base"

    def device(self) -> torch.device:
        raise NotImplementedError

    def setup(self) -> None:
        """Per-process initialisation (threads, device selection); raises what ``unavailable`` says."""

    def unavailable(self) -> str | None:
        """Why this process cannot use this kind of device at all (None: it can), found without
        initialising one: the launch step asks before any worker starts (workers/prepare.py,
        through ``workers.engine.assembly.start_refusal``), and ``setup`` raises it."""
        return None

    def device_count(self) -> int | None:
        """How many devices of this kind this process sees (None: not counted, the CPU)."""
        return None

    def free_memory(self) -> int:
        """Free device memory in bytes (the KV cache's budget when npuMemSize is -1:
        workers/attention/kv_cache.py, ``budget_bytes``)."""
        raise NotImplementedError

    def bind_thread(self) -> None:
        """Make the calling thread compute like the one that ran ``setup`` (the engine's
        compute thread calls it): per-thread state such as the current device."""

    def after_step(self) -> None:
        """Called by the runner after every step, on the thread that computed it (housekeeping
        such as returning freed host memory; must be cheap)."""

    def attention_class(self) -> type:
        """The paged-attention implementation for this device (workers.attention.for_device)."""
        return attention.for_device(self.name)

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Device-specific rewrites after loading (weight layouts, fused kernels)."""

    def warm_up(self, model: torch.nn.Module, spec: WorkerSpec) -> None:
        """Called once on the final model, before the KV cache is sized (the CPU creates its
        oneDNN primitives here)."""

    def int8_kernel(self):
        """The weight-only int8 matmul (``ModelConfig[].quantize: "w8a16"``), a
        workers.backends.int8.Int8Kernel, or None when this device has none (the worker then
        refuses the key at start)."""
        return None

    def w8a8_target(self):
        """What computes W8A8 int8 linears (``quantize: "w8a8"``, a compressed-tensors W8A8
        checkpoint) on this device: a workers.backends.gguf_linear.NativeTarget over Q8_0 blocks,
        or None (the worker then refuses them at start)."""
        return None

    def gguf_target(self, dtype: torch.dtype = torch.bfloat16):
        """What keeps a GGUF file's linears in their quantised blocks on this device (a
        workers.backends.gguf_linear.NativeTarget) computing ``dtype`` rows, or None: dequantised
        at load."""
        return None

    def spec_row_cost(self, model: torch.nn.Module) -> float | None:
        """What a speculative proposal's row costs on this device, as a fraction of a one-row
        decode step of ``model`` (workers/engine/speculative.py prices proposals with it), or
        None: the engine's default (speculative.ROW_COST)."""
        return None

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def resolve_dtype(self, name: str, checkpoint_dtype: str | None, plain_weights: bool = True,
                      gguf: bool = False) -> torch.dtype:
        """ModelConfig.dtype: a name, or "auto" = the checkpoint's torch_dtype (this device's
        default when the checkpoint does not say). ``plain_weights``: the linears keep the
        checkpoint's floating-point weights (no int8 quantisation, not a GGUF file); ``gguf``: the
        weights come from a GGUF file."""
        if name != "auto":
            return DTYPES[name]
        return DTYPES.get(checkpoint_dtype or "", self.default_dtype())

    def describe(self) -> str:
        return self.name
