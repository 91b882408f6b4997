"""GLM-4-MoE (``glm4_moe``, GLM-4.5 / 4.6 / 4.7) hyper-parameters from a Hugging Face ``config.json``,
as transformers 5.25's Glm4MoeConfig reads them.

GLM-4-MoE is not GLM-4's block: its attention is Llama's (separate q/k/v with optional biases, no
o bias, no extra norms) with partial rotary in the NeoX layout (the halves of the first
``partial_rotary_factor * head_dim`` dims, default 0.5) and optional per-head q/k norms
(``use_qk_norm``); its feed-forward is a dense SwiGLU on the first ``first_k_dense_replace`` layers,
then DeepSeek-V3's routing (sigmoid scores, ``e_score_correction_bias``, ``n_group`` /
``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``) over ``n_routed_experts`` plus
``n_shared_experts`` shared experts, as DeepSeek-V3 names its tensors.

``parse_glm4_moe`` returns the routing and rotary part (``Glm4MoeArgs``: its fields are those
workers/models/deepseek_routing.py's router reads, its ``rope`` a ``VariantArgs`` of family
``glm4_moe`` for workers/models/variant.py's rope), the experts (a ``MoeArgs``: workers/models/moe.py) and the
config to read rope_theta from. The decoder is workers/models/glm4_moe.py. Torch-free, as config.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .config_values import config_bool, config_int
from .variant_config import VariantArgs, parse_variant

__all__ = ["GLM4_MOE_ARCHS", "Glm4MoeArgs", "parse_glm4_moe", "router_tensors"]

GLM4_MOE_ARCHS: dict[str, str] = {"glm4_moe": "glm4_moe", "Glm4MoeForCausalLM": "glm4_moe"}
FAMILY = "GLM-4-MoE"

Err = Callable[[str, str], Exception]


@dataclass(frozen=True)
class Glm4MoeArgs:
    """The routing of GLM-4-MoE's sparse layers, under the names DeepseekRouter reads."""

    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    num_nextn_predict_layers: int  # the MTP layers (model.layers.{num_hidden_layers + i}): not loaded
    rope: VariantArgs  # partial rotary, NeoX layout (workers/models/variant.py's VariantRope reads it)
    # DeepSeek-V3's scheme, which Glm4MoeTopkRouter computes
    scoring: str = "sigmoid"
    topk_method: str = "noaux_tc"
    version: int = 3


def parse_glm4_moe(cfg: Mapping[str, Any], head_dim: int, n_layers: int, max_pos: int, err: Err,
                   moe_args: Callable[..., Any]) -> tuple[Glm4MoeArgs, Any, dict[str, Any], bool]:
    """(routing and rotary, experts, the config to read rope_theta / scaling from, use_qk_norm) of a
    glm4_moe ``cfg``; ``err(key, message)`` names what cannot be served; ``moe_args``: config.MoeArgs
    (passed in: config.py imports this module)."""

    def pos_int(key: str, default: int, minimum: int = 1) -> int:
        return config_int(cfg, key, err, default, minimum=minimum)

    params = cfg.get("rope_parameters") if cfg.get("rope_parameters") is not None else cfg.get("rope_scaling")
    if cfg.get("partial_rotary_factor") is None and not (isinstance(params, dict)
                                                         and params.get("partial_rotary_factor") is not None):
        cfg = {**cfg, "partial_rotary_factor": 0.5}  # Glm4MoeConfig's default
    variant, rope_cfg, _ = parse_variant(cfg, "glm4_moe", head_dim, n_layers, max_pos, err)
    if cfg.get("sliding_window") is not None:
        raise err("sliding_window", f"{FAMILY} attends to every position (Glm4MoeAttention has no window)")

    experts = pos_int("n_routed_experts", 128)
    top_k = pos_int("num_experts_per_tok", 8)
    if top_k > experts:
        raise err("num_experts_per_tok", f"{top_k} exceeds n_routed_experts={experts}")
    n_group, topk_group = pos_int("n_group", 1), pos_int("topk_group", 1)
    if experts % n_group:
        raise err("n_group", f"{n_group} does not divide n_routed_experts={experts}")
    if experts // n_group < 2:  # a group's score is the sum of its two best experts
        raise err("n_group", f"{n_group} groups of {experts // n_group} expert(s): each group needs at least 2")
    if topk_group > n_group:
        raise err("topk_group", f"{topk_group} exceeds n_group={n_group}")
    scale = cfg.get("routed_scaling_factor", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise err("routed_scaling_factor", f"must be a positive number, got {scale!r}")
    first_dense = pos_int("first_k_dense_replace", 1, minimum=0)
    inter = pos_int("moe_intermediate_size", 1408)
    shared = pos_int("n_shared_experts", 1, minimum=0)
    mtp = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 1))
    if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
        raise err("num_nextn_predict_layers", f"must be a non-negative integer, got {mtp!r}")
    routing = Glm4MoeArgs(experts, top_k, n_group, topk_group, config_bool(cfg, "norm_topk_prob", err, True), float(scale), mtp,
                          variant)
    moe = moe_args(num_experts=experts, top_k=top_k, moe_intermediate_size=inter,
                   norm_topk_prob=routing.norm_topk_prob,
                   sparse_layers=tuple(i >= first_dense for i in range(n_layers)),
                   shared_expert_intermediate_size=inter * shared, names="deepseek")
    return routing, moe, rope_cfg, config_bool(cfg, "use_qk_norm", err, False)


def router_tensors(sparse_layers: tuple[bool, ...], num_experts: int) -> dict[str, tuple[int, ...]]:
    """The router tensor the generic MoE names leave out: each sparse layer's correction bias."""
    return {f"model.layers.{i}.mlp.gate.e_score_correction_bias": (num_experts,)
            for i, sparse in enumerate(sparse_layers) if sparse}
