"""Ollama's ``POST /api/chat`` and ``POST /api/generate``, on the shared pipeline (mindie/pipeline.py).

The body is translated (mindie/api/ollama_schema.py) into the OpenAI chat body (chat; generate
with its prompt and ``system`` as one user turn) or completion body (generate ``raw``: the prompt
as it is), and the OpenAI route's codec (mindie/api/openai.py) parses it: the chat template,
tools and their parser, the reasoning parser and structured output are that codec's, the same
for both families. What comes back is rendered here in Ollama's shapes:

- a stream (Ollama's default: ``stream`` absent is true) is NDJSON (``application/x-ndjson``),
  one object per line: ``{model, created_at, message: {role, content[, thinking]}, done: false}``
  (generate: ``response[, thinking]``), then the last one with ``done: true``, ``done_reason``
  ("stop" or "length"), the durations (nanoseconds) and counts; a non-stream answer is one object
  with the whole text and the same last fields;
- ``prompt_eval_count``: the prompt's tokens; ``eval_count``: the generated tokens (the
  OpenAI route's usage counts); ``prompt_eval_duration``: the worker's time to the first token;
  ``eval_duration``: its time for the later ones; ``total_duration``: the request's, from its
  arrival; ``load_duration``: 0 (the model is loaded when the server is ready);
- tool calls (chat ``tools``): ``message.tool_calls`` ``[{function: {name, arguments}}]`` with
  the arguments an object (a stream gives them on its last line, once parsed whole); ``think``
  true on a model without a reasoning parser is a 400 (as Ollama); ``think`` false leaves the
  answer unsplit;
- an empty prompt (generate) or no messages (chat) loads nothing and answers at once with
  ``done_reason: "load"``, as Ollama does;
- ``model``: the served name, or it with ``:latest`` (Ollama's clients add it), or a LoRA
  adapter's name; any other is a 404 ``{"error": "model 'x' not found"}``. Errors are Ollama's
  ``{"error": "..."}`` with the status; inside a stream, an NDJSON line ``{"error": "..."}``
  (mindie/contract/families.py, which the coordinator writes too).
"""
from __future__ import annotations

import json
from collections.abc import Container, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
import falcon.asgi
import msgspec

from mindie.api import ollama_schema as S
from mindie.api import field_names
from mindie.api.openai import ChatCompletionsCodec, CompletionsCodec
from mindie.contract import families
from mindie.contract.errors import FINISH_LENGTH
from mindie.contract.http_error import ApiError
from mindie.text.generation import Piece
from mindie.pipeline import Codec, Context, Job, Output, Pipeline

NDJSON = "application/x-ndjson"
_enc = msgspec.json.Encoder()


def created_at() -> str:
    """Now as Ollama writes it: RFC 3339, UTC, with fractional seconds."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def line(obj: dict) -> bytes:
    return _enc.encode(obj) + b"\n"


def model_names(served: str) -> tuple[str, ...]:
    """The names that mean the served model: its own, and with Ollama's default tag."""
    return (served, f"{served}:latest")


def check_model(model: str | None, served: str, adapters: Container[str]) -> str | None:
    """The OpenAI body's ``model`` for an Ollama ``model`` (None: the base model); 404 else."""
    if not model:
        raise ApiError(400, "model is required")
    if model in model_names(served):
        return None
    name = model.removesuffix(":latest")
    if name in adapters:
        return name
    raise ApiError(404, f"model '{model}' not found")


def tool_calls(calls: list[dict]) -> list[dict]:
    """OpenAI's tool_call objects as Ollama's: the arguments an object (a call cut short, whose
    arguments are not JSON yet, has none)."""
    out = []
    for i, c in enumerate(calls):
        fn = c["function"]
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = {}
        out.append({"function": {"index": i, "name": fn["name"], "arguments": args if isinstance(args, dict) else {}}})
    return out


@dataclass
class OllamaRequest:
    """An Ollama request: its model name as sent, and the job of the OpenAI codec serving it."""

    model: str
    inner: Job | None  # None: nothing to generate (done_reason "load")
    chat: bool  # the chat codec serves it (else the completion codec: generate raw)


