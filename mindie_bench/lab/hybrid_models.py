"""Benchmark checkpoints of a hybrid linear-attention model (Qwen3.5) and its full-attention twin.

    mindie-bench bench-models qwen35-1b        # prints the directory, built from seed 0 on first use
    mindie-bench bench-models qwen35-1b-twin   # the same size with full attention in every layer

``qwen35-1b`` is a real ``qwen3_5_text`` checkpoint (``Qwen3_5ForCausalLM``: config.json, bf16
safetensors, the demo model's 32000-token tokenizer) of about 1B parameters: hidden 2048, 16
layers, Gated DeltaNet and gated full attention three to one (12 linear + 4 full), full attention
8 heads x 256 with 2 KV heads, linear attention 16 key and 16 value heads of 128, a short
convolution of 4, MLP 6144, tied embeddings. ``qwen35-1b-twin`` is a Qwen3 (``qwen3``) of the same
hidden size, layers, MLP and attention heads in all 16 layers: what the hybrid's memory per
sequence is compared with. ``qwen35-tiny`` / ``qwen35-tiny-twin`` are the same plumbing at a toy
size (the tests').

Weights are transformers' own initialisation after ``torch.manual_seed(seed)`` (the same files for
the same torch and transformers), written by ``save_pretrained``; the directory is filled in a
temp dir and renamed, so racing processes and killed builds never leave a half-written model.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger("bench_models")

FORMAT_VERSION = 1
_MARKER = "mindie_bench_hybrid.json"


@dataclass(frozen=True)
class HybridShape:
    """A Qwen3.5 text shape (``twin``: a Qwen3 of the same size, full attention everywhere)."""

    hidden: int
    layers: int
    heads: int  # full attention: query heads
    kv_heads: int
    head_dim: int
    linear_k_heads: int
    linear_v_heads: int
    linear_head_dim: int
    intermediate: int
    full_attention_interval: int = 4  # every 4th layer full attention: three linear to one full
    conv_kernel: int = 4
    twin: bool = False
    dtype: str = "bfloat16"
    seed: int = 0

    def config(self, vocab: int, bos: int, eos: int) -> Any:
        """The transformers config of this shape."""
        import transformers
        common = dict(vocab_size=vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                      num_hidden_layers=self.layers, num_attention_heads=self.heads,
                      num_key_value_heads=self.kv_heads, head_dim=self.head_dim, max_position_embeddings=32768,
                      tie_word_embeddings=True, bos_token_id=bos, eos_token_id=eos)
        if self.twin:
            return transformers.Qwen3Config(**common)
        types = ["full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
                 for i in range(self.layers)]
        return transformers.Qwen3_5TextConfig(**common, layer_types=types, linear_conv_kernel_dim=self.conv_kernel,
                                              linear_key_head_dim=self.linear_head_dim,
                                              linear_value_head_dim=self.linear_head_dim,
                                              linear_num_key_heads=self.linear_k_heads,
                                              linear_num_value_heads=self.linear_v_heads)


_1B = HybridShape(hidden=2048, layers=16, heads=8, kv_heads=2, head_dim=256, linear_k_heads=16, linear_v_heads=16,
                  linear_head_dim=128, intermediate=6144)
_TINY = HybridShape(hidden=64, layers=4, heads=2, kv_heads=1, head_dim=32, linear_k_heads=2, linear_v_heads=4,
                    linear_head_dim=16, intermediate=96, dtype="float32")
PRESETS: dict[str, HybridShape] = {
    "qwen35-1b": _1B,
    "qwen35-1b-twin": dataclasses.replace(_1B, twin=True),
    "qwen35-tiny": _TINY,
    "qwen35-tiny-twin": dataclasses.replace(_TINY, twin=True),
}


def _fingerprint(shape: HybridShape) -> dict[str, Any]:
    return {"format_version": FORMAT_VERSION, **dataclasses.asdict(shape)}


def model_dir(name: str, cache_dir: Optional[Path] = None) -> Path:
    """Where ``ensure`` keeps preset ``name``: ``<cache>/<name>-<hash of its shape>``."""
    from workers.models.demo import default_cache_dir
    digest = hashlib.sha256(json.dumps(_fingerprint(PRESETS[name]), sort_keys=True).encode()).hexdigest()[:12]
    return (Path(cache_dir) if cache_dir else default_cache_dir()) / f"{name}-{digest}"


def _complete(path: Path, shape: HybridShape) -> bool:
    try:
        return json.loads((path / _MARKER).read_text()) == _fingerprint(shape)
    except (OSError, ValueError):
        return False


def ensure(name: str, cache_dir: Optional[Path] = None) -> Path:
    """The directory of preset ``name``, built on first use."""
    if name not in PRESETS:
        raise KeyError(f"unknown hybrid preset {name!r}: one of {', '.join(PRESETS)}")
    shape, final = PRESETS[name], model_dir(name, cache_dir)
    if _complete(final, shape):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        log.info("building %s (%s) in %s", name, shape, final)
        _write(tmp, shape)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 and safetensors' 0600: the model is not secret
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first
            if not _complete(final, shape):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write(d: Path, shape: HybridShape) -> None:
    import torch
    import transformers

    from workers.models.demo import BOS, EOS, VOCAB_SIZE, ensure_demo_model
    demo = ensure_demo_model()  # its tokenizer: 32000 byte-level BPE tokens, <s> and </s>
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(demo / f, d / f)
    torch.manual_seed(shape.seed)
    model = transformers.AutoModelForCausalLM.from_config(shape.config(VOCAB_SIZE, BOS, EOS),
                                                          dtype=getattr(torch, shape.dtype))
    model.save_pretrained(d, safe_serialization=True)
    (d / _MARKER).write_text(json.dumps(_fingerprint(shape), sort_keys=True))
