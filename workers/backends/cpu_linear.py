"""oneDNN-prepacked linear layers for the CPU backend.

torch's ``F.linear`` on CPU hands oneDNN a plain row-major weight on every call; packing the
weight once into oneDNN's blocked layout (what torch.compile's CPU "freezing" does) makes the
small-batch matmuls of decoding 1.3-2x faster here (docs/performance.md). The packed weight
replaces the original, so memory does not grow, except for a tied embedding, whose plain
copy the embedding lookup still needs. Where oneDNN cannot pack a dtype on this CPU (fp16
without AVX-NE-CONVERT / AMX-FP16), the layer keeps ``F.linear``.

Row counts are bucketed. For each input shape oneDNN builds a primitive, and two caches keep
them, keyed by (shape, thread count): ideep's per-thread cache of inner-product descriptors
(``LRU_CACHE_CAPACITY``, 1024) and oneDNN's primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``,
1024; two entries per shape: the inner product and its nested brgemm matmul). Together about
0.55 MiB per shape here. A step's row count is its token count, which takes hundreds of values
under mixed prompt lengths, so a worker's heap grew until both caches were full (some 500 MiB)
and then went on growing as evictions fragmented glibc's heap (docs/reliability.md, "Flat
memory"). So every call's rows are padded to one of 68 sizes (``bucket_rows``) and the output is
sliced: a model has a bounded set of shapes that fits both caches, and no entry is ever evicted.
``MINDIE_CPU_LINEAR_BUCKETS=0`` turns the padding off (for measurements: the creep comes back).
"""
from __future__ import annotations

import logging
import os

import torch
from torch import nn

log = logging.getLogger("workers.backends")


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except (RuntimeError, AttributeError):
        return None


EXACT_ROWS = 16  # row counts up to this run unpadded (decode batches: every one common)
FINE_ROWS = 256  # up to here 8 sizes per octave, above it 4 (large prefills are rarer)
BUCKETS = os.environ.get("MINDIE_CPU_LINEAR_BUCKETS", "1").strip().lower() not in ("0", "false", "no", "off")


def bucket_rows(m: int) -> int:
    """The row count a call with ``m`` rows runs at: ``m`` up to EXACT_ROWS, then the next of 8
    evenly spaced sizes per octave up to FINE_ROWS (18, 20, .. 32, 36, .. 64, 72, .. 256: at most
    12.5 % padding), then of 4 (320, 384, 448, 512, 640, ..: at most 25 %). 68 sizes up to 8192
    rows."""
    if m <= EXACT_ROWS or not BUCKETS:
        return m
    # m in (2^(k-1), 2^k]: a step of 2^(k-4) gives 8 sizes in that octave, 2^(k-3) gives 4.
    step = 1 << ((m - 1).bit_length() - (4 if m <= FINE_ROWS else 3))
    return -(-m // step) * step


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
                   ) -> torch.Tensor:
    if x.dim() != 2:
        return _packed_linear(x.reshape(-1, x.shape[-1]), packed, bias, out_features).reshape(
            *x.shape[:-1], out_features)
    m = x.shape[0]
    rows = bucket_rows(m)
    if rows == m:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    # Output rows depend on their own input row only: pad with zeros, run, keep the first m rows.
    padded = x.new_empty((rows, x.shape[1]))
    padded[:m].copy_(x)
    padded[m:].zero_()
    return torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")[:m]


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, packed: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = packed
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_linear(x, self.packed, self.bias, self.out_features)


def pack_linears(model: nn.Module) -> int:
    """Swap every nn.Linear of ``model`` for a PackedLinear (and pack the tied LM head)."""
    if not torch.backends.mkldnn.is_available():
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                packed = _pack(child.weight)
                if packed is not None:
                    setattr(parent, name, PackedLinear(child, packed))
                    count += 1
    head = getattr(model, "lm_head", None)
    if head is None and hasattr(model, "embed_tokens"):
        packed = _pack(model.embed_tokens.weight)
        if packed is not None:
            vocab = model.embed_tokens.weight.shape[0]
            model.logits_linear = lambda h: _packed_linear(h, packed, None, vocab)
            count += 1
    log.info("packed %d linear layers for oneDNN", count)
    return count
