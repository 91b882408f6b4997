"""``POST /v1/embeddings`` (OpenAI's body and answer) and Ollama's ``POST /api/embed``.

Each input is one pooling submission (``SamplingParams.pooling``): the worker computes the prompt
only, samples nothing, frees its KV blocks at once and answers with the pooled final hidden state
(``TokenFrame.embedding``, float32 bytes). The pooling rule is the model's (mindie/text/pooling.py);
normalising and a Matryoshka truncation (``dimensions``) happen here.

OpenAI: ``input`` is a string, a list of strings, a list of token ids or a list of token-id lists;
``encoding_format`` ``float`` (a list of numbers) or ``base64`` (little-endian float32 bytes, what
the ``openai`` package asks by default); ``dimensions`` only where the model is Matryoshka-trained;
``model`` checked as on the completion routes. The answer: ``{"object": "list", "data": [{"object":
"embedding", "index", "embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}``; errors
in OpenAI's shape (a 400 names the field in ``param``).

Ollama: ``input`` a string or a list of strings, ``dimensions``, ``truncate`` (accepted; inputs over
the limit are refused either way); the answer ``{"model", "embeddings", "total_duration",
"load_duration", "prompt_eval_count"}`` (durations in ns).
"""
from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Container

import falcon.asgi
import msgspec

from mindie.api.ollama import check_model as ollama_check_model
from mindie.api.openai import OpenAIResource, _OpenAICodec
from mindie.api.openai_schema import decode_body
from mindie.contract import families
from mindie.contract import wire as P
from mindie.contract.http_error import ApiError
from mindie.pipeline import Context, Job, Output, Pipeline, Sub
from mindie.text.pooling import Pooling

if TYPE_CHECKING:  # numpy is imported by the first answer, not at every front end's start
    import numpy as np

FORMATS = ("float", "base64")


@dataclass
class EmbeddingRequest:
    """A validated request: what the answer needs."""

    encoding_format: str
    dimensions: int | None
    adapter: str  # the LoRA adapter ``model`` names ("" = the base model)
    t0: float = 0.0
    model: str = ""  # the answer's ``model`` ("" = the adapter's name, else the served model's)


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param)


_any_json = msgspec.json.Decoder()


def _body(body: bytes) -> dict:
    # the OpenAI routes' decode: empty and over-deep bodies refused before any recursive decode
    d = decode_body(_any_json, body)
    if not isinstance(d, dict):
        raise _bad("The body must be a JSON object", "body")
    return d


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


