"""POST /infer and POST /infer_token: MindIE's native routes, token ids or text in, JSON or SSE out,
byte for byte as the seed example (shared/seed/infer_token_example.txt; bodies in
mindie/api/infer_responses.py, the body parser in mindie/api/infer_schema.py).

A stream sends one frame per generated token (``prefill_time`` on the first, ``decode_time`` on
the others: the step's time shared by its tokens); the last token goes out in the final frame,
``"text": null``, with ``generated_text`` and (with ``details``) the details. A deadline in an
open stream is MindIE's raw text (``Engine callback timeout: ...``), written into the stream
before it closes; any other error there is ``data: {"error", "error_type"}`` (the native family's
frames: mindie/contract/families.py)."""
from __future__ import annotations

from typing import Container

import falcon.asgi

from mindie.api import infer_responses as R
from mindie.api.infer_schema import InferRequest, parse_infer_request
from mindie.contract import families
from mindie.text.detokenizer import IncrementalDetokenizer, TextTokenizer
from mindie.text.generation import Piece
from mindie.pipeline import Codec, Context, Job, Output, Pipeline, Sub
from mindie.text.validation import Limits


class InferCodec(Codec):
    """MindIE's native shapes. The codec decodes ids itself, one token at a time."""

    detokenize = False
    family = families.NATIVE

    def __init__(self, tokenizer: TextTokenizer, limits: Limits, full_text: bool = False, model_name: str = "",
                 adapters: Container[str] = ()):
        """``full_text``: ServerConfig.fullTextEnabled, each stream frame's ``token.text`` is the
        text so far instead of the new piece; ``adapters``: the LoRA adapters ``parameters.adapter_id``
        may name besides ``model_name`` (mindie/lora_adapters.py)."""
        self.tokenizer = tokenizer
        self.limits = limits
        self.full_text = full_text
        self.model_name = model_name
        self.adapters = adapters

    def parse(self, body: bytes, ctx: Context) -> Job:
        r = parse_infer_request(body, self.limits, encode=self.tokenizer.encode, model_name=self.model_name,
                                adapters=self.adapters)
        return Job([Sub(r.input_ids, r.sampling, priority=r.priority, timeout=r.timeout, adapter=r.adapter)],
                   r.stream, r, ignored=r.ignored)

    def reply(self, job: Job, outs: list[Output], ctx: Context) -> bytes:
        r: InferRequest = job.request
        out = outs[0]
        details = R.Details(out.finish, len(out.ids), out.ids, r.sampling.seed) if r.details else None
        return R.reply(self.tokenizer.decode(out.ids), details)

    def render(self, job: Job, out: Output, p: Piece, ctx: Context) -> list[bytes]:
        st = out.state
        detok = st.get("detok")
        if detok is None:
            detok = st["detok"] = IncrementalDetokenizer(self.tokenizer)
            st["so_far"] = ""
        frames = []
        ids = p.token_ids
        n = len(ids)
        first = len(out.ids) == n  # no token before this piece
        prefill = decode = None
        last = n - 1 if p.finish_reason else -1  # the last token goes out in the final frame, "text": null
        for i, tok in enumerate(ids):
            prefill = R.ms(p.prefill_ms) if (first and i == 0) else None
            decode = None if prefill is not None else R.ms(p.decode_ms / n)
            text = detok.push([tok])
            if self.full_text:
                st["so_far"] = text = st["so_far"] + text
            if i == last:
                break
            frames.append(R.stream_frame([tok], text, prefill, decode))
        if p.finish_reason:
            r: InferRequest = job.request
            details = R.StreamDetails(p.finish_reason, len(out.ids), r.sampling.seed) if r.details else None
            frames.append(R.final_stream_frame(ids[-1:], prefill, decode, detok.full_text(), details))
        return frames


class InferResource:
    """The route of ``/infer`` and ``/infer_token``."""

    def __init__(self, pipeline: Pipeline, full_text: bool = False, model_name: str = ""):
        self.pipeline = pipeline
        self.codec = InferCodec(pipeline.tokenizer, pipeline.limits, full_text, model_name, pipeline.adapters)

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        await self.pipeline.serve(req, resp, self.codec)
