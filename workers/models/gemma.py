"""Gemma 2 and Gemma 3 (text) decoders over a flat batch, with workers/models/llama.py's DecoderLM
interface (forward, compute_logits, args/local_args/tp, lora, fast_decode, rope, layer_windows).

What Gemma computes differently from Llama, op for op as transformers 5.25's Gemma2/Gemma3
modeling files (their keys: workers/models/gemma_config.py):

- RMSNorm ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` all in fp32, cast back at the end (Llama casts
  before the weight); the weights start at zero;
- the embedding times sqrt(hidden_size), the factor rounded to the model dtype first;
- GeGLU feed-forward: gelu (tanh approximation) of the gate times up;
- four norms per layer: before and after attention, before and after the feed-forward, the
  residual added after the "post" norms;
- q/k norms per head before rope (Gemma 3);
- the softmax scale ``query_pre_attn_scalar ** -0.5``; attention logits soft-capped (Gemma 2:
  ``attn_logit_softcapping``), passed to the attention object as ``scale=`` / ``softcap=``;
- sliding-window and global layers (``layer_windows``), each kind with its own rope (Gemma 3: the
  local base for sliding layers, the global base with its scaling for global ones);
- final logits soft-capped (``final_logit_softcapping``), in the model dtype as transformers.

The classes are Gemma's own (not subclasses of llama.py's RMSNorm / MLP / RotaryEmbedding) so a
backend's swaps for the Llama modules (workers/backends/cpu_fused.py) leave them alone. The CPU's
fused decode step (workers/backends/cpu_decode.py) computes both versions' layers too (the (1 + w)
norms, GeGLU, Gemma 3's q/k norms, per-layer ropes, the scaled embedding and Gemma 2's soft-capped
attention scores, which the CPU's attention kernels cap as they go).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import row_ops
from .config import ModelArgs
from .llama import Embedding, Linear, RotaryEmbedding
from .lora import LoraHook

if TYPE_CHECKING:
    from .sharding import TensorParallel

__all__ = ["GemmaLM", "GemmaRMSNorm", "capped_logits", "norm_slots", "GGUF_NORM_OFFSET"]

# llama.cpp stores Gemma's norm weights as 1 + w (convert_hf_to_gguf.py); the loader subtracts it, as
# transformers' GGUF loader does (Gemma2TensorProcessor).
GGUF_NORM_OFFSET = 1.0


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: normalised and scaled by (1 + w) in fp32, then cast back."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class LayerRopes(nn.Module):
    """The rope of each layer kind: ``local`` for sliding-window layers, ``glob`` for global ones
    (the same object for Gemma 2). Not a RotaryEmbedding itself: backends swap only those."""

    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        g = args.gemma
        assert g is not None
        self.glob = RotaryEmbedding(args.head_dim, max_positions, args.rope_theta, args.rope_scaling)
        same = g.local_rope_theta == args.rope_theta and g.local_rope_scaling == args.rope_scaling
        self.local = self.glob if same else RotaryEmbedding(args.head_dim, max_positions, g.local_rope_theta,
                                                            g.local_rope_scaling)
        self.max_positions = max_positions

    def to_device(self, device: torch.device | str) -> None:
        self.glob.to_device(device)
        self.local.to_device(device)

    def of(self, window: int | None) -> RotaryEmbedding:
        return self.glob if window is None else self.local


class GemmaAttention(nn.Module):
    """q/k/v (one fused matmul, rows [q; k; v]), q/k norms (Gemma 3), rope, attention, o."""

    def __init__(self, args: ModelArgs, layer_idx: int, dtype: torch.dtype | None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        g = args.gemma
        assert g is not None
        self.layer_idx, self.reduce = layer_idx, reduce
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.q_size, self.kv_size = args.q_size, args.kv_size
        self.window = args.layer_windows[layer_idx]
        self.scale, self.softcap = g.scale, g.attn_logit_softcapping
        self.qkv_proj = Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.attention_bias, dtype=dtype)
        self.o_proj = Linear(self.q_size, args.hidden_size, bias=args.o_proj_bias, dtype=dtype)
        self.q_norm = GemmaRMSNorm(self.head_dim, args.rms_norm_eps, dtype) if args.qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, args.rms_norm_eps, dtype) if args.qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, attn) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.n_heads, self.head_dim)
        k = k.view(t, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        h = attn(self.layer_idx, q, k, v.view(t, self.n_kv_heads, self.head_dim), self.window, scale=self.scale,
                 softcap=self.softcap).reshape(t, self.q_size)
        out = self.o_proj(h)
        return out if self.reduce is None else self.reduce(out)


def _geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


class GemmaMLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate) * up), gate and up fused into one matmul (rows [gate; up])."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype | None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.reduce = reduce
        self.intermediate_size = args.intermediate_size
        self.gate_up_proj = Linear(args.hidden_size, 2 * args.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=False, dtype=dtype)

    def geglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up of ``[gate | up]`` columns (a backend may set its own: cpu_fused.CpuSwiGLU)."""
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return row_ops.rowwise(_geglu, gate, up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.geglu(self.gate_up_proj(x)))
        return out if self.reduce is None else self.reduce(out)


