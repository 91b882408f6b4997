"""LoRA adapters on the decoder: an adapter's tensors in the model's fused layout, and one step's
batched application over the rows of every adapter in the batch.

The decoder's projections are fused (q/k/v in one matmul, gate/up in another: workers/models/llama.py),
so an adapter is kept per fused projection: ``A`` stacks the adapted parts' lora_A along the rank
(``[in, R]``, transposed for ``x @ A``), and ``B`` is block-structured (``[R, out]``), each
part's lora_B times its scale in its own rank rows and output columns, zeros elsewhere. One
projection of one adapter is then two matmuls whatever it adapts: ``out += (x @ A) @ B``, which
is peft's ``base(x) + lora_B(lora_A(x)) * scale`` per part (the zero blocks add exact zeros).

A step (``LoraStep``) lists the flat batch's row ranges of each adapter: the model runner puts the
rows of one adapter next to each other (workers/engine/model_runner.py), so each range is a view
and its delta is added in place. The base model's rows, and the base projection of every row, are
computed as without adapters: one step serves the base model and several adapters together, and no
adapter is merged into the base weights. ``LoraHook`` is how the layers see the step: the model
holds one, every layer reads it, the runner sets it around a forward.
"""
from __future__ import annotations

import torch
from safetensors import safe_open

from . import row_ops
from .config import ModelArgs
from .lora_adapter import TARGETS, AdapterPlan

__all__ = ["AdapterWeights", "DOWN", "GATE_UP", "LoraHook", "LoraStacks", "LoraStep", "O", "PROJECTIONS", "QKV",
           "STACK_ROWS", "lora_dtype", "read_adapter"]

QKV, O, GATE_UP, DOWN = 0, 1, 2, 3
PROJECTIONS = {"qkv": QKV, "o": O, "gate_up": GATE_UP, "down": DOWN}


class AdapterWeights:
    """One adapter's tensors: ``layers[i][p]`` = (A [in, R], B [R, out]) of fused projection ``p``
    of layer ``i``, or None where the adapter leaves it alone."""

    __slots__ = ("name", "layers", "nbytes")

    def __init__(self, name: str, layers: list[list[tuple[torch.Tensor, torch.Tensor] | None]]):
        self.name = name
        self.layers = layers
        self.nbytes = sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                          for lay in layers for ab in lay if ab is not None for a, b in [ab])


def _fused_columns(args: ModelArgs) -> dict[str, tuple[int, int, int]]:
    """peft module -> (its fused projection, first output column, columns) in the decoder's layout."""
    q, kv, i = args.q_size, args.kv_size, args.intermediate_size
    return {"q_proj": (QKV, 0, q), "k_proj": (QKV, q, kv), "v_proj": (QKV, q + kv, kv), "o_proj": (O, 0, args.hidden_size),
            "gate_proj": (GATE_UP, 0, i), "up_proj": (GATE_UP, i, i), "down_proj": (DOWN, 0, args.hidden_size)}


