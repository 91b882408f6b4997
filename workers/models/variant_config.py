"""The config keys of the Llama-like families whose block or rope differs from Llama's: GLM-4
(``glm4``), Phi-3 / Phi-4-mini (``phi3``), SmolLM3 (``smollm3``) and Granite (``granite``).

``parse_variant`` reads what sets each apart (partial and interleaved rotary embeddings, LongRoPE,
NoPE layers, GLM-4's extra norms, Granite's multipliers, which projections the checkpoint stores
fused) into a ``VariantArgs`` that ``workers/models/variant.py`` builds its decoder from. The keys
shared with Llama (sizes, biases, rope_theta) stay config.py's. Torch-free, as config.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["LongRope", "VARIANT_ARCHS", "VariantArgs", "parse_variant"]

# model_type / architectures[0] -> family (merged into config.SUPPORTED_ARCHS).
VARIANT_ARCHS: dict[str, str] = {
    "glm4": "glm4", "Glm4ForCausalLM": "glm4",
    "phi3": "phi3", "Phi3ForCausalLM": "phi3",
    "smollm3": "smollm3", "SmolLM3ForCausalLM": "smollm3",
    "granite": "granite", "GraniteForCausalLM": "granite",
}


@dataclass(frozen=True)
class LongRope:
    """Phi-3's LongRoPE: frequency i divided by ``short[i]`` at positions below
    ``original_max_position_embeddings``, by ``long[i]`` from there on; cos and sin times
    ``attention_factor`` everywhere (transformers' ``_compute_longrope_parameters``)."""

    short: tuple[float, ...]
    long: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float


@dataclass(frozen=True)
class VariantArgs:
    """What a GLM-4 / Phi-3 / SmolLM3 / Granite decoder does beyond the Llama block."""

    family: str
    rotary_dim: int  # leading dims of each head that rope rotates (partial_rotary_factor * head_dim)
    rope_interleaved: bool = False  # GLM-4: pairs (0,1),(2,3).. instead of the halves (i, i + dim/2)
    longrope: LongRope | None = None
    rope_layers: tuple[bool, ...] = ()  # per layer: rope applied (SmolLM3's NoPE layers: False)
    sandwich_norms: bool = False  # GLM-4: post_self_attn_layernorm / post_mlp_layernorm on each branch
    fused_qkv: bool = False  # checkpoint stores self_attn.qkv_proj (Phi-3)
    fused_gate_up: bool = False  # checkpoint stores mlp.gate_up_proj (Phi-3, GLM-4)
    embedding_multiplier: float = 1.0  # Granite
    attention_multiplier: float | None = None  # Granite: the softmax scale (None: 1/sqrt(head_dim))
    residual_multiplier: float = 1.0  # Granite: each branch's output scaled before the residual add
    logits_scaling: float = 1.0  # Granite: logits divided by it

    @property
    def fused_checkpoint(self) -> bool:
        return self.fused_qkv or self.fused_gate_up


Err = Callable[[str, str], Exception]


def _num(cfg: Mapping[str, Any], key: str, default: float, err: Err, name: str | None = None) -> float:
    v = cfg.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise err(name or key, f"must be a positive number, got {v!r}")
    return float(v)


def parse_variant(cfg: Mapping[str, Any], arch: str, head_dim: int, n_layers: int, max_pos: int,
                  err: Err) -> tuple[VariantArgs, dict[str, Any], tuple[int | None, ...]]:
    """(the variant, the config to read rope_theta and Llama-style scaling from, the sliding
    window of each layer) for family ``arch``; ``err(key, message)`` for what cannot be served."""
    rkey = "rope_parameters" if cfg.get("rope_parameters") is not None else "rope_scaling"
    params = cfg.get(rkey)
    if params is not None and not isinstance(params, dict):
        raise err(rkey, f"must be an object or null, got {params!r}")
    params = dict(params or {})
    default_prf = 0.5 if arch == "glm4" else 1.0  # Glm4Config's default
    prf = params.pop("partial_rotary_factor", None)
    top = cfg.get("partial_rotary_factor")
    prf = top if prf is None and top is not None else prf  # transformers reads rope_parameters' first
    prf = _num({"p": prf}, "p", default_prf, err, "partial_rotary_factor")
    if prf > 1:
        raise err("partial_rotary_factor", f"must be at most 1, got {prf}")
    rotary_dim = int(head_dim * prf)
    if rotary_dim < 2 or rotary_dim % 2:
        raise err("partial_rotary_factor", f"{prf} x head_dim {head_dim} = {rotary_dim} rotary dims: must be even "
                  "and at least 2")
    if arch != "phi3" and params.get("rope_type", params.get("type")) == "longrope":
        raise err(f"{rkey}.rope_type", f"longrope is Phi-3's; not supported for {arch}")

    longrope = None
    rope_type = params.get("rope_type", params.get("type", "default"))
    if arch == "phi3" and rope_type in ("longrope", "su", "yarn"):  # transformers maps the old names to longrope
        half = rotary_dim // 2

        def factors(name: str) -> tuple[float, ...]:
            f = params.get(name)
            if (not isinstance(f, list) or len(f) != half
                    or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in f)):
                raise err(f"{rkey}.{name}", f"must be a list of {half} positive numbers (rotary dims / 2), got {f!r}")
            return tuple(float(x) for x in f)

        # transformers gives the top-level original_max_position_embeddings priority (Phi-3's checkpoints)
        orig = cfg.get("original_max_position_embeddings", params.get("original_max_position_embeddings", max_pos))
        if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
            raise err("original_max_position_embeddings", f"must be a positive integer, got {orig!r}")
        factor = params.get("factor")
        factor = max_pos / orig if factor is None else _num(params, "factor", 1.0, err, f"{rkey}.factor")
        af = params.get("attention_factor")
        if af is None:
            af = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        else:
            af = _num(params, "attention_factor", 1.0, err, f"{rkey}.attention_factor")
        longrope = LongRope(factors("short_factor"), factors("long_factor"), orig, af)
        params = {"rope_type": "default", "rope_theta": params.get("rope_theta", cfg.get("rope_theta", 10000.0))}
    rope_cfg = {k: v for k, v in cfg.items() if k not in ("partial_rotary_factor", "rope_scaling", "rope_parameters")}
    rope_cfg[rkey] = params

    rope_layers: tuple[bool, ...] = (True,) * n_layers
    windows: tuple[int | None, ...] = (None,) * n_layers
    window = cfg.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise err("sliding_window", f"must be a positive integer or null, got {window!r}")
    if arch == "smollm3":
        nope = cfg.get("no_rope_layers")
        if nope is None:
            step = cfg.get("no_rope_layer_interval", 4)
            if isinstance(step, bool) or not isinstance(step, int) or step < 1:
                raise err("no_rope_layer_interval", f"must be a positive integer, got {step!r}")
            nope = [int((i + 1) % step != 0) for i in range(n_layers)]
        if not isinstance(nope, list) or len(nope) != n_layers or any(v not in (0, 1) for v in nope):
            raise err("no_rope_layers", f"must be a list of {n_layers} 0/1 flags (1: rope), got {nope!r}")
        rope_layers = tuple(bool(v) for v in nope)
        if cfg.get("use_sliding_window", False) and window is not None:
            types = cfg.get("layer_types")
            if types is None:  # SmolLM3Config's default: the NoPE layers slide
                types = ["full_attention" if r else "sliding_attention" for r in rope_layers]
            if not isinstance(types, list) or len(types) != n_layers or not set(types) <= {"full_attention",
                                                                                             "sliding_attention"}:
                raise err("layer_types", f"must be a list of {n_layers} full_attention/sliding_attention, got {types!r}")
            windows = tuple(window if t == "sliding_attention" else None for t in types)
    elif arch == "phi3" and window is not None:  # every layer (transformers' sliding-window mask)
        windows = (window,) * n_layers

    mult: dict[str, float] = {}
    if arch == "granite":
        mult = {k: _num(cfg, k, 1.0, err) for k in ("embedding_multiplier", "residual_multiplier", "logits_scaling")}
        mult["attention_multiplier"] = _num(cfg, "attention_multiplier", 1.0, err)
    variant = VariantArgs(
        family=arch, rotary_dim=rotary_dim, rope_interleaved=arch == "glm4", longrope=longrope,
        rope_layers=rope_layers, sandwich_norms=arch == "glm4", fused_qkv=arch == "phi3",
        fused_gate_up=arch in ("phi3", "glm4"), **mult)
    return variant, rope_cfg, windows
