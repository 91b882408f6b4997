"""MindIE's request-parameter semantics, once, for every API family: the JSON type model, each
parameter's range and message, the request limits, the prompt checks and the engine-side
checks (424). Each family's body parser sits beside its route (mindie/api/*_schema.py, and the
parse functions of vllm_generate.py and triton.py) and calls these; the defaults are the
contract's (``mindie.contract.wire.DEFAULT_*``).

Source of truth: mindie.md §3/§4 and MindIE-LLM's C++ (``infer_param.cpp``, ``parse_protocol.cpp``,
``llm_manager_impl.cpp ProcessReqInputIds``).

JSON type semantics (nlohmann): a non-negative integer literal is "unsigned", a negative one
"integer", anything with a fraction/exponent (or an integer beyond 64 bits) "float"; "float"
checks accept any number, "integer" checks accept unsigned and integer, and ``true`` is never a
number. An optional key that is absent **or null** is "not set".

Numbers in messages: MindIE prints the JSON value itself (``jsonObj[key]`` -> nlohmann
``dump``), so ``0`` prints ``0``, ``0.0`` prints ``0.0``, ``1e-7`` prints ``1e-07`` (``dump_number``),
and the FLT_MAX bound prints as ``3.40282e+38`` (C++ stream default precision).

JSON nested deeper than ``MAX_JSON_DEPTH`` (100) arrays/objects is refused before decoding with
422 (nlohmann has no depth limit; a recursive decoder must have one). See docs/reliability.md.
"""
from __future__ import annotations

import math
import re
import secrets
from dataclasses import dataclass
from itertools import accumulate, count
from operator import sub
from typing import Any, Callable, Container, NamedTuple

import msgspec

from mindie.config import ModelDeployConfig, ScheduleConfig, ServerConfig
from mindie.contract.wire import DEFAULT_MAX_NEW_TOKENS, DEFAULT_PRIORITY, SamplingParams
from mindie.contract.http_error import ApiError, generation_error, validation_error

__all__ = [
    "Limits",
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_PRIORITY",
    "check_token_count",
    "check_token_ids",
    "cap_max_new_tokens",
    "implicit_do_sample",
    "random_seed",
    "get_param",
    "float_param",
    "dump_number",
    "too_deep",
    "check_json_text",
    "DEPTH_ERROR",
    "check_common_params",
    "CommonParams",
    "clamp_top_k",
]

MAX_TOKEN_ID = 1024 * 1024  # endpoint range for an input id: [0, 1048576]
MAX_TOKENS_NUM = 1024 * 1024  # input length range: (0, 1048576]
MAX_INT32 = 2**31 - 1
INT64_MAX = 2**63 - 1
_INT64_MIN = -(2**63)
_UINT64_MAX = 2**64 - 1
FLT_MAX = 3.4028234663852886e38  # MindIE bounds temperature/repetition_penalty by float max
FLT_MAX_TEXT = "3.40282e+38"  # how MindIE's std::stringstream prints FLT_MAX
MAX_PRIORITY = 5
MAX_TIMEOUT_S = 65535

PARSE_ERROR = "Failed to parse request context to json"
_ENQUEUE = "Failed to enqueue inferRequest. "


# --------------------------------------------------------------------------------------------
# Limits and the parsed request
# --------------------------------------------------------------------------------------------


# The config's defaults (MindIE's), defined once in mindie/config.py.
_SERVER, _DEPLOY, _SCHEDULE = ServerConfig(), ModelDeployConfig(), ScheduleConfig()


