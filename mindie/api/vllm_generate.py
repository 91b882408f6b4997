"""vLLM's ``POST /generate`` (a body with ``prompt``; mindie.md §7; MindIE
single_req_vllm_infer_interface.cpp), on the ``/generate`` route that it shares with TGI
(mindie/api/generate.py tells the two bodies apart).

Checks in MindIE's order with its messages (422): prompt (present, string, length, tokens) ->
ignore_eos, stop (a string up to 32768 UTF-16 units or a list of at most 1024-unit strings, total
<= 32768), stop_token_ids, include_stop_str_in_output (read only with stop or stop_token_ids),
temperature ([0, FLT_MAX]: 0 = greedy), top_k (-1 = off, 0 refused), top_p ((0, 1]), seed,
repetition_penalty, frequency_penalty and presence_penalty ([-2, 2]), skip_special_tokens,
best_of ([1, 128]), n ([1, 8192]), model, max_tokens (default maxIterTimes), stream -> best_of
against n and the temperature -> best_of/n > 1 refused (one sequence per request here) -> the
structured output (vLLM's ``structured_outputs`` object or its older ``guided_*`` keys: at most one;
mindie/text/structured.py), a bad one 422 with the message naming the field.

Answers: ``{"text": ["<prompt> <output>"]}`` (MindIE joins them with one space); a stream is
``{"text": ["<new text>"]}`` chunks, each followed by a NUL byte. Keys not read are ignored and
named (``X-Ignored-Fields``, a rate-limited WARNING: mindie/text/ignored_fields.py).
"""
from __future__ import annotations

from typing import Any, Container, Optional

import msgspec

from mindie.contract import families
from mindie.contract.grammar import ConstraintError
from mindie.contract.wire import Constraint, SamplingParams
from mindie.text.detokenizer import TextTokenizer
from mindie.contract.http_error import validation_error
from mindie.text.generation import Piece
from mindie.text.ignored_fields import find
from mindie.pipeline import Codec, Context, Job, Output, Sub, finish_name
from mindie.text.structured import (GUIDED_KEYS, STRUCTURED_OUTPUTS_KEYS, Checker, as_validation_error, from_guided,
                                    from_structured_outputs, one_of)
from mindie.text.validation import (MAX_INT32, Limits, cap_max_new_tokens, check_model_name, check_stop, check_text_input,
                               check_token_ids, clamp_top_k, decode_json, dump_number, encode_text_input, float_param,
                               get_param, implicit_do_sample, random_seed, repetition_penalty_param, seed_param,
                               temperature_param, top_k_param, top_p_param, u16len)

# The keys read (the others, ``inputs`` beside ``prompt`` among them, are ignored and named:
# mindie/text/ignored_fields.py).
SCHEMA = {**dict.fromkeys(("prompt", "ignore_eos", "stop", "stop_token_ids", "include_stop_str_in_output",
                           "temperature", "top_k", "top_p", "seed", "repetition_penalty", "frequency_penalty",
                           "presence_penalty", "skip_special_tokens", "best_of", "n", "model", "max_tokens", "stream")
                          + GUIDED_KEYS),
          "structured_outputs": dict.fromkeys(STRUCTURED_OUTPUTS_KEYS)}

MAX_TOTAL_STOP = 32 * 1024
MAX_BEST_OF = 128
MAX_N = 8192
MAX_LORA_ID_LENGTH = 256


class VllmRequest(msgspec.Struct, kw_only=True):
    """A checked vLLM body (None = not given)."""

    prompt: str
    input_ids: list[int]
    stream: bool = False
    max_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: int = 0
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    n: Optional[int] = None
    best_of: Optional[int] = None
    model: Optional[str] = None
    adapter: str = ""  # the LoRA adapter ``model`` names ("" = the base model)
    constraint: Optional[Constraint] = None  # structured output (mindie/text/structured.py)
    constraint_field: str = ""  # the field that gave it


def _check_prompt(v, limits) -> str:
    return check_text_input(v, limits, "Contains not prompt or prompt null", "Prompt arr is empty",
                            "The type of prompt is abnormal",
                            "Prompt must be necessary and data type must be string and length in "
                            "(0, {limit}], but the length of inputs is {n}")


