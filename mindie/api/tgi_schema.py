"""TGI request bodies (``/generate`` with ``inputs``, ``/generate_stream``, ``POST /``): the typed
request and MindIE's checks with MindIE's messages (single_req_tgi_text_infer_interface.cpp
``ValidateAndPrepareReqToken`` then ``SetupInferParams``), in MindIE's order; the first failure
is a 422 ``Input Validation Error``. The checks shared with ``/infer`` are mindie/text/validation.py's.

Order: inputs (present, string, length in UTF-16 units, tokens) -> ``parameters`` object -> stop,
temperature, top_k, top_p (< 1 as on /infer), typical_p, do_sample, seed, repetition_penalty,
watermark, adapter_id, max_new_tokens, details, decoder_input_details, return_full_text,
truncate -> decoder_input_details with a stream -> TGI-only keys MindIE does not read
(top_n_tokens, best_of, grammar: mindie/text/structured.py, its compile check left to the codec's
``Job.checks``) -> engine checks (424) on the truncated prompt.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Container, Optional

import msgspec

from mindie.contract.wire import DEFAULT_MAX_NEW_TOKENS, SamplingParams
from mindie.contract.http_error import validation_error
from mindie.contract.grammar import ConstraintError
from mindie.text.structured import as_validation_error, from_tgi_grammar
from mindie.text.validation import (MAX_INT32, Limits, check_common_params, check_model_name, check_params_object,
                               check_stop, check_string, check_text_input, check_token_ids, dump_number,
                               encode_text_input, get_param, max_new_tokens_param)

# What is read of the body (TGI keys this server does not implement, such as frequency_penalty,
# are ignored, and named: mindie/text/ignored_fields.py). ``stream`` only on ``POST /``.
PARAMETERS = {**dict.fromkeys(("stop", "temperature", "top_k", "top_p", "typical_p", "do_sample", "seed",
                               "repetition_penalty", "watermark", "adapter_id", "max_new_tokens", "details",
                               "decoder_input_details", "return_full_text", "truncate", "top_n_tokens", "best_of",
                               "ignore_eos")),
              "grammar": {"type": None, "value": None}}
SCHEMA = {"inputs": None, "parameters": PARAMETERS}
COMPAT_SCHEMA = {**SCHEMA, "stream": None}

MAX_STOP_LEN_TGI = 1024  # MindIE's TGI path: one stop string up to MAX_STOP_STRING_LEN
MAX_TOP_N_TOKENS = 5  # TGI's default max_top_n_tokens
MAX_BEST_OF = 128  # MindIE's range for best_of
_ADAPTER_RE = re.compile(r"^[a-zA-Z0-9_./-]{1,256}$")


class TgiParameters(msgspec.Struct, kw_only=True):
    """``parameters`` after the checks (None = not given)."""

    stop: list[str] = []
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    typical_p: Optional[float] = None
    do_sample: Optional[bool] = None
    seed: Optional[int] = None
    repetition_penalty: Optional[float] = None
    watermark: bool = False
    adapter_id: Optional[str] = None
    max_new_tokens: Optional[int] = None
    details: bool = False
    decoder_input_details: bool = False
    return_full_text: bool = False
    truncate: Optional[int] = None
    top_n_tokens: Optional[int] = None
    best_of: Optional[int] = None


class TgiRequest(msgspec.Struct, kw_only=True):
    """A checked TGI request: the text, its (truncated) prompt ids and the parameters."""

    inputs: str
    input_ids: list[int]
    stream: bool
    parameters: TgiParameters
    sampling: SamplingParams
    adapter: str = ""  # the LoRA adapter ``adapter_id`` names ("" = the base model)


def check_inputs(v: Any, limits: Limits) -> str:
    return check_text_input(v, limits, "Request should contain 'inputs' and the type should be string.",
                            "Inputs arr is empty", "The type of inputs is abnormal",
                            "Inputs length must be in (0, {limit}], but got {n}")


def check_bool(p: dict, key: str) -> bool:
    return bool(get_param(p, key, "boolean"))


def parse_tgi(body: dict, limits: Limits, encode: Callable[[str], list[int]], stream: bool,
              model_name: str, adapters: Container[str] = ()) -> TgiRequest:
    """Check a decoded TGI body (an object with ``inputs``); raise ApiError with MindIE's message.
    ``adapter_id`` names the base model or one of the LoRA ``adapters`` (mindie/lora_adapters.py)."""
    text = check_inputs(body.get("inputs"), limits)
    ids = encode_text_input(text, encode, "Inputs token length must be in (0, {limit}], but got {n}")
    p = check_params_object(body)
    stop = check_stop(p, True, MAX_STOP_LEN_TGI)
    c = check_common_params(p)
    watermark = check_bool(p, "watermark")
    adapter_id = check_string(p, "adapter_id")
    if adapter_id is not None and not _ADAPTER_RE.match(adapter_id):
        raise validation_error("The format of adapter_id is invalid.")
    max_new_tokens = max_new_tokens_param(p)
    details = check_bool(p, "details")
    decoder_input_details = check_bool(p, "decoder_input_details")
    return_full_text = check_bool(p, "return_full_text")
    truncate = get_param(p, "truncate", "integer")
    if truncate is not None and not 0 < truncate <= MAX_INT32:
        raise validation_error(f"truncate must be in (0,{MAX_INT32}], got {dump_number(truncate)}.")
    if stream and decoder_input_details:
        raise validation_error("The decoder_input_details must not be true when stream is true.")
    # TGI keys MindIE does not read: checked in MindIE's style.
    top_n_tokens = get_param(p, "top_n_tokens", "unsigned")
    if top_n_tokens is not None and top_n_tokens > MAX_TOP_N_TOKENS:
        raise validation_error(f"Parameter top_n_tokens must be in [0, {MAX_TOP_N_TOKENS}], got {top_n_tokens}.")
    best_of = get_param(p, "best_of", "unsigned")
    if best_of is not None:
        if not 1 <= best_of <= MAX_BEST_OF:
            raise validation_error(f"Parameter [best_of] should be in [1, {MAX_BEST_OF}], "
                                   f"got {dump_number(best_of)}.")
        if best_of > 1:
            raise validation_error("best_of/n greater than 1 are not supported by this endpoint")
    try:
        constraint = from_tgi_grammar(p.get("grammar"), "grammar")
    except ConstraintError as e:
        raise as_validation_error(e) from None
    adapter = check_model_name(adapter_id, model_name, adapters)

    # TruncateReqTokens: keep the last `truncate` tokens, then the engine's checks.
    if truncate is not None and len(ids) > truncate:
        ids = ids[len(ids) - truncate:]
    ids = check_token_ids(ids, limits)
    sampling = c.sampling(
        limits, max_new_tokens if max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS, len(ids),
        watermark=watermark,
        # Log-probabilities of the sampled tokens (and the top n) when the details show them.
        logprobs=(top_n_tokens or 0) if (details or decoder_input_details or top_n_tokens) else -1,
        prompt_logprobs=decoder_input_details,
        ignore_eos=p.get("ignore_eos") is True,  # as on /infer: a benchmark extension
    )
    sampling.constraint = constraint
    params = TgiParameters(
        stop=stop, temperature=c.temperature, top_k=c.top_k, top_p=c.top_p, typical_p=c.typical_p,
        do_sample=c.do_sample, seed=sampling.seed, repetition_penalty=c.repetition_penalty, watermark=watermark,
        adapter_id=adapter_id, max_new_tokens=max_new_tokens, details=details, decoder_input_details=decoder_input_details,
        return_full_text=return_full_text, truncate=truncate, top_n_tokens=top_n_tokens, best_of=best_of)
    return TgiRequest(inputs=text, input_ids=ids, stream=stream, parameters=params, sampling=sampling, adapter=adapter)

