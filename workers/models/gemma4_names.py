"""The tensors of a Gemma 4 (text) checkpoint by Hugging Face name with their full shapes
(workers/models/checkpoint.py checks a checkpoint against them before any worker imports torch;
``gemma4.param_slots`` says where each goes).

A ``Gemma4ForConditionalGeneration`` checkpoint stores the decoder under ``model.language_model.``
beside the vision and audio towers and their embedders: ``checkpoint_key`` maps the first to the
text model's names and skips the others (workers/models/multimodal_names.py: not served, counted and
logged by the loader). The k/v
projections and norms of a KV-shared layer, which transformers ignores on load, are skipped too."""
from __future__ import annotations

import re

from .config import ModelArgs
from .multimodal_names import text_key

__all__ = ["checkpoint_key", "expected_tensors"]

_KV = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


def checkpoint_key(name: str, args: ModelArgs) -> str | None:
    """The text model's name of checkpoint tensor ``name``; None: not served (a tower, or a
    KV-shared layer's unused k/v tensors)."""
    if (name := text_key(name)) is None:
        return None
    m = _KV.match(name)
    g = args.gemma4
    if m and g is not None and int(m.group(1)) < len(g.kv_source) and g.shared(int(m.group(1))):
        return None
    return name


def expected_tensors(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """HF name -> full shape of every tensor a Gemma 4 text checkpoint must hold."""
    g = args.gemma4
    assert g is not None
    hid, heads, n = args.hidden_size, args.num_attention_heads, args.num_hidden_layers
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (args.vocab_size, hid),
                                       "model.norm.weight": (hid,)}
    if not args.tie_word_embeddings:
        out["lm_head.weight"] = (args.vocab_size, hid)
    if g.ple_dim:
        out["model.embed_tokens_per_layer.weight"] = (g.ple_vocab, n * g.ple_dim)
        out["model.per_layer_model_projection.weight"] = (n * g.ple_dim, hid)
        out["model.per_layer_projection_norm.weight"] = (g.ple_dim,)
    for i in range(n):
        pre, d, kvh, inter = f"model.layers.{i}.", g.head_dims[i], g.kv_heads[i], g.intermediate[i]
        a = f"{pre}self_attn."
        out[f"{pre}layer_scalar"] = (1,)
        projs = [("q_proj", heads * d), ("o_proj", hid)]
        if not g.shared(i):
            projs += [("k_proj", kvh * d)] + ([] if g.k_eq_v[i] else [("v_proj", kvh * d)])
            out[f"{a}k_norm.weight"] = (d,)
        for proj, rows in projs:
            out[f"{a}{proj}.weight"] = (rows, heads * d if proj == "o_proj" else hid)
            if args.attention_bias:
                out[f"{a}{proj}.bias"] = (rows,)
        out[f"{a}q_norm.weight"] = (d,)
        for proj, shape in (("gate_proj", (inter, hid)), ("up_proj", (inter, hid)), ("down_proj", (hid, inter))):
            out[f"{pre}mlp.{proj}.weight"] = shape
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            out[f"{pre}{norm}.weight"] = (hid,)
        if g.num_experts:  # the MoE block beside the MLP, with its three norms
            e, mi = g.num_experts, g.moe_intermediate_size
            out.update({f"{pre}router.proj.weight": (e, hid), f"{pre}router.scale": (hid,),
                        f"{pre}router.per_expert_scale": (e,), f"{pre}experts.gate_up_proj": (e, 2 * mi, hid),
                        f"{pre}experts.down_proj": (e, hid, mi)})
            for norm in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
                out[f"{pre}{norm}.weight"] = (hid,)
        if g.ple_dim:
            out[f"{pre}per_layer_input_gate.weight"] = (g.ple_dim, hid)
            out[f"{pre}per_layer_projection.weight"] = (hid, g.ple_dim)
            out[f"{pre}post_per_layer_input_norm.weight"] = (hid,)
    return out
