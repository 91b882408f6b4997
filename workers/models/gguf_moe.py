"""llama.cpp's mixture-of-experts GGUF files (``qwen2moe``, ``qwen3moe``, ``glm4moe``) as Hugging
Face config keys and tensor names; torch-free, as gguf_file.py (which calls it).

What convert_hf_to_gguf.py writes for them (conversion/qwen.py ``Qwen2MoeModel`` /
``Qwen3MoeModel``, conversion/glm.py ``Glm4MoeModel``) and llama.cpp computes (src/models/*.cpp):

- the routed experts stacked per layer: ``blk.N.ffn_gate_exps`` / ``ffn_up_exps`` [E, I, H] and
  ``ffn_down_exps`` [E, H, I] (or gate and up fused as ``ffn_gate_up_exps`` [E, 2I, H], the
  converter's ``--fuse-gate-up-exps``); each Hugging Face per-expert tensor is one expert of them
  (``expert_part``: a view the loader reads like any tensor, so each expert is dequantised on its
  own, into its rows of the model's stacked weights);
- the router ``ffn_gate_inp``, shared experts ``ffn_{gate,up,down}_shexp``, Qwen2-MoE's shared
  expert gate ``ffn_gate_inp_shexp`` as a 1-D [H] (the converter squeezes [1, H]), GLM-4-MoE's
  correction bias ``exp_probs_b.bias``;
- keys: ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``,
  ``expert_shared_feed_forward_length`` (Qwen2-MoE), ``expert_shared_count``,
  ``leading_dense_block_count``, ``expert_group_count`` / ``expert_group_used_count``,
  ``expert_weights_scale``, ``expert_weights_norm``, ``nextn_predict_layers`` (GLM-4-MoE);
- top-k renormalisation as llama.cpp hard-codes it (qwen2moe.cpp: no, qwen3moe.cpp: yes;
  transformers' GGUF loader sets Qwen3-MoE's ``norm_topk_prob`` the same way), GLM-4-MoE's from
  ``expert_weights_norm``;
- GLM-4-MoE's multi-token-prediction layers (``block_count`` counts them, ``nextn_predict_layers``
  says how many, the last ones): not loaded, as from safetensors.

The hybrid Qwen3-Next (``qwen3next``, whose experts are these) is gguf_hybrid.py's.
"""
from __future__ import annotations

import re
from typing import Any

__all__ = ["MOE_ARCHS", "expert_part", "moe_keys", "mtp_layers"]

# general.architecture -> (model_type, class), the mixtures of experts served from GGUF
MOE_ARCHS: dict[str, tuple[str, str]] = {
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "glm4moe": ("glm4_moe", "Glm4MoeForCausalLM"),
}

_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|"
                     r"w1|w3|w2)\.weight")
_KIND = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def _int(g: Any, suffix: str, err: type[Exception], default: int | None = None, minimum: int = 1) -> int:
    v = g.arch_key(suffix, default)
    if v is None:
        raise err(f"metadata {g.arch}.{suffix} is missing")
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise err(f"metadata {g.arch}.{suffix} must be an integer >= {minimum}, got {v!r}")
    return int(v)


def mtp_layers(g: Any) -> int:
    """The multi-token-prediction layers counted in ``block_count``, the last ones (GLM-4-MoE's;
    Qwen3-Next's and Qwen3.5's, which the converter's ``_QwenMtpMixin`` appends the same way); 0
    elsewhere."""
    n = g.arch_key("nextn_predict_layers", 0) if g.arch in ("glm4moe", "qwen3next", "qwen35", "qwen35moe") else 0
    return int(n) if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def moe_keys(g: Any, head_dim: int, err: type[Exception]) -> dict[str, Any]:
    """config.json keys of a ``qwen2moe`` / ``qwen3moe`` / ``glm4moe`` file ``g`` (gguf_file.GgufFile)
    beyond the dense ones (``num_hidden_layers`` without GLM-4-MoE's MTP layers)."""
    arch = g.arch
    experts = _int(g, "expert_count", err)
    out: dict[str, Any] = {"num_experts_per_tok": _int(g, "expert_used_count", err),
                           "moe_intermediate_size": _int(g, "expert_feed_forward_length", err)}
    if arch == "glm4moe":
        blocks, mtp = _int(g, "block_count", err), mtp_layers(g)
        if mtp >= blocks:
            raise err(f"metadata {arch}.nextn_predict_layers {mtp} leaves no layer of its {blocks} blocks")
        out.update(n_routed_experts=experts, num_hidden_layers=blocks - mtp, num_nextn_predict_layers=mtp,
                   n_shared_experts=_int(g, "expert_shared_count", err, 0, minimum=0),
                   first_k_dense_replace=_int(g, "leading_dense_block_count", err, 0, minimum=0),
                   n_group=_int(g, "expert_group_count", err, 1), topk_group=_int(g, "expert_group_used_count", err, 1),
                   norm_topk_prob=bool(g.arch_key("expert_weights_norm", True)),
                   routed_scaling_factor=float(g.arch_key("expert_weights_scale", 1.0) or 1.0),
                   partial_rotary_factor=_int(g, "rope.dimension_count", err, head_dim) / head_dim,
                   attention_bias="blk.0.attn_q.bias" in g.tensors,
                   use_qk_norm="blk.0.attn_q_norm.weight" in g.tensors)
        func = g.arch_key("expert_gating_func")
        if func is not None and int(func) != 2:  # gguf.ExpertGatingFuncType.SIGMOID
            raise err(f"metadata {arch}.expert_gating_func {func!r}: GLM-4-MoE routes by sigmoid (2)")
        return out
    out.update(num_experts=experts, decoder_sparse_step=1, mlp_only_layers=[],
               norm_topk_prob=arch == "qwen3moe")  # as llama.cpp's qwen2moe.cpp / qwen3moe.cpp compute
    if arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = _int(g, "expert_shared_feed_forward_length", err)
    return out


def expert_part(hf: str, tensors: dict[str, Any], moe_inter: int) -> str | None:
    """The part name (gguf_file.GgufFile.ref) of a Hugging Face per-expert tensor ``hf``:
    ``blk.N.ffn_gate_exps.weight@E`` (expert E of the stacked tensor), or with a fused
    ``ffn_gate_up_exps`` ``...@E:first:last`` rows of it; None for any other tensor."""
    m = _EXPERT.fullmatch(hf)
    if m is None:
        return None
    layer, e, kind = m.group(1), int(m.group(2)), _KIND[m.group(3)]
    fused = f"blk.{layer}.ffn_gate_up_exps.weight"
    if kind != "down" and fused in tensors:
        r0 = 0 if kind == "gate" else moe_inter
        return f"{fused}@{e}:{r0}:{r0 + moe_inter}"
    return f"blk.{layer}.ffn_{kind}_exps.weight@{e}"
