"""W8A8 int8 on the CPU (``ModelConfig[].quantize: "w8a8"``, and compressed-tensors W8A8
checkpoints): weights in GGUF Q8_0 blocks (int8 per 32 values of a row, an fp16 scale each:
workers/models/w8a8.py), computed by the GGUF block kernels (workers/backends/gguf_linear.py,
workers/kernels/gguf_kernels.c), the GGUF linears' products at each row count (``regimes``:
integer dot products over int8 activations per 32 values for decode rows, dequantised tiles in
cache from the measured row counts), the fused decode step reading the blocks in place. The linears are those ``quantize: "w8a16"``
quantises (workers/backends/int8.py ``quantisable_linears``: the decoder layers', every expert's,
the LM head, a tied head as an int8 copy of the embedding); a linear whose inputs are not whole
blocks of 32 stays in the model dtype. Only the CPU backend has these kernels: the others refuse
the key at start (workers/engine/assembly.py).
"""
from __future__ import annotations

import logging

from torch import nn

import torch

from workers.backends.gguf_linear import NativeTarget, regimes
from workers.backends.int8 import quantisable_linears
from workers.kernels import gguf_kernels as gk
from workers.models.w8a8 import BLOCK, Q8_0, quantize_q8_0

log = logging.getLogger("workers.backends")

SCHEME = "w8a8"


def target() -> NativeTarget | None:
    """The C kernels' target for Q8_0 linears, or None where they do not load."""
    lib = gk.load()
    return None if lib is None else NativeTarget(lib)


def unavailable_reason() -> str:
    return gk.unavailable_reason()


def quantize_model(model: nn.Module, tgt: NativeTarget, dtype: torch.dtype) -> int:
    """Replace the linears ``quantize: "w8a16"`` would by Q8_0 ones from ``tgt`` (the tied head:
    ``model.logits_linear`` from the embedding); ``dtype``: the model's rows. Returns the count."""

    def make(w, bias, halves: bool = False):
        n, k = w.shape
        if not tgt.covers(Q8_0, k):
            return None
        # gate/up as two parts, as a GGUF file's two tensors: the fused decode step reads each half
        cuts = (0, n // 2, n) if halves and n % 2 == 0 else (0, n)
        parts = [(a, Q8_0, quantize_q8_0(w[a:b])) for a, b in zip(cuts, cuts[1:])]
        return tgt.linear(parts, k, n, bias)

    count = kept = 0
    for parent, name, child in quantisable_linears(model):
        lin = make(child.weight, child.bias, name == "gate_up_proj")
        if lin is None:
            kept += 1
            continue
        setattr(parent, name, lin)
        count += 1
    for mod in list(model.modules()):  # mixture-of-experts layers: every expert's two matrices
        if callable(getattr(mod, "quantize_experts", None)):
            if not (tgt.covers(Q8_0, mod.w13.shape[-1]) and tgt.covers(Q8_0, mod.w2.shape[-1])):
                kept += 1
                continue
            count += mod.quantize_experts(lambda w: make(w, None))
    if getattr(model, "lm_head", "absent") is None and hasattr(model, "embed_tokens"):
        head = make(model.embed_tokens.weight, None)
        if head is not None:
            model.logits_linear = head
            count += 1
    loaded(tgt, count, "quantised at load", dtype, kept)
    return count


def loaded(tgt: NativeTarget, count: int, how: str, dtype: torch.dtype, kept: int = 0) -> None:
    """The worker's one line on its W8A8 linears (``dtype``: the model's rows)."""
    log.info("W8A8: %d linear layers %s into Q8_0 blocks (int8 per %d weights, fp16 scales; %.1f MiB)%s on the C "
             "kernels (%s): %s", count, how, BLOCK, tgt.nbytes / 2**20,
             f", {kept} kept in the model dtype (inputs not whole blocks of {BLOCK})" if kept else "",
             gk.ISA_NAMES[tgt.lib.isa], regimes(tgt.lib, dtype))
