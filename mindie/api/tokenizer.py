"""POST /v1/tokenizer (mindie.md §6): count the tokens of a text.

``{"inputs": "<text>", "do_decode": true}`` -> ``{"token_number": N, "tokens": [...]}``.
``token_number`` counts the tokens the model is given for this text on ``/infer`` (a BOS the
tokenizer adds included). With ``do_decode`` (the default) ``tokens`` are their text pieces, one
per token, special tokens as their text (``<s>``), except that tokens completing one character
together (bytes of a CJK character) give one piece: as MindIE documents it, ``len(tokens)`` is
below ``token_number`` only where characters were merged. With ``do_decode: false`` they are
the token ids. Other body keys are ignored and named (mindie/text/ignored_fields.py).
"""
from __future__ import annotations

import asyncio

import falcon
import falcon.asgi
import msgspec

from mindie.text import ignored_fields
from mindie.text.detokenizer import IncrementalDetokenizer, TextTokenizer
from mindie.contract.http_error import validation_error
from mindie.pipeline import read_body
from mindie.text.validation import Limits

LARGE_TEXT = 64 * 1024  # characters; longer texts are tokenised on a thread
SCHEMA = {"inputs": None, "do_decode": None}


def pieces(tok: TextTokenizer, ids: list[int]) -> list[str]:
    """The text of each token (a special token's own text), tokens that only complete a
    character together merged."""
    detok = IncrementalDetokenizer(tok)
    special = tok.special_ids
    out: list[str] = []
    for i in ids:
        if i in special:  # the detokenizer skips these (as generated text does): listed by name
            out.append(tok.tokenizer.decode([i], skip_special_tokens=False))
            continue
        piece = detok.push([i])
        if piece:
            out.append(piece)
    rest = detok.flush()
    if rest:
        out.append(rest)
    return out


class TokenizerResource:
    def __init__(self, tokenizer: TextTokenizer, limits: Limits):
        self.tokenizer = tokenizer
        self.limits = limits

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        raw = await read_body(req, self.limits.max_request_length_mb)
        try:
            body = msgspec.json.decode(raw)
        except (msgspec.DecodeError, RecursionError):
            raise validation_error("Req body converts to json fail.")
        text = body.get("inputs") if isinstance(body, dict) else None
        do_decode = body.get("do_decode", True) if isinstance(body, dict) else True
        if not isinstance(text, str) or not text or not isinstance(do_decode, (bool, type(None))):
            raise validation_error("Inputs in request body is invalid.")
        limit = self.limits.max_text_len
        if len(text) > limit:
            raise validation_error(f"Inputs data length in [0, {limit}], but the length of inputs is {len(text)}")
        if len(text) > LARGE_TEXT:
            ids = await asyncio.to_thread(self.tokenizer.encode, text)
        else:
            ids = self.tokenizer.encode(text)
        tokens = pieces(self.tokenizer, ids) if do_decode is not False else ids
        ignored_fields.report(req, resp, ignored_fields.find(body, SCHEMA))
        resp.content_type = falcon.MEDIA_JSON
        resp.data = msgspec.json.encode({"token_number": len(ids), "tokens": tokens})