@dataclass(frozen=True, slots=True)
class Limits:
    """Request limits taken from the server config (build with ``Limits.from_config``).

    ``truncation``: 0 (or False) rejects over-long input with 424; -1 (or True) right-truncates,
    i.e. keeps the first ``max_input_len`` tokens; 1 left-truncates, i.e. keeps the last ones
    (mindie.md §8 ``truncation``). ``vocab_size``/``max_position_embeddings`` 0 = unknown (not
    checked), as in MindIE.
    """

    vocab_size: int = 0
    max_input_len: int = min(_DEPLOY.max_input_token_len, _DEPLOY.max_seq_len - 1)
    truncation: int = 0
    max_request_length_mb: int = _SERVER.max_request_length
    max_seq_len: int = _DEPLOY.max_seq_len
    max_iter_times: int = _SCHEDULE.max_iter_times
    max_position_embeddings: int = 0
    token_timeout: float = float(_SERVER.token_timeout)  # s, longest wait for the next token (tokenTimeout)
    e2e_timeout: float = float(_SERVER.e2e_timeout)  # s, longest request (e2eTimeout)

    def __post_init__(self) -> None:
        t = self.truncation
        # MindIE's config accepts a bool here too: true = -1 (right), false = 0.
        t = -1 if t is True else 0 if t is False else int(t)
        if t not in (-1, 0, 1):
            raise ValueError(f"truncation must be -1, 0 or 1 (or a bool), got {self.truncation!r}")
        object.__setattr__(self, "truncation", t)

    @classmethod
    def from_config(
        cls,
        *,
        max_seq_len: int,
        max_input_token_len: int,
        max_iter_times: int,
        truncation: int | bool = 0,
        vocab_size: int = 0,
        max_request_length_mb: int = _SERVER.max_request_length,
        max_position_embeddings: int = 0,
        token_timeout: float = float(_SERVER.token_timeout),
        e2e_timeout: float = float(_SERVER.e2e_timeout),
    ) -> "Limits":
        """Limits from MindIE config keys; ``max_input_len = min(maxInputTokenLen, maxSeqLen-1)``."""
        return cls(
            vocab_size=vocab_size,
            max_input_len=min(max_input_token_len, max_seq_len - 1),
            truncation=truncation,  # type: ignore[arg-type]  # normalised in __post_init__
            max_request_length_mb=max_request_length_mb,
            max_seq_len=max_seq_len,
            max_iter_times=max_iter_times,
            max_position_embeddings=max_position_embeddings,
            token_timeout=token_timeout,
            e2e_timeout=e2e_timeout,
        )

    @property
    def max_text_len(self) -> int:
        """Max ``inputs`` length in UTF-16 units (MindIE ``GetMaxInputLen``: maxRequestLength MiB)."""
        return self.max_request_length_mb * 1024 * 1024

    @property
    def truncation_len(self) -> int:
        """How many tokens truncation keeps."""
        mpe = self.max_position_embeddings
        return min(self.max_input_len, mpe) if mpe > 0 else self.max_input_len


# --------------------------------------------------------------------------------------------
# Small public helpers
# --------------------------------------------------------------------------------------------


def implicit_do_sample(
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    typical_p: float | None,
) -> bool:
    """Whether to sample when the request did not say (``do_sample`` absent or null).

    TGI's rule (tgi.md §3.2): sampling is on when any warper is set to a non-neutral value:
    temperature != 1.0, top_k != 0, top_p < 1.0 or typical_p < 1.0 (None = not set). An explicit
    neutral value (temperature 1.0, typical_p 1.0) keeps greedy decoding. repetition_penalty,
    watermark and seed never switch sampling on. An explicit ``do_sample`` always wins.
    """
    return (
        (temperature is not None and temperature != 1.0)
        or (top_k is not None and top_k != 0)
        or (top_p is not None and top_p < 1.0)
        or (typical_p is not None and typical_p < 1.0)
    )


def random_seed() -> int:
    """A fresh seed in [0, 2**63 - 1] (MindIE draws one whenever the request has none)."""
    return secrets.randbits(63)


def check_token_count(n: int) -> None:
    """422 unless 0 < n <= 1048576 (MindIE endpoint check on the prompt length)."""
    if n == 0 or n > MAX_TOKENS_NUM:
        raise validation_error(
            f"Inputs token length must be in (0, {MAX_TOKENS_NUM}], but got {n}"
        )


