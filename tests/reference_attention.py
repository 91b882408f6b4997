"""Dense causal attention over a flat batch, without a KV cache.

For tests and offline use: it recomputes everything, builds an explicit [T, T] mask and calls
torch's `scaled_dot_product_attention`. The serving path uses the paged attention object instead;
both follow the same `workers.models.llama.Attention` protocol.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

__all__ = ["DenseCausalAttention", "logits_over_cache"]


class DenseCausalAttention:
    """Causal (optionally sliding-window) GQA attention for sequences packed back to back.

    `cu_seqlens` holds the start offset of every sequence in the flat batch plus the total length,
    e.g. [0, 5, 12] for two sequences of 5 and 7 tokens. Each sequence is a whole prompt: token i
    of a sequence sees tokens 0..i of the same sequence (the last `window` of them when a layer has
    a sliding window).
    """

    def __init__(self, cu_seqlens: Sequence[int] | torch.Tensor) -> None:
        cu = torch.as_tensor(cu_seqlens, dtype=torch.long).cpu()
        if cu.ndim != 1 or cu.numel() < 2 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must be increasing offsets starting at 0, got {cu.tolist()}")
        self.cu_seqlens = cu
        self.total = int(cu[-1])
        lengths = cu[1:] - cu[:-1]
        # Sequence id and in-sequence index of every flat token; the mask is built from these.
        self._seq = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        self._idx = torch.arange(self.total) - cu[:-1].repeat_interleave(lengths)
        self._masks: dict[tuple[int | None, torch.device], torch.Tensor] = {}

    @classmethod
    def from_lengths(cls, lengths: Sequence[int]) -> "DenseCausalAttention":
        """Build from per-sequence token counts."""
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + int(n))
        return cls(cu)

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor:
        """Boolean [T, T] mask, True where query row may attend to key column (cached per window)."""
        key = (window, device)
        m = self._masks.get(key)
        if m is None:
            same = self._seq[:, None] == self._seq[None, :]
            diff = self._idx[:, None] - self._idx[None, :]  # query index - key index
            m = same & (diff >= 0)
            if window is not None:
                m &= diff < window
            m = m.to(device)
            self._masks[key] = m
        return m

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, *,
        scale: float | None = None, softcap: float | None = None
    ) -> torch.Tensor:
        t, n_heads, head_dim = q.shape
        if t != self.total:
            raise ValueError(f"attention got {t} tokens but cu_seqlens describes {self.total}")
        n_rep = n_heads // k.shape[1]
        # GQA: every kv head serves n_rep consecutive query heads (transformers' repeat_kv layout).
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
        scale = head_dim**-0.5 if scale is None else scale
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, T, D]
        if softcap is not None:  # transformers' eager attention: scaled, capped, masked, fp32 softmax
            s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
            s = torch.tanh(s / softcap) * softcap
            s = s.masked_fill(~self.mask(window, q.device), float("-inf"))
            p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.matmul(p, vh).transpose(0, 1)
        out = F.scaled_dot_product_attention(qh.unsqueeze(0), kh.unsqueeze(0), vh.unsqueeze(0),  # [1, H, T, D]
                                             attn_mask=self.mask(window, q.device), scale=scale)
        return out[0].transpose(0, 1)  # [T, H, D]


def logits_over_cache(model, attn, ids: torch.Tensor, chunks: list[int], table: list[int]) -> torch.Tensor:
    """A model's logits of every position of one sequence over a paged ``attn``: the prompt in
    ``chunks`` (chunked prefill over the cache), the rest one decode step each; ``table`` is the
    sequence's block table (tests pass blocks out of order: the table is what places them)."""
    outs, pos = [], 0
    with torch.no_grad():
        for n in chunks + [1] * (len(ids) - sum(chunks)):
            attn.prepare([table], [pos], [n])
            outs.append(model.compute_logits(model(ids[pos:pos + n], torch.arange(pos, pos + n), attn)))
            pos += n
    return torch.cat(outs)
