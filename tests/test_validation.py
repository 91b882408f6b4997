"""MindIE /infer and /infer_token validation: every row of mindie.md §4.1/§4.2 (status + exact text)."""
from __future__ import annotations

import json

import msgspec
import pytest

from mindie.contract import wire as protocol
from mindie.contract.http_error import ApiError, request_too_large
from mindie.api.infer_schema import InferRequest, parse_infer_request
from mindie.text.validation import (
    INT64_MAX,
    Limits,
    _dump_float,
    cap_max_new_tokens,
    check_token_ids,
    implicit_do_sample,
)

LIMITS = Limits.from_config(max_seq_len=2560, max_input_token_len=2048, max_iter_times=512, vocab_size=32000)
NO_VOCAB = Limits.from_config(max_seq_len=2560, max_input_token_len=2048, max_iter_times=512)
PARSE = "Failed to parse request context to json"
FLT = "3.40282e+38"


def body(obj: object) -> bytes:
    return json.dumps(obj).encode()


def char_encode(text: str) -> list[int]:
    return [1] + [ord(c) % 100 for c in text]  # BOS + one id per character


def err(raw: bytes, limits: Limits = LIMITS, **kw: object) -> tuple[int, str]:
    kw.setdefault("encode", char_encode)
    with pytest.raises(ApiError) as ei:
        parse_infer_request(raw, limits, **kw)  # type: ignore[arg-type]
    e = ei.value
    # Every error body is {"error", "error_type"} in that order.
    decoded = json.loads(e.body())
    assert list(decoded) == ["error", "error_type"]
    assert decoded == {"error": e.message, "error_type": e.error_type}
    return e.status, e.message


def ok(obj: object, limits: Limits = LIMITS, **kw: object) -> InferRequest:
    kw.setdefault("encode", char_encode)
    return parse_infer_request(body(obj), limits, **kw)  # type: ignore[arg-type]


def with_params(**params: object) -> bytes:
    return body({"input_id": [1, 2, 3], "parameters": params})


# ---------------------------------------------------------------------------------------------
# §4.1 request body and inputs
# ---------------------------------------------------------------------------------------------

PARSE_FAILURES = [
    b"",
    b"{",
    b'{"input_id":[1],}',
    b'{"input_id":[1]} trailing',
    b"{'input_id':[1]}",
    b'{"input_id":[NaN]}',
    b'{"input_id":[1],"parameters":{"temperature":1e400}}',  # double overflow: nlohmann rejects
    b'{"input_id":[1],"junk":"\xff"}',  # invalid UTF-8, even in a key MindIE never reads
    b'{"inputs":"\xc3("}',
    b'{"inputs":"\xed\xa0\x80"}',  # UTF-8-encoded surrogate
    b'{"inputs":"\\ud800"}',  # lone surrogate escape
    b"\xef\xbb\xbf" + b'{"input_id":[1]}',  # BOM
]


@pytest.mark.parametrize("raw", PARSE_FAILURES)
def test_unparseable_body(raw: bytes) -> None:
    assert err(raw) == (422, PARSE)


