"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

The family's codec stands on the OpenAI chat codec (mindie/api/openai.py): the body is converted
into the chat request it stands for (mindie/api/anthropic_schema.py), the chat codec builds the job
(template, tools and their grammar, reasoning parser, structured output, sampling, limits), and
its answer, or its stream chunk by chunk, is rewritten in Anthropic's shapes. So the greedy text
of a conversation is the chat route's, token for token.

- Reply: ``{id: "msg_...", type: "message", role: "assistant", model, content, stop_reason,
  stop_sequence, usage: {input_tokens, output_tokens}}``; content: a ``thinking`` block (the
  reasoning parser's output, with a ``signature``: Anthropic's clients require the field and
  send it back; here it means nothing), a ``text`` block, then one ``tool_use`` block per call
  (id ``toolu_...``, its input object). stop_reason: ``max_tokens`` (length), ``tool_use`` (the
  answer holds calls), ``stop_sequence`` (a stop string matched: ``stop_sequence`` names it),
  else ``end_turn``.
- Stream: ``message_start``, ``ping``, then per block ``content_block_start``,
  ``content_block_delta`` (``thinking_delta`` then ``signature_delta``, ``text_delta``,
  ``input_json_delta``), ``content_block_stop``; ``message_delta`` (stop_reason, usage) and
  ``message_stop``. A stream that fails after it started ends with ``event: error``.
- Errors: ``{"type": "error", "error": {"type", "message"}}`` (mindie/contract/families.py);
  MindIE's 422/424 refusals are 400 ``invalid_request_error``, as on the OpenAI routes.
- count_tokens: ``{"input_tokens"}``, the prompt the same body would be answered from (the same
  conversion, template and tools), without generating.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import falcon
import falcon.asgi
import msgspec

from mindie.api import anthropic_schema as A
from mindie.api import field_names
from mindie.api.openai import ChatCompletionsCodec, OpenAIRequest, OpenAIResource
from mindie.contract import families
from mindie.contract.http_error import ApiError
from mindie.contract.sse_framing import named_event
from mindie.pipeline import Codec, Context, Job, Output, Pipeline, read_body
from mindie.text.generation import Piece

# Anthropic's clients keep a thinking block's signature and send it back; nothing checks it here.
SIGNATURE = "mindie-unsigned"
_enc = msgspec.json.Encoder()

_STOP = {"length": "max_tokens", "tool_calls": "tool_use"}


def _stop_reason(finish: str | None, stop: Any) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of the chat codec's finish_reason and stop_reason."""
    if finish in _STOP:
        return _STOP[finish], None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def _tool_id(call_id: str) -> str:
    """The chat codec's ``call_...`` id as Anthropic's ``toolu_...``."""
    return "toolu_" + call_id.split("_", 1)[-1]


