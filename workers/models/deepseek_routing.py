"""DeepSeek's expert routing: the router callable a sparse MoE layer takes,
``(hidden [T, H]) -> (weights [T, k] fp32, ids [T, k])``.

- V2 (``scoring`` softmax): softmax over the experts' logits; ``greedy`` takes the top k,
  ``group_limited_greedy`` first keeps the ``topk_group`` groups (of ``n_group``) with the best
  single expert score, then the top k among their experts;
- V3 (``noaux_tc``, sigmoid): sigmoid scores; the choice adds ``e_score_correction_bias`` (the
  load-balancing bias, used to choose, not to weigh), a group's score is the sum of its two best
  biased scores, the best ``topk_group`` groups are kept, the top k of their experts are chosen and
  weighed by their unbiased scores;
- then ``norm_topk_prob`` (weights divided by their sum + 1e-20) and ``routed_scaling_factor``.

The arithmetic is transformers 5.24's DeepseekV2TopkRouter / DeepseekV3TopkRouter, in fp32 (the
gate's weight is kept in fp32 whatever the model dtype, as transformers keeps it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import row_ops
from .deepseek_config import DeepseekArgs

__all__ = ["DeepseekRouter"]


class DeepseekRouter(nn.Module):
    """The gate of one DeepSeek MoE layer: ``weight`` [E, hidden] and (V3) ``e_score_correction_bias`` [E]."""

    def __init__(self, ds: DeepseekArgs, hidden_size: int) -> None:
        super().__init__()
        e = ds.n_routed_experts
        self.weight = nn.Parameter(torch.empty(e, hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(e, dtype=torch.float32), requires_grad=False)
                                        if ds.scoring == "sigmoid" else None)
        self.top_k, self.n_group, self.topk_group = ds.num_experts_per_tok, ds.n_group, ds.topk_group
        self.method, self.scoring = ds.topk_method, ds.scoring
        self.norm, self.scale, self.version = ds.norm_topk_prob, ds.routed_scaling_factor, ds.version

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = row_ops.matmul(hidden.float(), self.weight.float().t())
        t, e = logits.shape
        if self.scoring == "sigmoid":  # V3: noaux_tc
            scores = row_ops.elementwise(torch.sigmoid, logits)
            choice = scores + self.e_score_correction_bias
            groups = choice.view(t, self.n_group, e // self.n_group).topk(2, dim=-1)[0].sum(dim=-1)
            choice = choice.masked_fill(~self._group_mask(groups, e), float("-inf"))
            ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
        else:  # V2: softmax, greedy or group_limited_greedy
            scores = logits.softmax(dim=-1, dtype=torch.float32)
            if self.method == "group_limited_greedy":
                groups = scores.view(t, self.n_group, e // self.n_group).max(dim=-1).values
                scores = scores.masked_fill(~self._group_mask(groups, e), 0.0)
            weights, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        if self.norm and (self.version == 3 or self.top_k > 1):
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids

    def _group_mask(self, group_scores: torch.Tensor, e: int) -> torch.Tensor:
        """[T, E] bool: the experts of each token's ``topk_group`` best groups."""
        idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, idx, True)
        return mask.unsqueeze(-1).expand(-1, self.n_group, e // self.n_group).reshape(-1, e)
