"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

The codec stands on the OpenAI chat codec (mindie/api/openai.py), as Anthropic's does
(mindie/api/anthropic.py): the body and the conversation it continues become the chat request
they stand for (mindie/api/responses_schema.py), the chat codec builds the job (template, tools
and their grammar, reasoning parser, structured output, sampling, limits), and its answer, or
its stream chunk by chunk, is rewritten in the Responses shapes. So the greedy text of a
conversation is the chat route's, token for token.

- Answer: the response object ``{id: "resp_...", object: "response", created_at, status,
  incomplete_details, model, output, usage, ...}`` with the request's settings echoed (the
  fields the SDK's ``Response`` requires). ``output``: a ``reasoning`` item (the reasoning
  parser's thinking as summary text), a ``message`` item (one ``output_text`` part; left out when
  the answer is only tool calls), one ``function_call`` item per call (``fc_...``, the chat
  route's ``call_...`` id as ``call_id``, the arguments a JSON string). ``status``:
  ``incomplete`` with ``incomplete_details.reason: "max_output_tokens"`` when the length limit
  ended it, else ``completed``.
- Stream: ``response.created``, ``response.in_progress``; per item ``response.output_item.added``
  then its deltas (``response.reasoning_summary_part.added`` /
  ``response.reasoning_summary_text.delta``; ``response.content_part.added`` /
  ``response.output_text.delta``; ``response.function_call_arguments.delta``) and its done events;
  ``response.completed`` (or ``response.incomplete``) with the whole response. Every event is
  named for its ``type`` and numbered (``sequence_number``). A stream that fails after it started
  ends with an ``error`` event (mindie/contract/families.py).
- Store: ``store`` (default true) keeps the response and the conversation items it answered
  (mindie/server/response_store.py), which ``GET``/``DELETE /v1/responses/{id}`` and
  ``previous_response_id`` read. An unknown id is a 404 in OpenAI's error object.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import falcon
import falcon.asgi
import msgspec

from mindie.api import responses_schema as R
from mindie.api import field_names
from mindie.api.openai import ChatCompletionsCodec, OpenAIResource
from mindie.contract import families
from mindie.contract.http_error import ApiError
from mindie.contract.sse_framing import named_event
from mindie.pipeline import Codec, Context, Job, Output, Pipeline
from mindie.server.response_store import ResponseStore, new_id
from mindie.text.generation import Piece

_enc = msgspec.json.Encoder()


def not_found(rid: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"Response with id '{rid}' not found.", param=param)


@dataclass
class Turn:
    """One request as its answer needs it: the body, its id and the conversation it answered."""

    r: R.ResponsesRequest
    conversation: list[dict[str, Any]]
    id: str = field(default_factory=new_id)
    created_at: int = field(default_factory=lambda: int(time.time()))


def _usage(chat_usage: dict, cached: int) -> dict:
    """The Responses API's usage from the chat codec's, with the prompt tokens the prefix cache
    served (``cached``; always in this shape, whatever ServerConfig.enablePromptTokensDetails says)."""
    details = chat_usage.get("completion_tokens_details") or {}
    return {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"],
            "total_tokens": chat_usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)}}