def _stop_token_ids(p: dict) -> list[int]:
    v = p.get("stop_token_ids")
    if v is None:
        return []
    if type(v) is not list:
        raise validation_error("Parameter stop_token_ids not array")
    out = set()
    for t in v:
        if type(t) is not int:
            raise validation_error("Parameter stop_token_ids not list[int]")
        if 0 <= t <= MAX_INT32:  # MindIE drops the others silently
            out.add(t)
    return sorted(out)


def parse_vllm(p: dict, limits, encode, model_name: str, adapters: Container[str] = ()) -> VllmRequest:
    prompt = _check_prompt(p.get("prompt"), limits)
    ids = encode_text_input(prompt, encode, "Messages token length must be in (0, {limit}], but got {n}. "
                                            "This could be caused by invalid input format or empty content.")
    ignore_eos = bool(get_param(p, "ignore_eos", "boolean"))
    stop = check_stop(p, False, MAX_TOTAL_STOP)
    stop_ids = _stop_token_ids(p)
    include_stop = False
    if "stop" in p or "stop_token_ids" in p:
        include_stop = bool(get_param(p, "include_stop_str_in_output", "boolean"))
    temperature = temperature_param(p, zero_ok=True)  # 0 = greedy
    top_k = top_k_param(p, off_ok=True)  # -1 = off
    top_p = top_p_param(p, one_ok=True)
    seed = seed_param(p)
    repetition_penalty = repetition_penalty_param(p)
    frequency_penalty = float_param(p, "frequency_penalty", lambda x: -2.0 <= x <= 2.0,
                                     "Parameter frequency_penalty should be in [-2.0, 2.0], got {}.")
    presence_penalty = float_param(p, "presence_penalty", lambda x: -2.0 <= x <= 2.0,
                                    "Parameter presence_penalty not in [-2.0, 2.0], but got {}.")
    skip_special = get_param(p, "skip_special_tokens", "boolean")
    best_of = get_param(p, "best_of", "unsigned")
    if best_of is not None and not 1 <= best_of <= MAX_BEST_OF:
        raise validation_error(f"Parameter [best_of] should be in [1, {MAX_BEST_OF}], got {dump_number(best_of)}.")
    n = get_param(p, "n", "unsigned")
    if n is not None and not 1 <= n <= MAX_N:
        raise validation_error(f"Parameter [n] should be in [1, {MAX_N}], got {dump_number(n)}. ")
    model = p.get("model")
    if model is not None:
        if type(model) is not str:
            raise validation_error("Model must be string type.")
        ln = u16len(model)
        if not 1 <= ln <= MAX_LORA_ID_LENGTH:
            raise validation_error(f"Input validation error: length of `model` must be in [1, {MAX_LORA_ID_LENGTH}], "
                                   f"but got {ln}")
    max_tokens = p.get("max_tokens")
    if max_tokens is None:
        max_tokens = limits.max_iter_times
    else:
        if type(max_tokens) is not int:
            raise validation_error("Parameter max_tokens not number_integer")
        if not 0 < max_tokens <= MAX_INT32:
            raise validation_error(f"Parameter max_tokens must be (0,{MAX_INT32}], got {dump_number(max_tokens)}")
    stream = get_param(p, "stream", "boolean")
    # SetReturnSeqCount, then the endpoint's features.
    count = 1
    if best_of is not None and n is not None:
        if best_of < n:
            raise validation_error(f"best_of should greater than or equal to n, but best_of is {best_of}, n is {n}.")
        count = best_of
    elif best_of is not None or n is not None:
        count = best_of if best_of is not None else n
    if (temperature is None or temperature == 0.0) and count > 1:
        raise validation_error("Best_of/N can not greater than 1 when temperature is 0 or not set, but best_of is "
                               f"{best_of if best_of is not None else 'None'}, n is {n if n is not None else 'None'}.")
    if count > 1:
        raise validation_error("best_of/n greater than 1 are not supported by this endpoint")
    try:
        constraint, field = one_of((from_structured_outputs(p.get("structured_outputs")), "structured_outputs"),
                                   from_guided(p))
    except ConstraintError as e:
        raise as_validation_error(e) from None
    adapter = check_model_name(model, model_name, adapters)
    ids = check_token_ids(ids, limits)
    return VllmRequest(
        prompt=prompt, input_ids=ids, stream=bool(stream), max_tokens=max_tokens, stop=stop, stop_token_ids=stop_ids,
        include_stop_str_in_output=include_stop, skip_special_tokens=skip_special is not False,
        ignore_eos=ignore_eos, temperature=temperature, top_k=top_k, top_p=top_p,
        seed=seed if seed is not None else random_seed(), repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, n=n, best_of=best_of, model=model,
        adapter=adapter, constraint=constraint, constraint_field=field)


