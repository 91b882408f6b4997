"""CPU paged attention: the portable torch attention with its cache write and its decode part
done by C kernels (cpu_kernels.c) that read the KV blocks in place.

The torch decode path gathers every decoding sequence's blocks into a scratch tensor (K and V,
every layer) and pays about fifteen op dispatches per layer; the kernel does one pass over the
cached rows with an online softmax in fp32, parallel over (sequence, KV head) on torch's OpenMP
pool. Prefill chunks keep torch's SDPA (large matmuls, where torch is already good).
Measured side by side in docs/performance.md (`scripts/bench_attention.py`).
"""
from __future__ import annotations

import torch

from workers.backends import cpu_kernels
from workers.engine.attention import PagedAttention, _Decode


class CpuPagedAttention(PagedAttention):
    """Same interface and cache layout as PagedAttention."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(num_layers, num_blocks, block_size, n_kv_heads, head_dim, dtype, device)
        # Types and head sizes the kernels do not cover keep the torch path (whole object).
        self.lib = cpu_kernels.load()
        self.code = cpu_kernels.dtype_code(self.lib, dtype) if self.lib is not None else None
        if self.code is None or head_dim > 256:
            self.lib = None
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.k_ptr = [t.data_ptr() for t in self.k_cache]
        self.v_ptr = [t.data_ptr() for t in self.v_cache]

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        meta = self.meta
        hkv, bs, d = self.k_cache[layer].shape[1:]
        t = meta.blocks.numel()
        # The C write trusts its shapes: anything unexpected takes the checked torch path.
        if self.lib is None or k.shape != (t, hkv, d) or v.shape != (t, hkv, d) or meta.offsets.numel() != t:
            return super()._write(layer, k, v)
        for src, dst in ((k, self.k_ptr[layer]), (v, self.v_ptr[layer])):
            src = src.to(self.k_cache[layer].dtype)
            if src.stride(2) != 1 or src.stride(1) != d:
                src = src.contiguous()
            self.lib.paged_write(self.elem, src.data_ptr(), dst, meta.blocks.data_ptr(), meta.offsets.data_ptr(),
                                 src.shape[0], src.stride(0), hkv, bs, d)

    def _decode(self, g: _Decode, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                window: int | None) -> torch.Tensor:
        if self.lib is None:
            return super()._decode(g, q, kc, vc, window)
        B, H, D = q.shape
        qc = q.to(kc.dtype).contiguous()
        out = torch.empty_like(qc)
        # The kernel refuses, before touching anything, shapes beyond its static buffers (more
        # than 16 query heads per KV head): those take the torch path.
        if self.lib.paged_decode(self.code, qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), g.tables.data_ptr(),
                                 g.tables.shape[1], g.pos.data_ptr(), B, H, kc.shape[1], kc.shape[2], D,
                                 window or 0, D ** -0.5, out.data_ptr()) != 0:
            return super()._decode(g, q, kc, vc, window)
        return out.to(q.dtype)
