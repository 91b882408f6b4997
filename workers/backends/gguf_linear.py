"""A GGUF file's linear layers computed from their quantised blocks (``cpuTuning.ggufCompute:
native``, or ``auto`` on a CPU without native bf16 or with ScheduleConfig.batchInvariant off;
``dequantise`` keeps the weights dequantised at load to bf16/fp32: docs/config.md,
docs/performance.md "GGUF blocks").

The loader (workers/models/gguf_loader.py) hands each linear's tensors to ``NativeTarget.linear``
as the file stores them (one part per GGUF tensor: the fused q/k/v and gate/up layers have
several, each its own block type); the weights then take the file's bytes, not 2-4x them, and a
decode step reads those bytes: the fused decode step (cpu_decode.py) reads them in place. The
products are the C kernels' (workers/kernels/gguf_kernels.c):

- on the AVX-512 VNNI builds (with or without avx512_bf16: Zen 4/5, Intel Xeons from Cascade
  Lake) and the AVX2 builds (Haswell on, Zen 1-3; AVX-VNNI's ymm vpdpbusd where present): each part
  interleaved at load in groups of 16 rows (``gk.pack_x16``, the file's bytes), activations
  quantised per 32 values to int8 (as llama.cpp's Q8_0), a 32-value block of 16 rows (AVX2: two
  halves of 8) summed exactly in int32 by 8 vpdpbusd (AVX2: vpmaddubsw pairs) and then one scale and
  two FMAs per block and output, at every row count: 3-4x mode 2's integer products on one row,
  4-5x on prompts (AVX2: 1.8x and 2.7x), level with or ahead of the dequantised tiles and oneDNN
  over bf16 copies from 64 rows (docs/performance.md "GGUF blocks"); one order per (row, output)
  whatever the step holds, so batch-invariant mode (ScheduleConfig.batchInvariant) takes it as it
  is, and the AVX2 and AVX-512 builds give the same bits;
- on the scalar build, few rows (decode steps): integer dot products with each weight row read
  from its blocks, scaled per 16 values; from ``SCALAR_FLOAT_ROWS`` rows fp32 products over
  dequantised tiles; above ``INT_ROWS`` the layer's weights dequantised into a transient matrix on
  oneDNN; (``interleave=False``, benchmarks: the SIMD builds' products over the file's blocks as
  stored: the integer rows, mode 3's tiles from the row counts gguf_kernels.c measured,
  ``gk.tile_rows``, and the transient matrix);
- in batch-invariant mode there one path at every row count, so a row's result never depends on
  its step: mode 2's integer products.

The activation quantisation changes the results slightly against the dequantised weights
(~0.3 % of a product's magnitude): greedy text can differ from the ``dequantise`` path where
two tokens' logits are that close (tests/test_gguf_kernels.py).
"""
from __future__ import annotations

import ctypes
import logging
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from workers import settings
from workers.kernels import gguf_kernels as gk

log = logging.getLogger("workers.backends")

COMPUTES = ("auto", "native", "dequantise")
# What a speculative proposal's row costs over the interleaved products, as a fraction of a
# one-row decode step (mindie-bench speculative --row-cost; CpuBackend.spec_row_cost), per build's
# gguf_isa(): AVX-512 VNNI 7-32 % (Zen 4, bf16 and fp32 rows), AVX2 27-34 % (its 8-row halves and
# vpmaddubsw pairs make each further row dearer).
X16_ROW_COST = {2: 0.25, 1: 0.30}
# Row counts up to this take the integer products (cpu_kernels' decode batches reach 64).
INT_ROWS = 64
# The scalar build (no AVX2): from this many rows the fp32 products over dequantised tiles (the
# compiler's SSE loop) beat its scalar integer loop (docs/performance.md, "GGUF blocks").
SCALAR_FLOAT_ROWS = 16


