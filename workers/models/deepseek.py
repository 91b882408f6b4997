"""DeepSeek-V2 / DeepSeek-V3 decoder: multi-head latent attention (MLA) and DeepSeek's mixture of
experts, over a flat batch like workers/models/llama.py's DecoderLM (same interface: forward,
compute_logits, args/local_args/tp, the LoRA hook, fast_decode).

Attention (transformers' DeepseekV2Attention / DeepseekV3Attention):
  q = q_b_proj(q_a_layernorm(q_a_proj(x)))  (or q_proj(x) when q_lora_rank is None: V2-Lite)
      per head [qk_nope_head_dim | qk_rope_head_dim], rope on the second part;
  kv_a_proj_with_mqa(x) = [c (kv_lora_rank) | k_pe (qk_rope_head_dim, one for all heads)],
      c normed by kv_a_layernorm, k_pe roped;
  kv_b_proj(c) = per head [k_nope | v]; scores (q_nope.k_nope + q_pe.k_pe) * softmax_scale.
The cache keeps only [c | k_pe] per token (``kv_layout``: workers/attention/mla.py), and decodes
absorb kv_b_proj into the query and the output (see there).

RoPE on the rope part (``DeepseekRope``): DeepSeek's dimensions come in interleaved pairs (x0, x1),
(x2, x3) ... (V2's complex rotation; V3 with ``rope_interleave``), each pair rotated by one
frequency; YaRN (``rope_scaling.type: yarn``) changes the frequencies and multiplies cos/sin by its
mscale, and ``mscale_all_dim`` scales the softmax (workers/models/deepseek_config.py). The rotated
query and key are kept de-interleaved ([evens | odds], transformers' V3 layout): both the same way,
so their dot products are those of the interleaved vectors.

Feed-forward: a dense SwiGLU on layers < first_k_dense_replace (and where moe_layer_freq skips),
else workers/models/moe.py's SparseMoE with DeepSeek's router (workers/models/deepseek_routing.py)
and ``n_shared_experts`` shared experts as one dense SwiGLU of ``moe_intermediate_size *
n_shared_experts``. The MTP head (``num_nextn_predict_layers``) is not built: its tensors are
skipped at load (logged).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelArgs
from .deepseek_config import DeepseekArgs
from .deepseek_routing import DeepseekRouter
from .llama import MLP, Embedding, Linear, RMSNorm
from .lora import LoraHook
from .moe import DEEPSEEK_NAMES, MoeShard, SparseMoE
from .moe import slots as moe_slots

if TYPE_CHECKING:
    from .sharding import TensorParallel

__all__ = ["DeepseekLM", "DeepseekRope", "kv_bytes_per_token", "param_slots", "rope_inv_freq", "yarn_inv_freq"]


def rope_inv_freq(ds: DeepseekArgs) -> torch.Tensor:
    """Inverse frequencies [qk_rope_head_dim / 2] in fp32: plain, or YaRN (``yarn_inv_freq``)."""
    return yarn_inv_freq(ds.qk_rope_head_dim, ds.rope_theta, ds.yarn)


def yarn_inv_freq(dim: int, base: float, yarn: tuple[float, float, float, int, bool] | None) -> torch.Tensor:
    """Inverse frequencies [dim / 2] in fp32: plain (``yarn`` None), or YaRN exactly as transformers'
    ``_compute_yarn_parameters``; ``yarn``: (factor, beta_fast, beta_slow, original max positions,
    truncate). GPT-OSS's rope uses it too (workers/models/gpt_oss.py)."""
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if yarn is None:
        return 1.0 / pos_freqs
    factor, beta_fast, beta_slow, orig, truncate = yarn

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class DeepseekRope(nn.Module):
    """cos/sin tables [max_positions, rope/2] in fp32 (YaRN's mscale folded in) and the rotation of
    interleaved pairs (or NeoX halves for V3 with ``rope_interleave: false``)."""

    def __init__(self, ds: DeepseekArgs, max_positions: int) -> None:
        super().__init__()
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * rope_inv_freq(ds)[None, :]
        self.cos = freqs.cos() * ds.rope_attention_factor
        self.sin = freqs.sin() * ds.rope_attention_factor
        self.interleave = ds.rope_interleave
        self.fp32 = ds.version == 2  # V2 rotates as complex fp32 numbers, then casts back

    def to_device(self, device: torch.device | str) -> None:
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, rope] -> rotated, de-interleaved when ``interleave``."""
        if self.cos.device != positions.device:
            self.to_device(positions.device)
        dt = torch.float32 if self.fp32 else x.dtype
        cos, sin = self.cos[positions].to(dt)[:, None], self.sin[positions].to(dt)[:, None]
        xf = x.to(dt)
        if self.interleave:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
        else:
            x1, x2 = xf.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class MlaAttention(nn.Module):
    """One layer's multi-head latent attention (module docstring); ``attn.mla`` does the cache."""

    def __init__(self, args: ModelArgs, layer_idx: int, dtype: torch.dtype | None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        ds = args.deepseek
        assert ds is not None
        self.layer_idx, self.reduce, self.ds = layer_idx, reduce, ds
        h, hid = args.num_attention_heads, args.hidden_size  # this rank's heads
        self.n_heads = h
        bias = args.attention_bias
        if ds.q_lora_rank is None:
            self.q_proj = Linear(hid, h * ds.qk_head_dim, bias=False, dtype=dtype)
        else:
            self.q_a_proj = Linear(hid, ds.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(ds.q_lora_rank, 1e-6, dtype)  # transformers' default eps here
            self.q_b_proj = Linear(ds.q_lora_rank, h * ds.qk_head_dim, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(hid, ds.latent_width, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(ds.kv_lora_rank, 1e-6, dtype)
        # A plain parameter, not a Linear: the decode uses it in the latent space (absorbed), so
        # backends must not repack it.
        self.kv_b_proj = nn.Parameter(torch.empty(h * (ds.qk_nope_head_dim + ds.v_head_dim), ds.kv_lora_rank,
                                                  dtype=dtype), requires_grad=False)
        self.o_proj = Linear(h * ds.v_head_dim, hid, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: DeepseekRope, attn) -> torch.Tensor:
        ds, t = self.ds, x.shape[0]
        if ds.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.n_heads, ds.qk_head_dim)
        q_nope, q_pe = q.split([ds.qk_nope_head_dim, ds.qk_rope_head_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([ds.kv_lora_rank, ds.qk_rope_head_dim], dim=-1)
        latent = torch.cat((self.kv_a_layernorm(c), rope(positions, k_pe[:, None])[:, 0]), dim=-1)
        o = attn.mla(self.layer_idx, q_nope, rope(positions, q_pe), latent, self.kv_b_proj, ds.qk_nope_head_dim,
                     ds.softmax_scale)
        out = self.o_proj(o.reshape(t, self.n_heads * ds.v_head_dim))
        return out if self.reduce is None else self.reduce(out)


class DeepseekLayer(nn.Module):
    """Pre-norm block: x + mla(norm(x)), then h + ffn(norm(h)) (dense SwiGLU or SparseMoE)."""

    def __init__(self, args: ModelArgs, local: ModelArgs, layer_idx: int, dtype: torch.dtype | None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None, moe_shard: MoeShard | None) -> None:
        super().__init__()
        ds = args.deepseek
        assert ds is not None
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.self_attn = MlaAttention(local, layer_idx, dtype, reduce)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.mlp: nn.Module
        if ds.is_moe_layer(layer_idx):
            shared = ds.moe_intermediate_size * ds.n_shared_experts
            self.mlp = SparseMoE(args.hidden_size, ds.n_routed_experts, ds.num_experts_per_tok,
                                 ds.moe_intermediate_size, dtype, router=DeepseekRouter(ds, args.hidden_size),
                                 shared_inter=shared, shard=moe_shard, reduce=reduce)
        else:
            self.mlp = MLP(local, dtype, reduce, layer_idx)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: DeepseekRope, attn) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), positions, rope, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekLM(nn.Module):
    """DeepSeek-V2/V3 causal LM over a flat batch (the DecoderLM interface; module docstring)."""

    # workers/backends/cpu_decode.py: the fused Llama decode kernel does not cover MLA.
    fused_decode_refusal = "multi-head latent attention (DeepSeek)"

    def __init__(self, args: ModelArgs, dtype: torch.dtype | None = None, max_positions: int | None = None,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        ds = args.deepseek
        assert ds is not None
        self.args, self.tp = args, tp
        local = tp.shard.local_args(args) if tp is not None else args
        self.local_args = local
        reduce = tp.all_reduce if tp is not None else None
        # The experts this rank holds (ModelConfig moeParallel "tp" or "ep": sharding.plan_shard).
        moe_shard = tp.shard.moe if tp is not None else None
        self.lora = LoraHook()  # never set: LoRA adapters are refused for DeepSeek (lora_manager)
        self.embed_tokens = Embedding(local.vocab_size, args.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DeepseekLayer(args, local, i, dtype, reduce, moe_shard)
                                    for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.lm_head = None if args.tie_word_embeddings else Linear(args.hidden_size, local.vocab_size, bias=False,
                                                                     dtype=dtype)
        self.logits_linear = None
        self.fast_decode: Callable | None = None
        self.rope = DeepseekRope(ds, max_positions or args.max_position_embeddings)

    @property
    def kv_layout(self) -> tuple[str, tuple[int, int, int]]:
        """The KV cache this model needs: ("mla", (layers, 1, latent width)); the engine assembly
        allocates and sizes it with workers.attention.for_layout("mla") (the latent cache)."""
        return "mla", (self.args.num_hidden_layers, 1, self.args.deepseek.latent_width)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return self.args.layer_windows

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if self.tp is None else self.tp.embed(self.embed_tokens.weight, input_ids)
        for layer in self.layers:
            x = layer(x, positions, self.rope, attn)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits_linear is not None:
            logits = self.logits_linear(hidden).float()
        elif self.lm_head is not None:
            logits = self.lm_head(hidden).float()
        else:
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        return logits if self.tp is None else self.tp.gather_logits(logits)


def kv_bytes_per_token(args: ModelArgs, elem: int) -> tuple[int, int]:
    """(bytes of the latent cache per token, bytes full per-head K and V would take), all layers."""
    ds = args.deepseek
    assert ds is not None
    full = args.num_attention_heads * (ds.qk_head_dim + ds.v_head_dim)
    return args.num_hidden_layers * ds.latent_width * elem, args.num_hidden_layers * full * elem


# ------------------------------------------------------------------------ checkpoint


def param_slots(model: DeepseekLM, slot: Callable[..., object], shard=None) -> dict[str, object]:
    """HF name -> loader.Slot for every name of ``expected_tensors`` (``slot``: loader.Slot).
    With a tensor-parallel ``shard``: heads of q_b/q/kv_b and o's input columns are split, the
    latent projections (q_a, kv_a) and norms are replicated, dense MLPs as the Llama family's."""
    a = model.args
    ds = a.deepseek
    assert ds is not None
    hid = a.hidden_size
    slots: dict[str, object] = {}

    def whole(name: str, p: torch.Tensor) -> None:
        slots[name] = slot(p, 0, p.shape[0])

    def heads_rows(name: str, p: torch.Tensor, per_head: int) -> None:  # column-parallel by heads
        if shard is None:
            whole(name, p)
        else:
            slots[name] = slot(p, 0, p.shape[0], 0, shard.head0 * per_head)

    def row(name: str, lin: nn.Module) -> None:  # row-parallel (o, down): input columns; bias on rank 0
        n_in = lin.weight.shape[1]
        slots[f"{name}.weight"] = slot(lin.weight, 0, hid, 1 if shard else None, shard.rank * n_in if shard else 0)
        if lin.bias is not None:
            slots[f"{name}.bias"] = slot(lin.bias, 0, hid, zero=bool(shard and shard.rank))

    def vocab(name: str, p: torch.Tensor) -> None:
        if shard is None:
            whole(name, p)
        else:
            slots[name] = slot(p, 0, shard.vocab_rows, 0, shard.vocab0)

    vocab("model.embed_tokens.weight", model.embed_tokens.weight)
    whole("model.norm.weight", model.norm.weight)
    if model.lm_head is not None:
        vocab("lm_head.weight", model.lm_head.weight)
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        at, p = layer.self_attn, f"{pre}self_attn."
        if ds.q_lora_rank is None:
            heads_rows(f"{p}q_proj.weight", at.q_proj.weight, ds.qk_head_dim)
        else:
            whole(f"{p}q_a_proj.weight", at.q_a_proj.weight)
            if at.q_a_proj.bias is not None:
                whole(f"{p}q_a_proj.bias", at.q_a_proj.bias)
            whole(f"{p}q_a_layernorm.weight", at.q_a_layernorm.weight)
            heads_rows(f"{p}q_b_proj.weight", at.q_b_proj.weight, ds.qk_head_dim)
        whole(f"{p}kv_a_proj_with_mqa.weight", at.kv_a_proj_with_mqa.weight)
        if at.kv_a_proj_with_mqa.bias is not None:
            whole(f"{p}kv_a_proj_with_mqa.bias", at.kv_a_proj_with_mqa.bias)
        whole(f"{p}kv_a_layernorm.weight", at.kv_a_layernorm.weight)
        heads_rows(f"{p}kv_b_proj.weight", at.kv_b_proj, ds.qk_nope_head_dim + ds.v_head_dim)
        row(f"{p}o_proj", at.o_proj)
        mlp = layer.mlp
        if isinstance(mlp, SparseMoE):
            slots.update(moe_slots(mlp, pre, DEEPSEEK_NAMES, slot, sharded=shard is not None))
            if mlp.gate.e_score_correction_bias is not None:
                whole(f"{pre}mlp.gate.e_score_correction_bias", mlp.gate.e_score_correction_bias)
        else:
            inter = mlp.intermediate_size
            i0 = shard.rank * inter if shard else 0
            for proj, start in (("gate_proj", 0), ("up_proj", inter)):
                slots[f"{pre}mlp.{proj}.weight"] = slot(mlp.gate_up_proj.weight, start, inter,
                                                        0 if shard else None, i0)
            row(f"{pre}mlp.down_proj", mlp.down_proj)
        whole(f"{pre}input_layernorm.weight", layer.input_layernorm.weight)
        whole(f"{pre}post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
    return slots
