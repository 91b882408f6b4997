"""The interface every device backend implements."""
from __future__ import annotations

import torch


class Backend:
    name = "base"

    def device(self) -> torch.device:
        raise NotImplementedError

    def setup(self) -> None:
        """Per-process initialisation (threads, device selection)."""

    def kv_cache_bytes(self, configured_gb: float, fraction: float = 0.8) -> int:
        """Bytes to give the KV cache: the configured GiB figure, or a fraction of free memory."""
        if configured_gb > 0:
            return int(configured_gb * (1 << 30))
        return int(self.free_memory() * fraction)

    def free_memory(self) -> int:
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for queued device work (timing, overlap)."""

    def bind_thread(self) -> None:
        """Make the calling thread compute like the one that ran ``setup`` (the engine's
        compute thread calls it): per-thread state such as the current device."""

    def attention_class(self) -> type:
        """The paged-attention implementation for this device (portable torch by default)."""
        from workers.engine.attention import PagedAttention
        return PagedAttention

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Device-specific rewrites after loading (weight layouts, fused kernels)."""

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def describe(self) -> str:
        return self.name