def _input(arguments: str) -> dict:
    """A call's arguments as its input object (a call cut off by max_tokens: what parsed, else {})."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesCodec(Codec):
    """POST /v1/messages, on the chat codec ``chat``."""

    family = families.ANTHROPIC

    def __init__(self, chat: ChatCompletionsCodec):
        self.chat = chat

    def refused(self, err: ApiError) -> ApiError:
        return field_names.renamed(self.chat.refused(err), field_names.ANTHROPIC)

    def chat_job(self, r: A.MessagesRequest | A.CountTokensRequest) -> Job:
        return self.chat.job_of(A.to_chat(r))

    def parse(self, body: bytes, ctx: Context) -> Job:
        r = A.decode_messages(body)
        job = self.chat_job(r)
        job.ignored = A.ignored(body)
        return job

    # -- answers -------------------------------------------------------------------------------
    def _message(self, req: OpenAIRequest, content: list, stop_reason: str | None, stop_sequence: str | None,
                 usage: dict) -> dict:
        return {"id": "msg_" + req.rid.split("-", 1)[-1], "type": "message", "role": "assistant",
                "model": req.adapter or self.chat.model_name, "content": content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": usage}

    def reply(self, job: Job, outs: list[Output], ctx: Context) -> bytes:
        body = self.chat.response(job, outs)
        choice = body["choices"][0]
        msg = choice["message"]
        content: list[dict] = []
        if msg.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": SIGNATURE})
        if msg.get("content"):
            content.append({"type": "text", "text": msg["content"]})
        for call in msg.get("tool_calls") or ():
            content.append({"type": "tool_use", "id": _tool_id(call["id"]), "name": call["function"]["name"],
                            "input": _input(call["function"]["arguments"])})
        reason, sequence = _stop_reason(choice["finish_reason"], choice["stop_reason"])
        usage = {"input_tokens": body["usage"]["prompt_tokens"], "output_tokens": body["usage"]["completion_tokens"]}
        return _enc.encode(self._message(job.request, content, reason, sequence, usage))

    def open(self, job: Job, outs: list[Output], ctx: Context) -> Iterator[bytes]:
        usage = {"input_tokens": job.prompt_tokens(), "output_tokens": 0}
        yield named_event("message_start", {"type": "message_start",
                                            "message": self._message(job.request, [], None, None, usage)})
        yield named_event("ping", {"type": "ping"})

    def render(self, job: Job, out: Output, p: Piece, ctx: Context) -> Iterator[bytes]:
        chunk = self.chat.chunk(job, out, p, len(out.ids) - len(p.token_ids))
        if chunk is None:
            return
        choice = chunk["choices"][0]
        delta = choice["delta"]
        blocks = out.state.setdefault("blocks", _Blocks())
        if delta.get("reasoning_content"):
            yield from blocks.to(("thinking",), {"type": "thinking", "thinking": "", "signature": ""})
            yield blocks.delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]})
        if delta.get("content"):
            yield from blocks.to(("text",), {"type": "text", "text": ""})
            yield blocks.delta({"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or ():
            if "id" in call:
                yield from blocks.to(("tool_use", call["index"]), {
                    "type": "tool_use", "id": _tool_id(call["id"]), "name": call["function"]["name"], "input": {}})
            args = call.get("function", {}).get("arguments")
            if args:
                yield blocks.delta({"type": "input_json_delta", "partial_json": args})
        if choice["finish_reason"] is not None:
            out.state["stop"] = _stop_reason(choice["finish_reason"], choice.get("stop_reason"))

    def close(self, job: Job, outs: list[Output], ctx: Context) -> Iterator[bytes]:
        out = outs[0]
        blocks = out.state.get("blocks")
        if blocks is not None:
            yield from blocks.stop()
        reason, sequence = out.state.get("stop") or _stop_reason(None, None)
        yield named_event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"input_tokens": job.prompt_tokens(), "output_tokens": len(out.ids)}})
        yield named_event("message_stop", {"type": "message_stop"})


class _Blocks:
    """The content blocks of one streamed message: which one is open, and its index."""

    def __init__(self) -> None:
        self.index = -1
        self.key: tuple | None = None

    def to(self, key: tuple, start: dict) -> Iterator[bytes]:
        """Opens block ``key`` unless it is the open one (closing that first)."""
        if key == self.key:
            return
        yield from self.stop()
        self.index += 1
        self.key = key
        yield named_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": start})

    def delta(self, delta: dict) -> bytes:
        return named_event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": delta})

    def stop(self) -> Iterator[bytes]:
        if self.key is None:
            return
        if self.key[0] == "thinking":
            yield self.delta({"type": "signature_delta", "signature": SIGNATURE})
        yield named_event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        self.key = None


class CountTokensResource:
    """``POST /v1/messages/count_tokens``: the prompt's length, nothing generated (no admission slot,
    no metrics: it is not an inference)."""

    def __init__(self, codec: MessagesCodec, max_mb: int):
        self.codec = codec
        self.max_mb = max_mb

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        req.context.codec = self.codec  # errors in Anthropic's shape (mindie/server/app.py)
        try:
            body = await read_body(req, self.max_mb)
            r = A.decode_count(body)
            job = self.codec.chat_job(r)
        except ApiError as e:
            raise self.codec.refused(e) from None
        resp.content_type = falcon.MEDIA_JSON
        resp.data = _enc.encode({"input_tokens": job.prompt_tokens()})


def anthropic_routes(pipeline: Pipeline, chat: ChatCompletionsCodec,
                     max_mb: int) -> tuple[OpenAIResource, CountTokensResource]:
    """The two resources of a front end, on its chat codec (mindie/api/openai.py ``openai_routes``):
    /v1/messages is served by the pipeline as the OpenAI routes are."""
    codec = MessagesCodec(chat)
    return OpenAIResource(pipeline, codec), CountTokensResource(codec, max_mb)
