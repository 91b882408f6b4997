"""The ``/infer`` and ``/infer_token`` request body, parsed and checked exactly as MindIE does.

Source of truth: mindie.md §3/§4 and MindIE-LLM's C++ (``single_req_self_develop_infer_interface.cpp``
``ValidateAndPrepareReqToken``/``SetupInferParams``, ``llm_manager_impl.cpp ProcessReqInputIds``).
The order of checks is MindIE's, and the first failure is reported:

1. JSON parse (invalid JSON or invalid UTF-8)         -> 422 ``Failed to parse request context to json``
2. ``stopped`` flag (after /stopService)              -> 503 ``The service has been stopped``
3. inputs: conflict / missing / input_id / inputs text -> 422 (messages in ``_check_ids``/``_check_text``)
   (text is tokenised here when ``encode`` is given), then the token count (0, 1048576]
4. ``parameters`` in MindIE's order: temperature, top_k, top_p, typical_p, do_sample, seed,
   repetition_penalty, watermark, priority, max_new_tokens, timeout, details; then top-level
   ``stream``                                          -> 422
5. engine checks (``check_token_ids``): ids >= vocab, input too long -> 424
   ``Failed to enqueue inferRequest. ...``; or truncation.

The parameter semantics (JSON kinds, ranges, messages) are mindie/text/validation.py's, shared with
every other family.

Keys MindIE does not read (top level or in ``parameters``) are ignored as MindIE ignores them,
and named: the ``X-Ignored-Fields`` header and a rate-limited WARNING (mindie/text/ignored_fields.py).

Deviations (documented choices):
- A list ``inputs`` (MindIE's multimodal form) passes MindIE's own checks and is then rejected
  with 422 ``Multimodal inputs are not supported by this model.``: this server is text-only.
- ``-0`` is "integer" for nlohmann but decodes to ``0`` here, so ``"priority": -0`` is accepted.
- A body that is valid JSON but not an object gives ``Not found inputs.`` (nlohmann's
  ``contains`` is false on non-objects), as MindIE.
- JSON nested deeper than ``MAX_JSON_DEPTH`` (100) arrays/objects is refused before decoding
  with 422 ``Failed to parse request context to json`` (nlohmann has no depth limit; a
  recursive decoder must have one). See docs/reliability.md.
"""
from __future__ import annotations

import functools
import re
from typing import Annotated, Any, Callable, Container, Optional, Union

import msgspec

from mindie.contract.wire import DEFAULT_PRIORITY, SamplingParams
from mindie.contract.http_error import service_unavailable, validation_error
from mindie.text.ignored_fields import Found, find
from mindie.text.validation import (DEFAULT_MAX_NEW_TOKENS, MAX_TOKEN_ID, PARSE_ERROR, Limits, _any_decoder, _json_kind,
                               check_common_params, check_json_text, check_model_name, check_string,
                               check_token_count, check_token_ids, get_param, max_new_tokens_param, priority_param,
                               timeout_param, u16len)

_UNSET = msgspec.UNSET

# What MindIE reads of the body (the rest is ignored, as MindIE does; mindie/text/ignored_fields.py
# names it): ``ignore_eos`` is this server's extension (AISBench sends it).
PARAMETERS = dict.fromkeys(("temperature", "top_k", "top_p", "typical_p", "do_sample", "seed", "repetition_penalty",
                            "watermark", "priority", "max_new_tokens", "timeout", "details", "ignore_eos",
                            "adapter_id"))
# Project extension: MindIE's /infer does not read adapter_id (its LoRA adapters are named on the
# vLLM, TGI and OpenAI routes); here it names one as on TGI's route, with TGI's check and message.
_ADAPTER_RE = re.compile(r"^[a-zA-Z0-9_./-]{1,256}$")
SCHEMA = {"inputs": None, "input_id": None, "stream": None, "parameters": PARAMETERS}


class InferRequest(msgspec.Struct, kw_only=True):
    """A validated /infer or /infer_token request: the ids to run (truncated if configured)
    and the effective sampling parameters (``do_sample`` decided, seed always filled,
    ``max_new_tokens`` = min(max_new_tokens or 20, maxIterTimes, maxSeqLen - len(input_ids)))."""

    input_ids: list[int]
    stream: bool = False
    details: bool = False
    priority: int = DEFAULT_PRIORITY
    timeout: Optional[int] = None  # seconds; None = not set (server timeouts apply)
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    ignored: list[Any] = []  # the body's keys MindIE does not read (ignored_fields.Found)
    adapter: str = ""  # the LoRA adapter parameters.adapter_id names ("" = the base model)


