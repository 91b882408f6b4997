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
``cpuTuning.linearBuckets: false`` (``MINDIE_CPU_LINEAR_BUCKETS=0``) turns the padding off (for measurements: the creep comes back).

Both caches are also keyed by the thread count, and core lending (workers/backends/core_share.py)
runs a worker at its own share and at its share times 2, 3 .. ``workers``. ``prewarm`` creates
every (shape, bucket, thread count) a worker can meet when it starts, so its heap reaches its
plateau before it serves, instead of over its first minutes of mixed load (docs/reliability.md,
"Flat memory").
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch
from torch import nn

from workers import settings
from workers.kernels import cpu_kernels
from workers.kernels.cpu_layout import pack

log = logging.getLogger("workers.backends")


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except (RuntimeError, AttributeError):
        return None


EXACT_ROWS = 16  # row counts up to this run unpadded (decode batches: every one common)
FINE_ROWS = 256  # up to here 8 sizes per octave, above it 4 (large prefills are rarer)
BUCKETS = settings.cpu().linear_buckets  # set again by settings.apply


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


# Off by default: it costs start time and about 0.57 MiB per primitive (docs/reliability.md,
# "Flat memory"); operators who want the heap at its plateau from the first request turn it on
# (cpuTuning.prewarmGflop, MINDIE_CPU_PREWARM_GFLOP; ``budget_gflop`` None = that setting).
def prewarm(model: nn.Module, thread_counts: list[int], max_rows: int, max_head_rows: int,
            budget_gflop: float | None = None) -> dict:
    """Run every packed linear shape of ``model`` once at each row bucket up to ``max_rows``
    (the LM head: up to ``max_head_rows``, the rows a step samples) at each of ``thread_counts``,
    so that oneDNN's and ideep's caches hold all their entries before the first request.

    Only one layer per distinct weight shape runs (the caches are keyed by shape, not by layer).
    Buckets go smallest first; a bucket whose matmuls would exceed ``budget_gflop`` in all (a
    large model: start would take minutes) and every larger one are left to be created when a
    step first needs them. A large model's step is then long enough and its weights large
    enough that those few MiB are neither a cost in time nor a visible growth. Restores the
    thread count. Returns what it did."""
    if budget_gflop is None:
        budget_gflop = settings.cpu().prewarm_gflop
    t0 = time.perf_counter()
    shapes: dict[tuple, tuple[torch.Tensor, torch.Tensor | None, int, int, bool]] = {}
    head = getattr(model, "logits_linear", None)
    head_packed = getattr(head, "packed", None)
    for name, mod in model.named_modules():
        if isinstance(mod, PackedLinear):
            is_head = name.split(".")[-1] == "lm_head"
            key = (mod.in_features, mod.out_features, mod.packed.dtype, mod.bias is not None, is_head)
            shapes.setdefault(key, (mod.packed, mod.bias, mod.in_features, mod.out_features, is_head))
    if head_packed is not None:
        key = (head.in_features, head.out_features, head_packed.dtype, False, True)
        shapes.setdefault(key, (head_packed, None, head.in_features, head.out_features, True))
    buckets = sorted({bucket_rows(m) for m in range(1, max(1, max_rows) + 1)})
    head_buckets = [b for b in buckets if b <= bucket_rows(max(1, max_head_rows))]
    before = torch.get_num_threads()
    spent = 0.0
    done = 0
    largest = 0
    stopped = None
    try:
        with torch.inference_mode():
            for rows in buckets:
                todo = [s for s in shapes.values() if not s[4] or rows in head_buckets]
                cost = len(thread_counts) * sum(2.0 * rows * k * n for _, _, k, n, _ in todo) / 1e9
                if spent + cost > budget_gflop:
                    stopped = rows
                    break
                for threads in thread_counts:
                    torch.set_num_threads(threads)
                    for packed, bias, k, n, _ in todo:
                        x = torch.zeros((rows, k), dtype=packed.dtype)
                        torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
                        done += 1
                spent += cost
                largest = rows
    finally:
        torch.set_num_threads(before)
    info = {"shapes": len(shapes), "buckets": len(buckets), "largest": largest, "primitives": done,
            "threads": list(thread_counts), "gflop": round(spent, 1), "seconds": round(time.perf_counter() - t0, 2),
            "stopped_at": stopped}
    if not done:
        log.info("oneDNN linears not pre-warmed (cpuTuning.prewarmGflop %g): %d shapes' primitives are created "
                 "on first use", budget_gflop, info["shapes"])
        return info
    log.info("oneDNN linears pre-warmed: %d shapes x %d thread counts %s, row buckets up to %d (%d primitives, "
             "%.0f GFLOP) in %.2f s%s", info["shapes"], len(thread_counts), info["threads"], largest, done, spent,
             info["seconds"], f"; buckets from {stopped} rows are created on first use (over the "
             f"{budget_gflop:.0f} GFLOP budget)" if stopped else "")
    return info


