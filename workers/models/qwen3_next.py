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

Tensor parallelism (``tp``, workers/models/sharding.py): every layer is built with the rank's
shapes (``Shard.local_args``). A Gated DeltaNet layer keeps 1/world of the key heads, each with its
value heads (key head i's value heads are i * r .. i * r + r - 1, r = Hv / Hk, as the delta rule
repeats them), so its projections, the convolution's [q | k | v] channels, A_log and dt_bias are
this rank's heads (``param_slots``: Qwen3-Next's per-key-head groups are one row range, Qwen3.5's
in_proj_qkv and the convolution three) and out_proj is row-parallel; the gated attention splits
its query heads (q and gate together), its KV heads as the Llama family's; the MLP and the experts
as the Llama family's and MoE's TP; vocab-parallel embedding and LM head.
"""
from __future__ import annotations

import logging
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
from .sharding import Shard, TensorParallel

__all__ = ["HybridLM", "param_slots"]

log = logging.getLogger("workers.models")


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

    def __init__(self, args: ModelArgs, kv_index: int, dtype: torch.dtype | None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.kv_index = kv_index
        self.reduce = reduce  # tensor parallel: o_proj is row-parallel
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
        out = self.o_proj(o * row_ops.elementwise(torch.sigmoid, gate))
        return out if self.reduce is None else self.reduce(out)


class HybridLayer(nn.Module):
    """Pre-norm block: x + mixer(norm(x)), then h + ffn(norm(h)); the mixer is a Gated DeltaNet
    layer or a gated attention layer."""

    def __init__(self, args: ModelArgs, i: int, dtype: torch.dtype | None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, moe_shard=None) -> None:
        """``args``: this rank's shapes; ``reduce`` / ``moe_shard``: tensor parallelism's all-reduce
        and experts (None on one device)."""
        super().__init__()
        hy = args.hybrid
        assert hy is not None
        self.input_layernorm = ZeroCenteredRMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: GatedAttention | None = None
        if hy.layer_types[i] == "linear_attention":
            self.linear_attn = GatedDeltaNet(hy, args.hidden_size, args.rms_norm_eps, hy.linear_layers.index(i), dtype,
                                             reduce)
        else:
            self.self_attn = GatedAttention(args, hy.full_layers.index(i), dtype, reduce)
        self.mlp: nn.Module
        if args.moe is not None and args.moe.sparse_layers[i]:
            self.mlp = sparse_moe(args, dtype, reduce, moe_shard)
        else:
            self.mlp = MLP(args, dtype, reduce, i)

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
                 tp: TensorParallel | None = None) -> None:
        """``tp``: one rank of a tensor-parallel instance (module docstring)."""
        super().__init__()
        hy = args.hybrid
        assert hy is not None
        self.args = args
        self.tp = tp
        local = self.local_args = tp.shard.local_args(args) if tp is not None else args
        reduce = tp.all_reduce if tp is not None else None
        moe_shard = tp.shard.moe if tp is not None else None
        self.lora = LoraHook()  # never set: LoRA adapters are refused for hybrid models (assembly)
        self.embed_tokens = Embedding(local.vocab_size, args.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(HybridLayer(local, i, dtype, reduce, moe_shard)
                                    for i in range(args.num_hidden_layers))
        self.norm = ZeroCenteredRMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.lm_head = None if args.tie_word_embeddings else Linear(args.hidden_size, local.vocab_size, bias=False,
                                                                     dtype=dtype)
        self.logits_linear = None
        self.fast_decode: Callable | None = None
        self.rope = PartialRotary(hy.rotary_dim, max_positions or args.max_position_embeddings, args.rope_theta,
                                  args.rope_scaling)
        self.states = None
        if tp is not None:
            _log_rank_heads(args, local, tp.shard, dtype)

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
        x = self.embed_tokens(input_ids) if self.tp is None else self.tp.embed(self.embed_tokens.weight, input_ids)
        for layer in self.layers:
            x = layer(x, positions, self.rope, attn, self.states)
        return self.norm(x)

    # hidden [N, hidden_size] -> fp32 logits: the Llama family's head (a backend's, lm_head or tied)
    compute_logits = DecoderLM.compute_logits


def _log_rank_heads(args: ModelArgs, local: ModelArgs, shard: Shard, dtype: torch.dtype | None) -> None:
    """The load log's line of a tensor-parallel rank: its linear heads and what its state pool
    keeps per sequence (the pool's slot count and total: workers/engine/assembly.py)."""
    hy, mine = args.hybrid, local.hybrid
    conv, rec = mine.state_bytes(torch.empty((), dtype=dtype).element_size())
    full = sum(hy.state_bytes(torch.empty((), dtype=dtype).element_size()))
    k0, v0 = shard.rank * mine.num_k_heads, shard.rank * mine.num_v_heads
    log.info("tensor-parallel rank %d/%d: Gated DeltaNet key heads %d..%d, value heads %d..%d, attention heads "
             "%d..%d; state pool %d bytes per sequence per rank (conv %d + recurrent %d) of the model's %d",
             shard.rank, shard.world, k0, k0 + mine.num_k_heads - 1, v0, v0 + mine.num_v_heads - 1, shard.head0,
             shard.head0 + shard.heads - 1, conv + rec, conv, rec, full)


def param_slots(model: HybridLM, slot: Callable[..., object], shard: Shard | None = None) -> dict[str, object]:
    """HF name -> loader.Slot for every name of hybrid_names.expected_tensors; with a tensor-parallel
    ``shard`` this rank's slices (module docstring), a list of Slots for a tensor whose rank's rows
    are several ranges (Qwen3.5's in_proj_qkv and every convolution: its q, k and v heads)."""
    out: dict[str, object] = {}
    dim0, dim1 = (0, 1) if shard is not None else (None, None)
    rank = shard.rank if shard is not None else 0
    hid = model.args.hidden_size

    def whole(name: str, p: torch.Tensor) -> None:
        out[name] = slot(p, 0, p.shape[0])

    def heads(name: str, p: torch.Tensor, per_rank: int) -> None:
        """Rows of this rank's heads: one range of ``per_rank`` rows."""
        out[name] = slot(p, 0, per_rank, dim0, rank * per_rank)

    def qkv(name: str, p: torch.Tensor, hy) -> None:
        """The [q | k | v] rows (in_proj_qkv, the convolution's channels) of this rank's heads."""
        if shard is None:
            whole(name, p)
            return
        kd, vd, full_kd = hy.key_dim, hy.value_dim, model.args.hybrid.key_dim
        out[name] = [slot(p, 0, kd, 0, rank * kd), slot(p, kd, kd, 0, full_kd + rank * kd),
                     slot(p, 2 * kd, vd, 0, 2 * full_kd + rank * vd)]

    def vocab(name: str, p: torch.Tensor) -> None:
        if shard is None:
            whole(name, p)
        else:  # the padding rows past the vocabulary stay zero (the loader zeroes them)
            out[name] = slot(p, 0, shard.vocab_rows, 0, shard.vocab0)

    vocab("model.embed_tokens.weight", model.embed_tokens.weight)
    whole("model.norm.weight", model.norm.weight)
    if model.lm_head is not None:
        vocab("lm_head.weight", model.lm_head.weight)
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        if (la := layer.linear_attn) is not None:
            p, hy = f"{pre}linear_attn.", la.hy  # this rank's heads
            if hy.layout == "qkvz":  # grouped by key head: this rank's groups are one row range
                heads(f"{p}in_proj_qkvz.weight", la.in_proj_qkvz.weight, hy.conv_dim + hy.value_dim)
                heads(f"{p}in_proj_ba.weight", la.in_proj_ba.weight, 2 * hy.num_v_heads)
            else:
                qkv(f"{p}in_proj_qkv.weight", la.in_proj_qkv.weight, hy)
                heads(f"{p}in_proj_z.weight", la.in_proj_z.weight, hy.value_dim)
                heads(f"{p}in_proj_b.weight", la.in_proj_b.weight, hy.num_v_heads)
                heads(f"{p}in_proj_a.weight", la.in_proj_a.weight, hy.num_v_heads)
            qkv(f"{p}conv1d.weight", la.conv_weight, hy)
            heads(f"{p}dt_bias", la.dt_bias, hy.num_v_heads)
            heads(f"{p}A_log", la.A_log, hy.num_v_heads)
            whole(f"{p}norm.weight", la.norm.weight)
            out[f"{p}out_proj.weight"] = slot(la.out_proj.weight, 0, hid, dim1, rank * hy.value_dim)
        else:
            at, p = layer.self_attn, f"{pre}self_attn."
            d = at.d
            out[f"{p}q_proj.weight"] = slot(at.q_proj.weight, 0, 2 * at.h * d, dim0, rank * 2 * at.h * d)
            kv0 = shard.kv_head0 * d if shard is not None else 0
            for n in ("k_proj", "v_proj"):
                out[f"{p}{n}.weight"] = slot(getattr(at, n).weight, 0, at.hkv * d, dim0, kv0)
            out[f"{p}o_proj.weight"] = slot(at.o_proj.weight, 0, hid, dim1, rank * at.h * d)
            whole(f"{p}q_norm.weight", at.q_norm.weight)
            whole(f"{p}k_norm.weight", at.k_norm.weight)
        if isinstance(layer.mlp, SparseMoE):
            out.update(moe_slots(layer.mlp, pre, QWEN_NAMES, slot, shard is not None))
        else:
            inter = layer.mlp.intermediate_size  # this rank's
            out[f"{pre}mlp.gate_proj.weight"] = slot(layer.mlp.gate_up_proj.weight, 0, inter, dim0, rank * inter)
            out[f"{pre}mlp.up_proj.weight"] = slot(layer.mlp.gate_up_proj.weight, inter, inter, dim0, rank * inter)
            out[f"{pre}mlp.down_proj.weight"] = slot(layer.mlp.down_proj.weight, 0, hid, dim1, rank * inter)
        whole(f"{pre}input_layernorm.weight", layer.input_layernorm.weight)
        whole(f"{pre}post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
    return out
