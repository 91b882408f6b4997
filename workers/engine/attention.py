"""Paged attention for the portable torch path (CPU and CUDA).

The KV cache is one tensor per layer of shape [num_blocks * block_size, n_kv_heads, head_dim]
(a flat list of token slots); a sequence's block table maps its positions to slots.
Per step the engine builds ``AttentionMetadata`` once; every layer then
  1. writes the new k/v rows into their slots (``slot_mapping``), and
  2. attends each query row to its sequence's cached keys, in two padded groups: decodes
     (one query each) and prefills/chunks (several queries each). One SDPA call per group,
     no Python loop over sequences.
The NPU backend swaps this class for torch_npu's paged-attention ops (workers/backends/npu.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class _Group:
    """Padded view of a set of sequences for one SDPA call."""

    q_index: torch.Tensor  # [B, Q] rows of the flat batch (padding points at row 0)
    q_valid: torch.Tensor  # [B, Q] bool
    k_slots: torch.Tensor  # [B, K] cache slots (padding points at slot 0)
    q_pos: torch.Tensor  # [B, Q] absolute positions of the queries
    k_len: torch.Tensor  # [B] number of valid keys (context length)
    masks: dict

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            k_pos = torch.arange(self.k_slots.shape[1], device=self.k_slots.device)
            m = (k_pos[None, None, :] <= self.q_pos[:, :, None]) & (k_pos[None, None, :] < self.k_len[:, None, None])
            if window is not None:
                m &= k_pos[None, None, :] > self.q_pos[:, :, None] - window
            # Padding rows attend to slot 0 so softmax never sees an all-masked row.
            m |= ~self.q_valid[:, :, None] & (k_pos[None, None, :] == 0)
            self.masks[window] = m[:, None]  # [B, 1, Q, K]
        return self.masks[window]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot of every new token
    decode: _Group | None
    prefill: _Group | None
    num_tokens: int


def build_metadata(
    block_tables: list[list[int]],
    start_pos: list[int],
    num_new: list[int],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata for sequences whose new tokens (``num_new[i]`` from position ``start_pos[i]``)
    are laid out one sequence after another in the flat batch."""
    slots: list[int] = []
    dec: list[int] = []
    pre: list[int] = []
    offsets: list[int] = []
    off = 0
    for i, (table, start, n) in enumerate(zip(block_tables, start_pos, num_new)):
        offsets.append(off)
        for p in range(start, start + n):
            slots.append(table[p // block_size] * block_size + p % block_size)
        (dec if n == 1 else pre).append(i)
        off += n

    def group(idx: list[int]) -> _Group | None:
        if not idx:
            return None
        q_max = max(num_new[i] for i in idx)
        k_max = max(start_pos[i] + num_new[i] for i in idx)
        nb = -(-k_max // block_size)
        tables = torch.tensor([block_tables[i][:nb] + [0] * (nb - len(block_tables[i][:nb])) for i in idx],
                              dtype=torch.long)
        k_pos = torch.arange(k_max)
        k_slots = tables[:, k_pos // block_size] * block_size + (k_pos % block_size)[None, :]
        q_ar = torch.arange(q_max)
        n_new = torch.tensor([num_new[i] for i in idx])
        starts = torch.tensor([start_pos[i] for i in idx])
        offs = torch.tensor([offsets[i] for i in idx])
        q_valid = q_ar[None, :] < n_new[:, None]
        q_index = torch.where(q_valid, offs[:, None] + q_ar[None, :], 0)
        q_pos = starts[:, None] + q_ar[None, :]
        k_len = starts + n_new
        return _Group(q_index.to(device), q_valid.to(device), k_slots.to(device), q_pos.to(device),
                      k_len.to(device), {})

    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        decode=group(dec), prefill=group(pre), num_tokens=off,
    )


class PagedAttention:
    """The ``attn`` object the model calls per layer; owns the KV cache tensors."""

    def __init__(self, num_layers: int, num_slots: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_slots, n_kv_heads, head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.meta: AttentionMetadata | None = None

    @staticmethod
    def bytes_per_slot(num_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * n_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 window: int | None = None) -> torch.Tensor:
        meta = self.meta
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        kc.index_copy_(0, meta.slot_mapping, k.to(kc.dtype))
        vc.index_copy_(0, meta.slot_mapping, v.to(vc.dtype))
        out = torch.empty_like(q)
        for g in (meta.decode, meta.prefill):
            if g is None:
                continue
            qg = q[g.q_index].transpose(1, 2)  # [B, H, Q, D]
            kg = kc[g.k_slots].transpose(1, 2)  # [B, Hkv, K, D]
            vg = vc[g.k_slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask(window),
                                               enable_gqa=kg.shape[1] != qg.shape[1])
            o = o.transpose(1, 2)  # [B, Q, H, D]
            out[g.q_index[g.q_valid]] = o[g.q_valid]
        return out
