"""A sparse mixture-of-experts feed-forward block (Qwen2-MoE, Qwen3-MoE, Mixtral; DeepSeek's
router plugs into it), in plain torch.

``SparseMoE(x [T, H]) -> [T, H]``:

1. the router (``router(x) -> (weights [T, k] fp32, ids [T, k] int64)``; ``SoftmaxTopKRouter``
   by default, any callable module with the same contract, e.g. DeepSeek's grouped sigmoid
   router, in its place) picks ``k`` experts per token and their weights;
2. ``experts_forward(x, weights, ids)``: the token rows are sorted by expert and each activated
   expert runs ONE SwiGLU product over its own rows (``down(silu(gate(x)) * up(x))``), scaled by
   the rows' weights and added back into the token order. An expert no token picked is not
   touched, so a decode step reads the weights of the activated experts only;
3. an optional shared expert (a dense SwiGLU every token goes through), optionally scaled by a
   sigmoid gate ``sigmoid(x @ shared_expert_gate.T)`` (Qwen2-MoE);
4. with tensor parallelism, one all-reduce (``reduce``) sums the ranks' partial outputs of the
   routed and shared experts together.

Expert weights are stacked: ``w13`` [E_local, 2 * I_local, H] (rows [gate; up], as the dense MLP's
gate_up_proj) and ``w2`` [E_local, H, I_local]. A rank holds experts ``expert0 ..
expert0 + E_local`` (expert parallelism: a slice of the experts, each whole) with columns
``inter0 .. inter0 + I_local`` of each (expert tensor parallelism: every expert, a slice of its
intermediate size); ``MoeShard`` says which. ``quantize_experts`` turns the stacked weights into
per-expert int8 linears (w8a16, workers/backends/int8.py), and a GGUF file's experts loaded native
are per-expert block linears from the start (``install_experts``; workers/models/gguf_loader.py,
never dequantised), which ``experts_forward`` runs the same way.

Numerics follow transformers (``Qwen2MoeSparseMoeBlock``, ``MixtralSparseMoeBlock``): router
logits in the model dtype, softmax in fp32, top-k, optional renormalisation; experts visited in
ascending order, each one's contribution ``index_add``-ed into a zero output.

The checkpoint names are described by ``ExpertNames`` (``QWEN_NAMES``: ``mlp.experts.{e}.
gate_proj/up_proj/down_proj``; ``MIXTRAL_NAMES``: ``block_sparse_moe.experts.{e}.w1/w3/w2``;
``DEEPSEEK_NAMES``: Qwen's with ``shared_experts``); ``expected_tensors`` and ``slots`` give the
checkpoint side and where each tensor goes (workers/models/checkpoint.py, loader.py call them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import row_ops
# The checkpoint names live in a torch-free module (the launch step checks headers without torch).
from .moe_names import DEEPSEEK_NAMES, MIXTRAL_NAMES, QWEN_NAMES, ExpertNames, expected_tensors

__all__ = ["DEEPSEEK_NAMES", "ExpertNames", "MIXTRAL_NAMES", "MoeShard", "QWEN_NAMES", "SoftmaxTopKRouter",
           "SparseMoE", "SwiGLU", "expected_tensors", "slots"]

Router = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class _Linear(nn.Linear):
    """nn.Linear without random init (the checkpoint overwrites it; see llama.Linear)."""

    def reset_parameters(self) -> None:
        pass


class SwiGLU(nn.Module):
    """A dense SwiGLU feed-forward (the shared expert): gate and up fused (rows [gate; up]).
    Same attribute names as the dense MLP, so int8 quantisation and the CPU backend's packing
    treat its linears like any other."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.intermediate_size = inter
        self.gate_up_proj = _Linear(hidden, 2 * inter, bias=False, dtype=dtype)
        self.down_proj = _Linear(inter, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(row_ops.swiglu(self.gate_up_proj(x), self.intermediate_size))


class SoftmaxTopKRouter(nn.Module):
    """Qwen2/3-MoE and Mixtral routing: ``softmax(x @ weight.T)`` in fp32, the ``top_k`` largest,
    renormalised to sum 1 when ``norm_topk_prob`` (Mixtral always). ``weight`` [E, H] is the
    checkpoint's ``gate.weight``."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 dtype: torch.dtype | None) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, expert ids [T, k] int64)."""
        probs = torch.softmax(row_ops.matmul(x, self.weight.t()).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


@dataclass(frozen=True)
class MoeShard:
    """The experts one rank holds: experts ``expert0 .. expert0 + experts`` (of ``total``),
    intermediate columns ``inter0 .. inter0 + inter`` of each, and columns ``shared0 .. shared0 +
    shared_inter`` of the shared expert (always split tensor-parallel: it is dense)."""

    total: int
    expert0: int
    experts: int
    inter0: int
    inter: int
    shared0: int = 0
    shared_inter: int = 0

    @classmethod
    def whole(cls, num_experts: int, inter: int, shared_inter: int = 0) -> "MoeShard":
        return cls(num_experts, 0, num_experts, 0, inter, 0, shared_inter)

    @classmethod
    def plan(cls, num_experts: int, inter: int, shared_inter: int, rank: int, world: int, mode: str) -> "MoeShard":
        """Rank ``rank`` of ``world``: ``mode`` "ep" splits the experts (``num_experts % world ==
        0``), "tp" splits every expert's intermediate size (``inter % world == 0``). The shared
        expert's intermediate size must divide by ``world`` either way. ValueError naming the
        size that does not divide."""
        if shared_inter % world:
            raise ValueError(f"shared expert intermediate size {shared_inter} is not a multiple of {world}")
        s = shared_inter // world
        if mode == "ep":
            if num_experts % world:
                raise ValueError(f"{num_experts} experts are not a multiple of {world} (expert parallelism)")
            e = num_experts // world
            return cls(num_experts, rank * e, e, 0, inter, rank * s, s)
        if mode != "tp":
            raise ValueError(f"unknown MoE parallel mode {mode!r} (tp or ep)")
        if inter % world:
            raise ValueError(f"expert intermediate size {inter} is not a multiple of {world} (expert tensor parallelism)")
        i = inter // world
        return cls(num_experts, 0, num_experts, rank * i, i, rank * s, s)


class SparseMoE(nn.Module):
    """Routed experts (+ optional shared expert) of one layer; see the module docstring."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, inter: int, dtype: torch.dtype | None, *,
                 norm_topk_prob: bool = True, router: nn.Module | None = None, shared_inter: int = 0,
                 shared_gate: bool = False, shard: MoeShard | None = None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """``inter``/``shared_inter``: the checkpoint's (whole) sizes; ``shard``: this rank's part
        (None: everything); ``router``: replaces the default ``SoftmaxTopKRouter`` (it becomes
        ``self.gate``, where the loader puts ``<block>.gate.*``); ``reduce``: the all-reduce of a
        tensor-parallel rank."""
        super().__init__()
        shard = shard or MoeShard.whole(num_experts, inter, shared_inter)
        self.shard = shard
        self.hidden = hidden
        self.num_experts = num_experts
        self.top_k = top_k
        self.reduce = reduce
        self.gate = router if router is not None else SoftmaxTopKRouter(hidden, num_experts, top_k, norm_topk_prob,
                                                                        dtype)
        i = shard.inter
        self.w13 = nn.Parameter(torch.empty(shard.experts, 2 * i, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(shard.experts, hidden, i, dtype=dtype), requires_grad=False)
        # Per-expert linear modules in place of w13/w2 (convert_experts): int8 (quantize_experts,
        # Int8Linear) or a device's packed layout (the CPU backend's oneDNN-packed linears).
        self.lin13: nn.ModuleList | None = None
        self.lin2: nn.ModuleList | None = None
        self.shared_expert = SwiGLU(hidden, shard.shared_inter, dtype) if shared_inter else None
        self.shared_expert_gate = _Linear(hidden, 1, bias=False, dtype=dtype) if shared_gate else None
        # The device backend's routed-experts step (workers/backends/npu_moe.py): same contract as
        # experts_forward, None = the torch path below.
        self.fused_experts: Callable[["SparseMoE", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    # -------------------------------------------------------------------- forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        fn = self.fused_experts
        out = self.experts_forward(x, weights, ids) if fn is None else fn(self, x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = row_ops.elementwise(torch.sigmoid, self.shared_expert_gate(x)) * shared
            out = out + shared
        return out if self.reduce is None else self.reduce(out)

    def expert_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """(flat positions ``t * k + j`` of the routed rows, sorted by local expert; rows per local
        expert) for ids [T, k]; rows routed to another rank's experts are left out."""
        local = ids.reshape(-1) - self.shard.expert0
        if self.shard.experts != self.num_experts:
            local = torch.where((local >= 0) & (local < self.shard.experts), local, self.shard.experts)
        order = torch.argsort(local, stable=True)
        counts = torch.bincount(local, minlength=self.shard.experts + 1)[:self.shard.experts].tolist()
        return order, counts

    def experts_forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum for x [T, H] (this rank's part, not reduced): one grouped SwiGLU
        product per activated expert over its rows."""
        k = ids.shape[1]
        out = torch.zeros_like(x)
        if x.shape[0] == 1:  # one token (a single sequence's decode step): no sorting, same sum order
            s = self.shard
            for w, e in sorted(zip(weights[0].tolist(), ids[0].tolist()), key=lambda p: p[1]):
                if s.expert0 <= e < s.expert0 + s.experts:
                    out += self.expert(e - s.expert0, x) * torch.tensor(w, dtype=torch.float32).to(x.dtype)
            return out
        order, counts = self.expert_rows(ids)
        tokens = order // k
        w = weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            rows = tokens[start:start + n]
            y = self.expert(e, x[rows]) * w[start:start + n, None].to(x.dtype)
            out.index_add_(0, rows, y)
            start += n
        return out

    def expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """Local expert ``e``'s SwiGLU on rows h [n, H]."""
        i = self.shard.inter
        if self.lin13 is not None and self.lin2 is not None:
            return self.lin2[e](row_ops.swiglu(self.lin13[e](h), i))
        return F.linear(row_ops.swiglu(F.linear(h, self.w13[e]), i), self.w2[e])

    def convert_experts(self, make_linear: Callable[[torch.Tensor], nn.Module], kind: str) -> int:
        """Replace the stacked expert weights by per-expert linear modules ``make_linear(weight [N,
        K])`` (``lin13[e]``, ``lin2[e]``), ``kind`` naming them ("int8", "packed"); returns the
        count of linears made. A model converted once stays so (a second call does nothing)."""
        if self.lin13 is not None:
            return 0
        return self.install_experts([make_linear(self.w13[e]) for e in range(self.shard.experts)],
                                    [make_linear(self.w2[e]) for e in range(self.shard.experts)], kind)

    def install_experts(self, lin13: list[nn.Module], lin2: list[nn.Module], kind: str) -> int:
        """The local experts as the given linears (``lin13[e]``: [2 * I, H] rows [gate; up],
        ``lin2[e]``: [H, I]), ``kind`` naming them ("int8", "packed", "gguf": a GGUF file's blocks,
        never dequantised); the stacked weights let go. Returns the count of linears."""
        if len(lin13) != self.shard.experts or len(lin2) != self.shard.experts:
            raise ValueError(f"{len(lin13)} / {len(lin2)} expert linears for {self.shard.experts} experts")
        self.lin13, self.lin2 = nn.ModuleList(lin13), nn.ModuleList(lin2)
        self.experts_kind = kind
        self.w13 = nn.Parameter(self.w13.new_empty(0), requires_grad=False)
        self.w2 = nn.Parameter(self.w2.new_empty(0), requires_grad=False)
        return 2 * self.shard.experts

    def quantize_experts(self, make_linear: Callable[[torch.Tensor], nn.Module]) -> int:
        """``convert_experts`` into int8 linears (workers/backends/int8.py ``Int8Linear``)."""
        return self.convert_experts(make_linear, "int8")

    @property
    def int8(self) -> bool:
        return self.lin13 is not None and getattr(self, "experts_kind", "") == "int8"

    def extra_repr(self) -> str:
        s = self.shard
        return (f"experts={s.experts}/{s.total} from {s.expert0}, top_k={self.top_k}, inter={s.inter} from "
                f"{s.inter0}{', ' + self.experts_kind if self.lin13 is not None else ''}")


# ------------------------------------------------------------------------ checkpoint names

def slots(moe: SparseMoE, prefix: str, names: ExpertNames, slot: Callable[..., Any],
          sharded: bool) -> dict[str, Any]:
    """HF name -> ``slot(param, start, rows, dim, src_start)`` (loader.Slot) for every name of
    ``expected_tensors``: where each goes in ``moe``. Experts another rank holds get a slot of
    0 rows (not read). ``sharded``: a tensor-parallel rank (slices are read along ``dim``)."""
    s, h = moe.shard, moe.hidden
    b = f"{prefix}{names.block}."
    out: dict[str, Any] = {f"{b}gate.weight": slot(moe.gate.weight, 0, moe.gate.weight.shape[0])}
    d0, d1 = (0, 1) if sharded else (None, None)
    for e in range(s.total):
        le = e - s.expert0
        if not 0 <= le < s.experts:  # another rank's expert: nothing read
            for p in (names.w1, names.w3, names.w2):
                out[f"{b}experts.{e}.{p}.weight"] = slot(moe.w13, 0, 0)
            continue
        out[f"{b}experts.{e}.{names.w1}.weight"] = slot(moe.w13[le], 0, s.inter, d0, s.inter0)
        out[f"{b}experts.{e}.{names.w3}.weight"] = slot(moe.w13[le], s.inter, s.inter, d0, s.inter0)
        out[f"{b}experts.{e}.{names.w2}.weight"] = slot(moe.w2[le], 0, h, d1, s.inter0)
    if moe.shared_expert is not None:
        se, n = moe.shared_expert, s.shared_inter
        out[f"{b}{names.shared}.gate_proj.weight"] = slot(se.gate_up_proj.weight, 0, n, d0, s.shared0)
        out[f"{b}{names.shared}.up_proj.weight"] = slot(se.gate_up_proj.weight, n, n, d0, s.shared0)
        out[f"{b}{names.shared}.down_proj.weight"] = slot(se.down_proj.weight, 0, h, d1, s.shared0)
        if moe.shared_expert_gate is not None:
            out[f"{b}{names.shared_gate}.weight"] = slot(moe.shared_expert_gate.weight, 0, 1)
    return out
