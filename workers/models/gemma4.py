"""Gemma 4 (text) decoder over a flat batch, with workers/models/llama.py's DecoderLM interface
(forward, compute_logits, args/local_args/tp, lora, fast_decode, rope, layer_windows), op for op
as transformers 5.25's ``Gemma4TextModel`` (its keys: workers/models/gemma4_config.py):

- RMSNorm ``x * (mean(x^2) + eps) ** -0.5 * w`` in fp32 (w, not Gemma 2/3's 1 + w; v_norm has no
  weight), cast back last;
- per layer type its head geometry (the full layers' ``global_head_dim`` and KV heads), its rope
  (sliding: default; full: "proportional", the rotated share of each half at the head's full
  dimension, the rest of the frequencies zero: cos 1, sin 0, the values kept exactly) and its window;
- q/k/v norms per head; ``attention_k_eq_v``: a full layer's values are its keys' projection
  (before the k norm and rope) through the v norm; softmax scale 1;
- KV sharing: a shared layer (the last ``num_kv_shared_layers``) computes queries only and attends
  over the KV cache of its source layer (the attention object is called with the source's cache
  index and the source's k/v rows of this step, so it rewrites the same values in the same slots:
  a shared layer owns no KV blocks);
- per-layer input embeddings: ``embed_tokens_per_layer`` (times sqrt(ple_dim)) plus the normed
  ``per_layer_model_projection`` of the embedding (times hidden ** -0.5), times 2 ** -0.5; each layer
  adds ``post_per_layer_input_norm(per_layer_projection(gelu(per_layer_input_gate(h)) * ple_i))``;
- four norms around attention and MLP, the layer's output times ``layer_scalar``, the embedding times
  sqrt(hidden) (rounded to the model dtype), final logits soft-capped;
- ``enable_moe_block``: routed experts beside the MLP (workers/models/gemma4_moe.py), with three more
  norms: ``post_ff_norm(post_ff_norm_1(mlp) + post_ff_norm_2(experts(pre_ff_norm_2(h))))``.

The KV cache: ``kv_layout`` ("per_kind", geometries) gives one cache geometry (layers, KV heads,
head_dim) per distinct head geometry of the writing layers (workers/attention/split.py), each layer
its ``cache_index`` in that numbering (docs/design.md, "Gemma 4").
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from . import row_ops
from .config import ModelArgs
from .gemma import GemmaMLP, _geglu, capped_logits
from .gemma4_config import LayerRope
from .gemma4_moe import Gemma4MoE, Gemma4Router, moe_slots
from .llama import Embedding, Linear, RotaryEmbedding
from .lora import LoraHook

if TYPE_CHECKING:
    from .sharding import TensorParallel

__all__ = ["Gemma4LM", "param_slots"]


class Gemma4RMSNorm(nn.Module):
    """Gemma 4's RMSNorm: ``x * pow(mean(x^2) + eps, -0.5) [* w]`` in fp32, then cast back."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None, with_scale: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype)) if with_scale else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.type_as(x)


