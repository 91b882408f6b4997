"""OpenAI Responses bodies (``POST /v1/responses``) as a msgspec Struct, and their conversion into
the OpenAI chat request the chat codec builds a job from (mindie/api/openai.py
``ChatCompletionsCodec.job_of``), as mindie/api/anthropic_schema.py does for Anthropic's.

The conversion (``items`` then ``to_chat``):
- ``input``: a string (one user message) or a list of items: messages (``role`` user, system,
  developer (a system message) or assistant; content a string or ``input_text`` /
  ``output_text`` parts, joined by newlines); ``function_call`` items {call_id, name, arguments}
  (the assistant's tool calls: consecutive ones are one assistant turn, joined to the assistant
  message just before them); ``function_call_output`` items {call_id, output} (``tool``
  messages); ``reasoning`` items are dropped (the templates drop earlier reasoning too); images,
  files and item references are a 400;
- ``previous_response_id``: the stored response's conversation (its input items, then its output
  items) goes before ``input``; its ``instructions`` do not carry over (OpenAI's rule);
- ``instructions``: the first message, ``role: system``;
- ``tools`` ({type: function, name, description, parameters, strict}) become chat functions;
  ``tool_choice`` auto / required / none / {type: function, name} as the chat route reads them;
- ``text.format``: ``json_schema`` {name, schema, strict} and ``json_object`` are the chat
  route's ``response_format``; ``text`` is none;
- ``max_output_tokens``, ``temperature``, ``top_p``, ``stream``, ``parallel_tool_calls`` as the
  chat route's; ``store``, ``metadata`` are the codec's (mindie/api/responses.py); ``reasoning``,
  ``user``, ``truncation`` and ``include`` are read and have no effect; other keys are named
  (X-Ignored-Fields).
"""
from __future__ import annotations

from typing import Annotated, Any, Optional, Union

import msgspec
from msgspec import Meta

from mindie.api import openai_schema as S
from mindie.text.ignored_fields import Found, find_in_json, struct_schema

__all__ = ["ResponsesRequest", "decode", "ignored", "items", "to_chat", "tool_echo"]

TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text"})


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = None
    max_output_tokens: Optional[S.MaxTokens] = None
    temperature: Optional[S.Temperature] = None
    top_p: Optional[S.TopP] = None
    stream: bool = False
    store: bool = True
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, Annotated[str, Meta(max_length=512)]]] = None
    # read, no effect: the reasoning parser splits what the model thinks whatever the effort
    reasoning: Any = None
    user: Any = None
    truncation: Any = None
    include: Any = None


_decoder = msgspec.json.Decoder(ResponsesRequest)
SCHEMA = struct_schema(ResponsesRequest)


def decode(body: bytes) -> ResponsesRequest:
    return S.decode_body(_decoder, body)


def ignored(body: bytes) -> list[Found]:
    """The top-level keys of a decoded-fine body that this family does not read."""
    return find_in_json(body, SCHEMA)


def _bad(message: str, param: str = "input") -> Exception:
    return S.bad_request(message, param)


def _text(content: Any, where: str) -> str:
    """A string, or text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of input_text parts.")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{i}]: parts of type {kind!r} are not supported (input_text, output_text).")
        texts.append(part["text"])
    return "\n".join(texts)


def items(r: ResponsesRequest) -> list[dict[str, Any]]:
    """``input`` as a list of items (a string: one user message)."""
    if isinstance(r.input, str):
        return [{"type": "message", "role": "user", "content": r.input}]
    return list(r.input)


def _messages(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Conversation items as chat messages (see the module docstring)."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(conversation):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object.")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role must be 'user', 'system', 'developer' or 'assistant', got {role!r}.")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments")
            if not isinstance(name, str) or not isinstance(args, str):
                raise _bad(f"{where}: a function_call item has a name and arguments (a JSON string).")
            call = {"id": str(item.get("call_id") or f"call_{i}"), "type": "function",
                    "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""),
                        "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # earlier reasoning does not go back to the model (templates drop it too)
        else:
            raise _bad(f"{where}: items of type {kind!r} are not supported (message, function_call, "
                       "function_call_output, reasoning).")
    return out


def _tools(tools: Optional[list[dict[str, Any]]]) -> Optional[list[dict[str, Any]]]:
    """Function tools as the chat route's (built-in tools: a 400 naming the first)."""
    if tools is None:
        return None
    kinds = [t.get("type") if isinstance(t, dict) else None for t in tools]
    bad = next((i for i, k in enumerate(kinds) if k != "function"), None)
    if bad is not None:
        raise _bad(f"tools[{bad}]: only function tools are supported, got type {kinds[bad]!r}.", "tools")
    return [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                              if t.get(k) is not None}} for t in tools]


def _tool_choice(choice: Union[str, dict[str, Any], None]) -> Union[str, dict[str, Any], None]:
    if choice is None or isinstance(choice, str):
        return choice  # auto, required, none: the chat route checks the value
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice must be 'auto', 'required', 'none' or {\"type\": \"function\", \"name\": ...}.",
               "tool_choice")


def _format(text: Optional[dict[str, Any]]) -> Optional[S.ResponseFormat]:
    """``text.format`` as the chat route's response_format."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return S.ResponseFormat(type="json_object")
    if kind == "json_schema":
        return S.ResponseFormat(type="json_schema", json_schema=S.JsonSchemaFormat(
            name=fmt.get("name"), schema=fmt.get("schema"), strict=fmt.get("strict"),
            description=fmt.get("description")))
    raise _bad(f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}.", "text")


def tool_echo(r: ResponsesRequest) -> tuple[list[dict[str, Any]], Any]:
    """(tools, tool_choice) as the response object repeats them."""
    tools = [{"type": "function", "name": t.get("name"), "description": t.get("description"),
              "parameters": t.get("parameters"), "strict": t.get("strict", True)} for t in r.tools or ()]
    return tools, r.tool_choice if r.tool_choice is not None else "auto"


def to_chat(r: ResponsesRequest, conversation: list[dict[str, Any]]) -> S.ChatCompletionRequest:
    """The OpenAI chat request of ``r`` answering ``conversation`` (the previous response's items
    and ``r``'s input)."""
    messages: list[dict[str, Any]] = []
    if r.instructions:
        messages.append({"role": "system", "content": r.instructions})
    messages.extend(_messages(conversation))
    if not messages:
        raise _bad("input must hold at least one item.")
    return S.ChatCompletionRequest(
        model=r.model, messages=messages, tools=_tools(r.tools), tool_choice=_tool_choice(r.tool_choice),
        parallel_tool_calls=r.parallel_tool_calls, response_format=_format(r.text),
        max_tokens=r.max_output_tokens, temperature=r.temperature, top_p=r.top_p, stream=r.stream)
