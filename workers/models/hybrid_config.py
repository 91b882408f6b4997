"""The hybrid linear-attention part of a Qwen3-Next / Qwen3.5 config.json (torch-free: the
launch step and the front ends read configs without torch).

Both families interleave Gated DeltaNet layers (``layer_types`` "linear_attention") with gated
full-attention layers ("full_attention"), three to one by default (``full_attention_interval`` 4,
as transformers' ``Qwen3NextConfig`` derives ``layer_types`` when a config has none). Keys read:
``linear_num_key_heads``, ``linear_num_value_heads``, ``linear_key_head_dim``,
``linear_value_head_dim``, ``linear_conv_kernel_dim``, the partial rotary factor
(``rope_parameters.partial_rotary_factor``, 0.25 by default as transformers sets it), and for the
mixtures of experts the Qwen2-MoE keys (shared expert with its sigmoid gate). A real Qwen3.5
checkpoint nests the decoder's keys under ``text_config`` (``Qwen3_5ForConditionalGeneration``):
``flatten_text_config`` lifts them. ``mrope_section`` / ``mrope_interleaved`` are accepted: with
text only every rotary axis has the same position, so the multimodal rope is the plain one.

Refused by name: ``attention_bias: true``, ``sliding_window``, layer types other than the two, a
value-head count that is not a multiple of the key-head count.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from .config_values import config_int

__all__ = ["HYBRID_ARCHS", "HybridArgs", "flatten_text_config", "parse_hybrid", "rope_config"]

# ModelArgs.arch of the hybrid families -> how their Gated DeltaNet projections are stored:
# "qkvz" (Qwen3-Next: in_proj_qkvz / in_proj_ba, grouped by key head) or "split" (Qwen3.5:
# in_proj_qkv, in_proj_z, in_proj_b, in_proj_a).
HYBRID_ARCHS: dict[str, str] = {"qwen3_next": "qkvz", "qwen3_5": "split", "qwen3_5_moe": "split"}
LINEAR, FULL = "linear_attention", "full_attention"
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")


@dataclass(frozen=True)
class HybridArgs:
    """The Gated DeltaNet layers' shapes and which layers they are."""

    layout: str  # "qkvz" | "split" (HYBRID_ARCHS)
    layer_types: tuple[str, ...]
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    rotary_dim: int  # the rotated part of each full-attention head (partial rotary)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    def state_bytes(self, conv_elem: int) -> tuple[int, int]:
        """(conv state, recurrent state) bytes of one sequence over every linear layer; the
        recurrent state is kept in fp32 whatever the model dtype (transformers' delta rule runs in fp32)."""
        n = len(self.linear_layers)
        return (n * self.conv_dim * (self.conv_kernel - 1) * conv_elem,
                n * self.num_v_heads * self.head_k_dim * self.head_v_dim * 4)


def flatten_text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """A Qwen3.5 checkpoint's config.json (model_type "qwen3_5" / "qwen3_5_moe" with the decoder's
    keys under ``text_config``) as the text model's flat config; anything else unchanged."""
    text = cfg.get("text_config")
    if cfg.get("model_type") not in ("qwen3_5", "qwen3_5_moe") or not isinstance(text, dict):
        return cfg
    out = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    out.update(text)
    out["model_type"] = f"{cfg['model_type']}_text"
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if key not in text and key in cfg:
            out[key] = cfg[key]
    return out


def rope_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` without the keys config._parse_rope refuses but the hybrid decoder serves: the
    partial rotary factor (HybridArgs.rotary_dim) and the multimodal rope sections."""
    out = dict(cfg)
    out.pop("partial_rotary_factor", None)
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(out.get(key), dict):
            out[key] = {k: v for k, v in out[key].items() if k != "partial_rotary_factor" and k not in _MROPE_KEYS}
    return out


def _partial_rotary(cfg: Mapping[str, Any], err: Any) -> float:
    for key in ("rope_parameters", "rope_scaling"):
        params = cfg.get(key)
        if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
            v = params["partial_rotary_factor"]
            break
    else:
        v = cfg.get("partial_rotary_factor", 0.25)  # transformers' default for these families
        key = "partial_rotary_factor"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
        raise err(key, f"partial_rotary_factor must be in (0, 1], got {v!r}")
    return float(v)


def parse_hybrid(cfg: Mapping[str, Any], arch: str, n_layers: int, head_dim: int, err: Any,
                 parse_moe: Callable[..., Any]) -> tuple[HybridArgs, Any]:
    """(HybridArgs, MoeArgs or None) of a hybrid family's config; ``parse_moe``: config._parse_moe
    (the Qwen2-MoE keys: shared expert and its gate)."""

    def pos_int(key: str, default: int | None = None) -> int:
        return config_int(cfg, key, err, default)

    if cfg.get("attention_bias"):
        raise err("attention_bias", "true is not supported for the hybrid Qwen models (their checkpoints have none)")
    if cfg.get("sliding_window") is not None:
        raise err("sliding_window", "sliding-window attention is not supported for the hybrid Qwen models")
    types = cfg.get("layer_types")
    if types is None:
        interval = pos_int("full_attention_interval", 4)
        types = [LINEAR if (i + 1) % interval else FULL for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers:
        raise err("layer_types", f"must be a list of {n_layers} entries, got {types!r}")
    if bad := sorted({t for t in types if t not in (LINEAR, FULL)}):
        raise err("layer_types", f"unsupported layer type(s) {bad!r} (supported: {LINEAR}, {FULL})")
    nk, nv = pos_int("linear_num_key_heads", 16), pos_int("linear_num_value_heads", 32)
    if nv % nk:
        raise err("linear_num_value_heads", f"{nv} is not a multiple of linear_num_key_heads={nk}")
    rot = int(head_dim * _partial_rotary(cfg, err))
    if rot % 2 or rot < 2:
        raise err("partial_rotary_factor", f"gives an odd or empty rotary part ({rot} of head_dim {head_dim})")
    hybrid = HybridArgs(HYBRID_ARCHS[arch], tuple(types), nk, nv, pos_int("linear_key_head_dim", 128),
                        pos_int("linear_value_head_dim", 128), pos_int("linear_conv_kernel_dim", 4), rot)
    if hybrid.conv_kernel < 2:
        raise err("linear_conv_kernel_dim", f"must be at least 2, got {hybrid.conv_kernel}")
    moe = None
    if arch == "qwen3_next":  # Qwen2-MoE's keys: decoder_sparse_step, mlp_only_layers, norm_topk_prob
        moe = parse_moe(cfg, "qwen2_moe", n_layers, err)
        if moe is not None:
            moe = replace(moe, norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))
    elif arch == "qwen3_5_moe":  # every layer sparse, top-k always renormalised (Qwen3_5MoeTopKRouter)
        sub = {k: v for k, v in cfg.items() if k not in ("decoder_sparse_step", "mlp_only_layers")}
        moe = parse_moe(sub, "qwen2_moe", n_layers, err)
        if moe is None:
            raise err("num_experts", "must be at least 1 for qwen3_5_moe")
        moe = replace(moe, norm_topk_prob=True)
    return hybrid, moe
