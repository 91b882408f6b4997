"""Read a GGUF file's tensors into a DecoderLM: dequantised at load, one piece at a time.

``workers.models.loader.load_model`` builds the model and maps every Hugging Face tensor name to
where it goes (``Slot``: a parameter's rows, a tensor-parallel rank's slice); for a GGUF model
view it calls ``load_gguf`` instead of reading safetensors. For each tensor of the file:

- only the rows (and, for a row-parallel weight, the columns) this rank holds are read from the
  memory-mapped file; a column range on ggml block boundaries is cut from the raw bytes, any
  other (a split that does not fall on blocks) is dequantised a row chunk at a time and cut;
- the bytes are dequantised by ``gguf.quants.dequantize`` (llama.cpp's own Python decoders; no
  block format is decoded here) to fp32, at most ``CHUNK_VALUES`` values at a time, and copied
  into the parameter, cast to the model dtype; the file's pages are then dropped from this
  process (``madvise``), so the load's peak is the final weights plus one chunk;
- llama-architecture files (Llama, Mistral) hold q and k with llama.cpp's rope row order
  (``convert_hf_to_gguf.py`` ``LlamaModel.permute``): each head's rows are put back in Hugging
  Face order, as transformers' GGUF loader does (``_reverse_permute_weights``);
- with an ``int8`` target (``quantize: w8a16``) the linear layers go straight to int8: each
  chunk's fp32 rows are quantised per output channel as ``workers/backends/int8.py`` does after a
  load (so the result equals dequantise-then-quantise exactly: the scales are per row), and the
  model-dtype matrix is never filled. A Q8_0 tensor's own int8 values cannot be kept as they
  are: Q8_0 has one scale per 32 inputs, the int8 layout one per output channel; they are kept
  exactly in a row whose blocks share one scale, and requantised to the row's largest otherwise;
- with a ``native`` target (the CPU's ``cpuTuning.ggufCompute: native``,
  workers/backends/gguf_linear.py) every linear whose tensors are all of a block type the target
  covers, read whole (no tensor-parallel split), keeps the file's blocks: each tensor's rows are
  copied as bytes (q/k of a llama-architecture file put back in Hugging Face row order, the same
  row permutation on whole rows of blocks) and the layer is replaced by the target's, the
  model-dtype matrix never written; a tied LM head also gets a native copy of the embedding's
  blocks, and the embedding then looks its rows up from them (``GgufTarget.embedding``; its dense
  matrix never written either).
"""
from __future__ import annotations

import logging
import mmap
import time
from typing import Any, Protocol

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from mindie.runtime import heap

from .gguf_file import GgufFile
from .gguf_hybrid import v_order, value_map

__all__ = ["CHUNK_VALUES", "GgufTarget", "Int8Target", "load_gguf"]

log = logging.getLogger("workers.models")

# Values dequantised at once (fp32): 8 MiB, the transient on top of the final weights.
CHUNK_VALUES = 1 << 21
_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
_PAGE = mmap.PAGESIZE
# Architectures whose norm weights llama.cpp's converter writes as 1 + w (Gemma's (1 + w) RMSNorm)
NORM_PLUS_ONE = ("gemma2", "gemma3")


