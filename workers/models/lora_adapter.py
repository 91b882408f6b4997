"""A peft LoRA adapter folder, checked against the served model from its files' headers (torch-free).

What is read: ``adapter_config.json`` (peft's ``LoraConfig``) and the header of
``adapter_model.safetensors`` (no tensor is read; the file is mapped, not loaded). What is
served: LoRA (``peft_type`` "LORA") on any of the decoder's seven linear projections (peft's
module names ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``,
``down_proj``) of any layers, rank up to ``maxLoraRank`` (at most ``MAX_RANK``), scaled by
``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), with peft's per-module
``rank_pattern`` and ``alpha_pattern``. The tensors are the truth about which modules an
adapter changes (``target_modules`` may be a regular expression or ``all-linear``).

Refused, each with a message naming the problem (``AdapterError``: 404 for a folder that is not
there, 400 otherwise): no adapter_config.json or no safetensors file (``adapter_model.bin`` only:
convert it), another peft type, options that change the math this server does not implement
(``use_dora``, ``lora_bias``, ``fan_in_fan_out``, a ``bias`` other than "none",
``modules_to_save``, trainable tokens, activated LoRA, ...), a tensor of another module
(embeddings, the LM head, norms) or of a layer the model does not have, a rank above the limit,
shapes the served model does not have (an adapter of another base model), a ``base_model_name_or_path``
that is a local model folder whose config.json describes another model, non-float tensors, a
truncated file.

The launch step (workers/prepare.py) runs this on ``LoraModules`` before any process starts; a
device worker runs it again before it reads the tensors (workers/models/lora.py).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from .checkpoint import FLOAT_DTYPES, _size_hint
from .config import ModelArgs, ModelConfigError

__all__ = ["AdapterError", "AdapterModule", "AdapterPlan", "CONFIG_FILE", "MAX_RANK", "TARGETS", "WEIGHTS_FILE",
           "check_adapter"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_RANK = 64  # the largest rank this server serves (maxLoraRank 0 = this)

# peft module name -> (the decoder block's submodule, the fused projection it lands in).
TARGETS: dict[str, tuple[str, str]] = {
    "q_proj": ("self_attn", "qkv"), "k_proj": ("self_attn", "qkv"), "v_proj": ("self_attn", "qkv"),
    "o_proj": ("self_attn", "o"),
    "gate_proj": ("mlp", "gate_up"), "up_proj": ("mlp", "gate_up"), "down_proj": ("mlp", "down"),
}
# adapter_config.json keys that change what the adapter computes in ways this server does not
# implement: a value other than the harmless one is refused, naming the key.
_REFUSED: dict[str, tuple[Any, str]] = {
    "use_dora": (False, "DoRA (weight-decomposed LoRA) is not supported"),
    "lora_bias": (False, "LoRA biases (lora_bias) are not supported"),
    "fan_in_fan_out": (False, "fan_in_fan_out (Conv1D-style weights) is not supported"),
    "modules_to_save": (None, "modules_to_save (fully trained copies of base modules) is not supported"),
    "trainable_token_indices": (None, "trainable token embeddings are not supported"),
    "alora_invocation_tokens": (None, "activated LoRA (alora_invocation_tokens) is not supported"),
    "use_qalora": (False, "QA-LoRA is not supported"),
    "layer_replication": (None, "layer_replication is not supported"),
    "target_parameters": (None, "LoRA on parameters (target_parameters) is not supported"),
    "use_bdlora": (False, "BD-LoRA is not supported"),
    "arrow_config": (None, "Arrow routing (arrow_config) is not supported"),
}
_KEY_RE = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """The adapter cannot be served; ``status`` is the HTTP status a load answers with (404: no
    adapter at that path; 400: the adapter is not one this server serves on this model)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class AdapterModule:
    """One adapted projection: layer, peft module name, rank, scale, and its two tensors' names
    (A: [rank, in], B: [out, rank])."""

    layer: int
    target: str
    rank: int
    scale: float
    a_name: str
    b_name: str


@dataclass(frozen=True)
class AdapterPlan:
    """A checked adapter: what a worker reads (``modules``) and what is reported about it."""

    path: str  # the folder, absolute
    file: str  # its safetensors file
    rank: int  # the largest rank of its modules
    targets: tuple[str, ...]  # peft module names it adapts, in TARGETS order
    modules: tuple[AdapterModule, ...]
    nbytes: int  # the safetensors file's size
    base_model: str  # base_model_name_or_path as written ("" = none)
    use_rslora: bool = False

    def describe(self) -> str:
        return (f"rank {self.rank}, {', '.join(self.targets)} on {len({m.layer for m in self.modules})} layers"
                f"{', rsLoRA' if self.use_rslora else ''}, {self.nbytes / 2**20:.1f} MiB")


