"""llama.cpp's ``qwen3next`` GGUF files (Qwen3-Next: Gated DeltaNet layers beside gated full
attention, Qwen2-MoE's experts) as Hugging Face config keys and tensor names; torch-free, as
gguf_file.py (which calls it).

convert_hf_to_gguf.py's ``Qwen3NextModel`` (conversion/qwen.py) rewrites the checkpoint, and this
module maps each rewrite back:

- ``in_proj_qkvz`` (rows per key head h: q_h, k_h, v_h, z_h) is split into ``attn_qkv`` (every
  q, then every k, then every v) and ``attn_gate`` (every z): each piece of a head is a row range
  of one of them, read into its rows of ``in_proj_qkvz`` (``qkvz_parts``: the part names and the
  destination rows the loader takes: ``NAME@rows:A:B`` into ``HF#ROW``);
- ``conv1d.weight`` [C, 1, K] squeezed to ``ssm_conv1d.weight`` [C, K] (read as ``@unsqueeze1``);
  ``dt_bias`` as ``ssm_dt.bias``; ``A_log`` stored as ``ssm_a`` = -exp(A_log), read back as
  log(-ssm_a) in fp32; the (1 + w) RMSNorm weights (every ``*norm.weight`` but the gated
  ``ssm_norm``) stored as 1 + w, read back minus one in fp32 (``value_map``): the float rounding of
  those two round trips is the only way the served model differs from the checkpoint's values;
- keys: ``ssm.conv_kernel``, ``ssm.state_size`` (the key head dim), ``ssm.group_count`` (key
  heads), ``ssm.time_step_rank`` (value heads), ``ssm.inner_size`` (value heads x value head dim),
  ``full_attention_interval``, ``rope.dimension_count`` (partial rotary), and Qwen2-MoE's expert
  keys with the top-k renormalised (qwen3next.cpp); the multi-token-prediction blocks the converter
  appends (``nextn_predict_layers`` of ``block_count``) are not loaded, as from safetensors.

Qwen3.5 (``qwen35``, ``qwen35moe``; ``Qwen3_5TextModel`` / ``Qwen3_5MoeTextModel``) keeps the
checkpoint's separate ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` (as
``attn_qkv``, ``attn_gate``, ``ssm_beta``, ``ssm_alpha``) with the same value rewrites, and
``_LinearAttentionVReorderBase`` also reorders the value heads from grouped by key head (HF:
head h * r + j, r value heads per key head) to tiled (file: j * nk + h) for ggml's broadcast: the
v rows of ``attn_qkv`` and of the convolution's channels, the rows of ``attn_gate``,
``ssm_beta``, ``ssm_alpha``, the entries of ``ssm_a`` / ``ssm_dt.bias`` and the columns of
``ssm_out``. ``v_order`` gives each such tensor's inverse (Hugging Face row / column i is the
file's row / column ``idx[i]``): the loader reads those tensors whole, dequantised, and takes
its rows / columns through it (tensor-parallel slices included). The MoE keys are read for
``qwen35moe`` only; ``attention.recurrent_layers`` (the converter writes it from
``layer_types``) gives the layer types when present.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .gguf_moe import mtp_layers

__all__ = ["HYBRID_ARCHS", "hybrid_keys", "linear_attn_parts", "v_order", "value_map"]

HYBRID_ARCHS: dict[str, tuple[str, str]] = {"qwen3next": ("qwen3_next", "Qwen3NextForCausalLM"),
                                            "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
                                            "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")}
# Whose converter reorders the value heads (_LinearAttentionVReorderBase)
V_REORDERED = ("qwen35", "qwen35moe")


def _int(g: Any, suffix: str, err: type[Exception], default: int | None = None) -> int:
    v = g.arch_key(suffix, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise err(f"metadata {g.arch}.{suffix} must be a positive integer, got {v!r}")
    return int(v)


def hybrid_keys(g: Any, head_dim: int, err: type[Exception]) -> dict[str, Any]:
    """config.json keys of a ``qwen3next`` file ``g`` beyond the dense ones."""
    nv = _int(g, "ssm.time_step_rank", err)
    inner = _int(g, "ssm.inner_size", err)
    if inner % nv:
        raise err(f"metadata {g.arch}.ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {nv}")
    blocks, mtp = _int(g, "block_count", err), mtp_layers(g)
    if mtp >= blocks:
        raise err(f"metadata {g.arch}.nextn_predict_layers {mtp} leaves no layer of its {blocks} blocks")
    out: dict[str, Any] = {
        "num_hidden_layers": blocks - mtp,  # the MTP blocks (the last ones) are not served
        "linear_conv_kernel_dim": _int(g, "ssm.conv_kernel", err), "linear_key_head_dim": _int(g, "ssm.state_size", err),
        "linear_num_key_heads": _int(g, "ssm.group_count", err), "linear_num_value_heads": nv,
        "linear_value_head_dim": inner // nv, "full_attention_interval": _int(g, "full_attention_interval", err, 4),
        "partial_rotary_factor": _int(g, "rope.dimension_count", err, head_dim) / head_dim,
    }
    if nv % out["linear_num_key_heads"]:
        raise err(f"metadata {g.arch}.ssm.time_step_rank {nv} is not a multiple of ssm.group_count "
                  f"{out['linear_num_key_heads']}")
    recurrent = g.array(f"{g.arch}.attention.recurrent_layers")
    if recurrent is not None:  # one flag per block (the MTP blocks' too): the layer types
        if not isinstance(recurrent, list) or len(recurrent) != blocks:
            raise err(f"metadata {g.arch}.attention.recurrent_layers must hold {blocks} flags, got {recurrent!r}")
        out["layer_types"] = ["linear_attention" if r else "full_attention" for r in recurrent[:blocks - mtp]]
    if g.arch != "qwen35":  # Qwen2-MoE's expert keys, the top-k renormalised (qwen3next.cpp, qwen35moe.cpp)
        out.update({"num_experts": _int(g, "expert_count", err), "num_experts_per_tok": _int(g, "expert_used_count", err),
                    "moe_intermediate_size": _int(g, "expert_feed_forward_length", err),
                    "shared_expert_intermediate_size": _int(g, "expert_shared_feed_forward_length", err),
                    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []})
    return out


def linear_attn_parts(hf: str, g: Any) -> list[tuple[str, int]] | None:
    """(part name, first destination row) of the Hugging Face tensor ``hf`` of a Gated DeltaNet
    layer of the file ``g``; None for any other tensor."""
    pre, sep, name = hf.partition(".linear_attn.")
    if not sep:
        return None
    blk = f"blk.{pre.rsplit('.', 1)[1]}."
    if name == "in_proj_qkvz.weight":
        nk, dk = int(g.arch_key("ssm.group_count")), int(g.arch_key("ssm.state_size"))
        rv = int(g.arch_key("ssm.inner_size")) // nk  # the value rows of one key head's group
        group = 2 * dk + 2 * rv  # one key head's rows: q, k, v, z
        out = []
        for h in range(nk):
            for src, r0, n, dst in (("attn_qkv", h * dk, dk, 0), ("attn_qkv", nk * dk + h * dk, dk, dk),
                                    ("attn_qkv", 2 * nk * dk + h * rv, rv, 2 * dk),
                                    ("attn_gate", h * rv, rv, 2 * dk + rv)):
                out.append((f"{blk}{src}.weight@rows:{r0}:{r0 + n}", h * group + dst))
        return out
    simple = {"in_proj_ba.weight": "ssm_ba.weight", "in_proj_qkv.weight": "attn_qkv.weight",
              "in_proj_z.weight": "attn_gate.weight", "in_proj_b.weight": "ssm_beta.weight",
              "in_proj_a.weight": "ssm_alpha.weight", "conv1d.weight": "ssm_conv1d.weight@unsqueeze1",
              "dt_bias": "ssm_dt.bias", "A_log": "ssm_a", "norm.weight": "ssm_norm.weight",
              "out_proj.weight": "ssm_out.weight"}
    return [(blk + simple[name], 0)] if name in simple else None


def _heads(nk: int, nv: int, dim: int) -> np.ndarray:
    """Inverse of the converter's ``_reorder_v_heads`` over ``nv`` heads of ``dim`` rows: the file
    row of each Hugging Face row (HF head h * r + j was written at j * nk + h)."""
    r = nv // nk
    m = np.arange(nv)
    return (((m % r) * nk + m // r)[:, None] * dim + np.arange(dim)).reshape(-1)


def v_order(g: Any, gname: str) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(file row of each HF row, file column of each HF column) of the tensor (or part) ``gname``
    of a file whose converter reordered the value heads; None: that axis as stored."""
    if g.arch not in V_REORDERED:
        return None, None
    nk, nv = int(g.arch_key("ssm.group_count")), int(g.arch_key("ssm.time_step_rank"))
    if nk == nv:  # the converter reorders nothing then
        return None, None
    dv = int(g.arch_key("ssm.inner_size")) // nv
    kind = gname.partition("@")[0].split(".")[2] if gname.startswith("blk.") else ""
    if kind in ("attn_qkv", "ssm_conv1d"):  # q and k channels as stored, then the value heads
        qk = 2 * nk * int(g.arch_key("ssm.state_size"))
        return np.concatenate([np.arange(qk), qk + _heads(nk, nv, dv)]), None
    if kind == "attn_gate":
        return _heads(nk, nv, dv), None
    if kind in ("ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt"):
        return _heads(nk, nv, 1), None
    if kind == "ssm_out":
        return None, _heads(nk, nv, dv)
    return None, None


def value_map(arch: str, gname: str) -> Callable[[np.ndarray], np.ndarray] | None:
    """What turns the values of tensor ``gname`` back into the checkpoint's (fp32), None: as stored."""
    if arch not in HYBRID_ARCHS:
        return None
    if gname.endswith(".ssm_a"):
        return lambda v: np.log(-np.asarray(v, dtype=np.float32))
    if gname.endswith("norm.weight") and not gname.endswith("ssm_norm.weight"):
        return lambda v: np.asarray(v, dtype=np.float32) - np.float32(1.0)
    return None
