"""Triton-style routes on MindIE's business plane (mindie.md §2.1, §7; MindIE
single_req_triton_token_infer_interface.cpp and single_req_triton_text_infer_interface.cpp):

- ``POST /v2/models/{m}/infer``: token ids in, token ids out, as UINT32 tensors:
  ``{"id", "inputs": [{"name", "shape": [1, n] or [n], "datatype": "UINT32", "data": [...],
  "parameters": {...}}], "outputs": [{"name"}]}`` -> ``{"id", "outputs": [{"name", "shape": [1, k],
  "datatype": "UINT32", "data": [generated ids]}]}``. MindIE reads the parameters from
  ``inputs[0].parameters``; a top-level ``parameters`` (the reference's example) is read when
  ``inputs[0]`` has none.
- ``POST /v2/models/{m}/generate`` and ``/generate_stream``: ``{"id", "text_input", "parameters"}``
  -> ``{"id", "model_name", "model_version": null, "text_output", ["details": {...},
  "prefill_time", "decode_time"]}``; the stream sends one such object per token as
  ``data:{json}\\n\\n`` (``text_output`` is the new text, the cumulative text with
  ``fullTextEnabled``).

``{m}`` must be the served model: 404 ``Model X not found.`` before anything else. ``id``, when
given, is the request's name for stopInfer and the answer's ``id`` (else the ``req-id``).
Parameters as on ``/infer`` with Triton's differences: ``top_p`` 1.0 and ``top_k`` 0 are accepted,
``batch_size`` is checked (and otherwise unused); ``typical_p`` only on the text routes.
Other keys are ignored, as MindIE ignores them, and named (``X-Ignored-Fields`` and a
rate-limited WARNING: mindie/text/ignored_fields.py).
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Optional

import falcon.asgi
import msgspec

from mindie.contract import families
from mindie.contract.sse_framing import event
from mindie.contract.wire import DEFAULT_MAX_NEW_TOKENS, DEFAULT_PRIORITY, SamplingParams
from mindie.text.detokenizer import TextTokenizer
from mindie.contract.http_error import generation_error, not_found, validation_error
from mindie.text.generation import Piece
from mindie.text.ignored_fields import Found, find
from mindie.pipeline import Codec, Context, Job, Output, Pipeline, Sub, finish_name
from mindie.text.validation import (MAX_INT32, MAX_TOKEN_ID, MAX_TOKENS_NUM, CommonParams, Limits, check_common_params,
                               check_params_object, check_text_input, check_token_count, check_token_ids, decode_json,
                               dump_number, encode_text_input, get_param, max_new_tokens_param, priority_param,
                               random_seed, timeout_param)

ID_RE = re.compile(r"^[a-zA-Z0-9_-]{1,256}$")
ID_MESSAGE = ("The id can contain only digits, letters, underscores(_), hyphens(-) and no more than 256 words "
              "in length.")
_ENQUEUE = "Failed to enqueue inferRequest. "

# The keys read (the others are ignored and named: mindie/text/ignored_fields.py).
TOKEN_PARAMETERS = dict.fromkeys(("temperature", "top_k", "top_p", "do_sample", "seed", "repetition_penalty",
                                  "watermark", "priority", "max_new_tokens", "timeout", "details", "batch_size"))
TEXT_PARAMETERS = {**TOKEN_PARAMETERS, "typical_p": None}
TOKEN_SCHEMA = {"id": None, "parameters": TOKEN_PARAMETERS, "outputs": {"name": None},
                "inputs": {"name": None, "shape": None, "datatype": None, "data": None,
                           "parameters": TOKEN_PARAMETERS}}
TEXT_SCHEMA = {"id": None, "text_input": None, "parameters": TEXT_PARAMETERS}


def ignored_in(body: dict, text_route: bool) -> list[Found]:
    """The keys of a checked body that the route does not read: a top-level ``parameters``
    too when ``inputs[0]`` has its own (MindIE reads only those)."""
    if text_route:
        return find(body, TEXT_SCHEMA)
    found = find(body, TOKEN_SCHEMA)
    inputs = body.get("inputs")
    if body.get("parameters") is not None and type(inputs) is list and inputs and type(inputs[0]) is dict \
            and inputs[0].get("parameters") is not None:
        found = [("parameters", TOKEN_SCHEMA)] + [f for f in found if not f[0].startswith("parameters.")]
    return found


class TritonParameters(msgspec.Struct, kw_only=True):
    """Checked ``parameters`` of a Triton request (None = not given)."""

    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    typical_p: Optional[float] = None
    do_sample: Optional[bool] = None
    seed: int = 0
    repetition_penalty: Optional[float] = None
    watermark: bool = False
    priority: int = DEFAULT_PRIORITY
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    timeout: Optional[int] = None
    details: bool = False
    batch_size: Optional[int] = None


class TritonRequest(msgspec.Struct, kw_only=True):
    id: Optional[str]
    input_ids: list[int]
    parameters: TritonParameters
    output_name: str = "output0"  # /infer
    text: str = ""  # /generate*


def _check_id(body: dict) -> str | None:
    v = body.get("id")
    if v is None:
        return None
    if type(v) is not str:
        raise validation_error("id must be string type.")
    if not ID_RE.match(v):
        raise validation_error(ID_MESSAGE)
    return v


def parse_parameters(p: dict, text_route: bool) -> TritonParameters:
    """Triton's SetupInferParams, MindIE's order and messages."""
    # Triton accepts top_k 0 (allowLowerBound) and top_p 1.0; typical_p only on the text routes.
    c = check_common_params(p, top_k_zero_ok=True, top_p_one_ok=True, typical_p=text_route)
    watermark = bool(get_param(p, "watermark", "boolean"))
    priority = priority_param(p)
    max_new_tokens = max_new_tokens_param(p)

    def batch_size_() -> int | None:
        b = get_param(p, "batch_size", "integer")
        if b is not None and not 0 < b <= MAX_INT32:
            raise validation_error(f"Parameter batch_size must be in (0,{MAX_INT32}], got {dump_number(b)}.")
        return b

    # The token route checks timeout before details and batch_size, the text route after them.
    timeout = None if text_route else timeout_param(p)
    details = bool(get_param(p, "details", "boolean"))
    batch_size = batch_size_()
    if text_route:
        timeout = timeout_param(p)
    return TritonParameters(
        temperature=c.temperature, top_k=c.top_k, top_p=c.top_p, typical_p=c.typical_p, do_sample=c.do_sample,
        seed=c.seed if c.seed is not None else random_seed(), repetition_penalty=c.repetition_penalty,
        watermark=watermark,
        priority=priority if priority is not None else DEFAULT_PRIORITY,
        max_new_tokens=max_new_tokens if max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS,
        timeout=timeout, details=details, batch_size=batch_size)


def sampling_of(t: TritonParameters, n_ids: int, limits) -> SamplingParams:
    c = CommonParams(t.temperature, t.top_k, t.top_p, t.typical_p, t.do_sample, t.seed, t.repetition_penalty)
    return c.sampling(limits, t.max_new_tokens, n_ids, watermark=t.watermark)


def parse_token_request(body, limits) -> TritonRequest:
    """/v2/models/{m}/infer (ValidateAndPrepareReqToken, then SetupInferParams)."""
    if type(body) is not dict:
        body = {}
    inputs = body.get("inputs")
    if type(inputs) is not list:
        raise validation_error("Req should contain 'inputs' and the type should be array.")
    if len(inputs) != 1:
        raise validation_error("Inputs count must be 1.")
    inp = inputs[0] if type(inputs[0]) is dict else {}
    name = inp.get("name")
    if type(name) is not str:
        raise validation_error("Cannot find name in inputs or its type is not string")
    if len(name.encode()) > 256:
        raise validation_error("The length of name set in inputs exceeds 256.")
    shape = inp.get("shape")
    if type(shape) is not list:
        raise validation_error("Cannot find shape in inputs or its type is not array")
    if any(type(x) is not int or x < 0 for x in shape):
        raise validation_error("Shape element must be integer type.")
    if not (len(shape) == 1 or (len(shape) == 2 and shape[0] == 1 and 0 < shape[1] <= MAX_TOKENS_NUM)):
        raise validation_error("Shape must be at most two-dimensional, and the last element's value must be in "
                               f"(0,{MAX_TOKENS_NUM}].")
    n = shape[-1]
    dtype = inp.get("datatype")
    if type(dtype) is not str:
        raise validation_error("Cannot find datatype in inputs or its type is not string")
    if dtype != "UINT32":
        raise validation_error(f"Unsupported datatype, got {dtype}.")
    data = inp.get("data")
    if type(data) is not list:
        raise validation_error("Cannot find data in inputs or its type is not array")
    if len(data) > MAX_TOKENS_NUM:
        raise validation_error(f"Data element must be no more than max token id length, which is {MAX_TOKENS_NUM}.")
    if len(data) != n:
        raise validation_error(f"Data size should be {n}, got {len(data)}.")
    if any(type(x) is not int for x in data):
        raise validation_error("Data element must be integer type.")
    rid = _check_id(body)
    outputs = body.get("outputs")
    if type(outputs) is not list:
        raise validation_error("Req should contain 'outputs' and the type should be array.")
    if len(outputs) != 1:
        raise validation_error(f"Outputs size should be 1, got {len(outputs)}.")
    out_name = outputs[0].get("name") if type(outputs[0]) is dict else None
    if type(out_name) is not str:
        raise validation_error("Outputs name must be non-empty string.")
    holder = inp if inp.get("parameters") is not None else body
    params = parse_parameters(check_params_object(holder), text_route=False)
    check_token_count(len(data))
    # The engine's checks (424): every id inside the vocabulary (UINT32: no negative ids).
    if min(data) < 0 or max(data) > MAX_TOKEN_ID or (limits.vocab_size > 0 and max(data) >= limits.vocab_size):
        raise generation_error(_ENQUEUE + "Invalid Input Ids")
    ids = check_token_ids(list(data), limits, vocab_checked=True)
    return TritonRequest(id=rid, input_ids=ids, parameters=params, output_name=out_name or "output0")


def parse_text_request(body, limits, encode, request_id: str) -> TritonRequest:
    """/v2/models/{m}/generate[_stream]."""
    if type(body) is not dict:
        body = {}
    rid = _check_id(body)
    text = check_text_input(body.get("text_input"), limits, "The text_input not found",
                            "Parameter text_input arr is empty",
                            f"The type of text_input is abnormal. The requestId is {rid or request_id}",
                            "text_input must be necessary and data type must be string and length in "
                            "(0, {limit}], but the length of inputs is {n}")
    ids = encode_text_input(text, encode, "text_input token length must be in (0, {limit}], but got {n}")
    params = parse_parameters(check_params_object(body), text_route=True)
    ids = check_token_ids(ids, limits)
    return TritonRequest(id=rid, input_ids=ids, parameters=params, text=text)


_json = msgspec.json.encode


class TritonCodec(Codec):
    """Triton's shapes; ``mode``: "infer" (tokens), "generate" or "stream" (text)."""

    family = families.TRITON

    def __init__(self, tokenizer: TextTokenizer, limits: Limits, model_name: str, mode: str, full_text: bool):
        self.tokenizer = tokenizer
        self.limits = limits
        self.model_name = model_name
        self.mode = mode
        self.full_text = full_text

    def precheck(self, ctx: Context) -> None:
        if ctx.kw["model"] != self.model_name:
            raise not_found(f"Model {ctx.kw['model']} not found.")

    def parse(self, body: bytes, ctx: Context) -> Job:
        value = decode_json(body)
        if self.mode == "infer":
            r = parse_token_request(value, self.limits)
        else:
            r = parse_text_request(value, self.limits, self.tokenizer.encode, ctx.request_id)
        t = r.parameters
        sub = Sub(r.input_ids, sampling_of(t, len(r.input_ids), self.limits), priority=t.priority, timeout=t.timeout,
                  user_id=r.id)
        return Job([sub], self.mode == "stream", r, ignored=ignored_in(value, self.mode != "infer"))

    def finish_label(self, finish: str) -> str:
        return finish_name(finish)

    def _head(self, r: TritonRequest, ctx: Context) -> dict:
        return {"id": r.id or ctx.request_id, "model_name": ctx.kw["model"], "model_version": None}

    def reply(self, job: Job, outs: list[Output], ctx: Context) -> bytes:
        r: TritonRequest = job.request
        out = outs[0]
        if self.mode == "infer":
            return _json({"id": r.id or ctx.request_id,
                          "outputs": [{"name": r.output_name, "shape": [1, len(out.ids)], "datatype": "UINT32",
                                       "data": out.ids}]})
        res = self._head(r, ctx)
        res["text_output"] = out.text
        if r.parameters.details:
            res["details"] = {"finish_reason": finish_name(out.finish), "generated_tokens": len(out.ids),
                              "first_token_cost": None, "decode_cost": None, "batch_size": None,
                              "queue_wait_time": None}
        return _json(res)

    def render(self, job: Job, out: Output, p: Piece, ctx: Context) -> Iterator[bytes]:
        r: TritonRequest = job.request
        res = self._head(r, ctx)
        res["text_output"] = out.text if self.full_text else p.text
        if r.parameters.details:
            d: dict = {}
            if p.finish_reason:
                d["finish_reason"] = finish_name(p.finish_reason)
            d.update({"generated_tokens": len(out.ids), "first_token_cost": None, "decode_cost": None,
                      "batch_size": None, "queue_wait_time": None})
            res["details"] = d
            if not out.state.get("started"):
                res["prefill_time"], res["decode_time"] = round(p.prefill_ms, 2), None
            else:
                res["prefill_time"], res["decode_time"] = None, round(p.decode_ms, 2)
        out.state["started"] = True
        yield event(_json(res), space=False)


class TritonResource:
    """The three Triton inference routes (responder suffixes "infer", "generate", "generate_stream")."""

    def __init__(self, pipeline: Pipeline, model_name: str, full_text: bool = False):
        self.pipeline = pipeline
        tok, lim = pipeline.tokenizer, pipeline.limits
        self.codecs = {mode: TritonCodec(tok, lim, model_name, mode, full_text)
                       for mode in ("infer", "generate", "stream")}

    async def on_post_infer(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, model: str) -> None:
        await self.pipeline.serve(req, resp, self.codecs["infer"], model=model)

    async def on_post_generate(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, model: str) -> None:
        await self.pipeline.serve(req, resp, self.codecs["generate"], model=model)

    async def on_post_generate_stream(self, req: falcon.asgi.Request, resp: falcon.asgi.Response,
                                      model: str) -> None:
        await self.pipeline.serve(req, resp, self.codecs["stream"], model=model)