def check_token_ids(ids: list[int], limits: Limits, vocab_checked: bool = False) -> list[int]:
    """Engine-side prompt checks (MindIE ``ProcessReqInputIds``); returns the ids to run.

    Order as MindIE: any id >= vocab_size -> 424 ``... Invalid Input Ids``; then with
    truncation on, cut to ``limits.truncation_len`` (first tokens kept for -1, last for 1);
    with truncation 0, too long -> 424 ``... cannot be greater than N,the input ids length is M``.
    Works for ``input_id`` and for tokenised ``inputs`` alike. The device workers trust the
    result (they never repeat these checks).
    """
    n = len(ids)
    # vocab_checked: the fast body decode already bounded every id by vocab_size - 1.
    if not vocab_checked and limits.vocab_size > 0 and n and max(ids) >= limits.vocab_size:
        raise generation_error(_ENQUEUE + "Invalid Input Ids")
    if limits.truncation != 0:
        keep = limits.truncation_len
        if n > keep:
            return ids[:keep] if limits.truncation < 0 else ids[n - keep:]
        return ids
    mpe = limits.max_position_embeddings
    if 0 < mpe < n:
        raise generation_error(
            _ENQUEUE + "This model's maximum input ids length cannot be greater than "
            f"maxPositionEmbeddings {mpe},the input ids length is {n}"
        )
    if n > limits.max_input_len:
        # No space after the comma: MindIE's exact text.
        raise generation_error(
            _ENQUEUE + "This model's maximum input ids length cannot be greater than "
            f"{limits.max_input_len},the input ids length is {n}"
        )
    if n > limits.max_seq_len:  # only reachable with inconsistent hand-made Limits
        raise generation_error(
            _ENQUEUE + "This model's maximum input ids length cannot be greater than "
            f"maxSeqLen {limits.max_seq_len},the input ids length is {n}"
        )
    return ids


def cap_max_new_tokens(max_new_tokens: int, input_len: int, limits: Limits) -> int:
    """Effective output budget: ``min(max_new_tokens, maxIterTimes, maxSeqLen - input_len)``."""
    return max(0, min(max_new_tokens, limits.max_iter_times, limits.max_seq_len - input_len))


# --------------------------------------------------------------------------------------------
# JSON type model (nlohmann semantics)
# --------------------------------------------------------------------------------------------


def _json_kind(v: Any) -> str:
    """nlohmann's type name for a decoded JSON value."""
    t = type(v)
    if t is int:
        if 0 <= v <= _UINT64_MAX:
            return "unsigned"
        if _INT64_MIN <= v < 0:
            return "integer"
        return "float"  # nlohmann parses integer literals beyond 64 bits as doubles
    if t is float:
        return "float"
    if t is bool:
        return "boolean"
    if t is str:
        return "string"
    if t is list:
        return "array"
    if t is dict:
        return "object"
    return "null"


_ACCEPTS = {
    "float": ("unsigned", "integer", "float"),
    "integer": ("unsigned", "integer"),
    "unsigned": ("unsigned",),
    "boolean": ("boolean",),
    "object": ("object",),
}


def _dump_float(x: float) -> str:
    """nlohmann ``dump`` of a double: shortest round-trip digits, like ``repr``.

    nlohmann switches to exponent notation when the decimal exponent is >= 15 (``1e+15``) where
    Python waits until 16; below 1e-4 both use ``1e-05`` style.
    """
    if x == 0.0:
        return "-0.0" if math.copysign(1.0, x) < 0 else "0.0"
    r = repr(x)
    if "e" in r or abs(x) < 1e15:
        return r
    sign = "-" if x < 0 else ""
    whole, _, frac = repr(abs(x)).partition(".")
    digits = (whole + frac).rstrip("0")
    mant = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
    return f"{sign}{mant}e+{len(whole) - 1:02d}"


def dump_number(v: Any) -> str:
    """How MindIE prints a JSON number in a message (``jsonObj[key]`` / ``.dump()``)."""
    if type(v) is int and _INT64_MIN <= v <= _UINT64_MAX:
        return str(v)
    return _dump_float(_as_float(v))


def _as_float(v: Any) -> float:
    try:
        return float(v)
    except OverflowError:  # an integer literal too big for a double: nlohmann rejects the body
        raise validation_error(PARSE_ERROR) from None


def get_param(p: dict[str, Any], key: str, want: str) -> Any:
    """The value of optional ``key`` (None when absent or null), type-checked like
    MindIE's ``CheckOptionalItemType``."""
    v = p.get(key)
    if v is None:
        return None
    if _json_kind(v) not in _ACCEPTS[want]:
        raise validation_error(f"{key} must be {want} type.")
    return v


def float_param(p: dict[str, Any], key: str, in_range: Callable[[float], bool], message: str) -> float | None:
    """An optional "float" parameter checked against its range; ``message`` gets the value as
    MindIE prints it."""
    v = get_param(p, key, "float")
    if v is None:
        return None
    x = _as_float(v)
    if not in_range(x):
        raise validation_error(message.format(dump_number(v)))
    return x


