"""What a checkpoint's weight files must hold, checked from their headers alone (torch-free).

One description serves both sides of a start:

- ``expected_tensors(args)``: every tensor the decoder needs, by its Hugging Face name, with the
  full shape config.json implies (``workers.models.loader`` maps each name to where it goes);
- ``check_checkpoint(path, args)``: reads the header of every shard file with safetensors' own
  parser (the one the loader opens the files with; no tensor is read, the files are mapped, not
  loaded) and refuses what the loader would, naming the file and the tensors: shard files absent
  or unreadable, a file whose size differs from what its header describes (truncated, or still
  being copied), tensors missing, unexpected, stored twice, of another shape, or not stored as
  floating point (the loader casts floats to the serving dtype; a quantised checkpoint's int8 or
  fp8 tensors would be cast into nonsense).

A GGUF model view (workers/models/gguf_view.py: a folder whose ``mindie_gguf.json`` names the
``.gguf`` file) is checked the same way from the GGUF file's header (workers/models/gguf_file.py
``plan_tensors``: llama.cpp's names, and a tensor type the loader dequantises).

The loader runs it before it reads a tensor and then reads what it returns; the launch step
(workers/prepare.py) runs it before any process starts, so a checkpoint the server cannot load
is refused with exit status 2 instead of failing in each worker.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import SafetensorError, safe_open

from .config import ModelArgs
from .deepseek_config import is_mtp_tensor
from .gpt_oss_config import expert_tensors as gpt_oss_tensors
from .gemma_config import extra_tensors as gemma_tensors
from .gguf_paths import GgufError, view_source
from .w8a8_config import AUX_SUFFIXES, Int8Tensor, check_scale, checkpoint_scheme
from .moe_names import NAMES as MOE_NAMES, expected_tensors as moe_tensors

__all__ = ["FLOAT_DTYPES", "Checkpoint", "ModelLoadError", "check_checkpoint", "expected_tensors",
           "safetensors_files"]

# Tensors some checkpoints carry that the model recomputes itself.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# safetensors dtype names the loader accepts (it casts them to the serving dtype).
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


class ModelLoadError(RuntimeError):
    """The weights cannot be loaded; the message names the file and tensors involved."""


@dataclass(frozen=True)
class Checkpoint:
    """A checked checkpoint: per shard file, the (stored name, expected name) of each tensor to
    read, in file order (ignored tensors left out). ``gguf``: one GGUF file (stored names are
    llama.cpp's), not safetensors shards."""

    files: dict[Path, list[tuple[str, str]]]
    nbytes: int  # the shard files' sizes together
    gguf: bool = False
    skipped_mtp: int = 0  # DeepSeek's multi-token-prediction tensors, not loaded
    skipped_towers: int = 0  # a multimodal Gemma 3/4's vision/audio tensors, not loaded
    # a compressed-tensors W8A8 checkpoint's int8 linear weights (not in ``files``): expected name ->
    # where it and its scale are (workers/models/w8a8.py)
    int8: dict[str, Int8Tensor] = field(default_factory=dict)

    @property
    def tensors(self) -> int:
        return sum(len(v) for v in self.files.values())


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint's shard files: those named by `model.safetensors.index.json`, else every `*.safetensors`."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index}: cannot read weight_map: {exc}") from exc
        files = [path / name for name in dict.fromkeys(weight_map.values())]  # unique, in order
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        extra = " (found pytorch_model*.bin: convert it to safetensors)" if any(path.glob("pytorch_model*.bin")) else ""
        raise ModelLoadError(f"{path}: no *.safetensors weight files{extra}")
    return files


def expected_tensors(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> full shape, for every tensor of the model ``args`` describe
    (whole model, not a tensor-parallel shard: each rank reads its slice of these)."""
    if args.deepseek is not None:  # multi-head latent attention and DeepSeek's experts
        from .deepseek_names import expected_tensors as deepseek_tensors
        return deepseek_tensors(args)
    if args.hybrid is not None:  # Gated DeltaNet layers beside gated full attention (Qwen3-Next, Qwen3.5)
        from .hybrid_names import expected_tensors as hybrid_tensors
        return hybrid_tensors(args)
    if args.gemma4 is not None:  # per-layer head geometries, KV sharing, per-layer inputs (Gemma 4)
        from .gemma4_names import expected_tensors as gemma4_tensors
        return gemma4_tensors(args)
    hid, vocab, inter = args.hidden_size, args.vocab_size, args.intermediate_size
    q, kv = args.q_size, args.kv_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hid), "model.norm.weight": (hid,)}
    if args.num_labels:  # a sequence-classification head instead of the LM head
        out["score.weight"] = (args.num_labels, hid)
    elif not args.tie_word_embeddings:
        out["lm_head.weight"] = (vocab, hid)
    for i in range(args.num_hidden_layers):
        pre = f"model.layers.{i}."
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out[f"{pre}self_attn.{proj}.weight"] = (rows, hid)
            if args.attention_bias:
                out[f"{pre}self_attn.{proj}.bias"] = (rows,)
        out[f"{pre}self_attn.o_proj.weight"] = (hid, q)
        if args.o_proj_bias:
            out[f"{pre}self_attn.o_proj.bias"] = (hid,)
        if args.qk_norm:
            out[f"{pre}self_attn.q_norm.weight"] = (args.head_dim,)
            out[f"{pre}self_attn.k_norm.weight"] = (args.head_dim,)
        moe = args.moe
        if args.gpt_oss is not None:  # its router, experts and sinks (workers/models/gpt_oss.py)
            out.update(gpt_oss_tensors(pre, hid, inter, args.num_attention_heads, args.gpt_oss))
        elif moe is not None and moe.sparse_layers[i]:  # a mixture-of-experts layer (workers/models/moe.py)
            out.update(moe_tensors(pre, MOE_NAMES[moe.names], hid, moe.num_experts, moe.moe_intermediate_size,
                                   moe.shared_expert_intermediate_size, moe.shared_expert_gate))
        else:
            for proj, shape in (("gate_proj", (inter, hid)), ("up_proj", (inter, hid)), ("down_proj", (hid, inter))):
                out[f"{pre}mlp.{proj}.weight"] = shape
                if args.mlp_bias:
                    out[f"{pre}mlp.{proj}.bias"] = shape[:1]
        out[f"{pre}input_layernorm.weight"] = (hid,)
        out[f"{pre}post_attention_layernorm.weight"] = (hid,)
    if args.variant is not None:  # GLM-4 / Phi-3's fused tensors and GLM-4's extra norms
        from .variant_names import expected_tensors as variant_tensors
        return variant_tensors(args, out)
    if args.gemma is not None:  # Gemma's norms around the feed-forward (workers/models/gemma_config.py)
        out.update(gemma_tensors(args))
    if args.glm4_moe is not None:  # GLM-4-MoE's routers' correction biases (workers/models/glm4_moe_config.py)
        from .glm4_moe_config import router_tensors
        assert args.moe is not None
        out.update(router_tensors(args.moe.sparse_layers, args.moe.num_experts))
    return out


def _names(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _size_hint(file: Path) -> str:
    """For a header safetensors cannot parse: how the file's size compares with what its header
    describes, when the header itself is whole (a truncated file's usual case)."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= min(size - 8, 100 << 20):
                return f" (the file has {size} bytes)"
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return ""
    want = 8 + n + end
    if want == size:
        return ""
    return f" (the file has {size} bytes, its header describes {want}: {'truncated' if size < want else 'extra bytes'}?)"


def _read_header(file: Path) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every tensor in ``file``, in file order: its header only."""
    try:
        with safe_open(str(file), framework="numpy") as f:  # the loader's parser; no tensor is read
            out = []
            for name in f.keys():
                sl = f.get_slice(name)
                out.append((name, tuple(sl.get_shape()), sl.get_dtype()))
            return out
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"{file}: not a readable safetensors file: {e}{_size_hint(file)}") from None


def check_checkpoint(path: str | Path, args: ModelArgs) -> Checkpoint:
    """Check the weight files of the checkpoint at ``path`` against ``args`` from their headers
    (see the module docstring); ModelLoadError naming the file and tensors when the loader would
    refuse them."""
    path = Path(path)
    expected = expected_tensors(args)
    source = None
    try:
        source = view_source(path)
        if source is not None:
            from .gguf_file import open_gguf, plan_tensors  # gguf and numpy: only for a GGUF file
            return Checkpoint({source: plan_tensors(open_gguf(source), expected, args.num_hidden_layers)},
                              os.path.getsize(source), gguf=True)
    except GgufError as e:
        raise ModelLoadError(f"{source or path}: {e}") from None
    files: dict[Path, list[tuple[str, str]]] = {}
    seen: dict[str, Path] = {}
    unexpected: list[str] = []
    nbytes = 0
    mtp = towers = 0
    w8a8 = checkpoint_scheme(path) is not None  # ModelConfigError for a scheme it does not serve
    int8: dict[str, tuple[Path, str]] = {}  # expected name -> (file, stored name) of an int8 weight
    aux: dict[str, tuple[Path, tuple[int, ...], str]] = {}  # its scales and zero points
    for file in safetensors_files(path):
        nbytes += os.path.getsize(file)
        entries = files[file] = []
        for name, shape, dtype in _read_header(file):
            if w8a8 and name.endswith(AUX_SUFFIXES):
                aux[name] = (file, shape, dtype)
                continue
            # Some checkpoints drop the "model." prefix of the decoder's tensors.
            key = name if name in expected or name.startswith(("model.", "lm_head.")) else f"model.{name}"
            if args.hybrid is not None:  # a Qwen3.5 checkpoint's model.language_model. (vision, MTP skipped)
                from .hybrid_names import checkpoint_key
                if (key := checkpoint_key(key)) is None:
                    continue
            if args.gemma4 is not None:  # model.language_model. (towers, shared layers' k/v skipped)
                from .gemma4_names import checkpoint_key as gemma4_key
                from .multimodal_names import TOWERS
                towers += key.startswith(TOWERS)
                if (key := gemma4_key(key, args)) is None:
                    continue
            elif args.gemma is not None:  # a multimodal Gemma 3's decoder (towers skipped)
                from .multimodal_names import text_key
                if (text := text_key(key)) is None:
                    towers += 1
                    continue
                key = text
            if key not in expected:
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                if (args.deepseek or args.glm4_moe) is not None and is_mtp_tensor(args.num_hidden_layers, key):
                    mtp += 1  # the MTP head is not served
                    continue
                if key == "lm_head.weight" and args.tie_word_embeddings:
                    continue  # some tied checkpoints store a copy of the embedding anyway
                unexpected.append(name)
                continue
            if key in seen:
                raise ModelLoadError(f"{file}: tensor {name} appears in more than one shard (also in {seen[key].name})")
            seen[key] = file
            if shape != expected[key]:
                raise ModelLoadError(f"{file}: tensor {name} has shape {shape}, config.json implies {expected[key]}")
            if w8a8 and dtype == "I8" and key.endswith(".weight"):
                int8[key] = (file, name)  # read with its scale (loader.py, w8a8.read_blocks)
                continue
            if dtype not in FLOAT_DTYPES:
                raise ModelLoadError(f"{file}: tensor {name} is stored as {dtype}; only floating-point weights "
                                     f"({', '.join(FLOAT_DTYPES)}) are loaded (a pre-quantised checkpoint is not "
                                     "supported: serve the unquantised one, with ModelConfig quantize if wanted)")
            entries.append((name, key))
    int8_tensors = _int8_tensors(int8, aux, expected, path)
    missing = [k for k in expected if k not in seen]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {_names(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {_names(unexpected)}")
        raise ModelLoadError(f"{path}: checkpoint does not match its config.json ({args.arch}): " + "; ".join(parts))
    return Checkpoint(files, nbytes, skipped_mtp=mtp, skipped_towers=towers, int8=int8_tensors)


def _int8_tensors(int8: dict[str, tuple[Path, str]], aux: dict[str, tuple[Path, tuple[int, ...], str]],
                  expected: dict[str, tuple[int, ...]], path: Path) -> dict[str, Int8Tensor]:
    """Each int8 weight of a W8A8 checkpoint with its per-channel scale (and zero point, if
    stored); ModelLoadError for a weight without a scale, a scale of another shape or type, or a
    scale or zero point of no int8 weight."""
    out: dict[str, Int8Tensor] = {}
    for key, (file, name) in int8.items():
        scale = aux.pop(name + "_scale", None)
        if scale is None:
            raise ModelLoadError(f"{file}: int8 tensor {name} has no {name}_scale beside it")
        if scale[2] not in FLOAT_DTYPES or (why := check_scale(name + "_scale", scale[1], expected[key][0])):
            raise ModelLoadError(f"{scale[0]}: {why if scale[2] in FLOAT_DTYPES else name + '_scale is ' + scale[2]}")
        zp = aux.pop(name + "_zero_point", None)
        out[key] = Int8Tensor(file, name, scale[0], name + "_scale", (zp[0], name + "_zero_point") if zp else None)
    if aux:
        raise ModelLoadError(f"{path}: checkpoint does not match its config.json: scales of no int8 weight: "
                             f"{_names(sorted(aux))}")
    return out
