"""Tiny random transformers checkpoints for the tests (no weights can be downloaded here)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def random_model(cls_name: str, config: dict[str, Any]) -> Any:
    """A ``transformers.<cls_name>(**config)`` causal LM with seeded random weights (eager
    attention: the textbook math as reference)."""
    import transformers

    cfg = getattr(transformers, cls_name)(**config)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        # Default init leaves norms at 1 and biases at 0, which would hide mapping mistakes.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
    return model


def save_random_model(cls_name: str, config: dict[str, Any], path: Path) -> Any:
    """``random_model``, saved as safetensors in ``path``; returns the model."""
    model = random_model(cls_name, config)
    model.save_pretrained(path, safe_serialization=True)
    return model