INPUT_ROWS = [
    # both / neither (presence, not value: null counts as present for these two keys)
    ({"inputs": "hi", "input_id": [1]}, "Input conflict."),
    ({"inputs": None, "input_id": None}, "Input conflict."),
    ({"inputs": "hi", "input_id": [1], "parameters": 5}, "Input conflict."),
    ({}, "Not found inputs."),
    ({"parameters": {}}, "Not found inputs."),
    ({"Input_id": [1]}, "Not found inputs."),
    ([], "Not found inputs."),
    ([{"input_id": [1]}], "Not found inputs."),
    ("input_id", "Not found inputs."),
    (5, "Not found inputs."),
    (None, "Not found inputs."),
    # input_id
    ({"input_id": None}, "Input_id should not be empty"),
    ({"input_id": "1 2 3"}, "Parameter input_id must be an array"),
    ({"input_id": {"0": 1}}, "Parameter input_id must be an array"),
    ({"input_id": 5}, "Parameter input_id must be an array"),
    ({"input_id": True}, "Parameter input_id must be an array"),
    ({"input_id": [1, 2.0]}, "Parameter input_id must be integer"),
    ({"input_id": [1, 2.5]}, "Parameter input_id must be integer"),
    ({"input_id": [True]}, "Parameter input_id must be integer"),
    ({"input_id": ["1"]}, "Parameter input_id must be integer"),
    ({"input_id": [None]}, "Parameter input_id must be integer"),
    ({"input_id": [[1]]}, "Parameter input_id must be integer"),
    ({"input_id": [2**64]}, "Parameter input_id must be integer"),  # > uint64: a float for nlohmann
    ({"input_id": [-1]}, "Data element in param input_id is invalid"),
    ({"input_id": [1048577]}, "Data element in param input_id is invalid"),
    ({"input_id": [2**63]}, "Data element in param input_id is invalid"),
    ({"input_id": [-(2**63)]}, "Data element in param input_id is invalid"),
    # the first bad element decides
    ({"input_id": [-1, 2.0]}, "Data element in param input_id is invalid"),
    ({"input_id": [2.0, -1]}, "Parameter input_id must be integer"),
    ({"input_id": []}, "Inputs token length must be in (0, 1048576], but got 0"),
    # inputs
    ({"inputs": None}, "Inputs must not be null"),
    ({"inputs": 5}, "The type of inputs is abnormal"),
    ({"inputs": True}, "The type of inputs is abnormal"),
    ({"inputs": {"text": "hi"}}, "The type of inputs is abnormal"),
    ({"inputs": []}, "Inputs arr is empty"),
    (
        {"inputs": ""},
        "Inputs must be necessary and data type must be string and length in (0, 41943040], "
        "but the length of inputs is 0",
    ),
    ({"inputs": [{"type": "text", "text": 5}]}, "Request param text must be string"),
    ({"inputs": [{"type": "image_url", "image_url": None}]}, "Request param image_url null"),
    ({"inputs": [{"type": "audio_url", "audio_url": None}]}, "Request param audio_url null"),
    ({"inputs": [{"type": "video_url", "video_url": None}]}, "Request param video_url null"),
    (
        {"inputs": [{"type": "image_url", "image_url": "u"}] * 21},
        "The number of multimodal url should be no more than 20",
    ),
    # Deviation (text-only server): a list that passes MindIE's checks is still refused.
    ({"inputs": [{"type": "text", "text": "hi"}]}, "Multimodal inputs are not supported by this model."),
    # input errors come before parameter errors
    ({"input_id": [-1], "parameters": 5}, "Data element in param input_id is invalid"),
    ({"input_id": None, "stream": "x"}, "Input_id should not be empty"),
]


@pytest.mark.parametrize(("obj", "message"), INPUT_ROWS)
def test_input_rows(obj: object, message: str) -> None:
    assert err(body(obj)) == (422, message)


def test_input_id_range_edges() -> None:
    assert ok({"input_id": [0, 1048576]}, NO_VOCAB).input_ids == [0, 1048576]
    assert ok({"input_id": [0, 31999]}).input_ids == [0, 31999]


def test_input_id_too_many() -> None:
    raw = b'{"input_id":[' + b"0," * 1048576 + b"0]}"
    assert err(raw, NO_VOCAB) == (422, "Inputs token length must be in (0, 1048576], but got 1048577")


