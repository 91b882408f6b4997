"""RMSNorm and rotary embedding as single C kernels (cpu_kernels.c) for the CPU backend.

In eager torch an RMSNorm is about seven small ops and a rope about eight; at the batch sizes
of decoding each op costs more in dispatch than in arithmetic (together 15-25 % of a step for
the ~30M benchmark model, docs/performance.md). The kernels do each in one pass and round like
transformers' eager code op by op (RMSNorm statistics in fp32; rope products and sums rounded
to the activation type), so outputs match it. The rope rotates q and k in place inside the
fused qkv projection's output. Layouts the kernels do not cover fall back to the torch code.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from workers.kernels import cpu_kernels
from workers.models.llama import RMSNorm, RotaryEmbedding

log = logging.getLogger("workers.backends")


class CpuRMSNorm(nn.Module):
    def __init__(self, norm: RMSNorm, lib):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self.fallback = norm
        self.lib = lib

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        code = cpu_kernels.dtype_code(self.lib, x.dtype)
        c = x.shape[-1]
        if x.dim() == 2 and x.stride(1) == 1:
            rows, stride = x, x.stride(0)
        elif x.is_contiguous():
            rows, stride = x.view(-1, c), c
        else:
            return self.fallback(x)
        if code is None or self.weight.dtype != x.dtype or not self.weight.is_contiguous() or self.weight.numel() != c:
            return self.fallback(x)
        out = torch.empty(x.shape, dtype=x.dtype)
        if self.lib.rms_norm(code, rows.data_ptr(), stride, self.weight.data_ptr(), out.data_ptr(), rows.shape[0],
                             c, self.eps) != 0:
            return self.fallback(x)
        return out


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


def fuse_model(model: nn.Module) -> int:
    """Swap the model's RMSNorms and rope for the C versions; returns how many modules changed."""
    lib = cpu_kernels.load()
    if lib is None:
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, RMSNorm):
                setattr(parent, name, CpuRMSNorm(child, lib))
                count += 1
    rope = getattr(model, "rope", None)
    if isinstance(rope, RotaryEmbedding):
        model.rope = CpuRotaryEmbedding(rope, lib)
        count += 1
    log.info("fused C kernels for %d norm/rope modules", count)
    return count
