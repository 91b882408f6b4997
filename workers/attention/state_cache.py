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

Rows beyond the sequences' slots (docs/design.md, "Hybrid linear attention"): ``checkpoints`` rows
keep the state at a prompt's block boundaries for the prefix cache (the engine's ``BlockManager``
ties each to the KV block ending there), and ``scratch`` rows keep, for a sequence verifying k
proposed tokens (speculative decoding), its state after each of its first k rows. ``prepare`` also
takes, per sequence, a pool row to copy its state from before the step (``restores``: a prefix
hit's checkpoint), the rows to copy its state into after its first m rows (``saves``: [(m, row)]),
and whether its rows are a verify (``verify``: token by token in the recurrent form, as plain
decodes would compute them); and ``copies`` [(from row, to row)] made first (a verify's state
rolled back to its last accepted token, ``rollback``). A prompt chunk with saves is cut at them
(``prefills`` pieces carry the row their final state is copied to); a wave's
``(rows, slots, save_from, save_to)`` copies after it; ``saves_by_slot`` gives the convolution's
(its state after m rows is the window's columns m .. m + K - 2).
"""
from __future__ import annotations

import torch

from workers import settings

__all__ = ["StateCache"]


class StateCache:
    """The pool's tensors and the step's view of them (module docstring)."""

    def __init__(self, layers: int, slots: int, conv_dim: int, conv_keep: int, heads: int, dk: int, dv: int,
                 dtype: torch.dtype, device: torch.device, checkpoints: int = 0, scratch: int = 0) -> None:
        self.slots = slots
        self.checkpoints, self.scratch = checkpoints, scratch
        rows = slots + checkpoints + scratch
        self.conv = torch.zeros(layers, rows, conv_dim, conv_keep, dtype=dtype, device=device)
        self.recurrent = torch.zeros(layers, rows, heads, dk, dv, dtype=torch.float32, device=device)
        self.decode_rows: torch.Tensor | None = None
        self.decode_slots: torch.Tensor | None = None
        self.prefills: list[tuple[int, int, int, int]] = []  # (first row, rows, slot, row to save into or -1)
        self.chunks: list[tuple[int, int, int]] = []  # sequences not in decode_rows (the convolution's)
        self.sequences: list[tuple[int, int, int]] = []
        self.waves: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
        self.saves_by_slot: dict[int, list[tuple[int, int]]] = {}
        self.every_row = bool(settings.engine().batch_invariant)  # batch-invariant mode

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * 4

    @property
    def rows(self) -> int:
        """Pool rows: slots, then checkpoints, then verify scratch."""
        return self.slots + self.checkpoints + self.scratch

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Every layer's state of row ``a`` copied into row ``b`` for each (a, b)."""
        if pairs:
            src = torch.tensor([a for a, _ in pairs], dtype=torch.long, device=self.conv.device)
            dst = torch.tensor([b for _, b in pairs], dtype=torch.long, device=self.conv.device)
            self.conv[:, dst] = self.conv[:, src]
            self.recurrent[:, dst] = self.recurrent[:, src]

    def prepare(self, slots: list[int], starts: list[int], counts: list[int], restores: list[int] | None = None,
                saves: list[list[tuple[int, int]]] | None = None, verify: list[bool] | None = None,
                copies: list[tuple[int, int]] | None = None) -> None:
        """The step's sequences (flat-batch order): their state slot, first position, rows; the
        optional restores, saves, verify flags and first copies (module docstring)."""
        if any(s < 0 or s >= self.slots for s in slots):
            raise RuntimeError(f"a sequence of the step holds no state slot ({slots}; pool of {self.slots})")
        k = len(slots)
        restores = restores or [-1] * k
        saves = saves or [[] for _ in range(k)]
        verify = verify or [False] * k
        self.copy(list(copies or ()))  # a verify's rollback, before a slot's new owner restores or zeroes it
        fresh = [s for s, p in zip(slots, starts) if p == 0]
        if fresh:
            idx = torch.tensor(fresh, dtype=torch.long, device=self.conv.device)
            self.conv[:, idx] = 0
            self.recurrent[:, idx] = 0
        self.copy([(r, s) for s, r in zip(slots, restores) if r >= 0])
        dec_rows: list[int] = []
        dec_slots: list[int] = []
        self.prefills, self.chunks = [], []
        self.sequences = [(row0, n, slot) for row0, n, slot in zip(_firsts(counts), counts, slots)]
        self.saves_by_slot = {slot: list(sv) for slot, sv in zip(slots, saves) if sv}
        dev = self.conv.device
        self.waves = []
        stepped = [seq for seq, v in zip(self.sequences, verify) if v or self.every_row]  # token by token
        for j in range(max((n for _, n, _ in stepped), default=0)):
            wave = [(row0 + j, slot) for row0, n, slot in stepped if n > j]
            # the state after j + 1 rows into the pool rows saved at m = j + 1
            kept = [(slot, row) for _, slot in wave for m, row in self.saves_by_slot.get(slot, ()) if m == j + 1]
            self.waves.append((_longs([r for r, _ in wave], dev), _longs([s for _, s in wave], dev),
                               _longs([s for s, _ in kept], dev) if kept else None,
                               _longs([r for _, r in kept], dev) if kept else None))
        if self.every_row:
            self.decode_rows = self.decode_slots = None
            return
        for (row, n, slot), start, v in zip(self.sequences, starts, verify):
            if v:
                self.chunks.append((row, n, slot))
            # transformers: the recurrent form for one token after a cached state, else the chunked form
            elif n == 1 and start > 0 and slot not in self.saves_by_slot:
                dec_rows.append(row)
                dec_slots.append(slot)
            else:
                self.chunks.append((row, n, slot))
                a = 0  # the chunk cut at its saves: each piece's final state is a save's
                for m, keep in sorted(self.saves_by_slot.get(slot, ())):
                    if m > a:
                        self.prefills.append((row + a, m - a, slot, keep))
                        a = m
                    else:  # two saves at one boundary: the piece before it saved into the first
                        raise RuntimeError(f"two saves of slot {slot} after {m} rows")
                if a < n:
                    self.prefills.append((row + a, n - a, slot, -1))
        self.decode_rows = torch.tensor(dec_rows, dtype=torch.long, device=dev) if dec_rows else None
        self.decode_slots = torch.tensor(dec_slots, dtype=torch.long, device=dev) if dec_slots else None


def _longs(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _firsts(counts: list[int]) -> list[int]:
    """The first flat-batch row of each sequence of ``counts`` rows."""
    out, row = [], 0
    for n in counts:
        out.append(row)
        row += n
    return out
