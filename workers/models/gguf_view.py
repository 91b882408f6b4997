"""A GGUF file seen as a Hugging Face folder: the model view the rest of the server reads.

Everything but the weights reads a model as a Hugging Face folder: ``ModelArgs.from_dir``
(config.json, generation_config.json), the front ends' tokenizer (tokenizer.json with the
``tokenizers`` library, mindie/text/detokenizer.py), the chat template and special tokens
(tokenizer_config.json / chat_template.jinja, mindie/text/chat_template.py). For a GGUF file the
launch step (workers/prepare.py) makes such a folder once, from the file's metadata, and serves
it as the model directory; only the weight loader goes back to the ``.gguf`` file, which the
view's ``mindie_gguf.json`` names (workers/models/gguf_paths.py ``view_source``):

- config.json and generation_config.json: ``gguf_file.hf_config`` (the metadata keys
  llama.cpp writes, mapped to transformers' names);
- tokenizer.json, tokenizer_config.json, chat_template.jinja: transformers' own GGUF tokenizer
  conversion (``AutoTokenizer.from_pretrained(folder, gguf_file=...)``, the same object
  transformers users get from the file), saved with ``save_pretrained``; a Gemma file without
  ``tokenizer.chat_template`` gets Gemma's (workers/models/gemma_chat.py). transformers (and torch,
  which it imports) is loaded only here, once per file.

The view lives in ``$MINDIE_CACHE_DIR`` (default ``~/.cache/mindie-py``) as
``gguf-<file stem>-<hash>``, the hash over the file's absolute path, size and modification time,
the view format and the transformers version: a changed file or another transformers makes a
new view. It is built in a temp folder and renamed into place, so concurrent launches race
safely; a view that exists is reused without reading the file's tokenizer again (a warm start
reads the GGUF header only, in the loader).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from .checkpoint import expected_tensors
from .config import ModelArgs, ModelConfigError
from .demo import default_cache_dir
from .gemma_chat import GEMMA_CHAT_TEMPLATE
from .gguf_file import hf_config, open_gguf, plan_tensors
from .gguf_paths import MARKER, GgufError, file_key

__all__ = ["VIEW_FILES", "ensure_view", "view_dir"]

log = logging.getLogger("workers.models")

# Bump when the files of a view change for the same GGUF file, so stale views are not reused.
FORMAT_VERSION = 2  # 2: a quantised file's config says torch_dtype bfloat16
VIEW_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", MARKER)


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return ""


def view_dir(gguf_path: Path, cache_dir: str | Path | None = None) -> Path:
    """Where the view of ``gguf_path`` lives (see the module docstring)."""
    key = {**file_key(gguf_path), "format_version": FORMAT_VERSION, "transformers": _transformers_version()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    return root / f"gguf-{gguf_path.stem[:60]}-{digest}"


def _complete(path: Path, gguf_path: Path) -> bool:
    if not all((path / f).is_file() for f in VIEW_FILES):
        return False
    try:
        rec = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return rec == {**file_key(gguf_path), "format_version": FORMAT_VERSION}


def ensure_view(gguf_path: str | os.PathLike[str], cache_dir: str | Path | None = None) -> Path:
    """The model view of the GGUF file ``gguf_path``, made on first use (about 10 s for a
    50k-token vocabulary, mostly importing transformers; then cached). GgufError when the file
    cannot be served: unreadable, truncated, an unsupported architecture, a tokenizer transformers
    cannot convert."""
    gguf_path = Path(gguf_path).resolve()
    g = open_gguf(gguf_path)
    # Everything the workers would refuse, refused before the (slow) tokenizer conversion: an
    # unsupported architecture, metadata the decoder cannot take, tensors it cannot load.
    cfg, gen = hf_config(g)
    try:
        args = ModelArgs.from_dict(cfg, gen, source="its metadata")
    except ModelConfigError as e:
        raise GgufError(str(e)) from None
    plan_tensors(g, expected_tensors(args), args.num_hidden_layers)
    final = view_dir(gguf_path, cache_dir)
    if _complete(final, gguf_path):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(final.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        t0 = time.monotonic()
        log.info("GGUF %s: making its model view (config and tokenizer from the metadata, transformers' converter) "
                 "in %s", gguf_path, final)
        _write_json(tmp / "config.json", cfg)
        _write_json(tmp / "generation_config.json", gen)
        _write_tokenizer(gguf_path, tmp)
        if g.arch in ("gemma2", "gemma3") and g.get("tokenizer.chat_template") is None:
            # a Gemma file without its template: Gemma's own, not the server's ChatML fallback
            (tmp / "chat_template.jinja").write_text(GEMMA_CHAT_TEMPLATE, encoding="utf-8")
        _write_json(tmp / MARKER, {**file_key(gguf_path), "format_version": FORMAT_VERSION})
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        try:
            if final.exists() and not _complete(final, gguf_path):
                shutil.rmtree(final)  # not a view of this file (a rename is atomic: never a half-made one)
            os.rename(tmp, final)
        except OSError:
            if not _complete(final, gguf_path):  # another launch finished first: use its view
                raise
        log.info("GGUF model view ready in %.1f s: %s", time.monotonic() - t0, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _remove_orphans(root: Path, max_age_s: float = 3600.0) -> None:
    """Remove the views of GGUF files that are gone or changed (a view is keyed by its file's
    path, size and modification time, so those are never used again), and temp folders of builds
    that were killed."""
    now = time.time()
    for d in root.glob("gguf-*"):
        try:
            rec = json.loads((d / MARKER).read_text(encoding="utf-8"))
            path = Path(rec["gguf"])
            stale = not path.is_file() or (path.stat().st_size, path.stat().st_mtime_ns) != (rec["size"],
                                                                                              rec["mtime_ns"])
        except (OSError, ValueError, KeyError, TypeError):
            stale = False  # not ours to judge (or being written): left alone
        if stale:
            shutil.rmtree(d, ignore_errors=True)
    for d in root.glob(".gguf-*.tmp-*"):
        try:
            if now - d.stat().st_mtime > max_age_s:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_tokenizer(gguf_path: Path, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json (special tokens, add_bos/eos) and the chat template,
    as transformers builds them from the file; then checked to load with ``tokenizers`` alone,
    as the front ends load it."""
    try:
        import transformers  # lazy: heavy (imports torch), needed only to make a view
        from tokenizers import Tokenizer
    except ImportError as e:
        raise GgufError(f"converting its tokenizer needs transformers (pip install transformers): {e}") from None
    try:
        try:
            tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        except ValueError as e:
            if "is not supported yet" not in str(e):
                raise
            # AutoTokenizer maps the file's model config first, which transformers lacks for some
            # architectures (glm4); its tokenizer converter reads any architecture's vocabulary
            tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tok.save_pretrained(str(out))
        Tokenizer.from_file(str(out / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001  (transformers raises anything from a file it cannot convert)
        raise GgufError(f"its tokenizer cannot be converted by transformers {transformers.__version__}: "
                        f"{type(e).__name__}: {e}") from None
    if not (out / "tokenizer_config.json").is_file():
        raise GgufError("transformers wrote no tokenizer_config.json for its tokenizer")
