"""Response bodies of /infer and /infer_token, byte for byte in MindIE's shape.

Key order follows the seed example (shared/seed/infer_token_example.txt) and mindie.md §4.3-4.4:
msgspec Structs encode fields in declaration order, as compact JSON. An error inside a stream is
the native family's error frame (mindie/contract/families.py).
"""
from __future__ import annotations

from typing import Union

import msgspec

from mindie.contract.sse_framing import json_event


class TokenInfo(msgspec.Struct):
    id: list[int]
    text: Union[str, None]


class StreamFrame(msgspec.Struct):
    prefill_time: Union[float, None]
    decode_time: Union[float, None]
    token: TokenInfo


class StreamDetails(msgspec.Struct):
    finish_reason: str
    generated_tokens: int
    seed: int


class FinalStreamFrame(msgspec.Struct):
    prefill_time: Union[float, None]
    decode_time: Union[float, None]
    generated_text: str
    details: Union[StreamDetails, None]
    token: TokenInfo


class Details(msgspec.Struct):
    finish_reason: str
    generated_tokens: int
    generated_token_ids: list[int]
    seed: int


class Reply(msgspec.Struct, omit_defaults=True):
    generated_text: str
    details: Union[Details, None] = None


_enc = msgspec.json.Encoder()


def ms(value: float) -> float:
    """Milliseconds as the seed shows them: two decimals."""
    return round(value, 2)


def stream_frame(ids: list[int], text: str, prefill_ms: float | None, decode_ms: float | None) -> bytes:
    return json_event(StreamFrame(prefill_ms, decode_ms, TokenInfo(ids, text)))


def final_stream_frame(ids: list[int], prefill_ms: float | None, decode_ms: float | None, generated_text: str,
                       details: StreamDetails | None) -> bytes:
    return json_event(FinalStreamFrame(prefill_ms, decode_ms, generated_text, details, TokenInfo(ids, None)))


def reply(generated_text: str, details: Details | None) -> bytes:
    return _enc.encode(Reply(generated_text, details))
