"""The GGUF metadata of llama.cpp's ``phi3`` and ``glm4`` architectures as Hugging Face config keys
(what convert_hf_to_gguf.py's Phi3MiniModel / Glm4Model write; torch-free, as gguf_file.py):

- ``{arch}.rope.dimension_count``: the rotary dims, so ``partial_rotary_factor`` = it / head_dim
  (GLM-4's default being 0.5, the factor is always written out);
- GLM-4: q/k/v biases when the file has ``blk.0.attn_q.bias``; its q/k rows are stored in Hugging
  Face's order (llama.cpp permutes only the llama architecture, and GLM-4's M-RoPE variant);
- Phi-3: ``attention.sliding_window`` (0: none, Phi-4), and LongRoPE from the tensors
  ``rope_factors_long`` / ``rope_factors_short`` with ``rope.scaling.attn_factor`` and
  ``rope.scaling.original_context_length``. The fused ``attn_qkv`` / ``ffn_up`` tensors keep the
  checkpoint's [q; k; v] and [gate; up] rows (the gguf package's name table maps them).
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["EXTRA_TENSORS", "variant_keys"]

ROPE_LONG, ROPE_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"
# read into the config by variant_keys, not loaded as weights
EXTRA_TENSORS = (ROPE_LONG, ROPE_SHORT)


def variant_keys(g: Any, arch: str, head_dim: int, err: type[Exception]) -> dict[str, Any]:
    """config.json keys of a ``phi3`` / ``glm4`` file ``g`` (a gguf_file.GgufFile) beyond Llama's."""
    out: dict[str, Any] = {}
    rot = g.arch_key("rope.dimension_count")
    if rot is not None:
        out["partial_rotary_factor"] = int(rot) / head_dim
    elif arch == "glm4":
        out["partial_rotary_factor"] = 0.5
    if arch == "glm4":
        out["attention_bias"] = "blk.0.attn_q.bias" in g.tensors
        return out
    window = g.arch_key("attention.sliding_window")
    out["sliding_window"] = int(window) if window else None
    long, short = g.tensors.get(ROPE_LONG), g.tensors.get(ROPE_SHORT)
    if (long is None) != (short is None):
        raise err(f"tensors {ROPE_LONG} and {ROPE_SHORT} come together; the file has only one")
    if long is not None:
        orig = g.arch_key("rope.scaling.original_context_length")
        if orig is None:
            raise err(f"metadata {arch}.rope.scaling.original_context_length is missing (LongRoPE needs it)")
        rope: dict[str, Any] = {"rope_type": "longrope",
                                "long_factor": [float(x) for x in np.asarray(long.data, dtype=np.float32)],
                                "short_factor": [float(x) for x in np.asarray(short.data, dtype=np.float32)]}
        if (af := g.arch_key("rope.scaling.attn_factor")) is not None:
            rope["attention_factor"] = float(af)
        out["rope_scaling"] = rope
        out["original_max_position_embeddings"] = int(orig)
    return out