def inv_freq(rope: LayerRope, head_dim: int) -> torch.Tensor:
    """The rope's inverse frequencies [head_dim / 2] as transformers computes them (default, or
    proportional: zeros past the rotated share)."""
    if rope.rope_type == "default":
        return 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    angles = int(rope.partial_rotary_factor * head_dim // 2)
    rot = 1.0 / (rope.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
    if head_dim // 2 > angles:
        rot = torch.cat((rot, torch.zeros(head_dim // 2 - angles, dtype=torch.float32)))
    return rot / rope.factor


class FreqRope(RotaryEmbedding):
    """A RotaryEmbedding over given inverse frequencies (the tables as RotaryEmbedding builds them)."""

    def __init__(self, freqs: torch.Tensor, max_positions: int) -> None:
        super().__init__(2, 1, 1.0, None)
        angles = torch.arange(max_positions, dtype=torch.int64, device="cpu").float()[:, None] * freqs[None, :]
        self.cos, self.sin, self.max_positions = angles.cos(), angles.sin(), max_positions


class KindRopes(nn.Module):
    """The rope of each layer type. Not a RotaryEmbedding itself: backends swap only those."""

    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        g = args.gemma4
        assert g is not None
        dims = {t: d for t, d in zip(g.layer_types, g.head_dims)}
        self.by_kind = {t: FreqRope(inv_freq(g.ropes[t], dims[t]), max_positions) for t in dims}
        self.max_positions = max_positions

    def to_device(self, device: torch.device | str) -> None:
        for r in self.by_kind.values():
            r.to_device(device)

    def of(self, kind: str) -> RotaryEmbedding:
        return self.by_kind[kind]


KvRows = dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> its k, v rows of this step


class Gemma4Attention(nn.Module):
    """q (and, unless KV-shared, k/v) projections, their norms, rope, attention (scale 1), o."""

    def __init__(self, args: ModelArgs, i: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        g = args.gemma4
        assert g is not None
        hid, eps, bias = args.hidden_size, args.rms_norm_eps, args.attention_bias
        self.layer_idx, self.kind, self.source = i, g.layer_types[i], g.kv_source[i]
        self.n_heads, self.n_kv, self.head_dim = args.num_attention_heads, g.kv_heads[i], g.head_dims[i]
        self.window = args.layer_windows[i]
        self.cache_index = i  # set by Gemma4LM (kv_layout's numbering)
        q = self.n_heads * self.head_dim
        self.q_proj = Linear(hid, q, bias=bias, dtype=dtype)
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps, dtype)
        self.k_proj = self.v_proj = self.k_norm = self.v_norm = None
        if not g.shared(i):
            self.k_proj = Linear(hid, self.n_kv * self.head_dim, bias=bias, dtype=dtype)
            self.v_proj = None if g.k_eq_v[i] else Linear(hid, self.n_kv * self.head_dim, bias=bias, dtype=dtype)
            self.k_norm = Gemma4RMSNorm(self.head_dim, eps, dtype)
            self.v_norm = Gemma4RMSNorm(self.head_dim, eps, dtype, with_scale=False)
        self.o_proj = Linear(q, hid, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, attn, kv: KvRows
                ) -> torch.Tensor:
        t = x.shape[0]
        q = rope.rotate(positions, self.q_norm(self.q_proj(x).view(t, self.n_heads, self.head_dim)))
        if self.k_proj is None:  # KV-shared: the source layer's rows (rewritten unchanged) and cache
            k, v = kv[self.source]
        else:
            raw = self.k_proj(x).view(t, self.n_kv, self.head_dim)
            v = raw if self.v_proj is None else self.v_proj(x).view(t, self.n_kv, self.head_dim)
            k, v = rope.rotate(positions, self.k_norm(raw)), self.v_norm(v)
            kv[self.layer_idx] = (k, v)
        h = attn(self.cache_index, q, k, v, self.window, scale=1.0)
        return self.o_proj(h.reshape(t, self.n_heads * self.head_dim))


class Gemma4Layer(nn.Module):
    """Attention and MLP inside their four norms, the per-layer input's residual, ``layer_scalar``."""

    def __init__(self, args: ModelArgs, i: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        g = args.gemma4
        assert g is not None
        hid, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = Gemma4RMSNorm(hid, eps, dtype)
        self.self_attn = Gemma4Attention(args, i, dtype)
        self.post_attention_layernorm = Gemma4RMSNorm(hid, eps, dtype)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hid, eps, dtype)
        self.mlp = GemmaMLP(dataclasses.replace(args, intermediate_size=g.intermediate[i]), dtype)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hid, eps, dtype)
        self.moe = self.post_feedforward_layernorm_1 = self.post_feedforward_layernorm_2 = None
        self.pre_feedforward_layernorm_2 = None
        if g.num_experts:
            router = Gemma4Router(hid, g.num_experts, g.top_k, Gemma4RMSNorm(hid, eps, dtype, with_scale=False), dtype)
            self.moe = Gemma4MoE(hid, g.num_experts, g.top_k, g.moe_intermediate_size, dtype, router=router)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(hid, eps, dtype)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(hid, eps, dtype)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(hid, eps, dtype)
        self.layer_scalar = nn.Parameter(torch.ones(1, dtype=dtype))
        self.per_layer_input_gate = self.per_layer_projection = self.post_per_layer_input_norm = None
        if g.ple_dim:
            self.per_layer_input_gate = Linear(hid, g.ple_dim, bias=False, dtype=dtype)
            self.per_layer_projection = Linear(g.ple_dim, hid, bias=False, dtype=dtype)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hid, eps, dtype)

    def forward(self, x: torch.Tensor, ple: torch.Tensor | None, positions: torch.Tensor, rope: RotaryEmbedding,
                attn, kv: KvRows) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, rope, attn, kv))
        m = self.mlp(self.pre_feedforward_layernorm(h))
        if self.moe is not None:  # experts routed on the residual, beside the MLP
            m = self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(
                self.moe.route(h, self.pre_feedforward_layernorm_2(h)))
        h = h + self.post_feedforward_layernorm(m)
        if ple is not None:
            gated = row_ops.rowwise(_geglu, self.per_layer_input_gate(h), ple)
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h * self.layer_scalar


class Gemma4LM(nn.Module):
    """Gemma 4 text causal LM over a flat batch (the DecoderLM interface; module docstring)."""

    # workers/backends/cpu_decode.py: the fused decode kernel computes Llama's layer only.
    fused_decode_refusal = "Gemma 4's layers (per-layer head dims, KV sharing, per-layer inputs)"
    # workers/engine/assembly.py: the layers read no LoRA hook.
    lora_refusal = "LoRA adapters are not served for Gemma 4 models"

    def __init__(self, args: ModelArgs, dtype: torch.dtype | None = None, max_positions: int | None = None,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        g = args.gemma4
        assert g is not None
        if tp is not None:
            raise ValueError(f"{args.model_type or args.arch}: tensor parallelism is not supported for Gemma 4 "
                             "(per-layer head geometries and KV sharing are not sharded)")
        self.args, self.tp, self.local_args = args, None, args
        self.lora = LoraHook()  # never set (lora_refusal)
        hid, n = args.hidden_size, args.num_hidden_layers
        self.embed_tokens = Embedding(args.vocab_size, hid, dtype=dtype)
        self.embed_scale = hid ** 0.5
        self.embed_tokens_per_layer = self.per_layer_model_projection = self.per_layer_projection_norm = None
        if g.ple_dim:
            self.embed_tokens_per_layer = Embedding(g.ple_vocab, n * g.ple_dim, dtype=dtype)
            self.per_layer_model_projection = Linear(hid, n * g.ple_dim, bias=False, dtype=dtype)
            self.per_layer_projection_norm = Gemma4RMSNorm(g.ple_dim, args.rms_norm_eps, dtype)
        self.layers = nn.ModuleList(Gemma4Layer(args, i, dtype) for i in range(n))
        self.norm = Gemma4RMSNorm(hid, args.rms_norm_eps, dtype)
        self.lm_head = None if args.tie_word_embeddings else Linear(hid, args.vocab_size, bias=False, dtype=dtype)
        self.logits_linear = None
        self.fast_decode: Callable | None = None
        self.rope = KindRopes(args, max_positions or args.max_position_embeddings)
        # the KV cache: one geometry per distinct (KV heads, head_dim) of the writing layers
        geoms: list[tuple[int, int]] = []
        count: dict[tuple[int, int], list[int]] = {}
        for i in range(n):
            if not g.shared(i):
                key = (g.kv_heads[i], g.head_dims[i])
                if key not in count:
                    geoms.append(key)
                    count[key] = []
                count[key].append(i)
        offsets, at = {}, 0
        for key in geoms:
            offsets[key] = at
            at += len(count[key])
        index = {i: offsets[key] + j for key in geoms for j, i in enumerate(count[key])}
        for layer in self.layers:
            layer.self_attn.cache_index = index[layer.self_attn.source]
        self.kv_layout = ("per_kind", tuple((len(count[k]), k[0], k[1]) for k in geoms))

    @property
    def kv_layers(self) -> int:
        """Layers that write a KV cache (a KV-shared layer reads its source's)."""
        return sum(n for n, _, _ in self.kv_layout[1])

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return self.args.layer_windows

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # transformers: a tensor sqrt(hidden) cast to the weights' dtype, then the product
        x = x * torch.tensor(self.embed_scale).to(x.dtype)
        ple = self._per_layer_inputs(input_ids, x)
        kv: KvRows = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, None if ple is None else ple[:, i], positions, self.rope.of(layer.self_attn.kind), attn, kv)
        return self.norm(x)

    def _per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """[T, layers, ple_dim]: (norm(projection(x) / sqrt(hidden)) + embedding * sqrt(ple_dim)) / sqrt(2)."""
        g = self.args.gemma4
        if not g.ple_dim:
            return None
        t, n = x.shape[0], self.args.num_hidden_layers
        tok = self.embed_tokens_per_layer(input_ids)
        tok = (tok * torch.tensor(g.ple_dim ** 0.5).to(tok.dtype)).reshape(t, n, g.ple_dim)
        proj = self.per_layer_model_projection(x) * self.args.hidden_size ** -0.5
        proj = self.per_layer_projection_norm(proj.reshape(t, n, g.ple_dim))
        return (proj + tok) * 2.0 ** -0.5

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> fp32 logits [N, vocab_size], soft-capped where the model says."""
        return capped_logits(self, hidden, self.args.gemma4.final_logit_softcapping).float()


def param_slots(model: Gemma4LM, slot: Callable[..., object]) -> dict[str, object]:
    """HF name -> loader.Slot (``slot``) of every tensor of workers/models/gemma4_names.py."""
    out: dict[str, object] = {}

    def whole(name: str, p: torch.Tensor | None) -> None:
        if p is not None:
            out[name] = slot(p, 0, p.shape[0])

    whole("model.embed_tokens.weight", model.embed_tokens.weight)
    whole("model.norm.weight", model.norm.weight)
    if model.lm_head is not None:
        whole("lm_head.weight", model.lm_head.weight)
    for name in ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm"):
        if getattr(model, name) is not None:
            whole(f"model.{name}.weight", getattr(model, name).weight)
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        whole(f"{pre}layer_scalar", layer.layer_scalar)
        att = layer.self_attn
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            lin = getattr(att, proj)
            if lin is not None:
                whole(f"{pre}self_attn.{proj}.weight", lin.weight)
                whole(f"{pre}self_attn.{proj}.bias", lin.bias)
        for norm in ("q_norm", "k_norm"):
            if getattr(att, norm) is not None:
                whole(f"{pre}self_attn.{norm}.weight", getattr(att, norm).weight)
        inter = layer.mlp.intermediate_size
        w = layer.mlp.gate_up_proj.weight
        out[f"{pre}mlp.gate_proj.weight"] = slot(w, 0, inter)
        out[f"{pre}mlp.up_proj.weight"] = slot(w, inter, inter)
        whole(f"{pre}mlp.down_proj.weight", layer.mlp.down_proj.weight)
        if layer.moe is not None:
            out.update(moe_slots(layer.moe, pre, slot))
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "per_layer_input_gate", "per_layer_projection",
                     "post_per_layer_input_norm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                     "pre_feedforward_layernorm_2"):
            if getattr(layer, name) is not None:
                whole(f"{pre}{name}.weight", getattr(layer, name).weight)
    return out
