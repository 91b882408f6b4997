"""The CPU's recurrent step of the Gated DeltaNet layers (Qwen3-Next / Qwen3.5 decodes): the C
kernel ``gdn_recurrent`` (workers/kernels/cpu_kernels.c, family 6) in place of the torch
reference, attached by ``attach`` to every layer of a loaded model (``GatedDeltaNet.
recurrent_kernel``). It reads each decoding sequence's state [heads, d_k, d_v] in its pool slot
twice (one sweep for S^T k and S^T q, one in-place update) instead of the reference's ~12 torch ops
over copies of it. fp32 throughout, as the reference (the pool's recurrent state is fp32)."""
from __future__ import annotations

import ctypes
from typing import Callable

import torch
from torch import nn

from workers.kernels import cpu_kernels

__all__ = ["attach", "recurrent_step"]


def recurrent_step(lib: ctypes.CDLL) -> Callable[..., torch.Tensor]:
    """The kernel with GatedDeltaNet.recurrent_kernel's contract: (q, k [B, Hk, Dk], v [B, Hv, Dv],
    g, beta [B, Hv], state [slots, Hv, Dk, Dv] fp32 contiguous, slots [B] int64) -> out [B, Hv, Dv]
    in v's dtype; ``state[slots]`` updated in place."""

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        b, hk, dk = k.shape
        hv, dv = v.shape[1:]
        if not state.is_contiguous() or state.dtype != torch.float32:
            raise ValueError("the recurrent state must be a contiguous fp32 tensor")
        qf, kf, vf, gf, bf = (x.to(torch.float32).contiguous() for x in (q, k, v, g, beta))
        idx = slots.to(torch.int64).contiguous()
        out = torch.empty(b, hv, dv, dtype=torch.float32)
        rc = lib.gdn_recurrent(b, hk, hv, dk, dv, qf.data_ptr(), kf.data_ptr(), vf.data_ptr(), gf.data_ptr(),
                               bf.data_ptr(), state.data_ptr(), idx.data_ptr(), out.data_ptr())
        if rc != 0:
            raise ValueError(f"gdn_recurrent refused the shapes (heads {hk}/{hv}, dims {dk}/{dv}: at most 1024)")
        return out.to(v.dtype)

    return step


def attach(model: nn.Module) -> int:
    """Give every Gated DeltaNet layer of ``model`` the C recurrent step (when the kernels build
    and its dims fit the kernel's buffers); returns how many layers got it."""
    lib = cpu_kernels.load()
    if lib is None:
        return 0
    step = recurrent_step(lib)
    count = 0
    for m in model.modules():
        hy = getattr(m, "hy", None)
        if hasattr(m, "recurrent_kernel") and hy is not None and max(hy.head_k_dim, hy.head_v_dim) <= 1024:
            m.recurrent_kernel = step
            count += 1
    return count
