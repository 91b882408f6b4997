"""Unknown request fields (issue 27, point 2): every API family accepts a body with keys it does
not read, as before, and names them: the ``X-Ignored-Fields`` response header and a WARNING in
the server log with the closest known key, rate-limited per (route, field set).

The helper (mindie/text/ignored_fields.py) is checked directly; each family on the real launch
script (tests/harness.py demo_server, one front end so that one process rate-limits)."""
from __future__ import annotations

import logging
import time

import httpx
import pytest

from mindie.text import ignored_fields as I
from mindie.api import infer_schema, openai_schema, tgi_schema, triton, vllm_generate
from tests.harness import demo_server

pytestmark = pytest.mark.timeout(600)

HEADER = "x-ignored-fields"
PROMPT = "Once upon a time"


# -- the helper ------------------------------------------------------------------------------------

def paths(found) -> list[str]:
    return [p for p, _ in found]


def test_find_nested_lists_and_nulls():
    body = {"input_id": [1], "stram": True, "parameters": {"max_new_token": 3, "top_k": 2, "gone": None},
            "extra": None}
    assert paths(I.find(body, infer_schema.SCHEMA)) == ["stram", "parameters.max_new_token"]
    tb = {"inputs": [{"name": "a", "data": [1], "shape": [1], "datatype": "UINT32", "paramters": {}}],
          "outputs": [{"name": "o", "nmae": 1}], "id": "x"}
    assert paths(triton.ignored_in(tb, False)) == ["inputs[0].paramters", "outputs[0].nmae"]
    # a top-level `parameters` beside inputs[0]'s own is not read (MindIE): named as a whole
    tb["inputs"][0]["parameters"] = {"max_new_tokens": 2}
    tb["parameters"] = {"max_new_tokens": 9, "bogus": 1}
    assert paths(triton.ignored_in(tb, False)) == ["parameters", "inputs[0].paramters", "outputs[0].nmae"]
    assert paths(I.find({"prompt": "x", "inputs": "y", "max_token": 2}, vllm_generate.SCHEMA)) == ["inputs",
                                                                                                  "max_token"]
    assert paths(I.find({"inputs": "x", "stream": True}, tgi_schema.SCHEMA)) == ["stream"]
    assert paths(I.find({"inputs": "x", "stream": True}, tgi_schema.COMPAT_SCHEMA)) == []
    assert I.find([1, 2], infer_schema.SCHEMA) == []


def test_find_in_json_matches_find():
    body = (b'{"model": "m", "messages": [{"role": "user", "content": "x", "whatever": 1}], "max_token": 3,'
            b' "stream_options": {"include_usag": true}, "response_format": {"type": "text", "x": null},'
            b' "logit_bias": null, "tool_prompt": "t"}')
    assert paths(openai_schema.ignored(body, chat=True)) == ["max_token", "stream_options.include_usag",
                                                            "tool_prompt"]
    assert paths(openai_schema.ignored(b'{"prompt": "x", "echo": true, "suffx": "s"}', chat=False)) == ["suffx"]
    assert openai_schema.ignored(b"not json", chat=True) == []


def test_suggestions():
    s = infer_schema.SCHEMA
    assert I.suggestion("parameters.max_new_token", infer_schema.PARAMETERS) == "max_new_tokens"
    assert I.suggestion("parameter", s) == "parameters"
    assert I.suggestion("MAX_NEW_TOKENS", s) == "parameters.max_new_tokens"  # known one level down
    assert I.suggestion("zzzz", s) is None
    assert I.suggestion("inputs[0].paramters", triton.TOKEN_SCHEMA["inputs"]) == "parameters"


