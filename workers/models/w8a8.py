"""W8A8 int8 weights as GGUF Q8_0 blocks (``ModelConfig[].quantize: "w8a8"``, and pre-quantised
W8A8 checkpoints in the compressed-tensors format).

Q8_0 (llama.cpp's format: per 32 values of a row one fp16 scale ``d`` and 32 int8 values, 34
bytes) is a symmetric W8A8 scheme the C kernels already compute from its blocks with int8
activations per 32 values (workers/kernels/gguf_kernels.c, workers/backends/gguf_linear.py), the
fused decode step included. So both sources end as Q8_0 blocks:

- ``quantize: "w8a8"`` of a float checkpoint: each block's ``d = max|w| / 127`` (stored as fp16),
  ``q = round(w / d)`` clamped to [-127, 127] (``quantize_q8_0``);
- a compressed-tensors checkpoint (what vLLM loads, e.g. the ``*-quantized.w8a8`` exports of
  llm-compressor): its int8 weight values are kept and every block of a row gets the row's
  (output channel's) ``weight_scale`` (``channel_blocks``; which checkpoints are accepted:
  workers/models/w8a8_config.py).

A channel scale rounds to fp16 in the blocks: relative error at most 2^-11 for scales from
6.1e-5 (fp16's smallest normal value; smaller ones keep fewer bits, below 6e-8 or above 65504
they are refused, naming the tensor).
"""
from __future__ import annotations

from pathlib import Path

import torch

from .w8a8_config import Int8Tensor

Q8_0 = 8  # ggml's type id (gguf_kernels.TYPES["Q8_0"])
BLOCK = 32
BLOCK_BYTES = 2 + BLOCK
FP16_MIN, FP16_MAX = 2.0 ** -24, 65504.0


def q8_0_blocks(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/32 * 34]: Q8_0 blocks of int8 ``q`` [N, K] with scales ``d`` [N, K/32]
    (rounded to fp16, little-endian, before each block's 32 values)."""
    n, k = q.shape
    if k % BLOCK:
        raise ValueError(f"Q8_0 needs whole blocks of {BLOCK} inputs, not {k}")
    out = torch.empty(n, k // BLOCK, BLOCK_BYTES, dtype=torch.uint8)
    out[:, :, :2] = d.to(torch.float16).contiguous().view(torch.uint8).view(n, k // BLOCK, 2)
    out[:, :, 2:] = q.contiguous().view(torch.uint8).view(n, k // BLOCK, BLOCK)
    return out.view(n, -1)


def channel_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q8_0_blocks`` of a per-output-channel int8 weight: each block of row n scaled by
    ``scale[n]`` (the int8 values kept as they are)."""
    n, k = q.shape
    return q8_0_blocks(q, scale.reshape(n, 1).float().expand(n, k // BLOCK))


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks of a float [N, K] ``w``: per 32 values ``d = max|w| / 127`` (fp16), ``q =
    round(w / d)`` against the stored (fp16) scale, clamped to [-127, 127]; an all-zero block
    stores d = 0."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"Q8_0 needs whole blocks of {BLOCK} inputs, not {k}")
    blocks = w.detach().float().reshape(n, k // BLOCK, BLOCK)
    d = (blocks.abs().amax(-1) / 127.0).to(torch.float16).float()
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q8_0_blocks(q.view(n, k), d)


def dequantize_q8_0(raw: torch.Tensor, k: int) -> torch.Tensor:
    """fp32 [N, K] of Q8_0 blocks (the reference the tests compare against)."""
    n = raw.shape[0]
    b = raw.reshape(n, k // BLOCK, BLOCK_BYTES)
    d = b[:, :, :2].contiguous().view(torch.float16).float()
    return (b[:, :, 2:].contiguous().view(torch.int8).float() * d).view(n, k)


def read_blocks(f_weight, t: Int8Tensor, f_scale, f_zero, start: int, rows: int) -> torch.Tensor:
    """Q8_0 blocks of rows [start, start + rows) of the int8 tensor ``t`` (opened safetensors files:
    its weight's, its scale's, its zero point's or None). ModelLoadError-worthy problems raise
    ValueError naming the tensor."""
    q = f_weight.get_slice(t.name)[start:start + rows]
    scale = f_scale.get_slice(t.scale_name)[start:start + rows].float().reshape(-1)
    if f_zero is not None and t.zero_point is not None:
        zp = f_zero.get_slice(t.zero_point[1])[start:start + rows]
        if bool((zp != 0).any()):
            raise ValueError(f"{t.zero_point[1]}: non-zero zero points (asymmetric weights) are not served")
    bad = (scale.abs() > FP16_MAX) | ((scale != 0) & (scale.abs() < FP16_MIN)) | ~torch.isfinite(scale)
    if bool(bad.any()):
        raise ValueError(f"{t.scale_name}: scale {float(scale[bad][0])!r} is outside fp16's range, which the "
                         "Q8_0 blocks store")
    return channel_blocks(q, scale)


def load_int8_linears(model: torch.nn.Module, slots: dict, int8: dict[str, Int8Tensor], target) -> int:
    """Replace each linear whose checkpoint weights are int8 (``Checkpoint.int8``) by
    ``target.linear`` (workers/backends/gguf_linear.py ``NativeTarget``) over their Q8_0 blocks;
    a fused linear (q/k/v, gate/up) takes its parts' rows in turn. Returns the count. ValueError
    for an int8 tensor of no whole linear (a mixture of experts' stacked experts), a linear of
    int8 and float parts, or inputs the blocks cannot hold."""
    from safetensors import safe_open

    linears = {id(m.weight): (parent, name, m) for parent in model.modules()
               for name, m in parent.named_children() if isinstance(m, torch.nn.Linear)}
    plan: dict[int, dict] = {}
    for key, t in int8.items():
        slot = slots[key]
        if isinstance(slot, list) or id(slot.param) not in linears or slot.dim is not None or slot.zero:
            raise ValueError(f"int8 tensor {t.name} is not a whole linear layer's weight here (only the dense "
                             "layers' linears and the LM head are served from int8)")
        parent, name, lin = linears[id(slot.param)]
        if not target.covers(Q8_0, lin.in_features):
            raise ValueError(f"int8 tensor {t.name}: {lin.in_features} inputs are not whole blocks of {BLOCK}")
        plan.setdefault(id(slot.param), {"at": (parent, name, lin), "rows": []})["rows"].append((slot, t))
    files: dict[Path, object] = {}

    def opened(file: Path):
        if file not in files:
            files[file] = safe_open(str(file), framework="pt", device="cpu")
        return files[file]

    for b in plan.values():
        parent, name, lin = b["at"]
        if sum(slot.rows for slot, _ in b["rows"]) != lin.out_features:
            float_part = next(n for n, s in slots.items() if not isinstance(s, list) and s.param is lin.weight
                              and n not in int8)
            raise ValueError(f"{float_part} is stored in float beside int8 parts of the same layer "
                             f"({b['rows'][0][1].name}); quantise all of them or none")
        # one part per checkpoint tensor (q, k, v; gate, up), as a GGUF file's: the fused decode
        # step reads gate and up apart
        parts = [(slot.start, Q8_0, read_blocks(opened(t.file), t, opened(t.scale_file),
                                                opened(t.zero_point[0]) if t.zero_point else None, 0, slot.rows))
                 for slot, t in b["rows"]]
        setattr(parent, name, target.linear(parts, lin.in_features, lin.out_features, lin.bias))
    return len(plan)
