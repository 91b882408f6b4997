"""The Gemma 2 / Gemma 3 keys of a config.json (torch-free: front ends read configs too).

``parse_gemma(cfg, arch, err, parse_rope)`` returns ``GemmaArgs``: what the decoder of
workers/models/gemma.py needs beyond the Llama-family keys of ``ModelArgs``, with transformers
5.25's defaults (``Gemma2Config`` / ``Gemma3TextConfig``) for keys a saved config leaves out (it
writes only what differs from them):

- ``query_pre_attn_scalar``: the softmax scale is its inverse square root, not head_dim's;
- ``attn_logit_softcapping`` (Gemma 2: 50) and ``final_logit_softcapping`` (Gemma 2: 30);
- ``layer_types`` (or Gemma 3's older ``sliding_window_pattern``: every n-th layer global; Gemma 2:
  even layers sliding) with ``sliding_window``;
- per-layer-type rope (Gemma 3): ``rope_parameters`` {"sliding_attention": ..., "full_attention": ...}
  (transformers >= 5) or ``rope_theta`` + ``rope_scaling`` for the global layers and
  ``rope_local_base_freq`` for the sliding ones.

``extra_tensors(args)`` names the two norms around the feed-forward that a Gemma layer adds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["GEMMA_ARCHS", "GemmaArgs", "extra_tensors", "parse_gemma", "text_config"]

GEMMA_ARCHS = ("gemma2", "gemma3")
ACTIVATIONS = ("gelu_pytorch_tanh",)


@dataclass(frozen=True)
class GemmaArgs:
    version: int  # 2 | 3
    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    local_rope_theta: float  # sliding layers' base (Gemma 2: the one rope_theta)
    local_rope_scaling: Any = None  # config.RopeScaling of the sliding layers (None: plain)

    @property
    def scale(self) -> float:
        """The softmax scale: query_pre_attn_scalar ** -0.5 (transformers' ``self.scaling``)."""
        return self.query_pre_attn_scalar ** -0.5


def text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """A Gemma3/Gemma4ForConditionalGeneration config's text part (``text_config``, model_type
    gemma3_text / gemma4_text), its ids from the outer config where the text part has none; else ``cfg``."""
    if cfg.get("model_type") not in ("gemma3", "gemma4") or not isinstance(cfg.get("text_config"), dict):
        return cfg
    text = dict(cfg["text_config"])
    text.setdefault("model_type", f"{cfg['model_type']}_text")
    for key in ("eos_token_id", "bos_token_id", "pad_token_id", "torch_dtype", "dtype", "tie_word_embeddings"):
        if key in cfg and key not in text:
            text[key] = cfg[key]
    return text


def _number(cfg: Mapping[str, Any], key: str, default: float | None, err: Callable, *, optional: bool = False):
    v = cfg.get(key, default)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise err(key, f"must be a positive number{' or null' if optional else ''}, got {v!r}")
    return float(v)


def parse_gemma(cfg: Mapping[str, Any], arch: str, n_layers: int, err: Callable,
                parse_rope: Callable) -> tuple[GemmaArgs, float, Any, int | None, tuple[int | None, ...]]:
    """(GemmaArgs, global rope_theta, global RopeScaling, sliding_window, per-layer windows) of a
    Gemma 2/3 config; ``err(key, message)`` makes the error, ``parse_rope(params_cfg)`` is
    config.py's rope parser (returns (theta, RopeScaling | None))."""
    version = 2 if arch == "gemma2" else 3
    act = cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in ACTIVATIONS:
        raise err("hidden_activation", f"only {', '.join(ACTIVATIONS)} is supported for Gemma, got {act!r}")
    if cfg.get("use_bidirectional_attention"):
        raise err("use_bidirectional_attention", "bidirectional attention (an encoder's) is not served")
    qpas = _number(cfg, "query_pre_attn_scalar", 256, err)
    attn_cap = _number(cfg, "attn_logit_softcapping", 50.0 if version == 2 else None, err, optional=True)
    final_cap = _number(cfg, "final_logit_softcapping", 30.0 if version == 2 else None, err, optional=True)

    window = cfg.get("sliding_window", 4096)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise err("sliding_window", f"must be a positive integer or null, got {window!r}")
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern", 2 if version == 2 else 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise err("sliding_window_pattern", f"must be a positive integer, got {pattern!r}")
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers:
        raise err("layer_types", f"must be a list of {n_layers} entries, got {types!r}")
    bad = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
    if bad:
        raise err("layer_types", f"unsupported layer type(s) {bad!r}")
    windows = tuple(window if t == "sliding_attention" else None for t in types)

    params = cfg.get("rope_parameters")
    if version == 3 and isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        unknown = sorted(set(params) - {"sliding_attention", "full_attention"})
        if unknown:
            raise err("rope_parameters", f"unknown layer type(s) {unknown!r}")
        glob = {"rope_theta": 1_000_000.0, **(params.get("full_attention") or {})}
        local = {"rope_theta": 10_000.0, **(params.get("sliding_attention") or {})}
        theta, scaling = parse_rope({"rope_parameters": glob})
        local_theta, local_scaling = parse_rope({"rope_parameters": local})
    elif version == 3:
        theta, scaling = parse_rope({"rope_theta": cfg.get("rope_theta", 1_000_000.0),
                                     "rope_scaling": cfg.get("rope_scaling", params)})
        local_theta = _number(cfg, "rope_local_base_freq", 10_000.0, err)
        local_scaling = None
    else:
        theta, scaling = parse_rope(cfg)
        local_theta, local_scaling = theta, scaling
    return (GemmaArgs(version, qpas, attn_cap, final_cap, local_theta, local_scaling), theta, scaling, window,
            windows)


def extra_tensors(args: Any) -> dict[str, tuple[int, ...]]:
    """The norms a Gemma layer has beyond a Llama one (before and after its feed-forward)."""
    return {f"model.layers.{i}.{n}.weight": (args.hidden_size,) for i in range(args.num_hidden_layers)
            for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")}