def compute(bf16: bool = True, fast_invariant: Callable[[], bool] = lambda: True) -> str:
    """``cpuTuning.ggufCompute`` resolved: native or dequantise (ValueError for anything else).
    ``auto``: native where the CPU has no native bf16 (``bf16`` False: AVX-512 without
    avx512_bf16, AVX2), where the dequantised weights would be computed in fp32 or as bf16 weights
    under fp32 rows, 2-4x the file's bytes per token; where it has them (AVX512-BF16, AMX) with
    ScheduleConfig.batchInvariant off, where the dequantised tiles (gguf_kernels.c mode 3) tie or
    beat the bf16 copies from 8 rows and on prompts and the integer products win one row; and in
    batch-invariant mode (the CPU default) where that mode's one path is fast at every row count
    (``fast_invariant()``, asked only there: the SIMD builds' interleaved integer products,
    or the avx512_bf16 build's bf16 tiles for bf16 rows), which decodes faster than the bf16 copies
    and keeps the file's bytes, not 3.5x them. Otherwise dequantise: mode 2's integer products,
    that mode's path on other builds, lose 3x on prompts (docs/performance.md, "GGUF blocks")."""
    value = settings.cpu().gguf_compute
    if value not in COMPUTES:
        raise ValueError(f"cpuTuning.ggufCompute must be one of {', '.join(COMPUTES)}, got {value!r}")
    if value == "auto":
        return "dequantise" if bf16 and settings.engine().batch_invariant and not fast_invariant() else "native"
    return value


def regimes(lib: ctypes.CDLL, dtype: torch.dtype) -> str:
    """The products a native linear takes per row count on this build (a Q4_1 part), in words."""
    if lib.x16:
        return ("integer products over the blocks interleaved in 16-row groups at every row count "
                "(one order per row, prompts included)")
    if settings.engine().batch_invariant:
        one = "bf16 dequantised tiles" if lib.tile_bf16 and dtype == torch.bfloat16 else "integer products"
        return f"{one} at every row count (ScheduleConfig.batchInvariant: one order per row, prompts included)"
    if lib.isa == 0:
        return (f"integer products up to {SCALAR_FLOAT_ROWS - 1} rows, fp32 tiles to {INT_ROWS}, "
                "a transient dequantised matrix on oneDNN above")
    lo, hi = gk.tile_rows(lib, gk.TYPES["Q4_1"], dtype)
    if not lo:
        return f"integer products up to {INT_ROWS} rows, a transient dequantised matrix on oneDNN above"
    # bf16 tiles: bf16 rows on the avx512_bf16 build (the one build whose fp32 rows take no tiles)
    kind = "bf16" if lib.tile_bf16 and dtype == torch.bfloat16 else "fp32"
    return (f"integer products up to {lo - 1} rows, {kind} dequantised tiles from {lo}"
            + (f" to {hi} rows, a transient dequantised matrix on oneDNN above" if hi else " rows on"))


class Part(NamedTuple):
    """Output rows ``first`` .. ``first + rows`` of a GgufLinear: ``data`` uint8, the file's blocks
    [rows, row bytes] of ggml type ``type``, or (``type`` with gk.X16) those rows interleaved in
    groups of 16 (gk.pack_x16)."""
    first: int
    type: int
    data: torch.Tensor
    rows: int


def _covering(parts: list[tuple[int, int, torch.Tensor]], rows: int, what: str,
              unit: str = "rows") -> list[tuple[int, int, torch.Tensor]]:
    """``parts`` (first row, ggml type, blocks) in row order, refused unless they cover ``rows`` rows."""
    given = sorted(parts, key=lambda p: p[0])
    covered = sum(raw.shape[0] for _, _, raw in given)
    if covered != rows:
        raise ValueError(f"{what}: parts cover {covered} of {rows} {unit}")
    return given


