"""Runners: turn a scheduled batch into next tokens.

``ModelRunner`` runs a torch decoder over the flat batch with paged attention and samples;
``NullRunner`` produces tokens with no model compute, to measure the serving stack alone.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING, Callable

import torch

from mindie.contract.spec import WorkerSpec
from workers.engine.attention import PagedAttention
from workers.engine.scheduler import ScheduledBatch
from workers.engine.sequence import Sequence

if TYPE_CHECKING:
    from workers.backends.base import Backend

log = logging.getLogger("workers.engine")

# (logits [B, V], the B sequences to sample) -> LongTensor [B]: a workers.engine.sampler.Sampler.
SampleFn = Callable[[torch.Tensor, list[Sequence]], torch.Tensor]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_shape: tuple[int, int, int], kv_dtype: torch.dtype,
                 sample: SampleFn, vocab_size: int, eos_token_ids: frozenset[int], device: torch.device,
                 attention_cls: type = PagedAttention, after_step: Callable[[], None] | None = None):
        self.model = model
        self.after_step = after_step  # the backend's housekeeping (Backend.after_step)
        self.attention_cls = attention_cls  # PagedAttention, or the NPU's (workers/backends/npu_attention.py)
        self.kv_shape = kv_shape  # (num_layers, n_kv_heads, head_dim)
        self.kv_dtype = kv_dtype
        self.attn = None
        self.sample = sample
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device

    def bytes_per_block(self, block_size: int) -> int:
        return block_size * self.attention_cls.bytes_per_slot(*self.kv_shape, self.kv_dtype)

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        layers, kv_heads, head_dim = self.kv_shape
        self.attn = self.attention_cls(layers, num_blocks, block_size, kv_heads, head_dim, self.kv_dtype, self.device)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        ids: list[int] = []
        pos: list[int] = []
        last_rows: list[int] = []
        sampled_seqs: list[Sequence] = []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed
            ids.extend(seq.tokens[start:start + n])
            pos.extend(range(start, start + n))
            if start + n == seq.num_tokens:
                last_rows.append(len(ids) - 1)
                sampled_seqs.append(seq)
        self.attn.prepare([s.block_table for s in batch.seqs], [s.num_computed for s in batch.seqs],
                          batch.num_tokens)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, positions, self.attn)
        result: list[int | None] = [None] * len(batch.seqs)
        if sampled_seqs:
            rows = torch.tensor(last_rows, dtype=torch.long, device=self.device)
            logits = self.model.compute_logits(hidden[rows])
            it = iter(self.sample(logits, sampled_seqs).tolist())
            for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
                if seq.num_computed + n == seq.num_tokens:
                    result[i] = int(next(it))
        if self.after_step is not None:
            self.after_step()
        return result


class NullRunner:
    """No model: every step costs ``step_ms`` plus ``token_us`` per computed token and emits
    token ids cycling through the vocabulary (never EOS), so requests run their full length."""

    def __init__(self, vocab_size: int = 32000, step_ms: float = 0.0, token_us: float = 0.0):
        self.vocab_size = vocab_size
        self.eos_token_ids: frozenset[int] = frozenset()
        self.step_ms = step_ms
        self.token_us = token_us
        self._ids = itertools.cycle(range(3, vocab_size))

    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        cost = self.step_ms / 1000.0 + self.token_us * sum(batch.num_tokens) / 1e6
        if cost > 0:
            time.sleep(cost)
        return [next(self._ids) if seq.num_computed + n == seq.num_tokens else None
                for seq, n in zip(batch.seqs, batch.num_tokens)]


def load_runner(spec: WorkerSpec, backend: Backend) -> ModelRunner:
    """The worker's model in one pass: config.json read once, dtype picked by the backend,
    weights loaded and rewritten for the device, sampler wired."""
    from workers.engine.sampler import Sampler
    from workers.engine.watermark import WatermarkConfig
    from workers.models.config import ModelArgs
    from workers.models.loader import load_model

    if not spec.model_path:
        raise ValueError("WorkerSpec.model_path is empty: run python -m workers.prepare on the launch plan")
    t0 = time.perf_counter()
    args = ModelArgs.from_dir(spec.model_path)
    dtype = backend.resolve_dtype(spec.dtype, args.torch_dtype)
    device = backend.device()
    model, _ = load_model(spec.model_path, dtype, device, max_positions=spec.engine.max_seq_len, args=args)
    backend.prepare_model(model)
    log.info("loaded %s (%s, %d layers, vocab %d) as %s on %s in %.2f s", spec.model_path, args.arch,
             args.num_hidden_layers, args.vocab_size, dtype, device, time.perf_counter() - t0)
    return ModelRunner(model, (args.num_hidden_layers, args.num_key_value_heads, args.head_dim), dtype,
                       Sampler(WatermarkConfig(gamma=spec.watermark_gamma, delta=spec.watermark_delta)), args.vocab_size,
                       frozenset(args.eos_token_ids), device, attention_cls=backend.attention_class(),
                       after_step=backend.after_step)