class EmbeddingsCodec(_OpenAICodec):
    """POST /v1/embeddings: the OpenAI codec's model and token checks, pooling submissions."""

    detokenize = False  # the answer is the vector, no text

    def __init__(self, *args: Any, pooling: Pooling, **kw: Any):
        super().__init__(*args, **kw)
        self.pooling = pooling

    # -- parsing -------------------------------------------------------------------------------
    def _inputs(self, raw: Any) -> list[list[int]]:
        """OpenAI's four ``input`` forms as token-id lists (each checked as a prompt is)."""
        if isinstance(raw, str):
            raw = [raw]
        elif _is_ids(raw):
            raw = [raw]
        if not isinstance(raw, list) or not raw:
            raise _bad("input must be a non-empty string, a list of strings, a list of token ids or a list "
                       "of token-id lists", "input")
        if len({isinstance(item, str) for item in raw}) > 1:
            raise _bad("input must be all strings or all token-id lists, not a mix", "input")
        out = []
        for item in raw:
            if isinstance(item, str):
                if not item:
                    raise _bad("input must not contain an empty string", "input")
                ids = self.tokenizer.encode(item)
            elif _is_ids(item):
                ids = list(item)
            else:
                raise _bad("each input must be a non-empty string or a non-empty list of token ids", "input")
            if not ids:
                raise _bad("an input encodes to no tokens", "input")
            try:
                out.append(self._check_ids(ids))
            except ApiError as e:
                raise ApiError(400, e.message, param="input") from None
        return out

    def _dimensions(self, dims: Any) -> int | None:
        if dims is None:
            return None
        if not isinstance(dims, int) or isinstance(dims, bool):
            raise _bad("dimensions must be an integer", "dimensions")
        if why := self.pooling.check_dimensions(dims):
            raise _bad(why, "dimensions")
        return dims

    def _job(self, inputs: list[list[int]], req: EmbeddingRequest) -> Job:
        subs = [Sub(ids, P.SamplingParams(max_new_tokens=1, pooling=self.pooling.kind), prompt=i,
                    adapter=req.adapter) for i, ids in enumerate(inputs)]
        return Job(subs, request=req)

    def parse(self, body: bytes, ctx: Context) -> Job:
        d = _body(body)
        adapter = self._check_model(d.get("model"))
        fmt = d.get("encoding_format") or "float"
        if fmt not in FORMATS:
            raise _bad(f"encoding_format must be one of {list(FORMATS)}, got {fmt!r}", "encoding_format")
        if "input" not in d:
            raise _bad("input is required", "input")
        req = EmbeddingRequest(fmt, self._dimensions(d.get("dimensions")), adapter, time.monotonic())
        return self._job(self._inputs(d["input"]), req)

    # -- the answer ----------------------------------------------------------------------------
    def vectors(self, job: Job, outs: list[Output]) -> list[np.ndarray]:
        """Each input's vector, truncated to ``dimensions`` and normalised as the model says."""
        import numpy as np  # the front end's one numpy use besides rerank: imported once, here

        dims = job.request.dimensions
        vecs = []
        for o in sorted(outs, key=lambda o: o.index):
            if not o.embedding:
                raise ApiError(500, "Internal error: the device worker sent no embedding")
            v = np.frombuffer(o.embedding, dtype="<f4")
            if dims is not None:
                v = v[:dims]
            if self.pooling.normalize:
                v = v / max(float(np.linalg.norm(v)), 1e-12)  # sentence-transformers' Normalize (eps 1e-12)
            vecs.append(v.astype("<f4"))
        return vecs

    def reply(self, job: Job, outs: list[Output], ctx: Context) -> bytes:
        req: EmbeddingRequest = job.request
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.tobytes()).decode() if req.encoding_format == "base64" else v.tolist()}
                for i, v in enumerate(self.vectors(job, outs))]
        n = job.prompt_tokens()
        return msgspec.json.encode({"object": "list", "data": data, "model": req.adapter or self.model_name,
                                    "usage": {"prompt_tokens": n, "total_tokens": n}})


class OllamaEmbedCodec(EmbeddingsCodec):
    """POST /api/embed: Ollama's body and answer on the same pooling submissions."""

    family = families.OLLAMA

    def refused(self, err: ApiError) -> ApiError:
        return ApiError(400, err.message) if err.status in (422, 424) else err

    def parse(self, body: bytes, ctx: Context) -> Job:
        d = _body(body)
        model = d.get("model")
        adapter = ollama_check_model(model if isinstance(model, str) else None, self.model_name, self.adapters) or ""
        raw = d.get("input")
        if not (isinstance(raw, str) or (isinstance(raw, list) and all(isinstance(s, str) for s in raw))):
            raise ApiError(400, "input must be a string or a list of strings")
        req = EmbeddingRequest("float", self._dimensions(d.get("dimensions")), adapter, time.monotonic(), model)
        return self._job(self._inputs(raw), req)

    def reply(self, job: Job, outs: list[Output], ctx: Context) -> bytes:
        req: EmbeddingRequest = job.request
        total = int((time.monotonic() - req.t0) * 1e9)
        return msgspec.json.encode({"model": req.model,
                                    "embeddings": [v.tolist() for v in self.vectors(job, outs)],
                                    "total_duration": total, "load_duration": 0,
                                    "prompt_eval_count": job.prompt_tokens()})


def embedding_routes(fe: Any, pipeline: Pipeline, pooling: Pooling,
                     adapters: Container[str]) -> tuple[OpenAIResource, OpenAIResource]:
    """The ``/v1/embeddings`` and ``/api/embed`` resources of a front end."""
    args = (fe.tokenizer, fe.limits, fe.model_name)
    kw = dict(pooling=pooling, adapters=adapters, structured=pipeline.structured)
    return OpenAIResource(pipeline, EmbeddingsCodec(*args, **kw)), OpenAIResource(pipeline, OllamaEmbedCodec(*args, **kw))