# --------------------------------------------------------------------------------------------
# Parameter checks shared by every route (MindIE's SetupInferParams messages)
# --------------------------------------------------------------------------------------------


def temperature_param(p: dict[str, Any], zero_ok: bool = False) -> float | None:
    """``temperature`` in (0, FLT_MAX]; ``zero_ok``: [0, FLT_MAX] (vLLM: 0 = greedy), same message."""
    in_range = (lambda x: 0.0 <= x <= FLT_MAX) if zero_ok else (lambda x: 0.0 < x <= FLT_MAX)
    return float_param(p, "temperature", in_range, f"Parameter temperature must be in (0.0,{FLT_MAX_TEXT}], got {{}}.")


def top_k_param(p: dict[str, Any], zero_ok: bool = False, off_ok: bool = False) -> int | None:
    """``top_k`` in (0, INT32_MAX]; ``zero_ok``: 0 too (Triton), ``off_ok``: -1 too (vLLM). MindIE's
    text (no final period; -1 is named even where it is rejected)."""
    v = get_param(p, "top_k", "integer")
    if v is not None and not (off_ok and v == -1) and not (0 if zero_ok else 1) <= v <= MAX_INT32:
        raise validation_error(f"Parameter top_k must be in -1 || (0,{MAX_INT32}], got {dump_number(v)}")
    return v


def top_p_param(p: dict[str, Any], one_ok: bool = False) -> float | None:
    """``top_p`` in (0, 1); ``one_ok``: (0, 1]. 1.0 itself is rejected on /infer and TGI
    (allowUpperBound=false), whatever the message says."""
    in_range = (lambda x: 0.0 < x <= 1.0) if one_ok else (lambda x: 0.0 < x < 1.0)
    return float_param(p, "top_p", in_range, "Parameter top_p must be in (0.0,1.0], got {}.")


def typical_p_param(p: dict[str, Any]) -> float | None:
    return float_param(p, "typical_p", lambda x: 0.0 < x <= 1.0, "Parameter typical_p must be in (0.0,1.0], got {}.")


def seed_param(p: dict[str, Any]) -> int | None:
    v = get_param(p, "seed", "unsigned")
    if v is not None and v > INT64_MAX:
        raise validation_error(f"Parameter seed must be in [0, {INT64_MAX}], got {dump_number(v)}.")
    return v


def repetition_penalty_param(p: dict[str, Any]) -> float | None:
    return float_param(p, "repetition_penalty", lambda x: 0.0 < x <= FLT_MAX,
                       f"Parameter 'repetition_penalty' must be in (0.0, {FLT_MAX_TEXT}], got {{}}.")


def priority_param(p: dict[str, Any]) -> int | None:
    v = get_param(p, "priority", "unsigned")
    if v is not None and not 1 <= v <= MAX_PRIORITY:
        raise validation_error(f"Parameter priority must be in [1,{MAX_PRIORITY}], got {v}.")
    return v


def max_new_tokens_param(p: dict[str, Any]) -> int | None:
    v = get_param(p, "max_new_tokens", "integer")
    if v is not None and not 0 < v <= MAX_INT32:
        raise validation_error(f"Parameter max_new_tokens must be in (0,{MAX_INT32}], got {dump_number(v)}.")
    return v


def timeout_param(p: dict[str, Any]) -> int | None:
    v = get_param(p, "timeout", "unsigned")
    if v is not None and not 0 < v <= MAX_TIMEOUT_S:
        raise validation_error("Parameter timeout must be strictly positive and small than 65535 seconds, "
                               f"got {dump_number(v)}.")
    return v


def clamp_top_k(top_k: int | None, limits: Limits) -> int:
    """``top_k`` as it runs: 0 = off; MindIE VerifyTopK clamps it to the vocabulary."""
    k = top_k or 0
    if k and limits.vocab_size > 0:
        k = min(k, limits.vocab_size)
    return k


