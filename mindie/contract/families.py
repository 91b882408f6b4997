"""The API families of the predict port and how each one says that a request failed: one rule,
used by the server (its codecs, mindie/api/ and mindie/pipeline.py) and by the coordinator
(coordinator/relay.py), so both answer a request of one family in the same bytes.

- ``family(path, body)``: the family of a request: MindIE's native ``/infer`` and
  ``/infer_token``; OpenAI's ``/v1/*completions`` and ``/v1/embeddings``; vLLM's or TGI's ``/generate``, told apart by
  the body (``is_vllm_generate``: MindIE's rule); TGI's ``/generate_stream`` and ``/``; Triton's
  ``/v2/models/...``; Ollama's ``/api/...``; Anthropic's ``/v1/messages`` (and paths under it);
  OpenAI's Responses ``/v1/responses`` (and paths under it: its errors are OpenAI's object, its
  stream's error frame is its own ``error`` event, so it is a family of its own); rerank's
  ``/rerank``, ``/v1/rerank``, ``/v2/rerank`` (Jina's and Cohere's bodies; never streamed) and
  vLLM's ``/score``, ``/v1/score`` (OpenAI's);
  anything else ``OTHER`` (MindIE's shape).
- ``streams(path, body)``: whether the body asks for a stream (its ``stream`` true; Ollama's chat
  and generate stream unless it is false).
- ``unrouted(path)``: the family whose shape answers a path no route serves (404): Anthropic's
  under ``/v1/messages``, Ollama's under ``/api/``, OpenAI's for any other ``/v1/...`` (what
  OpenAI clients read), else MindIE's.
- ``error_answer(fam, err)``: (status, body) of an error answered before the answer started:
  MindIE's ``{"error", "error_type"}`` (mindie/contract/http_error.py), OpenAI's
  ``{"error": {"message", "type", "param", "code"}}`` (vLLM's types, ``code`` = the status),
  Anthropic's ``{"type": "error", "error": {"type", "message"}}`` (its types by status: a 503
  keeps its status, which the coordinator retries on, with Anthropic's ``overloaded_error``);
  Ollama's ``{"error": "..."}``; rerank's Cohere ``{"message": "..."}`` (what Cohere's API
  answers; the ``cohere`` client keeps any JSON body as its error's ``body``).
- ``stream_error(fam, err)``: the bytes that end a stream that failed after it started: the
  family's error frame, then its terminator (``terminator``: OpenAI's ``data: [DONE]``, none
  for the others). Native: ``data: {"error", "error_type"}`` (a deadline: MindIE's raw text);
  OpenAI: ``data: {"error": {...}}``; Anthropic: ``event: error`` with its error object;
  Responses: ``event: error`` with ``{type: "error", code, message, param, sequence_number}``
  (``responses_error``: the server's codec numbers it in its stream; the coordinator, which does
  not count the instance's events, writes 0); vLLM's
  ``/generate`` (not SSE): the MindIE body and a NUL; Ollama (NDJSON, not SSE): the line
  ``{"error": "..."}``; TGI, Triton and the rest:
  ``data:{"error", "error_type"}`` (no space, as MindIE).
"""
from __future__ import annotations

from typing import Any

import msgspec

from mindie.contract.http_error import ApiError
from mindie.contract.sse_framing import DONE, event, json_event, named_event

NATIVE, OPENAI, VLLM, TGI, TRITON, OLLAMA, ANTHROPIC, RESPONSES, RERANK, OTHER = (
    "native", "openai", "vllm", "tgi", "triton", "ollama", "anthropic", "responses", "rerank", "other")
RERANK_PATHS = frozenset({"/rerank", "/v1/rerank", "/v2/rerank"})
SCORE_PATHS = frozenset({"/score", "/v1/score"})  # vLLM's: OpenAI's error object
OLLAMA_GENERATION = frozenset({"/api/chat", "/api/generate"})  # stream unless the body says "stream": false

# vLLM's error types of OpenAI's error object, by HTTP status.
OPENAI_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestEntityTooLargeError",
                      500: "InternalServerError", 503: "ServiceUnavailableError"}
# Anthropic's error types, by HTTP status (its 529 "overloaded" is our 503).
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}

