"""Server-sent events as bytes: the framing every SSE stream of the predict port uses, written by
the server's SSE writer (mindie/sse.py, the API codecs in mindie/api/) and by the coordinator
when it ends a stream itself (mindie/contract/families.py). Pure bytes: no web framework here.

An event is ``data: <data>\\n\\n`` (MindIE's native routes, OpenAI) or ``data:<data>\\n\\n``
(MindIE's TGI and Triton routes: no space, as MindIE writes them); ``DONE`` is OpenAI's stream
terminator. Anthropic's events are named: ``event: <name>\\ndata: <json>\\n\\n`` (``named_event``).
"""
from __future__ import annotations

from typing import Any

import msgspec

DONE = b"data: [DONE]\n\n"

_enc = msgspec.json.Encoder()


def event(data: bytes, space: bool = True) -> bytes:
    """One SSE event: ``data: <data>\\n\\n`` (``data:<data>`` without ``space``)."""
    return (b"data: " if space else b"data:") + data + b"\n\n"


def json_event(obj: Any, space: bool = True) -> bytes:
    """One SSE event of ``obj`` as compact JSON (msgspec keeps Struct field and dict key order)."""
    return event(_enc.encode(obj), space)


def named_event(name: str, obj: Any) -> bytes:
    """One named SSE event of ``obj`` as compact JSON: ``event: <name>\\ndata: <json>\\n\\n``."""
    return b"event: " + name.encode() + b"\ndata: " + _enc.encode(obj) + b"\n\n"