def lora_dtype(model_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype an adapter's tensors are kept in: the model's, except fp32 for a half-precision
    model on the CPU, where torch's bf16/fp16 matmuls of a LoRA's thin shapes are several times
    slower than fp32 ones (and the fp32 delta is rounded once, where the activations are)."""
    if torch.device(device).type == "cpu" and model_dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return model_dtype


def read_adapter(name: str, plan: AdapterPlan, args: ModelArgs, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> AdapterWeights:
    """Read a checked adapter (``workers.models.lora_adapter.check_adapter``) into the fused layout,
    in ``dtype`` on ``device``. The scales are applied to B in fp32, then everything is cast once."""
    cols = _fused_columns(args)
    outs = {QKV: args.q_size + 2 * args.kv_size, O: args.hidden_size, GATE_UP: 2 * args.intermediate_size,
            DOWN: args.hidden_size}
    by_layer: dict[int, dict[int, list]] = {}
    for m in plan.modules:
        by_layer.setdefault(m.layer, {}).setdefault(cols[m.target][0], []).append(m)
    layers: list[list[tuple[torch.Tensor, torch.Tensor] | None]] = [[None] * 4 for _ in range(args.num_hidden_layers)]
    with safe_open(plan.file, framework="pt") as f:
        for layer, projections in by_layer.items():
            for p, mods in projections.items():
                mods.sort(key=lambda m: list(TARGETS).index(m.target))
                total = sum(m.rank for m in mods)
                a_parts = []
                b = torch.zeros(total, outs[p], dtype=torch.float32)
                r0 = 0
                for m in mods:
                    a_parts.append(f.get_tensor(m.a_name).to(torch.float32))  # [r, in]
                    _, c0, n = cols[m.target]
                    b[r0:r0 + m.rank, c0:c0 + n] = f.get_tensor(m.b_name).to(torch.float32).t() * m.scale
                    r0 += m.rank
                a = torch.cat(a_parts).t()
                layers[layer][p] = (a.to(device=device, dtype=dtype).contiguous(),
                                    b.to(device=device, dtype=dtype).contiguous())
    return AdapterWeights(name, layers)


class LoraStacks:
    """The adapters of a step stacked per projection for batched matmuls: ``A`` [G, in, R] and
    ``B`` [G, R, out], each adapter's rank padded with zeros to the largest (zero columns of A and
    rows of B add exact zeros), an adapter that leaves the projection alone all zeros. Kept for the
    last combination of adapters seen (a batch's adapters change rarely between decode steps),
    built per projection on first use."""

    __slots__ = ("combo", "cache")

    def __init__(self) -> None:
        self.combo: tuple[AdapterWeights, ...] = ()
        self.cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor] | None] = {}

    def use(self, combo: tuple[AdapterWeights, ...]) -> "LoraStacks":
        if combo != self.combo:  # the tensors of the old combination are dropped with it
            self.combo, self.cache = combo, {}
        return self

    def get(self, layer: int, proj: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        key = (layer, proj)
        if key not in self.cache:
            parts = [w.layers[layer][proj] for w in self.combo]
            have = [ab for ab in parts if ab is not None]
            if not have:
                self.cache[key] = None
            else:
                a0, b0 = have[0]
                r = max(a.shape[1] for a, _ in have)
                a = a0.new_zeros(len(parts), a0.shape[0], r)
                b = b0.new_zeros(len(parts), r, b0.shape[1])
                for g, ab in enumerate(parts):
                    if ab is not None:
                        a[g, :, :ab[0].shape[1]] = ab[0]
                        b[g, :ab[1].shape[0]] = ab[1]
                self.cache[key] = (a, b)
        return self.cache[key]


# Steps of at most this many rows with several adapters use the batched matmuls (a handful of ops
# per projection whatever the number of adapters); larger ones (prompt chunks), where the ops are
# few beside the work, go adapter by adapter.
STACK_ROWS = 64


class LoraStep:
    """The adapter rows of one step: ``segments`` of (first flat row, end row, weights), one per
    adapter in the batch, each a contiguous range (the base model's rows are in none).

    Small steps with several adapters (``stacks``) gather each adapter's rows into a [G, M, in]
    block (M: the most rows of one adapter; shorter ranges padded with a repeated row whose result
    is dropped) and run two batched matmuls against the stacked adapters, then add the real rows'
    deltas in place: seven ops per projection whatever the number of adapters, against four per
    adapter. Otherwise each adapter's rows get their own two matmuls. Where the adapter's tensors
    have another dtype than the activations (fp32 adapters of a bf16 model on the CPU, whose bf16
    matmuls of these shapes are slow), the delta is computed in theirs and rounded once."""

    __slots__ = ("segments", "rows", "stacks", "gather", "valid", "dest")

    def __init__(self, segments: list[tuple[int, int, AdapterWeights]], rows: int = 0,
                 stacks: LoraStacks | None = None):
        self.segments = segments
        self.rows = rows
        self.stacks = stacks.use(tuple(w for _, _, w in segments)) \
            if stacks is not None and len(segments) > 1 and 0 < rows <= STACK_ROWS and not row_ops.invariant() else None
        self.gather = self.valid = self.dest = None
        if self.stacks is not None:
            m = max(b - a for a, b, _ in segments)
            gather, valid, dest = [], [], []
            for g, (a, b, _) in enumerate(segments):
                gather += list(range(a, b)) + [a] * (m - (b - a))
                valid += range(g * m, g * m + b - a)
                dest += range(a, b)
            self.gather = torch.tensor(gather)
            # Without padding the gathered rows are the real ones, in order: no second selection.
            self.valid = None if len(valid) == len(gather) else torch.tensor(valid)
            self.dest = torch.tensor(dest)

    def apply(self, layer: int, proj: int, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (the base projection of ``x``, [T, out]) += each adapter's delta on its rows."""
        if self.stacks is not None:
            ab = self.stacks.get(layer, proj)
            if ab is not None:
                a, b = ab
                if self.gather.device != x.device:
                    self.gather, self.dest = self.gather.to(x.device), self.dest.to(x.device)
                    self.valid = None if self.valid is None else self.valid.to(x.device)
                xs = x.index_select(0, self.gather).to(a.dtype).view(a.shape[0], -1, a.shape[1])
                d = torch.bmm(torch.bmm(xs, a), b).view(-1, b.shape[2])
                if self.valid is not None:
                    d = d.index_select(0, self.valid)
                out.index_add_(0, self.dest, d if d.dtype == out.dtype else d.to(out.dtype))
            return
        for r0, r1, w in self.segments:
            ab = w.layers[layer][proj]
            if ab is None:
                continue
            a, b = ab
            if row_ops.invariant():  # batch-invariant mode: the C kernels' products (row_ops.py)
                mm = row_ops.matmul
                out[r0:r1].add_(mm(mm(x[r0:r1].to(a.dtype), a), b).to(out.dtype))
            elif x.dtype == a.dtype:
                out[r0:r1].addmm_(torch.mm(x[r0:r1], a), b)
            else:
                out[r0:r1].add_(torch.mm(torch.mm(x[r0:r1].to(a.dtype), a), b))


class LoraHook:
    """What the decoder's layers read: the current step's adapters, or None (no adapter row: the
    plain path, and the device's whole-stack decode kernel may take the step)."""

    __slots__ = ("step",)

    def __init__(self) -> None:
        self.step: LoraStep | None = None
