"""DeepSeek-V2 / DeepSeek-V3 hyper-parameters: multi-head latent attention (MLA), its RoPE
(YaRN with mscale), and the routing of its mixture of experts, read from a Hugging Face
``config.json`` (the hub's own layout, or transformers 5's ``rope_parameters``).

``ModelArgs.from_dict`` (workers/models/config.py) calls ``parse_deepseek`` for the
``deepseek_v2`` / ``deepseek_v3`` model types and keeps the result in ``ModelArgs.deepseek``; the
model is workers/models/deepseek.py. Torch-free, like config.py.

Semantics follow transformers 5.24's DeepseekV2/V3 modelling (the reference of the tests), with
DeepSeek's own code where transformers leaves a key unread: ``moe_layer_freq`` (a layer i >=
``first_k_dense_replace`` is MoE when ``i % moe_layer_freq == 0``; the released configs say 1, so
every such layer) and V2's ``norm_topk_prob`` (applied when true; false in the released V2 configs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .config_values import config_int

__all__ = ["DeepseekArgs", "is_mtp_tensor", "parse_deepseek", "yarn_mscale"]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude correction (``yarn_get_mscale``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class DeepseekArgs:
    """What a DeepSeek-V2/V3 model needs beyond the Llama-family fields of ModelArgs."""

    version: int  # 2 or 3
    # -- multi-head latent attention
    q_lora_rank: int | None  # None: a plain q_proj (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # -- rope over the qk_rope_head_dim part
    rope_theta: float
    rope_interleave: bool  # V3: pairs (x0, x1), (x2, x3) ...; V2 is always interleaved (complex)
    yarn: tuple[float, float, float, int, bool] | None  # (factor, beta_fast, beta_slow, original_max_pos, truncate)
    rope_attention_factor: float  # multiplies cos and sin (YaRN's mscale / mscale_all_dim)
    softmax_scale: float  # qk_head_dim ** -0.5, times mscale_all_dim's correction squared
    # -- mixture of experts
    n_routed_experts: int  # 0: dense everywhere
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_group: int
    topk_group: int
    topk_method: str  # "greedy" | "group_limited_greedy" (V2) | "noaux_tc" (V3)
    scoring: str  # "softmax" (V2) | "sigmoid" (V3, with e_score_correction_bias)
    norm_topk_prob: bool
    routed_scaling_factor: float
    num_nextn_predict_layers: int  # the MTP head's layers: not loaded (their tensors are skipped)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Cache elements per token and layer: the normed latent and the roped shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return (self.n_routed_experts > 0 and i >= self.first_k_dense_replace
                and i % max(1, self.moe_layer_freq) == 0)


def parse_deepseek(cfg: Mapping[str, Any], arch: str, err: Callable[[str, str], Exception]) -> DeepseekArgs:
    """The DeepSeek part of ``cfg`` (``arch``: "deepseek_v2" | "deepseek_v3"); ``err(key, msg)``
    builds the ModelConfigError naming the key."""
    version = 2 if arch == "deepseek_v2" else 3

    def pos_int(key: str, default: int | None = None, minimum: int = 1) -> int:
        return config_int(cfg, key, err, default, minimum=minimum, missing="missing (required for DeepSeek models)")

    def num(key: str, default: float, params: Mapping[str, Any] | None = None, positive: bool = True) -> float:
        src = cfg if params is None else params
        v = src.get(key, default)
        if v is None:
            v = default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (positive and v <= 0):
            raise err(key, f"must be a positive number, got {v!r}")
        return float(v)

    q_lora = cfg.get("q_lora_rank", 1536)
    if q_lora is not None:
        q_lora = pos_int("q_lora_rank")
    kv_lora = pos_int("kv_lora_rank", 512)
    nope = pos_int("qk_nope_head_dim", 128)
    rope_d = pos_int("qk_rope_head_dim", 64)
    if rope_d % 2:
        raise err("qk_rope_head_dim", f"rotary embeddings need an even size, got {rope_d}")
    v_dim = pos_int("v_head_dim", 128)

    # RoPE: the hub's rope_scaling + rope_theta, or transformers 5's rope_parameters.
    key = "rope_scaling"
    params = cfg.get("rope_scaling")
    if params is None and cfg.get("rope_parameters") is not None:
        key, params = "rope_parameters", cfg["rope_parameters"]
    if params is not None and not isinstance(params, dict):
        raise err(key, f"must be an object or null, got {params!r}")
    params = dict(params or {})
    theta = num("rope_theta", float(cfg.get("rope_theta", 10000.0)), params)
    rope_type = params.get("rope_type", params.get("type", "default"))
    yarn = None
    attention_factor = 1.0
    qk_head = nope + rope_d
    scale = qk_head ** -0.5
    if rope_type == "yarn":
        factor = num("factor", 1.0, params)
        orig = params.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
        if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
            raise err(f"{key}.original_max_position_embeddings", f"must be a positive integer, got {orig!r}")
        beta_fast = float(params.get("beta_fast") or 32)
        beta_slow = float(params.get("beta_slow") or 1)
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if params.get("attention_factor") is not None:
            attention_factor = num("attention_factor", 1.0, params)
        elif mscale and mscale_all:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attention_factor = yarn_mscale(factor)
        if mscale_all:  # the softmax scale grows with the context extension (transformers' yarn_apply_mscale)
            m = yarn_mscale(factor, mscale_all)
            scale = scale * m * m
        yarn = (factor, beta_fast, beta_slow, orig, bool(params.get("truncate", True)))
    elif rope_type != "default":
        raise err(f"{key}.rope_type", f"unsupported RoPE type {rope_type!r} for DeepSeek (supported: default, yarn)")

    n_routed = cfg.get("n_routed_experts")
    n_routed = 0 if n_routed is None else pos_int("n_routed_experts", minimum=0)
    top_k = cfg.get("num_experts_per_tok")
    if n_routed:
        top_k = pos_int("num_experts_per_tok")
        if top_k > n_routed:
            raise err("num_experts_per_tok", f"{top_k} is more than n_routed_experts={n_routed}")
    n_group = cfg.get("n_group") or 1
    topk_group = cfg.get("topk_group") or 1
    if version == 3:
        topk_method, scoring = "noaux_tc", "sigmoid"  # transformers' V3 router, whatever the keys say
    else:
        topk_method, scoring = cfg.get("topk_method") or "greedy", "softmax"
        if topk_method not in ("greedy", "group_limited_greedy"):
            raise err("topk_method", f"unsupported for DeepSeek-V2: {topk_method!r} (supported: greedy, "
                      "group_limited_greedy)")
        if cfg.get("scoring_func", "softmax") != "softmax":
            raise err("scoring_func", f"DeepSeek-V2 scores with softmax, got {cfg.get('scoring_func')!r}")
    if n_routed and topk_method != "greedy":
        n_group, topk_group = pos_int("n_group", n_group), pos_int("topk_group", topk_group)
        if n_routed % n_group:
            raise err("n_group", f"{n_group} does not divide n_routed_experts={n_routed}")
        if topk_group > n_group:
            raise err("topk_group", f"{topk_group} is more than n_group={n_group}")
        if version == 3 and n_routed // n_group < 2:
            raise err("n_group", "noaux_tc scores a group by its two best experts: each group needs at least two")
        if top_k > topk_group * (n_routed // n_group):
            raise err("num_experts_per_tok", f"{top_k} is more than the experts of topk_group={topk_group} groups")
    if cfg.get("mlp_bias"):
        raise err("mlp_bias", "biased MLPs are not supported for DeepSeek models")
    nextn = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0)) or 0
    return DeepseekArgs(
        version=version, q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope_d,
        v_head_dim=v_dim, rope_theta=theta,
        rope_interleave=True if version == 2 else bool(cfg.get("rope_interleave", True)),
        yarn=yarn, rope_attention_factor=float(attention_factor), softmax_scale=float(scale),
        n_routed_experts=n_routed, n_shared_experts=int(cfg.get("n_shared_experts") or 0),
        num_experts_per_tok=int(top_k or 0), moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
        first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
        moe_layer_freq=int(cfg.get("moe_layer_freq") or 1), n_group=int(n_group), topk_group=int(topk_group),
        topk_method=topk_method, scoring=scoring, norm_topk_prob=bool(cfg.get("norm_topk_prob", version == 3)),
        routed_scaling_factor=num("routed_scaling_factor", 1.0 if version == 2 else 2.5),
        num_nextn_predict_layers=int(nextn),
    )


def is_mtp_tensor(num_hidden_layers: int, name: str) -> bool:
    """A tensor of DeepSeek's multi-token-prediction head: ``model.layers.{n}.*`` with n >=
    num_hidden_layers (not served: skipped at load, counted in the load log)."""
    if not name.startswith("model.layers."):
        return False
    idx = name.split(".", 3)[2]
    return idx.isdigit() and int(idx) >= num_hidden_layers
