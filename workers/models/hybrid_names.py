"""The tensors of a Qwen3-Next / Qwen3.5 checkpoint by Hugging Face name with their full shapes
(workers/models/checkpoint.py checks a checkpoint against them before any worker imports torch;
``qwen3_next.param_slots`` says where each goes).

A Qwen3.5 checkpoint as published (``Qwen3_5ForConditionalGeneration``) stores the decoder under
``model.language_model.`` beside the vision tower (``model.visual.``) and the multi-token
prediction head (``mtp.``): ``checkpoint_key`` maps the first to the text model's names and skips
the other two (neither is served)."""
from __future__ import annotations

from .config import ModelArgs
from .moe_names import QWEN_NAMES
from .moe_names import expected_tensors as moe_expected

__all__ = ["checkpoint_key", "expected_tensors"]

_SKIPPED = ("model.visual.", "mtp.", "model.mtp.")


def checkpoint_key(name: str) -> str | None:
    """The text model's name of checkpoint tensor ``name``; None: not served (vision, MTP)."""
    if name.startswith(_SKIPPED):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


def expected_tensors(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """HF name -> full shape of every tensor a hybrid checkpoint must hold."""
    hy = args.hybrid
    assert hy is not None
    hid, inter, d = args.hidden_size, args.intermediate_size, args.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (args.vocab_size, hid),
                                       "model.norm.weight": (hid,)}
    if not args.tie_word_embeddings:
        out["lm_head.weight"] = (args.vocab_size, hid)
    for i, kind in enumerate(hy.layer_types):
        pre = f"model.layers.{i}."
        if kind == "full_attention":
            a = f"{pre}self_attn."
            out[f"{a}q_proj.weight"] = (2 * args.num_attention_heads * d, hid)  # query and its output gate
            out[f"{a}k_proj.weight"] = (args.num_key_value_heads * d, hid)
            out[f"{a}v_proj.weight"] = (args.num_key_value_heads * d, hid)
            out[f"{a}o_proj.weight"] = (hid, args.num_attention_heads * d)
            out[f"{a}q_norm.weight"] = (d,)
            out[f"{a}k_norm.weight"] = (d,)
        else:
            la = f"{pre}linear_attn."
            if hy.layout == "qkvz":
                out[f"{la}in_proj_qkvz.weight"] = (hy.conv_dim + hy.value_dim, hid)
                out[f"{la}in_proj_ba.weight"] = (2 * hy.num_v_heads, hid)
            else:
                out[f"{la}in_proj_qkv.weight"] = (hy.conv_dim, hid)
                out[f"{la}in_proj_z.weight"] = (hy.value_dim, hid)
                out[f"{la}in_proj_b.weight"] = (hy.num_v_heads, hid)
                out[f"{la}in_proj_a.weight"] = (hy.num_v_heads, hid)
            out[f"{la}conv1d.weight"] = (hy.conv_dim, 1, hy.conv_kernel)
            out[f"{la}dt_bias"] = (hy.num_v_heads,)
            out[f"{la}A_log"] = (hy.num_v_heads,)
            out[f"{la}norm.weight"] = (hy.head_v_dim,)
            out[f"{la}out_proj.weight"] = (hid, hy.value_dim)
        moe = args.moe
        if moe is not None and moe.sparse_layers[i]:
            out.update(moe_expected(pre, QWEN_NAMES, hid, moe.num_experts, moe.moe_intermediate_size,
                                    moe.shared_expert_intermediate_size, moe.shared_expert_gate))
        else:
            for proj, shape in (("gate_proj", (inter, hid)), ("up_proj", (inter, hid)), ("down_proj", (hid, inter))):
                out[f"{pre}mlp.{proj}.weight"] = shape
        out[f"{pre}input_layernorm.weight"] = (hid,)
        out[f"{pre}post_attention_layernorm.weight"] = (hid,)
    return out
