"""GPT-OSS (``GptOssForCausalLM``) over a flat batch, as transformers' modeling_gpt_oss.py computes it.

Beside the Llama-family decoder (workers/models/llama.py, whose DecoderLM interface, fused q/k/v
projection with biases, o bias, RMSNorm and NeoX rope it reuses):

- attention sinks: one learned logit per query head in every softmax's denominator
  (``softmax([scores, sink])`` with the sink's column dropped); passed to the attention object as
  ``attn(layer, q, k, v, window, sinks=...)`` (workers/attention/paged.py);
- sliding-window and full layers alternating as ``layer_types`` says (ModelArgs.layer_windows);
- YaRN rope (transformers' ``_compute_yarn_parameters``: workers/models/deepseek.py's
  ``yarn_inv_freq``) with its attention factor folded into the cos/sin tables;
- its mixture of experts (``GptOssMoE``): a router with a bias, top-k of the logits then a softmax
  over the k chosen, every expert's gate/up product with interleaved columns (gate = even, up =
  odd) and biases, the clamped SwiGLU ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with
  ``g = clamp(gate, max=l)``, the down product with its bias. The stacked [E, in, out] weights are
  kept as the checkpoint stores them (workers/models/moe.py's SparseMoE has bias-free [gate; up]
  SwiGLU experts, a different product).

LoRA adapters and tensor parallelism are refused for GPT-OSS (assembly and sharding read the
reasons below). The CPU's fused decode step computes its attention halves (sinks included) and
stops at each layer's feed-forward norm for ``GptOssMoE`` (workers/backends/cpu_decode.py). With ``quantize: w8a16`` the
attention projections and the LM head become int8; the router and the stacked experts keep the
model dtype (the experts' products are not int8 kernels' shape).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import row_ops
from .config import ModelArgs
from .deepseek import yarn_inv_freq
from .llama import DecoderAttention, DecoderLM, Embedding, Linear, RMSNorm, RotaryEmbedding
from .lora import LoraHook

if TYPE_CHECKING:
    from .sharding import TensorParallel

__all__ = ["GptOssLM", "GptOssMoE", "GptOssRope", "GptOssRouter", "layer_slots"]



class GptOssRope(RotaryEmbedding):
    """The NeoX rotation with YaRN frequencies; cos/sin tables in fp32 times YaRN's attention factor
    (transformers multiplies cos and sin by it before casting them to the activation dtype)."""

    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        nn.Module.__init__(self)
        g = args.gpt_oss
        assert g is not None
        inv_freq = yarn_inv_freq(args.head_dim, g.rope_theta, g.yarn)
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        self.cos = freqs.cos() * g.rope_attention_factor
        self.sin = freqs.sin() * g.rope_attention_factor
        self.max_positions = max_positions
        self._key: tuple = (None, None)
        self._rows: tuple = ()


class SinkAttention(DecoderAttention):
    """The Llama-family attention layer with its per-head ``sinks`` logits passed to ``attn``."""

    def __init__(self, args: ModelArgs, layer_idx: int, dtype: torch.dtype | None) -> None:
        super().__init__(args, layer_idx, dtype)
        self.sinks = nn.Parameter(torch.empty(args.num_attention_heads, dtype=dtype))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, attn) -> torch.Tensor:
        return super().forward(x, positions, rope, functools.partial(attn, sinks=self.sinks))


class GptOssRouter(nn.Module):
    """The router's logits ``x @ weight.T + bias``. Not an nn.Linear, so that ``quantize: w8a16``
    (which turns a model's linears into int8) leaves the expert choice exact, as DeepSeek's router."""

    def __init__(self, hidden: int, experts: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(experts, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if row_ops.invariant():
            return row_ops.matmul(x, self.weight.t()) + self.bias
        return F.linear(x, self.weight, self.bias)


class GptOssMoE(nn.Module):
    """Router and experts of one GPT-OSS layer (module docstring); parameters named as the checkpoint's."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype | None) -> None:
        super().__init__()
        g = args.gpt_oss
        assert g is not None
        e, h, i = g.num_experts, args.hidden_size, args.intermediate_size
        self.top_k, self.alpha, self.limit = g.top_k, g.swiglu_alpha, g.swiglu_limit
        self.router = GptOssRouter(h, e, dtype)
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i, dtype=dtype))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(e, i, h, dtype=dtype))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)  # logits in the model dtype, as transformers
        weights = torch.softmax(top, dim=1, dtype=top.dtype)
        out = torch.zeros_like(x)
        # Rows sorted by expert: one product per activated expert over its rows, experts in
        # ascending order and rows in token order within each (transformers' loop order).
        flat = ids.view(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            rows = order[start:start + n]
            start += n
            tok = rows // self.top_k
            gate_up = row_ops.matmul(x[tok], self.gate_up_proj[e]) + self.gate_up_proj_bias[e]
            h = row_ops.matmul(self.glu(gate_up), self.down_proj[e]) + self.down_proj_bias[e]
            out.index_add_(0, tok, (h * weights.view(-1)[rows, None]).to(x.dtype))
        return out

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The clamped SwiGLU of interleaved [gate, up] columns."""
        return row_ops.rowwise(self._glu, gate_up[..., ::2], gate_up[..., 1::2])

    def _glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GptOssLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + moe(norm(h))."""

    def __init__(self, args: ModelArgs, layer_idx: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.self_attn = SinkAttention(args, layer_idx, dtype)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.mlp = GptOssMoE(args, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, attn) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), positions, rope, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class GptOssLM(DecoderLM):
    """GPT-OSS causal LM: DecoderLM's forward and logits over GPT-OSS layers (module docstring)."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype | None = None, max_positions: int | None = None,
                 tp: TensorParallel | None = None) -> None:
        nn.Module.__init__(self)
        if tp is not None:  # sharding.plan_shard refuses it first, naming the key
            raise ValueError("tensor parallelism is not supported for GPT-OSS")
        self.args, self.tp, self.local_args = args, None, args
        self.lora = LoraHook()  # never set: LoRA adapters are refused for GPT-OSS (assembly)
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(GptOssLayer(args, i, dtype) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.lm_head = None if args.tie_word_embeddings else Linear(args.hidden_size, args.vocab_size, bias=False,
                                                                     dtype=dtype)
        self.logits_linear = None
        self.fast_decode: Callable | None = None
        self.rope = GptOssRope(args, max_positions or args.max_position_embeddings)


def layer_slots(layer: GptOssLayer, pre: str, slot: Callable[..., object]) -> dict[str, object]:
    """HF name -> loader.Slot for the router, experts and sinks of one layer (``pre``: its prefix)."""
    m = layer.mlp
    sinks = layer.self_attn.sinks
    out = {f"{pre}self_attn.sinks": slot(sinks, 0, sinks.shape[0])}
    for name, p in (("router.weight", m.router.weight), ("router.bias", m.router.bias),
                    ("experts.gate_up_proj", m.gate_up_proj), ("experts.gate_up_proj_bias", m.gate_up_proj_bias),
                    ("experts.down_proj", m.down_proj), ("experts.down_proj_bias", m.down_proj_bias)):
        out[f"{pre}mlp.{name}"] = slot(p, 0, p.shape[0])
    return out
