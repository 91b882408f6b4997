"""The NPU's mixture-of-experts step: torch_npu's fused MoE ops behind ``SparseMoE``'s interface
(workers/models/moe.py), the ops MindIE's own MoE models call.

Exercised: nothing here has run on an NPU in this project (no Ascend hardware); it runs on CPU in
tests/test_moe.py against a fake ``torch_npu`` whose ops are pure-torch references of the
contracts below, and must agree with the CPU path (``SparseMoE.experts_forward``), which stays
the tested reference. ``shared/reference/torch-npu.md`` does not describe these ops; the
contracts are torch_npu's API documentation (Ascend "torch_npu" custom operator list):

- ``npu_moe_gating_top_k_softmax(x [T, E], finished=None, k) -> (y [T, k], expert_idx [T, k]
  int32, row_idx [T, k] int32)``: softmax over the experts, the k largest, and
  ``row_idx[t, j] = j * T + t`` (the routing ops' source-row numbering). The routing of
  Qwen2/3-MoE and Mixtral (renormalised here when the model says so);
- ``npu_moe_init_routing(x [T, H], row_idx, expert_idx, active_num) -> (expanded_x [T*k, H],
  expanded_row_idx [T*k] int32, expanded_expert_idx [T*k] int32)``: the rows copied k times and
  sorted by expert (stable), ``expanded_row_idx[src] = dst`` for ``src = j * T + t``;
- ``npu_moe_compute_expert_tokens(expanded_expert_idx, num_experts) -> [E] int64``: cumulative
  rows per expert (the ``group_list`` of the grouped product);
- ``npu_grouped_matmul([x], [w [E, K, N]], group_list=..., split_item=2, group_type=0,
  group_list_type=0, antiquant_scale=[s [E, N]] for int8 w) -> [y [rows, N]]``: expert e's
  rows times its own weight, one kernel for all experts (the int8 variant dequantises inside);
- ``npu_swiglu(x [rows, 2I], dim=-1) -> silu(x[:, :I]) * x[:, I:]``;
- ``npu_moe_finalize_routing(expanded_permuted_rows [T*k, H], skip1, skip2, bias, scales [T, k],
  expanded_src_to_dst_row, export_for_source_row) -> [T, H]``: ``out[t] = sum_j scales[t, j] *
  rows[expanded_src_to_dst_row[j * T + t]]`` (skips and bias None).

DeepSeek's grouped routing has its own op (``npu_moe_gating_top_k``), supplied with its router.
Expert parallelism (a rank holding a slice of the experts) keeps the CPU reference path: the
routing ops number every expert, and the grouped product would need the foreign rows dropped.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("workers.backends")

OPS = ("npu_moe_gating_top_k_softmax", "npu_moe_init_routing", "npu_moe_compute_expert_tokens",
       "npu_grouped_matmul", "npu_swiglu", "npu_moe_finalize_routing")


class NpuSoftmaxRouter(nn.Module):
    """``SoftmaxTopKRouter`` through ``npu_moe_gating_top_k_softmax`` (same weight, same result)."""

    def __init__(self, router: nn.Module, torch_npu) -> None:
        super().__init__()
        self.weight = router.weight
        self.top_k = router.top_k
        self.norm_topk_prob = router.norm_topk_prob
        self._npu = torch_npu

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.nn.functional.linear(x, self.weight).float()
        weights, ids, _rows = self._npu.npu_moe_gating_top_k_softmax(logits, None, k=self.top_k)
        weights = weights.float()
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids.long()


class NpuGroupedExperts:
    """``SparseMoE.fused_experts`` on the NPU: weights laid out once as [E, K, N] (the grouped
    product's layout), int8 experts with their per-channel scales as ``antiquant_scale``."""

    def __init__(self, moe: nn.Module, torch_npu) -> None:
        self._npu = torch_npu
        self.num_experts = moe.shard.experts
        if moe.int8:
            # NpuInt8Kernel keeps each int8 weight transposed ([K, N]) with scales in the model dtype
            self.w13 = torch.stack([lin.q for lin in moe.lin13])
            self.w2 = torch.stack([lin.q for lin in moe.lin2])
            self.s13 = [torch.stack([lin.scale for lin in moe.lin13])]
            self.s2 = [torch.stack([lin.scale for lin in moe.lin2])]
        else:
            self.w13 = moe.w13.detach().transpose(1, 2).contiguous()  # [E, H, 2I]
            self.w2 = moe.w2.detach().transpose(1, 2).contiguous()  # [E, I, H]
            self.s13 = self.s2 = None

    def _mm(self, x: torch.Tensor, w: torch.Tensor, scale, groups: torch.Tensor) -> torch.Tensor:
        return self._npu.npu_grouped_matmul([x], [w], antiquant_scale=scale, group_list=groups, split_item=2,
                                            group_type=0, group_list_type=0)[0]

    def __call__(self, moe: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        npu = self._npu
        t, k = ids.shape
        ids32 = ids.to(torch.int32)
        row_idx = torch.arange(t * k, dtype=torch.int32, device=x.device).view(k, t).t().contiguous()
        rows, src_to_dst, sorted_ids = npu.npu_moe_init_routing(x, row_idx, ids32, active_num=t)
        groups = npu.npu_moe_compute_expert_tokens(sorted_ids, self.num_experts)
        h = npu.npu_swiglu(self._mm(rows, self.w13, self.s13, groups), dim=-1)
        y = self._mm(h, self.w2, self.s2, groups)
        return npu.npu_moe_finalize_routing(y, None, None, None, weights.to(x.dtype), src_to_dst, ids32)


def attach(model: nn.Module, torch_npu=None) -> int:
    """Route every SparseMoE of ``model`` whose experts this rank holds all of through the fused
    ops (``fused_experts``; the softmax router too where it is the default one). Returns how many
    layers; none where this torch_npu lacks one of ``OPS`` (logged)."""
    if torch_npu is None:
        import torch_npu  # optional (the npu extra): only an NPU worker calls this
    missing = [op for op in OPS if not hasattr(torch_npu, op)]
    layers = [m for m in model.modules() if hasattr(m, "experts_forward") and hasattr(m, "fused_experts")]
    if not layers:
        return 0
    if missing:
        log.warning("MoE layers on the portable torch path: this torch_npu has no %s", ", ".join(missing))
        return 0
    from workers.models.moe import SoftmaxTopKRouter
    n = 0
    for moe in layers:
        if moe.shard.experts != moe.shard.total:
            continue  # expert parallelism: the reference path (see the module docstring)
        moe.fused_experts = NpuGroupedExperts(moe, torch_npu)
        if type(moe.gate) is SoftmaxTopKRouter:
            moe.gate = NpuSoftmaxRouter(moe.gate, torch_npu)
        n += 1
    log.info("MoE: %d of %d layers on torch_npu's fused routing and grouped products", n, len(layers))
    return n