class GgufLinear(nn.Module):
    """``x @ W.T (+ bias)`` with W [out_features, in_features] held as ``parts``: (first output row,
    ggml type id, uint8 [rows, row bytes] blocks) covering every output row once."""

    def __init__(self, lib: ctypes.CDLL, in_features: int, out_features: int,
                 parts: list[tuple[int, int, torch.Tensor]], bias: torch.Tensor | None, interleave: bool = True):
        super().__init__()
        self.lib, self.in_features, self.out_features = lib, in_features, out_features
        given = _covering(parts, out_features, "GGUF linear", "output rows")
        self.bias = bias
        # The AVX2 and AVX-512 builds interleave the parts in 16-row groups and take their integer
        # products at every row count (one order per row: batch-invariant as they are; faster than
        # the other paths from one row up, level with the tiles on prompts). Elsewhere (the scalar
        # build, or interleave False) batch-invariant mode keeps one path at every row count: mode
        # 3's bf16 tiles for bf16 rows on the avx512_bf16 build, else mode 2's integer products.
        self.invariant = settings.engine().batch_invariant
        self.x16 = interleave and bool(getattr(lib, "x16", False))  # interleave False: the build's other paths
        self.invariant_tiles = bool(getattr(lib, "tile_bf16", False)) and not self.x16
        self.parts = [Part(r0, t | gk.X16, gk.pack_x16(lib, t, raw, in_features), raw.shape[0]) if self.x16
                      else Part(r0, t, raw, raw.shape[0]) for r0, t, raw in given]
        # each part type's tile ranges per activation dtype, asked of the library once: forward
        # chooses a path per part on every call
        self._tiles = {(p.type, dt): gk.tile_rows(lib, p.type, dt) for p in self.parts if not p.type & gk.X16
                       for dt in (torch.float32, torch.bfloat16)}
        # which products ran, counted once a call per kind (tests check the path)
        self.calls = {"int": 0, "tile": 0, "float": 0, "dequantised": 0}

    def nbytes(self) -> int:
        return sum(p.data.numel() for p in self.parts)

    def types(self) -> set[int]:
        """The parts' ggml type ids (without gk.X16)."""
        return {p.type & 0xFF for p in self.parts}

    def tile_range(self, type_id: int, dtype: torch.dtype) -> tuple[int, int]:
        """(from, to) rows where a part of ``type_id`` takes the dequantised tiles (gk.tile_rows).
        Batch-invariant mode keeps one path at every row count: (1, 0), the tiles at every count,
        for bf16 rows on the avx512_bf16 build (each sum in one order whatever the rows around it:
        tests/test_gguf_kernels.py); else (0, 0), mode 2's integer products."""
        if type_id & gk.X16:
            return (0, 0)
        if self.invariant:
            return (1, 0) if self.invariant_tiles and dtype == torch.bfloat16 else (0, 0)
        return self._tiles[type_id, dtype]

    def path(self, type_id: int, m: int, dtype: torch.dtype) -> str:
        """Which products compute ``m`` rows of ``dtype`` for a part of ``type_id``: "int" (integer;
        mode 2 in batch-invariant mode), "tile" (dequantised tiles in cache), "float" (the scalar
        build's fp32 tiles) or "dequantised" (a transient matrix on oneDNN); gguf_kernels.c's
        measured ranges. Batch-invariant mode keeps one path at every row count (tile_range)."""
        if m == 0:
            return "dequantised"
        lo, hi = self.tile_range(type_id, dtype)
        if lo and m >= lo and (not hi or m <= hi):
            return "tile"
        if self.invariant or type_id & gk.X16:
            return "int"
        if self.lib.isa == 0:
            return "int" if m < SCALAR_FLOAT_ROWS else "float" if m <= INT_ROWS else "dequantised"
        return "int" if m <= INT_ROWS else "dequantised"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        dtype = rows.dtype if rows.dtype in (torch.float32, torch.bfloat16) else torch.float32
        rows = rows.to(dtype).contiguous()
        m = rows.shape[0]
        bias = None if self.bias is None else self.bias.detach().to(dtype)
        paths = [self.path(p.type, m, dtype) for p in self.parts]
        for p in set(paths):
            self.calls[p] += 1
        if all(p == "dequantised" for p in paths):
            out = F.linear(rows, self.dequantised(dtype), bias)
            return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        out = torch.empty((m, self.out_features), dtype=torch.float32 if "float" in paths else dtype)
        acts = gk.Activations(self.lib, rows) if "int" in paths else None
        xf = rows.float().contiguous() if "float" in paths else None
        for (r0, tid, raw, n), p in zip(self.parts, paths):
            b = None if bias is None else bias[r0:r0 + n]
            dst = out[:, r0:r0 + n]
            if p == "int":  # decode rows; in batch-invariant mode every row count, one order per row
                gk.matmul(self.lib, tid, rows, raw, dst, acts=acts, bias=b,
                          mode=gk.INVARIANT if self.invariant else gk.INTEGER)
            elif p == "tile":
                gk.matmul(self.lib, tid, rows, raw, dst, bias=b, mode=gk.TILE)
            elif p == "float":
                gk.matmul(self.lib, tid, xf, raw, dst, mode=gk.FLOAT, bias=None if b is None else b.float())
            else:
                dst.copy_(F.linear(rows, gk.dequantize(self.lib, tid, raw, self.in_features, dtype, rows=n), b))
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def dequantised(self, dtype: torch.dtype) -> torch.Tensor:
        """The [out, in] weight in ``dtype`` (fp32 or bf16), computed from the blocks (transient)."""
        w = torch.empty((self.out_features, self.in_features), dtype=dtype)
        for r0, tid, raw, n in self.parts:
            gk.dequantize(self.lib, tid, raw, self.in_features, dtype, out=w[r0:r0 + n], rows=n)
        return w

    @property
    def weight(self) -> torch.Tensor:
        """fp32 [out, in] (rare paths and tests: the model's dtype is the rows')."""
        return self.dequantised(torch.float32)


