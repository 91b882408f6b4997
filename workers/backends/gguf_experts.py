"""A mixture-of-experts layer's routed experts in one C call over their GGUF blocks (the CPU).

A GGUF file loaded native keeps every expert in the file's blocks (workers/models/gguf_loader.py:
``SparseMoE.install_experts`` with ``GgufLinear`` gate-up and down linears, never dequantised).
``SparseMoE.experts_forward`` would then run two ``GgufLinear`` calls, a SwiGLU and an ``index_add_``
per activated expert: a decode step of a 48-layer, top-8 model makes ~800 such calls per token,
and at a few rows each the calls, not the products, set the pace. ``attach`` gives such a layer
``fused_experts`` = ``GgufExperts``: gguf_kernels.c's ``gguf_moe`` quantises the step's rows once,
computes each activated expert's rows as tasks over the cores (gate and up, SwiGLU, down) and sums
each token's experts in ascending id, rounding as ``experts_forward`` does over those linears; a
token's result does not depend on the other tokens of the step (batch-invariant as the products).
"""
from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from workers.backends.cpu_fused import silu_table
from workers.backends.gguf_linear import CParts, c_parts
from workers.kernels import gguf_kernels

log = logging.getLogger("workers.backends")

class GgufExperts:
    """``SparseMoE.fused_experts`` for experts held in GGUF blocks (``experts_kind == "gguf"``)."""

    def __init__(self, moe: nn.Module, lib: ctypes.CDLL, w13: list[CParts], w2: list[CParts]):
        self.lib = lib
        self.experts = len(w13)
        self.w13 = (CParts * self.experts)(*w13)  # the ctypes arrays point at the linears' blocks: kept with them
        self.w2 = (CParts * self.experts)(*w2)
        self.inter, self.hidden = moe.shard.inter, moe.hidden
        self.table = silu_table()
        self.calls = 0  # steps computed here (tests read it)

    def __call__(self, moe: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or x.shape[1] != self.hidden:
            return moe.experts_forward(x, weights, ids)
        x = x.contiguous()
        ids = ids.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        out = torch.empty_like(x)
        if self.lib.gguf_moe(int(x.dtype == torch.bfloat16), x.shape[0], self.hidden, self.inter, ids.shape[1],
                             x.data_ptr(), ids.data_ptr(), weights.data_ptr(), self.experts, self.w13, self.w2,
                             self.table.data_ptr(), out.data_ptr()) != 0:
            return moe.experts_forward(x, weights, ids)  # a shape the kernel does not take
        self.calls += 1
        return out


def attach(model: nn.Module) -> int:
    """``fused_experts`` for every mixture layer whose experts are GGUF block linears, all of this
    rank's experts (a whole layer), with gguf_kernels.c built; returns how many layers got it."""
    lib = None
    count = 0
    for mod in model.modules():
        if getattr(mod, "experts_kind", "") != "gguf" or mod.lin13 is None or mod.fused_experts is not None:
            continue
        if mod.shard.experts != mod.num_experts:
            continue  # a rank's slice of the experts: ids would need the offset (native loads are whole)
        lib = lib or gguf_kernels.load()
        if lib is None:
            return 0
        w13 = [c_parts(lin) for lin in mod.lin13]
        w2 = [c_parts(lin) for lin in mod.lin2]
        if any(w is None for w in w13 + w2):
            continue
        mod.fused_experts = GgufExperts(mod, lib, w13, w2)
        count += 1
    if count:
        log.info("GGUF experts: %d mixture layers' routed experts in one C call each over their blocks", count)
    return count
