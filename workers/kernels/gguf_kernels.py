"""Build and call the GGUF block kernels (gguf_kernels.c): products of weights kept in ggml's
quantised blocks.

Built as cpu_kernels.py builds its library (the same compiler, cache directory, lock and flags,
``cpuTuning.isa`` included); ``build(flags)`` builds another instruction set's variant (the tests
run the AVX2 and scalar paths on an AVX-512 host). ``ISA_NAMES`` names what ``gguf_isa()`` reports.
"""
from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path

import torch

from workers.kernels import cpu_kernels

log = logging.getLogger("workers.backends")

SOURCE = Path(__file__).with_name("gguf_kernels.c")
ISA_NAMES = {2: "avx512-vnni (vpdpbusd)", 1: "avx2 (vpmaddubsw)", 0: "scalar"}
# The flags that build each instruction set's path on top of the common ones (a host that has the
# wider ones can run the narrower: the tests build all three).
VARIANT_FLAGS = {"native": [], "avx512": cpu_kernels.ISA_FLAGS["avx512"], "avx2": cpu_kernels.ISA_FLAGS["avx2"],
                 "avxvnni": ["-mno-avx512f"], "scalar": ["-mno-avx"]}
# GGML type ids the kernels read (gguf.GGMLQuantizationType values)
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
# gguf_matmul's modes: int8 activations, fp32 ones over dequantised tiles (the scalar build's), int8
# activations with each row's products in one order at any row count (batch-invariant mode), and
# the activations as they are against weight tiles dequantised in cache (bf16 vdpbf16ps or fp32
# FMAs, register-tiled: mid and large row counts on the AVX2 and AVX-512 builds)
INTEGER, FLOAT, INVARIANT, TILE = 0, 1, 2, 3
# a type id with this bit: the weights interleaved in groups of 16 rows (gguf_x16_pack, the
# AVX-512 VNNI build's integer products at every row count: gguf_kernels.c "16-row interleaved")
X16 = 0x100

_lib: ctypes.CDLL | None = None
_tried = False
_reason = ""


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.gguf_isa.restype = ctypes.c_int
    lib.gguf_tile_from.restype = i64
    lib.gguf_tile_from.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.gguf_tile_to.restype = i64
    lib.gguf_tile_to.argtypes = [ctypes.c_int]
    lib.gguf_tile_bf16.restype = ctypes.c_int
    lib.gguf_tile_bf16.argtypes = []
    lib.gguf_block_values.restype = i64
    lib.gguf_block_values.argtypes = [ctypes.c_int]
    lib.gguf_block_bytes.restype = i64
    lib.gguf_block_bytes.argtypes = [ctypes.c_int]
    lib.gguf_quantize.restype = ctypes.c_int
    lib.gguf_quantize.argtypes = [ctypes.c_int, p, i64, i64, p, p, p]
    lib.gguf_matmul.restype = ctypes.c_int
    lib.gguf_matmul.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, i64, i64, p, p, p, p, p, i64, p, p, i64]
    lib.gguf_quantize_row.restype = None  # the fused decode step calls these two through pointers
    lib.gguf_rows.restype = None
    lib.gguf_dequantize.restype = ctypes.c_int
    lib.gguf_dequantize.argtypes = [ctypes.c_int, p, i64, i64, ctypes.c_int, p]
    lib.gguf_dequantize_rows.restype = ctypes.c_int
    lib.gguf_dequantize_rows.argtypes = [ctypes.c_int, p, p, i64, i64, ctypes.c_int, p]
    lib.gguf_x16_supported.restype = ctypes.c_int
    lib.gguf_x16_supported.argtypes = []
    lib.gguf_x16_bytes.restype = i64
    lib.gguf_x16_bytes.argtypes = [ctypes.c_int, i64]
    lib.gguf_moe.restype = ctypes.c_int  # workers/backends/gguf_experts.py
    lib.gguf_moe.argtypes = [ctypes.c_int, i64, i64, i64, i64, p, p, p, i64, p, p, p, p]
    lib.gguf_x16_pack.restype = ctypes.c_int
    lib.gguf_x16_pack.argtypes = [ctypes.c_int, p, i64, i64, p]
    lib.isa = int(lib.gguf_isa())
    lib.x16 = bool(lib.gguf_x16_supported())  # interleaved 16-row groups (the AVX2 and AVX-512 builds)
    lib.tile_bf16 = bool(lib.gguf_tile_bf16())  # bf16 tiles for bf16 rows (the avx512_bf16 build)
    return lib


def build(variant: str = "native") -> ctypes.CDLL:
    """This source built for ``variant`` (VARIANT_FLAGS; "native" honours cpuTuning.isa). Raises
    RuntimeError where it cannot be built."""
    cc = cpu_kernels._compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC)")
    flags = cpu_kernels.build_flags() if variant == "native" else cpu_kernels.FLAGS + VARIANT_FLAGS[variant]
    try:
        return declare(ctypes.CDLL(str(cpu_kernels._build(cc, SOURCE, flags))))
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        raise RuntimeError(f"build failed: {e}") from e


def load() -> ctypes.CDLL | None:
    """This host's library, or None (``unavailable_reason()``): no compiler, or the C kernels off."""
    global _lib, _tried, _reason
    if _tried:
        return _lib
    _tried = True
    if cpu_kernels.load() is None:  # the same switches and compiler: off or failed there, off here
        _reason = cpu_kernels.unavailable_reason()
    else:
        try:
            _lib = build()
        except (RuntimeError, ValueError) as e:
            _reason = str(e)
    return _lib


