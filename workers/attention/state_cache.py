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
"""
from __future__ import annotations

import torch

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
        row = 0
        for slot, start, n in zip(slots, starts, counts):
            # transformers: the recurrent form for one token after a cached state, else the chunked form
            if n == 1 and start > 0:
                dec_rows.append(row)
                dec_slots.append(slot)
            else:
                self.prefills.append((row, n, slot))
            row += n
        dev = self.conv.device
        self.decode_rows = torch.tensor(dec_rows, dtype=torch.long, device=dev) if dec_rows else None
        self.decode_slots = torch.tensor(dec_slots, dtype=torch.long, device=dev) if dec_slots else None
