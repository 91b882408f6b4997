"""The whole decoder stack of a small decode step in one C call (cpu_kernels.c ``decode_layers``).

At batch 1 a decode step of a small model reads its weights in about as much time as eager torch
spends dispatching the ~12 ops of each layer (docs/performance.md, "Decode at concurrency 1").
For a step made only of decodes, of at most ``cpuTuning.fusedDecodeRows`` sequences (64; 4 on
a CPU without AVX2+FMA), the kernel runs embedding, every layer and the final norm inside one OpenMP
region: matrix-vector products over weights repacked for it (``pack``: AVX512-BF16 dot products
where the CPU has them, fp32 FMAs otherwise, a loop the compiler vectorises on AVX2), the same C
norms, rope and paged attention as the eager path, and every intermediate rounded where torch
rounds. Larger steps and prefills keep the eager path and its linears.

On an AMX CPU a bf16 model's linears are in the kernel's layout already (``cpu_linear.amx_linears``,
``cpuTuning.prefillLinears: kernels``, the default: AMX tiles for its prompts too), and the kernel
reads them, no copy (a large model's decode then reaches the read roofline, where per-op oneDNN
calls stayed at ~0.78 of it). oneDNN-packed layers (fp32 models, CPUs without AMX,
``prefillLinears: onednn``) cannot be read by the kernel, so it keeps its own copy of the layer
weights: the linear layers' bytes twice. Only models whose copy fits ``cpuTuning.fusedDecodeMb``
(256 MiB) get a copy; beyond it a bf16 model on an AMX or AVX512-BF16 CPU still moves its
linears to the kernel's layout (``cpu_linear.amx_linears``, ``cpu_linear.dpbf16_linears``), other
larger models keep the eager path.
``cpuTuning.fusedDecode: false`` turns it off (each key's
environment override: docs/config.md). Int8 weights (``quantize: w8a16``) are kept in this
layout by the CPU's int8 linears already (workers/backends/int8.py): the kernel reads those same
tensors, no copy, with their scales applied to the fp32 sums. A GGUF file's blocks
(``ggufCompute: native``: workers/backends/gguf_linear.py) are read in place too, each linear
as a ``dec_gguf_t`` of its parts, through gguf_kernels.c's ``gguf_rows`` (a pointer in the step),
over the layer's input quantised per 32 values into the step's scratch, or over the input itself
against weight tiles dequantised in cache from the row counts where those win (gguf_kernels.c's
measured ranges, as the eager GgufLinear; in batch-invariant mode at every row count or none, its
one path). An fp32 model whose linears keep
bf16 weights (a GGUF file on an AVX2 CPU: ``cpu_linear.bf16_weight_linears``) is computed in fp32
over those same tensors (kernel code 2), no copy either. Qwen3's per-head q/k norms and Gemma 2's
and 3's layers (their (1 + w) norms, the norms of the attention's and the feed-forward's outputs,
GeGLU, a rope per layer kind, the scaled embedding, Gemma 2's soft-capped attention scores:
``norm_w1``, ``attn_out_norm``, ``act_gelu``, the layer's ``cos_t`` in cpu_kernels.c's dec_layer_t,
the step's ``softcap``) are computed too, and GPT-OSS's attention sinks (the layer's ``sinks``). A
mixture-of-experts layer (Qwen2/3-MoE, Mixtral, GPT-OSS) stops the call after its feed-forward norm
(``moe``: the step's ``l0`` / ``stopped``): its own module (router, experts: gguf_experts.py's one
call for a GGUF file's, a shared expert) adds the mixture to the residual rows, as the eager layer
does, and the next call resumes at the following layer. Models it does not cover
(``fused_decode_refusal``: MLA, hybrid layers, the variant families; interleaved rotary pairs;
tensor-parallel ranks, fp16, a KV cache of another type) keep the eager path. A partial rotary
(GLM-4-MoE's NeoX halves of the first ``rotary_dim`` dims) turns those dims only (``rot_half``).
"""
from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from workers import settings
from workers.backends import cpu_linear
from workers.backends.cpu_fused import gelu_table, one_plus, silu_table
from workers.backends.cpu_linear import KernelLinear
from workers.backends.gguf_linear import CParts, GgufLinear, c_parts
from workers.backends.int8 import Int8Linear
from workers.kernels import cpu_kernels, gguf_kernels
from workers.kernels.cpu_layout import pack, pack_scales

