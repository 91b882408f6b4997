"""How the served model turns a prompt into one embedding (``/v1/embeddings``, ``/api/embed``).

Read once from the checkpoint's folder, as sentence-transformers reads it:

- ``modules.json`` lists a ``sentence_transformers.models.Pooling`` module (its folder, usually
  ``1_Pooling``, holds ``config.json``: ``pooling_mode_mean_tokens``, ``pooling_mode_cls_token``
  or ``pooling_mode_lasttoken``) and, when the vectors are unit length, a ``Normalize`` module;
- without those files (a plain decoder), ``ModelConfig.embeddingPooling`` (docs/config.md):
  ``auto`` (the default) is the last token's hidden state, normalised, as Qwen3-Embedding and the
  other decoder embedding models pool; ``last``, ``mean`` or ``cls`` name the pooling (normalised).
  A pooling the key names wins over the files.
- Matryoshka: the checkpoint's ``config.json`` ``matryoshka_dimensions`` (a list: ``dimensions``
  must be one of them) or ``is_matryoshka: true`` (any ``dimensions`` up to the hidden size),
  vLLM's keys. Otherwise a request's ``dimensions`` is refused.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("mindie.api")

POOLING_MODULE = "sentence_transformers.models.Pooling"
NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
# sentence-transformers' 1_Pooling/config.json flag of each pooling the workers compute.
ST_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
DEFAULT_POOLING = "last"  # a plain decoder's (embeddingPooling "auto" without sentence-transformers files)


@dataclass(frozen=True)
class Pooling:
    """The served model's pooling rule."""

    kind: str  # "mean" | "last" | "cls" (wire.POOLING_KINDS)
    normalize: bool
    source: str  # where the rule came from (logged)
    hidden_size: int = 0  # the pooled vector's length (0 = unknown)
    matryoshka: bool = False  # a request's ``dimensions`` may truncate it
    dimensions: tuple[int, ...] = ()  # the truncations allowed (empty: any up to hidden_size)

    def check_dimensions(self, dims: int) -> str:
        """Why ``dims`` cannot be served ("" = it can)."""
        if not self.matryoshka:
            return "dimensions is not supported: the model is not Matryoshka-trained (config.json has no " \
                   "matryoshka_dimensions or is_matryoshka)"
        if dims < 1 or (self.hidden_size and dims > self.hidden_size):
            return f"dimensions must be between 1 and {self.hidden_size or 'the hidden size'}, got {dims}"
        if self.dimensions and dims not in self.dimensions:
            return f"dimensions must be one of {list(self.dimensions)}, got {dims}"
        return ""


def _read(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _st_pooling(model_dir: Path) -> tuple[str, bool] | None:
    """(kind, normalise) from sentence-transformers' files; None without them. A pooling the workers
    do not compute (max, weighted mean) is refused here, at start."""
    modules = _read(model_dir / "modules.json")
    if not isinstance(modules, list):
        return None
    types = {m.get("type"): m for m in modules if isinstance(m, dict)}
    if POOLING_MODULE not in types:
        return None
    cfg = _read(model_dir / str(types[POOLING_MODULE].get("path") or "1_Pooling") / "config.json")
    if not isinstance(cfg, dict):
        raise ValueError(f"{model_dir}: modules.json lists a Pooling module without a readable config.json")
    kinds = [kind for key, kind in ST_MODES.items() if cfg.get(key)]
    others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in ST_MODES]
    if len(kinds) != 1 or others:
        raise ValueError(f"{model_dir}: sentence-transformers pooling {kinds + others} is not served "
                         f"(one of mean, CLS or last token)")
    return kinds[0], NORMALIZE_MODULE in types


def load_pooling(model_dir: str | Path, configured: str = "auto") -> Pooling:
    """The pooling rule of the checkpoint in ``model_dir`` with ``ModelConfig.embeddingPooling``."""
    d = Path(model_dir)
    cfg = _read(d / "config.json")
    cfg = cfg if isinstance(cfg, dict) else {}
    dims = cfg.get("matryoshka_dimensions")
    dims = tuple(int(x) for x in dims) if isinstance(dims, list) else ()
    common = dict(hidden_size=int(cfg.get("hidden_size") or 0), dimensions=dims,
                  matryoshka=bool(dims) or cfg.get("is_matryoshka") is True)
    st = _st_pooling(d)
    if configured != "auto":
        return Pooling(configured, True if st is None else st[1], "ModelConfig.embeddingPooling", **common)
    if st is not None:
        return Pooling(st[0], st[1], "sentence-transformers modules.json", **common)
    return Pooling(DEFAULT_POOLING, True, "the plain-decoder default (last token, normalised)", **common)