C_PARTS = 4  # DEC_GGUF_PARTS in cpu_kernels.c, MOE_PARTS in gguf_kernels.c


class CParts(ctypes.Structure):
    """A GgufLinear's rows as the C kernels read them in place: cpu_kernels.c's ``dec_gguf_t`` (the
    fused decode step) and gguf_kernels.c's ``gg_linear_t`` (``gguf_moe``), one layout."""
    _fields_ = [("n_parts", ctypes.c_int64)] + [(n, ctypes.c_int64 * C_PARTS) for n in ("first", "rows", "type")] \
        + [("data", ctypes.c_void_p * C_PARTS), ("tile_from", ctypes.c_int64 * C_PARTS), ("tile_to", ctypes.c_int64)]


def c_parts(mod: "GgufLinear", rows: slice | None = None, dtype: torch.dtype = torch.bfloat16) -> CParts | None:
    """The parts of ``mod`` holding output rows ``rows`` (all of them: None), as the kernels read
    them, or None where a part straddles the slice or there are too many. ``dtype``: the
    activations', for the eager path's tile ranges (the fused step follows them; gguf_moe takes
    the integer products whatever they say)."""
    start = 0 if rows is None else rows.start or 0
    stop = mod.out_features if rows is None or rows.stop is None else rows.stop
    parts = [p for p in mod.parts if start <= p.first < stop]
    if not parts or len(parts) > C_PARTS or any(p.first + p.rows > stop for p in parts) \
            or sum(p.rows for p in parts) != stop - start:
        return None
    g = CParts(n_parts=len(parts))
    for i, (r0, t, raw, n) in enumerate(parts):
        # t with gk.X16: the rows interleaved in 16-row groups, which gguf_rows reads as such
        g.first[i], g.rows[i], g.type[i], g.data[i] = r0 - start, n, t, raw.data_ptr()
        # the eager GgufLinear's ranges (one path in batch-invariant mode)
        g.tile_from[i], g.tile_to = mod.tile_range(t, dtype)
    return g


