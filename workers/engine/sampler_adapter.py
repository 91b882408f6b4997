"""Connects the engine's sequences to the sampler (workers/engine/sampler.py)."""
from __future__ import annotations

from typing import Callable

import torch

from workers.engine.sequence import Sequence


def make_sample_fn(vocab_size: int, device: torch.device, gamma: float = 0.5,
                   delta: float = 2.0) -> Callable[[torch.Tensor, list[Sequence]], list[int]]:
    def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        return logits.argmax(dim=-1).tolist()
    return sample
