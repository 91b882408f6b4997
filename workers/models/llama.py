"""One readable Llama-family decoder (Llama 2/3/3.1, Qwen2/2.5, Qwen3, Mistral; and the mixtures of
experts built on their attention, Qwen2-MoE, Qwen3-MoE, Mixtral, whose sparse layers are
workers/models/moe.py's SparseMoE) in plain torch.

The model runs over a FLAT batch: the tokens of many sequences (prefill chunks and decode steps
alike) are concatenated into one `[T]` tensor with their absolute `positions`. Everything except
attention is position-wise, so the model never needs to know where sequences start or end; the
attention object passed to `forward` does (it owns the KV cache and the sequence boundaries).

Numerics follow transformers so that logits match it on the same weights: RMSNorm is computed in
fp32 and cast back before the weight multiply, cos/sin are computed in fp32 and cast to the
activation dtype before being applied.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelArgs, RopeScaling
from .lora import DOWN, GATE_UP, O, QKV, LoraHook
from .moe import MoeShard, SparseMoE

if TYPE_CHECKING:
    from .sharding import TensorParallel

__all__ = ["Attention", "DecoderLM", "RMSNorm", "RotaryEmbedding", "rope_inv_freq"]


class Attention(Protocol):
    """What `DecoderLM.forward` calls once per layer.

    q: [T, n_heads, head_dim]; k, v: [T, n_kv_heads, head_dim] (rope already applied to q, k);
    window: sliding-window size for this layer or None. A query at position p may attend to keys
    at positions max(0, p - window + 1) .. p of its own sequence (transformers' convention).
    Returns [T, n_heads, head_dim]. ``sinks`` (GPT-OSS): a logit per query head [n_heads] in every
    softmax's denominator. The softmax scale is ``scale`` (None: 1/sqrt(head_dim)); ``softcap``
    (Gemma 2): scores become softcap * tanh(scores / softcap) before the softmax.
    """

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, *,
        sinks: torch.Tensor | None = None, scale: float | None = None, softcap: float | None = None
    ) -> torch.Tensor: ...


class Linear(nn.Linear):
    """nn.Linear without random init: every weight is overwritten by the checkpoint anyway, and
    skipping init keeps construction on the meta device free (no torch._refs import)."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """nn.Embedding without random init (see Linear)."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    """RMSNorm as transformers computes it: normalise in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op instead of seven. It normalises in fp32 as transformers does; in bf16/fp16
        # it rounds once at the end where transformers rounds before the weight multiply
        # (within the half-precision tolerances of tests/test_models.py).
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in fp32, with Llama 3.1 / linear scaling exactly as
    transformers' `_compute_llama3_parameters` / `_compute_linear_scaling_rope_parameters`, and
    llama.cpp's per-frequency factors (a GGUF's `rope_freqs`) as llama.cpp applies them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "freq_factors":  # llama.cpp's rope_freqs: theta_i / factors[i]
        return inv_freq / torch.tensor(scaling.factors, dtype=torch.float32)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type != "llama3":
        raise ValueError(f"unsupported rope_type {scaling.rope_type!r}")
    factor = scaling.factor
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed down by `factor`, short ones kept, and the
    # band in between is interpolated smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed fp32 cos/sin tables indexed by absolute position (NeoX "rotate half" layout).

    The tables are plain attributes, not buffers, so `model.to(torch.bfloat16)` cannot round them:
    they stay fp32 and only follow the device (moved on first use).
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        # Same op order as transformers (positions.float() * inv_freq, then cos/sin) so the values match.
        freqs = torch.arange(max_positions, dtype=torch.int64, device="cpu").float()[:, None] * inv_freq[None, :]
        self.cos = freqs.cos()  # [max_positions, head_dim/2]
        self.sin = freqs.sin()
        self.max_positions = max_positions
        self._key: tuple = (None, None)
        self._rows: tuple = ()

    def to_device(self, device: torch.device | str) -> None:
        """Move the tables (the loader calls this so the first forward does not pay for it)."""
        self.cos = self.cos.to(device)
        self.sin = self.sin.to(device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, H, D] and k [T, Hkv, D] by their token's position."""
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, D] (any number of heads) by its token's position."""
        if self.cos.device != positions.device:
            self.to_device(positions.device)
        # Every layer of one forward passes the same positions: look the rows up once.
        if positions is not self._key[0] or x.dtype != self._key[1]:
            self._key = (positions, x.dtype)
            self._rows = (self.cos[positions].to(x.dtype)[:, None, :],  # [T, 1, D/2]
                          self.sin[positions].to(x.dtype)[:, None, :])
        cos, sin = self._rows
        return _rotate(x, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Equal, op for op, to transformers' x*cat(cos,cos) + rotate_half(x)*cat(sin,sin).
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class DecoderAttention(nn.Module):
    """q/k/v projection (fused into one matmul), optional q/k norm, rope, attention, o projection."""

    def __init__(self, args: ModelArgs, layer_idx: int, dtype: torch.dtype | None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, lora: LoraHook | None = None) -> None:
        """``reduce``: the all-reduce of a tensor-parallel rank's o-projection (row-parallel);
        ``lora``: the model's LoRA hook (workers/models/lora.py), read at every projection."""
        super().__init__()
        self.layer_idx = layer_idx
        self.reduce = reduce
        self.lora = lora if lora is not None else LoraHook()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.q_size, self.kv_size = args.q_size, args.kv_size
        self.window = args.layer_windows[layer_idx]
        # Rows are [q; k; v], the loader copies the three HF matrices into those slices.
        self.qkv_proj = Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.attention_bias, dtype=dtype)
        self.o_proj = Linear(self.q_size, args.hidden_size, bias=args.o_proj_bias, dtype=dtype)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps, dtype) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps, dtype) if args.qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, attn: Attention) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if (lora := self.lora.step) is not None:  # adapters' deltas, before the split and rope (as peft)
            lora.apply(self.layer_idx, QKV, x, qkv)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.n_kv_heads, self.head_dim)
        q, k = self.rotated_qk(qkv, positions, rope)
        h = attn(self.layer_idx, q, k, v, self.window).reshape(t, self.q_size)
        out = self.o_proj(h)
        if lora is not None:
            lora.apply(self.layer_idx, O, h, out)
        return out if self.reduce is None else self.reduce(out)


    def rotated_qk(self, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D] and k [T, Hkv, D] of the fused projection's output, normed (Qwen3) and roped
        (a family with its own rope or scale overrides it: workers/models/variant.py)."""
        t = qkv.shape[0]
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: per head, before rope
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(t, self.n_heads, self.head_dim))
            k = self.k_norm(k.view(t, self.n_kv_heads, self.head_dim))
            return rope(positions, q, k)
        # q and k are adjacent columns of one matmul output: rotate both in one pass.
        qk = qkv[:, :self.q_size + self.kv_size].view(t, self.n_heads + self.n_kv_heads, self.head_dim)
        q, k = rope.rotate(positions, qk).split([self.n_heads, self.n_kv_heads], dim=1)
        return q, k


class MLP(nn.Module):
    """SwiGLU feed-forward with gate and up fused into one matmul (rows [gate; up])."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype | None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, layer_idx: int = 0,
                 lora: LoraHook | None = None) -> None:
        super().__init__()
        self.reduce = reduce  # tensor parallel: the down projection is row-parallel
        self.layer_idx = layer_idx
        self.lora = lora if lora is not None else LoraHook()
        self.intermediate_size = args.intermediate_size
        self.gate_up_proj = Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias, dtype=dtype)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if (lora := self.lora.step) is None:
            out = self.down_proj(self.swiglu(gate_up))
        else:
            lora.apply(self.layer_idx, GATE_UP, x, gate_up)
            h = self.swiglu(gate_up)
            out = self.down_proj(h)
            lora.apply(self.layer_idx, DOWN, h, out)
        return out if self.reduce is None else self.reduce(out)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused projection's output (a backend may swap in one kernel)."""
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return F.silu(gate) * up


