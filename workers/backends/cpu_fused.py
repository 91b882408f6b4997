"""RMSNorm, rotary embedding and (bf16) SwiGLU / GeGLU as single C kernels (cpu_kernels.c) for the CPU backend.

In eager torch an RMSNorm is about seven small ops and a rope about eight; at the batch sizes
of decoding each op costs more in dispatch than in arithmetic (together 15-25 % of a step for
the ~30M benchmark model, docs/performance.md). The kernels do each in one pass and round like
transformers' eager code op by op (RMSNorm statistics in fp32; rope products and sums rounded
to the activation type), so outputs match it. The rope rotates q and k in place inside the
fused qkv projection's output. SwiGLU in bf16 reads torch's own silu results from a table and
equals ``F.silu(gate) * up`` bit for bit in one pass (in a prompt step the two bf16 ops cost about
a seventh of the 40M benchmark model's time); Gemma's GeGLU the same way from a gelu table.
Layouts the kernels do not cover fall back to the torch code.
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from workers.kernels import cpu_kernels
from workers.models.gemma import GemmaMLP, GemmaRMSNorm, LayerRopes
from workers.models.llama import MLP, RMSNorm, RotaryEmbedding

log = logging.getLogger("workers.backends")


class CpuRMSNorm(nn.Module):
    """RMSNorm as one C kernel (rms_norm). Rows of other layouts (Qwen3's per-head q/k norms over a
    view of the fused projection) are copied into place for it rather than left to torch: the
    fused decode step norms them with the same code, so prompt and decode rows agree bit for bit,
    and torch's rsqrt rounds the tail of its loop otherwise than the body (batch-invariant mode)."""

    def __init__(self, norm: nn.Module, lib):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self.fallback = norm
        self.lib = lib

    def covers(self, x: torch.Tensor, c: int) -> bool:
        """The kernel's weight fits rows of ``x`` (``c`` wide)."""
        return self.weight.dtype == x.dtype and self.weight.is_contiguous() and self.weight.numel() == c

    def kernel(self, code: int, rows: torch.Tensor, stride: int, out: torch.Tensor, c: int) -> int:
        return self.lib.rms_norm(code, rows.data_ptr(), stride, self.weight.data_ptr(), out.data_ptr(), rows.shape[0],
                                 c, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        code = cpu_kernels.dtype_code(self.lib, x.dtype)
        c = x.shape[-1]
        if x.dim() == 2 and x.stride(1) == 1:
            rows, stride = x, x.stride(0)
        elif x.is_contiguous():
            rows, stride = x.view(-1, c), c
        else:
            x = x.contiguous()
            rows, stride = x.view(-1, c), c
        if code is None or not self.covers(x, c):
            return self.fallback(x)
        out = torch.empty(x.shape, dtype=x.dtype)
        if self.kernel(code, rows, stride, out, c) != 0:
            return self.fallback(x)
        return out


def one_plus(weight: torch.Tensor) -> torch.Tensor:
    """Gemma's norm weight as the C kernels read it: 1 + w in fp32 (rms_row's w1), made once."""
    return (1.0 + weight.detach().float()).contiguous()


class CpuGemmaRMSNorm(CpuRMSNorm):
    """Gemma's RMSNorm (scaled by 1 + w in fp32, one rounding) as one C kernel (rms_norm_w1): a
    Gemma 3 decode step runs six per layer (four around the blocks, q and k), ~15 µs each in torch's
    eleven ops. The 1 + w vector is made once, in fp32, from the loaded weight."""

    def __init__(self, norm: GemmaRMSNorm, lib):
        super().__init__(norm, lib)
        self.w1 = one_plus(norm.weight)

    def covers(self, x: torch.Tensor, c: int) -> bool:
        return self.w1.numel() == c

    def kernel(self, code: int, rows: torch.Tensor, stride: int, out: torch.Tensor, c: int) -> int:
        return self.lib.rms_norm_w1(code, rows.data_ptr(), stride, self.w1.data_ptr(), out.data_ptr(),
                                    rows.shape[0], c, self.eps)


class CpuRotaryEmbedding(RotaryEmbedding):
    """The model's rope with the same fp32 tables, rotating in place."""

    def __init__(self, rope: RotaryEmbedding, lib):
        nn.Module.__init__(self)
        self.cos, self.sin = rope.cos.contiguous(), rope.sin.contiguous()
        self.max_positions = rope.max_positions
        self._key, self._rows = (None, None), ()
        self.lib = lib

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        code = cpu_kernels.dtype_code(self.lib, x.dtype)
        if (code is None or x.dim() != 3 or x.stride(2) != 1
                or x.stride(1) != x.shape[2] or x.shape[2] != 2 * self.cos.shape[1]
                or positions.dtype != torch.long or not positions.is_contiguous()
                or positions.numel() != x.shape[0] or self.cos.dtype != torch.float32
                or self.cos.device.type != "cpu"):
            return super().rotate(positions, x)
        rc = self.lib.rope_inplace(code, x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], x.shape[2],
                                   positions.data_ptr(), self.cos.data_ptr(), self.sin.data_ptr(), self.max_positions)
        if rc != 0:
            raise IndexError(f"rope: a position is outside the table of {self.max_positions} positions")
        return x


