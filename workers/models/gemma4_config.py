"""The Gemma 4 (text) keys of a config.json (torch-free: front ends read configs too).

``parse_gemma4(cfg, n_layers, head_dim, n_kv, err)`` returns ``Gemma4Args``: what the decoder of
workers/models/gemma4.py needs beyond the Llama-family keys of ``ModelArgs`` (whose ``head_dim``
and ``num_key_value_heads`` are the sliding layers'), with transformers 5.25's defaults
(``Gemma4TextConfig``) for keys a saved config leaves out:

- ``layer_types`` (default: five sliding layers of six; the last layer always full, as transformers
  forces it) with ``sliding_window`` (512);
- the full layers' head geometry: ``global_head_dim`` (512) and, where ``attention_k_eq_v`` is set,
  ``num_global_key_value_heads``; or, as transformers 5.25 saves it, ``per_layer_config``
  {layer index: {"head_dim", "num_key_value_heads"}};
- ``attention_k_eq_v``: the full layers have no v_proj, their values are the keys' projection;
- ``rope_parameters`` per layer type: "default" (the whole head) or "proportional" (the first
  ``partial_rotary_factor`` of each half rotated over the head's full dimension, the rest kept);
- per-layer input embeddings (``hidden_size_per_layer_input``, ``vocab_size_per_layer_input``);
- ``num_kv_shared_layers``: the last layers read the KV cache of the last earlier layer of their type
  (``kv_source``) and have no k/v projections; ``use_double_wide_mlp`` doubles their MLP;
- ``final_logit_softcapping``;
- ``enable_moe_block``: every layer adds routed experts beside its MLP (``num_experts``,
  ``top_k_experts``, ``moe_intermediate_size``).

Refused by name: bidirectional attention, other activations, other rope types.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["GEMMA4_ARCHS", "Gemma4Args", "LayerRope", "parse_gemma4"]

GEMMA4_ARCHS = ("gemma4",)
KINDS = ("sliding_attention", "full_attention")
ROPE_TYPES = ("default", "proportional")
_ROPE_DEFAULTS = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                  "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                     "rope_theta": 1_000_000.0}}


@dataclass(frozen=True)
class LayerRope:
    """One layer type's rope: ``rope_type`` default | proportional, its base, the rotated share of
    the head (proportional) and the frequencies' divisor ``factor``."""

    rope_type: str
    theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0


@dataclass(frozen=True)
class Gemma4Args:
    layer_types: tuple[str, ...]
    sliding_window: int
    head_dims: tuple[int, ...]  # per layer
    kv_heads: tuple[int, ...]  # per layer
    k_eq_v: tuple[bool, ...]  # per layer: no v_proj, values are the keys' projection (full layers)
    kv_source: tuple[int, ...]  # per layer: the layer whose KV cache it reads (itself unless shared)
    ropes: Mapping[str, LayerRope]  # per layer type
    ple_dim: int  # hidden_size_per_layer_input (0: no per-layer input embeddings)
    ple_vocab: int
    intermediate: tuple[int, ...]  # per layer (double-wide on the shared layers)
    final_logit_softcapping: float | None
    num_experts: int = 0  # enable_moe_block: experts beside every layer's MLP (0: none)
    top_k: int = 0
    moe_intermediate_size: int = 0

    def shared(self, i: int) -> bool:
        """Layer ``i`` reads another layer's KV cache and writes none."""
        return self.kv_source[i] != i


def _pos_number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and v > 0


def _rope(params: Any, kind: str, err: Callable) -> LayerRope:
    key = f"rope_parameters.{kind}"
    if not isinstance(params, dict):
        raise err(key, f"must be an object, got {params!r}")
    p = {"rope_theta": 10_000.0, **params}
    if p.get("rope_type", "default") not in ROPE_TYPES:
        raise err(f"{key}.rope_type", f"{p.get('rope_type')!r} is not supported for Gemma 4 "
                                      f"(supported: {', '.join(ROPE_TYPES)})")
    for name, default in (("rope_theta", None), ("partial_rotary_factor", 1.0), ("factor", 1.0)):
        if not _pos_number(p.get(name, default)):
            raise err(f"{key}.{name}", f"must be a positive number, got {p.get(name, default)!r}")
    prf = float(p.get("partial_rotary_factor", 1.0)) if p.get("rope_type") == "proportional" else 1.0
    if prf > 1:
        raise err(f"{key}.partial_rotary_factor", f"must be at most 1, got {prf}")
    return LayerRope(p.get("rope_type", "default"), float(p["rope_theta"]), prf,
                     float(p.get("factor", 1.0)) if p.get("rope_type") == "proportional" else 1.0)


def _positive_int(cfg: Mapping[str, Any], key: str, default: Any, err: Callable, minimum: int = 1) -> int:
    v = cfg.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise err(key, f"must be an integer >= {minimum}, got {v!r}")
    return v


