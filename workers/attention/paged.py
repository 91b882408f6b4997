"""Paged attention for the portable torch path (CPU and CUDA).

The KV cache of a layer is a tensor [num_blocks, n_kv_heads, block_size, head_dim]; a
sequence's block table lists its blocks in position order. Per step the engine builds
``AttentionMetadata`` once; every layer then
  1. writes the new k/v rows into their (block, offset) slots, and
  2. attends, with no Python loop over sequences:
     - decodes (one query each): gather each sequence's blocks ([B, nb, Hkv, bs, D], contiguous
       block copies), scores per block with one batched matmul, one softmax over all the
       sequence's positions, values per block, summed. Measured on CPU (B=32, 2 blocks of 128)
       at a quarter of the time of SDPA with a mask on the gathered keys.
     - prefills (several queries each): prompts with nothing cached use causal SDPA on the new
       keys directly (right padding keeps it exact); chunks after a cached prefix gather their
       blocks and use SDPA with an explicit mask.
Backends may swap this class: the NPU's uses torch_npu's paged-attention ops
(workers/attention/npu.py); the CPU's replaces the cache write and the decode part with C
kernels that read the blocks in place (workers/attention/cpu.py). The cache tensors, their
sizing and the block-table contract are workers/attention/kv_cache.py's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from workers import settings
from workers.attention import kv_cache


def _pad_tables(tables: list[list[int]], nb: int) -> torch.Tensor:
    return torch.tensor([t[:nb] + [0] * (nb - len(t[:nb])) for t in tables], dtype=torch.long)


@dataclass
class _Decode:
    rows: torch.Tensor  # [B] rows of the flat batch
    tables: torch.Tensor  # [B, nb]
    pos: torch.Tensor  # [B] position of the query (= context length - 1)
    masks: dict = field(default_factory=dict)

    def each(self, block_size: int) -> list["_Decode"]:
        """One _Decode per row, its table cut at its own last block (batch-invariant mode: a row's
        computation then has the same shapes whatever the other rows)."""
        return [_Decode(self.rows[i:i + 1], self.tables[i:i + 1, :int(p) // block_size + 1], self.pos[i:i + 1])
                for i, p in enumerate(self.pos.tolist())]

    def mask(self, window: int | None, block_size: int) -> torch.Tensor:
        """[B, nb, 1, 1, bs]: which cached positions each query may see."""
        if window not in self.masks:
            nb = self.tables.shape[1]
            k_pos = torch.arange(nb * block_size, device=self.pos.device).view(1, nb, block_size)
            m = k_pos <= self.pos[:, None, None]
            if window is not None:
                m &= k_pos > self.pos[:, None, None] - window
            self.masks[window] = m[:, :, None, None, :]
        return self.masks[window]


@dataclass
class _Prefill:
    q_index: torch.Tensor  # [B, Q] rows of the flat batch (padding points at row 0)
    q_valid: torch.Tensor  # [B, Q]
    tables: torch.Tensor  # [B, nb]
    q_pos: torch.Tensor  # [B, Q] absolute positions of the queries
    k_len: torch.Tensor  # [B] context length after this step
    fresh: bool  # nothing cached before this step for any of them
    masks: dict = field(default_factory=dict)

    def mask(self, window: int | None, block_size: int) -> torch.Tensor:
        """[B, 1, Q, nb*bs] for SDPA on gathered keys."""
        if window not in self.masks:
            k_pos = torch.arange(self.tables.shape[1] * block_size, device=self.q_pos.device)
            m = (k_pos[None, None, :] <= self.q_pos[:, :, None]) & (k_pos[None, None, :] < self.k_len[:, None, None])
            if window is not None:
                m &= k_pos[None, None, :] > self.q_pos[:, :, None] - window
            # Padding rows attend to position 0 so softmax never sees an all-masked row.
            m |= ~self.q_valid[:, :, None] & (k_pos[None, None, :] == 0)
            self.masks[window] = m[:, None]
        return self.masks[window]


@dataclass
class AttentionMetadata:
    blocks: torch.Tensor  # [T] block of every new token
    offsets: torch.Tensor  # [T] offset in its block
    decode: _Decode | None
    prefill: _Prefill | None
    num_tokens: int


def build_metadata(
    block_tables: list[list[int]],
    start_pos: list[int],
    num_new: list[int],
    block_size: int,
    device: torch.device,
    every_row: bool = False,
) -> AttentionMetadata:
    """Metadata for sequences whose new tokens (``num_new[i]`` from position ``start_pos[i]``)
    are laid out one sequence after another in the flat batch. ``every_row`` (batch-invariant
    mode): every new token is a decode row of its own, at its position against its sequence's
    blocks (the step's keys are written first), so a prompt chunk's and a verify step's rows take
    the decode computation, and a token's attention is the same in any step."""
    if every_row and any(n != 1 for n in num_new):
        return _rows_metadata(block_tables, start_pos, num_new, block_size, device)
    if num_new and all(n == 1 for n in num_new):
        return _decode_metadata(block_tables, start_pos, block_size, device)
    return _mixed_metadata(block_tables, start_pos, num_new, block_size, device)


def _rows_metadata(block_tables: list[list[int]], start_pos: list[int], num_new: list[int], block_size: int,
                   device: torch.device) -> AttentionMetadata:
    """build_metadata(every_row=True): each new token a decode row, its sequence's table padded to
    the step's longest (``_decode_metadata`` of the tokens' positions and tables, built with tensor
    ops: a long prompt chunk has thousands of rows)."""
    counts = torch.tensor(num_new, dtype=torch.long)
    t = int(counts.sum())
    seq = torch.repeat_interleave(torch.arange(len(num_new)), counts)  # [T] each token's sequence
    first = counts.cumsum(0) - counts  # each sequence's first row
    rows = torch.arange(t)
    positions = torch.tensor(start_pos, dtype=torch.long)[seq] + rows - first[seq]
    nb = -(-max(s + n for s, n in zip(start_pos, num_new) if n) // block_size)
    tables = _pad_tables(block_tables, nb)[seq]  # [T, nb]
    blocks = tables.gather(1, (positions // block_size)[:, None]).squeeze(1)
    meta = AttentionMetadata(blocks, positions % block_size, _Decode(rows, tables, positions), None, t)
    if device.type != "cpu":
        meta = AttentionMetadata(blocks.to(device), meta.offsets.to(device),
                                 _Decode(rows.to(device), tables.to(device), positions.to(device)), None, t)
    return meta


def _mixed_metadata(block_tables: list[list[int]], start_pos: list[int], num_new: list[int], block_size: int,
                    device: torch.device) -> AttentionMetadata:
    """build_metadata for any step (prompt chunks, decodes or both)."""
    blocks: list[int] = []
    offsets: list[int] = []
    dec: list[int] = []
    pre: list[int] = []
    row0: list[int] = []
    off = 0
    for i, (table, start, n) in enumerate(zip(block_tables, start_pos, num_new)):
        row0.append(off)
        for p in range(start, start + n):
            blocks.append(table[p // block_size])
            offsets.append(p % block_size)
        (dec if n == 1 else pre).append(i)
        off += n

    decode = None
    if dec:
        nb = -(-max(start_pos[i] + 1 for i in dec) // block_size)
        decode = _Decode(torch.tensor([row0[i] for i in dec], device=device),
                         _pad_tables([block_tables[i] for i in dec], nb).to(device),
                         torch.tensor([start_pos[i] for i in dec], device=device))
    prefill = None
    if pre:
        q_max = max(num_new[i] for i in pre)
        nb = -(-max(start_pos[i] + num_new[i] for i in pre) // block_size)
        q_ar = torch.arange(q_max)
        n_new = torch.tensor([num_new[i] for i in pre])
        starts = torch.tensor([start_pos[i] for i in pre])
        q_valid = q_ar[None, :] < n_new[:, None]
        q_index = torch.where(q_valid, torch.tensor([row0[i] for i in pre])[:, None] + q_ar[None, :], 0)
        prefill = _Prefill(q_index.to(device), q_valid.to(device),
                           _pad_tables([block_tables[i] for i in pre], nb).to(device),
                           (starts[:, None] + q_ar[None, :]).to(device), (starts + n_new).to(device),
                           fresh=all(start_pos[i] == 0 for i in pre))
    return AttentionMetadata(torch.tensor(blocks, dtype=torch.long, device=device),
                             torch.tensor(offsets, dtype=torch.long, device=device), decode, prefill, off)


def _decode_metadata(block_tables: list[list[int]], start_pos: list[int], block_size: int,
                     device: torch.device) -> AttentionMetadata:
    """build_metadata for a step of decodes only: the same tensors, from one host tensor. At
    batch 1 a decode step of a small model takes about a millisecond, and each tensor built from a
    list costs microseconds more once the step's weights have streamed through the caches."""
    b = len(start_pos)
    nb = -(-(max(start_pos) + 1) // block_size)
    # one flat tensor: blocks, offsets, flat rows, positions (b each), then the [b, nb] tables
    flat = [t[p // block_size] for t, p in zip(block_tables, start_pos)]
    flat += [p % block_size for p in start_pos]
    flat += range(b)
    flat += start_pos
    for t in block_tables:
        flat += t[:nb]
        if len(t) < nb:
            flat += [0] * (nb - len(t))
    host = torch.tensor(flat, dtype=torch.long)
    if device.type != "cpu":
        host = host.to(device)
    return AttentionMetadata(host[:b], host[b:2 * b], _Decode(host[2 * b:3 * b], host[4 * b:].view(b, nb),
                                                              host[3 * b:4 * b]), None, b)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   sinks: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Attention with a learned sink logit per query head in each softmax's denominator (GPT-OSS,
    transformers' eager ``softmax(cat(scores, sink))`` with the sink's column dropped). q [B, H, Q, D],
    k and v [B, Hkv, K, D], mask [B, 1, Q, K] (True: may attend), sinks [H]; scores in fp32."""
    h, hkv, d = q.shape[1], k.shape[1], q.shape[3]
    if h != hkv:
        k, v = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * (d ** -0.5 if scale is None else scale)
    s.masked_fill_(~mask, float("-inf"))
    sink = sinks.float().view(1, h, 1, 1).expand(s.shape[0], h, s.shape[2], 1)
    p = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :-1]
    return torch.matmul(p.to(v.dtype), v).to(q.dtype)


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None,
                     softcap: float) -> torch.Tensor:
    """Attention with soft-capped scores, q [B, H, Q, D], k/v [B, Hkv, K, D], mask [B, 1, Q, K]:
    scores in fp32, capped (softcap * tanh(s / softcap)), masked, softmax, values; [B, H, Q, D]."""
    B, H, Q, D = q.shape
    hkv = k.shape[1]
    qg = q.reshape(B, hkv, H // hkv, Q, D).to(k.dtype)
    s = torch.matmul(qg, k[:, :, None].transpose(-1, -2)).float()  # [B, Hkv, G, Q, K]
    s.mul_(D ** -0.5 if scale is None else scale)
    s = torch.tanh(s / softcap).mul_(softcap)
    s.masked_fill_(~mask[:, :, None], float("-inf"))
    p = torch.softmax(s, dim=-1).to(v.dtype)
    return torch.matmul(p, v[:, :, None]).reshape(B, H, Q, D).to(q.dtype)


class PagedAttention:
    """The ``attn`` object the model calls per layer; owns the KV cache tensors."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_blocks, n_kv_heads, block_size, head_dim)
        self.block_size = block_size
        self.k_cache, self.v_cache = kv_cache.tensors(num_layers, shape, dtype, device)
        self.meta: AttentionMetadata | None = None
        # batch-invariant mode (ScheduleConfig.batchInvariant): every row a decode, computed alone
        self.every_row = bool(settings.engine().batch_invariant)
        # Gather buffers reused by every layer: a fresh multi-MB tensor per call costs an
        # mmap/munmap and page faults on CPU, more than the copy itself.
        self._scratch: dict[str, torch.Tensor] = {}

    def _gather(self, name: str, cache: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        n = flat.numel()
        buf = self._scratch.get(name)
        if buf is None or buf.shape[0] < n:
            buf = self._scratch[name] = torch.empty((max(n, 2 * (buf.shape[0] if buf is not None else 0)),
                                                     *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
        return torch.index_select(cache, 0, flat, out=buf[:n])

    bytes_per_slot = staticmethod(kv_cache.bytes_per_slot)

    def prepare(self, block_tables: list[list[int]], start_pos: list[int], num_new: list[int]) -> None:
        """Per-step metadata, built once and used by every layer."""
        self.meta = build_metadata(block_tables, start_pos, num_new, self.block_size, self.k_cache[0].device,
                                   self.every_row)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 window: int | None = None, *, sinks: torch.Tensor | None = None, scale: float | None = None,
                 softcap: float | None = None) -> torch.Tensor:
        """``sinks``: one logit per query head [H] in every softmax's denominator (GPT-OSS); ``scale``:
        the softmax scale (None: 1/sqrt(head_dim)); ``softcap``: scores become
        softcap * tanh(scores / softcap) before the mask and softmax (Gemma 2)."""
        meta = self.meta
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        self._write(layer, k, v)
        if meta.prefill is None:
            return self._decode(meta.decode, q, kc, vc, window, sinks=sinks, scale=scale, softcap=softcap)
        out = torch.empty_like(q)
        if meta.decode is not None:
            out[meta.decode.rows] = self._decode(meta.decode, q[meta.decode.rows], kc, vc, window, sinks=sinks,
                                                 scale=scale, softcap=softcap)
        g = meta.prefill
        qg = q[g.q_index].transpose(1, 2)  # [B, H, Q, D]
        if g.fresh and window is None and sinks is None and softcap is None:
            kg = k[g.q_index].transpose(1, 2).to(kc.dtype)  # right-padded: causal SDPA stays exact
            vg = v[g.q_index].transpose(1, 2).to(kc.dtype)
            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=kg.shape[1] != qg.shape[1],
                                               scale=scale)
        else:
            B, nb = g.tables.shape
            flat = g.tables.view(-1)
            kg = self._gather("k", kc, flat).view(B, nb, *kc.shape[1:]).transpose(1, 2).reshape(
                B, kc.shape[1], nb * self.block_size, kc.shape[3])
            vg = self._gather("v", vc, flat).view(B, nb, *vc.shape[1:]).transpose(1, 2).reshape(
                B, vc.shape[1], nb * self.block_size, vc.shape[3])
            mask = g.mask(window, self.block_size)
            if sinks is not None:  # SDPA has no sink term
                o = sink_attention(qg, kg, vg, mask, sinks, scale)
            elif softcap is not None:  # SDPA has no soft-capping: the eager computation, as transformers' eager attention
                o = capped_attention(qg, kg, vg, mask, scale, softcap)
            else:
                o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, enable_gqa=kg.shape[1] != qg.shape[1],
                                                   scale=scale)
        o = o.transpose(1, 2)  # [B, Q, H, D]
        out[g.q_index[g.q_valid]] = o[g.q_valid]
        return out

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's new k/v rows [T, Hkv, D] in their cache slots."""
        meta, kc, vc = self.meta, self.k_cache[layer], self.v_cache[layer]
        kc[meta.blocks, :, meta.offsets] = k.to(kc.dtype)
        vc[meta.blocks, :, meta.offsets] = v.to(vc.dtype)

    def _decode(self, g: _Decode, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                window: int | None, *, sinks: torch.Tensor | None = None, scale: float | None = None,
                softcap: float | None = None) -> torch.Tensor:
        if self.every_row and q.shape[0] > 1:  # batch-invariant: each row alone, its own blocks only
            return torch.cat([self._decode(one, q[i:i + 1], kc, vc, window, sinks=sinks, scale=scale, softcap=softcap)
                              for i, one in enumerate(g.each(self.block_size))])
        B, H, D = q.shape
        nb = g.tables.shape[1]
        hkv, bs = kc.shape[1], kc.shape[2]
        flat = g.tables.view(-1)
        # index_select copies whole blocks; several times faster than advanced indexing on CPU.
        kb = self._gather("k", kc, flat).view(B, nb, hkv, bs, D)
        vb = self._gather("v", vc, flat).view(B, nb, hkv, bs, D)
        qg = q.view(B, 1, hkv, H // hkv, D).to(kc.dtype)
        s = torch.matmul(qg, kb.transpose(-1, -2)).float()  # [B, nb, Hkv, G, bs]
        s.mul_(D ** -0.5 if scale is None else scale)
        if softcap is not None:
            s = torch.tanh(s / softcap).mul_(softcap)
        s.masked_fill_(~g.mask(window, bs), float("-inf"))
        s = s.permute(0, 2, 3, 1, 4).reshape(B, hkv, H // hkv, nb * bs)
        if sinks is None:
            p = torch.softmax(s, dim=-1)
        else:  # the sink's column joins the softmax, then is dropped
            sink = sinks.float().view(1, hkv, H // hkv, 1).expand(B, -1, -1, 1)
            p = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :-1]
        p = p.view(B, hkv, H // hkv, nb, bs).permute(0, 3, 1, 2, 4).to(vb.dtype)
        o = torch.matmul(p, vb).sum(1, dtype=torch.float32)  # [B, Hkv, G, D]
        return o.reshape(B, H, D).to(q.dtype)