def sampling_of(r: VllmRequest, limits) -> SamplingParams:
    """vLLM's sampling: temperature 0 is greedy; otherwise sampling is decided as on /infer
    (temperature, top_k, top_p set to non-neutral values), top_k -1 = off."""
    top_k = clamp_top_k(None if r.top_k == -1 else r.top_k, limits)
    greedy = r.temperature == 0.0
    do_sample = False if greedy else implicit_do_sample(r.temperature, top_k or None, r.top_p, None)
    return SamplingParams(
        do_sample=do_sample,
        temperature=1.0 if greedy or r.temperature is None else r.temperature,
        top_k=top_k,
        top_p=r.top_p if r.top_p is not None else 1.0,
        repetition_penalty=r.repetition_penalty if r.repetition_penalty is not None else 1.0,
        seed=r.seed,
        max_new_tokens=cap_max_new_tokens(r.max_tokens, len(r.input_ids), limits),
        ignore_eos=r.ignore_eos,
        stop_token_ids=list(r.stop_token_ids),
        presence_penalty=r.presence_penalty or 0.0,
        frequency_penalty=r.frequency_penalty or 0.0,
        constraint=r.constraint,
    )


class VllmCodec(Codec):
    """vLLM's ``/generate`` shapes: the answer ``{"text": [...]}``, a stream of NUL-terminated
    ``{"text": [new text]}`` chunks (not SSE), errors as MindIE's JSON (NUL-terminated in a stream)."""

    content_type = "text/plain; charset=utf-8"
    family = families.VLLM

    def __init__(self, tokenizer: TextTokenizer, limits: Limits, model_name: str, adapters: Container[str] = (),
                 structured: Checker | None = None):
        """``adapters``: the LoRA adapters ``model`` may name (mindie/lora_adapters.py); ``structured``:
        the front end's constraint checker (None: one of its own)."""
        self.tokenizer = tokenizer
        self.structured = structured if structured is not None else Checker(tokenizer)
        self.limits = limits
        self.model_name = model_name
        self.adapters = adapters

    def parse(self, body: bytes, ctx: Context) -> Job:
        value = decode_json(body)
        return self.parse_value(value if type(value) is dict else {})

    def parse_value(self, body: dict[str, Any]) -> Job:
        """A decoded body (an object with ``prompt``) into its job."""
        r = parse_vllm(body, self.limits, self.tokenizer.encode, self.model_name, self.adapters)
        sub = Sub(r.input_ids, sampling_of(r, self.limits), stops=r.stop, include_stop=r.include_stop_str_in_output,
                  adapter=r.adapter)
        checks = (self.structured.pending(r.constraint, r.constraint_field, as_validation_error)
                  if r.constraint is not None else [])
        return Job([sub], r.stream, r, self, ignored=find(body, SCHEMA), checks=checks)

    def finish_label(self, finish: str) -> str:
        return finish_name(finish)

    def reply(self, job: Job, outs: list[Output], ctx: Context) -> bytes:
        r: VllmRequest = job.request
        return msgspec.json.encode({"text": [r.prompt + " " + outs[0].text]})

    def render(self, job: Job, out: Output, p: Piece, ctx: Context) -> list[bytes]:
        return [msgspec.json.encode({"text": [p.text]}) + b"\0"]
