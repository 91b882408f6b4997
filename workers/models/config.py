"""Model hyper-parameters parsed from a Hugging Face model directory.

`ModelArgs.from_dir(path)` reads `config.json` (and `generation_config.json` when present) of a
Llama-family checkpoint (Llama 2/3/3.1, Qwen2/2.5, Qwen3, Mistral) and returns a validated,
flat description that `workers.models.llama.DecoderLM` is built from.

This module deliberately does not import torch: front ends read the EOS/BOS ids from it and
must stay small.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .config_values import config_bool, config_int
from .deepseek_config import DeepseekArgs, parse_deepseek
from .gpt_oss_config import GptOssArgs, parse_gpt_oss
from .variant_config import VARIANT_ARCHS, VariantArgs, parse_variant
from .glm4_moe_config import GLM4_MOE_ARCHS, Glm4MoeArgs, parse_glm4_moe
from .gemma_config import GEMMA_ARCHS, GemmaArgs, parse_gemma, text_config
from .gemma4_config import GEMMA4_ARCHS, Gemma4Args, parse_gemma4
from .hybrid_config import HYBRID_ARCHS, HybridArgs, flatten_text_config, parse_hybrid, rope_config

__all__ = ["ModelArgs", "ModelConfigError", "MoeArgs", "RopeScaling", "SUPPORTED_ARCHS"]

# model_type / architectures[0] -> arch family.
SUPPORTED_ARCHS: dict[str, str] = {
    "llama": "llama",
    "LlamaForCausalLM": "llama",
    "qwen2": "qwen2",
    "Qwen2ForCausalLM": "qwen2",
    "qwen3": "qwen3",
    "Qwen3ForCausalLM": "qwen3",
    "mistral": "mistral",
    "MistralForCausalLM": "mistral",
    # Multi-head latent attention and DeepSeek's MoE: workers/models/deepseek.py
    "deepseek_v2": "deepseek_v2",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "deepseek_v3": "deepseek_v3",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    # Mixtures of experts (workers/models/moe.py): the attention of their dense family, SparseMoE
    # feed-forward layers (ModelArgs.moe).
    "qwen2_moe": "qwen2_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "mixtral": "mixtral",
    "MixtralForCausalLM": "mixtral",
    # Attention sinks, alternating windows, its own experts: workers/models/gpt_oss.py
    "gpt_oss": "gpt_oss",
    "GptOssForCausalLM": "gpt_oss",
    # GLM-4, Phi-3 / Phi-4-mini, SmolLM3, Granite: Llama's attention with their own rope, norms or
    # multipliers (workers/models/variant_config.py, variant.py)
    **VARIANT_ARCHS,
    # GLM-4-MoE: Llama's attention with partial rotary, DeepSeek-V3's routing (workers/models/glm4_moe.py)
    **GLM4_MOE_ARCHS,
    # Gemma 2 / 3 (text): workers/models/gemma.py; a Gemma3ForConditionalGeneration's text part
    "gemma2": "gemma2",
    "Gemma2ForCausalLM": "gemma2",
    "gemma3_text": "gemma3",
    "Gemma3ForCausalLM": "gemma3",
    "gemma3": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    # Gemma 4 (text): workers/models/gemma4.py; a Gemma4ForConditionalGeneration's text part
    "gemma4_text": "gemma4",
    "Gemma4ForCausalLM": "gemma4",
    "gemma4": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",
    # Cross-encoders (rerank and score, mindie/api/rerank.py): the dense decoder with a `score` head
    # of num_labels rows in place of the LM head (ModelArgs.num_labels).
    "LlamaForSequenceClassification": "llama",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
    "MistralForSequenceClassification": "mistral",
    # Hybrid linear attention (Gated DeltaNet + gated full attention): workers/models/qwen3_next.py
    "qwen3_next": "qwen3_next",
    "Qwen3NextForCausalLM": "qwen3_next",
    "qwen3_5_text": "qwen3_5",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
}
CLASSIFIER_SUFFIX = "ForSequenceClassification"

# An MoE family -> the dense family whose attention (biases, q/k norms, windows) it shares.
MOE_BASE: dict[str, str] = {"qwen2_moe": "qwen2", "qwen3_moe": "qwen3", "mixtral": "mistral"}

_DTYPES = ("float32", "bfloat16", "float16")


class ModelConfigError(ValueError):
    """A model's config.json cannot be served; the message names the offending key."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `rope_type` is "llama3" (Llama 3.1+), "linear", or "freq_factors":
    llama.cpp's per-frequency divisors (a GGUF file's ``rope_freqs`` tensor, as its model view
    writes them: ``{"rope_type": "freq_factors", "factors": [...]}``, one per rotary pair)."""

    rope_type: str
    factor: float
    # llama3 only:
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # freq_factors only: frequency i is divided by factors[i]
    factors: tuple[float, ...] = ()


@dataclass(frozen=True)
class MoeArgs:
    """The mixture-of-experts part of a model (workers/models/moe.py): which layers are sparse and
    how their experts are routed. Parsed from Qwen2-MoE / Qwen3-MoE / Mixtral config.json keys."""

    num_experts: int  # Qwen num_experts, Mixtral num_local_experts
    top_k: int  # num_experts_per_tok
    moe_intermediate_size: int  # each routed expert's (Mixtral: intermediate_size)
    norm_topk_prob: bool  # renormalise the top-k weights to sum 1 (Mixtral: always)
    sparse_layers: tuple[bool, ...]  # per layer: SparseMoE (True) or the dense MLP (intermediate_size)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0 = none
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid gate on the shared expert
    names: str = "qwen"  # checkpoint naming: "qwen" (mlp.experts.{e}.gate_proj..) | "mixtral" (block_sparse_moe..w1)

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)


@dataclass(frozen=True)
class ModelArgs:
    """Everything the decoder needs to know about a checkpoint (see module docstring)."""

    arch: str  # "llama" | "qwen2" | "qwen3" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v projections
    o_proj_bias: bool = False  # bias on the output projection (Llama/Qwen3 attention_bias; never Qwen2)
    mlp_bias: bool = False  # Llama `mlp_bias`
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before rope
    sliding_window: int | None = None
    # Per-layer window (None = full attention); Qwen2/3 only window layers >= max_window_layers.
    layer_windows: tuple[int | None, ...] = ()
    torch_dtype: str | None = None  # "float32" | "bfloat16" | "float16" as stored in the checkpoint
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    model_type: str = ""
    # DeepSeek-V2/V3 (multi-head latent attention, their MoE routing): workers/models/deepseek_config.py
    deepseek: DeepseekArgs | None = None
    moe: MoeArgs | None = None  # mixture of experts (None: every layer dense)
    gpt_oss: GptOssArgs | None = None  # GPT-OSS's experts and rope: workers/models/gpt_oss_config.py
    variant: VariantArgs | None = None  # GLM-4 / Phi-3 / SmolLM3 / Granite: workers/models/variant_config.py
    gemma: GemmaArgs | None = None  # Gemma 2/3 (workers/models/gemma_config.py)
    gemma4: Gemma4Args | None = None  # Gemma 4 text (workers/models/gemma4_config.py)
    glm4_moe: Glm4MoeArgs | None = None  # GLM-4-MoE's routing and rotary (workers/models/glm4_moe_config.py)
    # A sequence-classification checkpoint (architectures *ForSequenceClassification): its `score`
    # head's rows (num_labels) replace the LM head; 0 = a causal LM.
    num_labels: int = 0
    # Qwen3-Next / Qwen3.5 (Gated DeltaNet layers beside full attention): workers/models/hybrid_config.py
    hybrid: HybridArgs | None = None

    def __post_init__(self) -> None:
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (self.sliding_window,) * self.num_hidden_layers)

    # ------------------------------------------------------------------ parsing

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelArgs":
        """Parse `<path>/config.json` and, when present, `<path>/generation_config.json`."""
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelConfigError(f"{cfg_file}: not found (expected a Hugging Face model directory)")
        cfg = _read_json(cfg_file)
        gen_file = path / "generation_config.json"
        gen = _read_json(gen_file) if gen_file.is_file() else None
        return cls.from_dict(cfg, gen, source=str(cfg_file))

    @classmethod
    def from_dict(
        cls,
        cfg: Mapping[str, Any],
        generation_config: Mapping[str, Any] | None = None,
        *,
        source: str = "config.json",
    ) -> "ModelArgs":
        """Parse an already-loaded config dict (see `from_dir`). Errors name `source` and the key."""

        def err(key: str, msg: str) -> ModelConfigError:
            return ModelConfigError(f"{source}: {key}: {msg}")

        def get_int(key: str, default: int | None = None, *, minimum: int = 1) -> int:
            return config_int(cfg, key, err, default, minimum=minimum)

        def get_float(key: str, default: float) -> float:
            v = cfg.get(key, default)
            if v is None:
                v = default
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise err(key, f"must be a positive number, got {v!r}")
            return float(v)

        def get_bool(key: str, default: bool) -> bool:
            return config_bool(cfg, key, err, default)

        cfg = flatten_text_config(cfg)  # a Qwen3.5 checkpoint's text_config
        arch_key = _arch_of(cfg, err)
        arch = MOE_BASE.get(arch_key, arch_key)
        if arch in GEMMA_ARCHS + GEMMA4_ARCHS:
            cfg = text_config(cfg)  # a Gemma3/4ForConditionalGeneration: its text part

        act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
        if act != "silu" and arch not in GEMMA_ARCHS + GEMMA4_ARCHS:  # Gemma's GeGLU: parse_gemma(4) checks it
            raise err("hidden_act", f"only 'silu' is supported, got {act!r}")

        hidden = get_int("hidden_size")
        n_heads = get_int("num_attention_heads")
        n_kv = cfg.get("num_key_value_heads")
        n_kv = n_heads if n_kv is None else get_int("num_key_value_heads")
        if n_heads % n_kv:
            raise err("num_key_value_heads", f"{n_kv} does not divide num_attention_heads={n_heads}")
        deepseek = parse_deepseek(cfg, arch, err) if arch.startswith("deepseek") else None
        if deepseek is not None:  # the rope part of each head (what transformers' config calls head_dim)
            head_dim = deepseek.qk_rope_head_dim
        elif cfg.get("head_dim") is not None:
            head_dim = get_int("head_dim")
        else:
            if hidden % n_heads:
                raise err("hidden_size", f"{hidden} is not a multiple of num_attention_heads={n_heads}")
            head_dim = hidden // n_heads
        if head_dim % 2:
            raise err("head_dim", f"rotary embeddings need an even head_dim, got {head_dim}")
        n_layers = get_int("num_hidden_layers")
        max_pos = get_int("max_position_embeddings", {"llama": 4096, "gemma2": 8192, "gemma3": 131072,
                                                      "gemma4": 131072}.get(arch))

        variant = variant_windows = gemma = gemma4 = None
        rope_cfg = rope_config(cfg) if arch_key in HYBRID_ARCHS else cfg
        if arch in VARIANT_ARCHS.values():  # partial / interleaved rope, LongRoPE, NoPE layers, multipliers
            variant, rope_cfg, variant_windows = parse_variant(cfg, arch, head_dim, n_layers,
                                                               max_pos, err)
        glm4_moe = glm4_moe_experts = glm4_qk_norm = None
        if arch in GLM4_MOE_ARCHS.values():  # partial rotary, experts and their routing
            glm4_moe, glm4_moe_experts, rope_cfg, glm4_qk_norm = parse_glm4_moe(
                cfg, head_dim, n_layers, max_pos, err, MoeArgs)
        gpt_oss = parse_gpt_oss(cfg, err) if arch == "gpt_oss" else None
        # DeepSeek's and GPT-OSS's YaRN are their own (deepseek_config.py, gpt_oss_config.py)
        own_rope = deepseek or gpt_oss
        if arch in GEMMA_ARCHS:  # per-layer-type rope and windows, soft-capping: gemma_config.py
            gemma, rope_theta, rope_scaling, sliding_window, layer_windows = parse_gemma(
                cfg, arch, n_layers, err, lambda c: _parse_rope(c, err, max_pos))
        elif arch in GEMMA4_ARCHS:  # per-layer head geometry, rope, KV sharing, PLE: gemma4_config.py
            gemma4, sliding_window, layer_windows = parse_gemma4(
                cfg, n_layers, head_dim, n_kv, n_heads, get_int("intermediate_size"), err)
            rope_theta, rope_scaling = gemma4.ropes["full_attention"].theta, None
        elif own_rope:
            rope_theta, rope_scaling = own_rope.rope_theta, None
        else:
            rope_theta, rope_scaling = _parse_rope(rope_cfg, err, max_pos)
        rot = variant.rotary_dim if variant is not None else glm4_moe.rope.rotary_dim if glm4_moe else head_dim
        if rope_scaling is not None and rope_scaling.factors and len(rope_scaling.factors) != rot // 2:
            dims = f"head_dim {head_dim} needs" if variant is None else f"{rot} rotary dims need"
            raise err("rope_scaling.factors", f"{len(rope_scaling.factors)} factors, {dims} {rot // 2}")

        # Bias layout differs per family: Llama/Qwen3 `attention_bias` covers q,k,v,o; Qwen2 always
        # has q,k,v bias and never o bias (its config has no attention_bias key at all).
        if arch_key == "qwen2_moe":
            qkv_bias, o_bias = get_bool("qkv_bias", True), False
        elif arch == "qwen2":
            qkv_bias, o_bias = True, False
        elif arch in ("mistral", "phi3"):
            qkv_bias = o_bias = False
        elif arch in ("glm4", "glm4_moe"):  # q, k, v only (their o_proj has no bias)
            qkv_bias, o_bias = get_bool("attention_bias", arch == "glm4"), False
        elif deepseek is not None:  # q_a, kv_a and o projections (attention_bias)
            qkv_bias = o_bias = get_bool("attention_bias", False)
        else:  # GPT-OSS: q, k, v and o biases unless its config says otherwise
            qkv_bias = o_bias = get_bool("attention_bias", arch == "gpt_oss")
        mlp_bias = get_bool("mlp_bias", False) if arch in ("llama", "smollm3", "granite") else False

        if gemma is None and gemma4 is None:
            sliding_window, layer_windows = _parse_sliding_window(cfg, arch_key, n_layers, err)
        if variant_windows is not None:
            layer_windows = variant_windows
            sliding_window = next((w for w in layer_windows if w is not None), None)
        moe = _parse_moe(cfg, arch_key, n_layers, err) if arch_key in MOE_BASE else glm4_moe_experts
        hybrid = None
        if arch_key in HYBRID_ARCHS:
            hybrid, moe = parse_hybrid(cfg, arch_key, n_layers, head_dim, err, _parse_moe)

        dtype = cfg.get("torch_dtype", cfg.get("dtype"))
        if dtype is not None and dtype not in _DTYPES:
            # fp8/quantised checkpoints need kernels we do not have; fail early and say why.
            raise err("torch_dtype", f"unsupported checkpoint dtype {dtype!r} (supported: {', '.join(_DTYPES)})")

        gen = generation_config or {}
        eos_ids = _union_ids(
            _ids(cfg.get("eos_token_id"), err, "eos_token_id"),
            _ids(gen.get("eos_token_id"), lambda k, m: ModelConfigError(f"generation_config.json: {k}: {m}"), "eos_token_id"),
        )
        bos = gen.get("bos_token_id", cfg.get("bos_token_id"))
        if bos is not None and (isinstance(bos, bool) or not isinstance(bos, int)):
            raise err("bos_token_id", f"must be an integer, got {bos!r}")

        return cls(
            arch=arch,
            vocab_size=get_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=(get_int("intermediate_size") if moe is None or not all(moe.sparse_layers)
                               else get_int("intermediate_size", moe.moe_intermediate_size)),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=get_float("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=get_bool("tie_word_embeddings", gemma is not None or gemma4 is not None),  # Gemma: tied
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=arch in ("qwen3", "gemma3") or hybrid is not None or bool(glm4_qk_norm),
            sliding_window=sliding_window,
            layer_windows=layer_windows,
            torch_dtype=dtype,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            model_type=str(cfg.get("model_type", "")),
            deepseek=deepseek,
            moe=moe,
            gpt_oss=gpt_oss,
            variant=variant,
            gemma=gemma,
            gemma4=gemma4,
            glm4_moe=glm4_moe,
            num_labels=_num_labels(cfg, err, dense=deepseek is None and moe is None),
            hybrid=hybrid,
        )

    # ---------------------------------------------------------------- helpers

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: expected a JSON object at top level")
    return data


def _arch_of(cfg: Mapping[str, Any], err: Any) -> str:
    model_type = cfg.get("model_type")
    if model_type is not None:
        if model_type not in SUPPORTED_ARCHS:
            supported = sorted({k for k in SUPPORTED_ARCHS if k.islower()})
            raise err("model_type", f"unsupported model type {model_type!r} (supported: {', '.join(supported)})")
        return SUPPORTED_ARCHS[model_type]
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in SUPPORTED_ARCHS:
            return SUPPORTED_ARCHS[a]
    if archs:
        raise err("architectures", f"unsupported architecture {archs!r} (supported: "
                  f"{', '.join(sorted(k for k in SUPPORTED_ARCHS if not k.islower()))})")
    raise err("model_type", "missing (and no 'architectures' either); cannot tell the model family")


def _num_labels(cfg: Mapping[str, Any], err: Any, dense: bool) -> int:
    """A sequence-classification checkpoint's head size (its ``id2label``, else ``num_labels``,
    else transformers' default 2); 0 for a causal LM."""
    if not any(str(a).endswith(CLASSIFIER_SUFFIX) for a in cfg.get("architectures") or []):
        return 0
    if not dense:
        raise err("architectures", "sequence classification is served for the dense families only "
                  "(Llama, Qwen2, Qwen3, Mistral)")
    labels = cfg.get("id2label")
    n = len(labels) if isinstance(labels, dict) and labels else cfg.get("num_labels", 2)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise err("num_labels", f"must be a positive integer, got {n!r}")
    return n


