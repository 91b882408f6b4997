"""Paged multi-head latent attention (DeepSeek-V2/V3's MLA) over a cache of compressed latents.

The cache of a layer is one tensor [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]:
per token the normed latent ``c`` (after kv_a_layernorm) and the roped shared key ``k_pe``, for
all heads at once, instead of full K and V per head. For DeepSeek-V3 (128 heads, 192 + 128 per
head) that is 576 elements per token and layer instead of 40960. Block tables, sizing and
allocation follow workers/attention/kv_cache.py (``bytes_per_slot`` counts the one latent row), so
the block manager, prefix caching, chunked prefill and preemption work unchanged.

Per step, after the write of the new rows:
- decodes (one query each) absorb the up-projections: ``q_lat = q_nope @ W_UK`` turns each
  head's query into the latent space, scores are ``q_lat . c + q_pe . k_pe`` over the cached rows,
  the weighted sum of the latents is taken, and ``W_UV`` maps it to the head's value. Only the
  latent cache is read: no per-head K/V is ever formed.
- prompt chunks expand: the gathered latents go through kv_b_proj into per-head keys and values,
  as transformers computes them, then SDPA with a causal mask over the cached prefix and the
  chunk; except short chunks after a long cached prefix (chunked prefill, prefix-cache hits),
  which absorb as decodes do, since expanding would pay kv_b_proj over the whole prefix for a
  few queries (``absorb_prefill`` compares the two).
Both are exact up to float summation order (tests/test_deepseek.py compares with transformers).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from workers import settings
from workers.attention import kv_cache
from workers.attention.paged import AttentionMetadata, _Decode, build_metadata


class MlaPagedAttention:
    """The ``attn`` object a DeepSeek model calls per layer (``mla``); owns the latent cache.

    Built as ``cls(num_layers, num_blocks, block_size, 1, latent_width, dtype, device)`` by
    kv_cache.allocate, with the model's ``kv_layout`` as kv_shape (workers/models/deepseek.py)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, width: int,
                 dtype: torch.dtype, device: torch.device):
        if n_kv_heads != 1:
            raise ValueError(f"the latent cache has one row per token, not {n_kv_heads} heads")
        self.block_size = block_size
        self.width = width
        self.cache = [kv_cache.zeros((num_blocks, block_size, width), dtype, device) for _ in range(num_layers)]
        self.k_cache, self.v_cache = self.cache, []  # workers.attention.Attention's fields
        self.meta: AttentionMetadata | None = None
        self.every_row = bool(settings.engine().batch_invariant)  # batch-invariant mode (paged.py)

    @staticmethod
    def bytes_per_slot(num_layers: int, n_kv_heads: int, width: int, dtype: torch.dtype) -> int:
        """One latent row per layer (no separate V): the MLA saving, counted in the KV budget."""
        return num_layers * n_kv_heads * width * torch.empty((), dtype=dtype).element_size()

    def prepare(self, block_tables: list[list[int]], start_pos: list[int], num_new: list[int]) -> None:
        self.meta = build_metadata(block_tables, start_pos, num_new, self.block_size, self.cache[0].device,
                                   self.every_row)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 window: int | None = None) -> torch.Tensor:
        raise TypeError("the MLA cache is called through mla(), by a DeepSeek model")

    def mla(self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
            kv_b: torch.Tensor, nope: int, scale: float) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope] (roped), latent [T, R + rope] (normed c, roped
        k_pe), kv_b: kv_b_proj's weight [H * (nope + v), R] -> attention output [T, H, v]."""
        meta, cache = self.meta, self.cache[layer]
        T, H, _ = q_nope.shape
        R = cache.shape[-1] - q_pe.shape[-1]
        w = kv_b.view(H, -1, R)  # [H, nope + v, R]
        vd = w.shape[1] - nope
        cache[meta.blocks, meta.offsets] = latent.to(cache.dtype)
        if meta.prefill is None:
            return self._decode(cache, q_nope, q_pe, w, nope, scale, meta.decode)
        out = q_nope.new_empty(T, H, vd)
        if (d := meta.decode) is not None:
            out[d.rows] = self._decode(cache, q_nope[d.rows], q_pe[d.rows], w, nope, scale, d)
        g = meta.prefill
        B, nb = g.tables.shape
        bs = self.block_size
        lat = cache.index_select(0, g.tables.view(-1)).view(B, nb * bs, -1)  # [B, N, R + rope]
        if self.absorb_prefill(g.q_index.shape[1], nb * bs, R, q_pe.shape[-1], nope, vd):
            out[g.q_index[g.q_valid]] = self._absorbed_chunks(lat, q_nope, q_pe, w, nope, scale, g)
            return out
        c, k_pe = lat[..., :R].to(kv_b.dtype), lat[..., R:].to(kv_b.dtype)
        kv = F.linear(c, kv_b).view(B, nb * bs, H, nope + vd).transpose(1, 2)  # [B, H, N, nope + v]
        k = torch.cat((kv[..., :nope], k_pe[:, None].expand(B, H, nb * bs, k_pe.shape[-1])), dim=-1)
        vv = kv[..., nope:]
        qg = torch.cat((q_nope, q_pe), dim=-1)[g.q_index].transpose(1, 2)  # [B, H, Q, nope + rope]
        o = F.scaled_dot_product_attention(qg, k, vv, attn_mask=g.mask(None, bs), scale=scale)
        o = o.transpose(1, 2)  # [B, Q, H, v]
        out[g.q_index[g.q_valid]] = o[g.q_valid]
        return out

    @staticmethod
    def absorb_prefill(q: int, n: int, r: int, rope: int, nope: int, vd: int) -> bool:
        """Absorb a step's prompt chunks too when that reads fewer bytes and does fewer products:
        expanding costs kv_b_proj over all ``n`` cached positions (nope + v per head), absorbing
        widens each of the ``q`` queries' scores to r + rope. Short chunks after a long cached
        prefix (chunked prefill, prefix-cache hits) absorb; a prompt computed whole expands."""
        return q * (r + rope) < n * (nope + vd)

    def _absorbed_chunks(self, lat: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor, w: torch.Tensor,
                         nope: int, scale: float, g) -> torch.Tensor:
        """Prompt chunks through the absorbed path: [valid query rows, H, v], SDPA over the latent
        rows as one shared key/value head (values: the latent part of each row)."""
        R = w.shape[2]
        q_lat = torch.einsum("thn,hnr->thr", q_nope, w[:, :nope].to(q_nope.dtype))
        q_full = torch.cat((q_lat, q_pe), dim=-1).to(lat.dtype)[g.q_index].transpose(1, 2)  # [B, H, Q, R + rope]
        k = lat[:, None]  # [B, 1, N, R + rope]
        o_lat = F.scaled_dot_product_attention(q_full, k, k[..., :R], attn_mask=g.mask(None, self.block_size),
                                               scale=scale, enable_gqa=True)  # [B, H, Q, R]
        o_lat = o_lat.transpose(1, 2)[g.q_valid]  # [rows, H, R]
        return torch.einsum("bhr,hvr->bhv", o_lat.to(w.dtype), w[:, nope:]).to(q_nope.dtype)

    def _decode(self, cache: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor, w: torch.Tensor, nope: int,
                scale: float, g: _Decode) -> torch.Tensor:
        """The absorbed decode: [B, H, v] from the latent rows alone (batch-invariant mode: one row
        per call, over its own blocks, ``_Decode.each``)."""
        if self.every_row and q_nope.shape[0] > 1:
            return torch.cat([self._decode(cache, q_nope[i:i + 1], q_pe[i:i + 1], w, nope, scale, one)
                              for i, one in enumerate(g.each(self.block_size))])
        pos, tables = g.pos, g.tables
        B, H, _ = q_nope.shape
        nb, bs = tables.shape[1], self.block_size
        R = w.shape[2]
        lat = cache.index_select(0, tables.view(-1)).view(B, nb * bs, -1)  # [B, N, R + rope]
        # W_UK absorbed into the query: [B, H, nope] x [H, nope, R] -> [B, H, R]
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope, w[:, :nope].to(q_nope.dtype))
        q_full = torch.cat((q_lat, q_pe), dim=-1).to(lat.dtype)  # [B, H, R + rope]
        s = torch.matmul(q_full, lat.transpose(1, 2)).float()  # [B, H, N]
        s.mul_(scale)
        k_pos = torch.arange(nb * bs, device=pos.device)
        s.masked_fill_((k_pos[None, :] > pos[:, None])[:, None, :], -math.inf)
        p = torch.softmax(s, dim=-1).to(lat.dtype)
        o_lat = torch.matmul(p, lat[..., :R])  # [B, H, R]
        # W_UV after the weighted sum: [B, H, R] x [H, v, R] -> [B, H, v]
        return torch.einsum("bhr,hvr->bhv", o_lat.to(w.dtype), w[:, nope:]).to(q_nope.dtype)