class CommonParams(NamedTuple):
    """The parameters every route checks first, in MindIE's order (None = not set)."""

    temperature: float | None
    top_k: int | None
    top_p: float | None
    typical_p: float | None
    do_sample: bool | None
    seed: int | None
    repetition_penalty: float | None

    def sampling(self, limits: Limits, max_new_tokens: int, n_ids: int, **extra: Any) -> SamplingParams:
        """The effective sampling parameters: ``do_sample`` decided when not given, a random seed
        when none, ``max_new_tokens`` capped; ``extra``: the route's other fields."""
        return SamplingParams(
            do_sample=self.do_sample if self.do_sample is not None
            else implicit_do_sample(self.temperature, self.top_k, self.top_p, self.typical_p),
            temperature=self.temperature if self.temperature is not None else 1.0,
            top_k=clamp_top_k(self.top_k, limits),
            top_p=self.top_p if self.top_p is not None else 1.0,
            typical_p=self.typical_p if self.typical_p is not None else 1.0,
            repetition_penalty=self.repetition_penalty if self.repetition_penalty is not None else 1.0,
            seed=self.seed if self.seed is not None else random_seed(),
            max_new_tokens=cap_max_new_tokens(max_new_tokens, n_ids, limits),
            **extra,
        )


def check_common_params(p: dict[str, Any], *, top_k_zero_ok: bool = False, top_p_one_ok: bool = False,
                        typical_p: bool = True) -> CommonParams:
    """temperature, top_k, top_p, typical_p (unless ``typical_p`` is False), do_sample, seed and
    repetition_penalty, in MindIE's order (/infer, TGI and Triton share it)."""
    return CommonParams(
        temperature_param(p),
        top_k_param(p, zero_ok=top_k_zero_ok),
        top_p_param(p, one_ok=top_p_one_ok),
        typical_p_param(p) if typical_p else None,
        get_param(p, "do_sample", "boolean"),
        seed_param(p),
        repetition_penalty_param(p),
    )


# --------------------------------------------------------------------------------------------
# JSON bodies (every family decodes its body through these checks)
# --------------------------------------------------------------------------------------------


_any_decoder = msgspec.json.Decoder()

MAX_JSON_DEPTH = 100  # arrays/objects nested deeper than this: 422 before decoding
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = bytes(i for i in range(256) if i not in b"[]{}")
_BRACKET_STEP = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")  # depth change + 1


