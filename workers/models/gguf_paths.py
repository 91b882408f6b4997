"""Where a GGUF file is, without reading it: the model view's marker, the file magic, the file a
``modelWeightPath`` stands for, and the view's record of its file. No ``gguf`` or numpy import,
so that the launch step and a worker serving an ordinary checkpoint do not pay for them
(workers/models/gguf_file.py reads the files)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# The model view's record of the file it stands for (workers/models/gguf_view.py writes it).
MARKER = "mindie_gguf.json"
GGUF_MAGIC = b"GGUF"


class GgufError(ValueError):
    """The GGUF file cannot be served; the message says why (the caller names the file/key)."""


def is_gguf_path(path: str | os.PathLike[str]) -> bool:
    """``path`` is a file that starts with the GGUF magic (cheap: 4 bytes)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def find_gguf(path: str | os.PathLike[str]) -> Path | None:
    """The GGUF file ``path`` (``modelWeightPath``) stands for, or None when it is not one (a
    Hugging Face folder, or nothing there). A file is taken when its name ends in ``.gguf`` or it
    starts with the GGUF magic; a folder without config.json holding ``*.gguf`` files must hold
    exactly one (several: GgufError naming them, so that the operator names the one to serve)."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix.lower() == ".gguf" or is_gguf_path(p) else None
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    found = sorted(f for f in p.iterdir() if f.suffix.lower() == ".gguf" and f.is_file())
    if len(found) > 1:
        raise GgufError(f"holds {len(found)} GGUF files ({', '.join(f.name for f in found)}): set modelWeightPath to "
                        "the one to serve")
    return found[0] if found else None


def file_key(path: Path) -> dict[str, Any]:
    """What identifies the file a view was made from: its path, size and modification time."""
    st = path.stat()
    return {"gguf": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def view_source(model_dir: str | os.PathLike[str]) -> Path | None:
    """The GGUF file behind the model view ``model_dir`` (None: not a view, an ordinary Hugging
    Face folder); GgufError when the file is gone or changed since the view was made."""
    marker = Path(model_dir) / MARKER
    if not marker.is_file():
        return None
    try:
        rec = json.loads(marker.read_text(encoding="utf-8"))
        path = Path(rec["gguf"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise GgufError(f"{marker}: unreadable ({e})") from None
    try:
        now = file_key(path)
    except OSError as e:
        raise GgufError(f"{path} (the GGUF file of {model_dir}): {e}") from None
    if (now["size"], now["mtime_ns"]) != (rec.get("size"), rec.get("mtime_ns")):
        raise GgufError(f"{path} changed since its model view {model_dir} was made (size or modification time): "
                        "restart the server to read it again")
    return path
