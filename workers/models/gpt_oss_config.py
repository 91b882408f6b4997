"""GPT-OSS's own config.json keys (``model_type: gpt_oss``): its experts, the clamped SwiGLU, YaRN
rope as transformers' ``_compute_yarn_parameters`` reads it, and the refusal of MXFP4 checkpoints.

The shared keys (sizes, heads, ``layer_types`` windows, ``attention_bias`` on q/k/v/o) are
workers/models/config.py's; this module is torch-free like it (front ends import the config).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from .config_values import ErrorFactory, config_int

__all__ = ["GptOssArgs", "expert_tensors", "parse_gpt_oss", "yarn_attention_factor"]


def yarn_attention_factor(factor: float) -> float:
    """YaRN's magnitude correction of cos/sin (transformers' ``yarn_get_mscale`` with mscale 1)."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


@dataclass(frozen=True)
class GptOssArgs:
    """What GPT-OSS adds to ModelArgs (workers/models/gpt_oss.py builds from it)."""

    num_experts: int  # num_local_experts
    top_k: int  # num_experts_per_tok
    swiglu_alpha: float
    swiglu_limit: float
    rope_theta: float
    # YaRN: (factor, beta_fast, beta_slow, original_max_position_embeddings, truncate); None: plain rope
    yarn: tuple[float, float, float, int, bool] | None
    rope_attention_factor: float  # multiplies cos and sin


def parse_gpt_oss(cfg: Mapping[str, Any], err: ErrorFactory) -> GptOssArgs:
    """The GPT-OSS keys of ``cfg``; ``err(key, message)`` for what cannot be served."""
    quant = cfg.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        # The released checkpoints keep their experts in MXFP4 blocks and scales: serve a bf16 copy.
        raise err("quantization_config", f"pre-quantised GPT-OSS checkpoints ({method!r}) are not supported: serve "
                  "a dequantised (bf16) copy, e.g. one saved by transformers with Mxfp4Config(dequantize=True)")

    def num(key: str, default: float, src: Mapping[str, Any] = cfg, where: str = "") -> float:
        v = src.get(key, default)
        if v is None:
            v = default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise err(where + key, f"must be a positive number, got {v!r}")
        return float(v)

    n = config_int(cfg, "num_local_experts", err, 128)
    top_k = config_int(cfg, "num_experts_per_tok", err, 4)
    if top_k > n:
        raise err("num_experts_per_tok", f"{top_k} is more than the {n} experts")

    key = "rope_parameters" if cfg.get("rope_parameters") is not None else "rope_scaling"
    params = cfg.get(key)
    if params is not None and not isinstance(params, dict):
        raise err(key, f"must be an object or null, got {params!r}")
    if params is None:  # transformers' GptOssConfig default
        params = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                  "original_max_position_embeddings": 4096}
    p = f"{key}."
    theta = num("rope_theta", float(cfg.get("rope_theta") or 150000.0), params, p)
    prf = params.get("partial_rotary_factor", 1.0)
    if prf not in (None, 1, 1.0):
        raise err(p + "partial_rotary_factor", f"only 1.0 is supported, got {prf!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    yarn, attention_factor = None, 1.0
    if rope_type == "yarn":
        factor = params.get("factor")
        orig = params.get("original_max_position_embeddings")
        if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
            raise err(p + "original_max_position_embeddings", f"must be a positive integer, got {orig!r}")
        factor = num("factor", cfg.get("max_position_embeddings", orig) / orig, params, p)
        if params.get("attention_factor") is not None:
            attention_factor = num("attention_factor", 1.0, params, p)
        elif params.get("mscale") and params.get("mscale_all_dim"):
            raise err(p + "mscale", "DeepSeek's mscale / mscale_all_dim are not supported for GPT-OSS")
        else:
            attention_factor = yarn_attention_factor(factor)
        yarn = (factor, float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1), orig,
                bool(params.get("truncate", True)))
    elif rope_type != "default":
        raise err(p + "rope_type", f"unsupported RoPE type {rope_type!r} for GPT-OSS (supported: default, yarn)")
    return GptOssArgs(n, top_k, num("swiglu_alpha", 1.702), num("swiglu_limit", 7.0), theta, yarn, attention_factor)


def expert_tensors(pre: str, hidden: int, inter: int, heads: int, g: GptOssArgs) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of one layer's router, experts and attention sinks (``pre``: the
    layer's prefix), as transformers saves them (the experts stacked, [E, in, out])."""
    e = g.num_experts
    return {f"{pre}self_attn.sinks": (heads,), f"{pre}mlp.router.weight": (e, hidden), f"{pre}mlp.router.bias": (e,),
            f"{pre}mlp.experts.gate_up_proj": (e, hidden, 2 * inter),
            f"{pre}mlp.experts.gate_up_proj_bias": (e, 2 * inter),
            f"{pre}mlp.experts.down_proj": (e, inter, hidden), f"{pre}mlp.experts.down_proj_bias": (e, hidden)}