class _PackedHead:
    """The tied LM head: logits from the packed embedding matrix."""

    def __init__(self, packed: torch.Tensor, in_features: int, out_features: int):
        self.packed, self.in_features, self.out_features = packed, in_features, out_features

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return _packed_linear(h, self.packed, None, self.out_features)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, packed: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = packed
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_linear(x, self.packed, self.bias, self.out_features)


class KernelLinear(nn.Module):
    """A bf16 linear layer where oneDNN cannot pack bf16 (a CPU without AVX512-BF16 / AMX: torch's
    ``F.linear`` then runs at 8-9 GFLOP/s per core on an AVX2 Zen 3): the C kernels' AVX2 products
    (``linear_rows`` over the 16-channel layout, bf16 widened to fp32, fp32 sums rounded once to
    bf16). From 4 rows (prompt chunks) they run register-tiled, 6 rows x 16 channels, at 75-85
    GFLOP/s a Zen 3 core from 16 rows up, above oneDNN fp32 on the same shape; decodes of 1-3 rows
    take the row path (``mindie-bench isa``, docs/performance.md). The layout copy replaces the weight.
    On AMX CPUs the same class carries every bf16 model's layers on AMX tiles (``amx_linears``)."""

    def __init__(self, linear: nn.Module, lib, weight: torch.Tensor | None = None):
        super().__init__()
        w = linear.weight if weight is None else weight
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.packed = pack(w.detach())
        self.bias = getattr(linear, "bias", None)
        self.lib = lib
        self.w16a32 = bool(getattr(lib, "has_w16a32", False))  # linear_rows takes fp32 rows (dt 2)

    def code(self, dtype: torch.dtype) -> int | None:
        """linear_rows' type code for rows of ``dtype`` over this layer's weights: 1 bf16 over bf16,
        2 fp32 rows over bf16 weights (bf16_weight_linears, AVX2 builds), 0 fp32 over fp32
        (batch-invariant fp32 models: workers/backends/cpu_invariant.py); None: F.linear."""
        if self.packed.dtype == torch.bfloat16:
            return 1 if dtype == torch.bfloat16 else 2 if dtype == torch.float32 and self.w16a32 else None
        return 0 if self.packed.dtype == torch.float32 and dtype == torch.float32 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        code = self.code(rows.dtype)
        if code is None or rows.shape[0] == 0:
            w = self.plain()
            return torch.nn.functional.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        rows = rows.contiguous()
        out = torch.empty((rows.shape[0], self.out_features), dtype=rows.dtype)
        bias = self.bias if self.bias is None or self.bias.dtype == rows.dtype else self.bias.to(rows.dtype)
        self.lib.linear_rows(code, rows.data_ptr(), rows.shape[0], self.in_features, self.packed.data_ptr(), None,
                             self.out_features, None if bias is None else bias.contiguous().data_ptr(), out.data_ptr())
        return out.view(*x.shape[:-1], self.out_features)

    def plain(self) -> torch.Tensor:
        """The [N, K] weight back from the layout (rare paths: fp32 inputs, no rows)."""
        if self.packed.dtype != torch.bfloat16:  # [N/16, K, 16]
            nb, k = self.packed.shape[:2]
            return self.packed.permute(0, 2, 1).reshape(nb * 16, k)[:self.out_features, :self.in_features]
        nb, kp = self.packed.shape[:2]
        return self.packed.permute(0, 2, 1, 3).reshape(nb * 16, kp * 2)[:self.out_features, :self.in_features]


def _kernel_linears_lib():
    """The C kernels where they compute bf16 products faster than torch can here (AVX2 builds and
    AVX-512 builds without avx512_bf16: bf16 weights widened in registers), else None."""
    lib = cpu_kernels.load()
    return lib if lib is not None and getattr(lib, "has_w16a32", False) else None


