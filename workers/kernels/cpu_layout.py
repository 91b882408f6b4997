"""The C kernels' weight layout: 16 output channels per vector (cpu_kernels.c ``gemv_group``).

Shared by the int8 linears of the CPU backend (workers/backends/int8.py keeps its weights in it)
and the fused decode step (workers/backends/cpu_decode.py reads those same tensors, or packs its
own copy of plain weights).
"""
from __future__ import annotations

import torch


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A [N, K] weight in the kernel's layout: 16 output channels per vector, fp32 and int8
    [N/16, K, 16], bf16 [N/16, K/2, 16, 2] (pairs of K), zero-padded (cpu_kernels.c ``gemv_group``)."""
    w = weight.detach()
    n, k = w.shape
    nb = -(-n // 16)
    if w.dtype == torch.bfloat16:
        kp = -(-k // 2)
        padded = w.new_zeros((nb * 16, kp * 2))
        padded[:n, :k] = w
        return padded.view(nb, 16, kp, 2).permute(0, 2, 1, 3).contiguous()
    padded = w.new_zeros((nb * 16, k))
    padded[:n] = w
    return padded.view(nb, 16, k).permute(0, 2, 1).contiguous()


def pack_scales(scale: torch.Tensor) -> torch.Tensor:
    """An int8 layer's per-channel scales as the kernel reads them: fp32, padded to 16 with zeros."""
    n = scale.numel()
    out = torch.zeros(-(-n // 16) * 16, dtype=torch.float32)
    out[:n] = scale.detach().float()
    return out