def sparse_moe(args: ModelArgs, dtype: torch.dtype | None, reduce: Callable[[torch.Tensor], torch.Tensor] | None,
               shard: MoeShard | None) -> SparseMoE:
    """The SparseMoE of one sparse layer of ``args`` (``args.moe`` set); ``shard``: this rank's part."""
    moe = args.moe
    assert moe is not None
    return SparseMoE(args.hidden_size, moe.num_experts, moe.top_k, moe.moe_intermediate_size, dtype,
                     norm_topk_prob=moe.norm_topk_prob, shared_inter=moe.shared_expert_intermediate_size,
                     shared_gate=moe.shared_expert_gate, shard=shard, reduce=reduce)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then h + mlp(norm(h)); ``mlp`` is a
    SparseMoE on the sparse layers of a mixture of experts (workers/models/moe.py)."""

    def __init__(self, args: ModelArgs, layer_idx: int, dtype: torch.dtype | None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, lora: LoraHook | None = None,
                 moe_shard: MoeShard | None = None) -> None:
        super().__init__()
        lora = lora if lora is not None else LoraHook()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.self_attn = DecoderAttention(args, layer_idx, dtype, reduce, lora)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.mlp: nn.Module
        if args.moe is not None and args.moe.sparse_layers[layer_idx]:
            self.mlp = sparse_moe(args, dtype, reduce, moe_shard)
        else:
            self.mlp = MLP(args, dtype, reduce, layer_idx, lora)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, attn: Attention) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), positions, rope, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderLM(nn.Module):
    """Llama-family causal LM over a flat batch of tokens.

    Parameters start uninitialised: build it with `workers.models.loader.load_model`.

    `forward(input_ids [T], positions [T], attn) -> hidden [T, hidden_size]` (after the final norm);
    `compute_logits(hidden [N, hidden_size]) -> fp32 logits [N, vocab_size]`. Callers select the
    rows they need (e.g. the last token of each sequence) before `compute_logits`, which is where
    most of the FLOPs of a small model go.

    With `tp` (workers/models/sharding.py) this is one rank of a tensor-parallel instance: its
    modules have the shard's shapes (`local_args`), and forward/compute_logits are collectives
    that every rank of the group calls with the same inputs.
    """

    def __init__(self, args: ModelArgs, dtype: torch.dtype | None = None, max_positions: int | None = None,
                 tp: TensorParallel | None = None) -> None:
        """`max_positions` caps the rope table (defaults to max_position_embeddings); pass the
        server's max sequence length to save memory on 128k-context models."""
        super().__init__()
        self.args = args
        self.tp = tp
        local = tp.shard.local_args(args) if tp is not None else args
        self.local_args = local
        reduce = tp.all_reduce if tp is not None else None
        # LoRA adapters of the current step (workers/models/lora.py): set by the model runner
        # around a forward that has adapter rows, read by every layer's projections.
        self.lora = LoraHook()
        self.embed_tokens = Embedding(local.vocab_size, args.hidden_size, dtype=dtype)
        moe_shard = tp.shard.moe if tp is not None else None
        self.layers = nn.ModuleList(self.make_layer(local, i, dtype, reduce, moe_shard)
                                    for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        # Tied checkpoints reuse the embedding matrix: no separate module, so nothing can untie it.
        self.lm_head = None if args.tie_word_embeddings else Linear(args.hidden_size, local.vocab_size, bias=False,
                                                                     dtype=dtype)
        if args.num_labels:  # a sequence-classification model: its `score` head is the one head
            if tp is not None:
                raise ValueError("a sequence-classification model is served on one device (worldSize 1)")
            self.lm_head = Linear(args.hidden_size, args.num_labels, bias=False, dtype=dtype)
        self.logits_linear = None
        # A device backend's whole-stack kernel for small decode steps (workers/backends/cpu_decode.py):
        # returns the hidden states, or None for a step it does not cover.
        self.fast_decode: Callable | None = None
        self.rope = self.make_rope(args, max_positions or args.max_position_embeddings)

    def make_layer(self, args: ModelArgs, i: int, dtype: torch.dtype | None,
                   reduce: Callable[[torch.Tensor], torch.Tensor] | None, moe_shard: MoeShard | None) -> nn.Module:
        """Layer ``i`` (a family whose block differs overrides it: workers/models/variant.py)."""
        return DecoderLayer(args, i, dtype, reduce, self.lora, moe_shard)

    def make_rope(self, args: ModelArgs, max_positions: int) -> nn.Module:
        """The rotary embedding every layer is passed (``rotate(positions, x)``)."""
        return RotaryEmbedding(args.head_dim, max_positions, args.rope_theta, args.rope_scaling)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Sliding window per layer (None = full attention), as passed to `attn`."""
        return self.args.layer_windows

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention) -> torch.Tensor:
        """input_ids, positions: LongTensor [T] (flat batch). Returns normed hidden states [T, hidden]."""
        # The whole-stack kernel computes the base model only: a step with adapter rows takes the eager path.
        if (self.fast_decode is not None and self.lora.step is None
                and (hidden := self.fast_decode(input_ids, positions, attn)) is not None):
            return hidden
        x = self.embed_tokens(input_ids) if self.tp is None else self.tp.embed(self.embed_tokens.weight, input_ids)
        for layer in self.layers:
            x = layer(x, positions, self.rope, attn)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> fp32 logits [N, vocab_size]."""
        if self.logits_linear is not None:  # a device backend's faster kernel (workers/backends)
            logits = self.logits_linear(hidden).float()
        elif self.lm_head is not None:
            logits = self.lm_head(hidden).float()
        else:
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        return logits if self.tp is None else self.tp.gather_logits(logits)
