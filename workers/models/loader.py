"""Load a Hugging Face Llama-family checkpoint (`config.json` + `*.safetensors`) into DecoderLM."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelArgs, ModelConfigError
from .llama import DecoderLM

__all__ = ["load_model", "ModelConfigError", "ModelLoadError", "safetensors_files"]

log = logging.getLogger("workers.models")

# Tensors some checkpoints carry that the model recomputes itself.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class ModelLoadError(RuntimeError):
    """The weights cannot be loaded; the message names the file and tensors involved."""


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


def _param_slots(model: DecoderLM) -> dict[str, tuple[torch.Tensor, int, int]]:
    """HF tensor name -> (destination parameter, first row, row count).

    Fused projections take several HF tensors: q/k/v go into row ranges of qkv_proj, gate/up into
    gate_up_proj. Every row of every model parameter is covered by exactly one entry.
    """
    a = model.args
    slots: dict[str, tuple[torch.Tensor, int, int]] = {}

    def whole(name: str, p: torch.Tensor) -> None:
        slots[name] = (p, 0, p.shape[0])

    def linear(name: str, lin: torch.nn.Module, parts: list[tuple[str, int, int]] | None = None) -> None:
        """A linear layer's weight and bias; ``parts`` (HF name, first row, rows) when several HF
        projections are fused into it."""
        for proj, start, n in parts or [(name, 0, lin.weight.shape[0])]:
            slots[f"{proj}.weight"] = (lin.weight, start, n)
            if lin.bias is not None:
                slots[f"{proj}.bias"] = (lin.bias, start, n)

    whole("model.embed_tokens.weight", model.embed_tokens.weight)
    whole("model.norm.weight", model.norm.weight)
    if model.lm_head is not None:
        whole("lm_head.weight", model.lm_head.weight)
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        att = layer.self_attn
        linear("", att.qkv_proj, [(f"{pre}self_attn.q_proj", 0, a.q_size),
                                  (f"{pre}self_attn.k_proj", a.q_size, a.kv_size),
                                  (f"{pre}self_attn.v_proj", a.q_size + a.kv_size, a.kv_size)])
        linear(f"{pre}self_attn.o_proj", att.o_proj)
        if att.q_norm is not None and att.k_norm is not None:
            whole(f"{pre}self_attn.q_norm.weight", att.q_norm.weight)
            whole(f"{pre}self_attn.k_norm.weight", att.k_norm.weight)
        inter = a.intermediate_size
        linear("", layer.mlp.gate_up_proj, [(f"{pre}mlp.gate_proj", 0, inter), (f"{pre}mlp.up_proj", inter, inter)])
        linear(f"{pre}mlp.down_proj", layer.mlp.down_proj)
        whole(f"{pre}input_layernorm.weight", layer.input_layernorm.weight)
        whole(f"{pre}post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
    return slots


def _names(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def load_model(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    *,
    max_positions: int | None = None,
    args: ModelArgs | None = None,
) -> tuple[DecoderLM, ModelArgs]:
    """Build a DecoderLM from a Hugging Face model directory and load its safetensors weights.

    dtype None uses the checkpoint's `torch_dtype` (float32 when it does not say). `args`: the
    directory's ModelArgs when the caller has read them already. `max_positions` caps the rope
    table (see DecoderLM). Raises ModelConfigError for a bad config.json and ModelLoadError for
    missing, unexpected or mis-shaped tensors. Returns the model in eval mode and its ModelArgs.
    """
    path = Path(path)
    t0 = time.monotonic()
    args = args or ModelArgs.from_dir(path)
    if dtype is None:
        dtype = getattr(torch, args.torch_dtype or "float32")
    device = torch.device(device)
    files = safetensors_files(path)
    log.info(
        "loading %s model from %s: %d layers, hidden %d, vocab %d, %s on %s, %d shard(s)",
        args.arch, path, args.num_hidden_layers, args.hidden_size, args.vocab_size,
        str(dtype).removeprefix("torch."), device, len(files),
    )

    # Allocate straight on the target device. DecoderLM skips random init, so this is just
    # uninitialised storage that the checkpoint overwrites below (no meta device: its empty_like
    # drags in sympy and costs ~0.5 s on first use).
    with torch.device(device):
        model = DecoderLM(args, dtype=dtype, max_positions=max_positions)
    model.eval().requires_grad_(False)
    model.rope.to_device(device)

    slots = _param_slots(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for n, file in enumerate(files, 1):
        t_shard = time.monotonic()
        nbytes = 0
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                key = name if name in slots or name.startswith("model.") or name.startswith("lm_head.") else f"model.{name}"
                if key not in slots:
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if key == "lm_head.weight" and args.tie_word_embeddings:
                        continue  # some tied checkpoints store a copy of the embedding anyway
                    unexpected.append(name)
                    continue
                if key in loaded:
                    raise ModelLoadError(f"{file.name}: tensor {name} appears in more than one shard")
                tensor = f.get_tensor(name)
                param, start, rows = slots[key]
                expected = (rows, *param.shape[1:])
                if tuple(tensor.shape) != expected:
                    raise ModelLoadError(
                        f"{file.name}: tensor {name} has shape {tuple(tensor.shape)}, config.json implies {expected}"
                    )
                with torch.no_grad():
                    param[start:start + rows].copy_(tensor)  # casts to the model dtype and device
                loaded.add(key)
                nbytes += tensor.numel() * tensor.element_size()
        log.info(
            "loaded shard %d/%d %s (%.1f MiB) in %.2fs", n, len(files), file.name, nbytes / 2**20,
            time.monotonic() - t_shard,
        )

    missing = [k for k in slots if k not in loaded]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {_names(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {_names(unexpected)}")
        raise ModelLoadError(f"{path}: checkpoint does not match its config.json ({args.arch}): " + "; ".join(parts))

    log.info(
        "model ready: %.1fM parameters in %.2fs",
        sum(p.numel() for p in model.parameters()) / 1e6, time.monotonic() - t0,
    )
    return model, args

