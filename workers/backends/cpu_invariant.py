"""Batch-invariant mode on the CPU (``ScheduleConfig.batchInvariant``): every row of a step computed
in one order whatever else the step holds, so a sequence's tokens and log-probabilities do not
depend on the other requests, on how its prompt was cut into chunks, on a prefix-cache hit or on
speculation (docs/design.md, "Batch invariance").

What varies with the step elsewhere, and what this mode puts in its place:

- products: oneDNN picks its blocking (and so the order of a dot product's partial sums) by the
  row count, and the fused decode step's products differ from it; here every linear layer, a tied
  LM head and the experts of a mixture are ``KernelLinear`` (the C kernels' ``linear_rows``, whose
  sum for one output element runs in one order for any row count, on AMX tiles, AVX512-BF16 dot
  products, AVX-512 / AVX2 FMAs or the portable loops) and the fused decode step reads those same
  weights through the same products; int8 layers keep their C products at every row count;
- attention: prompt chunks, decodes and speculative verify rows all take the decode computation,
  one query row at a time against its sequence's cached keys (workers/attention/paged.py,
  ``build_metadata(every_row=True)``): the C decode kernel, or the portable torch decode one row
  per call for layers it does not cover (sinks, soft-capping, MLA);
- SwiGLU: the C kernels' pass in bf16 and in fp32 (the fused step's own arithmetic), not torch's
  vectorised silu, whose loop tails round differently;
- Gated DeltaNet layers (workers/models/gated_deltanet.py, the state pool's ``waves``): prompt
  tokens one at a time through the recurrent step decodes use, the convolution tap by tap;
- elementwise functions with a transcendental part (activations, gates, norms' rsqrt): through
  ``row_ops.rowwise`` / ``row_ops.elementwise``, every value in the body of torch's vectorised loop.

Norms, rope, residual adds and the sampler already compute each row alone.
"""
from __future__ import annotations

import logging
import weakref

import torch
from torch import nn

from workers import settings
from workers.backends.cpu_fused import c_swiglu
from workers.backends.cpu_linear import KernelLinear, _to_kernel_linears
from workers.kernels import cpu_kernels
from workers.kernels.cpu_layout import pack
from workers.models import row_ops

log = logging.getLogger("workers.backends")

KEY = "ScheduleConfig.batchInvariant"


def enabled() -> bool:
    """Whether this worker runs batch-invariant (the plan's ``batch_invariant``, settled)."""
    return bool(settings.engine().batch_invariant)


def check(dtype: torch.dtype, lib) -> None:
    """ValueError naming the keys when the mode cannot hold on this model and host."""
    if lib is None:
        raise ValueError(f"{KEY} needs the C kernels (BackendConfig.cpuTuning.kernels is off, or they could not "
                         "be built: see the worker's log); set batchInvariant false or turn the kernels on")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{KEY} computes float32 and bfloat16 models on the CPU, not {str(dtype).replace('torch.', '')}"
                         " (ModelConfig dtype); set batchInvariant false or choose another dtype")


def invariant_linears(model: nn.Module, lib) -> int:
    """Every fp32 / bf16 nn.Linear of ``model``, a tied LM head and a mixture's experts as
    KernelLinear on ``lib``. Returns the count converted."""
    count = _to_kernel_linears(model, lib, True, "the C kernels' products, one order per output element at every "
                               f"row count (batch-invariant mode, {KEY})",
                               lambda w: w.dtype in (torch.float32, torch.bfloat16))
    experts = 0
    for mod in model.modules():
        if callable(getattr(mod, "convert_experts", None)) and mod.lin13 is None and mod.w13.numel():

            def make(w: torch.Tensor) -> nn.Module:
                return KernelLinear(nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta"), lib, w.contiguous())

            experts += mod.convert_experts(make, "kernel")
    if experts:
        log.info("batch-invariant mode (%s): %d experts' products on the C kernels", KEY, experts)
    return count + experts


class RowProduct:
    """``row_ops.ROW_PRODUCT`` in this mode: ``x @ w`` on ``linear_rows`` (fp32 or bf16), each
    matrix packed once into the kernels' layout. A matrix is known by its base tensor (an adapter's
    A or B, an expert's slice of a stacked parameter) and its place in it; the packed copies go
    when the base tensor is freed."""

    def __init__(self, lib):
        self.lib = lib
        self.packed: dict[int, dict[tuple, torch.Tensor]] = {}  # id(base) -> view key -> packed

    def _packed(self, w: torch.Tensor) -> torch.Tensor:
        base = w if w._base is None else w._base
        views = self.packed.get(id(base))
        if views is None:
            views = self.packed[id(base)] = {}
            weakref.finalize(base, self.packed.pop, id(base), None)
        key = (w.storage_offset(), tuple(w.shape), w.stride(), w.dtype)
        packed = views.get(key)
        if packed is None:
            packed = views[key] = pack(w.t().contiguous())
        return packed

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        code = {torch.float32: 0, torch.bfloat16: 1}.get(w.dtype)
        if code is None or x.dtype != w.dtype or x.dim() != 2 or w.dim() != 2 or x.shape[0] == 0:
            return x @ w
        packed = self._packed(w)
        x = x.contiguous()
        out = torch.empty((x.shape[0], w.shape[1]), dtype=x.dtype)
        self.lib.linear_rows(code, x.data_ptr(), x.shape[0], w.shape[0], packed.data_ptr(), None, w.shape[1], None,
                             out.data_ptr())
        return out


def swiglu(lib):
    """``row_ops.SWIGLU`` in this mode: the C kernels' SwiGLU (the fused decode step's
    arithmetic), fp32 and bf16; torch's for inputs they do not cover."""

    def run(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        out = c_swiglu(lib, gate_up, inter)
        if out is None:
            gate, up = gate_up.split(inter, dim=-1)
            return torch.nn.functional.silu(gate) * up
        return out

    return run


def release() -> None:
    """Outside the mode: torch's products and SwiGLU again (a process that prepared an invariant
    model before, such as a test run)."""
    row_ops.ROW_PRODUCT = row_ops.SWIGLU = None
    log.info("batch-invariant mode off (%s false): a row's last bits may follow the batch around it", KEY)


def prepare(model: nn.Module) -> int:
    """The mode's rewrites of a loaded model, before the fused decode step attaches (it then reads
    these layers' weights): its checks, ``invariant_linears``, and LoRA adapters' products on the
    C kernels (``row_ops``: LoRA deltas, GPT-OSS's router and experts, a mixture's SwiGLU)."""
    lib = cpu_kernels.load()
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    check(dtype, lib)
    row_ops.ROW_PRODUCT = RowProduct(lib)
    row_ops.SWIGLU = swiglu(lib)
    return invariant_linears(model, lib)
