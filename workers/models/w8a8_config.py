"""Which W8A8 checkpoints are served (torch-free: the launch step's checkpoint check reads it):
the compressed-tensors ``quantization_config`` of config.json (vLLM's format for
llm-compressor's ``*-quantized.w8a8`` exports) and where each int8 weight's scale is.

Only the form the CPU's GGUF block kernels compute is accepted (workers/models/w8a8.py holds the
weights as Q8_0 blocks): ``format: "int-quantized"``, every config group's weights 8-bit int,
symmetric, static, per output channel, and its input activations 8-bit int, symmetric, dynamic,
per token (the kernels quantise them per 32 values, finer than per token); no sparsity, KV cache
or transform scheme. Anything else is refused, naming ``quantization_config`` and the scheme.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .config import ModelConfigError

KEY = "quantization_config"
# the checkpoint tensors beside an int8 ``<layer>.weight``
AUX_SUFFIXES = (".weight_scale", ".weight_zero_point")


@dataclass(frozen=True)
class Scheme:
    """An accepted compressed-tensors W8A8 checkpoint: its ``ignore`` list (layers kept in float)."""

    ignore: tuple[str, ...]


def _refuse(what: str) -> ModelConfigError:
    return ModelConfigError(f"config.json {KEY}: {what}; only compressed-tensors' W8A8 int8 form is served "
                            "(format int-quantized; weights int 8-bit symmetric static per channel; input "
                            "activations int 8-bit symmetric dynamic per token)")


def _args_problem(args: dict | None, role: str, strategy: str, dynamic: bool) -> str | None:
    if not isinstance(args, dict):
        return f"{role} are not quantised"
    want = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy, "dynamic": dynamic}
    for key, value in want.items():
        if args.get(key) != value:
            return f"{role} {key} is {args.get(key)!r}, not {value!r}"
    if args.get("group_size") not in (None, 0) or args.get("block_structure") not in (None, []):
        return f"{role} are grouped ({args.get('group_size') or args.get('block_structure')})"
    return None


def scheme_of(config: dict) -> Scheme | None:
    """The W8A8 scheme of a config.json dict: None when it has no compressed-tensors
    ``quantization_config`` (other methods are left to the checks that know them), a Scheme for
    the accepted form, ModelConfigError naming the key and the scheme for any other."""
    qc = config.get(KEY)
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        return None
    if qc.get("format") != "int-quantized":
        raise _refuse(f"compressed-tensors format {qc.get('format')!r} is not int-quantized")
    for key in ("sparsity_config", "kv_cache_scheme", "transform_config"):
        if qc.get(key):
            raise _refuse(f"compressed-tensors {key} is set")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse("compressed-tensors config_groups is empty")
    for name, group in groups.items():
        group = group if isinstance(group, dict) else {}
        problem = (_args_problem(group.get("weights"), "weights", "channel", False)
                   or _args_problem(group.get("input_activations"), "input activations", "token", True)
                   or ("output activations are quantised" if group.get("output_activations") else None))
        if problem:
            raise _refuse(f"compressed-tensors config group {name!r}: {problem}")
    return Scheme(ignore=tuple(qc.get("ignore") or ()))


def checkpoint_scheme(path: str | Path) -> Scheme | None:
    """``scheme_of`` the config.json in folder ``path`` (None where there is none)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return None
    try:
        config = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return None  # ModelArgs.from_dir reports an unreadable config.json
    return scheme_of(config) if isinstance(config, dict) else None


@dataclass(frozen=True)
class Int8Tensor:
    """Where a checkpoint's int8 weight and its per-channel scale (and zero point) are stored."""

    file: Path
    name: str
    scale_file: Path
    scale_name: str
    zero_point: tuple[Path, str] | None = None


def check_scale(name: str, shape: tuple[int, ...], rows: int) -> str | None:
    """Why a ``weight_scale`` header cannot be a per-channel scale of ``rows`` rows (None: it can)."""
    if tuple(shape) not in ((rows, 1), (rows,)):
        return f"{name} has shape {tuple(shape)}, not ({rows}, 1): only per-channel scales are served"
    return None