_encode = msgspec.json.encode


def is_vllm_generate(body: Any) -> bool:
    """Whether a decoded ``/generate`` body is vLLM's: an object with a non-null ``prompt``
    (``prompt`` wins when ``inputs`` is there too; MindIE's http_handler.cpp
    ``HandlePostGenerate``). Otherwise it is TGI's (when it has ``inputs``; the server refuses it
    when it has neither)."""
    return isinstance(body, dict) and body.get("prompt") is not None


def family(path: str, body: Any) -> str:
    """The API family of a predict-port request (``body``: its decoded JSON, None when unknown)."""
    if path in ("/infer", "/infer_token"):
        return NATIVE
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return ANTHROPIC
    if path == "/v1/responses" or path.startswith("/v1/responses/"):
        return RESPONSES
    if (path.startswith("/v1/") and path.endswith("completions")) or path == "/v1/embeddings" or path in SCORE_PATHS:
        return OPENAI
    if path in RERANK_PATHS:
        return RERANK
    if path == "/generate":
        return VLLM if is_vllm_generate(body) else TGI
    if path in ("/generate_stream", "/"):
        return TGI
    if path.startswith("/v2/models/"):
        return TRITON
    if path.startswith("/api/"):
        return OLLAMA
    return OTHER


def streams(path: str, body: Any) -> bool:
    """Whether a request's body asks for a stream (``body``: its decoded JSON, None when unknown;
    the routes that stream by their path, TGI's and Triton's ``generate_stream``, always do)."""
    if not isinstance(body, dict):
        return False
    if path in OLLAMA_GENERATION:
        return body.get("stream") is not False
    return body.get("stream") is True


def unrouted(path: str) -> str:
    """The family whose shape answers ``path`` when no route serves it."""
    fam = family(path, None)
    if fam in (ANTHROPIC, OLLAMA):
        return fam
    return OPENAI if path.startswith("/v1/") else OTHER


def anthropic_error(err: ApiError) -> dict:
    """Anthropic's error object."""
    etype = ANTHROPIC_ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": etype, "message": err.message}}


def openai_error(err: ApiError) -> dict:
    """OpenAI's error object (vLLM's types; ``code`` = the HTTP status)."""
    etype = OPENAI_ERROR_TYPES.get(err.status, "InternalServerError" if err.status >= 500 else "BadRequestError")
    return {"error": {"message": err.message, "type": etype, "param": err.param, "code": err.status}}


def responses_error(err: ApiError, sequence_number: int = 0) -> bytes:
    """The ``error`` event that ends a Responses stream that failed after it started."""
    e = openai_error(err)["error"]
    return named_event("error", {"type": "error", "code": e["type"], "message": err.message, "param": err.param,
                                 "sequence_number": sequence_number})


def error_answer(fam: str, err: ApiError) -> tuple[int, bytes]:
    """(status, body) of an error answer before anything was sent."""
    if fam in (OPENAI, RESPONSES):
        return err.status, _encode(openai_error(err))
    if fam == OLLAMA:
        return err.status, _encode({"error": err.message})
    if fam == RERANK:
        return err.status, _encode({"message": err.message})
    if fam == ANTHROPIC:
        return err.status, _encode(anthropic_error(err))
    return err.status, err.body()


def terminator(fam: str) -> bytes:
    """What ends every stream of ``fam`` (after its last event or its error frame)."""
    return DONE if fam == OPENAI else b""


def stream_error(fam: str, err: ApiError) -> bytes:
    """The last bytes of a stream that failed after it started: the error frame and the terminator."""
    if fam == NATIVE:
        if err.timeout:  # MindIE writes a deadline's raw text into the open stream, then closes it
            return err.message.encode()
        return event(err.body())
    if fam == OPENAI:
        return json_event(openai_error(err)) + terminator(fam)
    if fam == ANTHROPIC:
        return named_event("error", anthropic_error(err))
    if fam == RESPONSES:
        return responses_error(err)
    if fam == VLLM:
        return err.body() + b"\0"
    if fam == OLLAMA:
        return _encode({"error": err.message}) + b"\n"
    return event(err.body(), space=False)
