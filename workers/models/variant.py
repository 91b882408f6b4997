"""The decoder of GLM-4, Phi-3 / Phi-4-mini, SmolLM3 and Granite: Llama's DecoderLM with what each
family changes (``ModelArgs.variant``, workers/models/variant_config.py), numerics as transformers'
modeling_glm4 / modeling_phi3 / modeling_smollm3 / modeling_granite compute them:

- rope on the first ``rotary_dim`` dims of each head only (partial_rotary_factor), the rest passed
  through; GLM-4 rotates interleaved pairs (0,1),(2,3).., the others the halves (NeoX layout);
- Phi-3's LongRoPE: short factors at positions below original_max_position_embeddings, long ones
  from there on, cos/sin times the attention factor. transformers picks one set for a whole
  forward by its largest position; with its KV cache a decoded token at position p uses the long
  set exactly when p >= original_max_position_embeddings, which is the rule here, per token (so a
  cached key keeps the rotation it was written with). A single forward that spans the boundary
  (a prompt longer than the original length) is where the two differ: transformers rotates all of
  it with the long set, this decoder only its positions past the boundary;
- SmolLM3's NoPE layers: no rope at all on them;
- GLM-4's extra norms on the attention and MLP outputs before each residual add;
- Granite's multipliers: embeddings times embedding_multiplier, the softmax scale
  attention_multiplier (q is pre-scaled, as the attention kernels apply 1/sqrt(head_dim)), each
  branch times residual_multiplier, logits divided by logits_scaling.

The fused decode kernel (workers/backends/cpu_decode.py) computes the Llama block only: refused.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from .config import ModelArgs
from .llama import MLP, Attention, DecoderAttention, DecoderLM, RMSNorm, rope_inv_freq
from .moe import MoeShard
from .variant_config import VariantArgs
from .variant_names import fuse_names

__all__ = ["VariantLM", "VariantRope"]


def _variant(args: ModelArgs) -> VariantArgs:
    assert args.variant is not None
    return args.variant


class VariantRope(nn.Module):
    """fp32 cos/sin tables [positions, rotary_dim/2] of a partial, interleaved or LongRoPE rotary
    embedding; ``rotate`` turns the leading ``rotary_dim`` dims of each head."""

    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        v = _variant(args)
        self.rotary_dim, self.interleaved = v.rotary_dim, v.rope_interleaved
        pos = torch.arange(max_positions, dtype=torch.int64, device="cpu").float()[:, None]
        if v.longrope is None:
            inv = rope_inv_freq(v.rotary_dim, args.rope_theta, args.rope_scaling)
            self.cos, self.sin = (pos * inv[None, :]).cos(), (pos * inv[None, :]).sin()
        else:
            lr = v.longrope
            shape = torch.arange(0, v.rotary_dim, 2, dtype=torch.int64, device="cpu").float() / v.rotary_dim
            # transformers' 1 / (ext_factors * base ** shape), op for op
            short = 1.0 / (torch.tensor(lr.short, dtype=torch.float32) * args.rope_theta ** shape)
            long = 1.0 / (torch.tensor(lr.long, dtype=torch.float32) * args.rope_theta ** shape)
            inv = torch.where(pos >= lr.original_max_position_embeddings, long[None, :], short[None, :])
            freqs = pos * inv
            self.cos, self.sin = freqs.cos() * lr.attention_factor, freqs.sin() * lr.attention_factor
        self.max_positions = max_positions
        self._key: tuple = (None, None)
        self._rows: tuple = ()

    def to_device(self, device: torch.device | str) -> None:
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated by each token's position (dims past rotary_dim unchanged)."""
        if self.cos.device != positions.device:
            self.to_device(positions.device)
        if positions is not self._key[0] or x.dtype != self._key[1]:  # once per forward, not per layer
            self._key = (positions, x.dtype)
            self._rows = (self.cos[positions].to(x.dtype)[:, None, :], self.sin[positions].to(x.dtype)[:, None, :])
        cos, sin = self._rows
        r = x[..., :self.rotary_dim]
        if self.interleaved:  # GLM-4: pairs (2i, 2i+1) turn by frequency i
            x1, x2 = r[..., 0::2], r[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = r.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if self.rotary_dim == x.shape[-1]:
            return out
        return torch.cat((out, x[..., self.rotary_dim:]), dim=-1)


class VariantAttention(DecoderAttention):
    """Llama's fused-qkv attention with rope skipped on NoPE layers and Granite's softmax scale."""

    def __init__(self, args: ModelArgs, layer_idx: int, dtype: torch.dtype | None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None, lora) -> None:
        super().__init__(args, layer_idx, dtype, reduce, lora)
        v = _variant(args)
        self.use_rope = v.rope_layers[layer_idx]
        # attention scale m instead of 1/sqrt(d): q times m*sqrt(d) before the kernels' 1/sqrt(d)
        self.q_scale = None if v.attention_multiplier is None else v.attention_multiplier * math.sqrt(self.head_dim)

    def rotated_qk(self, qkv: torch.Tensor, positions: torch.Tensor, rope: VariantRope
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        t = qkv.shape[0]
        qk = qkv[:, :self.q_size + self.kv_size].view(t, self.n_heads + self.n_kv_heads, self.head_dim)
        if self.use_rope:
            qk = rope.rotate(positions, qk)
        q, k = qk.split([self.n_heads, self.n_kv_heads], dim=1)
        return (q, k) if self.q_scale is None else (q * self.q_scale, k)


class VariantLayer(nn.Module):
    """Pre-norm block; GLM-4 norms each branch's output too, Granite scales it."""

    def __init__(self, args: ModelArgs, layer_idx: int, dtype: torch.dtype | None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None, lora) -> None:
        super().__init__()
        v = _variant(args)
        eps, hid = args.rms_norm_eps, args.hidden_size
        self.input_layernorm = RMSNorm(hid, eps, dtype)
        self.self_attn = VariantAttention(args, layer_idx, dtype, reduce, lora)
        self.post_attention_layernorm = RMSNorm(hid, eps, dtype)
        self.mlp = MLP(args, dtype, reduce, layer_idx, lora)
        self.post_self_attn_layernorm = RMSNorm(hid, eps, dtype) if v.sandwich_norms else None
        self.post_mlp_layernorm = RMSNorm(hid, eps, dtype) if v.sandwich_norms else None
        self.residual_multiplier = v.residual_multiplier

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: VariantRope, attn: Attention) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(x), positions, rope, attn)
        if self.post_self_attn_layernorm is not None:
            a = self.post_self_attn_layernorm(a)
        if self.residual_multiplier != 1.0:
            a = a * self.residual_multiplier
        h = x + a
        m = self.mlp(self.post_attention_layernorm(h))
        if self.post_mlp_layernorm is not None:
            m = self.post_mlp_layernorm(m)
        if self.residual_multiplier != 1.0:
            m = m * self.residual_multiplier
        return h + m


