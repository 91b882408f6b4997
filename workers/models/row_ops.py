"""The row-wise work a model does with torch outside its linear layers, behind hooks: products
(LoRA adapters' deltas, GPT-OSS's router and stacked experts), the SwiGLU of a mixture's
experts, and elementwise functions with a transcendental part (activations, gates, a norm's
rsqrt). Batch-invariant mode (workers/backends/cpu_invariant.py) sets the hooks to the C kernels,
which compute a row in one order whatever the rows beside it, where torch's products (oneDNN's)
sum in an order that follows the shapes and its vectorised silu rounds the tails of its loops
with the scalar exp; the elementwise functions are laid out so that every value falls in the body
of torch's vectorised loop."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

# (x [M, in], w [in, out]) -> x @ w, or None: torch's matmul.
ROW_PRODUCT: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
# (gate_up [M, 2 * I], I) -> silu(gate) * up, or None: torch's.
SWIGLU: Callable[[torch.Tensor, int], torch.Tensor] | None = None
# torch splits an elementwise loop over threads above this many elements (at::internal::GRAIN_SIZE),
# and its vectorised loops take 2 vectors a pass (64 bf16 or 32 fp32 values on AVX-512)
GRAIN, LANES = 32768, 64


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for a 2-D ``x``: through ROW_PRODUCT where it is set."""
    return x @ w if ROW_PRODUCT is None else ROW_PRODUCT(x, w)


def swiglu(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate) * up`` of ``[gate | up]`` columns: through SWIGLU where it is set."""
    if SWIGLU is not None:
        return SWIGLU(gate_up, inter)
    gate, up = gate_up.split(inter, dim=-1)
    return F.silu(gate) * up


def rowwise(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    """``fn(*xs)`` for [M, n] tensors of one shape, an elementwise function of them with an [M, n]
    result. In batch-invariant mode (``invariant()``), each row's elements meet torch's kernels at the same
    places whatever the other rows: rows padded with zeros to a multiple of LANES, fed in blocks of
    one fixed row count of at most GRAIN elements (one row a call beyond it; the last block padded
    with zero rows), so no value falls in a loop's scalar tail or at a thread split, whose
    transcendental functions round otherwise than the vectorised body."""
    if not invariant() or xs[0].dim() != 2 or xs[0].shape[0] == 0:
        return fn(*xs)
    m, n = xs[0].shape
    width = -(-n // LANES) * LANES
    rows = max(1, GRAIN // width)
    out = torch.empty((m, n), dtype=torch.result_type(xs[0], xs[0]))
    first = True
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        block = []
        for x in xs:
            b = x.new_zeros((rows, width))
            b[:r1 - r0, :n] = x[r0:r1]
            block.append(b)
        y = fn(*block)
        if first and y.dtype != out.dtype:
            out = out.to(y.dtype)
        first = False
        out[r0:r1] = y[:r1 - r0, :n]
    return out


def elementwise(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    """``fn(*xs)`` for tensors of one shape (any), an elementwise function of them with a result of
    that shape. In batch-invariant mode the values are laid out as rows of LANES (padded) and go
    through ``rowwise``: every value in the vectorised body of torch's loop, where all lanes compute
    alike, so a gate or a norm's scale of a column [T, 1] rounds the same whatever T is."""
    if not invariant() or xs[0].numel() == 0:
        return fn(*xs)
    shape, n = xs[0].shape, xs[0].numel()
    width = -(-n // LANES) * LANES
    flat = []
    for x in xs:
        f = x.new_zeros(width)
        f[:n] = x.reshape(-1)
        flat.append(f.view(-1, LANES))
    return rowwise(fn, *flat).reshape(-1)[:n].reshape(shape)


def invariant() -> bool:
    """Whether batch-invariant products are on (callers then avoid their batched shortcuts)."""
    return ROW_PRODUCT is not None