@functools.lru_cache(maxsize=16)
def _body_decoder(id_bound: int) -> msgspec.json.Decoder:
    """Decoder for the keys MindIE reads. Any other top-level key fails this decode (so the
    common body costs nothing to check for ignored keys) and ``_decode_body`` takes the
    generic path, which finds them.

    ``input_id`` is typed as a list of ints in [0, id_bound] (id_bound folds the vocabulary into
    the endpoint range), so the common request is parsed and its ids checked in one C pass. Any
    deviation raises ``ValidationError`` and ``_decode_body`` falls back to a generic decode that
    finds MindIE's message.
    """
    ids_type = Union[Optional[list[Annotated[int, msgspec.Meta(ge=0, le=id_bound)]]], msgspec.UnsetType]
    body_type = msgspec.defstruct(
        "_Body",
        [
            ("inputs", Any, _UNSET),
            ("input_id", ids_type, _UNSET),
            ("stream", Any, _UNSET),
            ("parameters", Any, _UNSET),
        ],
        forbid_unknown_fields=True,
    )
    return msgspec.json.Decoder(body_type)


class _Parsed:
    """The four top-level values MindIE reads (UNSET = key absent)."""

    __slots__ = ("inputs", "input_id", "stream", "parameters", "ids_checked", "ignored")

    def __init__(self, src: Any, ids_checked: bool) -> None:
        get = src.get if type(src) is dict else (lambda k, d: getattr(src, k))
        self.inputs = get("inputs", _UNSET)
        self.input_id = get("input_id", _UNSET)
        self.stream = get("stream", _UNSET)
        self.parameters = get("parameters", _UNSET)
        # True: input_id (if a list) already passed the endpoint range and vocab checks.
        self.ids_checked = ids_checked
        # The typed decode admits no unknown top-level key: only `parameters` may hold some.
        self.ignored: list[Found] = (find(self.parameters, PARAMETERS, "parameters.") if ids_checked
                                     else find(src, SCHEMA))


def _id_bound(limits: Limits) -> int:
    return min(MAX_TOKEN_ID, limits.vocab_size - 1) if limits.vocab_size > 0 else MAX_TOKEN_ID


def _decode_body(body: bytes, limits: Limits) -> _Parsed | None:
    """Parse the body; None when it is valid JSON but not an object."""
    if not isinstance(body, (bytes, bytearray)):
        body = bytes(body)
    check_json_text(body)
    # RecursionError: second line of defence behind too_deep (a decode started deep in the stack).
    try:
        return _Parsed(_body_decoder(_id_bound(limits)).decode(body), True)
    except msgspec.ValidationError:
        pass  # slow path below: not an object, a bad/out-of-vocab input_id, a number overflow, an unknown key
    except (msgspec.DecodeError, RecursionError):
        raise validation_error(PARSE_ERROR) from None
    try:
        value = _any_decoder.decode(body)
    except (msgspec.DecodeError, RecursionError):  # DecodeError includes numbers that overflow a double
        raise validation_error(PARSE_ERROR) from None
    return _Parsed(value, False) if type(value) is dict else None


def _check_ids(value: Any) -> list[int]:
    """``input_id`` checks on a generic value (MindIE ``CheckTokenInput``); the first bad
    element decides the message, as in MindIE's loop."""
    if value is None:
        raise validation_error("Input_id should not be empty")
    if type(value) is not list:
        raise validation_error("Parameter input_id must be an array")
    for x in value:
        if _json_kind(x) not in ("unsigned", "integer"):
            raise validation_error("Parameter input_id must be integer")
        if x < 0 or x > MAX_TOKEN_ID:
            raise validation_error("Data element in param input_id is invalid")
    return value


def _check_multimodal(items: list[Any]) -> bool:
    """MindIE ``CheckMultimodalUrlFromJson``; returns whether any media url is present."""
    media = 0
    for item in items:
        if type(item) is not dict:
            continue  # nlohmann contains() is false on non-objects
        if "text" in item and type(item["text"]) is not str:
            raise validation_error("Request param text must be string")
        if not ("image_url" in item or "video_url" in item or "audio_url" in item):
            continue
        for key in ("image_url", "audio_url", "video_url"):  # MindIE's order
            if key in item and item[key] is None:
                raise validation_error(f"Request param {key} null")
        media += 1
        if media > 20:
            raise validation_error("The number of multimodal url should be no more than 20")
    return media > 0


