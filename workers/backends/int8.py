"""Weight-only int8 linears (W8A16): ``ModelConfig[].quantize: "w8a16"``.

At load, every linear of the decoder layers (the fused q/k/v and gate/up projections, o and
down; in a mixture of experts every routed expert's gate/up and down matrices and the shared
expert's, not the router nor the shared expert's [1, H] gate) and the LM head are quantised from the loaded weights (upcast to fp32): per output channel,
symmetric, ``scale[n] = max|W[n, :]| / 127`` (1 for an all-zero row), ``q = round(W / scale)``
clamped to [-127, 127]. Activations stay in the model dtype; the matmul computes
``x @ (q * scale).T`` with an fp32 accumulation. The embedding, the norms and the biases stay in
the model dtype.

The LM head is included because it is the largest single matrix of a small-vocabulary-heavy
model (the benchmark model: 33 of its 62 MB of bf16 weights) and is read at every decode step.
A tied head (``tie_word_embeddings``) keeps the embedding in the model dtype for the lookup and
computes the logits from an int8 copy of the same matrix (``model.logits_linear``); on the CPU
that copy replaces the oneDNN-packed bf16 copy the CPU backend keeps for the tied head anyway, so
it saves memory there; on an accelerator (no copy otherwise) it adds half of the embedding.

The matmul itself is the backend's (``Backend.int8_kernel``): CPU ``torch._weight_int8pack_mm``
for small row counts (decode) and dequantise-then-matmul above them; CUDA dequantise-then-matmul;
NPU ``torch_npu.npu_weight_quant_batchmatmul``. A backend without one refuses the key at start.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from workers import settings
from workers.backends.cpu_linear import bucket_rows
from workers.kernels import cpu_kernels
from workers.kernels.cpu_layout import pack, pack_scales

log = logging.getLogger("workers.backends")

QUANTIZE_KEY = "ModelConfig[].quantize"
SCHEMES = ("w8a16", "w8a8")  # w8a8: workers/backends/w8a8.py


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], fp32 scales [N]): symmetric per-output-channel quantisation of ``w`` [N, K]."""
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_weight_(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_weight`` of an fp32 ``w`` it may overwrite: the same operations, in place, so
    the same values, without three [N, K] fp32 temporaries (a loader quantising chunk by chunk,
    where fresh temporaries cost page faults as much as the arithmetic)."""
    if w.dtype != torch.float32:
        return quantize_weight(w)
    amax = w.abs().amax(dim=1)  # one temporary (vector_norm's inf norm: none, but 4x slower)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = w.div_(scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 matrix an int8 weight stands for (the reference the tests compare against)."""
    return q.float() * scale.float()[:, None]


class Int8Kernel:
    """One device's weight-only int8 matmul. ``pack`` turns (int8 [N, K], fp32 scales [N]) into
    what ``mm`` reads (the layout and dtypes that device wants); ``mm(x [M, K], packed)`` returns
    ``x @ (q * scale).T`` [M, N] in x's dtype."""

    name = "dequantise"
    transposed = False  # pack stores q as [K, N] instead of [N, K]

    def pack(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, device: torch.device) -> dict:
        return {"q": q.to(device), "scale": scale.to(device=device, dtype=dtype)}

    def mm(self, x: torch.Tensor, packed: dict) -> torch.Tensor:
        # Scale after the matmul: one [M, N] multiply instead of a [N, K] one.
        return F.linear(x, packed["q"].to(x.dtype)) * packed["scale"]

    def plain(self, packed: dict) -> torch.Tensor:
        """The int8 weight as [N, K] (a view where the layout allows)."""
        return packed["q"].t() if self.transposed else packed["q"]


# CPU without the C kernels: _weight_int8pack_mm is a GEMV-style kernel, its time grows with the
# rows; it beats dequantise-then-matmul up to ~24 rows here (docs/performance.md, "Weight-only int8").
# (cpuTuning.int8Rows, MINDIE_CPU_INT8_ROWS: 24)
# CPU with the C kernels: their int8 products (cpu_kernels.c ``linear_rows``, ~200 GFLOP/s per core
# at any row count) beat dequantise-then-matmul up to ~32 rows; oneDNN's bf16 GEMM wins above.
CPU_INT8_KERNEL_MAX_ROWS = 32


class CpuInt8Kernel(Int8Kernel):
    """With the C kernels (the default): the weight is kept in their layout, 16 output channels per
    vector ([N/16, K, 16], the fused decode step reads the same tensor), and row counts up to
    ``CPU_INT8_KERNEL_MAX_ROWS`` go through ``linear_rows``; larger ones dequantise into the
    transposed [K, N] matrix of the activation type (``int8_unpack_t``) for oneDNN. Without them:
    ``_weight_int8pack_mm`` for small row counts, dequantise-then-matmul above."""

    name = "cpu"

    def __init__(self, max_rows: int | None = None, c_kernels: bool = True):
        """``max_rows`` None = cpuTuning.int8Rows; ``c_kernels=False``: the torch path even where the
        C kernels load (tests cover both)."""
        if max_rows is None:
            max_rows = settings.cpu().int8_rows
        self.max_rows = max_rows if hasattr(torch, "_weight_int8pack_mm") else 0
        self.lib = cpu_kernels.load() if c_kernels else None
        # batch-invariant mode: the C products at every row count (oneDNN's order changes with it)
        self.kernel_rows = (1 << 62) if settings.engine().batch_invariant else CPU_INT8_KERNEL_MAX_ROWS
        if self.lib is not None:
            self.name = "cpu (C)"

    def pack(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, device: torch.device) -> dict:
        if self.lib is None or cpu_kernels.dtype_code(self.lib, dtype) not in (0, 1):
            return super().pack(q, scale, dtype, device)
        s = scale.to(dtype)
        # "scale16": fp32, zero-padded to the 16-channel blocks, as linear_rows reads it
        return {"q": pack(q), "scale": s, "scale16": pack_scales(s)}

    def plain(self, packed: dict) -> torch.Tensor:
        q = packed["q"]
        if q.dim() == 2:
            return q
        return q.permute(0, 2, 1).reshape(-1, q.shape[1])[:packed["scale"].numel()]

    def mm(self, x: torch.Tensor, packed: dict) -> torch.Tensor:
        m = x.shape[0]
        if "scale16" in packed:
            q = packed["q"]
            n, k = packed["scale"].numel(), q.shape[1]
            if m <= self.kernel_rows:
                x = x.contiguous()
                out = torch.empty(m, n, dtype=x.dtype)
                if self.lib.linear_rows(1 if x.dtype == torch.bfloat16 else 0, x.data_ptr(), m, k, q.data_ptr(),
                                        packed["scale16"].data_ptr(), n, None, out.data_ptr()) != 0:
                    raise RuntimeError(f"linear_rows refused an int8 product of {m} x {k} x {n}")
                return out
            # dequantised, transposed: [K, N rounded up to 16] (padding columns are zero weights)
            wt = torch.empty(k, q.shape[0] * 16, dtype=x.dtype)
            if self.lib.int8_unpack_t(1 if x.dtype == torch.bfloat16 else 0, q.data_ptr(), q.shape[0], k,
                                      wt.data_ptr()) != 0:
                raise RuntimeError(f"int8_unpack_t refused a {q.shape[0] * 16} x {k} weight")
            return self._bucketed(x, wt, packed["scale"], n)
        # _weight_int8pack_mm reads K in blocks of 16: other widths give garbage or a segfault
        # (torch 2.13; e.g. an odd intermediate size), so those take the dequantising path.
        if m <= self.max_rows and x.shape[1] % 16 == 0:
            return torch._weight_int8pack_mm(x.contiguous(), packed["q"], packed["scale"])
        return self._bucketed(x, packed["q"].to(x.dtype).t(), packed["scale"], packed["scale"].numel())

    @staticmethod
    def _bucketed(x: torch.Tensor, wt: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
        """(x @ wt)[:, :n] * scale, the rows padded to the bf16 path's buckets so that oneDNN's
        shape-keyed caches stay bounded (workers/backends/cpu_linear.py)."""
        m = x.shape[0]
        rows = bucket_rows(m)
        if rows != m:
            padded = x.new_zeros((rows, x.shape[1]))
            padded[:m].copy_(x)
            x = padded
        return ((x @ wt)[:m, :n] * scale)


class NpuInt8Kernel(Int8Kernel):
    """``torch_npu.npu_weight_quant_batchmatmul(x, weight, antiquant_scale)``: x [M, K] fp16/bf16,
    weight int8 [K, N], antiquant_scale [N] in x's dtype; y = x @ (weight * antiquant_scale)."""

    name = "npu"
    transposed = True

    def pack(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, device: torch.device) -> dict:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"{QUANTIZE_KEY} \"w8a16\" on the NPU needs a float16 or bfloat16 model "
                             f"(ModelConfig[].dtype), not {str(dtype).replace('torch.', '')}")
        return {"q": q.t().contiguous().to(device), "scale": scale.to(device=device, dtype=dtype)}

    def mm(self, x: torch.Tensor, packed: dict) -> torch.Tensor:
        import torch_npu  # optional (the npu extra): only an NPU worker gets this kernel
        return torch_npu.npu_weight_quant_batchmatmul(x, packed["q"], packed["scale"])


class Int8Linear(nn.Module):
    """A linear layer with an int8 weight and per-output-channel scales (buffers, so they count
    in ``model.buffers()`` and follow ``.to``), bias in the model dtype."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, kernel: Int8Kernel, *,
                 quantized: tuple[torch.Tensor, torch.Tensor, torch.dtype, torch.device] | None = None):
        """From ``weight`` [N, K] (quantised here), or from ``quantized``: (int8 [N, K], fp32 scales
        [N], the model dtype, its device) made by ``quantize_weight`` already (a GGUF loaded
        straight into int8)."""
        super().__init__()
        if quantized is None:
            q, scale = quantize_weight(weight)
            dtype, device = weight.dtype, weight.device
        else:
            q, scale, dtype, device = quantized
        self.out_features, self.in_features = q.shape
        self.kernel = kernel
        packed = kernel.pack(q, scale, dtype, device)
        self._names = tuple(packed)
        for k, v in packed.items():
            self.register_buffer(k, v, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def packed_state(self) -> dict:
        return {k: getattr(self, k) for k in self._names}

    def dequantized(self) -> torch.Tensor:
        """The fp32 [N, K] weight this layer computes with."""
        return dequantize(self.kernel.plain(self.packed_state), self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = self.kernel.mm(x2, self.packed_state)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 ({self.kernel.name})"


class Int8Target:
    """What a loader that quantises while it reads (workers/models/gguf_loader.py, which sits below
    the backends and cannot import them) is handed: this module's quantisation and linear layer,
    for ``kernel``."""

    def __init__(self, kernel: Int8Kernel):
        self.kernel = kernel

    @staticmethod
    def quantize_(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``quantize_weight`` (in place: ``w`` is overwritten): per output channel, so the rows of a
        matrix may come in pieces."""
        return quantize_weight_(w)

    def linear(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
               device: torch.device) -> nn.Module:
        return Int8Linear(None, bias, self.kernel, quantized=(q, scale, dtype, device))

    def loaded(self, count: int) -> None:
        log.info("quantised %d linear layers to int8 while loading (w8a16, per-channel scales, %s kernel)", count,
                 self.kernel.name)


def quantisable_linears(model: nn.Module, include: Callable[[str], bool] | None = None
                        ) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) of every nn.Linear under ``model.layers`` and the LM head, but
    a shared expert's [1, H] gate: what a ``quantize`` scheme replaces (``include``: by full name)."""
    out = []
    for parent_name, parent in list(model.named_modules()):
        if not (parent_name == "layers" or parent_name.startswith("layers.") or parent_name == ""):
            continue
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if not isinstance(child, nn.Linear):
                continue
            if parent_name == "" and name != "lm_head":
                continue
            if name == "shared_expert_gate":  # [1, H]: a scalar gate per token, kept exact
                continue
            if include is not None and not include(full):
                continue
            out.append((parent, name, child))
    return out


