"""Rerank and score: ``POST /rerank``, ``/v1/rerank``, ``/v2/rerank`` (Jina's and Cohere's bodies) and
``POST /score``, ``/v1/score`` (vLLM's).

Each (query, document) pair is one pooling submission of kind "score" (``SamplingParams.pooling``,
as the embeddings are: mindie/api/embeddings.py): the worker computes the prompt only and answers
with the last position's head logits (``TokenFrame.embedding``: a cross-encoder's one logit, or a
decoder reranker's "no"/"yes" logits, ``SamplingParams.score_tokens``); the rule that encodes the
pair and turns those logits into a score in [0, 1] is the model's (mindie/text/rerank.py).

Rerank body: ``model``, ``query`` (a non-empty string), ``documents`` (a non-empty list of strings,
or of objects with a ``text`` string, Cohere v1's and Jina's), ``top_n`` (>= 1; more than the
documents is all of them), ``return_documents`` (default true on ``/rerank`` and ``/v1/rerank``, as
Jina and vLLM answer; false on ``/v2/rerank``, whose Cohere v2 answer has no documents);
``max_tokens_per_doc`` (Cohere v2) cuts each document to that many tokens. The answer:
``{"id", "model", "results": [{"index", "relevance_score", "document"?: {"text"}}] (best first),
"usage": {"prompt_tokens", "total_tokens"}, "meta": {"api_version": {"version"}, "billed_units":
{"search_units": 1}, "tokens": {"input_tokens", "output_tokens": 0}}}``: Jina's and vLLM's fields and
Cohere's (``id``, ``meta``), so the ``cohere`` client's ``RerankResponse``/``V2RerankResponse`` read it.
Errors: Cohere's ``{"message": ...}`` (families.RERANK), which the ``cohere`` client keeps as the
error's ``body``.

Score body (vLLM): ``text_1`` and ``text_2``, each a string or a list of strings: one ``text_1`` is
paired with every ``text_2``, else both lists have the same length and are paired in order. The
answer: ``{"id", "object": "list", "created", "model", "data": [{"index", "object": "score",
"score"}], "usage"}``; errors in OpenAI's shape.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Container

import msgspec

from mindie.api.embeddings import _body
from mindie.api.openai import OpenAIResource, _OpenAICodec
from mindie.contract import families
from mindie.contract import wire as P
from mindie.contract.http_error import ApiError
from mindie.pipeline import Context, Job, Output, Pipeline, Sub
from mindie.text.rerank import Scorer

MAX_DOCUMENTS = 1000  # Cohere's advice for one request; more is refused (each is a submission)


@dataclass
class ScoreRequest:
    """A validated request: what the answer needs."""

    adapter: str
    documents: list[str]  # the texts paired with the query (rerank) or text_2 (score)
    top_n: int = 0
    return_documents: bool = False
    api_version: str = "1"


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param)


def _int(d: dict, key: str, minimum: int) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise _bad(f"{key} must be an integer >= {minimum}, got {v!r}", key)
    return v


class _ScoreCodec(_OpenAICodec):
    """The pairs of a request as score submissions, with the OpenAI codec's model and length checks."""

    detokenize = False  # the answer is a number, no text

    def __init__(self, *args: Any, scorer: Scorer, **kw: Any):
        super().__init__(*args, **kw)
        self.scorer = scorer

    def _read(self, body: bytes) -> tuple[dict, str]:
        """The body's object and the LoRA adapter its ``model`` names ("" = the base model)."""
        d = _body(body)
        model = d.get("model")
        if model is not None and not isinstance(model, str):
            raise _bad("model must be a string", "model")
        return d, self._check_model(model)

    def _pairs(self, query_docs: list[tuple[str, str]], adapter: str, cut: int | None = None) -> list[Sub]:
        if self.scorer.why:
            raise ApiError(400, self.scorer.why, param="model")
        subs = []
        for i, (q, doc) in enumerate(query_docs):
            if cut is not None:  # Cohere v2's max_tokens_per_doc: the document's first tokens
                enc = self.tokenizer.tokenizer.encode(doc, add_special_tokens=False)
                doc = doc[:enc.offsets[cut - 1][1]] if len(enc.ids) > cut else doc
            ids = self.scorer.pair_ids(self.tokenizer, q, doc)
            try:
                ids = self._check_ids(ids)
            except ApiError as e:
                raise ApiError(400, f"pair {i}: {e.message}", param=e.param) from None
            params = P.SamplingParams(max_new_tokens=1, pooling="score", score_tokens=list(self.scorer.tokens))
            subs.append(Sub(ids, params, prompt=i, adapter=adapter))
        return subs

    def scores(self, outs: list[Output]) -> list[float]:
        """Each pair's score, in the request's order."""
        import numpy as np  # imported by the first answer, not at every front end's start

        out = []
        for o in sorted(outs, key=lambda o: o.index):
            if not o.embedding:
                raise ApiError(500, "Internal error: the device worker sent no score")
            out.append(self.scorer.score(np.frombuffer(o.embedding, dtype="<f4")))
        return out


