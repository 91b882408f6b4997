"""Ollama request bodies (``/api/chat``, ``/api/generate``, ``/api/show``) as msgspec Structs, and
their translation into the OpenAI chat or completion body whose codec serves them
(mindie/api/ollama.py): one set of rules for templates, tools, reasoning and structured output.

- ``options``: ``num_predict`` (-1, -2 or absent: the server's cap, maxIterTimes and maxSeqLen;
  0 is refused), ``temperature`` (0: greedy), ``top_k``, ``top_p``, ``typical_p``, ``seed`` (< 0:
  random), ``stop``, ``repeat_penalty`` (the sampler's repetition penalty: over the whole sequence,
  not Ollama's ``repeat_last_n`` window, so it applies only when given), ``presence_penalty``,
  ``frequency_penalty``. Absent options keep Ollama's defaults for ``temperature`` (0.8),
  ``top_k`` (40) and ``top_p`` (0.9). Other options (the load-time ones: ``num_ctx``,
  ``num_gpu``, ...; ``mirostat``, ``repeat_last_n``, ...) are read as ignored fields: named in
  ``X-Ignored-Fields`` and a rate-limited WARNING (mindie/text/ignored_fields.py).
- ``format``: ``"json"`` (any JSON object) or a JSON schema, through structured output.
- ``keep_alive`` is accepted and has no effect (the model stays loaded).
"""
from __future__ import annotations

from typing import Annotated, Any, Optional, Union

import msgspec
from msgspec import Meta

from mindie.api.openai_schema import Penalty, RepetitionPenalty, StopStr, Temperature, TopK, TopP
from mindie.contract.http_error import ApiError
from mindie.text.ignored_fields import Found, find_in_json, struct_schema
from mindie.text.validation import MAX_JSON_DEPTH, too_deep

# Ollama's defaults for what a Modelfile usually leaves unset (api.DefaultOptions).
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.9


class _Base(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    pass


class Options(_Base):
    """The runtime ``options`` the sampler has; bounds as the OpenAI routes' (one sampler)."""

    num_predict: Optional[Annotated[int, Meta(ge=-2, le=2**31 - 1)]] = None
    temperature: Optional[Temperature] = None
    top_k: Optional[TopK] = None
    top_p: Optional[TopP] = None
    typical_p: Optional[Annotated[float, Meta(gt=0.0, le=1.0)]] = None
    seed: Optional[Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]] = None
    stop: Optional[Annotated[list[StopStr], Meta(max_length=1024)]] = None
    repeat_penalty: Optional[RepetitionPenalty] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None


class _Generation(_Base):
    model: Optional[str] = None
    stream: Optional[bool] = None  # None: true (Ollama streams by default)
    options: Optional[Options] = None
    format: Union[str, dict[str, Any], None] = None
    keep_alive: Union[str, float, None] = None  # accepted, no effect
    think: Union[bool, str, None] = None
    images: Optional[list[Any]] = None


class ChatRequest(_Generation, kw_only=True):
    messages: Optional[list[dict[str, Any]]] = None
    tools: Optional[list[dict[str, Any]]] = None


class GenerateRequest(_Generation, kw_only=True):
    prompt: Optional[str] = None
    system: Optional[str] = None
    raw: Optional[bool] = None
    suffix: Optional[str] = None
    context: Optional[list[int]] = None
    template: Optional[str] = None


class ShowRequest(_Base):
    model: Optional[str] = None
    name: Optional[str] = None  # the older clients' key
    verbose: Optional[bool] = None


CHAT_SCHEMA = struct_schema(ChatRequest)
GENERATE_SCHEMA = struct_schema(GenerateRequest)
_decoders = {cls: msgspec.json.Decoder(cls) for cls in (ChatRequest, GenerateRequest, ShowRequest)}


def decode(cls: type, body: bytes) -> Any:
    """A body as ``cls``; a 400 with msgspec's message (``... - at `$.options.top_p```) else."""
    if not body.strip():
        raise ApiError(400, "The request body is empty: a JSON object is expected.")
    if too_deep(body):
        raise ApiError(400, f"The request body nests JSON deeper than {MAX_JSON_DEPTH} levels.")
    try:
        return _decoders[cls].decode(body)
    except msgspec.ValidationError as e:
        raise ApiError(400, str(e)) from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise ApiError(400, f"The request body is not valid JSON: {e}") from None


