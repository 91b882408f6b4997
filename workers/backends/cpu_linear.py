"""oneDNN-prepacked linear layers for the CPU backend.

torch's ``F.linear`` on CPU hands oneDNN a plain row-major weight on every call; packing the
weight once into oneDNN's blocked layout (what torch.compile's CPU "freezing" does) makes the
small-batch matmuls of decoding 1.3-2x faster here (docs/performance.md). The packed weight
replaces the original, so memory does not grow, except for a tied embedding, whose plain
copy the embedding lookup still needs. Where oneDNN cannot pack a dtype on this CPU (fp16
without AVX-NE-CONVERT / AMX-FP16), the layer keeps ``F.linear``.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("workers.backends")


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except (RuntimeError, AttributeError):
        return None


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
                   ) -> torch.Tensor:
    if x.dim() != 2:
        return _packed_linear(x.reshape(-1, x.shape[-1]), packed, bias, out_features).reshape(
            *x.shape[:-1], out_features)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, packed: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = packed
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_linear(x, self.packed, self.bias, self.out_features)


def pack_linears(model: nn.Module) -> int:
    """Swap every nn.Linear of ``model`` for a PackedLinear (and pack the tied LM head)."""
    if not torch.backends.mkldnn.is_available():
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                packed = _pack(child.weight)
                if packed is not None:
                    setattr(parent, name, PackedLinear(child, packed))
                    count += 1
    head = getattr(model, "lm_head", None)
    if head is None and hasattr(model, "embed_tokens"):
        packed = _pack(model.embed_tokens.weight)
        if packed is not None:
            vocab = model.embed_tokens.weight.shape[0]
            model.logits_linear = lambda h: _packed_linear(h, packed, None, vocab)
            count += 1
    log.info("packed %d linear layers for oneDNN", count)
    return count