def unavailable_reason() -> str:
    return _reason


class Activations:
    """One call's activations quantised per 32 values (``gguf_quantize``), shared by the products
    of every part of a fused linear (q/k/v, gate/up)."""

    def __init__(self, lib: ctypes.CDLL, x: torch.Tensor):
        m, k = x.shape
        self.q = torch.empty((m, k), dtype=torch.int8)
        self.d = torch.empty((m, k // 4), dtype=torch.float32)  # the scale per 4 values (d4)
        self.s = torch.empty((m, k // 16), dtype=torch.float32)
        code = 1 if x.dtype == torch.bfloat16 else 0
        if lib.gguf_quantize(code, x.data_ptr(), m, k, self.q.data_ptr(), self.d.data_ptr(), self.s.data_ptr()):
            raise ValueError(f"gguf_quantize: {k} inputs is not a multiple of 32")


def tile_rows(lib: ctypes.CDLL, type_id: int, dtype: torch.dtype) -> tuple[int, int]:
    """(from, to): the row counts where this build's TILE products are the fastest for ``type_id``
    and activations of ``dtype`` (from 0: never; to 0: no upper limit), as gguf_kernels.c measured."""
    code = 1 if dtype == torch.bfloat16 else 0
    return int(lib.gguf_tile_from(int(type_id), code)), int(lib.gguf_tile_to(code))


def matmul(lib: ctypes.CDLL, type_id: int, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *,
           acts: Activations | None = None, bias: torch.Tensor | None = None, mode: int = INTEGER) -> None:
    """``out[:, :n] = x @ dequantised(w).T (+ bias)``: ``x`` [M, K] fp32/bf16 contiguous (fp32 for
    FLOAT; out's dtype for TILE), ``w`` uint8 [N, row bytes] (the file's blocks; ``type_id | X16``:
    pack_x16's groups, N = out's columns), ``out`` [M, >= N] of x's dtype, rows contiguous (a column
    slice of a wider output is fine). ``acts``: x already quantised (INTEGER, INVARIANT)."""
    m, k = x.shape
    n = out.shape[1] if type_id & X16 else w.shape[0]
    if mode == TILE:
        if x.dtype != out.dtype or not x.is_contiguous():
            raise ValueError("gguf_matmul TILE: x must be contiguous and of out's dtype")
        acts = None
    elif mode != FLOAT and acts is None:
        acts = Activations(lib, x)
    code = 1 if out.dtype == torch.bfloat16 else 0
    if bias is not None and bias.dtype != out.dtype:
        bias = bias.to(out.dtype)
    rc = lib.gguf_matmul(type_id, mode, code, m, k, x.data_ptr() if mode in (FLOAT, TILE) else None,
                         None if acts is None else acts.q.data_ptr(), None if acts is None else acts.d.data_ptr(),
                         None if acts is None else acts.s.data_ptr(), w.data_ptr(), n,
                         None if bias is None else bias.contiguous().data_ptr(), out.data_ptr(), out.stride(0))
    if rc:
        raise ValueError(f"gguf_matmul refused type {type_id} with {k} inputs")


def pack_x16(lib: ctypes.CDLL, type_id: int, w: torch.Tensor, k: int) -> torch.Tensor:
    """``w``'s N rows of blocks interleaved in groups of 16 rows: uint8 [ceil(N / 16), group bytes],
    computed as type ``type_id | X16`` (rows past N zero). ValueError where this build or the
    type does not cover it (``lib.x16`` says whether the build does)."""
    n, gb = w.shape[0], int(lib.gguf_x16_bytes(int(type_id), k))
    out = torch.empty(((n + 15) // 16, gb), dtype=torch.uint8)
    if not gb or lib.gguf_x16_pack(int(type_id), w.contiguous().data_ptr(), n, k, out.data_ptr()):
        raise ValueError(f"gguf_x16_pack refused type {type_id} with {k} inputs on the {ISA_NAMES[lib.isa]} build")
    return out


def dequantize(lib: ctypes.CDLL, type_id: int, w: torch.Tensor, k: int, dtype: torch.dtype,
               out: torch.Tensor | None = None, rows: int | None = None) -> torch.Tensor:
    """The [N, k] matrix of ``dtype`` (fp32 or bf16) that ``w``'s blocks stand for (``type_id |
    X16``: ``w`` interleaved by pack_x16, ``rows`` = N)."""
    n = w.shape[0] if rows is None else rows
    if out is None:
        out = torch.empty((n, k), dtype=dtype)
    if lib.gguf_dequantize(type_id, w.data_ptr(), n, k, 1 if dtype == torch.bfloat16 else 0, out.data_ptr()):
        raise ValueError(f"gguf_dequantize refused type {type_id} with {k} inputs")
    return out


def dequantize_rows(lib: ctypes.CDLL, type_id: int, w: torch.Tensor, ids: torch.Tensor, k: int, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``ids`` (int64, each in range: the caller's check) of the matrix ``w``'s blocks stand for,
    [len(ids), k] of ``dtype`` (fp32 or bf16): an embedding looked up from its blocks."""
    ids = ids.to(torch.int64).contiguous()
    if out is None:
        out = torch.empty((ids.numel(), k), dtype=dtype)
    if lib.gguf_dequantize_rows(type_id, w.data_ptr(), ids.data_ptr(), ids.numel(), k,
                                1 if dtype == torch.bfloat16 else 0, out.data_ptr()):
        raise ValueError(f"gguf_dequantize_rows refused type {type_id} with {k} inputs")
    return out
