"""GGUF checkpoints (llama.cpp's one-file format), read with the ``gguf`` package; torch-free.

A GGUF file holds the model's hyper-parameters and tokenizer as metadata and its tensors, under
llama.cpp's names, in one of ggml's types. This module is everything about such a file that needs
no torch:

- ``open_gguf(path)``: its header, read with the ``gguf`` package's own reader, with the parsing
  of the large metadata arrays (the tokenizer's 50-150k strings, which only the launch step's
  tokenizer conversion reads, through transformers) skipped: 0.05 s instead of 4 s for SmolLM2;
  a truncated or corrupt file raises ``GgufError`` saying so;
- ``hf_config(g)``: the Hugging Face ``config.json`` / ``generation_config.json`` the metadata
  describes (architectures llama, mistral, qwen2, qwen3, phi3, glm4, gemma2, gemma3, the
  mixtures of experts qwen2moe, qwen3moe, glm4moe: gguf_moe.py, and the hybrid qwen3next,
  qwen35, qwen35moe: gguf_hybrid.py; anything else refused, named;
  Gemma's keys as llama.cpp reads them: ``_gemma_keys``);
- ``plan_tensors(g, expected)``: every tensor the model needs (by Hugging Face name, from
  ``workers.models.checkpoint.expected_tensors``) found under its llama.cpp name (the ``gguf``
  package's own name table; a mixture of experts' per-expert tensors as parts of llama.cpp's
  stacked ones, ``GgufFile.ref``), with the shape the config implies and a type the loader
  dequantises (``LOADABLE_TYPES``); missing, unexpected, mis-shaped or unsupported tensors named;
Finding the file without reading it (``find_gguf``, the model view's marker, ``view_source``,
``GgufError``) is workers/models/gguf_paths.py's, which imports neither gguf nor numpy. The loader (workers/models/gguf_loader.py) reads the tensors, dequantised with
``gguf.quants.dequantize``; the launch step (workers/prepare.py) makes the view.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, MODEL_ARCH_NAMES
from gguf import get_tensor_name_map

from .gguf_paths import GGUF_MAGIC, GgufError
from .gguf_hybrid import HYBRID_ARCHS, hybrid_keys, linear_attn_parts
from .gguf_moe import MOE_ARCHS, expert_part, moe_keys, mtp_layers
from .gguf_variant import EXTRA_TENSORS, variant_keys
from .gemma_chat import END_OF_TURN

__all__ = ["GgufFile", "LOADABLE_TYPES", "SUPPORTED_ARCHS", "TensorRef", "hf_config", "open_gguf", "plan_tensors"]

T = GGMLQuantizationType
# The tensor types the loader dequantises (gguf.quants.dequantize has every one of them).
LOADABLE_TYPES: tuple[GGMLQuantizationType, ...] = (
    T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K)

# general.architecture -> the Hugging Face model_type and class. llama.cpp writes Mistral models
# (MistralForCausalLM) as "llama" (``mistral_of`` tells them apart).
SUPPORTED_ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    # partial rotary, LongRoPE, fused qkv / gate_up, GLM-4's extra norms: gguf_variant.py
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "glm4": ("glm4", "Glm4ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    # mixtures of experts: stacked experts, shared experts, routers (gguf_moe.py)
    **MOE_ARCHS,
    # Gated DeltaNet layers beside gated attention, Qwen2-MoE's experts (gguf_hybrid.py)
    **HYBRID_ARCHS,
}
# Llama 3.1+'s rope scaling, stored as a tensor; read into the config, not loaded as a weight.
ROPE_FREQS = "rope_freqs.weight"


class _HeaderReader(GGUFReader):
    """``gguf.GGUFReader`` with two shortcuts for a fast header read; the tensors, the scalar
    metadata and the file layout are its own:

    - it parses through a plain ndarray view of its memory map, not the ``np.memmap`` subclass
      (whose per-slice bookkeeping was 60 % of the time);
    - metadata arrays are skipped, not parsed element by element (one numpy view per element: 3 s
      for SmolLM2's 49152 tokens and 48900 merges); their fields keep their type and length
      (``array_length``) but no contents.
    """

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        if type(self.data) is np.memmap:  # the first read, in __init__: from now on a plain view of the map
            self._map = self.data
            self.data = self.data.view(np.ndarray)
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list, list]:
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, n, offs = int(raw_itype[0]), int(alen[0]), orig_offs + 12
        if itype == GGUFValueType.STRING:
            buf = self.data
            for _ in range(n):  # each string: a u64 length, then its bytes
                offs += 8 + int(buf[offs:offs + 8].view(np.uint64)[0])
        elif (np_type := self.gguf_scalar_to_np.get(GGUFValueType(itype))) is not None:
            offs += n * np.dtype(np_type).itemsize
        else:  # nested arrays: none in the files this serves; the reader's own (slow) parse
            return super()._get_field_parts(orig_offs, raw_type)
        if offs > len(self.data):
            raise ValueError(f"metadata array of {n} items runs past the end of the file")
        return offs - orig_offs, [raw_itype, alen], [], [GGUFValueType.ARRAY, GGUFValueType(itype)]

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        # A tensor the header places past the end of the file: say so (the reader's own error is
        # numpy's "cannot reshape array of size ...").
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            try:
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
            except (ValueError, KeyError):
                raise GgufError(f"tensor {bytes(name).decode(errors='replace')} has an unknown type number "
                                f"{int(raw_type[0])}") from None
            end = start_offs + int(offset[0]) + int(np.prod(dims, dtype=np.uint64)) * size // block
            if end > len(self.data):
                raise GgufError(f"truncated: tensor {bytes(name).decode(errors='replace')} ends at byte {end}, "
                                f"the file has {len(self.data)}")
        super()._build_tensors(start_offs, fields)


@dataclass(frozen=True)
class TensorRef:
    """One tensor of the file: its type, its shape in torch order ([out, in] for a matrix), and
    ``data``: its bytes as the reader maps them (rows x bytes-per-row for the block types, a float
    array for F32/F16), not read until used."""

    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray
    offset: int
    nbytes: int

    @property
    def block(self) -> tuple[int, int]:
        """(values per block, bytes per block) of its type (1, item size for the float types)."""
        return GGML_QUANT_SIZES[self.type]


class GgufFile:
    """A GGUF file's header: metadata (scalars and strings; arrays by length only) and tensors."""

    def __init__(self, path: Path, reader: GGUFReader):
        self.path = path
        self.size = path.stat().st_size
        self._reader = reader
        self.tensors: dict[str, TensorRef] = {}
        for t in reader.tensors:
            self.tensors[t.name] = TensorRef(t.name, t.tensor_type, tuple(int(d) for d in reversed(t.shape.tolist())),
                                             t.data, int(t.data_offset), int(t.n_bytes))

    def ref(self, name: str) -> TensorRef:
        """A tensor of the file by name, or a part of one (``plan_tensors`` names them): ``NAME@E``
        the E-th matrix of a stacked [E, rows, cols] tensor (one expert), ``NAME@E:A:B`` its rows
        A..B, ``NAME@rows:A:B`` rows A..B of a matrix, ``NAME@row`` a 1-D tensor as one row [1, n],
        ``NAME@unsqueeze1`` a [C, K] matrix as [C, 1, K]. A part's bytes are a view of the map."""
        t = self.tensors.get(name)
        if t is not None:
            return t
        base, _, spec = name.partition("@")
        t = self.tensors[base]
        if spec == "row":
            return TensorRef(name, t.type, (1, *t.shape), t.data.reshape(1, -1), t.offset, t.nbytes)
        if spec == "unsqueeze1":
            return TensorRef(name, t.type, (t.shape[0], 1, *t.shape[1:]), t.data.reshape(t.shape[0], 1, -1), t.offset,
                             t.nbytes)
        kind, *rows = spec.split(":")
        if kind == "rows":  # a row range of a matrix
            r0, r1 = int(rows[0]), int(rows[1])
            row_bytes = t.nbytes // t.shape[0]
            return TensorRef(name, t.type, (r1 - r0, *t.shape[1:]), t.data[r0:r1], t.offset + r0 * row_bytes,
                             (r1 - r0) * row_bytes)
        e = int(kind)
        per = t.nbytes // t.shape[0]
        r0, r1 = (int(rows[0]), int(rows[1])) if rows else (0, t.shape[1])
        row_bytes = per // t.shape[1]
        return TensorRef(name, t.type, (r1 - r0, *t.shape[2:]), t.data[e, r0:r1], t.offset + e * per + r0 * row_bytes,
                         (r1 - r0) * row_bytes)

    def get(self, key: str, default: Any = None) -> Any:
        """A scalar or string metadata value (``default`` when absent; arrays: see ``array_length``)."""
        field = self._reader.fields.get(key)
        if field is None or not field.types:
            return default
        if field.types[0] == GGUFValueType.ARRAY:
            if field.data:  # parsed (a nested array the fast reader left to gguf)
                return field.contents()
            return default
        return field.contents()

    def array(self, key: str) -> list | None:
        """A numeric metadata array's values (a per-layer list: the header read skips arrays'
        contents, so they are read here from the map); None when absent or not numeric."""
        field = self._reader.fields.get(key)
        if field is None or not field.types or field.types[0] != GGUFValueType.ARRAY:
            return None
        if field.data:
            return field.contents()
        np_type = self._reader.gguf_scalar_to_np.get(field.types[-1])
        if np_type is None:
            return None
        n = int(field.parts[-1][0])
        start = field.offset + 8 + len(field.parts[1]) + 4 + 12  # key length, key, value type, item type, count
        raw = np.asarray(self._reader.data[start:start + n * np.dtype(np_type).itemsize])
        return raw.view(np_type).tolist()

    def array_length(self, key: str) -> int | None:
        field = self._reader.fields.get(key)
        if field is None or not field.types or field.types[0] != GGUFValueType.ARRAY:
            return None
        return int(field.parts[4][0]) if not field.data else len(field.data)

    @property
    def arch(self) -> str:
        return str(self.get("general.architecture", ""))

    def arch_key(self, suffix: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{suffix}", default)


def open_gguf(path: str | os.PathLike[str]) -> GgufFile:
    """The header of the GGUF file at ``path`` (the tensors memory-mapped, none read); GgufError
    when it is not a readable GGUF file (truncated, corrupt, another format)."""
    p = Path(path)
    try:
        size = p.stat().st_size
    except OSError as e:
        raise GgufError(f"cannot read it: {e}") from None
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise GgufError(f"cannot read it: {e}") from None
    if magic != GGUF_MAGIC:
        raise GgufError(f"not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    try:
        try:
            reader: GGUFReader = _HeaderReader(p)
        except GgufError:
            raise
        except Exception:  # noqa: BLE001  (a gguf release whose internals the shortcuts no longer fit)
            reader = GGUFReader(p)  # the reader's own parse: slower, and its own error if the file is bad
    except GgufError:
        raise
    except (ValueError, IndexError, KeyError, OverflowError, TypeError) as e:
        # numpy's reshape/index errors: a header or tensor that runs past the end of the file
        raise GgufError(f"not a readable GGUF file, truncated or corrupt (the file has {size} bytes): "
                        f"{type(e).__name__}: {e}") from None
    except OSError as e:
        raise GgufError(f"cannot read it: {e}") from None
    g = GgufFile(p, reader)
    splits = g.get("split.count")
    if splits is not None and int(splits) > 1:
        raise GgufError(f"is part {int(g.get('split.no', 0)) + 1} of a GGUF split in {int(splits)} files: merge them "
                        "into one (llama.cpp's llama-gguf-split --merge) and serve that")
    return g


def mistral_of(g: GgufFile) -> bool:
    """A llama-architecture file converted from a Mistral model: llama.cpp writes those as
    "llama"; the name says Mistral, or the file has a sliding window (llama has none)."""
    return g.arch == "llama" and ("mistral" in str(g.get("general.name", "")).lower()
                                  or g.arch_key("attention.sliding_window") is not None)


def _positive(g: GgufFile, suffix: str, cast: type = int, default: Any = None) -> Any:
    v = g.arch_key(suffix, default)
    if v is None:
        raise GgufError(f"metadata {g.arch}.{suffix} is missing")
    try:
        v = cast(v)
    except (TypeError, ValueError):
        raise GgufError(f"metadata {g.arch}.{suffix} is {v!r}, not a number") from None
    if v <= 0:
        raise GgufError(f"metadata {g.arch}.{suffix} must be positive, got {v!r}")
    return v


def hf_config(g: GgufFile) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, generation_config.json) of the model the metadata describes; GgufError for an
    architecture the decoder does not have, or metadata it cannot serve."""
    arch = g.arch
    if arch == "llama" and g.arch_key("expert_count"):
        raise GgufError("general.architecture 'llama' with llama.expert_count (Mixtral as llama.cpp writes it) is "
                        "not served from GGUF yet: serve the model's Hugging Face checkpoint")
    if arch not in SUPPORTED_ARCHS:
        raise GgufError(f"general.architecture {arch!r} is not supported (supported: "
                        f"{', '.join(sorted(SUPPORTED_ARCHS))}, and mistral as llama.cpp writes it: llama)")
    model_type, cls = ("mistral", "MistralForCausalLM") if mistral_of(g) else SUPPORTED_ARCHS[arch]
    hidden = _positive(g, "embedding_length")
    heads = _positive(g, "attention.head_count")
    kv = _positive(g, "attention.head_count_kv", default=heads)
    head_dim = _positive(g, "attention.key_length", default=hidden // heads)
    vocab = g.arch_key("vocab_size") or g.array_length("tokenizer.ggml.tokens")
    if not vocab and "token_embd.weight" in g.tensors:
        vocab = g.tensors["token_embd.weight"].shape[0]
    if not vocab:
        raise GgufError(f"metadata {arch}.vocab_size is missing and the file has no token list")
    cfg: dict[str, Any] = {
        "architectures": [cls], "model_type": model_type, "hidden_act": "silu",
        "vocab_size": int(vocab), "hidden_size": hidden,
        "intermediate_size": _positive(g, "feed_forward_length"),
        "num_hidden_layers": _positive(g, "block_count"),
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
        "rms_norm_eps": _positive(g, "attention.layer_norm_rms_epsilon", float, 1e-6),
        "rope_theta": _positive(g, "rope.freq_base", float, 10000.0),
        "max_position_embeddings": _positive(g, "context_length", default=4096),
        # llama.cpp writes the output projection only when it is not the embedding
        "tie_word_embeddings": "output.weight" not in g.tensors,
    }
    if model_type == "llama":  # biases (Llama's attention_bias covers q, k, v and o; mlp_bias the MLP)
        cfg["attention_bias"] = "blk.0.attn_q.bias" in g.tensors
        cfg["mlp_bias"] = "blk.0.ffn_up.bias" in g.tensors
    if model_type in ("phi3", "glm4"):
        cfg.update(variant_keys(g, model_type, head_dim, GgufError))
    if arch in MOE_ARCHS:
        cfg.update(moe_keys(g, head_dim, GgufError))
    if arch in HYBRID_ARCHS:
        cfg.update(hybrid_keys(g, head_dim, GgufError))
    if model_type == "mistral":  # llama.cpp computes a "llama" file without a window unless it has the key
        cfg["sliding_window"] = g.arch_key("attention.sliding_window")
    if arch in ("gemma2", "gemma3"):
        del cfg["hidden_act"]
        cfg.update(_gemma_keys(g, hidden, heads, head_dim))
    rope = str(g.arch_key("rope.scaling.type", "none") or "none")
    freqs = g.tensors.get(ROPE_FREQS)
    if rope == "linear" and freqs is None:
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": _positive(g, "rope.scaling.factor", float)}
    elif rope not in ("none", "linear"):
        raise GgufError(f"metadata {arch}.rope.scaling.type {rope!r} is not supported (supported: none, linear, and "
                        "the rope_freqs tensor)")
    if freqs is not None:  # Llama 3.1+'s scaling: one divisor per rotary frequency, as llama.cpp applies them
        if rope == "linear":
            raise GgufError(f"both {arch}.rope.scaling.type linear and a {ROPE_FREQS} tensor: not supported")
        if freqs.type not in (T.F32, T.F16) or freqs.shape != (head_dim // 2,):
            raise GgufError(f"tensor {ROPE_FREQS} is {freqs.type.name} {list(freqs.shape)}, expected F32 "
                            f"[{head_dim // 2}]")
        cfg["rope_scaling"] = {"rope_type": "freq_factors",
                               "factors": [float(x) for x in np.asarray(freqs.data, dtype=np.float32)]}
    types = {t.type for t in g.tensors.values() if len(t.shape) > 1}
    if types <= {T.F32, T.F16, T.BF16}:  # a float file: its half type is the checkpoint's dtype ("auto")
        cfg["torch_dtype"] = "bfloat16" if T.BF16 in types else "float16" if T.F16 in types else "float32"
    else:
        # A quantised file's values are exact in no float type: "auto" computes it in bfloat16, which
        # loses less than the quantisation did, where the device computes bf16 natively (float32 on
        # CPUs without it; ModelConfig.dtype picks another).
        cfg["torch_dtype"] = "bfloat16"
    gen: dict[str, Any] = {}
    for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                    ("padding_token_id", "pad_token_id")):
        v = g.get(f"tokenizer.ggml.{key}")
        if v is not None:
            cfg[hf] = int(v)
            gen[hf] = int(v)
    # llama.cpp ends generation at any end-of-generation token: eos, and eot/eom where the file has them
    eog = [int(v) for k in ("eos_token_id", "eot_token_id", "eom_token_id")
           if (v := g.get(f"tokenizer.ggml.{k}")) is not None]
    if arch in ("gemma2", "gemma3") and (eot := token_id(g, END_OF_TURN)) is not None:
        eog.append(eot)  # llama.cpp's end-of-generation tokens include <end_of_turn> where the vocabulary has it
    if eog:
        gen["eos_token_id"] = list(dict.fromkeys(eog)) if len(set(eog)) > 1 else eog[0]
    return cfg, gen


def _gemma_keys(g: GgufFile, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """Gemma 2/3's config keys as llama.cpp computes such a file (llama-model.cpp): the softmax
    scale 1/sqrt(head_dim) (the 27B models: 1/sqrt(hidden / heads)); every other layer sliding
    (Gemma 2) or five of six (Gemma 3) unless the file says ``attention.sliding_window_pattern``;
    Gemma 3's sliding layers on rope base 10000 unscaled, its global ones on ``rope.freq_base``
    with the file's scaling; Gemma 2's soft-capping values."""
    arch, layers = g.arch, _positive(g, "block_count")
    big = layers == (46 if arch == "gemma2" else 62)  # the 27B models
    out: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh",
                           "query_pre_attn_scalar": hidden // heads if big else head_dim,
                           "sliding_window": _positive(g, "attention.sliding_window")}
    pattern = g.arch_key("attention.sliding_window_pattern")
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
        pattern = 2 if arch == "gemma2" else 6
    out["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if arch == "gemma2":
        out["attn_logit_softcapping"] = _positive(g, "attn_logit_softcapping", float, 50.0)
        out["final_logit_softcapping"] = _positive(g, "final_logit_softcapping", float, 30.0)
    else:
        out["final_logit_softcapping"] = None
        out["attn_logit_softcapping"] = None
        out["rope_local_base_freq"] = 10000.0
    return out


def token_id(g: GgufFile, text: str) -> int | None:
    """The id of the token ``text`` in the file's vocabulary (``tokenizer.ggml.tokens``), None when
    absent. Walks the strings in the map and stops at the match (special tokens come early)."""
    field = g._reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        return None
    want = text.encode()
    if field.data:  # parsed by gguf's own reader
        return next((i for i, idx in enumerate(field.data) if bytes(field.parts[idx]) == want), None)
    buf = g._reader.data
    # key length (u64), key, value type (u32), item type (u32), count (u64), then (u64 length, bytes) items
    offs = field.offset + 8 + field.parts[1].nbytes + 4 + 4 + 8
    for i in range(int(field.parts[4][0])):
        n = int.from_bytes(buf[offs:offs + 8].tobytes(), "little")
        if n == len(want) and buf[offs + 8:offs + 8 + n].tobytes() == want:
            return i
        offs += 8 + n
    return None


def _llama_cpp_arch(g: GgufFile) -> Any:
    for key, name in MODEL_ARCH_NAMES.items():
        if name == g.arch:
            return key
    raise GgufError(f"general.architecture {g.arch!r} is not one the gguf package knows")


def gguf_name(name_map: Any, hf_name: str) -> str | None:
    """llama.cpp's name of the Hugging Face tensor ``hf_name`` (the gguf package's own table)."""
    base, _, suffix = hf_name.rpartition(".")
    mapped = name_map.get_name(base)
    return f"{mapped}.{suffix}" if mapped else None


def plan_tensors(g: GgufFile, expected: dict[str, tuple[int, ...]], num_layers: int) -> list[tuple[str, str]]:
    """(GGUF name, Hugging Face name) of every tensor of ``expected`` (HF name -> shape), in file
    order; GgufError naming tensors that are missing, unexpected, of another shape or of a type the
    loader does not dequantise. A mixture of experts' per-expert tensors are parts of the stacked
    ones (``GgufFile.ref``: ``NAME@E``); a [1, n] tensor the converter squeezed to [n] is ``NAME@row``;
    GLM-4-MoE's multi-token-prediction layers are left out (gguf_moe.py)."""
    mtp = mtp_layers(g)
    name_map = get_tensor_name_map(_llama_cpp_arch(g), num_layers + mtp)
    moe_inter = g.arch_key("expert_feed_forward_length", 0) if g.arch in MOE_ARCHS or g.arch in HYBRID_ARCHS else 0
    wanted: dict[str, str] = {}  # part or tensor name -> HF name (#ROW: its rows from ROW on)
    for hf in expected:
        if hf.endswith(".e_score_correction_bias"):  # the converter's name: e_score_correction.bias
            hf_base = hf.removesuffix("_bias") + ".bias"
        else:
            hf_base = hf
        pieces = linear_attn_parts(hf, g) if g.arch in HYBRID_ARCHS else None
        if pieces is not None:
            for gn, dst in pieces:
                wanted[gn] = f"{hf}#{dst}" if len(pieces) > 1 else hf
            continue
        gn = expert_part(hf, g.tensors, int(moe_inter or 0)) if moe_inter else None
        gn = gn or gguf_name(name_map, hf_base)
        if gn is None:  # the decoder and gguf's table disagree: a bug, not the file's fault
            raise RuntimeError(f"no llama.cpp name for {hf}")
        wanted[gn] = hf
    parts: dict[str, list[str]] = {}  # stored tensor -> its wanted parts, in order
    for gn in wanted:
        if "@" in gn:
            parts.setdefault(gn.partition("@")[0], []).append(gn)
    mtp_prefixes = tuple(f"blk.{i}." for i in range(num_layers, num_layers + mtp))
    out: list[tuple[str, str]] = []
    unexpected, bad_type = [], []
    for t in g.tensors.values():
        names = parts.get(t.name) or ([t.name] if t.name in wanted else [])
        if not names:
            if t.name.startswith(mtp_prefixes):  # GLM-4-MoE's MTP layers: not served
                continue
            if t.name != ROPE_FREQS and t.name not in EXTRA_TENSORS:  # read by hf_config
                unexpected.append(t.name)
            continue
        if t.name in parts and len(t.shape) == 3:  # experts: the stack holds exactly those the metadata says
            n = len({p.partition("@")[2].split(":")[0] for p in names})
            if t.shape[0] != n:
                raise GgufError(f"tensor {t.name} has shape {list(t.shape)}: {t.shape[0]} experts, the metadata "
                                f"implies {n}")
        elif len(t.shape) == 1 and tuple(expected[wanted[t.name]]) == (1, *t.shape):
            wanted[f"{t.name}@row"] = wanted.pop(t.name)  # [1, n] squeezed by the converter
            names = [f"{t.name}@row"]
        if t.type not in LOADABLE_TYPES:
            bad_type.append(f"{t.name} ({t.type.name})")
            continue
        for name in names:
            hf, _, dst = wanted[name].partition("#")
            ref = g.ref(name)
            want, got = tuple(expected[hf]), ref.shape
            fits = got == want if not dst else (got[1:] == want[1:] and int(dst) + got[0] <= want[0])
            if not fits or len(ref.data) != got[0]:  # a part past the end of a short tensor
                raise GgufError(f"tensor {t.name} has shape {list(t.shape)}, the metadata implies "
                                f"{list(want) if name == t.name else 'parts of ' + str(list(want))}")
            out.append((name, wanted[name]))
    if bad_type:
        raise GgufError(f"tensor type(s) not supported: {_names(bad_type)} (supported: "
                        f"{', '.join(x.name for x in LOADABLE_TYPES)})")
    missing = list(dict.fromkeys(n.partition("@")[0] for n in wanted if n.partition("@")[0] not in g.tensors))
    if missing or unexpected:
        msgs = []
        if missing:
            msgs.append(f"missing tensors: {_names(missing)}")
        if unexpected:
            msgs.append(f"unexpected tensors: {_names(unexpected)}")
        raise GgufError(f"tensors do not match its metadata ({g.arch}): " + "; ".join(msgs))
    return out


def _names(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