class GgufEmbedding(nn.Module):
    """A token embedding looked up from GGUF blocks: its tied LM head's (that head's ``GgufLinear``
    parts, interleaved or not, ``of_head``) or, untied, its own tensor's as the file stores them.
    Each step's rows are dequantised as they are asked for (gguf_dequantize_rows: the values the
    loader's dense copy would hold), so the model keeps the file's bytes instead of a dense matrix
    (the default model: 113 MiB in fp32, 57 in bf16; an 8B Llama 3's untied Q4_K embedding: 288 MiB
    against 1 GiB in bf16, 2 in fp32). ``dtype``, ``num_embeddings`` and ``embedding_dim`` as an
    nn.Embedding has; no ``weight``: a reader of the dense matrix fails loudly (the fused decode step
    asks ``lookup`` for its rows)."""

    def __init__(self, lib: ctypes.CDLL, parts: list[Part], num_embeddings: int, embedding_dim: int,
                 dtype: torch.dtype):
        super().__init__()
        self.lib, self.parts, self.dtype = lib, parts, dtype
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    @classmethod
    def of_head(cls, head: GgufLinear, dtype: torch.dtype) -> GgufEmbedding:
        """The embedding read from a tied head's blocks (its parts, not a second copy)."""
        return cls(head.lib, head.parts, head.out_features, head.in_features, dtype)

    def lookup(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The rows of ``ids`` (flat int64) into ``out`` [len(ids), embedding_dim] (or a new tensor)."""
        n = ids.numel()
        if n and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(f"a token id outside the embedding's {self.num_embeddings} rows")
        if out is None:
            out = torch.empty(n, self.embedding_dim, dtype=self.dtype)
        if len(self.parts) == 1:
            p = self.parts[0]
            return gk.dequantize_rows(self.lib, p.type, p.data, ids - p.first if p.first else ids, self.embedding_dim,
                                      self.dtype, out)
        for p in self.parts:  # a head of several parts (a tensor per row range): each its own rows
            at = ((ids >= p.first) & (ids < p.first + p.rows)).nonzero().flatten()
            if at.numel():
                out[at] = gk.dequantize_rows(self.lib, p.type, p.data, ids[at] - p.first, self.embedding_dim,
                                             self.dtype)
        return out

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(input_ids.reshape(-1)).view(*input_ids.shape, self.embedding_dim)


class NativeTarget:
    """What the GGUF loader builds native linears with (gguf_loader.GgufTarget)."""

    def __init__(self, lib: ctypes.CDLL, bf16: bool = False, interleave: bool = True):
        self.lib, self.bf16 = lib, bf16  # bf16: the CPU computes bf16 natively (the log's reason)
        self.interleave = interleave  # False: the file's blocks as they are (benchmarks compare)
        self.count = 0
        self.nbytes = 0

    def covers(self, type_id: int, in_features: int) -> bool:
        bv = self.lib.gguf_block_values(int(type_id))
        return bv > 0 and in_features % bv == 0

    def linear(self, parts: list[tuple[int, int, torch.Tensor]], in_features: int, out_features: int,
               bias: torch.Tensor | None) -> nn.Module:
        lin = GgufLinear(self.lib, in_features, out_features, parts, bias, self.interleave)
        self.count += 1
        self.nbytes += lin.nbytes()
        return lin

    def embedding(self, head: nn.Module, dtype: torch.dtype) -> nn.Module | None:
        """The token embedding read from its tied head's blocks (``head``: this target's linear)."""
        return GgufEmbedding.of_head(head, dtype) if isinstance(head, GgufLinear) else None

    def embedding_blocks(self, parts: list[tuple[int, int, torch.Tensor]], num_embeddings: int,
                         embedding_dim: int, dtype: torch.dtype) -> nn.Module:
        """An untied token embedding read from its own tensor's blocks (``parts`` as ``linear``
        takes them), kept as the file stores them: a lookup reads a row's blocks wherever they are."""
        given = _covering(parts, num_embeddings, "GGUF embedding")
        return GgufEmbedding(self.lib, [Part(r0, t, raw, raw.shape[0]) for r0, t, raw in given], num_embeddings,
                             embedding_dim, dtype)

    def loaded(self, types: set[str], dtype: torch.dtype = torch.bfloat16) -> None:
        if self.count:
            setting = settings.cpu().gguf_compute
            why = (": no native bf16 on this CPU" if not self.bf16 else
                   ": ScheduleConfig.batchInvariant off" if not settings.engine().batch_invariant else
                   ": batch-invariant, integer products over 16-row interleaved blocks at every row count"
                   if self.lib.x16 else ": batch-invariant, bf16 tiles at every row count")
            log.info("GGUF compute: native (cpuTuning.ggufCompute %s%s), %d linear layers in their blocks (%s, "
                     "%.1f MiB) on the C kernels (%s): %s", setting, why if setting == "auto" else "", self.count,
                     "/".join(sorted(types)), self.nbytes / 2**20, gk.ISA_NAMES[self.lib.isa],
                     regimes(self.lib, dtype))


def native_target(bf16: bool = True, dtype: torch.dtype = torch.bfloat16) -> NativeTarget | None:
    """The CPU's target for a GGUF model's linears computing ``dtype`` rows, or None
    (``ggufCompute: dequantise``, or no C kernels: the reason logged once)."""
    lib = None

    def fast_invariant() -> bool:  # loads the kernels only where auto's answer depends on them
        nonlocal lib
        lib = gk.load()
        return lib is not None and (lib.x16 or (lib.tile_bf16 and dtype == torch.bfloat16))

    if compute(bf16, fast_invariant) != "native":
        auto = settings.cpu().gguf_compute == "auto"
        log.info("GGUF compute: dequantise (cpuTuning.ggufCompute %s%s): linear weights dequantised at load",
                 settings.cpu().gguf_compute,
                 f": this CPU computes bf16 natively and the worker runs batch-invariant with {dtype} rows, "
                 "whose one native path on these kernels is mode 2's integer products" if auto else "")
        return None
    lib = lib or gk.load()
    if lib is None:
        log.info("GGUF compute: dequantise, as the C kernels are unavailable (%s)", gk.unavailable_reason())
        return None
    return NativeTarget(lib, bf16)
