"""CPU paged attention: the portable torch attention with its cache write, its decode part and
its prompt chunks done by C kernels (cpu_kernels.c) that read the KV blocks in place.

The torch decode path gathers every decoding sequence's blocks into a scratch tensor (K and V,
every layer) and pays about fifteen op dispatches per layer; the kernel does one pass over the
cached rows with an online softmax in fp32, parallel over (sequence, KV head) on torch's OpenMP
pool. Prompt chunks take ``paged_prefill`` on AVX-512 and AVX2 builds (fp32 and bf16, head size a
multiple of 16): tiles of query positions over the cached rows, skipping the keys a query cannot
see, where torch's SDPA ran a 128-token causal prompt at a fifth of the cores' speed; other
layouts keep SDPA. Measured side by side in docs/performance.md (`mindie-bench attention`).

On CPUs with AMX (``amx_bf16``) bf16 chunks take ``paged_prefill``'s AMX tiles (head sizes a
multiple of 32 up to 128): the scores and the value products as tile products, the online softmax
in AVX-512 between them, 3-6x its AVX-512 loops and 1.1-1.7x torch's flash attention per sequence
(docs/performance.md, "Prompt steps on AMX"). Both keep a row's result independent of the other
rows of its call, which torch's SDPA does not: ``cpuTuning.prefillAttention: sdpa`` sends prompt
chunks to it, one sequence at a time, the keys of a cached prefix gathered from their blocks, and a
prompt computed fresh and the same prompt after a prefix-cache hit (or split into other chunks)
then differ in the last bits, and greedy answers can part. (The whole model is row-independent
only where its products are too: KernelLinear is, oneDNN is not; docs/design.md.)
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from workers import settings
from workers.attention.paged import PagedAttention, _Decode
from workers.kernels import cpu_kernels

ROUTES = ("kernels", "sdpa")
# Query rows per SDPA call of a chunk after a cached prefix: its mask is rows x keys (a 8192-token
# chunk after 8192 cached would otherwise build a 128 MiB mask, and torch a bf16 copy of it).
MASK_ROWS = 512


def _causal_mask(a: int, b: int, s: int) -> torch.Tensor:
    """Query rows a..b-1 of a chunk after s cached positions: row i sees keys 0 .. s + i."""
    return torch.ones(b - a, s + b, dtype=torch.bool).tril(s + a)


def amx_prefill_covers(head_dim: int) -> bool:
    """Whether ``paged_prefill`` takes bf16 chunks of this head size on AMX tiles (where the CPU has
    them): a multiple of 32 up to 128 (cpu_kernels.c, ``AMX_PRE_D``)."""
    return head_dim % 32 == 0 and 0 < head_dim <= 128


def prompt_route() -> str:
    """Who computes prompt chunks (``cpuTuning.prefillAttention``): ``"kernels"`` (``paged_prefill``
    where it covers the layout, with its own rule for fp32, else the portable path) or ``"sdpa"``
    (torch, one sequence at a time; sliding-window layers keep the kernels' route)."""
    route = settings.cpu().prefill_attention
    if route not in ROUTES:
        raise ValueError(f"cpuTuning.prefillAttention must be one of {', '.join(ROUTES)}, got {route!r}")
    return route


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
        # The prompt chunks of this step for paged_prefill: first flat row, first position, count.
        self._chunks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.prefill_calls = 0  # steps whose prompt chunks the kernel computed (tests read it)
        # What paged_prefill covers, known from the cache alone (the query heads per KV head are
        # checked by the kernel, which then refuses); other builds never build the chunk lists.
        self._prefill_ok = (self.lib is not None and self.lib.has_prefill and self.code in (0, 1)
                            and head_dim % 16 == 0)
        # whether prompt chunks' scores are plain fp32 FMAs (fp32 caches; bf16 ones without AVX512-BF16)
        self.plain_fma_prefill = self.code == 0 or (self.lib is not None and not self.lib.has_dpbf16)
        self.route = prompt_route()
        # SDPA route: per prompt chunk (first flat row, first position, count, its blocks or None
        # when fresh, its mask or None); windows keep the kernel (or the portable path)
        self._seqs: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]] | None = None
        self.sdpa_calls = 0  # steps whose prompt chunks took the SDPA route (tests read it)

    def prepare(self, block_tables: list[list[int]], start_pos: list[int], num_new: list[int]) -> None:
        super().prepare(block_tables, start_pos, num_new)
        self._chunks = None
        self._seqs = None
        g = self.meta.prefill
        if self.route == "sdpa" and g is not None:
            self._seqs = self._sequences(block_tables, start_pos, num_new)
        if self._prefill_ok and g is not None:
            pre = [i for i, n in enumerate(num_new) if n != 1]  # as build_metadata splits them
            # fp32 scores take plain FMAs (bf16 takes vdpbf16ps): SDPA is faster from ~1k keys,
            # and after a cached prefix (`mindie-bench attention --prefill`). AVX2 builds take
            # plain FMAs for bf16 too: the same rule (mindie-bench isa: a fresh 128-token prompt
            # 1.3-1.6x faster than SDPA, after 1000 cached keys 1.4x slower in bf16).
            if self.plain_fma_prefill and not (g.fresh and max(start_pos[i] + num_new[i] for i in pre) <= 1024):
                return
            row0 = list(itertools.accumulate(num_new, initial=0))
            self._chunks = (torch.tensor([row0[i] for i in pre]), torch.tensor([start_pos[i] for i in pre]),
                            torch.tensor([num_new[i] for i in pre]))

    def _sequences(self, block_tables: list[list[int]], start_pos: list[int],
                   num_new: list[int]) -> list[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]]:
        out = []
        bs = self.block_size
        for r0, table, s, n in zip(itertools.accumulate(num_new, initial=0), block_tables, start_pos, num_new):
            if n == 1:
                continue  # a decode: the decode kernel's
            if s == 0:
                out.append((r0, 0, n, None, None))
                continue
            blocks = torch.tensor(table[:-(-(s + n) // bs)], dtype=torch.long)
            # row i sees keys up to s + i; built once per step for every layer unless large
            out.append((r0, s, n, blocks, _causal_mask(0, n, s) if n <= MASK_ROWS else None))
        return out

    def _prompts_sdpa(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float | None = None) -> torch.Tensor:
        """The step's prompt chunks through SDPA, one sequence at a time, and its decodes."""
        meta = self.meta
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        self._write(layer, k, v)
        dt = kc.dtype
        qc = q.to(dt)
        out = torch.empty(qc.shape, dtype=dt)
        hkv, bs, d = kc.shape[1:]
        gqa = qc.shape[1] != hkv
        for r0, s, n, blocks, mask in self._seqs:
            qs = qc[r0:r0 + n].transpose(0, 1)[None]  # [1, H, n, D]
            if blocks is None:  # fresh: this step's keys are all it sees
                ks = k[r0:r0 + n].to(dt).transpose(0, 1)[None]
                vs = v[r0:r0 + n].to(dt).transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa, scale=scale)
            else:  # after a cached prefix: its blocks, in position order, cut at its last key
                nb = blocks.numel()
                ks = self._gather("k", kc, blocks).transpose(0, 1).reshape(hkv, nb * bs, d)[None, :, :s + n]
                vs = self._gather("v", vc, blocks).transpose(0, 1).reshape(hkv, nb * bs, d)[None, :, :s + n]
                if mask is not None:
                    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=gqa, scale=scale)
                else:  # a long chunk: MASK_ROWS query rows at a time, so no mask holds n x (s + n)
                    o = torch.cat([F.scaled_dot_product_attention(
                        qs[:, :, a:a + MASK_ROWS], ks[:, :, :s + min(a + MASK_ROWS, n)],
                        vs[:, :, :s + min(a + MASK_ROWS, n)], attn_mask=_causal_mask(a, min(a + MASK_ROWS, n), s),
                        enable_gqa=gqa, scale=scale) for a in range(0, n, MASK_ROWS)], dim=2)
            out[r0:r0 + n] = o[0].transpose(0, 1)
        if meta.decode is not None:
            rows = meta.decode.rows
            out[rows] = self._decode(meta.decode, qc[rows], kc, vc, None, scale=scale).to(dt)
        if layer == 0:
            self.sdpa_calls += 1
        return out.to(q.dtype)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 window: int | None = None, *, sinks: torch.Tensor | None = None, scale: float | None = None,
                 softcap: float | None = None) -> torch.Tensor:
        """As PagedAttention's. The kernels take ``scale``, ``softcap`` (Gemma 2) and ``sinks``
        (GPT-OSS); prompt chunks the prefill kernel does not cover take the portable torch path (its
        cache write stays the C one; SDPA has neither a cap nor sinks), their decodes the kernel."""
        meta = self.meta
        mods = dict(sinks=sinks, scale=scale, softcap=softcap)
        if (self._seqs is not None and window is None and softcap is None and sinks is None and q.dim() == 3
                and q.shape[0] == meta.num_tokens):
            return self._prompts_sdpa(layer, q, k, v, scale)
        chunks = self._chunks
        if chunks is None or q.dim() != 3 or q.shape[0] != meta.num_tokens:
            return super().__call__(layer, q, k, v, window, **mods)
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        self._write(layer, k, v)
        qc = q.to(kc.dtype).contiguous()
        out = torch.empty_like(qc)
        g = meta.prefill
        row0, start, count = chunks
        sink32 = _sinks(sinks, q.shape[1])
        if self.lib.paged_prefill(self.code, qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), g.tables.data_ptr(),
                                  g.tables.shape[1], row0.data_ptr(), start.data_ptr(), count.data_ptr(),
                                  count.numel(), qc.shape[1], kc.shape[1], kc.shape[2], qc.shape[2], window or 0,
                                  qc.shape[2] ** -0.5 if scale is None else scale, softcap or 0.0,
                                  _ptr(sink32), out.data_ptr()) != 0:
            self._chunks = None  # a layout the kernel does not cover: SDPA (the write is repeated, same rows)
            return super().__call__(layer, q, k, v, window, **mods)
        if layer == 0:
            self.prefill_calls += 1
        if meta.decode is not None:
            rows = meta.decode.rows
            out[rows] = self._decode(meta.decode, qc[rows], kc, vc, window, **mods).to(qc.dtype)
        return out.to(q.dtype)

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
                window: int | None, *, sinks: torch.Tensor | None = None, scale: float | None = None,
                softcap: float | None = None) -> torch.Tensor:
        if self.lib is None:
            return super()._decode(g, q, kc, vc, window, sinks=sinks, scale=scale, softcap=softcap)
        B, H, D = q.shape
        qc = q.to(kc.dtype).contiguous()
        out = torch.empty_like(qc)
        sink32 = _sinks(sinks, H)
        # The kernel refuses, before touching anything, shapes beyond its static buffers (more
        # than 16 query heads per KV head): those take the torch path.
        if self.lib.paged_decode(self.code, qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), g.tables.data_ptr(),
                                 g.tables.shape[1], g.pos.data_ptr(), B, H, kc.shape[1], kc.shape[2], D,
                                 window or 0, D ** -0.5 if scale is None else scale, softcap or 0.0,
                                 _ptr(sink32), out.data_ptr()) != 0:
            return super()._decode(g, q, kc, vc, window, sinks=sinks, scale=scale, softcap=softcap)
        return out.to(q.dtype)


def _sinks(sinks: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """A layer's sink logits as the kernels read them: [heads] fp32, contiguous (None: no sinks).
    ValueError for another count, before any kernel reads past them."""
    if sinks is None:
        return None
    if sinks.numel() != heads:
        raise ValueError(f"attention sinks: {sinks.numel()} logits for {heads} query heads")
    return sinks.detach().reshape(heads).to(torch.float32).contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