def _pattern_key(patterns: dict, module: str) -> str | None:
    """peft's ``get_pattern_key``: the first pattern that matches the end of ``module`` at a
    dot boundary (``(.*\\.)?(pattern)$``), else None."""
    for key in patterns:
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return key
        except re.error:
            raise AdapterError(f"{CONFIG_FILE}: pattern {key!r} is not a valid regular expression") from None
    return None


def _same_model(theirs: ModelArgs, ours: ModelArgs) -> list[str]:
    """What differs between two models' shapes (empty: the same architecture and sizes)."""
    keys = ("arch", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size")
    return [f"{k} {getattr(theirs, k)} (served: {getattr(ours, k)})" for k in keys
            if getattr(theirs, k) != getattr(ours, k)]


def _check_base(base: str, args: ModelArgs, folder: Path) -> None:
    """A ``base_model_name_or_path`` that is a local model folder must describe the served model.
    A hub id (or a folder not on this host) cannot be compared: the tensor shapes decide."""
    if not base:
        return
    p = Path(base).expanduser()
    if not p.is_absolute():
        p = (folder / p) if (folder / p).is_dir() else Path(os.getcwd()) / p
    if not (p / "config.json").is_file():
        return
    try:
        theirs = ModelArgs.from_dir(p)
    except (ModelConfigError, OSError, ValueError):
        return  # not a model this server reads: nothing to compare with
    if diff := _same_model(theirs, args):
        raise AdapterError(f"the adapter was trained for another base model: its base_model_name_or_path {base} "
                           f"has {', '.join(diff)}")


def _read_config(folder: Path) -> dict:
    cfg_path = folder / CONFIG_FILE
    if not cfg_path.is_file():
        # 404 as a missing folder: /v1/load_lora_adapter answers both alike (no existence oracle)
        raise AdapterError(f"{folder} has no {CONFIG_FILE} (a peft LoRA adapter folder is expected)", status=404)
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise AdapterError(f"{cfg_path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_path}: the top level must be a JSON object")
    return cfg


def _number(cfg: dict, key: str, default: Any, kind: type | tuple[type, ...], positive: bool = True) -> Any:
    value = cfg.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, kind) or (positive and not value > 0):
        raise AdapterError(f"{CONFIG_FILE}: {key} must be a positive number, got {value!r}")
    return value