def ignored(body: bytes, chat: bool) -> list[Found]:
    """The keys of the body its route does not read (``options`` looked into)."""
    return find_in_json(body, CHAT_SCHEMA if chat else GENERATE_SCHEMA)


def streams(r: _Generation) -> bool:
    return r.stream is not False


def sampling(r: _Generation) -> dict[str, Any]:
    """The OpenAI body fields of ``options`` (the typical_p the OpenAI body lacks: ``typical_p``)."""
    o = r.options or Options()
    if o.num_predict == 0:
        raise ApiError(400, "options.num_predict must be positive, or -1 for the server's cap.")
    out: dict[str, Any] = {
        "temperature": DEFAULT_TEMPERATURE if o.temperature is None else o.temperature,
        "top_k": DEFAULT_TOP_K if o.top_k is None else o.top_k,
        "top_p": DEFAULT_TOP_P if o.top_p is None else o.top_p,
    }
    if o.num_predict is not None and o.num_predict > 0:
        out["max_tokens"] = o.num_predict
    if o.seed is not None and o.seed >= 0:
        out["seed"] = o.seed
    if o.stop:
        out["stop"] = list(o.stop)
    for mine, theirs in (("repeat_penalty", "repetition_penalty"), ("presence_penalty", "presence_penalty"),
                         ("frequency_penalty", "frequency_penalty")):
        if getattr(o, mine) is not None:
            out[theirs] = getattr(o, mine)
    fmt = response_format(r.format)
    if fmt is not None:
        out["response_format"] = fmt
    return out


def response_format(fmt: Union[str, dict, None]) -> dict | None:
    """Ollama's ``format`` as OpenAI's ``response_format`` (None: free text)."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt, "strict": True}}
    raise ApiError(400, f'invalid format: {fmt!r}: "json" or a JSON schema object is expected.')


def _no_images(images: Any, where: str) -> None:
    if images:
        raise ApiError(400, f"{where}: images are not supported: the served model reads text only.")


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ollama's messages as the chat codec takes them: ``tool_name`` as the tool message's
    ``name``, an assistant's earlier ``thinking`` dropped (templates render the answer only), images
    refused."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object.")
        _no_images(m.get("images"), f"messages[{i}]")
        m = {k: v for k, v in m.items() if k not in ("images", "thinking", "tool_name")}
        if messages[i].get("tool_name") is not None:
            m["name"] = messages[i]["tool_name"]
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    return out


def think_kwargs(think: Union[bool, str, None]) -> dict[str, Any]:
    """``chat_template_kwargs`` of ``think`` (templates read ``enable_thinking``; a level such as
    "high" is also passed as ``reasoning_effort``)."""
    if think is None:
        return {}
    if isinstance(think, str):
        return {"enable_thinking": True, "reasoning_effort": think}
    return {"enable_thinking": bool(think)}


def chat_body(r: ChatRequest) -> dict[str, Any]:
    """The OpenAI chat body of an Ollama chat request (its model left out: checked here)."""
    _no_images(r.images, "images")
    body = {"messages": chat_messages(r.messages or []), "stream": streams(r), **sampling(r)}
    if r.tools:
        body["tools"] = r.tools
    if (kw := think_kwargs(r.think)):
        body["chat_template_kwargs"] = kw
    return body


def generate_body(r: GenerateRequest) -> tuple[dict[str, Any], bool]:
    """(the OpenAI body, whether it is a completion) of an Ollama generate request: ``raw`` is
    the prompt as it is (a completion, no template); else the prompt (with ``system``) goes
    through the chat template."""
    _no_images(r.images, "images")
    if r.suffix:
        raise ApiError(400, "suffix (fill in the middle) is not supported by the served model.")
    if r.context:
        raise ApiError(400, "context (the token history of an earlier answer) is not supported: send the "
                            "conversation to /api/chat.")
    if r.template:
        raise ApiError(400, "template (a Go template) is not supported: the model's chat template applies, or none "
                            "with raw.")
    if r.raw:
        return {"prompt": r.prompt or "", "stream": streams(r), **sampling(r)}, True
    messages = ([{"role": "system", "content": r.system}] if r.system else []) + \
        [{"role": "user", "content": r.prompt or ""}]
    body = {"messages": messages, "stream": streams(r), **sampling(r)}
    if (kw := think_kwargs(r.think)):
        body["chat_template_kwargs"] = kw
    return body, False
