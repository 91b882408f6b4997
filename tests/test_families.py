"""The API families' contract (mindie/contract/families.py), in process: one ``/generate`` rule for
the server's codec and the coordinator, and each family's error bytes as both write them. The
real round trips (an instance's error frames, the coordinator's own) are tests/test_coordinator*.py,
test_openai.py, test_tgi.py, test_vllm_triton.py."""
from __future__ import annotations

import json

import pytest

from mindie.api.generate import GenerateCodec
from mindie.contract import families as F
from mindie.contract.http_error import ApiError


class _Pick:
    """Stands for a family's codec: its parse says which family was chosen."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse_value(self, value, *args) -> str:
        return self.name


@pytest.mark.parametrize("body,family", [
    ({"prompt": "a"}, F.VLLM),
    ({"prompt": "a", "inputs": "b"}, F.VLLM),  # prompt wins (MindIE's HandlePostGenerate)
    ({"inputs": "b"}, F.TGI),
    ({"prompt": None, "inputs": "b"}, F.TGI),  # a null prompt is no prompt
])
def test_one_generate_rule(body, family):
    """The server's /generate codec and the coordinator's routing choose the same family."""
    assert F.family("/generate", body) == family
    assert GenerateCodec(_Pick(F.TGI), _Pick(F.VLLM)).parse(json.dumps(body).encode(), None) == family


def test_families_of_paths():
    assert [F.family(p, None) for p in ("/infer", "/infer_token", "/v1/completions", "/v1/chat/completions",
                                        "/generate", "/generate_stream", "/", "/v2/models/m/generate_stream",
                                        "/v1/tokenizer", "/api/chat", "/api/tags")] == \
        [F.NATIVE, F.NATIVE, F.OPENAI, F.OPENAI, F.TGI, F.TGI, F.TGI, F.TRITON, F.OTHER, F.OLLAMA, F.OLLAMA]
    assert [F.family(p, None) for p in ("/v1/messages", "/v1/messages/count_tokens", "/v1/messagesx")] == \
        [F.ANTHROPIC, F.ANTHROPIC, F.OTHER]
    assert [F.family(p, None) for p in ("/v1/responses", "/v1/responses/resp_1", "/v1/responsesx")] == \
        [F.RESPONSES, F.RESPONSES, F.OTHER]
    assert F.streams("/v1/responses", {"stream": True}) and not F.streams("/v1/responses", {})
    # OpenAI's error object; inside a stream, the Responses error event (no [DONE])
    err = ApiError(400, "bad", param="input")
    assert F.error_answer(F.RESPONSES, err) == F.error_answer(F.OPENAI, err)
    assert F.stream_error(F.RESPONSES, err) == F.responses_error(err, 0) == (
        b'event: error\ndata: {"type":"error","code":"BadRequestError","message":"bad","param":"input",'
        b'"sequence_number":0}\n\n')
    assert F.terminator(F.RESPONSES) == b""
    assert [F.family(p, None) for p in ("/v1/embeddings", "/api/embed", "/v1/embeddingsx")] == \
        [F.OPENAI, F.OLLAMA, F.OTHER]
    # rerank (Cohere's and Jina's bodies): Cohere's {"message"}; vLLM's /score: OpenAI's
    assert [F.family(p, None) for p in ("/rerank", "/v1/rerank", "/v2/rerank", "/score", "/v1/score", "/v3/rerank")] == \
        [F.RERANK, F.RERANK, F.RERANK, F.OPENAI, F.OPENAI, F.OTHER]
    assert F.error_answer(F.RERANK, ApiError(400, "bad")) == (400, b'{"message":"bad"}')
    # a path no route serves: Anthropic's shape under /v1/messages, Ollama's under /api/, OpenAI's under /v1/,
    # else MindIE's
    assert [F.unrouted(p) for p in ("/v1/messages/batches", "/v1/nope", "/v1", "/nope", "/api/pull",
                                    "/v1/responses/r/input_items")] == \
        [F.ANTHROPIC, F.OPENAI, F.OTHER, F.OTHER, F.OLLAMA, F.OPENAI]


def test_ollama_streams_unless_told_not_to():
    """Ollama's chat and generate stream by default; every other family streams when asked."""
    assert F.streams("/api/chat", {}) and F.streams("/api/generate", {"stream": None})
    assert not F.streams("/api/chat", {"stream": False}) and not F.streams("/api/show", {})
    assert F.streams("/v1/chat/completions", {"stream": True}) and not F.streams("/v1/chat/completions", {})
    assert not F.streams("/api/chat", None)
    err = ApiError(404, "model 'x' not found")
    assert F.error_answer(F.OLLAMA, err) == (404, b'{"error":"model \'x\' not found"}')
    assert F.stream_error(F.OLLAMA, err) == b'{"error":"model \'x\' not found"}\n'
    assert F.terminator(F.OLLAMA) == b""


def test_error_bytes_per_family():
    err = ApiError(500, "worker lost \u2014 \"x\"")
    body = '{"error":"worker lost \u2014 \\"x\\"","error_type":"Incomplete Generation"}'.encode()
    openai = ('{"error":{"message":"worker lost \u2014 \\"x\\"","type":"InternalServerError","param":null,'
              '"code":500}}').encode()
    assert F.error_answer(F.NATIVE, err) == F.error_answer(F.TGI, err) == (500, body)
    assert F.error_answer(F.OPENAI, err) == (500, openai)
    assert F.stream_error(F.NATIVE, err) == b"data: " + body + b"\n\n"
    assert F.stream_error(F.OPENAI, err) == b"data: " + openai + b"\n\ndata: [DONE]\n\n"
    assert F.stream_error(F.VLLM, err) == body + b"\0"
    assert F.stream_error(F.TGI, err) == F.stream_error(F.TRITON, err) == b"data:" + body + b"\n\n"
    # a deadline in MindIE's native stream is its raw text
    assert F.stream_error(F.NATIVE, ApiError(500, "Engine callback timeout", timeout=True)) == \
        b"Engine callback timeout"
    assert F.terminator(F.OPENAI) == b"data: [DONE]\n\n" and F.terminator(F.TGI) == b""
    anthropic = '{"type":"error","error":{"type":"api_error","message":"worker lost \u2014 \\"x\\""}}'.encode()
    assert F.error_answer(F.ANTHROPIC, err) == (500, anthropic)
    assert F.stream_error(F.ANTHROPIC, err) == b"event: error\ndata: " + anthropic + b"\n\n"
    assert F.terminator(F.ANTHROPIC) == b""
    assert [F.anthropic_error(ApiError(s, "m"))["error"]["type"] for s in (400, 404, 413, 422, 503, 500)] == \
        ["invalid_request_error", "not_found_error", "request_too_large", "invalid_request_error", "overloaded_error",
         "api_error"]
    # OpenAI's types by status; 422 (a MindIE check) reads as the client's fault
    assert F.openai_error(ApiError(422, "bad", param="n"))["error"] == {
        "message": "bad", "type": "BadRequestError", "param": "n", "code": 422}
