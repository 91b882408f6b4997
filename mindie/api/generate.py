"""``POST /generate``: one path, two protocols, told apart here by the contract's one rule.

MindIE serves TGI's and vLLM's ``/generate`` on the same path and chooses by the body
(http_handler.cpp ``HandlePostGenerate``):

- an object with a non-null ``prompt`` is vLLM's (mindie/api/vllm_generate.py; ``prompt`` wins
  when ``inputs`` is there too): the contract's one rule (mindie/contract/families.py
  ``is_vllm_generate``), which the coordinator follows too;
- else an object with a non-null ``inputs`` is TGI's (mindie/api/tgi.py), never streamed here;
- anything else (neither key, not an object, not JSON) is 422 with MindIE's embedded message
  ``NEITHER``.

The chosen family's codec then parses the body and renders the answer and its errors.
"""
from __future__ import annotations

import falcon.asgi

from mindie.api.tgi import TgiCodec
from mindie.api.vllm_generate import VllmCodec
from mindie.contract.families import is_vllm_generate
from mindie.contract.http_error import validation_error
from mindie.pipeline import Codec, Context, Job, Pipeline
from mindie.text.validation import decode_json

# MindIE's answer to a /generate body with neither `inputs` nor `prompt` (http_handler.cpp
# HandlePostGenerate): a JSON text embedded as the message of a MindIE error.
NEITHER = ('{"Error": "`inputs` or `prompt` must be necessary and data type must be string. Additionally, '
           'the request body must be valid json", "error_type": "validation"}')


class GenerateCodec(Codec):
    """Chooses the family of a ``/generate`` body; the job it returns names that family's codec."""

    def __init__(self, tgi: TgiCodec, vllm: VllmCodec):
        self.tgi = tgi
        self.vllm = vllm

    def parse(self, body: bytes, ctx: Context) -> Job:
        value = decode_json(body, NEITHER)
        if is_vllm_generate(value):
            return self.vllm.parse_value(value)
        if type(value) is not dict or value.get("inputs") is None:
            raise validation_error(NEITHER)
        return self.tgi.parse_value(value, False)


class GenerateResource:
    """The route of ``POST /generate``."""

    def __init__(self, pipeline: Pipeline, model_name: str):
        tok, lim = pipeline.tokenizer, pipeline.limits
        self.pipeline = pipeline
        self.codec = GenerateCodec(TgiCodec(tok, lim, model_name, "generate", pipeline.adapters, pipeline.structured),
                                   VllmCodec(tok, lim, model_name, pipeline.adapters, pipeline.structured))

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        await self.pipeline.serve(req, resp, self.codec)