def _parse_rope(cfg: Mapping[str, Any], err: Any, max_pos: int) -> tuple[float, RopeScaling | None]:
    """Read rope_theta and scaling from either the classic (`rope_theta` + `rope_scaling`) or the
    transformers>=5 (`rope_parameters`) layout."""
    key = "rope_scaling"
    params = cfg.get("rope_scaling")
    if params is None and cfg.get("rope_parameters") is not None:
        key, params = "rope_parameters", cfg["rope_parameters"]
    if params is not None and not isinstance(params, dict):
        raise err(key, f"must be an object or null, got {params!r}")
    params = dict(params or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise err(key, "per-layer-type RoPE parameters are not supported by the Llama-family decoder")

    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise err("rope_theta", f"must be a positive number, got {theta!r}")
    prf = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        raise err("partial_rotary_factor", f"only 1.0 is supported, got {prf!r}")

    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type == "freq_factors":
        factors = params.get("factors")
        if (not isinstance(factors, list) or not factors
                or not all(isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in factors)):
            raise err(f"{key}.factors", f"must be a list of positive numbers, got {factors!r}")
        return float(theta), RopeScaling("freq_factors", 1.0, factors=tuple(float(f) for f in factors))
    if rope_type not in ("llama3", "linear"):
        raise err(f"{key}.rope_type", f"unsupported RoPE scaling type {rope_type!r} (supported: default, llama3, "
                  "linear, freq_factors)")

    def num(name: str, default: float | None = None) -> float:
        v = params.get(name, default)
        if v is None:
            raise err(f"{key}.{name}", f"missing (required for rope_type {rope_type!r})")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise err(f"{key}.{name}", f"must be a positive number, got {v!r}")
        return float(v)

    factor = num("factor")
    if rope_type == "linear":
        return float(theta), RopeScaling("linear", factor)
    low, high = num("low_freq_factor"), num("high_freq_factor")
    if high <= low:
        raise err(f"{key}.high_freq_factor", f"must be greater than low_freq_factor ({high} <= {low})")
    # transformers falls back to max_position_embeddings when the original length is absent.
    orig = params.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings", max_pos))
    if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
        raise err(f"{key}.original_max_position_embeddings", f"must be a positive integer, got {orig!r}")
    return float(theta), RopeScaling("llama3", factor, low, high, orig)


def _parse_sliding_window(
    cfg: Mapping[str, Any], arch: str, n_layers: int, err: Any
) -> tuple[int | None, tuple[int | None, ...]]:
    """Sliding-window attention: Mistral when `sliding_window` is set; Qwen2/3 only when
    `use_sliding_window` is true, and then only on layers >= `max_window_layers` (or as `layer_types` says)."""
    # variants: parse_variant reads their windows; hybrid: refused in parse_hybrid
    if (arch in ("llama", *VARIANT_ARCHS.values(), *GLM4_MOE_ARCHS.values()) or arch.startswith("deepseek")
            or arch in HYBRID_ARCHS):
        return None, (None,) * n_layers
    window = cfg.get("sliding_window")
    if arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window", False):
        window = None
    if window is None:
        return None, (None,) * n_layers
    if arch == "gpt_oss" and cfg.get("layer_types") is None:  # transformers' default: sliding, full, sliding..
        cfg = {**cfg, "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise err("sliding_window", f"must be a positive integer or null, got {window!r}")
    if arch in ("mistral", "mixtral", "qwen3_moe"):  # Qwen3-MoE: every layer (transformers' Qwen3MoeAttention)
        return window, (window,) * n_layers
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != n_layers:
            raise err("layer_types", f"must be a list of {n_layers} entries, got {layer_types!r}")
        bad = [t for t in layer_types if t not in ("full_attention", "sliding_attention")]
        if bad:
            raise err("layer_types", f"unsupported layer type(s) {sorted(set(bad))!r}")
        return window, tuple(window if t == "sliding_attention" else None for t in layer_types)
    mwl = cfg.get("max_window_layers", 28)
    if isinstance(mwl, bool) or not isinstance(mwl, int) or mwl < 0:
        raise err("max_window_layers", f"must be a non-negative integer, got {mwl!r}")
    if arch == "qwen2_moe":  # transformers' Qwen2MoeConfig default layer_types: odd layers below max_window_layers
        return window, tuple(window if (i + 1) % 2 and i < mwl else None for i in range(n_layers))
    return window, tuple(window if i >= mwl else None for i in range(n_layers))


def _parse_moe(cfg: Mapping[str, Any], arch: str, n_layers: int, err: Any) -> MoeArgs | None:
    """The MoE keys of a Qwen2-MoE / Qwen3-MoE / Mixtral config.json (None: no sparse layer)."""

    def pos_int(key: str, default: Any = None, minimum: int = 1) -> int:
        return config_int(cfg, key, err, default, minimum=minimum)

    def flag(key: str, default: bool) -> bool:
        return config_bool(cfg, key, err, default)

    if arch == "mixtral":
        n = pos_int("num_local_experts", 8)
        top_k = pos_int("num_experts_per_tok", 2)
        inter = pos_int("intermediate_size")
        sparse = (True,) * n_layers
        moe = MoeArgs(n, top_k, inter, True, sparse, names="mixtral")
    else:
        # transformers >= 5 writes Qwen3-MoE's count as num_local_experts (its checkpoints: num_experts)
        key = "num_experts" if "num_experts" in cfg or "num_local_experts" not in cfg else "num_local_experts"
        n = pos_int(key, 60 if arch == "qwen2_moe" else 128, minimum=0)
        if n == 0:
            return None
        top_k = pos_int("num_experts_per_tok", 4 if arch == "qwen2_moe" else 8)
        inter = pos_int("moe_intermediate_size")
        step = pos_int("decoder_sparse_step", 1)
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise err("mlp_only_layers", f"must be a list of layer indices, got {only!r}")
        sparse = tuple(i not in only and (i + 1) % step == 0 for i in range(n_layers))
        shared = pos_int("shared_expert_intermediate_size", minimum=0) if arch == "qwen2_moe" else 0
        moe = MoeArgs(n, top_k, inter, flag("norm_topk_prob", False), sparse, shared_expert_intermediate_size=shared,
                      shared_expert_gate=bool(shared), names="qwen")
    if top_k > n:
        raise err("num_experts_per_tok", f"{top_k} is more than the {n} experts")
    if flag("output_router_logits", False):
        pass  # a training option (the auxiliary loss): nothing to serve differently
    return moe if any(moe.sparse_layers) else None


def _ids(value: Any, err: Any, key: str) -> list[int]:
    if value is None:
        return []
    vals = value if isinstance(value, list) else [value]
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise err(key, f"must be a token id or a list of token ids, got {value!r}")
    return list(vals)


def _union_ids(*lists: list[int]) -> list[int]:
    out: list[int] = []
    for ids in lists:
        for i in ids:
            if i not in out:
                out.append(i)
    return out