class Int8Target(Protocol):
    """workers/backends/int8.py ``Int8Target`` (this layer cannot import the backends)."""

    def quantize_(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def linear(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
               device: torch.device) -> torch.nn.Module: ...

    def loaded(self, count: int) -> None: ...


class GgufTarget(Protocol):
    """workers/backends/gguf_linear.py ``NativeTarget``: linears computed from the file's blocks."""

    def covers(self, type_id: int, in_features: int) -> bool: ...

    def linear(self, parts: list[tuple[int, int, torch.Tensor]], in_features: int, out_features: int,
               bias: torch.Tensor | None) -> torch.nn.Module: ...

    def embedding(self, head: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module | None:
        """The token embedding looked up from its tied head's blocks, or None (the dense copy)."""

    def embedding_blocks(self, parts: list[tuple[int, int, torch.Tensor]], num_embeddings: int,
                         embedding_dim: int, dtype: torch.dtype) -> torch.nn.Module:
        """An untied token embedding looked up from its own tensor's blocks."""

    def loaded(self, types: set[str]) -> None: ...


def _release(g: GgufFile, offset: int, nbytes: int) -> None:
    """Drop the file's pages of one tensor from this process's memory (they were read; the page
    cache keeps them). Best effort: a failure only costs resident memory."""
    m = getattr(getattr(g._reader, "_map", None), "_mmap", None)
    if m is None or nbytes <= 0:
        return
    start = offset - offset % _PAGE
    try:
        m.madvise(mmap.MADV_DONTNEED, start, min(offset + nbytes, len(m)) - start)
    except (OSError, ValueError, AttributeError):
        pass


class _Reader:
    """The dequantised values of one GGUF tensor, in row chunks, for a range of rows/columns."""

    def __init__(self, t: Any, unpermute: bool = False, head_dim: int = 0):
        """``unpermute``: q or k of a llama-architecture file (rows in llama.cpp's rope order)."""
        self.t = t
        self.bs, self.ts = t.block
        self.unpermute = unpermute
        self.head_dim = head_dim

    def chunks(self, r0: int, r1: int, c0: int | None = None, c1: int | None = None):
        """(first row offset from r0, fp32 ndarray) pieces covering rows r0..r1 (columns c0..c1)."""
        t = self.t
        data = t.data
        if len(t.shape) == 1:  # norms, biases: F32 in practice; a block type is dequantised whole, then cut
            if t.type in _FLOAT_TYPES:
                yield 0, self._values(data[r0:r1])
            else:
                yield 0, self._values(data)[r0:r1]
            return
        cols = t.shape[1] if c0 is None else c1 - c0
        unit = self.head_dim if self.unpermute else 1
        step = max(unit, (CHUNK_VALUES // max(cols, 1)) // unit * unit)
        for a in range(r0, r1, step):
            b = min(a + step, r1)
            raw = data[a:b]
            if c0 is None:
                yield a - r0, self._values(raw)
            elif t.type in _FLOAT_TYPES:  # mapped as a float array
                yield a - r0, self._values(raw[:, c0:c1])
            elif c0 % self.bs == 0 and c1 % self.bs == 0:  # whole blocks (BF16: 1 value): cut the bytes
                yield a - r0, self._values(raw[:, c0 // self.bs * self.ts:c1 // self.bs * self.ts])
            else:  # the split falls inside blocks: the whole rows, then the columns
                yield a - r0, self._values(raw)[:, c0:c1]

    def _values(self, raw: np.ndarray) -> np.ndarray:
        v = dequantize(raw, self.t.type)
        if self.unpermute:  # llama.cpp's rope order -> Hugging Face's, head by head (whole heads only)
            d = self.head_dim
            v = v.reshape(-1, d // 2, 2, *v.shape[1:]).swapaxes(1, 2).reshape(v.shape)
        return v


def load_gguf(model: torch.nn.Module, slots: dict, g: GgufFile, entries: list[tuple[str, str]], *,
              shard: Any = None, int8: Int8Target | None = None, native: GgufTarget | None = None) -> int:
    """Fill ``model`` (built, its parameters allocated) from ``g``: ``entries`` are (GGUF name, HF
    name) as ``gguf_file.plan_tensors`` checked them, ``slots`` the loader's HF name -> Slot. With
    ``int8``: the linear layers are replaced by int8 ones, quantised chunk by chunk; with
    ``native`` (and no ``int8``): the linears it covers keep the file's blocks. Returns the bytes
    of the file read."""
    t0 = time.monotonic()
    args = model.args
    permute = g.arch == "llama"  # llama.cpp permutes q/k of the llama architecture only (Llama, Mistral)
    dtype = model.embed_tokens.weight.dtype
    device = model.embed_tokens.weight.device
    int8_of = _int8_buffers(model, shard) if int8 is not None else {}
    native_of = _native_plan(model, slots, g, entries, native) if native is not None and int8 is None else {}
    nbytes = 0
    with torch.no_grad():
        for gname, entry in entries:
            hf, _, dst = entry.partition("#")  # "#ROW": this part's rows go from the slot's row ROW on
            slot = slots[hf]
            if dst:
                slot = slot._replace(start=slot.start + int(dst), rows=g.ref(gname).shape[0])
            t = g.ref(gname)
            if slot.zero:
                slot.param[slot.start:slot.start + slot.rows].zero_()
                continue
            if not slot.rows:
                continue
            qk = permute and (".attn_q." in gname or ".attn_k." in gname)
            nat = native_of.get(id(slot.param)) or native_of.get(("expert", slot.param.data_ptr()))
            emb = native_of.get("head") or native_of.get("embed") if hf == "model.embed_tokens.weight" else None
            if nat is not None or emb is not None:
                part = _raw_rows(t, qk, args.head_dim)
                b = nat if nat is not None else emb
                b["parts"].append((slot.start, int(t.type), part))
                b["left"] -= part.shape[0]
                if b["left"] == 0:
                    _swap_native(model, b, native)
                    # the linear holds what it keeps (interleaved: its own copy): the rows read
                    # for it go now, and their pages back to the system
                    b["types"], b["parts"] = {t for _, t, _ in b["parts"]}, []
                    heap.trim()
                if nat is not None or b.get("lookup"):  # the weight is never written (its pages never touched)
                    nbytes += t.nbytes
                    _release(g, t.offset, t.nbytes)
                    continue
            reader = _Reader(t, unpermute=qk, head_dim=args.head_dim)
            n_rows = t.shape[0]
            if slot.dim is None:
                r0, r1, c0, c1 = 0, n_rows, None, None
            elif slot.dim == 0:
                r0, r1, c0, c1 = slot.src_start, slot.src_start + slot.rows, None, None
            else:  # row-parallel: this rank's input columns, every row
                r0, r1, c0, c1 = 0, n_rows, slot.src_start, slot.src_start + slot.param.shape[1]
            target = int8_of.get(id(slot.param))
            # llama.cpp stores Gemma's norm weights as 1 + w: back to w in fp32, as transformers' GGUF loader
            shift = g.arch in NORM_PLUS_ONE and gname.endswith("norm.weight")
            undo = value_map(g.arch, gname)  # what else llama.cpp's converter rewrote (gguf_hybrid.py)
            rows_of, cols_of = v_order(g, gname)  # Qwen3.5's value heads, reordered by the converter
            chunks = (reader.chunks(r0, r1, c0, c1) if rows_of is None and cols_of is None else
                      _reordered(reader, n_rows, r0, r1, c0, c1, rows_of, cols_of))
            for off, values in chunks:
                if shift:
                    values = np.asarray(values, dtype=np.float32) - np.float32(1.0)
                if undo is not None:
                    values = undo(values)
                if not values.flags.writeable or not values.flags.c_contiguous:  # F32: a view of the read-only map
                    values = np.array(values, dtype=np.float32, order="C")
                src = torch.from_numpy(values)  # fp32, this chunk's own (quantize_ overwrites it)
                a = slot.start + off
                if target is None:
                    slot.param[a:a + src.shape[0]].copy_(src)
                    if hf == "model.embed_tokens.weight" and "head" in int8_of:  # the tied head's int8 copy
                        target = int8_of["head"]
                if target is not None:  # straight to int8, per output channel (rows are independent)
                    q, scale = int8.quantize_(src)
                    target["q"][a:a + len(q)].copy_(q)
                    target["scale"][a:a + len(q)].copy_(scale)
                    target["left"] -= len(q)
                    if target["left"] == 0 and "lin" in target:  # complete: packed now, the buffer freed
                        _swap_one(target, int8, dtype, device)
                    target = int8_of.get(id(slot.param))
            # what this rank read: its rows (and columns) of the tensor
            part = t.nbytes * (r1 - r0) // max(n_rows, 1)
            nbytes += part if c0 is None else part * (c1 - c0) // max(t.shape[1], 1)
            _release(g, t.offset, t.nbytes)
            # the chunks' temporaries raise glibc's dynamic mmap threshold, after which freed blocks stay
            # in the heap, resident: trimming after each tensor keeps a w8a16 load at 1.4x its weights
            # instead of 2.2x (SmolLM2; docs/performance.md, "GGUF load")
            heap.trim()
        if int8 is not None:
            int8.loaded(_swap_int8(model, int8_of, int8, dtype, device))
        if native is not None:
            left = [k for k, b in native_of.items() if b.get("left")]
            if left:  # the plan and the entries disagree: never silently half a layer
                raise RuntimeError(f"native GGUF load: {len(left)} linear layers did not get all their rows")
            for staged in native_of.get("moe", {}).values():  # each layer's experts, whole
                staged["moe"].install_experts(staged["13"], staged["2"], "gguf")
            native.loaded({GGMLQuantizationType(t).name for k, b in native_of.items() if k not in ("embed", "moe")
                           for t in b.get("types", ())}, dtype)
    log.info("read %s: %.1f MiB of %s tensors, %s to %s%s in %.2f s", g.path.name, nbytes / 2**20,
             "/".join(sorted({g.ref(n).type.name for n, _ in entries})),
             (f"{len(native_of) - ('embed' in native_of) - ('moe' in native_of)} linears kept in their blocks"
              + (f" ({2 * sum(m['moe'].shard.experts for m in native_of['moe'].values())} of them the experts of "
                 f"{len(native_of['moe'])} mixture layers)" if "moe" in native_of else "")
              + (" (the embedding read from the head's)" if native_of.get("head", {}).get("lookup") else
                 " (the embedding read from its own)" if native_of.get("embed", {}).get("lookup") else "")
              + ", the rest dequantised") if native_of else "dequantised",
             str(dtype).removeprefix("torch."), " (linears int8)" if int8 is not None else "", time.monotonic() - t0)
    return nbytes


def _reordered(reader: _Reader, n_rows: int, r0: int, r1: int, c0: int | None, c1: int | None,
               rows_of: np.ndarray | None, cols_of: np.ndarray | None):
    """One chunk: Hugging Face rows r0..r1 (columns c0..c1) of a tensor whose rows / columns the
    converter permuted (``rows_of`` / ``cols_of``: the file's index of each HF one), from the
    whole tensor dequantised (a Gated DeltaNet projection: small beside the model)."""
    values = np.concatenate([v for _, v in reader.chunks(0, n_rows)], axis=0)
    values = values[rows_of[r0:r1]] if rows_of is not None else values[r0:r1]
    if cols_of is not None:
        values = values[:, cols_of if c0 is None else cols_of[c0:c1]]
    elif c0 is not None:
        values = values[:, c0:c1]
    yield 0, np.ascontiguousarray(values, dtype=np.float32)


def _int8_linears(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str, torch.nn.Linear]]:
    """Every linear ``quantize_model`` (workers/backends/int8.py) quantises: the decoder layers'
    and the LM head; name -> (parent, attribute, module)."""
    out = {}
    for parent_name, parent in model.named_modules():
        if not (parent_name == "layers" or parent_name.startswith("layers.") or parent_name == ""):
            continue
        for name, child in parent.named_children():
            if name == "shared_expert_gate":  # [1, H]: kept exact, as quantize_model keeps it
                continue
            if isinstance(child, torch.nn.Linear) and (parent_name or name == "lm_head"):
                out[f"{parent_name}.{name}" if parent_name else name] = (parent, name, child)
    return out


def _int8_buffers(model: torch.nn.Module, shard: Any) -> dict:
    """id(weight) -> {"q": int8 [N, K], "scale": fp32 [N], "left": rows still to come, "lin": the
    linear, "at": (parent, attribute)} for every linear to quantise, and "head" for a tied LM head
    (the embedding's int8 copy; a tensor-parallel rank's vocabulary padding rows stay zero)."""
    out: dict = {}
    for _, (parent, name, lin) in _int8_linears(model).items():
        n, k = lin.weight.shape  # every row is written: no zero fill
        out[id(lin.weight)] = {"q": torch.empty(n, k, dtype=torch.int8), "scale": torch.empty(n), "left": n,
                               "lin": lin, "at": (parent, name)}
    if model.lm_head is None:
        n, k = model.embed_tokens.weight.shape
        rows = shard.vocab_rows if shard is not None else n
        out["head"] = {"q": torch.zeros(n, k, dtype=torch.int8), "scale": torch.ones(n), "left": rows}
    return out


def _swap_one(b: dict, int8: Int8Target, dtype: torch.dtype, device: torch.device) -> None:
    """Replace a completed linear by its int8 layer, and let go of its buffer and model-dtype weight."""
    parent, name = b.pop("at")
    lin = b.pop("lin")
    # The int8 layer's bias is a detached view of lin.bias (the same storage): a bias the file
    # holds after the weight still lands in it.
    setattr(parent, name, int8.linear(b.pop("q"), b.pop("scale"), lin.bias, dtype, device))


def _swap_int8(model: torch.nn.Module, bufs: dict, int8: Int8Target, dtype: torch.dtype, device: torch.device) -> int:
    """The tied head's int8 layer; every linear must have been swapped as it completed."""
    count = 0
    for key, b in bufs.items():
        if key == "head":
            model.logits_linear = int8.linear(b["q"], b["scale"], None, dtype, device)
        elif "lin" in b:  # a linear whose rows did not all come: the loader and checkpoint.py disagree
            raise RuntimeError(f"int8 load: {b['left']} rows of a linear layer were not read")
        count += 1
    for mod in model.modules():  # a mixture of experts' stacked experts: quantised once loaded, per expert
        if callable(getattr(mod, "quantize_experts", None)):
            count += mod.quantize_experts(lambda w: int8.linear(*int8.quantize_(w.detach().float().clone()), None,
                                                                dtype, device))
    model.int8_at_load = True  # workers/engine/assembly.py: nothing left for quantize_model
    return count


def _expert_views(model: torch.nn.Module) -> dict[int, tuple[Any, str, int]]:
    """The data pointer of each local expert's stacked rows (``w13[e]``, ``w2[e]`` of every
    mixture-of-experts layer still holding them) -> (layer, "13" or "2", e)."""
    out: dict[int, tuple[Any, str, int]] = {}
    for mod in model.modules():
        if callable(getattr(mod, "install_experts", None)) and mod.lin13 is None and mod.w13.numel():
            for e in range(mod.shard.experts):
                out[mod.w13[e].data_ptr()] = (mod, "13", e)
                out[mod.w2[e].data_ptr()] = (mod, "2", e)
    return out


def _native_plan(model: torch.nn.Module, slots: dict, g: GgufFile, entries: list[tuple[str, str]],
                 native: GgufTarget) -> dict:
    """id(weight) -> {"parts": [], "left": rows, "lin", "at"} for every linear whose GGUF tensors
    the target covers whole, "head" for a tied LM head whose embedding it covers, "embed" for an
    untied embedding it covers (looked up from its own blocks; an F16/BF16/F32 one stays dense),
    ("expert", data pointer) -> {"parts", "left", "expert": (layer, "13" / "2", e)} for each expert's
    rows of a mixture-of-experts layer whose experts it covers all, and "moe" -> the staging of
    those layers' expert linears (installed once all came: load_gguf)."""
    linears = {id(lin.weight): (parent, name, lin) for parent, name, lin in _int8_linears(model).values()}
    experts = _expert_views(model)
    parts: dict[Any, list] = {}
    embed = None
    for gname, entry in entries:
        hf, _, dst = entry.partition("#")
        slot, t = slots[hf], g.ref(gname)
        if dst or any(o is not None for o in v_order(g, gname)):  # a row range, or rows permuted: dequantised
            continue
        if id(slot.param) in linears:
            parts.setdefault(id(slot.param), []).append((slot, t))
        elif slot.rows and slot.param.data_ptr() in experts:  # gate and up of one expert share its w13 rows
            parts.setdefault(("expert", slot.param.data_ptr()), []).append((slot, t))
        elif hf == "model.embed_tokens.weight":
            embed = (slot, t)

    def whole(slot, t) -> bool:
        return (slot.dim is None and not slot.zero and len(t.shape) == 2 and slot.rows == t.shape[0]
                and native.covers(int(t.type), t.shape[1]))

    plan: dict = {}
    layers: dict[int, dict] = {}  # a mixture's experts: kept in blocks all of them, or none
    for key, found in parts.items():
        if isinstance(key, tuple):
            moe, kind, e = experts[key[1]]
            rows = 2 * moe.shard.inter if kind == "13" else moe.hidden
            ok = all(whole(s, t) for s, t in found) and sum(s.rows for s, _ in found) == rows
            staged = layers.setdefault(id(moe), {"moe": moe, "ok": True, "keys": []})
            staged["ok"] &= ok
            staged["keys"].append((key, kind, e, rows, found[0][1].shape[1]))
            continue
        parent, name, lin = linears[key]
        if all(whole(s, t) for s, t in found) and sum(s.rows for s, _ in found) == lin.out_features:
            plan[key] = {"parts": [], "left": lin.out_features, "lin": lin, "at": (parent, name)}
    for staged in layers.values():
        moe = staged["moe"]
        if not staged["ok"] or len(staged["keys"]) != 2 * moe.shard.experts:
            continue
        n = moe.shard.experts
        plan.setdefault("moe", {})[id(moe)] = out = {"moe": moe, "13": [None] * n, "2": [None] * n}
        for key, kind, e, rows, cols in staged["keys"]:
            plan[key] = {"parts": [], "left": rows, "expert": (out, kind, e, cols)}
    if embed is not None and whole(*embed) and getattr(model, "tp", None) is None:
        key = "head" if model.lm_head is None else "embed"
        plan[key] = {"parts": [], "left": embed[1].shape[0], "embed": model.embed_tokens.weight}
    return plan


def _raw_rows(t: Any, unpermute: bool, head_dim: int) -> torch.Tensor:
    """A tensor's blocks as uint8 [rows, row bytes], copied out of the file's map; q/k of a
    llama-architecture file with each head's rows back in Hugging Face order (as _Reader does to
    the values: a permutation of whole rows)."""
    raw = np.asarray(t.data).view(np.uint8).reshape(t.shape[0], -1)
    if unpermute:
        raw = raw.reshape(-1, head_dim // 2, 2, raw.shape[1]).swapaxes(1, 2).reshape(raw.shape)
    return torch.from_numpy(np.array(raw, order="C"))


def _swap_native(model: torch.nn.Module, b: dict, native: GgufTarget) -> None:
    """Replace a linear whose blocks all came by the target's (the tied head: model.logits_linear;
    an untied embedding: a lookup from its blocks; an expert's rows: its linear, staged for its
    layer's install_experts)."""
    if "expert" in b:
        staged, kind, e, cols = b["expert"]
        rows = sum(p.shape[0] for _, _, p in b["parts"])
        staged[kind][e] = native.linear(b["parts"], cols, rows, None)
        return
    if "embed" in b and model.lm_head is not None:  # untied: the embedding alone
        vocab, hidden = b["embed"].shape
        model.embed_tokens = native.embedding_blocks(b["parts"], vocab, hidden, b["embed"].dtype)
        b["lookup"] = True
        return
    if "embed" in b:
        vocab, hidden = b["embed"].shape
        model.logits_linear = native.linear(b["parts"], hidden, vocab, None)
        lookup = native.embedding(model.logits_linear, b["embed"].dtype)
        if lookup is not None:  # the embedding reads the head's blocks: its dense matrix is never written
            model.embed_tokens = lookup
            b["lookup"] = True
        return
    parent, name = b["at"]
    lin = b["lin"]
    setattr(parent, name, native.linear(b["parts"], lin.in_features, lin.out_features, lin.bias))