def _bf16_table(fn) -> torch.Tensor:
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    table = fn(every).view(torch.int16).roll(-32768)
    return torch.cat([table, table.new_zeros(2)])


@functools.cache
def silu_table() -> torch.Tensor:
    """torch's bf16 silu of every bf16 value, indexed by its bits (int16 [65536 + 2]): the two
    spare entries let a kernel's 4-byte vector gather read the last one. Built once per process
    (read-only: the fused step, the MLPs and batch-invariant mode's hook share it)."""
    return _bf16_table(torch.nn.functional.silu)


@functools.cache
def gelu_table() -> torch.Tensor:
    """As ``silu_table``, of torch's gelu with the tanh approximation (Gemma's GeGLU)."""
    return _bf16_table(lambda v: torch.nn.functional.gelu(v, approximate="tanh"))


def c_swiglu(lib, gate_up: torch.Tensor, inter: int, gelu: bool = False) -> torch.Tensor | None:
    """``silu(gate) * up`` (``gelu``: Gemma's GeGLU, gelu with the tanh approximation) of ``[gate |
    up]`` columns [M, 2 * inter] as one C pass (``silu_mul_f32`` / ``gelu_mul_f32`` or
    ``silu_mul_bf16`` over a table: the fused decode step's arithmetic), or None where the kernels
    do not cover the input (another dtype or layout) and the caller keeps torch's."""
    dt = gate_up.dtype
    if (dt not in (torch.bfloat16, torch.float32) or gate_up.dim() != 2 or gate_up.shape[1] != 2 * inter
            or gate_up.stride(1) != 1):
        return None
    out = torch.empty((gate_up.shape[0], inter), dtype=dt)
    if dt == torch.float32:
        rc = (lib.gelu_mul_f32 if gelu else lib.silu_mul_f32)(gate_up.data_ptr(), gate_up.shape[0], inter,
                                                               gate_up.stride(0), out.data_ptr())
    else:
        rc = lib.silu_mul_bf16(gate_up.data_ptr(), gate_up.shape[0], inter, gate_up.stride(0),
                               (gelu_table() if gelu else silu_table()).data_ptr(), out.data_ptr())
    return None if rc != 0 else out


class CpuSwiGLU:
    """An MLP's ``swiglu`` (``gelu``: a Gemma MLP's ``geglu``) for bf16 activations as one C pass
    (torch's silu / gelu from a table, the same bits; ``fp32``: fp32 ones too, the fused decode
    step's arithmetic: batch-invariant mode, workers/backends/cpu_invariant.py); other inputs keep
    torch's."""

    def __init__(self, mlp: MLP | GemmaMLP, lib, fp32: bool = False, gelu: bool = False):
        self.torch_glu = mlp.geglu if gelu else mlp.swiglu
        self.size = mlp.intermediate_size
        self.lib, self.fp32, self.gelu = lib, fp32, gelu

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = None
        if gate_up.dtype == torch.bfloat16 or self.fp32:
            out = c_swiglu(self.lib, gate_up, self.size, gelu=self.gelu)
        return self.torch_glu(gate_up) if out is None else out


def fuse_model(model: nn.Module, invariant: bool = False) -> int:
    """Swap the model's RMSNorms, rope and bf16 SwiGLU / GeGLU for the C versions (``invariant``:
    batch-invariant mode, fp32 SwiGLU too, on every build); returns how many modules changed."""
    lib = cpu_kernels.load()
    if lib is None:
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, RMSNorm):
                setattr(parent, name, CpuRMSNorm(child, lib))
                count += 1
            elif isinstance(child, GemmaRMSNorm):
                setattr(parent, name, CpuGemmaRMSNorm(child, lib))
                count += 1
    rope = getattr(model, "rope", None)
    if isinstance(rope, RotaryEmbedding):
        model.rope = CpuRotaryEmbedding(rope, lib)
        count += 1
    elif isinstance(rope, LayerRopes):  # Gemma's: one rope per layer kind
        local_same = rope.local is rope.glob
        rope.glob = CpuRotaryEmbedding(rope.glob, lib)
        rope.local = rope.glob if local_same else CpuRotaryEmbedding(rope.local, lib)
        count += 1 + (not local_same)
    mlps = [m for m in model.modules() if isinstance(m, (MLP, GemmaMLP))]
    if mlps and (lib.has_avx512 or invariant):  # bf16 activations (fp32 too in invariant mode)
        for m in mlps:
            if isinstance(m, GemmaMLP):
                m.geglu = CpuSwiGLU(m, lib, invariant, gelu=True)
            else:
                m.swiglu = CpuSwiGLU(m, lib, invariant)
            count += 1
    log.info("fused C kernels for %d norm/rope/swiglu modules", count)
    return count