class GemmaLayer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then h + post_ff_norm(mlp(pre_ff_norm(h)))."""

    def __init__(self, args: ModelArgs, layer_idx: int, dtype: torch.dtype | None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        hid, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hid, eps, dtype)
        self.self_attn = GemmaAttention(args, layer_idx, dtype, reduce)
        self.post_attention_layernorm = GemmaRMSNorm(hid, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hid, eps, dtype)
        self.mlp = GemmaMLP(args, dtype, reduce)
        self.post_feedforward_layernorm = GemmaRMSNorm(hid, eps, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, attn) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, rope, attn))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaLM(nn.Module):
    """Gemma 2/3 causal LM over a flat batch (the DecoderLM interface; module docstring)."""

    # workers/engine/assembly.py: the layers read no LoRA hook.
    lora_refusal = "LoRA adapters are not served for Gemma models"

    def __init__(self, args: ModelArgs, dtype: torch.dtype | None = None, max_positions: int | None = None,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        assert args.gemma is not None
        self.args, self.tp = args, tp
        local = tp.shard.local_args(args) if tp is not None else args
        self.local_args = local
        reduce = tp.all_reduce if tp is not None else None
        self.lora = LoraHook()  # never set (lora_refusal)
        self.embed_tokens = Embedding(local.vocab_size, args.hidden_size, dtype=dtype)
        self.embed_scale = args.hidden_size ** 0.5
        self.layers = nn.ModuleList(GemmaLayer(local, i, dtype, reduce) for i in range(args.num_hidden_layers))
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.lm_head = None if args.tie_word_embeddings else Linear(args.hidden_size, local.vocab_size, bias=False,
                                                                     dtype=dtype)
        self.logits_linear = None
        self.fast_decode: Callable | None = None
        self.rope = LayerRopes(args, max_positions or args.max_position_embeddings)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return self.args.layer_windows

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        if self.fast_decode is not None and (hidden := self.fast_decode(input_ids, positions, attn)) is not None:
            return hidden  # a decode step the CPU's fused step covers: the same normed hidden states
        x = self.embed_tokens(input_ids) if self.tp is None else self.tp.embed(self.embed_tokens.weight, input_ids)
        # transformers: a tensor sqrt(hidden) cast to the weights' dtype, then the product
        x = x * torch.tensor(self.embed_scale).to(x.dtype)
        for layer in self.layers:
            x = layer(x, positions, self.rope.of(layer.self_attn.window), attn)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> fp32 logits [N, vocab_size], soft-capped where the model says."""
        logits = capped_logits(self, hidden, self.args.gemma.final_logit_softcapping).float()
        return logits if self.tp is None else self.tp.gather_logits(logits)


def capped_logits(model: nn.Module, hidden: torch.Tensor, cap: float | None) -> torch.Tensor:
    """The LM head's logits of ``hidden`` (``logits_linear``, ``lm_head`` or the tied embedding) in
    the model dtype, soft-capped ``tanh(v / cap) * cap`` when ``cap`` is set, as transformers."""
    if model.logits_linear is not None:
        logits = model.logits_linear(hidden)
    elif model.lm_head is not None:
        logits = model.lm_head(hidden)
    else:
        logits = F.linear(hidden, model.embed_tokens.weight)
    if cap is not None:  # per vocabulary column: a tensor-parallel rank caps its own slice
        logits = row_ops.rowwise(lambda v: torch.tanh(v / cap) * cap, logits)
    return logits


def norm_slots(model: GemmaLM, slot: Callable[..., object]) -> dict[str, object]:
    """loader.Slot of the norms a Gemma layer has beyond a Llama one (``slot``: loader.Slot)."""
    out: dict[str, object] = {}
    for i, layer in enumerate(model.layers):
        for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            p = getattr(layer, name).weight
            out[f"model.layers.{i}.{name}.weight"] = slot(p, 0, p.shape[0])
    return out