def too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``body`` nests arrays/objects deeper than ``limit`` (brackets inside strings
    do not count). Decoding recurses once per level (RecursionError near Python's limit), so
    this runs before it.

    Fast path: a body with at most ``limit`` opening brackets cannot be deeper, and two
    ``bytes.count`` calls (C, about 1 us for 2 KB) prove it for the usual flat request.
    Otherwise every pass is in C (regex or split, translate, accumulate): about the cost of
    decoding the same body (docs/reliability.md "Hostile input").
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    if b'"' in body:  # drop strings: without escapes every other piece between quotes is one
        body = _JSON_STRING.sub(b"", body) if b"\\" in body else b"".join(body.split(b'"')[::2])
    steps = body.translate(_BRACKET_STEP, _NOT_BRACKET)  # 2 per opening, 0 per closing bracket
    if len(steps) <= 2 * limit:
        return False
    if b"\x02" * (limit + 1) in steps:  # the plain attack: limit + 1 openings in a row
        return True
    # depth after the i-th bracket = (sum of its steps) - i
    return max(map(sub, accumulate(steps), count(1))) > limit


_too_deep = too_deep  # tests/test_fuzz.py


def check_json_text(body: bytes, message: str = PARSE_ERROR) -> None:
    """422 ``message`` for a body refused before decoding: any invalid UTF-8 (msgspec does not
    look inside skipped keys, but MindIE converts the whole body with wstring_convert before
    parsing; isascii() is a fast C scan, only non-ASCII bodies pay for a full decode), or JSON
    nested deeper than MAX_JSON_DEPTH."""
    if not body.isascii():
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            raise validation_error(message) from None
    if too_deep(body):
        raise validation_error(message)


DEPTH_ERROR = f"The request body nests JSON deeper than {MAX_JSON_DEPTH} levels."


def decode_json(body: bytes, message: str = PARSE_ERROR) -> Any:
    """The body as JSON (MindIE rejects invalid UTF-8 and, here, nesting past 100 levels). A body
    too deep is refused with ``DEPTH_ERROR`` (a plain message naming the cause: ``message`` may be
    MindIE's embedded "no inputs" JSON text, which would name the wrong one)."""
    if too_deep(body):
        raise validation_error(DEPTH_ERROR)
    check_json_text(body, message)
    try:
        return _any_decoder.decode(body)
    except (msgspec.DecodeError, RecursionError):
        raise validation_error(message) from None


# --------------------------------------------------------------------------------------------
# Checks of the text routes (TGI, vLLM, Triton; MindIE's infer_param.cpp messages)
# --------------------------------------------------------------------------------------------


def u16len(text: str) -> int:
    """Length in UTF-16 code units, as MindIE measures strings."""
    if text.isascii():
        return len(text)
    return len(text.encode("utf-16-le", "surrogatepass")) >> 1


MAX_STOP_STRING_LEN = 1024
MAX_STOP_STRING_NUM = 1024
MAX_TOTAL_STOP = 32 * 1024


def check_stop(p: dict, limit_count: bool, single_max: int) -> list[str]:
    """``stop`` as MindIE's AssignStopStrings: a string or a list of strings."""
    v = p.get("stop")
    if v is None:
        return []
    if type(v) is str:
        n = u16len(v)
        if n < 1 or n > single_max:
            raise validation_error(f"Input validation error: length of `stop` must be in [1, {single_max}], "
                                   f"but got {n}")
        return [v]
    if type(v) is not list:
        raise validation_error("Input validation error: param stop must be string or list[string]")
    total = 0
    ok = True
    for s in v:
        if type(s) is not str or not 1 <= u16len(s) <= MAX_STOP_STRING_LEN:
            ok = False
            break
        total += u16len(s)
    if not ok or total > MAX_TOTAL_STOP or (limit_count and len(v) > MAX_STOP_STRING_NUM):
        raise validation_error(f"Input validation error: `stop` must be list[string] if list, and item length in "
                               f"[1, {MAX_STOP_STRING_LEN}] with total <= {MAX_TOTAL_STOP}")
    return list(v)


def check_text_input(v: Any, limits: Limits, missing: str, empty: str, abnormal: str, length: str) -> str:
    """A family's prompt text (TGI ``inputs``, vLLM ``prompt``, Triton ``text_input``) as MindIE
    checks it, with the family's messages: missing (absent or null), an empty list, any other
    list (multimodal), not a string, a length outside (0, max_text_len] UTF-16 units (``length``
    is formatted with ``limit`` and ``n``)."""
    if v is None:
        raise validation_error(missing)
    if type(v) is list:
        if not v:
            raise validation_error(empty)
        raise validation_error("Multimodal inputs are not supported by this model.")
    if type(v) is not str:
        raise validation_error(abnormal)
    n = u16len(v)
    if n == 0 or n > limits.max_text_len:
        raise validation_error(length.format(limit=limits.max_text_len, n=n))
    return v


def encode_text_input(text: str, encode: Callable[[str], list[int]], message: str) -> list[int]:
    """The prompt's token ids; 422 unless their count is in (0, MAX_TOKENS_NUM] (``message`` is
    formatted with ``limit`` and ``n``)."""
    ids = encode(text)
    if not 0 < len(ids) <= MAX_TOKENS_NUM:
        raise validation_error(message.format(limit=MAX_TOKENS_NUM, n=len(ids)))
    return ids


def check_params_object(container: dict, key: str = "parameters") -> dict:
    v = container.get(key)
    if v is None:
        return {}
    if type(v) is not dict:
        raise validation_error(f"{key} must be object type.")
    return v


def check_string(p: dict, key: str) -> str | None:
    v = p.get(key)
    if v is None:
        return None
    if type(v) is not str:
        raise validation_error(f"{key} must be string type.")
    return v


def check_model_name(name: str | None, served: str, adapters: Container[str] = ()) -> str:
    """The model a request names (TGI ``adapter_id``, vLLM ``model``, /infer's ``adapter_id``):
    "" for the base model (no name, its name, or MindIE's "None"), the name of a LoRA adapter
    in ``adapters`` (mindie/lora_adapters.py); 404 ``Model X not found.`` for any other."""
    if name is None or name in (served, "None"):
        return ""
    if name in adapters:
        return name
    raise ApiError(404, f"Model {name} not found.")