def quantize_model(model: nn.Module, kernel: Int8Kernel,
                   include: Callable[[str], bool] | None = None) -> int:
    """Replace every nn.Linear under ``model.layers`` and the LM head by an Int8Linear; a tied
    head gets ``model.logits_linear`` from an int8 copy of the embedding. Returns the count."""
    count = 0
    for parent, name, child in quantisable_linears(model, include):
        setattr(parent, name, Int8Linear(child.weight, child.bias, kernel))
        count += 1
    for name, mod in list(model.named_modules()):  # mixture-of-experts layers: every expert's two matrices
        if callable(getattr(mod, "quantize_experts", None)) and (include is None or include(name)):
            count += mod.quantize_experts(lambda w: Int8Linear(w, None, kernel))
    if getattr(model, "lm_head", "absent") is None and hasattr(model, "embed_tokens") and (
            include is None or include("lm_head")):
        model.logits_linear = Int8Linear(model.embed_tokens.weight, None, kernel)
        count += 1
    log.info("quantised %d linear layers to int8 (w8a16, per-channel scales, %s kernel)", count, kernel.name)
    return count


def copy_dequantized_into(ref: nn.Module, quantised: nn.Module) -> nn.Module:
    """Make ``ref`` (the same model loaded unquantised) the exact reference of ``quantised``: each
    matrix that ``quantised`` holds in int8 is replaced by its dequantised value, and a quantised
    tied LM head gets an untied copy of its own. Returns ``ref`` (tests, scripts/int8_quality.py)."""
    qlin = {n: m for n, m in quantised.named_modules() if isinstance(m, Int8Linear)}
    with torch.no_grad():
        for n, m in ref.named_modules():
            if n in qlin:
                m.weight.copy_(qlin[n].dequantized())
        for n, m in quantised.named_modules():  # mixture-of-experts layers: stacked expert weights
            if getattr(m, "int8", False):
                r = ref.get_submodule(n)
                r.w13.copy_(torch.stack([lin.dequantized() for lin in m.lin13]))
                r.w2.copy_(torch.stack([lin.dequantized() for lin in m.lin2]))
        if "logits_linear" in qlin:  # tied: the reference computes the logits from its own copy
            ref.lm_head = nn.Linear(ref.args.hidden_size, ref.args.vocab_size, bias=False)
            ref.lm_head.weight = nn.Parameter(qlin["logits_linear"].dequantized())
    return ref


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every distinct tensor the model computes with: parameters, buffers, and tensors
    held as plain attributes (the CPU backend's oneDNN-packed weights, its tied-head copy).
    Memory two tensors share (a view, the fused decode step's int8 layers) counts once."""
    spans: dict[int, int] = {}  # start address -> end, of contiguous tensors
    opaque: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            n = t.numel() * t.element_size()
            try:
                start = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
            except (RuntimeError, NotImplementedError):  # opaque (oneDNN-packed) tensors
                opaque[id(t)] = n
                return
            spans[start] = max(spans.get(start, start), start + n)

    for m in model.modules():
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            add(t)
        for v in vars(m).values():
            add(v)
            if isinstance(v, list):  # a GgufLinear's parts: (first row, type, blocks)
                for part in v:
                    for t in part if isinstance(part, tuple) else (part,):
                        add(t)
    head = getattr(model, "logits_linear", None)
    if head is not None and not isinstance(head, nn.Module):
        for v in vars(head).values():
            add(v)
    fused = getattr(model, "fast_decode", None)  # the CPU's fused decode step keeps its own copy
    for layer in getattr(fused, "weights", None) or []:
        for v in layer.values():
            add(v)
    total, reach = 0, 0
    for start in sorted(spans):  # the union of the spans
        end = spans[start]
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total + sum(opaque.values())