log = logging.getLogger("workers.backends")

_c_void_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Layer(ctypes.Structure):
    _fields_ = [(n, _c_void_p) for n in ("in_norm", "qkv_w", "qkv_b", "o_w", "o_b", "post_norm", "gate_w", "gate_b",
                                         "up_w", "up_b", "down_w", "down_b", "qkv_s", "o_s", "gate_s", "up_s",
                                         "down_s", "k_cache", "v_cache")] + [("window", _i64)] \
        + [(n, _c_void_p) for n in ("qkv_g", "o_g", "gate_g", "up_g", "down_g", "q_norm", "k_norm",
                                    "attn_out_norm", "ff_out_norm", "cos_t", "sin_t")] + [("moe", _i64)] \
        + [("sinks", _c_void_p), ("rot_half", _i64)]


class _Step(ctypes.Structure):
    _fields_ = [(n, _i64) for n in ("n_layers", "C", "H", "Hkv", "D", "I", "bs", "max_blocks", "max_pos", "M")] \
        + [("eps", _f32), ("scale", _f32), ("layers", ctypes.POINTER(_Layer))] \
        + [(n, _c_void_p) for n in ("embed", "ids", "pos", "blocks", "offsets", "tables", "final_norm", "act_bf16", "x", "xn", "qkv", "att", "act", "out",
                                    "gg_rows", "gg_quantize", "gg_xq", "gg_d4", "gg_s16")] \
        + [("norm_w1", _i64), ("act_gelu", _i64), ("embed_scale", _f32), ("softcap", _f32), ("l0", _i64),
           ("stopped", _i64)]


MAX_ROWS = 64  # DEC_MAX_ROWS in cpu_kernels.c


def rows_limit() -> int:
    """The largest decode batch the kernel takes (``cpuTuning.fusedDecodeRows``, 0-64, settled in
    the plan: 64 with AVX-512 or AVX2+FMA, 4 with the portable loops of other CPUs, slower than
    oneDNN from about 8 rows; docs/performance.md). ValueError for anything else."""
    value = settings.cpu().fused_decode_rows
    if not isinstance(value, int) or not 0 <= value <= MAX_ROWS:
        raise ValueError(f"cpuTuning.fusedDecodeRows must be an integer from 0 to {MAX_ROWS}, got {value!r}")
    return value


