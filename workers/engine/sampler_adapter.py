"""Connects the engine's sequences to the sampler (workers/engine/sampler.py).

Each sequence keeps its ``SamplingState`` (the token history the penalties and the
watermark see) for its whole life; the draw index is its number of generated tokens, so a
preempted and recomputed request draws the same tokens again.
"""
from __future__ import annotations

from typing import Callable

import torch

from workers.engine.sampler import Sampler, SamplingState
from workers.engine.sequence import Sequence
from workers.engine.watermark import WatermarkConfig


def make_sample_fn(gamma: float = 0.5, delta: float = 2.0) -> Callable[[torch.Tensor, list[Sequence]], list[int]]:
    sampler = Sampler(WatermarkConfig(gamma=gamma, delta=delta))

    def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        states = []
        for seq in seqs:
            st = seq.sampler_state
            if st is None:
                st = seq.sampler_state = SamplingState(seq.params, seq.tokens, prompt_len=seq.prompt_len)
            else:
                st.sync(seq.tokens)
            states.append(st)
        return sampler(logits, states).tolist()

    return sample
