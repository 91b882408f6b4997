"""Paged attention on Ascend NPUs through torch_npu's fused ops (the design of
shared/reference/torch-npu.md §2.6, as vllm-ascend uses them).

Exercised: only on CPU, against a fake ``torch_npu`` module whose ops are pure-torch
references that also assert the documented contracts (tests/test_npu_attention.py): the
metadata, layouts, dtypes and call sequence below match the portable PagedAttention's
results. Not exercised: real Ascend hardware (none is available to this project's CI).

- Cache per layer: [num_blocks, block_size, n_kv_heads, head_dim] (ND), block_size 128.
- KV write: ``torch_npu._npu_reshape_and_cache(k, v, k_cache, v_cache, slots_int32)``.
- Pure decode steps: ``torch_npu._npu_paged_attention`` (block table int32 on the device,
  context lengths int32 on the host).
- Steps with prefill or chunks: one ``torch_npu.npu_fused_infer_attention_score`` call in
  TND layout, paged (block_table + block_size), bottom-right causal (sparse_mode 3 with the
  2048x2048 int8 mask), cumulative query lengths and absolute KV lengths.
Sliding-window models are refused on this backend for now (FIA's band mode is untested here).
"""
from __future__ import annotations

import torch

from workers.attention import kv_cache

_MASK_SIZE = 2048


class NpuPagedAttention:
    """Same interface as workers.attention.paged.PagedAttention."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        if head_dim not in (64, 128, 192):
            raise ValueError(f"NPU attention (FIA, TND layout) needs head_dim 64, 128 or 192, got {head_dim}")
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"NPU attention runs in float16 or bfloat16, not {dtype}: set ModelConfig[].dtype")
        shape = (num_blocks, block_size, n_kv_heads, head_dim)
        self.block_size = block_size
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.k_cache, self.v_cache = kv_cache.tensors(num_layers, shape, dtype, device, host_mmap=False)
        # 1 strictly above the diagonal: FIA's compressed causal mask for sparse_mode 3.
        self.mask = torch.triu(torch.ones(_MASK_SIZE, _MASK_SIZE, dtype=torch.int8), diagonal=1).to(device)
        self.device = device

    bytes_per_slot = staticmethod(kv_cache.bytes_per_slot)

    def prepare(self, block_tables: list[list[int]], start_pos: list[int], num_new: list[int]) -> None:
        bs = self.block_size
        slots = [table[p // bs] * bs + p % bs
                 for table, start, n in zip(block_tables, start_pos, num_new) for p in range(start, start + n)]
        seq_lens = [s + n for s, n in zip(start_pos, num_new)]
        max_blocks = max(-(-n // bs) for n in seq_lens)
        table = [t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks])) for t in block_tables]
        cu_q, acc = [], 0
        for n in num_new:
            acc += n
            cu_q.append(acc)
        self.slots = torch.tensor(slots, dtype=torch.int32, device=self.device)
        self.block_table = torch.tensor(table, dtype=torch.int32, device=self.device)
        self.context_lens = torch.tensor(seq_lens, dtype=torch.int32)  # host tensor, as the ATB op wants
        self.seq_lens = seq_lens
        self.cu_q = cu_q
        self.decode_only = all(n == 1 for n in num_new)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 window: int | None = None, *, sinks: torch.Tensor | None = None, scale: float | None = None,
                 softcap: float | None = None) -> torch.Tensor:
        import torch_npu  # optional (the npu extra): imported only where an NPU step runs

        if sinks is not None:
            raise NotImplementedError("attention sinks (GPT-OSS) are not implemented on the NPU backend yet")
        if window is not None:
            raise NotImplementedError("sliding-window attention is not implemented on the NPU backend yet")
        if softcap is not None:  # the fused ops have no soft-capping (Gemma 2)
            raise NotImplementedError("attention logit soft-capping is not implemented on the NPU backend")
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        torch_npu._npu_reshape_and_cache(k.contiguous(), v.contiguous(), kc, vc, self.slots)
        n_heads = q.shape[1]
        scale = self.head_dim ** -0.5 if scale is None else scale
        q = q.contiguous()
        if self.decode_only:
            out = torch.empty_like(q)
            torch_npu._npu_paged_attention(q, kc, vc, self.n_kv_heads, n_heads, scale, self.block_table,
                                           self.context_lens, out)
            return out
        nb = kc.shape[0]
        out, _ = torch_npu.npu_fused_infer_attention_score(
            q, kc.view(nb, self.block_size, -1), vc.view(nb, self.block_size, -1),
            atten_mask=self.mask, actual_seq_lengths=self.cu_q, actual_seq_lengths_kv=self.seq_lens,
            block_table=self.block_table, block_size=self.block_size, num_heads=n_heads,
            num_key_value_heads=self.n_kv_heads, input_layout="TND", sparse_mode=3, scale=scale)
        return out.view(q.shape)