def test_header_is_a_safe_token_list():
    found = [("a,b c\r\nX-Evil: 1", {}), ("ü", {})] + [(f"k{i}", {}) for i in range(20)]
    v = I.header_value(found)
    names = v.split(", ")
    assert names[0] == "a%2Cb%20c%0D%0AX-Evil%3A%201" and names[1] == "%C3%BC"
    assert len(names) == I.MAX_NAMES + 1 and names[-1] == "..."
    assert v.isascii() and not any(c in v for c in "\r\n\"")
    assert len(I.safe_name("x" * 1000)) == I.MAX_NAME_CHARS + 3


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_rate_limit_counts_repeats(caplog):
    clock = _Clock()
    logger = logging.getLogger("test.ignored")
    rep = I.IgnoredFieldsLog(logger, window_s=60, clock=clock)
    found = I.find({"parameters": {"max_new_token": 1}}, infer_schema.SCHEMA)
    with caplog.at_level(logging.WARNING, logger="test.ignored"):
        assert rep.report("POST /infer", found)
        clock.t += 10
        assert not rep.report("POST /infer", found)
        assert not rep.report("POST /infer", found)
        assert rep.report("POST /infer_token", found)  # another route: its own window
        assert rep.report("POST /infer", found + [("parameters.x", infer_schema.PARAMETERS)])  # another set
        clock.t += 55
        assert rep.report("POST /infer", found)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4
    assert lines[0] == ("POST /infer: the following fields were present in the request but ignored: "
                        "parameters.max_new_token (did you mean max_new_tokens?)")
    assert lines[3].endswith("; 2 more requests with these fields in the last 60 s were not logged")


def test_rate_limit_table_is_bounded():
    clock = _Clock()
    rep = I.IgnoredFieldsLog(logging.getLogger("test.ignored.bounded"), clock=clock, max_tracked=8)
    for i in range(100):
        rep.report("POST /infer", [(f"k{i}", {})])
        rep.report("POST /infer", [(f"k{i}", {})])  # a repeat to tell: kept while under the cap
    assert len(rep._seen) <= 8


# -- every family on the real server ---------------------------------------------------------------

@pytest.fixture(scope="module")
def srv(tmp_path_factory, demo_model):
    with demo_server(tmp_path_factory.mktemp("ignored"), demo_model, schedule={"maxIterTimes": 64}) as s:
        yield s


def _warnings(srv, route: str) -> list[str]:
    return [ln for ln in srv.tail(100000).splitlines()
            if "were present in the request but ignored" in ln and f" {route}: " in ln]


def _wait_warnings(srv, route: str, n: int, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        lines = _warnings(srv, route)
        if len(lines) >= n or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


def _ids(srv) -> list[int]:
    r = httpx.post(srv.url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 1,
                                                                                "decoder_input_details": True}},
                   timeout=60)
    return [t["id"] for t in r.json()["details"]["prefill"]]


def _same(a: httpx.Response, b: httpx.Response, volatile: tuple[str, ...] = ()) -> None:
    """The typo'd request answered as the clean one (greedy: the same tokens)."""
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    ja, jb = a.json(), b.json()
    for k in volatile:
        ja.pop(k, None)
        jb.pop(k, None)
    assert ja == jb


