"""Checkpoint tensor names of GLM-4 / Phi-3 / SmolLM3 / Granite where they differ from Llama's:
Phi-3 stores q/k/v as one ``self_attn.qkv_proj`` (rows [q; k; v]) and, as GLM-4, gate/up as one
``mlp.gate_up_proj`` (rows [gate; up]): our fused modules' own layouts. GLM-4 adds
``post_self_attn_layernorm`` and ``post_mlp_layernorm`` to each layer. Torch-free (checkpoint.py
checks headers with it)."""
from __future__ import annotations

from typing import Callable, TypeVar

from .config import ModelArgs

__all__ = ["FUSED", "expected_tensors", "fuse_names"]

T = TypeVar("T")

# fused checkpoint tensor -> the Llama tensors it stands for, in row order
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse_names(args: ModelArgs, table: dict[str, T], merge: Callable[[str, list[T]], T]) -> dict[str, T]:
    """``table`` (Llama's names -> a value) with the fused families' parts replaced by their fused
    tensor, valued ``merge(fused name, [the parts' values])``."""
    v = args.variant
    assert v is not None
    out = dict(table)
    for i in range(args.num_hidden_layers):
        pre = f"model.layers.{i}."
        for fused, parts in FUSED.items():
            if not (v.fused_qkv if fused.startswith("self_attn") else v.fused_gate_up):
                continue
            for suffix in ("weight", "bias"):
                names = [f"{pre}{p}.{suffix}" for p in parts]
                if names[0] in out:
                    out[f"{pre}{fused}.{suffix}"] = merge(f"{pre}{fused}.{suffix}", [out.pop(n) for n in names])
    return out


def expected_tensors(args: ModelArgs, llama: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """checkpoint.expected_tensors for a variant family, from Llama's (``llama``)."""
    out = fuse_names(args, llama, lambda _, shapes: (sum(s[0] for s in shapes), *shapes[0][1:]))
    if args.variant is not None and args.variant.sandwich_norms:
        for i in range(args.num_hidden_layers):
            for norm in ("post_self_attn_layernorm", "post_mlp_layernorm"):
                out[f"model.layers.{i}.{norm}.weight"] = (args.hidden_size,)
    return out