def check_adapter(path: str | os.PathLike, args: ModelArgs, max_rank: int = MAX_RANK) -> AdapterPlan:
    """Check the peft LoRA adapter at ``path`` for the model ``args`` describe, ranks up to
    ``max_rank`` (capped at MAX_RANK); ``AdapterError`` saying what cannot be served."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise AdapterError(f"No adapter found for '{path}'", status=404)
    if args.moe is not None:
        raise AdapterError(f"LoRA adapters are not served on a mixture of experts ({args.model_type or args.arch}: "
                           "its expert layers have no adapter path)")
    cfg = _read_config(folder)
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"{CONFIG_FILE}: peft_type {peft_type!r} is not supported (LORA adapters only)")
    for key, (harmless, why) in _REFUSED.items():
        value = cfg.get(key)
        if value is not None and value != harmless and value not in ([], {}, ""):
            raise AdapterError(f"{CONFIG_FILE}: {why} ({key}: {json.dumps(value)})")
    bias = cfg.get("bias", "none")
    if bias not in (None, "none"):
        raise AdapterError(f"{CONFIG_FILE}: bias {bias!r} is not supported (only \"none\": peft trains no biases "
                           "then)")
    r = _number(cfg, "r", 8, int)
    alpha = _number(cfg, "lora_alpha", 8, (int, float))
    rslora = cfg.get("use_rslora") is True
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    if not isinstance(rank_pattern, dict) or not isinstance(alpha_pattern, dict):
        raise AdapterError(f"{CONFIG_FILE}: rank_pattern and alpha_pattern must be JSON objects")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        bad = [t for t in targets if not isinstance(t, str) or t.rsplit(".", 1)[-1] not in TARGETS]
        if bad:
            raise AdapterError(f"{CONFIG_FILE}: unsupported target module(s) {', '.join(map(str, bad))}: LoRA is "
                               f"served on {', '.join(TARGETS)} only")
    limit = min(max_rank or MAX_RANK, MAX_RANK)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        extra = " (found adapter_model.bin: convert it to safetensors)" if (folder / "adapter_model.bin").exists() \
            else ""
        raise AdapterError(f"{folder} has no {WEIGHTS_FILE}{extra}: only safetensors adapters are loaded")
    try:
        with safe_open(str(weights), framework="numpy") as f:
            header = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"{weights}: not a readable safetensors file: {e}{_size_hint(weights)}") from None
    hint = _size_hint(weights)
    if hint:
        raise AdapterError(f"{weights}: the file does not match its header{hint}")
    _check_base(str(cfg.get("base_model_name_or_path") or ""), args, folder)

    out_in = {"q_proj": (args.q_size, args.hidden_size), "k_proj": (args.kv_size, args.hidden_size),
              "v_proj": (args.kv_size, args.hidden_size), "o_proj": (args.hidden_size, args.q_size),
              "gate_proj": (args.intermediate_size, args.hidden_size),
              "up_proj": (args.intermediate_size, args.hidden_size),
              "down_proj": (args.hidden_size, args.intermediate_size)}
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for name, (shape, dtype) in header.items():
        m = _KEY_RE.match(name)
        if m is None:
            raise AdapterError(f"{weights}: tensor {name} is not LoRA on a decoder layer's linear projection "
                               f"(embeddings, the LM head and norms are not supported)")
        layer, block, target, ab = int(m[1]), m[2], m[3], m[4]
        if target not in TARGETS or TARGETS[target][0] != block:
            raise AdapterError(f"{weights}: tensor {name}: unsupported target {target} (LoRA is served on "
                               f"{', '.join(TARGETS)} only)")
        if layer >= args.num_hidden_layers:
            raise AdapterError(f"{weights}: tensor {name} is for layer {layer}, the served model has "
                               f"{args.num_hidden_layers} layers: the adapter was trained for another base model")
        if dtype not in FLOAT_DTYPES:
            raise AdapterError(f"{weights}: tensor {name} is stored as {dtype}; only floating-point tensors "
                               f"({', '.join(FLOAT_DTYPES)}) are loaded")
        if len(shape) != 2:
            raise AdapterError(f"{weights}: tensor {name} has shape {shape}, a matrix is expected")
        pairs.setdefault((layer, target), {})[ab] = name
    if not pairs:
        raise AdapterError(f"{weights} holds no LoRA tensors")
    modules = []
    for (layer, target), ab in sorted(pairs.items(), key=lambda kv: (kv[0][0], list(TARGETS).index(kv[0][1]))):
        module = f"model.layers.{layer}.{TARGETS[target][0]}.{target}"
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise AdapterError(f"{weights}: {module} has no {missing}.weight (a corrupt adapter)")
        (a_shape, _), (b_shape, _) = header[ab["A"]], header[ab["B"]]
        out_f, in_f = out_in[target]
        rank = a_shape[0]
        if a_shape[1] != in_f or b_shape[0] != out_f:
            raise AdapterError(f"{weights}: {module} adapts a [{b_shape[0]} x {a_shape[1]}] projection, the served "
                               f"model's is [{out_f} x {in_f}]: the adapter was trained for another base model")
        if b_shape[1] != rank:
            raise AdapterError(f"{weights}: {module}: lora_A has rank {rank}, lora_B {b_shape[1]} (a corrupt adapter)")
        key = _pattern_key(rank_pattern, module)
        want = rank_pattern[key] if key is not None else r
        if rank != want:
            raise AdapterError(f"{weights}: {module} has rank {rank}, {CONFIG_FILE} says {want} (a corrupt adapter)")
        if rank > limit:
            raise AdapterError(f"LoRA rank is greater than max_lora_rank: {module} has rank {rank}, "
                               f"the limit is {limit} (ModelDeployConfig.maxLoraRank; at most {MAX_RANK} here)")
        akey = _pattern_key(alpha_pattern, module)
        a = alpha_pattern[akey] if akey is not None else alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not a > 0:
            raise AdapterError(f"{CONFIG_FILE}: lora_alpha for {module} must be a positive number, got {a!r}")
        scale = a / math.sqrt(rank) if rslora else a / rank
        modules.append(AdapterModule(layer, target, rank, scale, ab["A"], ab["B"]))
    present = {m.target for m in modules}
    return AdapterPlan(path=str(folder.resolve()), file=str(weights.resolve()), rank=max(m.rank for m in modules),
                       targets=tuple(t for t in TARGETS if t in present), modules=tuple(modules),
                       nbytes=weights.stat().st_size, base_model=str(cfg.get("base_model_name_or_path") or ""),
                       use_rslora=rslora)