def _plain_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute name, layer) of every nn.Linear in ``model``, listed before any is swapped."""
    return [(parent, name, child) for parent in list(model.modules())
            for name, child in list(parent.named_children()) if isinstance(child, nn.Linear)]


def _tied_head(model: nn.Module) -> nn.Module | None:
    """The embedding of a model whose LM head is tied to it and has no kernel of its own yet, else
    None. A head that already has one (an int8 copy: workers/backends/int8.py; the AMX tiles:
    amx_linears) keeps it."""
    if getattr(model, "lm_head", None) is None and getattr(model, "logits_linear", None) is None:
        return getattr(model, "embed_tokens", None)
    return None


def _amx_lib():
    """The C kernels where their bf16 products run on AMX tiles (cpu_kernels.c ``kernels_amx_rows``),
    else None."""
    lib = cpu_kernels.load()
    return lib if lib is not None and getattr(lib, "amx_rows", 0) else None


ROUTES = ("kernels", "onednn")


def prefill_route() -> str:
    """Who computes a bf16 model's linear layers on an AMX CPU (``cpuTuning.prefillLinears``):
    ``"kernels"`` (``amx_linears``: the C kernels' tiles for every row count, one copy of the
    weights) or ``"onednn"`` (oneDNN's packed products, the fused decode step with a copy of its
    own within ``cpuTuning.fusedDecodeMb``, ``amx_linears`` only beyond it)."""
    route = settings.cpu().prefill_linears
    if route not in ROUTES:
        raise ValueError(f"cpuTuning.prefillLinears must be one of {', '.join(ROUTES)}, got {route!r}")
    return route


def amx_linears(model: nn.Module, head: bool = False) -> int:
    """On AMX CPUs, every bf16 nn.Linear of ``model`` as a KernelLinear: one copy of its weight,
    in the C kernels' layout, read by the prompt products (AMX tiles) and shared by the fused
    decode step, which then needs no copy of its own; ``head``: a tied LM head too
    (``model.logits_linear``, a copy of the embedding in that layout, as oneDNN's packed head).

    A row's result depends on that row alone (the tiles sum every row's products in one order,
    whatever the call's row count), so a model on them computes a prompt with the same bits fresh,
    after a prefix-cache hit or in chunks, and a sequence's logits do not depend on the batch
    around it; oneDNN's packed products round a row differently at different row counts
    (docs/design.md). In whole steps, where each layer's weights come cold from memory, they are
    also faster than oneDNN's on decodes and on prompt steps of up to 512 tokens, level at 1024,
    up to 16 % slower at 2048 (docs/performance.md, "Prompt products on AMX"). The default on AMX
    CPUs (``cpuTuning.prefillLinears``); under ``onednn`` cpu_decode.attach does this for a model
    whose fused-step copy would exceed cpuTuning.fusedDecodeMb. Odd in_features keep oneDNN (the
    tiles take pairs of K). Returns the count converted (0: no AMX here)."""
    return _to_kernel_linears(model, _amx_lib(), head, "the C kernels' AMX tiles")


def dpbf16_linears(model: nn.Module) -> int:
    """On CPUs with AVX512-BF16 dot products but no AMX, every bf16 nn.Linear of ``model`` as a
    KernelLinear (``linear_rows``' AVX512-BF16 products), so the fused decode step reads the
    layers' one copy: cpu_decode.attach does this for a bf16 model whose fused-step copy would
    exceed cpuTuning.fusedDecodeMb (the 1B shape on Zen 4: a decode at concurrency 1 from 0.71 to
    the read roofline's 0.9+, its 512-row prompt products at 0.94x oneDNN's, docs/performance.md).
    Returns the count converted (0: no AVX512-BF16 here)."""
    lib = cpu_kernels.load()
    ok = lib is not None and getattr(lib, "has_dpbf16", False) and not getattr(lib, "amx_rows", 0)
    return _to_kernel_linears(model, lib if ok else None, False, "the C kernels' AVX512-BF16 products")


def _even_bf16(w: torch.Tensor) -> bool:
    """Weights the AMX / AVX512-BF16 products take: bf16 with an even K (pairs of values)."""
    return w.dtype == torch.bfloat16 and w.shape[1] % 2 == 0


def _to_kernel_linears(model: nn.Module, lib, head: bool, where: str,
                       takes: Callable[[torch.Tensor], bool] = _even_bf16) -> int:
    """The swap itself, on ``lib`` (None: nothing to do): every nn.Linear whose weight ``takes``
    accepts, and with ``head`` a tied LM head, as KernelLinear (amx_linears, dpbf16_linears,
    batch-invariant mode's cpu_invariant.invariant_linears)."""
    if lib is None:
        return 0
    dtypes: set[str] = set()
    count = 0
    for parent, name, child in _plain_linears(model):
        if takes(child.weight):
            setattr(parent, name, KernelLinear(child, lib))
            dtypes.add(str(child.weight.dtype).replace("torch.", ""))
            count += 1
    emb = _tied_head(model) if head else None
    if emb is not None and takes(emb.weight):
        model.logits_linear = KernelLinear(emb, lib, emb.weight)
        dtypes.add(str(emb.weight.dtype).replace("torch.", ""))
        count += 1
    if count:
        log.info("%d %s linear layers on %s (one copy of the weights, shared with the fused decode step)",
                 count, "/".join(sorted(dtypes)), where)
    return count


def bf16_weight_linears(model: nn.Module) -> int:
    """An fp32 model's linear layers and tied LM head as KernelLinear over their weights rounded
    to bf16, computed on fp32 rows (``linear_rows`` dt 2, AVX2 builds): half the bytes a decode
    reads, fp32's rounding of every activation. For a GGUF file's quantised weights on a CPU
    without native bf16 (CpuBackend.resolve_dtype), where bf16 activations flip near ties
    (docs/performance.md, "AVX2-only AMD EPYC (Zen 3)"). The fused decode step reads these
    layers' own weights (cpu_decode: fp32 activations over them, no copy). Returns the count
    converted (0: no such kernel here)."""
    lib = _kernel_linears_lib()
    if lib is None or not getattr(lib, "has_w16a32", False):
        return 0
    count = 0
    for parent, name, child in _plain_linears(model):
        if child.weight.dtype == torch.float32:
            setattr(parent, name, KernelLinear(child, lib, child.weight.detach().to(torch.bfloat16)))
            count += 1
    emb = _tied_head(model)
    if emb is not None and emb.weight.dtype == torch.float32:
        model.logits_linear = KernelLinear(emb, lib, emb.weight.detach().to(torch.bfloat16))
        count += 1
    if count:
        log.info("%d linear layers keep their weights in bf16 on the C kernels' AVX2 products, computed on fp32 "
                 "rows", count)
    return count


def pack_experts(model: nn.Module) -> int:
    """A mixture of experts' stacked expert weights (workers/models/moe.py) as per-expert packed
    linears: one oneDNN product per activated expert, like every other linear here. Experts
    already converted (int8) stay as they are. Returns the count of linears packed."""
    if not torch.backends.mkldnn.is_available():
        return 0
    count = 0
    for mod in model.modules():
        if callable(getattr(mod, "convert_experts", None)) and mod.lin13 is None and mod.w13.numel():
            if _pack(mod.w13[0]) is None:  # a dtype oneDNN does not pack on this CPU
                continue

            def make(w: torch.Tensor) -> nn.Module:
                shape = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
                return PackedLinear(shape, _pack(w.contiguous()))

            count += mod.convert_experts(make, "packed")
    if count:
        log.info("packed %d expert linear layers for oneDNN", count)
    return count


def pack_linears(model: nn.Module) -> int:
    """Swap every nn.Linear of ``model`` for a PackedLinear (and pack the tied LM head)."""
    if not torch.backends.mkldnn.is_available():
        return 0
    count = kernel = 0
    klib = _kernel_linears_lib()
    for parent, name, child in _plain_linears(model):
        packed = _pack(child.weight)
        if packed is not None:
            setattr(parent, name, PackedLinear(child, packed))
            count += 1
        elif klib is not None and child.weight.dtype == torch.bfloat16:
            setattr(parent, name, KernelLinear(child, klib))
            kernel += 1
    if (emb := _tied_head(model)) is not None:
        packed = _pack(emb.weight)
        if packed is not None:
            vocab, hidden = emb.weight.shape
            model.logits_linear = _PackedHead(packed, hidden, vocab)
            count += 1
        elif klib is not None and emb.weight.dtype == torch.bfloat16:
            model.logits_linear = KernelLinear(emb, klib, emb.weight)
            kernel += 1
    log.info("packed %d linear layers for oneDNN%s", count,
             f"; {kernel} bf16 linear layers on the C kernels' AVX2 products (oneDNN cannot pack bf16 here)"
             if kernel else "")
    return count + kernel