def _check_text(value: Any, limits: Limits) -> str:
    """``inputs`` checks (MindIE ``CheckTextInput``), before tokenisation."""
    if value is None:
        raise validation_error("Inputs must not be null")
    if type(value) is str:
        text = value
    elif type(value) is list:
        if not value:
            raise validation_error("Inputs arr is empty")
        _check_multimodal(value)
        text = msgspec.json.encode(value).decode()  # MindIE measures the dumped list
    else:
        raise validation_error("The type of inputs is abnormal")
    n = u16len(text)
    limit = limits.max_text_len
    if n == 0 or n > limit:
        raise validation_error(
            f"Inputs must be necessary and data type must be string and length in (0, {limit}]"
            f", but the length of inputs is {n}"
        )
    if type(value) is list:
        raise validation_error("Multimodal inputs are not supported by this model.")
    return text


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def parse_infer_request(
    body: bytes,
    limits: Limits,
    *,
    encode: Callable[[str], list[int]],
    stopped: bool = False,
    model_name: str = "",
    adapters: Container[str] = (),
) -> InferRequest:
    """Validate an /infer or /infer_token body; raise ``ApiError`` with MindIE's first error.

    ``encode`` tokenises text ``inputs`` at MindIE's point in the order (before parameter
    checks). ``stopped`` = the service was stopped (503 after a successful parse, as MindIE).
    ``parameters.adapter_id`` (an extension) names ``model_name`` or one of the LoRA ``adapters``.
    """
    b = _decode_body(body, limits)
    if stopped:
        raise service_unavailable("The service has been stopped")
    if b is None:
        raise validation_error("Not found inputs.")

    # ---- inputs (ValidateAndPrepareReqToken) ----
    has_text = b.inputs is not _UNSET
    has_ids = b.input_id is not _UNSET
    if has_text and has_ids:
        raise validation_error("Input conflict.")
    if has_text:
        ids = encode(_check_text(b.inputs, limits))
        check_token_count(len(ids))
    elif has_ids:
        v = b.input_id
        # Fast path: the typed decode already checked every element (type, range, vocab).
        ids = v if (b.ids_checked and v is not None) else _check_ids(v)
        check_token_count(len(ids))
    else:
        raise validation_error("Not found inputs.")

    # ---- parameters (SetupInferParams), in MindIE's order ----
    params = b.parameters
    if params is _UNSET or params is None:
        p: dict[str, Any] = {}
    elif type(params) is dict:
        p = params
    else:
        raise validation_error("parameters must be object type.")

    c = check_common_params(p)
    watermark = get_param(p, "watermark", "boolean")
    priority = priority_param(p)
    max_new_tokens = max_new_tokens_param(p)
    timeout = timeout_param(p)
    details = get_param(p, "details", "boolean")
    adapter_id = check_string(p, "adapter_id")
    if adapter_id is not None and not _ADAPTER_RE.match(adapter_id):
        raise validation_error("The format of adapter_id is invalid.")
    stream = b.stream
    if stream is _UNSET or stream is None:
        stream = False
    elif type(stream) is not bool:
        raise validation_error("stream must be boolean type.")

    adapter = check_model_name(adapter_id, model_name, adapters)

    # ---- build ----
    # Engine checks (424) come after every 422, as in MindIE.
    ids = check_token_ids(ids, limits, vocab_checked=has_ids and b.ids_checked)
    sampling = c.sampling(
        limits, max_new_tokens if max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS, len(ids),
        watermark=bool(watermark),
        # Project extension: MindIE ignores `ignore_eos` on this route (AISBench sends it);
        # honoured here when it is a boolean so benchmarks get exact lengths, ignored otherwise.
        ignore_eos=p.get("ignore_eos") is True,
    )
    return InferRequest(
        input_ids=ids,
        stream=stream,
        details=bool(details),
        priority=priority if priority is not None else DEFAULT_PRIORITY,
        timeout=timeout,
        sampling=sampling,
        ignored=b.ignored,
        adapter=adapter,
    )
