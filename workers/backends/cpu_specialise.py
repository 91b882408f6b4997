"""The CPU specialisation of a loaded model: every rewrite the CPU backend makes, in order.

``CpuBackend.prepare_model`` calls ``specialise_cpu_model`` once the weights are loaded (and,
with ``quantize: w8a16``, quantised by the engine assembly: workers/engine/assembly.py);
``CpuBackend.warm_up`` calls ``warm_up_cpu_model`` on the final model. The order matters, and
the steps below are the only place that states it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from workers.backends import cpu_decode, cpu_deltanet, cpu_fused, cpu_invariant, cpu_linear, gguf_experts
from workers.backends.cpu_decode import FusedDecode

log = logging.getLogger("workers.backends")


@dataclass
class Specialised:
    """What ``specialise_cpu_model`` did (the steps log their own details)."""

    fused_decode: FusedDecode | None  # model.fast_decode, or None (not covered / switched off)
    packed_linears: int  # nn.Linear layers (and a tied head) moved to oneDNN-packed weights
    c_modules: int  # RMSNorm / rope modules replaced by their C kernels


def specialise_cpu_model(model: nn.Module, bf16_weights: bool = False) -> Specialised:
    """Rewrite a loaded model for the CPU backend, in this order:

    0. (before this function) int8 quantisation, on every backend: its Int8Linear layers keep
       the C kernels' 16-channel layout, and a tied head gets ``model.logits_linear``;
    1. on AMX CPUs (``cpuTuning.prefillLinears: kernels``, the default) every bf16 linear and a
       tied head become KernelLinear (cpu_linear.amx_linears: the C kernels' tiles, row-independent);
       with ``bf16_weights`` (CpuBackend.resolve_dtype: a GGUF file in fp32 on an AVX2 CPU) an fp32
       model's linears and tied head become KernelLinear over bf16 weights on fp32 rows
       (cpu_linear.bf16_weight_linears), which the fused step reads as they are (its fp32 step
       over bf16 weights, decode_layers' dtype 2);
    2. the fused decode step (``model.fast_decode``, cpu_decode.py): it reads the plain weights
       (a copy in its layout, within cpuTuning.fusedDecodeMb; beyond it a bf16 model's
       linears become KernelLinear instead), or the KernelLinear layers' own copy,
       or the int8 layers' own tensors, so it must come before step 3 replaces them;
    3. oneDNN packing of every remaining nn.Linear and of a tied head that has no int8 copy
       (cpu_linear.py); Int8Linear layers are not nn.Linear and stay as they are; a mixture of
       experts' stacked expert weights become per-expert packed linears (int8 experts stay);
    4. RMSNorm and rope as single C calls (cpu_fused.py), for the eager path, the Gated DeltaNet
       layers' recurrent step (cpu_deltanet.py: Qwen3-Next / Qwen3.5 decodes), and a GGUF file's
       experts kept in their blocks as one C call per mixture layer (gguf_experts.py).

    In batch-invariant mode (``ScheduleConfig.batchInvariant``) step 1 is ``cpu_invariant.prepare``
    instead: every linear, a tied head and a mixture's experts on the C kernels' products, whose
    order does not change with the row count (nothing is left for step 3 to pack); step 4 takes the
    SwiGLU of fp32 models too.
    """
    invariant = cpu_invariant.enabled()
    if invariant:
        cpu_invariant.prepare(model)
    else:
        cpu_invariant.release()
        if cpu_linear.prefill_route() == "kernels" and getattr(model, "tp", None) is None:
            cpu_linear.amx_linears(model, head=True)
    if bf16_weights and getattr(model, "tp", None) is None:
        cpu_linear.bf16_weight_linears(model)
    fused = cpu_decode.attach(model)
    amx = sum(isinstance(m, cpu_linear.KernelLinear) for m in model.modules())  # steps 1 and 2 may have made them
    packed = amx + cpu_linear.pack_linears(model) + cpu_linear.pack_experts(model)
    c_modules = (cpu_fused.fuse_model(model, invariant=invariant) + cpu_deltanet.attach(model)  # (Gated DeltaNet: Qwen3-Next/3.5)
                 + gguf_experts.attach(model))
    return Specialised(fused, packed, c_modules)


def warm_up_cpu_model(model: nn.Module, thread_counts: list[int], max_rows: int, max_head_rows: int) -> dict:
    """5. After the rewrites: create the oneDNN primitives of every (packed linear shape, row
    bucket, thread count) the worker can meet (cpu_linear.prewarm; off by default)."""
    return cpu_linear.prewarm(model, thread_counts, max_rows=max_rows, max_head_rows=max_head_rows)
