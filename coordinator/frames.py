"""Errors the coordinator writes itself, in the shape of the request's API family: a whole
answer before anything was sent, or the last frame of a stream an instance stopped answering.
The shapes are the server's own codecs' (``stream_error`` of mindie/api/infer.py,
mindie/api/openai.py, mindie/api/vllm_generate.py, mindie/pipeline.py for TGI and Triton)."""
from __future__ import annotations

from typing import Any

from mindie import sse
from mindie.api.openai import DONE, error_payload
from mindie.errors import ApiError
from mindie.responses import ErrorFrame

NATIVE, OPENAI, VLLM, TGI, TRITON, OTHER = "native", "openai", "vllm", "tgi", "triton", "other"


def family(path: str, body: Any) -> str:
    """The API family of a predict-port request (``/generate`` is vLLM's when it has a prompt)."""
    if path in ("/infer", "/infer_token"):
        return NATIVE
    if path.startswith("/v1/") and path.endswith("completions"):
        return OPENAI
    if path == "/generate":
        return VLLM if isinstance(body, dict) and "prompt" in body and "inputs" not in body else TGI
    if path in ("/generate_stream", "/"):
        return TGI
    if path.startswith("/v2/models/"):
        return TRITON
    return OTHER


def answer(fam: str, err: ApiError) -> tuple[int, bytes]:
    """(status, body) of an error answer."""
    if fam == OPENAI:
        import msgspec
        return err.status, msgspec.json.encode(error_payload(err))
    return err.status, err.body()


def stream_error(fam: str, err: ApiError) -> bytes:
    """The last frame of a stream cut after its first token."""
    if fam == NATIVE:
        return sse.json_event(ErrorFrame(err.message, err.error_type))
    if fam == OPENAI:
        return sse.json_event(error_payload(err)) + DONE
    if fam == VLLM:
        return err.body() + b"\0"
    return sse.event(err.body(), space=False)
