"""The state pool of a hybrid linear-attention model (Qwen3-Next, Qwen3.5): per sequence, a fixed
size state in every Gated DeltaNet layer instead of a growing KV cache.

A slot holds, for each linear layer, the short convolution's last ``K - 1`` inputs
([conv_dim, K - 1], model dtype) and the delta rule's recurrent state ([heads, d_k, d_v], fp32).
The pool has one slot per sequence the engine may run at once (``maxBatchSize``); the engine's
``BlockManager`` hands a slot to a sequence when it is admitted and takes it back when it finishes,
is cancelled or is preempted (workers/engine/block_manager.py), beside its KV blocks. A sequence
whose step starts at position 0 (a new one, or one recomputed after preemption) has its slot
zeroed first: the state is rebuilt from its tokens, as the KV is.

``prepare(slots, starts, counts)`` once per step, as the paged attention's ``prepare`` takes the
block tables: the flat batch's sequences in order, their slot, first position and row count. The
layers then read ``decode_rows`` / ``decode_slots`` (sequences computing one token after their
first: one batched recurrent step) and ``prefills`` ((first row, rows, slot) of each prompt
chunk: the chunked form from the carried state).

Batch-invariant mode (``ScheduleConfig.batchInvariant``, ``every_row``): where a prompt's chunk
boundaries fall depends on the scheduler (the other requests), and the chunked form's sums follow
them, so there every token takes the recurrent step: ``waves`` lists (rows, slots) of the step's
j-th token of every sequence that has one, j = 0, 1, ..; each wave is one recurrent step from the
state the previous one left, a decode step is one wave, and ``decode_rows`` / ``prefills`` are
empty. ``sequences``: (first row, rows, slot) of every sequence of the step (the convolution's).
"""
from __future__ import annotations

import torch

from workers import settings

__all__ = ["StateCache"]


class StateCache:
    """The pool's tensors and the step's view of them (module docstring)."""

    def __init__(self, layers: int, slots: int, conv_dim: int, conv_keep: int, heads: int, dk: int, dv: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.slots = slots
        self.conv = torch.zeros(layers, slots, conv_dim, conv_keep, dtype=dtype, device=device)
        self.recurrent = torch.zeros(layers, slots, heads, dk, dv, dtype=torch.float32, device=device)
        self.decode_rows: torch.Tensor | None = None
        self.decode_slots: torch.Tensor | None = None
        self.prefills: list[tuple[int, int, int]] = []
        self.sequences: list[tuple[int, int, int]] = []
        self.waves: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.every_row = bool(settings.engine().batch_invariant)  # batch-invariant mode

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * 4

    def prepare(self, slots: list[int], starts: list[int], counts: list[int]) -> None:
        """The step's sequences (flat-batch order): their state slot, first position, rows."""
        if any(s < 0 or s >= self.slots for s in slots):
            raise RuntimeError(f"a sequence of the step holds no state slot ({slots}; pool of {self.slots})")
        fresh = [s for s, p in zip(slots, starts) if p == 0]
        if fresh:
            idx = torch.tensor(fresh, dtype=torch.long, device=self.conv.device)
            self.conv[:, idx] = 0
            self.recurrent[:, idx] = 0
        dec_rows: list[int] = []
        dec_slots: list[int] = []
        self.prefills = []
        self.sequences = [(row0, n, slot) for row0, n, slot in zip(_firsts(counts), counts, slots)]
        dev = self.conv.device
        self.waves = []
        if self.every_row:
            self.decode_rows = self.decode_slots = None
            for j in range(max(counts, default=0)):
                wave = [(row0 + j, slot) for row0, n, slot in self.sequences if n > j]
                self.waves.append((torch.tensor([r for r, _ in wave], dtype=torch.long, device=dev),
                                   torch.tensor([s for _, s in wave], dtype=torch.long, device=dev)))
            return
        row = 0
        for slot, start, n in zip(slots, starts, counts):
            # transformers: the recurrent form for one token after a cached state, else the chunked form
            if n == 1 and start > 0:
                dec_rows.append(row)
                dec_slots.append(slot)
            else:
                self.prefills.append((row, n, slot))
            row += n
        self.decode_rows = torch.tensor(dec_rows, dtype=torch.long, device=dev) if dec_rows else None
        self.decode_slots = torch.tensor(dec_slots, dtype=torch.long, device=dev) if dec_slots else None


def _firsts(counts: list[int]) -> list[int]:
    """The first flat-batch row of each sequence of ``counts`` rows."""
    out, row = [], 0
    for n in counts:
        out.append(row)
        row += n
    return out