class _OllamaCodec(Codec):
    family = families.OLLAMA
    content_type = NDJSON
    key = ""  # "message" (chat) | "response" (generate)

    def __init__(self, chat: ChatCompletionsCodec, completions: CompletionsCodec, adapters: Container[str] = ()):
        self.chat = chat
        self.completions = completions
        self.adapters = adapters

    def refused(self, err: ApiError) -> ApiError:
        # MindIE's 422/424 checks are the client's fault (400); errors name Ollama's fields
        return field_names.renamed(self.chat.refused(err), field_names.OLLAMA)

    def _job(self, model: str, body: dict, chat: bool, r: S._Generation, raw: bytes, ctx: Context) -> Job:
        """The Ollama job wrapping the OpenAI codec's job of ``body``."""
        adapter = check_model(model, self.chat.model_name, self.adapters)
        if adapter is not None:
            body["model"] = adapter
        codec = self.chat if chat else self.completions
        inner = codec.parse(_enc.encode(body), ctx)
        if chat and r.think is not None:
            if r.think is not False and self.chat.reasoning is None:
                raise ApiError(400, f'"{model}" does not support thinking')
            if r.think is False:
                inner.request.reasoning = None  # the answer as the model wrote it, unsplit
        typical = r.options.typical_p if r.options is not None else None
        if typical is not None:
            for sub in inner.subs:
                sub.params = msgspec.structs.replace(sub.params, typical_p=typical)
        return Job(inner.subs, inner.stream, OllamaRequest(model, inner, chat), checks=inner.checks,
                   ignored=S.ignored(raw, chat=self.key == "message"))

    def _loaded(self, model: str, r: S._Generation) -> Job:
        """Nothing to generate: Ollama's answer that the model is loaded."""
        check_model(model, self.chat.model_name, self.adapters)
        return Job([], S.streams(r), OllamaRequest(model, None, True))

    # -- what is said ----------------------------------------------------------------------------
    def _part(self, text: str, thinking: str | None = None) -> dict:
        raise NotImplementedError

    def _head(self, job: Job) -> dict:
        return {"model": job.request.model, "created_at": created_at()}

    def _whole(self, job: Job, out: Output) -> tuple[str, str | None, list[dict]]:
        """(content, thinking, tool calls) of a whole answer."""
        req: OllamaRequest = job.request
        if not req.chat:
            return out.text, None, []
        message = self.chat.response(req.inner, [out])["choices"][0]["message"]
        return message.get("content") or "", message.get("reasoning_content"), tool_calls(message.get("tool_calls") or [])

    def _last(self, job: Job, outs: list[Output], ctx: Context) -> dict:
        """The last object's done fields (Ollama's names, nanoseconds)."""
        if not outs:
            return {"done": True, "done_reason": "load"}
        out = outs[0]
        return {"done": True, "done_reason": "length" if out.finish == FINISH_LENGTH else "stop",
                "total_duration": int(ctx.rec.duration_s * 1e9), "load_duration": 0,
                "prompt_eval_count": len(out.sub.input_ids),
                "prompt_eval_duration": int((out.prefill_ms or 0.0) * 1e6),
                "eval_count": len(out.ids), "eval_duration": int(sum(out.decode_ms) * 1e6)}

    def reply(self, job: Job, outs: list[Output], ctx: Context) -> bytes:
        if not outs:
            return _enc.encode({**self._head(job), **self._part(""), **self._last(job, outs, ctx)})
        content, thinking, calls = self._whole(job, outs[0])
        part = self._part(content, thinking)
        if calls:
            part["message"]["tool_calls"] = calls
        return _enc.encode({**self._head(job), **part, **self._last(job, outs, ctx)})

    def render(self, job: Job, out: Output, p: Piece, ctx: Context) -> Iterator[bytes]:
        req: OllamaRequest = job.request
        if not req.chat:
            if p.text:
                yield line({**self._head(job), **self._part(p.text), "done": False})
            return
        # The chat codec's delta: its reasoning split and tool parser (state kept in ``out``).
        chunk = self.chat.chunk(req.inner, out, p, len(out.ids) - len(p.token_ids))
        delta = chunk["choices"][0]["delta"] if chunk is not None else {}
        content, thinking = delta.get("content") or "", delta.get("reasoning_content")
        if content or thinking:
            yield line({**self._head(job), **self._part(content, thinking), "done": False})

    def close(self, job: Job, outs: list[Output], ctx: Context) -> Iterator[bytes]:
        part = self._part("")
        if outs and (stream := outs[0].state.get("tools")) is not None and stream.calls:
            part["message"]["tool_calls"] = tool_calls(stream.calls)
        yield line({**self._head(job), **part, **self._last(job, outs, ctx)})


class OllamaChatCodec(_OllamaCodec):
    """POST /api/chat."""

    key = "message"

    def parse(self, body: bytes, ctx: Context) -> Job:
        r: S.ChatRequest = S.decode(S.ChatRequest, body)
        if not r.messages:
            return self._loaded(r.model, r)
        return self._job(r.model, S.chat_body(r), True, r, body, ctx)

    def _part(self, text: str, thinking: str | None = None) -> dict:
        message = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        return {"message": message}


class OllamaGenerateCodec(_OllamaCodec):
    """POST /api/generate."""

    key = "response"

    def parse(self, body: bytes, ctx: Context) -> Job:
        r: S.GenerateRequest = S.decode(S.GenerateRequest, body)
        if not r.prompt:
            return self._loaded(r.model, r)
        oai, completion = S.generate_body(r)
        return self._job(r.model, oai, not completion, r, body, ctx)

    def _part(self, text: str, thinking: str | None = None) -> dict:
        return {"response": text, **({"thinking": thinking} if thinking else {})}


class OllamaResource:
    """One of the two generation routes."""

    def __init__(self, pipeline: Pipeline, codec: _OllamaCodec):
        self.pipeline = pipeline
        self.codec = codec

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        await self.pipeline.serve(req, resp, self.codec)


def ollama_routes(pipeline: Pipeline, completions: CompletionsCodec,
                  chat: ChatCompletionsCodec) -> tuple[OllamaResource, OllamaResource]:
    """(/api/chat, /api/generate) on the OpenAI routes' codecs (mindie/api/openai.py openai_routes)."""
    return (OllamaResource(pipeline, OllamaChatCodec(chat, completions, pipeline.adapters)),
            OllamaResource(pipeline, OllamaGenerateCodec(chat, completions, pipeline.adapters)))
