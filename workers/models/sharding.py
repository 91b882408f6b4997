"""Tensor-parallel sharding of the Llama family (Megatron style), and the collectives it needs.

One instance of ``world`` ranks splits every layer so that each rank holds about 1/world of
the weights and does 1/world of the matmul work:

- q/k/v and gate/up are column-parallel: rank r computes its own attention heads and its slice
  of the intermediate size, with no communication;
- o and down are row-parallel: each rank multiplies its slice of the input columns and one
  all-reduce sums the partial outputs (their biases live on rank 0 only, so the sum holds them
  once);
- the embedding and the LM head are vocab-parallel: rank r holds ``ceil(vocab / world)`` rows
  (the last rank zero-padded); a lookup is a masked local lookup plus an all-reduce, logits are
  one all-gather;
- KV heads are split when there are at least as many as ranks, otherwise replicated: each rank
  keeps the one KV head its query heads use;
- norms (and Qwen3's q/k norms) are replicated;
- a hybrid model's (Qwen3-Next, Qwen3.5: workers/models/qwen3_next.py) Gated DeltaNet layers split
  by key head, each rank with its value heads: their projections and the convolution's [q | k | v]
  channels column-parallel, the per-head A_log / dt_bias with them, out_proj row-parallel; the
  state pool of each rank holds its heads' states only;
- a mixture of experts' sparse layers (workers/models/moe.py) split by ``moeParallel``: "tp" (the
  default) column/row-splits every expert like the dense MLP, "ep" gives each rank
  ``num_experts / world`` whole experts; the shared expert is split like the dense MLP either way,
  the router is replicated, and one all-reduce sums the layer's partial outputs.

``Shard`` is the plan for one rank (pure arithmetic, used by the loader); ``TensorParallel`` does
the collectives (used by the model's forward).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import ModelArgs, ModelConfigError
from .moe import MoeShard

__all__ = ["MOE_PARALLEL_KEY", "MOE_PARALLEL_MODES", "Shard", "TensorParallel", "WORLD_SIZE_KEY", "plan_shard"]

WORLD_SIZE_KEY = "BackendConfig.ModelDeployConfig.ModelConfig[0].worldSize"
MOE_PARALLEL_KEY = "BackendConfig.ModelDeployConfig.ModelConfig[0].moeParallel"
MOE_PARALLEL_MODES = ("tp", "ep")


@dataclass(frozen=True)
class Shard:
    """What rank ``rank`` of ``world`` holds of a model."""

    rank: int
    world: int
    heads: int  # query heads on this rank
    kv_heads: int  # KV heads on this rank
    kv_head0: int  # the first (global) KV head this rank holds
    inter: int  # intermediate (MLP) columns on this rank
    vocab: int  # embedding / LM-head rows per rank (the last rank's tail is padding)
    full_vocab: int
    moe: MoeShard | None = None  # the experts this rank holds (a mixture of experts' sparse layers)

    @property
    def head0(self) -> int:
        return self.rank * self.heads

    @property
    def vocab0(self) -> int:
        return self.rank * self.vocab

    @property
    def vocab_rows(self) -> int:
        """Checkpoint rows this rank loads (the rest of its ``vocab`` rows are zero padding)."""
        return max(0, min(self.full_vocab - self.vocab0, self.vocab))

    def local_args(self, args: ModelArgs) -> ModelArgs:
        """The shapes this rank builds its modules with (norm sizes and everything else unchanged)."""
        hy = args.hybrid
        if hy is not None:  # a hybrid model's linear heads: 1/world of the key heads, each with its value heads
            hy = dataclasses.replace(hy, num_k_heads=hy.num_k_heads // self.world,
                                     num_v_heads=hy.num_v_heads // self.world)
        return dataclasses.replace(args, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                                   intermediate_size=self.inter, vocab_size=self.vocab,
                                   layer_windows=args.layer_windows, hybrid=hy)


def plan_shard(args: ModelArgs, rank: int, world: int, moe_mode: str = "tp") -> Shard:
    """The shard of rank ``rank``; ModelConfigError naming worldSize when the model cannot be split
    that way (its query heads, its KV heads or its intermediate size do not divide), or
    moeParallel when its experts cannot (``moe_mode`` "tp" or "ep": see the module docstring)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of a world of {world}")
    if args.hybrid is not None and args.hybrid.num_k_heads % world:
        # Gated DeltaNet layers split by key head, each with its value heads (workers/models/qwen3_next.py)
        hy = args.hybrid
        raise ModelConfigError(f"{WORLD_SIZE_KEY}: {world} ranks cannot split the Gated DeltaNet layers: "
                               f"linear_num_key_heads {hy.num_k_heads} (linear_num_value_heads {hy.num_v_heads}) "
                               f"is not a multiple of {world}; use a world size that divides linear_num_key_heads")
    h, kv, inter = args.num_attention_heads, args.num_key_value_heads, args.intermediate_size

    def refuse(what: str) -> ModelConfigError:
        return ModelConfigError(f"{WORLD_SIZE_KEY}: {world} ranks cannot split this model: {what}; use a world "
                                f"size that divides num_attention_heads ({h}), num_key_value_heads ({kv}) or is a "
                                f"multiple of it, and intermediate_size ({inter})")

    if args.glm4_moe is not None and world > 1:  # not built for it (workers/models/glm4_moe.py)
        raise ModelConfigError(f"{WORLD_SIZE_KEY}: tensor parallelism is not supported for GLM-4-MoE "
                               f"({args.model_type or args.arch}); use worldSize 1")
    if args.gpt_oss is not None and world > 1:  # stacked experts and per-head sinks are not split (gpt_oss.py)
        raise ModelConfigError(f"{WORLD_SIZE_KEY}: tensor parallelism is not supported for GPT-OSS; use worldSize 1")
    if world > 1 and args.variant is not None and args.variant.fused_checkpoint:
        # each rank would read row ranges of q, k, v (gate, up) out of one stored tensor
        raise ModelConfigError(f"{WORLD_SIZE_KEY}: {world} ranks: tensor parallelism is not supported for "
                               f"{args.variant.family} (its checkpoint stores fused qkv_proj / gate_up_proj tensors)")
    if h % world:
        raise refuse(f"num_attention_heads {h} is not a multiple of {world}")
    dense = args.moe is None or not all(args.moe.sparse_layers)
    if dense and inter % world:
        raise refuse(f"intermediate_size {inter} is not a multiple of {world}")
    moe = None
    ds = args.deepseek if args.deepseek is not None and args.deepseek.n_routed_experts else None
    if args.moe is not None or ds is not None:
        m = args.moe
        # DeepSeek's experts (workers/models/deepseek.py): its shared experts are one SwiGLU
        sizes = ((m.num_experts, m.moe_intermediate_size, m.shared_expert_intermediate_size) if m is not None else
                 (ds.n_routed_experts, ds.moe_intermediate_size, ds.moe_intermediate_size * ds.n_shared_experts))
        try:
            moe = MoeShard.plan(*sizes, rank, world, moe_mode)
        except ValueError as e:
            raise ModelConfigError(f"{MOE_PARALLEL_KEY} {moe_mode!r}: {world} ranks cannot split the experts: {e}; "
                                   f"use moeParallel {'tp' if moe_mode == 'ep' else 'ep'} or another worldSize") from None
    if kv % world == 0:
        kv_local, kv0 = kv // world, rank * (kv // world)
    elif world % kv == 0:
        # Fewer KV heads than ranks: each rank keeps a copy of the one its query heads read.
        kv_local, kv0 = 1, rank * kv // world
    else:
        raise refuse(f"num_key_value_heads {kv} neither divides nor is divided by {world}")
    vocab = -(-args.vocab_size // world)
    return Shard(rank=rank, world=world, heads=h // world, kv_heads=kv_local, kv_head0=kv0,
                 inter=inter // world if dense else inter, vocab=vocab, full_vocab=args.vocab_size, moe=moe)


class TensorParallel:
    """The collectives of one rank's forward, over ``group`` (torch.distributed)."""

    def __init__(self, shard: Shard, group=None, ordered: bool = False):
        """``ordered`` (batch-invariant mode, ScheduleConfig.batchInvariant): sums of more than two
        ranks in rank order (``all_reduce``)."""
        self.shard = shard
        self.group = group
        self.ordered = ordered

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of the ranks' partial outputs of a row-parallel layer, in place. Two ranks' sum is
        one addition, the same bits in either order; of more, gloo's ring starts each piece of the
        buffer at another rank and cuts the pieces by the buffer's size (the step's rows), so an
        element's order of additions follows the step: ``ordered`` gathers the parts and adds them
        in rank order instead (world - 1 times the bytes moved)."""
        import torch.distributed as dist
        world = self.shard.world
        if not self.ordered or world <= 2:
            dist.all_reduce(x, group=self.group)
            return x
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return x.copy_(total)

    def embed(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: each rank fills the rows of the ids it holds, zeros elsewhere, and
        the all-reduce assembles them."""
        local = ids - self.shard.vocab0
        outside = (local < 0) | (local >= self.shard.vocab)
        out = F.embedding(local.masked_fill(outside, 0), weight)
        out.masked_fill_(outside[:, None], 0)
        return self.all_reduce(out)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[N, vocab/world] per rank -> [N, vocab] (the padding columns cut off)."""
        import torch.distributed as dist
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.shard.world)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[:, :self.shard.full_vocab]
