"""The GLM-4-MoE decoder (``Glm4MoeForCausalLM``), numerics as transformers 5.25's modeling_glm4_moe,
assembled from the pieces other families use (keys: workers/models/glm4_moe_config.py):

- attention: Llama's (workers/models/llama.py DecoderAttention: fused q/k/v, Qwen3-style per-head
  q/k norms when ``use_qk_norm``), with rope on the first ``rotary_dim`` dims of each head in the
  NeoX layout (workers/models/variant.py VariantRope; not GLM-4's interleaved pairs);
- feed-forward: the dense SwiGLU below ``first_k_dense_replace``, else workers/models/moe.py's
  SparseMoE with DeepSeek-V3's router (workers/models/deepseek_routing.py: sigmoid, correction
  bias, groups, norm_topk_prob, routed_scaling_factor) and the shared experts as one SwiGLU;
- the MTP layers are not built (checkpoint.py skips their tensors, logged).

Refused: tensor parallelism (workers/models/sharding.py). The CPU backend's fused decode step turns
the partial rotary's dims only (its ``rot_half``) and hands each mixture layer to its SparseMoE
between calls (workers/backends/cpu_decode.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from .config import ModelArgs
from .deepseek_routing import DeepseekRouter
from .glm4_moe_config import Glm4MoeArgs
from .llama import MLP, DecoderAttention, DecoderLayer, DecoderLM, RMSNorm
from .moe import MoeShard, SparseMoE
from .variant import VariantRope

__all__ = ["Glm4MoeLM", "router_slots"]


def _glm(args: ModelArgs) -> Glm4MoeArgs:
    assert args.glm4_moe is not None and args.moe is not None
    return args.glm4_moe


class Glm4MoeLayer(DecoderLayer):
    """DecoderLayer's block (its forward) with DeepSeek-V3's router on the sparse layers."""

    def __init__(self, args: ModelArgs, layer_idx: int, dtype: torch.dtype | None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None, lora: Any,
                 moe_shard: MoeShard | None) -> None:
        nn.Module.__init__(self)  # DecoderLayer's own __init__ would build the softmax router's experts too
        g, moe = _glm(args), args.moe
        assert moe is not None
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.self_attn = DecoderAttention(args, layer_idx, dtype, reduce, lora)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.mlp: nn.Module
        if moe.sparse_layers[layer_idx]:
            self.mlp = SparseMoE(args.hidden_size, moe.num_experts, moe.top_k, moe.moe_intermediate_size, dtype,
                                 router=DeepseekRouter(g, args.hidden_size),  # type: ignore[arg-type]
                                 shared_inter=moe.shared_expert_intermediate_size, shard=moe_shard, reduce=reduce)
        else:
            self.mlp = MLP(args, dtype, reduce, layer_idx, lora)


class Glm4MoeLM(DecoderLM):
    """DecoderLM of a GLM-4-MoE checkpoint (see the module docstring)."""

    def make_layer(self, args: ModelArgs, i: int, dtype: torch.dtype | None,
                   reduce: Callable[[torch.Tensor], torch.Tensor] | None, moe_shard: MoeShard | None) -> nn.Module:
        return Glm4MoeLayer(args, i, dtype, reduce, self.lora, moe_shard)

    def make_rope(self, args: ModelArgs, max_positions: int) -> nn.Module:
        # VariantRope reads the rotary part from ModelArgs.variant; GLM-4-MoE keeps it beside its routing
        return VariantRope(dataclasses.replace(args, variant=_glm(args).rope), max_positions)


def router_slots(model: Glm4MoeLM, slot_cls: type) -> dict[str, Any]:
    """The correction bias of each sparse layer's router (the loader's MoE slots hold the rest)."""
    out = {}
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, SparseMoE):
            bias = layer.mlp.gate.e_score_correction_bias
            out[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] = slot_cls(bias, 0, bias.shape[0])
    return out