# (route, path, clean body, the same with unknown keys, the header, a fragment of the log line,
#  keys of the answer that differ between two requests)
CASES = {
    "infer_token": ("/infer_token", lambda ids: {"input_id": ids, "parameters": {"details": True, "seed": 1}},
                    lambda ids: {"input_id": ids, "parameters": {"details": True, "seed": 1, "max_new_token": 3}},
                    "parameters.max_new_token", "parameters.max_new_token (did you mean max_new_tokens?)", ()),
    "infer": ("/infer", lambda ids: {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}},
              lambda ids: {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}, "max_new_tokens": 9, "stram": True},
              "max_new_tokens, stram",
              "max_new_tokens (did you mean parameters.max_new_tokens?), stram (did you mean stream?)", ()),
    "tgi": ("/generate", lambda ids: {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}},
            lambda ids: {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "temprature": 0.5}},
            "parameters.temprature", "parameters.temprature (did you mean temperature?)", ()),
    "tgi_compat": ("/", lambda ids: {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}},
                   lambda ids: {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "frequency_penalty": 0.5}},
                   "parameters.frequency_penalty", "parameters.frequency_penalty", ()),
    "vllm": ("/generate", lambda ids: {"prompt": PROMPT, "temperature": 0},
             lambda ids: {"prompt": PROMPT, "temperature": 0, "max_token": 3},
             "max_token", "max_token (did you mean max_tokens?)", ()),
    "chat": ("/v1/chat/completions",
             lambda ids: {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                          "max_tokens": 4},
             lambda ids: {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                          "max_tokens": 4, "max_completion_token": 2, "stream_options": {"include_usag": True}},
             "max_completion_token, stream_options.include_usag",
             "max_completion_token (did you mean max_completion_tokens?), stream_options.include_usag "
             "(did you mean include_usage?)", ("id", "created")),
    "completions": ("/v1/completions", lambda ids: {"prompt": PROMPT, "temperature": 0, "max_tokens": 4},
                    lambda ids: {"prompt": PROMPT, "temperature": 0, "max_tokens": 4, "logprob": 2},
                    "logprob", "logprob (did you mean logprobs?)", ("id", "created")),
    "triton_infer": ("/v2/models/demo/infer",
                     lambda ids: {"id": "t", "inputs": [{"name": "i", "shape": [1, len(ids)], "datatype": "UINT32",
                                                         "data": ids, "parameters": {"max_new_tokens": 4}}],
                                  "outputs": [{"name": "o"}]},
                     lambda ids: {"id": "t", "inputs": [{"name": "i", "shape": [1, len(ids)], "datatype": "UINT32",
                                                         "data": ids, "parameters": {"max_new_tokens": 4,
                                                                                     "typical_p": 0.5}}],
                                  "outputs": [{"name": "o"}]},
                     "inputs[0].parameters.typical_p", "inputs[0].parameters.typical_p", ()),
    "triton_generate": ("/v2/models/demo/generate",
                        lambda ids: {"id": "g", "text_input": PROMPT, "parameters": {"max_new_tokens": 4}},
                        lambda ids: {"id": "g", "text_input": PROMPT, "parameters": {"max_new_tokens": 4},
                                     "max_new_token": 2},
                        "max_new_token", "max_new_token (did you mean parameters.max_new_tokens?)", ()),
    "tokenizer": ("/v1/tokenizer", lambda ids: {"inputs": PROMPT}, lambda ids: {"inputs": PROMPT, "do_decod": False},
                  "do_decod", "do_decod (did you mean do_decode?)", ()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_family_names_ignored_fields_and_answers_as_before(srv, case):
    path, clean, typo, header, logged, volatile = CASES[case]
    ids = _ids(srv)
    route = f"POST {path}"
    before = len(_warnings(srv, route))
    plain = httpx.post(srv.url + path, json=clean(ids), timeout=60)
    assert HEADER not in plain.headers  # a body without unknown keys: no header, no line
    first = httpx.post(srv.url + path, json=typo(ids), timeout=60)
    _same(first, plain, volatile)
    assert first.headers[HEADER] == header
    lines = _wait_warnings(srv, route, before + 1)
    assert len(lines) == before + 1, srv.tail()
    assert "WARNING" in lines[-1] and lines[-1].endswith(
        f"{route}: the following fields were present in the request but ignored: {logged}"), lines[-1]
    # within the window the same set on the same route is not logged again; the header still says it
    second = httpx.post(srv.url + path, json=typo(ids), timeout=60)
    _same(second, plain, volatile)
    assert second.headers[HEADER] == header
    time.sleep(0.5)
    assert len(_warnings(srv, route)) == before + 1


def test_typo_gets_the_default_as_before(srv):
    """The issue's case: `max_new_token` is not `max_new_tokens`: 20 tokens (MindIE's default),
    and the client is told."""
    r = httpx.post(srv.url + "/infer", json={"inputs": PROMPT, "parameters": {"max_new_token": 3, "details": True,
                                                                              "ignore_eos": True}}, timeout=60)
    assert r.status_code == 200 and r.json()["details"]["generated_tokens"] == 20
    assert r.headers[HEADER] == "parameters.max_new_token"


@pytest.mark.parametrize("path,body", [
    ("/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "detials": True}}),
    ("/infer", {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 2, "detials": True}}),
    ("/v2/models/demo/generate_stream", {"text_input": PROMPT, "parameters": {"max_new_tokens": 2, "detials": True}}),
])
def test_streams_carry_the_header(srv, path, body):
    with httpx.stream("POST", srv.url + path, json=body, timeout=60) as r:
        text = r.read().decode()
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), text
        assert r.headers[HEADER] == "parameters.detials"
    assert text.count("data:") >= 2


def test_refused_body_is_refused_as_before(srv):
    """Unknown keys change nothing about a refusal (the error is the family's own)."""
    r = httpx.post(srv.url + "/infer", json={"inputs": PROMPT, "parameters": {"top_p": 1.0, "max_new_token": 2}},
                   timeout=60)
    assert r.status_code == 422
    assert r.json() == {"error": "Parameter top_p must be in (0.0,1.0], got 1.0.",
                        "error_type": "Input Validation Error"}
    assert HEADER not in r.headers  # named only on a request that is served
