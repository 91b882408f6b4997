"""Gemma 4's MoE block (``enable_moe_block``): routed experts beside every layer's dense MLP, op for
op as transformers 5.25's ``Gemma4TextRouter`` / ``Gemma4TextExperts``.

- the router reads the layer's residual (not the MLP's normed input): a weightless RMSNorm, times
  ``scale`` and hidden ** -0.5, ``proj``, softmax in fp32, top-k, renormalised, each weight times its
  expert's ``per_expert_scale``;
- the experts read ``pre_feedforward_layernorm_2(residual)``: GeGLU experts over the stacked
  ``gate_up_proj`` [E, 2I, H] (rows [gate; up]) and ``down_proj`` [E, H, I], summed by workers/models/moe.py's
  ``SparseMoE.experts_forward`` (experts in ascending order, an expert no token picked never read).

``Gemma4MoE.forward(residual)`` returns the experts' sum; the layer (workers/models/gemma4.py) adds
``post_feedforward_layernorm_2`` of it to ``post_feedforward_layernorm_1`` of the MLP's output.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import row_ops
from .gemma import _geglu
from .llama import Linear
from .moe import SparseMoE

__all__ = ["Gemma4MoE", "Gemma4Router", "moe_slots"]


class Gemma4Router(nn.Module):
    """x [T, H] -> (weights [T, k] fp32, expert ids [T, k]) (module docstring)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm: nn.Module, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.norm, self.top_k, self.root = norm, top_k, hidden ** -0.5
        self.proj = Linear(hidden, num_experts, bias=False, dtype=dtype)
        self.scale = nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts, dtype=dtype))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(x) * self.scale * self.root
        probs = F.softmax(self.proj(h), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4MoE(SparseMoE):
    """SparseMoE with GeGLU experts and Gemma 4's router (``gate``), routed on the residual."""

    def expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """Local expert ``e``'s GeGLU on rows h [n, H]."""
        i = self.shard.inter
        gate, up = (self.lin13[e](h) if self.lin13 is not None else F.linear(h, self.w13[e])).split(i, dim=-1)
        y = row_ops.rowwise(_geglu, gate, up)
        return self.lin2[e](y) if self.lin2 is not None else F.linear(y, self.w2[e])

    def route(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The experts' sum over x [T, H] (the normed residual), routed on ``residual``."""
        weights, ids = self.gate(residual)
        return self.experts_forward(x, weights, ids)


def moe_slots(moe: Gemma4MoE, pre: str, slot) -> dict[str, object]:
    """loader.Slot of one layer's router and stacked experts (``slot``: loader.Slot)."""
    r = moe.gate
    return {f"{pre}router.proj.weight": slot(r.proj.weight, 0, r.proj.weight.shape[0]),
            f"{pre}router.scale": slot(r.scale, 0, r.scale.shape[0]),
            f"{pre}router.per_expert_scale": slot(r.per_expert_scale, 0, r.per_expert_scale.shape[0]),
            f"{pre}experts.gate_up_proj": slot(moe.w13, 0, moe.w13.shape[0]),
            f"{pre}experts.down_proj": slot(moe.w2, 0, moe.w2.shape[0])}