class RerankCodec(_ScoreCodec):
    """/rerank, /v1/rerank (Jina, Cohere v1, vLLM), /v2/rerank (Cohere v2)."""

    family = families.RERANK

    def __init__(self, *args: Any, api_version: str = "1", **kw: Any):
        super().__init__(*args, **kw)
        self.api_version = api_version

    def _documents(self, raw: Any) -> list[str]:
        if not isinstance(raw, list) or not raw:
            raise _bad("documents must be a non-empty list of strings (or of objects with a text string)", "documents")
        if len(raw) > MAX_DOCUMENTS:
            raise _bad(f"documents holds {len(raw)} documents; at most {MAX_DOCUMENTS} are scored in one request",
                       "documents")
        docs = []
        for i, d in enumerate(raw):
            text = d.get("text") if isinstance(d, dict) else d
            if not isinstance(text, str):
                raise _bad(f"documents[{i}] must be a string or an object with a text string", "documents")
            docs.append(text)
        return docs

    def parse(self, body: bytes, ctx: Context) -> Job:
        d, adapter = self._read(body)
        query = d.get("query")
        if not isinstance(query, str) or not query:
            raise _bad("query must be a non-empty string", "query")
        docs = self._documents(d.get("documents"))
        top_n = _int(d, "top_n", 1)
        cut = _int(d, "max_tokens_per_doc", 1)
        ret = d.get("return_documents", self.api_version != "2")
        if not isinstance(ret, bool):
            raise _bad(f"return_documents must be true or false, got {ret!r}", "return_documents")
        req = ScoreRequest(adapter, docs, min(top_n or len(docs), len(docs)), ret, self.api_version)
        return Job(self._pairs([(query, doc) for doc in docs], adapter, cut), request=req)

    def reply(self, job: Job, outs: list[Output], ctx: Context) -> bytes:
        req: ScoreRequest = job.request
        scores = self.scores(outs)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n]  # stable: ties keep input order
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": req.documents[i]}} if req.return_documents else {})} for i in order]
        n = job.prompt_tokens()
        return msgspec.json.encode({
            "id": str(uuid.uuid4()), "model": req.adapter or self.model_name, "results": results,
            "usage": {"prompt_tokens": n, "total_tokens": n},
            "meta": {"api_version": {"version": req.api_version}, "billed_units": {"search_units": 1},
                     "tokens": {"input_tokens": n, "output_tokens": 0}}})


class ScoreCodec(_ScoreCodec):
    """/score, /v1/score (vLLM): text_1 against text_2."""

    @staticmethod
    def _texts(d: dict, key: str) -> list[str]:
        v = d.get(key)
        v = [v] if isinstance(v, str) else v
        if not isinstance(v, list) or not v or not all(isinstance(s, str) for s in v):
            raise _bad(f"{key} must be a string or a non-empty list of strings", key)
        if len(v) > MAX_DOCUMENTS:
            raise _bad(f"{key} holds {len(v)} texts; at most {MAX_DOCUMENTS} are scored in one request", key)
        return v

    def parse(self, body: bytes, ctx: Context) -> Job:
        d, adapter = self._read(body)
        t1, t2 = self._texts(d, "text_1"), self._texts(d, "text_2")
        if len(t1) == 1:
            t1 = t1 * len(t2)
        if len(t1) != len(t2):
            raise _bad(f"text_1 ({len(t1)} texts) and text_2 ({len(t2)}) must have the same length, or text_1 "
                       "one text", "text_2")
        return Job(self._pairs(list(zip(t1, t2)), adapter), request=ScoreRequest(adapter, t2))

    def reply(self, job: Job, outs: list[Output], ctx: Context) -> bytes:
        req: ScoreRequest = job.request
        n = job.prompt_tokens()
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(self.scores(outs))]
        return msgspec.json.encode({
            "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": req.adapter or self.model_name, "data": data,
            "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}})


def rerank_routes(fe: Any, pipeline: Pipeline, scorer: Scorer,
                  adapters: Container[str]) -> tuple[OpenAIResource, OpenAIResource, OpenAIResource]:
    """The resources of ``/rerank`` and ``/v1/rerank``, ``/v2/rerank``, and ``/score`` and ``/v1/score``."""
    args = (fe.tokenizer, fe.limits, fe.model_name)
    kw = dict(scorer=scorer, adapters=adapters, structured=pipeline.structured)
    return (OpenAIResource(pipeline, RerankCodec(*args, api_version="1", **kw)),
            OpenAIResource(pipeline, RerankCodec(*args, api_version="2", **kw)),
            OpenAIResource(pipeline, ScoreCodec(*args, **kw)))
