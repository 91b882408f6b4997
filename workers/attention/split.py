"""A KV cache of several geometries over one block table (Gemma 4: sliding and full layers with
their own KV heads and head_dim).

``split_attention(base, geometries)`` makes an attention class (the ``Attention`` protocol of
workers/attention/__init__.py) that holds one ``base`` object (the backend's: portable, the CPU
kernels' or the NPU's) per geometry ``(layers, n_kv_heads, head_dim)``, all of ``num_blocks`` blocks
of ``block_size`` positions: the engine's block manager hands a sequence one block id, which holds
its positions in every part. Layer ``i`` of the model's numbering is layer ``i - offset`` of the part
whose range holds it. Each part keeps its own exact geometry (no padding), so a token costs the sum
of the parts' bytes (``bytes_per_slot``) and every kernel sees the shapes it already serves."""
from __future__ import annotations

import torch

from workers.attention.kv_cache import KvShape

__all__ = ["SplitAttention", "split_attention"]


class SplitAttention:
    """One attention object per cache geometry, sharing the step's block tables (module docstring)."""

    base: type
    geometries: tuple[KvShape, ...] = ()

    @classmethod
    def bytes_per_slot(cls, num_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one token position over every part (the arguments, kv_cache's, are not used)."""
        return sum(cls.base.bytes_per_slot(*g, dtype) for g in cls.geometries)

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.parts = [self.base(n, num_blocks, block_size, h, d, dtype, device) for n, h, d in self.geometries]
        self.where = [(p, j) for p, (n, _, _) in enumerate(self.geometries) for j in range(n)]
        self.block_size = block_size
        # every layer's tensors in the model's numbering (workers/pd_transfer.py moves them per layer)
        self.k_cache = [t for p in self.parts for t in p.k_cache]
        self.v_cache = [t for p in self.parts for t in p.v_cache]

    def prepare(self, block_tables: list[list[int]], start_pos: list[int], num_new: list[int]) -> None:
        for p in self.parts:
            p.prepare(block_tables, start_pos, num_new)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
                 **kw) -> torch.Tensor:
        p, j = self.where[layer]
        return self.parts[p](j, q, k, v, window, **kw)

    def __getattr__(self, name: str):
        # the first part's state for what runners and tests read (counters, the kernel library)
        if name in ("parts", "where"):
            raise AttributeError(name)
        return getattr(self.parts[0], name)


def split_attention(base: type, geometries: tuple[KvShape, ...]) -> type:
    """The attention class of a cache whose layers have ``geometries`` (layers, KV heads, head_dim),
    each part a ``base`` object."""
    return type(f"Split{base.__name__}", (SplitAttention,), {"base": base, "geometries": tuple(geometries)})