def _message_item(text: str, status: str, item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or new_id("msg"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(text: str, item_id: str | None = None) -> dict:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [{"type": "summary_text", "text": text}]}


def _call_item(call_id: str, name: str, arguments: str, status: str, item_id: str | None = None) -> dict:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class ResponsesCodec(Codec):
    """POST /v1/responses, on the chat codec ``chat``, keeping answers in ``store``."""

    family = families.RESPONSES

    def __init__(self, chat: ChatCompletionsCodec, store: ResponseStore):
        self.chat = chat
        self.store = store

    def refused(self, err: ApiError) -> ApiError:
        return field_names.renamed(self.chat.refused(err), field_names.RESPONSES)

    def parse(self, body: bytes, ctx: Context) -> Job:
        r = R.decode(body)
        conversation: list[dict[str, Any]] = []
        if r.previous_response_id is not None:
            prev = self.store.get(r.previous_response_id)
            if prev is None:
                raise not_found(r.previous_response_id, "previous_response_id")
            conversation = list(prev.get("input") or []) + list(prev["response"].get("output") or [])
        conversation += R.items(r)
        job = self.chat.job_of(R.to_chat(r, conversation))
        job.state["turn"] = Turn(r, conversation)
        job.ignored = R.ignored(body)
        return job

    # -- answers -------------------------------------------------------------------------------
    def response(self, job: Job, status: str, output: list[dict], usage: dict | None) -> dict:
        """The response object (``status``: in_progress, completed or incomplete)."""
        t: Turn = job.state["turn"]
        r = t.r
        tools, choice = R.tool_echo(r)
        fmt = (r.text or {}).get("format") or {"type": "text"}
        return {
            "id": t.id, "object": "response", "created_at": t.created_at, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "model": job.request.adapter or self.chat.model_name, "output": output,
            "parallel_tool_calls": r.parallel_tool_calls is not False, "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": r.store,
            "temperature": 1.0 if r.temperature is None else r.temperature, "text": {"format": fmt},
            "tool_choice": choice, "tools": tools, "top_p": 1.0 if r.top_p is None else r.top_p,
            "truncation": "disabled", "usage": usage, "user": None, "metadata": r.metadata or {}}

    def _keep(self, job: Job, response: dict) -> None:
        t: Turn = job.state["turn"]
        if t.r.store:
            self.store.put(t.id, {"response": response, "input": t.conversation})

    def reply(self, job: Job, outs: list[Output], ctx: Context) -> bytes:
        body = self.chat.response(job, outs)
        choice = body["choices"][0]
        msg = choice["message"]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        output: list[dict] = []
        if msg.get("reasoning_content"):
            output.append(_reasoning_item(msg["reasoning_content"]))
        calls = msg.get("tool_calls") or []
        if msg.get("content") or not calls:
            output.append(_message_item(msg.get("content") or "", status))
        for call in calls:
            output.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"], status))
        response = self.response(job, status, output, _usage(body["usage"], job.cached_tokens(outs)))
        self._keep(job, response)
        return _enc.encode(response)

    # -- the stream ----------------------------------------------------------------------------
    def open(self, job: Job, outs: list[Output], ctx: Context) -> Iterator[bytes]:
        events = job.state["events"] = _Events()
        yield events.emit("response.created", response=self.response(job, "in_progress", [], None))
        yield events.emit("response.in_progress", response=self.response(job, "in_progress", [], None))

    def render(self, job: Job, out: Output, p: Piece, ctx: Context) -> Iterator[bytes]:
        chunk = self.chat.chunk(job, out, p, len(out.ids) - len(p.token_ids))
        if chunk is None:
            return
        ev: _Events = job.state["events"]
        choice = chunk["choices"][0]
        delta = choice["delta"]
        if delta.get("reasoning_content"):
            yield from ev.to(("reasoning",), _reasoning_item(""))
            yield ev.text_delta(delta["reasoning_content"])
        if delta.get("content"):
            yield from ev.to(("message",), _message_item("", "in_progress"))
            yield ev.text_delta(delta["content"])
        for call in delta.get("tool_calls") or ():
            if "id" in call:
                yield from ev.to(("function_call", call["index"]),
                                 _call_item(call["id"], call["function"]["name"], "", "in_progress"))
            args = call.get("function", {}).get("arguments")
            if args:
                yield ev.text_delta(args)
        if choice["finish_reason"] is not None:
            ev.status = "incomplete" if choice["finish_reason"] == "length" else "completed"

    def close(self, job: Job, outs: list[Output], ctx: Context) -> Iterator[bytes]:
        ev: _Events = job.state["events"]
        answered = any(i["type"] != "reasoning" for i in ev.items) or (ev.key or ("reasoning",))[0] != "reasoning"
        if not answered:
            yield from ev.to(("message",), _message_item("", "in_progress"))  # as the answer has one
        yield from ev.stop()
        response = self.response(job, ev.status, ev.items, _usage(self.chat._usage(job, outs), job.cached_tokens(outs)))
        self._keep(job, response)
        yield ev.emit("response.completed" if ev.status == "completed" else "response.incomplete", response=response)

    def stream_error(self, job: Job, err: ApiError) -> bytes:
        ev = job.state.get("events")
        return families.responses_error(err, ev.seq if ev is not None else 0)


class _Events:
    """The numbered events of one streamed response: the output items done, and the open one."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict] = []
        self.key: tuple | None = None
        self.item: dict = {}
        self.text = ""
        self.status = "completed"

    def emit(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return named_event(kind, data)

    def _at(self) -> dict:
        return {"item_id": self.item["id"], "output_index": len(self.items)}

    def to(self, key: tuple, item: dict) -> Iterator[bytes]:
        """Opens item ``key`` unless it is the open one (finishing that first)."""
        if key == self.key:
            return
        yield from self.stop()
        self.key, self.item, self.text = key, item, ""
        yield self.emit("response.output_item.added", output_index=len(self.items), item=item)
        kind = item["type"]
        if kind == "reasoning":
            yield self.emit("response.reasoning_summary_part.added", **self._at(), summary_index=0,
                            part={"type": "summary_text", "text": ""})
        elif kind == "message":
            yield self.emit("response.content_part.added", **self._at(), content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def text_delta(self, delta: str) -> bytes:
        """A piece of the open item's text (summary, output text or arguments)."""
        self.text += delta
        kind = self.item["type"]
        if kind == "reasoning":
            return self.emit("response.reasoning_summary_text.delta", **self._at(), summary_index=0, delta=delta)
        if kind == "message":
            return self.emit("response.output_text.delta", **self._at(), content_index=0, delta=delta, logprobs=[])
        return self.emit("response.function_call_arguments.delta", **self._at(), delta=delta)

    def stop(self) -> Iterator[bytes]:
        """Finishes the open item: its done events, and it joins ``items``."""
        if self.key is None:
            return
        item, text, at = self.item, self.text, self._at()
        kind = item["type"]
        done_status = "incomplete" if self.status == "incomplete" else "completed"
        if kind == "reasoning":
            item = _reasoning_item(text, item["id"])
            yield self.emit("response.reasoning_summary_text.done", **at, summary_index=0, text=text)
            yield self.emit("response.reasoning_summary_part.done", **at, summary_index=0, part=item["summary"][0])
        elif kind == "message":
            item = _message_item(text, done_status, item["id"])
            yield self.emit("response.output_text.done", **at, content_index=0, text=text, logprobs=[])
            yield self.emit("response.content_part.done", **at, content_index=0, part=item["content"][0])
        else:
            item = _call_item(item["call_id"], item["name"], text, done_status, item["id"])
            yield self.emit("response.function_call_arguments.done", **at, name=item["name"], arguments=text)
        yield self.emit("response.output_item.done", output_index=at["output_index"], item=item)
        self.items.append(item)
        self.key = None


class StoredResponseResource:
    """``GET /v1/responses/{response_id}`` (a stored response) and ``DELETE`` (removes it)."""

    def __init__(self, codec: ResponsesCodec):
        self.codec = codec

    def _get(self, req: falcon.asgi.Request, response_id: str) -> dict:
        req.context.codec = self.codec  # errors in OpenAI's shape (mindie/server/app.py)
        record = self.codec.store.get(response_id)
        if record is None:
            raise not_found(response_id)
        return record

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, response_id: str) -> None:
        resp.content_type = falcon.MEDIA_JSON
        resp.data = _enc.encode(self._get(req, response_id)["response"])

    async def on_delete(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, response_id: str) -> None:
        req.context.codec = self.codec
        if not self.codec.store.delete(response_id):
            raise not_found(response_id)
        resp.content_type = falcon.MEDIA_JSON
        resp.data = _enc.encode({"id": response_id, "object": "response", "deleted": True})


def responses_routes(pipeline: Pipeline, chat: ChatCompletionsCodec,
                     store: ResponseStore) -> tuple[OpenAIResource, StoredResponseResource]:
    """The two resources of a front end, on its chat codec: /v1/responses is served by the
    pipeline as the OpenAI routes are."""
    codec = ResponsesCodec(chat, store)
    return OpenAIResource(pipeline, codec), StoredResponseResource(codec)
