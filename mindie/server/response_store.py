"""The stored responses of OpenAI's Responses API (``store: true``; mindie/api/responses.py): what
``GET /v1/responses/{id}`` returns, ``DELETE`` removes and ``previous_response_id`` continues.

One JSON file per response (``<id>.json``: the response object and the conversation items it
answered) in one directory, so that every front end process of the server sees every response
and they survive a restart: ``ServerConfig.responsesStorePath``, default ``<runDir>/responses/``
(not one of the run directory's ``ENTRIES``, mindie/runtime/lifecycle.py: a restart keeps it).
Behind a coordinator, instances that should continue each other's responses point the key at a
shared volume.

- Safe: an id is ``resp_`` and up to 64 letters, digits, ``_`` or ``-`` (no path traversal);
  anything else is simply not found. A file is written to a temporary name then ``os.replace``d
  (a reader never sees half a response; two writers never interleave).
- Bounded: at most ``max_count`` responses; a write past it removes the oldest (by mtime). The
  count is checked on every ``max_count // 10 + 1``-th write of a process (listing a large
  directory on every write would cost more than the answer), so the directory may hold up to
  that many more between two checks, per front end.
"""
from __future__ import annotations

import json
import os
import re
import secrets
from typing import Any

ID_RE = re.compile(r"^resp_[A-Za-z0-9_-]{1,64}$")
DEFAULT_MAX_COUNT = 10000
_SUFFIX = ".json"


def new_id(prefix: str = "resp") -> str:
    """A fresh id (``resp_<48 hex digits>``; ``msg``, ``fc``, ``rs`` for output items)."""
    return f"{prefix}_{secrets.token_hex(24)}"


def valid_id(rid: str) -> bool:
    return isinstance(rid, str) and ID_RE.match(rid) is not None


class ResponseStore:
    """The responses kept in ``path`` (created mode 0700 on first use)."""

    def __init__(self, path: str, max_count: int = DEFAULT_MAX_COUNT):
        self.path = path
        self.max_count = max(1, max_count)
        self._writes = 0

    def _file(self, rid: str) -> str | None:
        return os.path.join(self.path, rid + _SUFFIX) if valid_id(rid) else None

    def put(self, rid: str, record: dict[str, Any]) -> None:
        """Keeps ``record`` as response ``rid`` (replacing one of that id)."""
        path = self._file(rid)
        if path is None:
            raise ValueError(f"not a response id: {rid!r}")
        os.makedirs(self.path, 0o700, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f, separators=(",", ":"))
        os.replace(tmp, path)
        self._writes += 1
        if self._writes % (self.max_count // 10 + 1) == 0 or self.max_count < 10:
            self.prune()

    def get(self, rid: str) -> dict[str, Any] | None:
        """The record of ``rid``, None when unknown (or not an id)."""
        path = self._file(rid)
        if path is None:
            return None
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
        except (FileNotFoundError, ValueError):  # gone, or damaged outside this module
            return None
        return record if isinstance(record, dict) else None

    def delete(self, rid: str) -> bool:
        """Removes ``rid``; False when there was none."""
        path = self._file(rid)
        if path is None:
            return False
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        return True

    def prune(self) -> list[str]:
        """Removes the oldest responses past ``max_count``; returns their ids."""
        try:
            names = [n for n in os.listdir(self.path) if n.endswith(_SUFFIX) and valid_id(n[:-len(_SUFFIX)])]
        except FileNotFoundError:
            return []
        if len(names) <= self.max_count:
            return []
        aged = []
        for n in names:
            try:
                aged.append((os.stat(os.path.join(self.path, n)).st_mtime_ns, n))
            except FileNotFoundError:
                continue
        aged.sort()
        removed = []
        for _, n in aged[:max(0, len(aged) - self.max_count)]:
            if self.delete(n[:-len(_SUFFIX)]):
                removed.append(n[:-len(_SUFFIX)])
        return removed
