"""Hugging Face TGI routes on MindIE's business plane (mindie.md §2.1, §7; tgi.md §4):

- ``POST /generate`` with ``inputs`` (mindie/api/generate.py tells it from vLLM's body);
- ``POST /generate_stream``: TGI server-sent events;
- ``POST /``: TGI's compat route, ``stream`` in the body chooses; the non-stream answer is a
  one-element JSON array (what the ``text-generation`` client and api-inference expect).

Answers are TGI's: ``{"generated_text", "details"}`` (details only with ``details`` or
``decoder_input_details``) and SSE events ``data:{"index","token":{"id","text","logprob","special"},
["top_tokens",] "generated_text","details"}`` with the text and details on the last one. Errors are
MindIE's ``{"error","error_type"}`` (422 ``Input Validation Error`` ...), before a stream starts as
a plain JSON answer with that status, inside an open stream as a ``data:`` event.
The body's checks are mindie/api/tgi_schema.py's; ``parameters.grammar`` (``json``, ``regex``,
``json_schema``) constrains the output (mindie/text/structured.py), a bad one is MindIE's 422. Keys it does not read are ignored (as TGI and
MindIE do) and named: ``X-Ignored-Fields`` and a rate-limited WARNING (mindie/text/ignored_fields.py).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Container

import falcon.asgi
import msgspec

from mindie.api.tgi_schema import COMPAT_SCHEMA, SCHEMA, TgiRequest, parse_tgi
from mindie.text.detokenizer import IncrementalDetokenizer, TextTokenizer
from mindie.contract import families
from mindie.contract.http_error import validation_error
from mindie.contract.sse_framing import event
from mindie.text.generation import Piece
from mindie.text.ignored_fields import find
from mindie.pipeline import Codec, Context, Job, Output, Pipeline, Sub, finish_name
from mindie.text.structured import Checker, as_validation_error
from mindie.text.validation import Limits, decode_json

COMPAT_PARSE_ERROR = "Failed to parse context to json body"
_json = msgspec.json.encode


class TgiCodec(Codec):
    """TGI's shapes; ``mode``: "generate" (``/generate``), "stream" (``/generate_stream``) or
    "compat" (``POST /``)."""

    family = families.TGI

    def __init__(self, tokenizer: TextTokenizer, limits: Limits, model_name: str, mode: str,
                 adapters: Container[str] = (), structured: Checker | None = None):
        """``adapters``: the LoRA adapters ``adapter_id`` may name (mindie/lora_adapters.py);
        ``structured``: the front end's constraint checker (None: one of its own)."""
        self.tokenizer = tokenizer
        self.structured = structured if structured is not None else Checker(tokenizer)
        self.limits = limits
        self.model_name = model_name
        self.mode = mode
        self.adapters = adapters
        self.special = tokenizer.special_ids

    # -- the body ------------------------------------------------------------------------------
    def parse(self, body: bytes, ctx: Context) -> Job:
        if self.mode == "stream":
            return self.parse_value(decode_json(body), True)
        if self.mode == "compat":
            value = decode_json(body, COMPAT_PARSE_ERROR)
            stream = value.get("stream") if type(value) is dict else None
            if stream is not None and type(stream) is not bool:
                raise validation_error("Stream must be boolean type.")
            return self.parse_value(value, bool(stream))
        return self.parse_value(decode_json(body), False)

    def parse_value(self, body: Any, stream: bool) -> Job:
        """A decoded body (an object with ``inputs``) into its job."""
        if type(body) is not dict:
            body = {}
        r = parse_tgi(body, self.limits, self.tokenizer.encode, stream, self.model_name, self.adapters)
        c = r.sampling.constraint
        checks = self.structured.pending(c, "grammar", as_validation_error) if c is not None else []
        return Job([Sub(r.input_ids, r.sampling, stops=r.parameters.stop, adapter=r.adapter)], stream, r, self,
                   ignored=find(body, COMPAT_SCHEMA if self.mode == "compat" else SCHEMA), checks=checks)

    def finish_label(self, finish: str) -> str:
        return finish_name(finish)

    # -- tokens --------------------------------------------------------------------------------
    def _text_of(self, tok: int) -> str:
        return self.tokenizer.tokenizer.decode([tok], skip_special_tokens=False)

    def _token(self, tok: int, text: str, lp: float | None) -> dict:
        return {"id": tok, "text": text, "logprob": lp, "special": tok in self.special}

    def _top(self, tops: list[tuple[int, float]]) -> list[dict]:
        return [self._token(t, self._text_of(t), lp) for t, lp in tops]

    def _tokens(self, out: Output) -> list[dict]:
        detok = IncrementalDetokenizer(self.tokenizer)
        res = []
        for i, tok in enumerate(out.ids):
            text = self._text_of(tok) if tok in self.special else detok.push([tok])
            res.append(self._token(tok, text, out.logprobs[i] if i < len(out.logprobs) else None))
        return res

    def _prefill(self, r: TgiRequest, out: Output) -> list[dict]:
        if not r.parameters.decoder_input_details:
            return []
        lps = out.prompt_logprobs
        res = []
        for i, tok in enumerate(r.input_ids):
            lp = lps[i - 1] if 0 < i <= len(lps) else None  # the first prompt token has none
            res.append({"id": tok, "text": self._text_of(tok), "logprob": lp, "special": tok in self.special})
        return res

    # -- answers -------------------------------------------------------------------------------
    def reply(self, job: Job, outs: list[Output], ctx: Context) -> bytes:
        r: TgiRequest = job.request
        pr = r.parameters
        out = outs[0]
        res: dict = {"generated_text": (r.inputs if pr.return_full_text else "") + out.text}
        if pr.details or pr.decoder_input_details:
            d = {"prompt_tokens": len(r.input_ids), "finish_reason": finish_name(out.finish),
                 "generated_tokens": len(out.ids), "seed": r.sampling.seed, "prefill": self._prefill(r, out),
                 "tokens": self._tokens(out)}
            if pr.top_n_tokens:
                d["top_tokens"] = [self._top(t) for t in out.tops]
            res["details"] = d
        return _json([res] if self.mode == "compat" else res)

    def render(self, job: Job, out: Output, p: Piece, ctx: Context) -> Iterator[bytes]:
        r: TgiRequest = job.request
        pr = r.parameters
        st = out.state
        index = st.get("index", 0)
        ids = p.token_ids or ([st.get("last", 0)] if p.finish_reason else [])
        n = len(ids)
        for i, tok in enumerate(ids):
            index += 1
            end = i == n - 1
            lp = p.logprobs[i] if i < len(p.logprobs) and p.token_ids else None
            ev: dict = {"index": index, "token": self._token(tok, p.text if end else "", lp)}
            if pr.top_n_tokens and i < len(p.top_logprobs):
                ev["top_tokens"] = self._top(p.top_logprobs[i])
            final = bool(p.finish_reason) and end
            ev["generated_text"] = ((r.inputs if pr.return_full_text else "") + out.text) if final else None
            ev["details"] = None
            if final and pr.details:
                ev["details"] = {"prompt_tokens": len(r.input_ids), "finish_reason": finish_name(p.finish_reason),
                                 "generated_tokens": len(out.ids), "seed": r.sampling.seed,
                                 "input_length": len(r.input_ids)}
            yield event(_json(ev), space=False)
        st["index"] = index
        if p.token_ids:
            st["last"] = p.token_ids[-1]


class TgiResource:
    """``POST /generate_stream`` (suffix "stream") and ``POST /`` (suffix "compat")."""

    def __init__(self, pipeline: Pipeline, model_name: str):
        tok, lim = pipeline.tokenizer, pipeline.limits
        self.pipeline = pipeline
        self.stream = TgiCodec(tok, lim, model_name, "stream", pipeline.adapters, pipeline.structured)
        self.compat = TgiCodec(tok, lim, model_name, "compat", pipeline.adapters, pipeline.structured)

    async def on_post_stream(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        await self.pipeline.serve(req, resp, self.stream)

    async def on_post_compat(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        await self.pipeline.serve(req, resp, self.compat)
