"""The one SSE writer of the front end: the items handed to Falcon's ``resp.sse`` and the headers
of a stream.

Frames are bytes, framed by the codecs with the contract's SSE framing
(mindie/contract/sse_framing.py, shared with the coordinator) and passed through untouched
(``Raw``), so every family's events are byte-exact: MindIE's native routes and OpenAI write
``data: {json}\\n\\n``; MindIE's TGI and Triton routes ``data:{json}\\n\\n`` (no space, as MindIE);
vLLM's ``/generate`` stream is not SSE at all (NUL-terminated JSON, its codec says so with its
content type).
"""
from __future__ import annotations

import os
from collections.abc import AsyncIterator

import falcon.asgi


def _idle_tick_s(default: float = 1.0) -> float:
    """``MINDIE_SSE_IDLE_TICK_S`` (a test knob, docs/config.md), within [0.001, 60] s; else ``default``."""
    try:
        value = float(os.environ.get("MINDIE_SSE_IDLE_TICK_S") or default)
    except ValueError:
        return default
    return min(60.0, max(0.001, value)) if value == value else default


IDLE_TICK_S = _idle_tick_s()  # how often an idle stream checks for a client disconnect
SSE = "text/event-stream"


class Raw:
    """Bytes sent as they are into an open stream (Falcon's ``resp.sse`` item)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data

    def __bool__(self) -> bool:
        return True

    def serialize(self, handler=None) -> bytes:
        return self.data


class Tick:
    """Sent while a stream waits: zero bytes on the wire, but Falcon checks for a client
    disconnect after every item, so a vanished client is noticed within IDLE_TICK_S."""

    def __bool__(self) -> bool:
        return True

    def serialize(self, handler=None) -> bytes:
        return b""


TICK = Tick()


def start_stream(resp: falcon.asgi.Response, items: AsyncIterator[object], content_type: str = SSE) -> None:
    """Hand ``items`` (``Raw`` and ``TICK``) to Falcon as the response body."""
    resp.content_type = content_type
    resp.set_header("Cache-Control", "no-cache")
    resp.set_header("X-Accel-Buffering", "no")
    resp.sse = items
