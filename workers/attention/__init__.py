"""Paged attention: the object a model calls once per layer, and the KV cache it owns.

- ``paged.py``: the portable torch implementation (CUDA, and the CPU without its C kernels);
- ``cpu.py``: the same with the cache write, decodes and prompt chunks in the C kernels;
- ``npu.py``: torch_npu's fused paged-attention ops (their own cache layout);
- ``mla.py``: multi-head latent attention over a cache of compressed latents (DeepSeek-V2/V3),
  chosen by the model's ``kv_layout`` ("mla") on every device (``for_layout``);
- ``split.py``: a cache of several geometries (layers, KV heads, head_dim) over one block table,
  one object of the backend's class per geometry (Gemma 4's sliding and full layers);
- ``kv_cache.py``: the cache itself: tensors, sizing (bytes per block, blocks in a budget),
  allocation, and the block-table contract the engine's block manager fills in.

Layering (tests/test_import_graph.py): this package imports ``workers.kernels`` and itself,
never ``workers.backends`` or ``workers.engine`` (which import it). ``for_device`` is the one
place that maps a device type to its implementation; backends call it.
"""
from __future__ import annotations

from typing import Protocol

import torch

from workers.attention.cpu import CpuPagedAttention
from workers.attention.mla import MlaPagedAttention
from workers.attention.npu import NpuPagedAttention
from workers.attention.paged import PagedAttention
from workers.attention.split import split_attention
from workers.kernels import cpu_kernels


class Attention(Protocol):
    """What the model runner and the model use. Constructed as
    ``cls(num_layers, num_blocks, block_size, n_kv_heads, head_dim, dtype, device)``
    (kv_cache.allocate); ``bytes_per_slot`` sizes the cache before it exists."""

    block_size: int
    k_cache: list[torch.Tensor]
    v_cache: list[torch.Tensor]

    @staticmethod
    def bytes_per_slot(num_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int: ...

    def prepare(self, block_tables: list[list[int]], start_pos: list[int], num_new: list[int]) -> None:
        """Once per step, before the layers: the step's block tables and positions."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 window: int | None = None, *, sinks: torch.Tensor | None = None, scale: float | None = None,
                 softcap: float | None = None) -> torch.Tensor:
        """Write the new k/v rows of ``layer`` into the cache, then attend; [T, H, D]. ``sinks``:
        a logit per query head [H] in every softmax's denominator (GPT-OSS), or None; ``scale``:
        the softmax scale (None: 1/sqrt(head_dim)); ``softcap``: scores capped as
        softcap * tanh(scores / softcap) before the softmax (Gemma 2)."""


def for_device(device_type: str) -> type:
    """The attention implementation for a backend: the NPU's fused ops, the CPU's C kernels
    when they build (else the portable path, the reason logged by cpu_kernels), else portable."""
    if device_type == "npu":
        return NpuPagedAttention
    if device_type == "cpu" and cpu_kernels.load() is not None:
        return CpuPagedAttention
    return PagedAttention


def for_layout(kind: str) -> type:
    """The attention implementation of a model that names its own cache layout (``model.kv_layout``):
    "mla", DeepSeek's latent cache (mla.py; portable torch on every device)."""
    layouts = {"mla": MlaPagedAttention}
    if kind not in layouts:
        raise ValueError(f"unknown KV cache layout {kind!r} (known: {', '.join(layouts)})")
    return layouts[kind]


__all__ = ["Attention", "CpuPagedAttention", "MlaPagedAttention", "NpuPagedAttention", "PagedAttention", "for_device",
           "for_layout", "split_attention"]
