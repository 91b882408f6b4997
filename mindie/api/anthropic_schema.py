"""Anthropic Messages bodies (``/v1/messages``, ``/v1/messages/count_tokens``) as msgspec Structs,
and their conversion into the OpenAI chat request the chat codec builds a job from
(mindie/api/openai.py ``ChatCompletionsCodec.job_of``): one chat template, one tool setup, one
reasoning parser and one structured-output path serve both families.

The conversion:
- ``system`` (a string or text blocks) becomes the first message, ``role: system``;
- a message's content is a string or blocks: ``text`` blocks joined by newlines (as the chat
  codec joins OpenAI's text parts); ``tool_use`` blocks of an assistant turn become its
  ``tool_calls`` (the input object as the arguments); ``tool_result`` blocks of a user turn become
  ``tool`` messages, before the turn's text; ``thinking`` blocks of earlier turns are dropped (the
  templates drop earlier reasoning too); images and documents are a 400;
- ``tools`` ({name, description, input_schema}) become functions; ``tool_choice`` auto / any /
  tool / none become auto / required / the named function / none, and
  ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``;
- ``stop_sequences`` are the stop strings; ``temperature`` (Anthropic's range [0, 1]), ``top_p``
  and ``top_k`` are read from the body (clients send them as extra fields);
- ``output_config.format`` ({type: json_schema, schema}) is a strict ``json_schema``
  response format; ``thinking`` {type: enabled, budget_tokens} is the thinking budget,
  {type: disabled} the template's ``enable_thinking: false``;
- ``metadata`` is read and has no effect; other unknown keys are named (X-Ignored-Fields).
"""
from __future__ import annotations

from typing import Annotated, Any, Optional, Union

import msgspec
from msgspec import Meta

from mindie.api import openai_schema as S
from mindie.text.ignored_fields import Found, find_in_json, struct_schema

__all__ = ["MessagesRequest", "CountTokensRequest", "decode_messages", "decode_count", "to_chat", "ignored"]

Temperature = Annotated[float, Meta(ge=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=0, le=S.MAX_INT32)]


