"""OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``) as msgspec Structs.

Unknown keys are accepted and ignored (OpenAI clients send fields this server has no use for), and
named: ``ignored`` finds them for the ``X-Ignored-Fields`` header and the rate-limited WARNING
(mindie/text/ignored_fields.py). Every bound a
``msgspec.Meta`` can say is said here, so a bad value fails in the one C decode with msgspec's
message (``Expected `float` <= 2.0 - at `$.temperature```), which the handler turns into a 400
``BadRequestError`` naming the parameter; ``check_*`` add the few rules that span fields.
Ranges: OpenAI's (temperature [0, 2], penalties [-2, 2], logprobs/top_logprobs <= 20), MindIE's
where it is stricter (repetition_penalty (0, 2], seed [0, 2**63 - 1], max_tokens (0, 2**31 - 1]);
``n`` at most ``MAX_N``.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

import msgspec
from msgspec import Meta

from mindie.contract.http_error import ApiError
from mindie.text.ignored_fields import Found, find_in_json, struct_schema
from mindie.text.validation import MAX_JSON_DEPTH, too_deep

__all__ = ["CompletionRequest", "ChatCompletionRequest", "StreamOptions", "ResponseFormat", "StructuredOutputs",
           "JsonSchemaFormat", "MAX_N",
           "MAX_LOGPROBS", "decode_completion", "decode_chat", "ignored", "COMPLETION_SCHEMA", "CHAT_SCHEMA"]

MAX_N = 128
MAX_LOGPROBS = 20
MAX_INT32 = 2**31 - 1
INT64_MAX = 2**63 - 1

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1, le=MAX_INT32)]  # -1 and 0: off
Seed = Annotated[int, Meta(ge=0, le=INT64_MAX)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=2.0)]
MaxTokens = Annotated[int, Meta(ge=1, le=MAX_INT32)]
N = Annotated[int, Meta(ge=1, le=MAX_N)]
TokenId = Annotated[int, Meta(ge=0)]
StopStr = Annotated[str, Meta(max_length=1024)]
Stop = Union[StopStr, Annotated[list[StopStr], Meta(max_length=1024)], None]


def bad_request(message: str, param: str | None = None) -> ApiError:
    """A body that does not fit: 400 with the message and the parameter it names (or None)."""
    return ApiError(400, message, param=param)


class _Base(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    pass


class StreamOptions(_Base):
    include_usage: bool = False


class JsonSchemaFormat(_Base):
    """``response_format.json_schema``: the values are checked by mindie/text/structured.py (MindIE's
    messages); typed here only so that unknown keys in it are named."""

    name: Any = None
    schema: Any = None
    strict: Any = None
    description: Any = None


class ResponseFormat(_Base):
    """OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``), TGI's form of it
    (``value``: the schema or pattern of ``json``/``regex``/``json_schema``) and vLLM's structural
    tag (``structures``, ``triggers``); checked by mindie/text/structured.py."""

    type: Any = None
    json_schema: Optional[JsonSchemaFormat] = None
    value: Any = None
    structures: Any = None
    triggers: Any = None


class StructuredOutputs(_Base):
    """vLLM's ``structured_outputs`` object (mindie/text/structured.py checks the values)."""

    json: Any = None
    regex: Any = None
    choice: Any = None
    grammar: Any = None
    json_object: Any = None
    structural_tag: Any = None
    disable_fallback: Any = None
    disable_any_whitespace: Any = None
    disable_additional_properties: Any = None
    whitespace_pattern: Any = None


class _Sampling(_Base):
    """What both routes share."""

    model: Optional[str] = None  # None: the served model
    temperature: Optional[Temperature] = None  # None: 1.0 (OpenAI's default); 0: greedy
    top_p: Optional[TopP] = None
    top_k: Optional[TopK] = None
    seed: Optional[Seed] = None
    stop: Stop = None
    stop_token_ids: Optional[Annotated[list[TokenId], Meta(max_length=1024)]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    repetition_penalty: Optional[RepetitionPenalty] = None
    n: Optional[N] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # Structured output (mindie/text/structured.py): at most one of these constrains the output.
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Any = None  # vLLM's older fields
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: Any = None  # read, no effect (one backend: llguidance)


class CompletionRequest(_Sampling, kw_only=True):
    # str | list[int] | list[str] | list[list[int]]: checked by prompts()
    prompt: Union[str, list[Any]]
    max_tokens: Optional[MaxTokens] = None
    logprobs: Optional[Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[dict[str, Any]], Meta(min_length=1)]
    max_completion_tokens: Optional[MaxTokens] = None
    max_tokens: Optional[MaxTokens] = None  # deprecated by OpenAI, still sent by many clients
    logprobs: Optional[bool] = None
    top_logprobs: Optional[Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    thinking_token_budget: Optional[Annotated[int, Meta(ge=-1, le=2**32 - 1)]] = None  # vLLM's; -1 = none
    add_generation_prompt: bool = True


COMPLETION_SCHEMA = struct_schema(CompletionRequest)
CHAT_SCHEMA = struct_schema(ChatCompletionRequest)  # messages, tools: free-form, not looked into

_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)


def decode_body(decoder: msgspec.json.Decoder, body: bytes):
    if not body.strip():
        raise bad_request("The request body is empty: a JSON object is expected.")
    if too_deep(body):  # before any recursive decode (docs/reliability.md "Hostile input")
        raise bad_request(f"The request body nests JSON deeper than {MAX_JSON_DEPTH} levels.")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as e:
        msg = str(e)
        param = None
        if " - at `$." in msg:
            param = msg.rsplit(" - at `$.", 1)[1].rstrip("`")
            param = param.split("[", 1)[0].split(".", 1)[0] or None
        elif msg.startswith("Object missing required field `"):
            param = msg.split("`")[1]
        raise bad_request(msg, param) from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise bad_request(f"The request body is not valid JSON: {e}") from None


def decode_completion(body: bytes) -> CompletionRequest:
    req = decode_body(_completion_decoder, body)
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_request("best_of is not supported (it must be absent or equal to n).", "best_of")
    if req.suffix:
        raise bad_request("suffix is not supported.", "suffix")
    return req


def decode_chat(body: bytes) -> ChatCompletionRequest:
    req = decode_body(_chat_decoder, body)
    if req.top_logprobs is not None and req.top_logprobs > 0 and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
    for i, m in enumerate(req.messages):
        if not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}].role must be a string.", "messages")
        content = m.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise bad_request(f"messages[{i}].content must be a string or a list of content parts.", "messages")
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content: only text content parts are supported by this model.",
                                  "messages")
            texts.append(part["text"])
        m["content"] = "\n".join(texts)  # as vLLM gives a "string"-format template a list of text parts
    return req


def ignored(body: bytes, chat: bool) -> list[Found]:
    """The keys of a decoded-fine body that its request type does not have (top level,
    ``stream_options``, ``response_format`` and its ``json_schema``, ``structured_outputs``), found
    on raw slices: the typed decode dropped them."""
    return find_in_json(body, CHAT_SCHEMA if chat else COMPLETION_SCHEMA)


def stops(stop: Stop) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def prompts(prompt: Union[str, list[Any]]) -> list[Union[str, list[int]]]:
    """The prompts of a completion request: each a text or a list of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty.", "prompt")
    if all(type(x) is int for x in prompt):
        return [prompt]
    if all(isinstance(x, str) for x in prompt):
        return list(prompt)
    if all(isinstance(x, list) and x and all(type(t) is int for t in x) for x in prompt):
        return list(prompt)
    raise bad_request("prompt must be a string, a list of token ids, a list of strings or a list of token-id "
                      "lists.", "prompt")