def test_inputs_length_in_utf16_units() -> None:
    small = Limits(max_request_length_mb=1)
    limit = 1024 * 1024
    msg = (
        "Inputs must be necessary and data type must be string and length in (0, 1048576], "
        "but the length of inputs is {}"
    )
    assert err(body({"inputs": "a" * (limit + 1)}), small) == (422, msg.format(limit + 1))
    # An astral character is two UTF-16 units; a BMP CJK character is one.
    assert err(body({"inputs": "😀" * (limit // 2 + 1)}), small) == (422, msg.format(limit + 2))
    assert ok({"inputs": "中" * limit}, small, encode=lambda t: [len(t)]).input_ids == [limit]


def test_stopped_service_checked_after_parse() -> None:
    assert err(body({"input_id": [1]}), stopped=True) == (503, "The service has been stopped")
    assert err(body({}), stopped=True)[0] == 503
    assert err(b"{", stopped=True) == (422, PARSE)


# ---------------------------------------------------------------------------------------------
# §4.2 parameters
# ---------------------------------------------------------------------------------------------

PARAM_ROWS = [
    # temperature: any number, (0, FLT_MAX]
    ({"temperature": 0}, f"Parameter temperature must be in (0.0,{FLT}], got 0."),
    ({"temperature": 0.0}, f"Parameter temperature must be in (0.0,{FLT}], got 0.0."),
    ({"temperature": -0.0}, f"Parameter temperature must be in (0.0,{FLT}], got -0.0."),
    ({"temperature": -1.5}, f"Parameter temperature must be in (0.0,{FLT}], got -1.5."),
    ({"temperature": -3}, f"Parameter temperature must be in (0.0,{FLT}], got -3."),
    ({"temperature": 3.5e38}, f"Parameter temperature must be in (0.0,{FLT}], got 3.5e+38."),
    ({"temperature": True}, "temperature must be float type."),
    ({"temperature": "0.5"}, "temperature must be float type."),
    ({"temperature": [0.5]}, "temperature must be float type."),
    ({"temperature": {}}, "temperature must be float type."),
    # top_k: integer, (0, 2^31-1]; the text names -1 but -1 is rejected here; no final period
    ({"top_k": 0}, "Parameter top_k must be in -1 || (0,2147483647], got 0"),
    ({"top_k": -1}, "Parameter top_k must be in -1 || (0,2147483647], got -1"),
    ({"top_k": 2147483648}, "Parameter top_k must be in -1 || (0,2147483647], got 2147483648"),
    ({"top_k": 2**63}, "Parameter top_k must be in -1 || (0,2147483647], got 9223372036854775808"),
    ({"top_k": 5.0}, "top_k must be integer type."),
    ({"top_k": 2**64}, "top_k must be integer type."),
    ({"top_k": True}, "top_k must be integer type."),
    ({"top_k": "5"}, "top_k must be integer type."),
    # top_p: number, 0 < p < 1 (1.0 itself rejected on /infer)
    ({"top_p": 1.0}, "Parameter top_p must be in (0.0,1.0], got 1.0."),
    ({"top_p": 1}, "Parameter top_p must be in (0.0,1.0], got 1."),
    ({"top_p": 0}, "Parameter top_p must be in (0.0,1.0], got 0."),
    ({"top_p": 1.5}, "Parameter top_p must be in (0.0,1.0], got 1.5."),
    ({"top_p": -1e-05}, "Parameter top_p must be in (0.0,1.0], got -1e-05."),
    ({"top_p": False}, "top_p must be float type."),
    ({"top_p": "0.9"}, "top_p must be float type."),
    # typical_p: number, (0, 1]
    ({"typical_p": 0}, "Parameter typical_p must be in (0.0,1.0], got 0."),
    ({"typical_p": 1.01}, "Parameter typical_p must be in (0.0,1.0], got 1.01."),
    ({"typical_p": True}, "typical_p must be float type."),
    # do_sample: boolean
    ({"do_sample": 1}, "do_sample must be boolean type."),
    ({"do_sample": "true"}, "do_sample must be boolean type."),
    # seed: unsigned, <= 2^63-1
    ({"seed": -1}, "seed must be unsigned type."),
    ({"seed": 1.0}, "seed must be unsigned type."),
    ({"seed": True}, "seed must be unsigned type."),
    ({"seed": "1"}, "seed must be unsigned type."),
    ({"seed": 2**64}, "seed must be unsigned type."),  # beyond uint64: a float for nlohmann
    ({"seed": 2**63}, "Parameter seed must be in [0, 9223372036854775807], got 9223372036854775808."),
    ({"seed": 2**64 - 1}, "Parameter seed must be in [0, 9223372036854775807], got 18446744073709551615."),
    # repetition_penalty: number, (0, FLT_MAX]
    ({"repetition_penalty": 0}, f"Parameter 'repetition_penalty' must be in (0.0, {FLT}], got 0."),
    ({"repetition_penalty": -1.0}, f"Parameter 'repetition_penalty' must be in (0.0, {FLT}], got -1.0."),
    ({"repetition_penalty": 1e39}, f"Parameter 'repetition_penalty' must be in (0.0, {FLT}], got 1e+39."),
    ({"repetition_penalty": "1"}, "repetition_penalty must be float type."),
    # watermark: boolean
    ({"watermark": 1}, "watermark must be boolean type."),
    # priority: unsigned, [1, 5]
    ({"priority": 0}, "Parameter priority must be in [1,5], got 0."),
    ({"priority": 6}, "Parameter priority must be in [1,5], got 6."),
    ({"priority": 2**64 - 1}, "Parameter priority must be in [1,5], got 18446744073709551615."),
    ({"priority": -1}, "priority must be unsigned type."),
    ({"priority": 5.0}, "priority must be unsigned type."),
    ({"priority": True}, "priority must be unsigned type."),
    ({"priority": "5"}, "priority must be unsigned type."),
    # max_new_tokens: integer, (0, 2^31-1]
    ({"max_new_tokens": 0}, "Parameter max_new_tokens must be in (0,2147483647], got 0."),
    ({"max_new_tokens": -5}, "Parameter max_new_tokens must be in (0,2147483647], got -5."),
    ({"max_new_tokens": 2147483648}, "Parameter max_new_tokens must be in (0,2147483647], got 2147483648."),
    ({"max_new_tokens": 20.0}, "max_new_tokens must be integer type."),
    ({"max_new_tokens": True}, "max_new_tokens must be integer type."),
    # timeout: unsigned, [1, 65535]
    ({"timeout": 0}, "Parameter timeout must be strictly positive and small than 65535 seconds, got 0."),
    ({"timeout": 65536}, "Parameter timeout must be strictly positive and small than 65535 seconds, got 65536."),
    ({"timeout": -1}, "timeout must be unsigned type."),
    ({"timeout": 1.5}, "timeout must be unsigned type."),
    # details: boolean
    ({"details": "yes"}, "details must be boolean type."),
    ({"details": 0}, "details must be boolean type."),
]


@pytest.mark.parametrize(("params", "message"), PARAM_ROWS)
def test_parameter_rows(params: dict[str, object], message: str) -> None:
    assert err(with_params(**params)) == (422, message)


@pytest.mark.parametrize("parameters", [5, "x", [], [{"temperature": 1}], True, 0.5])
def test_parameters_must_be_object(parameters: object) -> None:
    assert err(body({"input_id": [1], "parameters": parameters})) == (422, "parameters must be object type.")


@pytest.mark.parametrize("stream", ["true", 1, 0, [], {}])
def test_stream_must_be_boolean(stream: object) -> None:
    assert err(body({"input_id": [1], "stream": stream})) == (422, "stream must be boolean type.")


def test_parameter_order() -> None:
    # All bad at once: reported in MindIE's order, stream last.
    every_bad = {
        "temperature": 0, "top_k": 0, "top_p": 1.0, "typical_p": 0, "do_sample": 1, "seed": -1,
        "repetition_penalty": 0, "watermark": 1, "priority": 0, "max_new_tokens": 0,
        "timeout": 0, "details": 1,
    }
    order = list(every_bad)
    for i, key in enumerate(order):
        params = {k: every_bad[k] for k in order[i:]}
        status, message = err(body({"input_id": [1], "stream": "x", "parameters": params}))
        assert status == 422
        assert key in message, (key, message)
    assert err(body({"input_id": [1], "stream": "x", "parameters": {}}))[1] == "stream must be boolean type."
    # a bad parameters object is reported before stream
    assert err(body({"input_id": [1], "stream": "x", "parameters": 1}))[1] == "parameters must be object type."


def test_valid_boundaries() -> None:
    r = ok({"input_id": [1], "parameters": {
        "temperature": 3.4e38, "top_k": 2147483647, "top_p": 0.999999, "typical_p": 1.0,
        "seed": INT64_MAX, "repetition_penalty": 1e-30, "priority": 1, "max_new_tokens": 2147483647,
        "timeout": 65535, "details": False, "watermark": True, "do_sample": False,
    }})
    assert r.sampling.seed == INT64_MAX
    assert r.priority == 1 and r.timeout == 65535
    assert r.sampling.top_k == 32000  # 2147483647 clamped to the vocab (VerifyTopK)
    assert r.sampling.watermark is True and r.sampling.do_sample is False
    # Integers are numbers for float parameters.
    r = ok({"input_id": [1], "parameters": {"temperature": 2, "top_p": 0.5, "repetition_penalty": 1}})
    assert r.sampling.temperature == 2.0 and isinstance(r.sampling.temperature, float)
    assert r.sampling.repetition_penalty == 1.0 and isinstance(r.sampling.repetition_penalty, float)


def test_null_means_absent() -> None:
    names = ["temperature", "top_k", "top_p", "typical_p", "do_sample", "seed", "repetition_penalty",
             "watermark", "priority", "max_new_tokens", "timeout", "details"]
    r = ok({"input_id": [1], "stream": None, "parameters": {n: None for n in names}})
    assert r.stream is False and r.details is False and r.priority == 5 and r.timeout is None
    s = r.sampling
    assert s.max_new_tokens == 20 and (s.temperature, s.top_k, s.top_p, s.typical_p) == (1.0, 0, 1.0, 1.0)
    assert s.do_sample is False and 0 <= s.seed <= INT64_MAX
    assert ok({"input_id": [1], "parameters": None}).priority == 5


def test_defaults() -> None:
    r = ok({"input_id": [5618, 19678, 701, 9072, 13]})
    assert r.input_ids == [5618, 19678, 701, 9072, 13]
    assert (r.stream, r.details, r.priority, r.timeout) == (False, False, 5, None)
    s = r.sampling
    assert (s.do_sample, s.temperature, s.top_k, s.top_p, s.typical_p, s.repetition_penalty) == (
        False, 1.0, 0, 1.0, 1.0, 1.0)
    assert s.watermark is False and s.ignore_eos is False and s.max_new_tokens == 20


def test_seed_example_from_the_interface_spec() -> None:
    raw = b"""{
      "input_id": [5618, 19678, 701, 9072, 13],
      "stream": false,
      "parameters": {
      "temperature": 0.5, "top_k": 10, "top_p": 0.95, "max_new_tokens": 20, "do_sample": true,
      "seed": null, "repetition_penalty": 1.03, "details": true, "typical_p": 0.5,
      "watermark": false, "priority": 5, "timeout": 10
      }
    }"""
    r = parse_infer_request(raw, LIMITS, encode=char_encode)
    assert r.details and not r.stream and r.timeout == 10 and r.priority == 5
    s = r.sampling
    assert (s.do_sample, s.temperature, s.top_k, s.top_p, s.typical_p, s.repetition_penalty) == (
        True, 0.5, 10, 0.95, 0.5, 1.03)
    assert 0 <= s.seed <= INT64_MAX  # "seed": null draws one
    assert s.seed != parse_infer_request(raw, LIMITS, encode=char_encode).sampling.seed


def test_unknown_keys_ignored() -> None:
    r = ok({
        "input_id": [1], "model": "x", "foo": {"deep": [1, {"x": None}]},
        "parameters": {"stop": ["x"], "ignore_eos": True, "n": "bad", "best_of": -1,
                       "skip_special_tokens": 5, "presence_penalty": "x"},
    })
    # ignore_eos is the one extension honoured (see test_ignore_eos_extension_only_when_boolean_true)
    assert r.input_ids == [1] and r.sampling.ignore_eos is True


def test_duplicate_keys_last_wins() -> None:
    assert parse_infer_request(b'{"input_id":[1],"input_id":[2]}', LIMITS, encode=char_encode).input_ids == [2]
    assert parse_infer_request(b'{"input_id":"x","input_id":[3]}', LIMITS, encode=char_encode).input_ids == [3]
    r = parse_infer_request(b'{"input_id":[1],"parameters":{"priority":0,"priority":3}}', LIMITS, encode=char_encode)
    assert r.priority == 3
    assert err(b'{"input_id":[1],"stream":true,"stream":"x"}')[1] == "stream must be boolean type."


def test_body_types_accepted() -> None:
    raw = body({"input_id": [1]})
    assert parse_infer_request(bytearray(raw), LIMITS, encode=char_encode).input_ids == [1]
    assert parse_infer_request(memoryview(raw), LIMITS, encode=char_encode).input_ids == [1]  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Engine checks (424), truncation and output budget
# ---------------------------------------------------------------------------------------------

ENQ = "Failed to enqueue inferRequest. "


def test_vocab_check() -> None:
    assert err(body({"input_id": [1, 32000]})) == (424, ENQ + "Invalid Input Ids")
    assert err(body({"input_id": [1048576]})) == (424, ENQ + "Invalid Input Ids")
    # generation errors come after every validation error
    assert err(body({"input_id": [32000], "parameters": {"top_k": 0}}))[0] == 422
    assert err(body({"input_id": [32000], "stream": 1}))[0] == 422
    # vocab before length (MindIE ProcessReqInputIds order)
    tiny = Limits(vocab_size=10, max_input_len=2, max_seq_len=3)
    assert err(body({"input_id": [1, 2, 3, 10]}), tiny) == (424, ENQ + "Invalid Input Ids")
    with pytest.raises(ApiError) as ei:
        check_token_ids([0, 99], tiny)
    assert ei.value.status == 424 and ei.value.error_type == "Generation Error"


def test_input_too_long_rejected() -> None:
    lim = Limits.from_config(max_seq_len=5, max_input_token_len=100, max_iter_times=10)
    assert lim.max_input_len == 4
    msg = ENQ + "This model's maximum input ids length cannot be greater than 4,the input ids length is 6"
    assert err(body({"input_id": [1] * 6}), lim) == (424, msg)
    assert ok({"input_id": [1] * 4}, lim).input_ids == [1] * 4
    lim = Limits.from_config(max_seq_len=100, max_input_token_len=3, max_iter_times=10)
    assert err(body({"input_id": [1] * 4}), lim)[1].endswith("greater than 3,the input ids length is 4")
    lim = Limits(max_input_len=10, max_seq_len=20, max_position_embeddings=3)
    assert err(body({"input_id": [1] * 4}), lim) == (
        424, ENQ + "This model's maximum input ids length cannot be greater than maxPositionEmbeddings 3,"
        "the input ids length is 4")


@pytest.mark.parametrize(
    ("truncation", "expected"),
    [(-1, [0, 1, 2, 3]), (True, [0, 1, 2, 3]), (1, [2, 3, 4, 5])],
)
def test_truncation(truncation: int, expected: list[int]) -> None:
    lim = Limits.from_config(max_seq_len=5, max_input_token_len=100, max_iter_times=10, truncation=truncation)
    r = ok({"input_id": [0, 1, 2, 3, 4, 5]}, lim)
    assert r.input_ids == expected
    assert r.sampling.max_new_tokens == 1  # 5 - 4
    assert ok({"input_id": [0, 1]}, lim).input_ids == [0, 1]


def test_truncation_config_values() -> None:
    assert Limits(truncation=False).truncation == 0
    assert Limits(truncation=True).truncation == -1
    with pytest.raises(ValueError):
        Limits(truncation=2)


def test_max_new_tokens_budget() -> None:
    lim = Limits.from_config(max_seq_len=100, max_input_token_len=90, max_iter_times=50)
    assert ok({"input_id": [1]}, lim).sampling.max_new_tokens == 20
    r = ok({"input_id": [1], "parameters": {"max_new_tokens": 70}}, lim)
    assert r.sampling.max_new_tokens == 50  # maxIterTimes
    r = ok({"input_id": [1] * 80, "parameters": {"max_new_tokens": 70}}, lim)
    assert r.sampling.max_new_tokens == 20  # maxSeqLen - input
    assert cap_max_new_tokens(30, 90, lim) == 10
    assert cap_max_new_tokens(5, 10, lim) == 5


# ---------------------------------------------------------------------------------------------
# Text inputs and tokenisation
# ---------------------------------------------------------------------------------------------


def test_text_with_encode() -> None:
    r = ok({"inputs": "hello", "parameters": {"details": True}}, encode=char_encode)
    assert r.input_ids == char_encode("hello") and r.details
    # The output budget counts the tokenised input; too many tokens is the engine check (424).
    lim = Limits.from_config(max_seq_len=10, max_input_token_len=8, max_iter_times=30)
    assert ok({"inputs": "hello"}, lim).sampling.max_new_tokens == 4
    assert err(body({"inputs": "x"}), lim, encode=lambda t: [1] * 9)[0] == 424


def test_text_token_checks_in_order() -> None:
    # tokenisation happens before parameter checks (MindIE CheckTextInput), the count check with it
    assert err(body({"inputs": "x", "parameters": 5}), encode=lambda s: []) == (
        422, "Inputs token length must be in (0, 1048576], but got 0")
    assert err(body({"inputs": "x", "parameters": 5}), encode=char_encode) == (
        422, "parameters must be object type.")
    # engine checks apply to tokenised text too
    assert err(body({"inputs": "x"}), encode=lambda s: [1, 40000]) == (424, ENQ + "Invalid Input Ids")
    lim = Limits.from_config(max_seq_len=4, max_input_token_len=10, max_iter_times=10, truncation=1)
    assert ok({"inputs": "abcdef"}, lim, encode=char_encode).input_ids == char_encode("abcdef")[-3:]


# ---------------------------------------------------------------------------------------------
# Seed and do_sample
# ---------------------------------------------------------------------------------------------


def test_default_seed_is_drawn_and_in_range() -> None:
    seeds = {ok({"input_id": [1]}).sampling.seed for _ in range(50)}
    assert len(seeds) > 45  # random, not a constant
    assert all(0 <= s <= INT64_MAX for s in seeds)
    # drawn for greedy requests too (MindIE always reports one)
    r = ok({"input_id": [1], "parameters": {"do_sample": False}})
    assert 0 <= r.sampling.seed <= INT64_MAX


def test_given_seed_passes_through() -> None:
    assert ok({"input_id": [1], "parameters": {"seed": 0}}).sampling.seed == 0
    assert ok({"input_id": [1], "parameters": {"seed": 846930886}}).sampling.seed == 846930886


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({}, False),
        ({"temperature": 0.7}, True),
        ({"temperature": 1.0}, False),  # neutral value: stays greedy (TGI)
        ({"temperature": 1}, False),
        ({"top_k": 5}, True),
        ({"top_k": 1}, True),
        ({"top_p": 0.9}, True),
        ({"typical_p": 0.5}, True),
        ({"typical_p": 1.0}, False),
        ({"repetition_penalty": 1.2}, False),
        ({"watermark": True}, False),
        ({"seed": 7}, False),
        ({"do_sample": True}, True),
        ({"do_sample": False, "temperature": 0.7, "top_k": 5}, False),  # explicit wins
        ({"do_sample": None, "top_k": 5}, True),
    ],
)
def test_do_sample_rule(params: dict[str, object], expected: bool) -> None:
    r = ok({"input_id": [1], "parameters": params})
    assert r.sampling.do_sample is expected


def test_implicit_do_sample_function() -> None:
    assert implicit_do_sample(None, None, None, None) is False
    assert implicit_do_sample(0.5, None, None, None) is True
    assert implicit_do_sample(1.0, 0, 1.0, 1.0) is False
    assert implicit_do_sample(None, 3, None, None) is True
    assert implicit_do_sample(None, None, 0.99, None) is True
    assert implicit_do_sample(None, None, None, 0.2) is True


# ---------------------------------------------------------------------------------------------
# Misc: message number format, error helpers, wire round trip
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("x", "text"),
    [
        (0.0, "0.0"), (-0.0, "-0.0"), (2.5, "2.5"), (1.0, "1.0"), (-3.0, "-3.0"), (0.1, "0.1"),
        (1e-7, "1e-07"), (1e-05, "1e-05"), (0.0001, "0.0001"), (123456789012345.0, "123456789012345.0"),
        (1e15, "1e+15"), (1.5e15, "1.5e+15"), (-2.25e15, "-2.25e+15"), (1e16, "1e+16"),
        (3.5e38, "3.5e+38"), (1e300, "1e+300"), (1.7976931348623157e308, "1.7976931348623157e+308"),
    ],
)
def test_number_format_matches_nlohmann_dump(x: float, text: str) -> None:
    assert _dump_float(x) == text


def test_error_helpers() -> None:
    e = request_too_large(40)
    assert e.status == 413
    assert e.body() == (b'{"error":"Request body too large. Maximum allowed size is 40MB.",'
                        b'"error_type":"Request Entity Too Large"}')
    assert ApiError(422, "中文").body() == '{"error":"中文","error_type":"Input Validation Error"}'.encode()
    for status, name in [(400, "Bad Request"), (404, "NotFoundError"), (424, "Generation Error"),
                         (500, "Incomplete Generation"), (503, "Service Unavailable")]:
        assert ApiError(status, "m").error_type == name


def test_sampling_params_travel_on_the_wire() -> None:
    r = ok({"input_id": [1, 2], "parameters": {"temperature": 0.5, "seed": 3}})
    assert r.input_ids is not None
    sub = protocol.Submit("r1", "fe", r.input_ids, r.sampling, priority=r.priority)
    back = protocol.decode_job(protocol.encode(sub))
    assert isinstance(back, protocol.Submit) and back.params == r.sampling
    assert msgspec.json.decode(msgspec.json.encode(r), type=InferRequest) == r


def test_ignore_eos_extension_only_when_boolean_true() -> None:
    lim = Limits(vocab_size=32000)
    on = parse_infer_request(b'{"input_id": [1], "parameters": {"ignore_eos": true}}', lim, encode=char_encode)
    off = parse_infer_request(b'{"input_id": [1], "parameters": {"ignore_eos": "yes"}}', lim, encode=char_encode)
    absent = parse_infer_request(b'{"input_id": [1]}', lim, encode=char_encode)
    assert on.sampling.ignore_eos is True
    assert off.sampling.ignore_eos is False and absent.sampling.ignore_eos is False
