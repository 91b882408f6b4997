"""Qwen3-Next and Qwen3.5 (dense and MoE): hybrid linear attention over a flat batch, as
transformers 5 computes them (``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM``,
``Qwen3_5MoeForCausalLM``).

Layers follow ``layer_types`` (workers/models/hybrid_config.py): "linear_attention" is a Gated
DeltaNet layer (workers/models/gated_deltanet.py) whose per-sequence state lives in the state pool
(workers/attention/state_cache.py, ``model.states``, set by the model runner); "full_attention" is
a gated attention layer over the paged KV cache, which holds the full-attention layers only
(``kv_layers``; the attention object is called with the layer's index among them):

- ``q_proj`` gives per head the query and an output gate ([q | gate] per head); q and k go
  through per-head RMSNorms, rope turns only the first ``rotary_dim`` dimensions of each head
  (``partial_rotary_factor``), and the attention output is multiplied by ``sigmoid(gate)`` before
  ``o_proj``;
- every RMSNorm of the decoder (input, post-attention, final, q/k) is zero-centred: it scales by
  ``1 + weight`` (in fp32, then cast), the Gated DeltaNet's own gated norm by ``weight``.

Feed-forward: a SwiGLU MLP, or on the sparse layers of Qwen3-Next / Qwen3.5-MoE workers/models/
moe.py's SparseMoE (softmax top-k routing, a shared expert with its sigmoid gate).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from . import row_ops
from .config import ModelArgs
from .gated_deltanet import GatedDeltaNet
from .llama import MLP, DecoderLM, Embedding, Linear, RotaryEmbedding, sparse_moe
from .lora import LoraHook
from .moe import QWEN_NAMES, SparseMoE
from .moe import slots as moe_slots

__all__ = ["HybridLM", "param_slots"]


class ZeroCenteredRMSNorm(nn.Module):
    """transformers' Qwen3NextRMSNorm: x / rms(x) in fp32, times (1 + weight) in fp32, cast back."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * row_ops.elementwise(torch.rsqrt, h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class PartialRotary(nn.Module):
    """Rope on the first ``rotary_dim`` dimensions of each head (NeoX halves within them), the rest
    passed through (transformers' apply_rotary_pos_emb with a shorter cos/sin)."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float, scaling) -> None:
        super().__init__()
        self.dim = rotary_dim
        self.inner = RotaryEmbedding(rotary_dim, max_positions, theta, scaling)

    def to_device(self, device: torch.device | str) -> None:
        self.inner.to_device(device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.inner.rotate(positions, x[..., :self.dim]), x[..., self.dim:]), dim=-1)


class GatedAttention(nn.Module):
    """A full-attention layer of the hybrid families (module docstring)."""

    def __init__(self, args: ModelArgs, kv_index: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.kv_index = kv_index
        self.h, self.hkv, self.d = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        hid = args.hidden_size
        self.q_proj = Linear(hid, 2 * self.h * self.d, bias=False, dtype=dtype)
        self.k_proj = Linear(hid, self.hkv * self.d, bias=False, dtype=dtype)
        self.v_proj = Linear(hid, self.hkv * self.d, bias=False, dtype=dtype)
        self.o_proj = Linear(self.h * self.d, hid, bias=False, dtype=dtype)
        self.q_norm = ZeroCenteredRMSNorm(self.d, args.rms_norm_eps, dtype)
        self.k_norm = ZeroCenteredRMSNorm(self.d, args.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: PartialRotary, attn) -> torch.Tensor:
        t = x.shape[0]
        q, gate = self.q_proj(x).view(t, self.h, 2 * self.d).chunk(2, dim=-1)
        gate = gate.reshape(t, self.h * self.d)
        q = rope(positions, self.q_norm(q))
        k = rope(positions, self.k_norm(self.k_proj(x).view(t, self.hkv, self.d)))
        v = self.v_proj(x).view(t, self.hkv, self.d)
        o = attn(self.kv_index, q, k, v, None).reshape(t, self.h * self.d)
        return self.o_proj(o * row_ops.elementwise(torch.sigmoid, gate))


class HybridLayer(nn.Module):
    """Pre-norm block: x + mixer(norm(x)), then h + ffn(norm(h)); the mixer is a Gated DeltaNet
    layer or a gated attention layer."""

    def __init__(self, args: ModelArgs, i: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        hy = args.hybrid
        assert hy is not None
        self.input_layernorm = ZeroCenteredRMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: GatedAttention | None = None
        if hy.layer_types[i] == "linear_attention":
            self.linear_attn = GatedDeltaNet(hy, args.hidden_size, args.rms_norm_eps, hy.linear_layers.index(i), dtype)
        else:
            self.self_attn = GatedAttention(args, hy.full_layers.index(i), dtype)
        self.mlp: nn.Module
        if args.moe is not None and args.moe.sparse_layers[i]:
            self.mlp = sparse_moe(args, dtype, None, None)
        else:
            self.mlp = MLP(args, dtype, None, i)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: PartialRotary, attn, states) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.linear_attn is not None:
            h = self.linear_attn(h, states)
        else:
            assert self.self_attn is not None
            h = self.self_attn(h, positions, rope, attn)
        h = x + h
        return h + self.mlp(self.post_attention_layernorm(h))


class HybridLM(nn.Module):
    """The hybrid causal LM over a flat batch (DecoderLM's interface). ``states``: the state pool
    (workers/attention/state_cache.py), set by the model runner before the first step."""

    # workers/backends/cpu_decode.py: the fused decode kernel computes no Gated DeltaNet layer
    fused_decode_refusal = "hybrid linear attention (Gated DeltaNet layers)"

    def __init__(self, args: ModelArgs, dtype: torch.dtype | None = None, max_positions: int | None = None,
                 tp=None) -> None:
        super().__init__()
        hy = args.hybrid
        assert hy is not None
        if tp is not None:
            raise ValueError(f"{args.model_type or args.arch}: tensor parallelism is not supported for hybrid "
                             "linear-attention models (Qwen3-Next / Qwen3.5)")
        self.args = self.local_args = args
        self.tp = None
        self.lora = LoraHook()  # never set: LoRA adapters are refused for hybrid models (assembly)
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(HybridLayer(args, i, dtype) for i in range(args.num_hidden_layers))
        self.norm = ZeroCenteredRMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.lm_head = None if args.tie_word_embeddings else Linear(args.hidden_size, args.vocab_size, bias=False,
                                                                     dtype=dtype)
        self.logits_linear = None
        self.fast_decode: Callable | None = None
        self.rope = PartialRotary(hy.rotary_dim, max_positions or args.max_position_embeddings, args.rope_theta,
                                  args.rope_scaling)
        self.states = None

    @property
    def kv_layers(self) -> int:
        """Layers with a KV cache: the full-attention ones."""
        return len(self.args.hybrid.full_layers)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return (None,) * self.kv_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        if self.states is None:
            raise RuntimeError("the hybrid model has no state pool (ModelRunner.allocate_kv makes it)")
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions, self.rope, attn, self.states)
        return self.norm(x)

    # hidden [N, hidden_size] -> fp32 logits: the Llama family's head (a backend's, lm_head or tied)
    compute_logits = DecoderLM.compute_logits


def param_slots(model: HybridLM, slot: Callable[..., object]) -> dict[str, object]:
    """HF name -> loader.Slot for every name of hybrid_names.expected_tensors."""
    out: dict[str, object] = {}

    def whole(name: str, p: torch.Tensor) -> None:
        out[name] = slot(p, 0, p.shape[0])

    whole("model.embed_tokens.weight", model.embed_tokens.weight)
    whole("model.norm.weight", model.norm.weight)
    if model.lm_head is not None:
        whole("lm_head.weight", model.lm_head.weight)
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        if (la := layer.linear_attn) is not None:
            p = f"{pre}linear_attn."
            names = (("in_proj_qkvz", "in_proj_ba") if la.hy.layout == "qkvz"
                     else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
            for n in names + ("out_proj",):
                whole(f"{p}{n}.weight", getattr(la, n).weight)
            whole(f"{p}conv1d.weight", la.conv_weight)
            whole(f"{p}dt_bias", la.dt_bias)
            whole(f"{p}A_log", la.A_log)
            whole(f"{p}norm.weight", la.norm.weight)
        else:
            at, p = layer.self_attn, f"{pre}self_attn."
            for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                whole(f"{p}{n}.weight", getattr(at, n).weight)
        if isinstance(layer.mlp, SparseMoE):
            out.update(moe_slots(layer.mlp, pre, QWEN_NAMES, slot, False))
        else:
            inter = layer.mlp.intermediate_size
            out[f"{pre}mlp.gate_proj.weight"] = slot(layer.mlp.gate_up_proj.weight, 0, inter)
            out[f"{pre}mlp.up_proj.weight"] = slot(layer.mlp.gate_up_proj.weight, inter, inter)
            whole(f"{pre}mlp.down_proj.weight", layer.mlp.down_proj.weight)
        whole(f"{pre}input_layernorm.weight", layer.input_layernorm.weight)
        whole(f"{pre}post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
    return out
