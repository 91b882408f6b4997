"""Hugging Face TGI routes on MindIE's business plane (mindie.md §2.1, §7; tgi.md §4):

- ``POST /generate``: ``inputs`` -> TGI (non-stream); ``prompt`` -> vLLM (mindie/api/vllm_generate.py;
  ``prompt`` wins when both are there, as MindIE); neither (or a body that is not JSON) -> 422 with
  MindIE's embedded message.
- ``POST /generate_stream``: TGI server-sent events.
- ``POST /``: TGI's compat route, ``stream`` in the body chooses; the non-stream answer is a
  one-element JSON array (what the ``text-generation`` client and api-inference expect).

Answers are TGI's: ``{"generated_text", "details"}`` (details only with ``details`` or
``decoder_input_details``) and SSE events ``data:{"index","token":{"id","text","logprob","special"},
["top_tokens",] "generated_text","details"}`` with the text and details on the last one. Errors are
MindIE's ``{"error","error_type"}`` (422 ``Input Validation Error`` ...), before a stream starts as
a plain JSON answer with that status, inside an open stream as a ``data:`` event.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import falcon.asgi

from mindie.api.generate_base import GenerateBase, Job, Result, decode_json, finish_name, json_bytes, render_pieces
from mindie.api.tgi_schema import TgiRequest, parse_tgi
from mindie.api.vllm_generate import VllmFamily
from mindie.detokenizer import IncrementalDetokenizer
from mindie.errors import validation_error
from mindie.generation import Generation, Piece
from mindie.request_log import RequestRecord

# MindIE's answer to a /generate body with neither `inputs` nor `prompt` (http_handler.cpp
# HandlePostGenerate): a JSON text embedded as the message of a MindIE error.
NEITHER = ('{"Error": "`inputs` or `prompt` must be necessary and data type must be string. Additionally, '
           'the request body must be valid json", "error_type": "validation"}')
COMPAT_PARSE_ERROR = "Failed to parse context to json body"


class TgiFamily:
    """Parsing and answers of the TGI protocol (shared by the three routes)."""

    def __init__(self, base: GenerateBase):
        self.base = base
        self.tokenizer = base.tokenizer
        self.special = base.tokenizer.special_ids

    def parse_value(self, body, stream: bool) -> Job:
        b = self.base
        if type(body) is not dict:
            body = {}
        r = parse_tgi(body, b.limits, b.tokenizer.encode, stream, b.model_name)
        return Job(r.input_ids, r.sampling, stream=stream, stops=r.parameters.stop, extra=r, prompt=r.inputs)

    # -- tokens ------------------------------------------------------------------------------
    def _text_of(self, tok: int) -> str:
        return self.tokenizer.tokenizer.decode([tok], skip_special_tokens=False)

    def _token(self, tok: int, text: str, lp: float | None) -> dict:
        return {"id": tok, "text": text, "logprob": lp, "special": tok in self.special}

    def _top(self, tops: list[tuple[int, float]]) -> list[dict]:
        return [self._token(t, self._text_of(t), lp) for t, lp in tops]

    def _tokens(self, res: Result) -> list[dict]:
        detok = IncrementalDetokenizer(self.tokenizer)
        out = []
        for i, tok in enumerate(res.ids):
            text = self._text_of(tok) if tok in self.special else detok.push([tok])
            out.append(self._token(tok, text, res.logprobs[i] if i < len(res.logprobs) else None))
        return out

    def _prefill(self, r: TgiRequest, res: Result) -> list[dict]:
        if not r.parameters.decoder_input_details:
            return []
        lps = res.prompt_logprobs
        out = []
        for i, tok in enumerate(r.input_ids):
            lp = lps[i - 1] if 0 < i <= len(lps) else None  # the first prompt token has none
            out.append({"id": tok, "text": self._text_of(tok), "logprob": lp, "special": tok in self.special})
        return out

    # -- answers -----------------------------------------------------------------------------
    def result(self, job: Job, res: Result) -> dict:
        r: TgiRequest = job.extra
        pr = r.parameters
        out: dict = {"generated_text": (r.inputs if pr.return_full_text else "") + res.text}
        if pr.details or pr.decoder_input_details:
            d = {"prompt_tokens": len(r.input_ids), "finish_reason": finish_name(res.finish_reason),
                 "generated_tokens": len(res.ids), "seed": r.sampling.seed, "prefill": self._prefill(r, res),
                 "tokens": self._tokens(res)}
            if pr.top_n_tokens:
                d["top_tokens"] = [self._top(t) for t in res.top_logprobs]
            out["details"] = d
        return out

    def events(self, job: Job, gen: Generation, rec: RequestRecord,
               base: GenerateBase) -> AsyncIterator[bytes | None]:
        r: TgiRequest = job.extra
        pr = r.parameters
        index = 0
        last = 0

        def render(p: Piece) -> Iterator[bytes]:
            nonlocal index, last
            ids = p.token_ids or ([last] if p.finish_reason else [])
            n = len(ids)
            for i, tok in enumerate(ids):
                index += 1
                end = i == n - 1
                lp = p.logprobs[i] if i < len(p.logprobs) and p.token_ids else None
                ev: dict = {"index": index, "token": self._token(tok, p.text if end else "", lp)}
                if pr.top_n_tokens and i < len(p.top_logprobs):
                    ev["top_tokens"] = self._top(p.top_logprobs[i])
                final = bool(p.finish_reason) and end
                ev["generated_text"] = ((r.inputs if pr.return_full_text else "") + gen.text) if final else None
                ev["details"] = None
                if final and pr.details:
                    ev["details"] = {"prompt_tokens": len(r.input_ids),
                                     "finish_reason": finish_name(p.finish_reason),
                                     "generated_tokens": len(gen.token_ids), "seed": r.sampling.seed,
                                     "input_length": len(r.input_ids)}
                if final:
                    base.succeeded(rec, p.finish_reason)
                yield b"data:" + json_bytes(ev) + b"\n\n"
            if p.token_ids:
                last = p.token_ids[-1]

        return render_pieces(gen, rec, render)


class GenerateResource(GenerateBase):
    """``POST /generate`` (TGI or vLLM by the body), ``POST /generate_stream`` (suffix "stream")
    and ``POST /`` (suffix "compat")."""

    def __init__(self, fe) -> None:
        super().__init__(fe)
        self.tgi = TgiFamily(self)
        self.vllm = VllmFamily(self)

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        await self.serve(req, resp, mode="generate")

    async def on_post_stream(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        await self.serve(req, resp, mode="stream")

    async def on_post_compat(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        await self.serve(req, resp, mode="compat")

    def parse(self, req, body: bytes, kw: dict, rec: RequestRecord) -> Job:
        mode = kw["mode"]
        if mode == "generate":
            value = decode_json(body, NEITHER)
            if type(value) is dict and value.get("prompt") is not None:
                job = self.vllm.parse_value(value)
                job.extra = ("vllm", job.extra)
                return job
            if type(value) is not dict or value.get("inputs") is None:
                raise validation_error(NEITHER)
            job = self.tgi.parse_value(value, False)
        elif mode == "stream":
            job = self.tgi.parse_value(decode_json(body), True)
        else:
            value = decode_json(body, COMPAT_PARSE_ERROR)
            stream = value.get("stream") if type(value) is dict else None
            if stream is not None and type(stream) is not bool:
                raise validation_error("Stream must be boolean type.")
            job = self.tgi.parse_value(value, bool(stream))
        job.extra = (mode, job.extra)
        return job

    def _unwrap(self, job: Job) -> tuple[str, Job]:
        tag, extra = job.extra
        return tag, Job(job.input_ids, job.params, job.stream, job.stops, job.include_stop, job.priority,
                        job.timeout, job.user_id, extra, job.prompt)

    def reply(self, job: Job, res: Result, rec: RequestRecord) -> bytes:
        tag, inner = self._unwrap(job)
        if tag == "vllm":
            return self.vllm.result(inner, res)
        out = self.tgi.result(inner, res)
        return json_bytes([out] if tag == "compat" else out)

    def events(self, job: Job, gen: Generation, rec: RequestRecord) -> AsyncIterator[bytes | None]:
        tag, inner = self._unwrap(job)
        if tag == "vllm":
            return self.vllm.events(inner, gen, rec, self)
        return self.tgi.events(inner, gen, rec, self)

    def content_type(self, job: Job) -> str:
        return self.vllm.content_type if job.extra[0] == "vllm" else super().content_type(job)

    def stream_error(self, job: Job, status: int, message: str, etype: str) -> bytes:
        if job.extra[0] == "vllm":
            return self.vllm.stream_error(message, etype)
        return super().stream_error(job, status, message, etype)
