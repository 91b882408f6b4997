"""Which kernel computes each part of a CPU step on this machine: decided by the instruction sets
the C kernels were built with and the CPU's flags, logged once when a worker has specialised its
model, and shown to operators in the worker's device description (``/v1/config``'s ``workers``).

The parts and their choices (docs/performance.md has the figures per machine kind):

- products (the linear layers of prefills and of decode steps the fused step does not take):
  torch's oneDNN, bf16 on AMX tiles where ``amx_bf16`` exists, AVX512-BF16 dot products where
  ``avx512_bf16`` does, fp32 FMAs otherwise (``dtype: auto`` is float32 there: oneDNN converts
  bf16 to fp32 on AVX2-only CPUs, several times slower than fp32 itself);
- the fused decode step (``cpu_decode.py``): decode-only steps of up to ``cpuTuning.fusedDecodeRows``
  rows with the C kernels' own products (AMX-BF16 tiles where ``amx_bf16`` exists and the OS grants
  the tile state, AVX512-BF16 dot products, AVX-512 or AVX2+FMA loops), above that oneDNN;
- decode and prefill attention: the C kernels' AVX-512 or AVX2+FMA loops, the portable C loops,
  or torch where the kernels are off; bf16 prompt chunks on AMX tiles where ``amx_bf16`` exists
  (head sizes a multiple of 32 up to 128); torch's SDPA where ``paged_prefill`` does not cover
  the layout, and all of them with ``cpuTuning.prefillAttention: sdpa`` (not row-independent;
  workers/attention/cpu.py);
- a GGUF file's linears under ``cpuTuning.ggufCompute: native``: the C kernels' products of their
  blocks (gguf_kernels.c, the build's instruction set), dequantised onto oneDNN for prompts.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from mindie.contract.spec import cpu_flags
from workers import settings
from workers.attention.cpu import amx_prefill_covers, prompt_route
from workers.backends.gguf_linear import GgufLinear, regimes
from workers.kernels.gguf_kernels import ISA_NAMES


@dataclass(frozen=True)
class Dispatch:
    isa: str
    products: str
    fused_decode: str
    decode_attention: str
    prefill_attention: str
    dtype: str

    def line(self) -> str:
        return (f"isa={self.isa}, products={self.products}, fused decode step={self.fused_decode}, "
                f"decode attention={self.decode_attention}, prefill attention={self.prefill_attention}, "
                f"dtype={self.dtype}")


def isa_name(flags: set[str], lib: ctypes.CDLL | None) -> str:
    """The CPU's vector extensions as the kernels see them, e.g. ``avx2+fma (no avx512/amx)``,
    ``avx512+avx512_bf16``, ``avx512+avx512_bf16+amx_bf16``; ``, kernels built for avx2`` when
    the build left AVX-512 out (cpuTuning.isa avx2)."""
    parts = [n for n in ("avx512f", "avx512_bf16", "amx_bf16") if n in flags]
    if parts:
        name = "+".join("avx512" if n == "avx512f" else n for n in parts)
    elif "avx2" in flags:
        name = "avx2+fma (no avx512/amx)" if "fma" in flags else "avx2 (no fma)"
    else:
        name = "no avx2"
    if lib is not None and "avx512f" in flags and not lib.has_avx512:
        name += ", kernels built for avx2"
    elif lib is not None and "avx512_bf16" in flags and lib.has_avx512 and not lib.has_dpbf16:
        name += ", kernels built without avx512_bf16"
    return name


def _kernel_isa(lib: ctypes.CDLL) -> str:
    return "avx512" if lib.has_avx512 else "avx2" if getattr(lib, "has_avx2", False) else "portable"


def products_name(dtype: torch.dtype, flags: set[str], packed: bool = True) -> str:
    """What oneDNN computes the linear layers with, for this dtype on this CPU (``packed``: the
    weights could be prepacked, cpu_linear.py; bf16 cannot be on CPUs without native bf16)."""
    if not packed:
        return f"torch {str(dtype).replace('torch.', '')} (F.linear, weights not prepacked on this CPU)"
    if dtype == torch.bfloat16:
        if "amx_bf16" in flags:
            return "torch bf16 (oneDNN amx_bf16)"
        if "avx512_bf16" in flags:
            return "torch bf16 (oneDNN avx512_bf16)"
        return "torch bf16 (oneDNN, converted to fp32: no native bf16)"
    name = {torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, str(dtype).replace("torch.", ""))
    vec = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "sse"
    return f"torch {name} (oneDNN {vec})"


def decide(model: torch.nn.Module, lib: ctypes.CDLL | None, flags_line: str | None = None) -> Dispatch:
    """The choices for ``model`` as ``specialise_cpu_model`` left it (its dtype, its fused step)."""
    flags = set((cpu_flags() if flags_line is None else flags_line).split())
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    fused = getattr(model, "fast_decode", None)
    if lib is None:
        attn = "torch (C kernels off)"
        decode, prefill = attn, "torch SDPA (C kernels off)"
    else:
        k = _kernel_isa(lib)
        decode = f"C {k}"
        fma = dtype == torch.float32 or not lib.has_dpbf16  # plain FMAs: fresh prompts only (attention/cpu.py)
        prefill = (f"C {k}" + (" for fresh prompts up to 1024 tokens, else SDPA" if fma else "")
                   if getattr(lib, "has_prefill", False) and dtype in (torch.float32, torch.bfloat16)
                   else "torch SDPA")
        head_dim = getattr(getattr(model, "args", None), "head_dim", None)
        if (dtype == torch.bfloat16 and getattr(lib, "prefill_amx", False) and getattr(lib, "has_prefill", False)
                and head_dim is not None and amx_prefill_covers(head_dim)):
            prefill = "C amx_bf16 tiles"
        if prompt_route() == "sdpa":
            tiles = " (flash attention on AMX tiles)" if dtype == torch.bfloat16 and "amx_bf16" in flags else ""
            prefill = f"torch SDPA per sequence{tiles}, {prefill} for sliding windows"
        if dtype not in (torch.float32, torch.bfloat16) and not (dtype == torch.float16 and lib.has_f16):
            decode = "torch"
    from workers.backends.cpu_linear import KernelLinear, PackedLinear
    kernel = any(isinstance(m, KernelLinear) for m in model.modules())
    if fused is None:
        step = "off"
    else:
        kind = ("avx512_bf16 dot products" if lib is not None and lib.has_dpbf16 and dtype == torch.bfloat16
                else f"{_kernel_isa(fused.lib)} FMAs")
        amx = getattr(fused.lib, "amx_rows", 0) if dtype == torch.bfloat16 else 0
        if amx:
            kind = "amx_bf16 tiles" + (f" from {amx} rows, avx512_bf16 dot products below" if amx > 1 else "")
        step = f"on up to {fused.max_rows} rows ({kind}; {'linear_rows' if kernel else 'oneDNN'} above)"
    packed = any(isinstance(m, PackedLinear) for m in model.modules())
    products = products_name(dtype, flags, packed)
    if kernel:
        products = ("C amx_bf16 tiles (linear_rows; the weights' one copy, shared with the fused decode step)"
                    if lib is not None and getattr(lib, "amx_rows", 0) and dtype == torch.bfloat16 else
                    "C avx512_bf16 products (linear_rows; the weights' one copy, shared with the fused decode step)"
                    if lib is not None and lib.has_dpbf16 and dtype == torch.bfloat16 else
                    "C avx2 products of bf16 weights on fp32 rows (linear_rows, register-tiled from 4 rows)"
                    if dtype == torch.float32 else
                    "C avx2 bf16 products (linear_rows, register-tiled from 4 rows; oneDNN cannot pack bf16 here)")
    if settings.engine().batch_invariant and lib is not None:  # workers/backends/cpu_invariant.py
        kind = ("amx_bf16 tiles" if getattr(lib, "amx_rows", 0) and dtype == torch.bfloat16 else
                "avx512_bf16 dot products" if lib.has_dpbf16 and dtype == torch.bfloat16 else f"{_kernel_isa(lib)} FMAs")
        products = f"C {kind} (linear_rows, batch-invariant: one order at every row count)"
        prefill = "the decode kernel, a token at a time (batch-invariant)"
    gguf = [m for m in model.modules() if isinstance(m, GgufLinear)]
    if gguf:  # a GGUF file's linears in their blocks (cpuTuning.ggufCompute: native)
        products = (f"C GGUF blocks ({ISA_NAMES[gguf[0].lib.isa]}: {regimes(gguf[0].lib, dtype)}) for {len(gguf)} layers"
                    + (f", {products} for the rest" if packed or kernel else ""))
    return Dispatch(isa_name(flags, lib), products, step, decode, prefill,
                    str(dtype).replace("torch.", ""))