def budget_limit_mb() -> float:
    """``cpuTuning.fusedDecodeMb`` (256): the largest weight copy the kernel may keep."""
    mb = settings.cpu().fused_decode_mb
    if not 0 <= mb < float("inf"):
        raise ValueError(f"cpuTuning.fusedDecodeMb must be a number of MiB >= 0, got {mb!r}")
    return mb


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedDecode:
    """``model.fast_decode``: called by DecoderLM.forward; returns the normed hidden states of a
    step it covers, or None (the eager path runs)."""

    def __init__(self, model: nn.Module, lib: ctypes.CDLL, code: int, weights: list[dict[str, torch.Tensor | None]],
                 max_rows: int):
        args = model.args
        self.lib, self.code, self.dtype = lib, code, embed_dtype(model)
        self.rope = model.rope  # Gemma's LayerRopes: a rope per layer kind (_layer_ropes)
        gemma = getattr(args, "gemma", None)
        self.gemma = gemma is not None
        # The kernel reads these in place: they live as long as this object. An embedding looked up
        # from GGUF blocks (gguf_linear.GgufEmbedding) has no dense matrix: its step's rows are
        # dequantised first into rows [max_rows, C], which the kernel reads at ids 0 .. M - 1.
        emb = model.embed_tokens
        self.lookup = emb if hasattr(emb, "lookup") else None
        self.rows = torch.empty(max_rows, args.hidden_size, dtype=self.dtype) if self.lookup is not None else None
        self.iota = torch.arange(max_rows, dtype=torch.long) if self.lookup is not None else None
        self.weights, self.final_norm = weights, _norm(model.norm.weight, self.gemma)
        # a mixture of experts' layers: the step stops after each one's feed-forward norm, and its
        # own module (router, experts, a shared expert) adds the mixture here, as the eager layer does
        self.mixtures = {i: layer.mlp for i, layer in enumerate(model.layers) if _is_mixture(layer.mlp)}
        self.embed = self.rows if self.lookup is not None else emb.weight
        self.C, self.H, self.Hkv, self.D = args.hidden_size, args.num_attention_heads, args.num_key_value_heads, \
            args.head_dim
        self.I = args.intermediate_size
        self.eps = args.rms_norm_eps
        self.layer_windows = args.layer_windows  # None: a global layer
        # Gemma: its softmax scale, and the embedding times sqrt(C) rounded to the model dtype first
        self.scale = gemma.scale if gemma is not None else self.D ** -0.5
        # Gemma 2: its attention scores soft-capped (0: none), as the eager attention's kernels cap them
        self.softcap = float(gemma.attn_logit_softcapping or 0.0) if gemma is not None else 0.0
        self.embed_scale = float(torch.tensor(model.embed_scale).to(self.dtype)) if gemma is not None else 0.0
        # silu (Gemma: gelu) of every bf16 value, computed by torch: the kernel looks it up, so the
        # activation rounds as eager's does
        self.act_table = None
        if self.dtype == torch.bfloat16:
            self.act_table = gelu_table() if self.gemma else silu_table()
        self.max_rows = max_rows
        self.calls = 0  # steps the kernel ran (tests check the path is taken)
        self._layers = None
        self._attn = None
        self._ok = False
        self._cos = None
        self._step: _Step | None = None
        self._scratch: tuple[torch.Tensor, ...] | None = None
        self._gg: dict[str, int] | None = None  # the GGUF layers' step fields (_gguf_scratch)

    def _layer_ropes(self) -> list:
        """Each layer's rope (its ``cos`` / ``sin`` tables): Gemma's by the layer's window."""
        of = getattr(self.rope, "of", None)
        return [of(w) if of is not None else self.rope for w in self.layer_windows]

    def _rope_key(self) -> tuple:
        """The tables the bound rope pointers were taken from, held (so none is freed while bound)
        and compared by identity: a rope moved or rebuilt is bound again."""
        of = getattr(self.rope, "of", None)
        ropes = (self.rope.glob, self.rope.local) if of is not None else (self.rope,)
        return tuple(getattr(r, "cos", None) for r in ropes)

    def _rope_moved(self) -> bool:
        key = self._rope_key()
        return self._cos is None or len(key) != len(self._cos) or any(a is not b for a, b in zip(key, self._cos))

    def _bind(self, attn) -> None:
        """Per-layer pointers, including this attention object's caches (bound once per KV
        allocation), and the step's constant fields, set once: a step only fills in its own."""
        arr = (_Layer * len(self.weights))()
        ropes = self._layer_ropes()
        for i, w in enumerate(self.weights):
            lay = arr[i]
            for name in _Layer._fields_:
                if name[0] in w:
                    v = w[name[0]]
                    setattr(lay, name[0], ctypes.addressof(v) if isinstance(v, CParts) else _ptr(v))
            lay.k_cache, lay.v_cache = attn.k_ptr[i], attn.v_ptr[i]
            lay.window = self.layer_windows[i] or 0
            lay.moe = int(i in self.mixtures)
        self._layers, self._attn, self._cos = arr, attn, self._rope_key()
        self._ok = (getattr(attn, "lib", None) is not None and attn.k_cache[0].dtype == self.dtype
                    and all(getattr(r, "cos", None) is not None and r.cos.dtype == torch.float32
                            and r.cos.is_contiguous() and r.sin.is_contiguous() for r in ropes))
        if not self._ok:
            return
        for lay, r in zip(arr, ropes):
            lay.cos_t, lay.sin_t = r.cos.data_ptr(), r.sin.data_ptr()
            rd = getattr(r, "rotary_dim", None)  # a partial rotary (VariantRope): its tables are rd / 2 wide
            lay.rot_half = rd // 2 if rd is not None and rd < self.D else 0
        if self._scratch is None:
            e, n = self.dtype, self.max_rows
            nq = (self.H + 2 * self.Hkv) * self.D
            self._scratch = (torch.empty(n, self.C, dtype=e), torch.empty(n, self.C, dtype=e),
                             torch.empty(n, nq, dtype=e), torch.empty(n, self.H * self.D, dtype=e),
                             torch.empty(n, self.I, dtype=e))
        x, xn, qkv, att, act = (t.data_ptr() for t in self._scratch)  # the kernel uses the first M rows
        if self._gg is None:  # once: the scratch does not depend on the KV allocation
            self._gg = self._gguf_scratch()
        self._step = _Step(n_layers=len(self.weights), C=self.C, H=self.H, Hkv=self.Hkv, D=self.D, I=self.I,
                           bs=attn.block_size, max_pos=self.rope.max_positions, eps=self.eps,
                           scale=self.scale, layers=self._layers, embed=self.embed.data_ptr(),
                           final_norm=self.final_norm.data_ptr(), act_bf16=_ptr(self.act_table),
                           x=x, xn=xn, qkv=qkv, att=att, act=act, norm_w1=int(self.gemma),
                           act_gelu=int(self.gemma), embed_scale=self.embed_scale, softcap=self.softcap,
                           **self._gg)

    def _gguf_scratch(self) -> dict[str, int]:
        """The GGUF layers' pointers and scratch (the input of a layer quantised per 32 values), or
        nothing where every layer is packed for gemv_group."""
        if not any(isinstance(v, CParts) for w in self.weights for v in w.values()):
            return {}
        lib = gguf_kernels.load()
        k = max(self.C, self.H * self.D, self.I)
        self._gg_scratch = (torch.empty(self.max_rows, k, dtype=torch.int8),  # the step reads them: kept here
                            torch.empty(self.max_rows, k // 4), torch.empty(self.max_rows, k // 16))
        xq, d4, s16 = (t.data_ptr() for t in self._gg_scratch)
        return dict(gg_rows=ctypes.cast(lib.gguf_rows, _c_void_p).value,
                    gg_quantize=ctypes.cast(lib.gguf_quantize_row, _c_void_p).value, gg_xq=xq, gg_d4=d4, gg_s16=s16)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor | None:
        meta = getattr(attn, "meta", None)
        m = input_ids.shape[0]
        if meta is None or meta.prefill is not None or meta.decode is None or m > self.max_rows:
            return None
        if attn is not self._attn or self._rope_moved():
            self._bind(attn)
        dec = meta.decode
        if not self._ok or dec.pos.shape[0] != m or meta.blocks.shape[0] != m:
            return None
        # The kernel reads these as dense arrays (build_metadata's are; anything else is copied).
        ids = input_ids if input_ids.is_contiguous() else input_ids.contiguous()
        if self.lookup is not None:  # the step's embedding rows from the blocks, read at ids 0 .. m - 1
            self.lookup.lookup(ids, out=self.rows[:m])
            ids = self.iota[:m]
        pos = dec.pos if dec.pos.is_contiguous() else dec.pos.contiguous()
        tables = dec.tables if dec.tables.is_contiguous() else dec.tables.contiguous()
        out = torch.empty(m, self.C, dtype=self.dtype)
        s = self._step
        s.M, s.max_blocks = m, tables.shape[1]
        s.ids, s.pos, s.tables, s.out = ids.data_ptr(), pos.data_ptr(), tables.data_ptr(), out.data_ptr()
        s.blocks, s.offsets = meta.blocks.data_ptr(), meta.offsets.data_ptr()
        s.l0 = 0
        if self.lib.decode_layers(self.code, ctypes.byref(s)) != 0:
            return None  # refused before touching anything (a position outside the rope table: eager raises)
        while s.stopped >= 0:  # a mixture layer: h + mlp(post_attention_layernorm(h)), as DecoderLayer
            x, xn = self._scratch[0][:m], self._scratch[1][:m]
            x.add_(self.mixtures[s.stopped](xn))
            s.l0 = s.stopped + 1
            if self.lib.decode_layers(self.code, ctypes.byref(s)) != 0:  # the checks of the first call again
                raise RuntimeError(f"fused decode step refused layers {s.l0}.. after computing the ones before")
        self.calls += 1
        return out


def _is_mixture(mlp: nn.Module) -> bool:
    """A mixture-of-experts feed-forward (workers/models/moe.py SparseMoE; GPT-OSS's router and
    stacked experts): its own module runs between the step's calls."""
    return callable(getattr(mlp, "experts_forward", None)) or hasattr(getattr(mlp, "router", None), "weight")


def embed_dtype(model: nn.Module) -> torch.dtype:
    """The model dtype its embedding holds (a GgufEmbedding says it; an nn.Embedding's weight has it)."""
    emb = model.embed_tokens
    return emb.dtype if isinstance(getattr(emb, "dtype", None), torch.dtype) else emb.weight.dtype


def _vec(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().contiguous()


def _norm(w: torch.Tensor, gemma: bool) -> torch.Tensor:
    """A norm's weight as the kernel reads it: Gemma's as fp32 1 + w (rms_row's w1), else as is."""
    return one_plus(w) if gemma else _vec(w)


def _blocks(sel: slice, n: int) -> tuple[int, int] | None:
    """The 16-channel blocks [b0, b1) holding output rows ``sel`` of an n-row layer in the kernel's
    layout, or None where the rows do not fall on block edges (then only a copy serves)."""
    start, stop = sel.start or 0, n if sel.stop is None else sel.stop
    return (start // 16, -(-stop // 16)) if start % 16 == 0 and (stop % 16 == 0 or stop == n) else None


def _matrix(mod: nn.Module, dtype: torch.dtype, rows: slice | None = None, w16: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor | None] | CParts | None:
    """(packed weight, scales or None) of a plain, a KernelLinear or an int8 (CPU kernel) linear,
    or of the output rows ``rows`` of it; None for anything else. A layer that keeps this layout
    already is shared, not copied, where the rows fall on its 16-channel blocks. ``w16``: the
    step computes in fp32 over bf16 weights (decode_layers' dtype 2), and reads only those."""
    sel = rows if rows is not None else slice(None)
    if isinstance(mod, GgufLinear):  # the file's blocks, read in place (ggufCompute: native)
        return None if w16 or mod.lib.isa < 1 else c_parts(mod, rows, dtype)
    if isinstance(mod, nn.Linear):
        return None if w16 else (pack(mod.weight[sel]), None)
    if isinstance(mod, KernelLinear):  # AMX CPUs (amx_linears), bf16 weights of fp32 models (bf16_weight_linears)
        if mod.packed.dtype != (torch.bfloat16 if w16 else dtype):
            return None
        blocks = _blocks(sel, mod.out_features)
        return (mod.packed[blocks[0]:blocks[1]] if blocks else pack(mod.plain()[sel])), None
    if not isinstance(mod, Int8Linear) or mod.kernel.transposed or w16:
        return None
    state = mod.packed_state
    blocks = _blocks(sel, mod.out_features)
    if "scale16" in state and blocks:
        b0, b1 = blocks
        return state["q"][b0:b1], state["scale16"][b0 * 16:b1 * 16]
    q = mod.kernel.plain(state)
    return (pack(q[sel]), pack_scales(mod.scale[sel])) if q.dtype == torch.int8 else None


def _copy_bytes(model: nn.Module) -> int:
    """What a copy of the plain linear layers would take (before packing them)."""
    return sum(m.weight.numel() * m.weight.element_size() for layer in model.layers
               for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, getattr(layer.mlp, "gate_up_proj", None),
                         getattr(layer.mlp, "down_proj", None))
               if isinstance(m, nn.Linear))


def _collect(model: nn.Module, w16: bool = False) -> tuple[list[dict], str | None, int]:
    """Each layer's tensors as the kernel reads them, why not (or None), and the bytes of its own
    (not shared with the model's layers: int8 and KernelLinear layers keep this layout already).
    ``w16``: every linear must be a KernelLinear over bf16 weights of this fp32 model."""
    weights: list[dict] = []
    dt = embed_dtype(model)
    gemma = getattr(model.args, "gemma", None) is not None
    for layer in model.layers:
        a, f = layer.self_attn, layer.mlp
        mixture = _is_mixture(f)
        i = 0 if mixture else f.intermediate_size
        mats = {"qkv": _matrix(a.qkv_proj, dt, None, w16), "o": _matrix(a.o_proj, dt, None, w16)}
        if not mixture:  # a mixture of experts runs its own module between the step's calls
            mats.update(gate=_matrix(f.gate_up_proj, dt, slice(0, i), w16),
                        up=_matrix(f.gate_up_proj, dt, slice(i, 2 * i), w16), down=_matrix(f.down_proj, dt, None, w16))
        if any(m is None for m in mats.values()):
            return [], "linear layers of a kind it does not read", 0
        gub = None if mixture else f.gate_up_proj.bias
        # Gemma's four norms: before attention, after it, before the feed-forward (the kernel's
        # post_norm, Llama's post_attention_layernorm) and after it
        pre_ff = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
        w = {"in_norm": _norm(layer.input_layernorm.weight, gemma), "post_norm": _norm(pre_ff.weight, gemma),
             "qkv_b": _vec(a.qkv_proj.bias), "o_b": _vec(a.o_proj.bias),
             "down_b": None if mixture else _vec(f.down_proj.bias),
             "gate_b": None if gub is None else _vec(gub[:i]), "up_b": None if gub is None else _vec(gub[i:])}
        if gemma:
            w["attn_out_norm"] = _norm(layer.post_attention_layernorm.weight, gemma)
            w["ff_out_norm"] = _norm(layer.post_feedforward_layernorm.weight, gemma)
        if getattr(a, "sinks", None) is not None:  # GPT-OSS: a sink logit per head in each softmax, fp32
            w["sinks"] = a.sinks.detach().to(torch.float32).contiguous()
        if getattr(a, "q_norm", None) is not None:  # Qwen3, Gemma 3: per head, before rope
            w["q_norm"], w["k_norm"] = _norm(a.q_norm.weight, gemma), _norm(a.k_norm.weight, gemma)
        for name, m in mats.items():
            if isinstance(m, CParts):
                w[f"{name}_g"] = m
            else:
                w[f"{name}_w"], w[f"{name}_s"] = m
        weights.append(w)
    shared = {t.untyped_storage().data_ptr() for t in model.buffers()} | {
        m.packed.untyped_storage().data_ptr() for m in model.modules() if isinstance(m, KernelLinear)}
    size = sum(t.numel() * t.element_size() for d in weights for k, t in d.items()
               if t is not None and k[-2:] in ("_w", "_s") and t.untyped_storage().data_ptr() not in shared)
    return weights, None, size


def attach(model: nn.Module) -> FusedDecode | None:
    """Give ``model`` a ``fast_decode`` before its linears are packed (it keeps their plain
    weights); None, with the reason logged, when the model or the settings rule it out."""
    if not settings.cpu().fused_decode:
        return None
    lib = cpu_kernels.load()
    try:
        max_rows, budget_mb = rows_limit(), budget_limit_mb()
    except ValueError as e:  # logged, the eager path stays on (as a bad isa does)
        log.warning("fused decode kernel not used: %s", e)
        return None
    if max_rows < 1:
        return None
    why = None
    args = getattr(model, "args", None)
    dtype = embed_dtype(model) if hasattr(model, "embed_tokens") else None
    code = cpu_kernels.dtype_code(lib, dtype) if lib is not None else None
    if lib is None:
        why = "no C kernels"
    elif args is None or getattr(model, "tp", None) is not None:
        why = "a tensor-parallel rank"
    elif getattr(model, "fused_decode_refusal", None):  # a model the kernel does not compute (DeepSeek's MLA)
        why = model.fused_decode_refusal
    elif code not in (0, 1):
        why = f"{dtype} (fp32 and bf16 only)"
    elif getattr(args, "moe", None) is not None and not all(_is_mixture(layer.mlp) or hasattr(layer.mlp, "gate_up_proj")
                                                            for layer in model.layers):
        why = "feed-forward layers of a kind it does not read"
    elif args.head_dim > 256 or args.head_dim % 2 or args.num_attention_heads // args.num_key_value_heads > 16:
        why = "head shapes beyond the kernel's buffers"
    elif getattr(getattr(model, "rope", None), "interleaved", False):
        why = "interleaved rotary pairs (GLM-4's layout)"
    weights: list[dict] = []
    size = 0
    if why is None:
        budget = budget_mb * (1 << 20)
        # AMX CPUs (and AVX512-BF16 ones): rather than a copy beyond the budget, the linears themselves
        # move to the kernels' layout
        if code == 1 and _copy_bytes(model) > budget and (cpu_linear.amx_linears(model)
                                                          or cpu_linear.dpbf16_linears(model)):
            log.info("fused decode kernel: instead of a copy beyond cpuTuning.fusedDecodeMb (%.0f MiB), the linears "
                     "keep their one copy in its layout (%s for prompts too)", budget_mb,
                     "AMX tiles" if getattr(lib, "amx_rows", 0) else "AVX512-BF16 products")
        # An fp32 model whose linears keep bf16 weights (cpu_linear.bf16_weight_linears): the kernel's
        # fp32 step over those same weights, code 2
        w16 = code == 0 and getattr(lib, "has_w16a32", False) and any(
            isinstance(m, KernelLinear) and m.packed.dtype == torch.bfloat16 for m in model.modules())
        weights, why, size = _collect(model, w16)
        code = 2 if w16 else code
        if why is None and size > budget:
            why = (f"its linear weights ({size / (1 << 20):.0f} MiB) exceed cpuTuning.fusedDecodeMb "
                   f"({budget / (1 << 20):.0f})")
    if why is not None:
        log.info("fused decode kernel not used: %s", why)
        return None
    fused = FusedDecode(model, lib, code, weights, max_rows)
    model.fast_decode = fused
    int8 = weights[0].get("qkv_s") is not None
    blocks = sum(isinstance(v, CParts) for w in weights for v in w.values())
    log.info("fused decode kernel on for decode steps of up to %d sequences (%s products; %s)%s", fused.max_rows,
             f"GGUF block ({blocks} matrices, {gguf_kernels.ISA_NAMES[gguf_kernels.load().isa]})" if blocks
             else "int8 weight" if int8 else "AMX-BF16" if getattr(lib, "amx_rows", 0) and code == 1
             else "AVX512-BF16" if lib.has_dpbf16 and code == 1
             else "bf16 weight, fp32 row" if code == 2 else "fp32-accumulated",
             f"keeps a {size / (1 << 20):.1f} MiB copy of the layer weights" if size
             else "reads the layers' own weights, no copy",
             f"; {len(fused.mixtures)} mixture-of-experts layers run their own modules between its calls"
             if fused.mixtures else "")
    return fused
