"""The tensors of a DeepSeek-V2/V3 checkpoint, by Hugging Face name with their full shapes
(``workers/models/checkpoint.py`` checks a checkpoint against them; ``deepseek.param_slots`` says
where each goes). Apart from deepseek.py so that the checkpoint check does not import the decoder."""
from __future__ import annotations

from .config import ModelArgs
from .moe import DEEPSEEK_NAMES
from .moe import expected_tensors as moe_expected

__all__ = ["expected_tensors"]


def _layer_dense_names(pre: str, hid: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {f"{pre}mlp.gate_proj.weight": (inter, hid), f"{pre}mlp.up_proj.weight": (inter, hid),
            f"{pre}mlp.down_proj.weight": (hid, inter)}


def expected_tensors(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """HF name -> full shape of every tensor a DeepSeek checkpoint must hold (the MTP layers,
    ``model.layers.{num_hidden_layers + i}``, are not among them: checkpoint.py skips them)."""
    ds = args.deepseek
    assert ds is not None
    hid, h = args.hidden_size, args.num_attention_heads
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (args.vocab_size, hid),
                                       "model.norm.weight": (hid,)}
    if not args.tie_word_embeddings:
        out["lm_head.weight"] = (args.vocab_size, hid)
    for i in range(args.num_hidden_layers):
        pre = f"model.layers.{i}."
        a = f"{pre}self_attn."
        if ds.q_lora_rank is None:
            out[f"{a}q_proj.weight"] = (h * ds.qk_head_dim, hid)
        else:
            out[f"{a}q_a_proj.weight"] = (ds.q_lora_rank, hid)
            if args.attention_bias:
                out[f"{a}q_a_proj.bias"] = (ds.q_lora_rank,)
            out[f"{a}q_a_layernorm.weight"] = (ds.q_lora_rank,)
            out[f"{a}q_b_proj.weight"] = (h * ds.qk_head_dim, ds.q_lora_rank)
        out[f"{a}kv_a_proj_with_mqa.weight"] = (ds.latent_width, hid)
        if args.attention_bias:
            out[f"{a}kv_a_proj_with_mqa.bias"] = (ds.latent_width,)
        out[f"{a}kv_a_layernorm.weight"] = (ds.kv_lora_rank,)
        out[f"{a}kv_b_proj.weight"] = (h * (ds.qk_nope_head_dim + ds.v_head_dim), ds.kv_lora_rank)
        out[f"{a}o_proj.weight"] = (hid, h * ds.v_head_dim)
        if args.attention_bias:
            out[f"{a}o_proj.bias"] = (hid,)
        if ds.is_moe_layer(i):
            out.update(moe_expected(pre, DEEPSEEK_NAMES, hid, ds.n_routed_experts, ds.moe_intermediate_size,
                                    ds.moe_intermediate_size * ds.n_shared_experts))
            if ds.scoring == "sigmoid":
                out[f"{pre}mlp.gate.e_score_correction_bias"] = (ds.n_routed_experts,)
        else:
            out.update(_layer_dense_names(pre, hid, args.intermediate_size))
        out[f"{pre}input_layernorm.weight"] = (hid,)
        out[f"{pre}post_attention_layernorm.weight"] = (hid,)
    return out