class _Body(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    """What both routes read."""

    model: Optional[str] = None
    messages: Annotated[list[dict[str, Any]], Meta(min_length=1)]
    system: Union[str, list[dict[str, Any]], None] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None
    output_config: Optional[dict[str, Any]] = None
    metadata: Any = None  # read, no effect (Anthropic's user id for abuse detection)


class MessagesRequest(_Body, kw_only=True):
    max_tokens: S.MaxTokens  # required, as Anthropic requires it
    stop_sequences: Optional[Annotated[list[S.StopStr], Meta(max_length=1024)]] = None
    stream: bool = False
    temperature: Optional[Temperature] = None
    top_p: Optional[S.TopP] = None
    top_k: Optional[TopK] = None


class CountTokensRequest(_Body, kw_only=True):
    pass


_messages_decoder = msgspec.json.Decoder(MessagesRequest)
_count_decoder = msgspec.json.Decoder(CountTokensRequest)
MESSAGES_SCHEMA = struct_schema(MessagesRequest)
COUNT_SCHEMA = struct_schema(CountTokensRequest)


def decode_messages(body: bytes) -> MessagesRequest:
    return S.decode_body(_messages_decoder, body)


def decode_count(body: bytes) -> CountTokensRequest:
    return S.decode_body(_count_decoder, body)


def ignored(body: bytes, count: bool = False) -> list[Found]:
    """The top-level keys of a decoded-fine body that this family does not read."""
    return find_in_json(body, COUNT_SCHEMA if count else MESSAGES_SCHEMA)


def _bad(message: str, param: str) -> Exception:
    return S.bad_request(message, param)


def _text(content: Any, where: str) -> str:
    """A string, or text blocks joined by newlines (a system prompt, a tool result)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of text blocks.", where)
    texts = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise _bad(f"{where}[{i}]: only text blocks are supported here.", where)
        texts.append(block["text"])
    return "\n".join(texts)


def _turn(i: int, m: dict[str, Any]) -> list[dict[str, Any]]:
    """One Anthropic message as the chat messages it stands for."""
    role = m.get("role")
    where = f"messages[{i}]"
    if role not in ("user", "assistant"):
        raise _bad(f"{where}.role must be 'user' or 'assistant', got {role!r}.", "messages")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content blocks.", "messages")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            name, args = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(args, dict):
                raise _bad(f"{at}: a tool_use block has a name and an input object.", "messages")
            calls.append({"id": str(block.get("id") or f"toolu_{i}_{j}"), "type": "function",
                          "function": {"name": name, "arguments": args}})
        elif kind == "tool_result" and role == "user":
            text = _text(block.get("content"), f"{at}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id") or ""), "content": text})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning does not go back to the model (templates drop it too)
        else:
            raise _bad(f"{at}: content blocks of type {kind!r} are not supported in a {role} turn (text, "
                       "tool_use in assistant turns, tool_result in user turns).", "messages")
    out = list(results)
    if texts or calls or not results:
        msg: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _tools(tools: Optional[list[dict[str, Any]]]) -> Optional[list[dict[str, Any]]]:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") not in ("custom", None):
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(f"tools[{i}]: only client tools ({{name, description, input_schema}}) are supported, got "
                       f"type {kind!r}.", "tools")
        # OpenAI's key order (name, description, parameters): templates render the tools as JSON,
        # so the same tools give the chat route's prompt token for token
        fn: dict[str, Any] = {"name": t.get("name")}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        fn["parameters"] = t.get("input_schema")
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Optional[dict[str, Any]]) -> tuple[Any, Optional[bool]]:
    """(OpenAI's tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, False
    raise _bad(f"tool_choice.type must be one of 'auto', 'any', 'tool', 'none', got {kind!r}.", "tool_choice")


def _format(output_config: Optional[dict[str, Any]]) -> Optional[S.ResponseFormat]:
    """``output_config.format`` as OpenAI's response_format."""
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _bad("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}.", "output_config")
    # strict: Anthropic's structured outputs close every object (additionalProperties: false)
    return S.ResponseFormat(type="json_schema", json_schema=S.JsonSchemaFormat(name="output", schema=fmt["schema"],
                                                                               strict=True))


def _thinking(thinking: Optional[dict[str, Any]]) -> tuple[Optional[int], Optional[dict[str, Any]]]:
    """(thinking_token_budget, chat_template_kwargs) of Anthropic's ``thinking``."""
    if thinking is None:
        return None, None
    kind = thinking.get("type")
    if kind == "disabled":
        return None, {"enable_thinking": False}
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if type(budget) is not int or budget < 1:
            raise _bad("thinking.budget_tokens must be a positive integer.", "thinking")
        return budget, None
    if kind == "adaptive":
        return None, None
    raise _bad(f"thinking.type must be 'enabled', 'disabled' or 'adaptive', got {kind!r}.", "thinking")


def to_chat(r: _Body) -> S.ChatCompletionRequest:
    """The OpenAI chat request ``r`` stands for (see the module docstring)."""
    messages: list[dict[str, Any]] = []
    if r.system is not None:
        system = _text(r.system, "system")
        if system:
            messages.append({"role": "system", "content": system})
    for i, m in enumerate(r.messages):
        messages.extend(_turn(i, m))
    choice, parallel = _tool_choice(r.tool_choice)
    budget, kwargs = _thinking(r.thinking)
    send = isinstance(r, MessagesRequest)
    return S.ChatCompletionRequest(
        model=r.model, messages=messages, tools=_tools(r.tools), tool_choice=choice, parallel_tool_calls=parallel,
        response_format=_format(r.output_config), thinking_token_budget=budget, chat_template_kwargs=kwargs,
        max_tokens=r.max_tokens if send else 1, stop=list(r.stop_sequences or []) if send else None,
        temperature=r.temperature if send else None, top_p=r.top_p if send else None,
        top_k=r.top_k if send else None, stream=r.stream if send else None)