class VariantLM(DecoderLM):
    """DecoderLM of a GLM-4 / Phi-3 / SmolLM3 / Granite checkpoint (see the module docstring)."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype | None = None, max_positions: int | None = None,
                 tp=None) -> None:
        super().__init__(args, dtype, max_positions, tp)
        self.fused_decode_refusal = f"the {_variant(args).family} block (workers/models/variant.py)"

    def make_layer(self, args: ModelArgs, i: int, dtype: torch.dtype | None,
                   reduce: Callable[[torch.Tensor], torch.Tensor] | None, moe_shard: MoeShard | None) -> nn.Module:
        return VariantLayer(args, i, dtype, reduce, self.lora)

    def make_rope(self, args: ModelArgs, max_positions: int) -> nn.Module:
        return VariantRope(args, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if self.tp is None else self.tp.embed(self.embed_tokens.weight, input_ids)
        if (m := _variant(self.args).embedding_multiplier) != 1.0:
            x = x * m
        for layer in self.layers:
            x = layer(x, positions, self.rope, attn)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        s = _variant(self.args).logits_scaling
        return logits if s == 1.0 else logits / s


def param_slots(model: VariantLM, slots: dict, slot_cls: type, shard) -> dict:
    """The loader's Llama slots (``slots``) with the fused checkpoint tensors in place of their
    parts (one slot: the same [q; k; v] / [gate; up] rows as our fused modules) and GLM-4's extra
    norms. A tensor-parallel shard of a fused tensor is refused at plan time (sharding.plan_shard)."""
    assert shard is None or not _variant(model.args).fused_checkpoint

    def merge(_: str, parts: list) -> object:
        first = parts[0]
        return slot_cls(first.param, 0, sum(p.rows for p in parts))

    out = fuse_names(model.args, slots, merge)
    for i, layer in enumerate(model.layers):
        for name in ("post_self_attn_layernorm", "post_mlp_layernorm"):
            if (norm := getattr(layer, name)) is not None:
                out[f"model.layers.{i}.{name}.weight"] = slot_cls(norm.weight, 0, norm.weight.shape[0])
    return out
