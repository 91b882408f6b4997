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

from .config import ModelArgs
from .lora_adapter import TARGETS, AdapterPlan

__all__ = ["AdapterWeights", "DOWN", "GATE_UP", "LoraHook", "LoraStep", "O", "PROJECTIONS", "QKV", "read_adapter"]

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


class LoraStep:
    """The adapter rows of one step: ``segments`` of (first flat row, end row, weights), one per
    adapter in the batch, each a contiguous range (the base model's rows are in none)."""

    __slots__ = ("segments",)

    def __init__(self, segments: list[tuple[int, int, AdapterWeights]]):
        self.segments = segments

    def apply(self, layer: int, proj: int, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (the base projection of ``x``, [T, out]) += each adapter's delta on its rows."""
        for a, b, w in self.segments:
            ab = w.layers[layer][proj]
            if ab is not None:
                out[a:b].addmm_(torch.mm(x[a:b], ab[0]), ab[1])


class LoraHook:
    """What the decoder's layers read: the current step's adapters, or None (no adapter row: the
    plain path, and the device's whole-stack decode kernel may take the step)."""

    __slots__ = ("step",)

    def __init__(self) -> None:
        self.step: LoraStep | None = None
