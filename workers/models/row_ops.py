"""The row-wise work a model does with torch outside its linear layers, behind hooks: products
(LoRA adapters' deltas, GPT-OSS's router and stacked experts) and the SwiGLU of a mixture's
experts. Batch-invariant mode (workers/backends/cpu_invariant.py) sets the hooks to the C kernels,
which compute a row in one order whatever the rows beside it, where torch's products (oneDNN's)
sum in an order that follows the shapes and its vectorised silu rounds the tails of its loops
with the scalar exp."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

# (x [M, in], w [in, out]) -> x @ w, or None: torch's matmul.
ROW_PRODUCT: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
# (gate_up [M, 2 * I], I) -> silu(gate) * up, or None: torch's.
SWIGLU: Callable[[torch.Tensor, int], torch.Tensor] | None = None


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for a 2-D ``x``: through ROW_PRODUCT where it is set."""
    return x @ w if ROW_PRODUCT is None else ROW_PRODUCT(x, w)


def swiglu(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate) * up`` of ``[gate | up]`` columns: through SWIGLU where it is set."""
    if SWIGLU is not None:
        return SWIGLU(gate_up, inter)
    gate, up = gate_up.split(inter, dim=-1)
    return F.silu(gate) * up


def invariant() -> bool:
    """Whether batch-invariant products are on (callers then avoid their batched shortcuts)."""
    return ROW_PRODUCT is not None