def _layer_overrides(cfg: Mapping[str, Any], types: list[str], err: Callable) -> dict[int, dict[str, Any]]:
    """Layer index -> {head_dim, num_key_value_heads} of its override (the full layers')."""
    plc = cfg.get("per_layer_config")
    if plc is not None:
        if not isinstance(plc, dict):
            raise err("per_layer_config", f"must be an object, got {plc!r}")
        out: dict[int, dict[str, Any]] = {}
        for k, v in plc.items():
            key = k if k in KINDS else str(k)
            if not isinstance(v, dict) or not (key.isdigit() and int(key) < len(types)):
                raise err("per_layer_config", f"entry {k!r}: expected a layer index and an object")
            unknown = sorted(set(v) - {"head_dim", "num_key_value_heads"})
            if unknown:
                raise err(f"per_layer_config.{k}", f"unsupported key(s) {unknown!r}")
            out[int(key)] = v
        return out
    over: dict[str, Any] = {"head_dim": cfg.get("global_head_dim", 512)}
    # transformers: num_global_key_value_heads applies where attention_k_eq_v is set
    if cfg.get("attention_k_eq_v", False) and cfg.get("num_global_key_value_heads") is not None:
        over["num_key_value_heads"] = cfg["num_global_key_value_heads"]
    return {i: over for i, t in enumerate(types) if t == "full_attention"}


def parse_gemma4(cfg: Mapping[str, Any], n_layers: int, head_dim: int, n_kv: int, n_heads: int,
                 inter: int, err: Callable) -> tuple[Gemma4Args, int, tuple[int | None, ...]]:
    """(Gemma4Args, sliding_window, per-layer windows) of a Gemma 4 text config;
    ``err(key, message)`` makes the error."""
    act = cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        raise err("hidden_activation", f"only gelu_pytorch_tanh is supported for Gemma 4, got {act!r}")
    if cfg.get("use_bidirectional_attention"):
        raise err("use_bidirectional_attention", "bidirectional attention is not served")
    experts = top_k = moe_inter = 0
    if cfg.get("enable_moe_block"):
        experts = _positive_int(cfg, "num_experts", None, err)
        top_k = _positive_int(cfg, "top_k_experts", None, err)
        moe_inter = _positive_int(cfg, "moe_intermediate_size", None, err)
        if top_k > experts:
            raise err("top_k_experts", f"{top_k} exceeds num_experts={experts}")
    window = _positive_int(cfg, "sliding_window", 512, err)
    types = cfg.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers:
        raise err("layer_types", f"must be a list of {n_layers} entries, got {types!r}")
    bad = sorted({str(t) for t in types if t not in KINDS})
    if bad:
        raise err("layer_types", f"unsupported layer type(s) {bad!r}")
    types = [*types[:-1], "full_attention"]  # transformers forces the last layer full

    overrides = _layer_overrides(cfg, types, err)
    dims, heads = [], []
    for i in range(n_layers):
        o = overrides.get(i, {})
        d = o.get("head_dim", head_dim)
        h = o.get("num_key_value_heads", n_kv)
        if isinstance(d, bool) or not isinstance(d, int) or d < 2 or d % 2:
            raise err("global_head_dim", f"must be an even positive integer, got {d!r}")
        if isinstance(h, bool) or not isinstance(h, int) or h < 1 or n_heads % h:
            raise err("num_global_key_value_heads", f"{h!r} does not divide num_attention_heads={n_heads}")
        dims.append(d)
        heads.append(h)
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))

    shared_n = _positive_int(cfg, "num_kv_shared_layers", 0, err, minimum=0)
    if shared_n > n_layers:
        raise err("num_kv_shared_layers", f"{shared_n} exceeds num_hidden_layers={n_layers}")
    first = n_layers - shared_n
    source = list(range(n_layers))
    if shared_n:
        if shared_n == n_layers:
            raise err("num_kv_shared_layers", "every layer shared: no layer writes a KV cache")
        for i in range(first, n_layers):
            producers = [j for j in range(first) if types[j] == types[i]]
            if not producers:
                raise err("num_kv_shared_layers", f"layer {i} ({types[i]}) has no earlier layer of its type to share")
            source[i] = producers[-1]
    for i in range(first, n_layers):
        if (dims[i], heads[i]) != (dims[source[i]], heads[source[i]]):
            raise err("per_layer_config", f"layer {i} shares layer {source[i]}'s KV cache with another geometry")

    params = cfg.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise err("rope_parameters", f"must be an object, got {params!r}")
    params = params or _ROPE_DEFAULTS  # transformers' defaults only when the config has none
    unknown = sorted(set(params) - set(KINDS))
    if unknown:
        raise err("rope_parameters", f"unknown layer type(s) {unknown!r}")
    ropes = {k: _rope(params.get(k), k, err) for k in KINDS if k in types}

    ple = cfg.get("hidden_size_per_layer_input", 256)
    ple = _positive_int(cfg, "hidden_size_per_layer_input", 256, err, minimum=0) if ple else 0
    ple_vocab = _positive_int(cfg, "vocab_size_per_layer_input", 262_144, err) if ple else 0
    double = bool(cfg.get("use_double_wide_mlp", False))
    cap = cfg.get("final_logit_softcapping")
    if cap is not None and not _pos_number(cap):
        raise err("final_logit_softcapping", f"must be a positive number or null, got {cap!r}")
    args = Gemma4Args(
        layer_types=tuple(types), sliding_window=window, head_dims=tuple(dims), kv_heads=tuple(heads),
        k_eq_v=tuple(k_eq_v and t == "full_attention" for t in types), kv_source=tuple(source), ropes=ropes,
        ple_dim=ple, ple_vocab=ple_vocab,
        intermediate=tuple(inter * (2 if double and i >= first and shared_n else 1) for i in range(n_layers)),
        final_logit_softcapping=None if cap is None else float(cap), num_experts=experts, top_k=top_k,
        moe_intermediate_size=moe_inter)
    return args, window, tuple(window if t == "sliding_attention" else None for t in types)
