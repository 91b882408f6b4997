"""vLLM's ``/generate`` (a body with ``prompt``) and the Triton routes (``/v2/models/{m}/infer``,
``/generate``, ``/generate_stream``) on the real launch script, with plain HTTP bodies
(mindie.md §2.1, §7), their errors, and one seed giving the same tokens through the native
``/infer``, TGI, vLLM and Triton."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.harness import demo_server

pytestmark = pytest.mark.timeout(600)

PROMPT = "Once upon a time"
MAX_ITER = 48


@pytest.fixture(scope="module")
def srv(tmp_path_factory, demo_model):
    with demo_server(tmp_path_factory.mktemp("vllm_triton"), demo_model, schedule={"maxIterTimes": MAX_ITER}) as s:
        yield s


def post(srv, path: str, body, **kw) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60, **kw)


def native(srv, **params) -> dict:
    r = post(srv, "/infer", {"inputs": PROMPT, "parameters": {"details": True, **params}})
    assert r.status_code == 200, r.text
    return r.json()


def prompt_ids(srv) -> list[int]:
    r = post(srv, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 1, "decoder_input_details": True}})
    return [t["id"] for t in r.json()["details"]["prefill"]]


def token_body(ids, **params) -> dict:
    return {"inputs": [{"name": "input0", "shape": [1, len(ids)], "datatype": "UINT32", "data": ids,
                        "parameters": params}], "outputs": [{"name": "output0"}]}


# -- vLLM -------------------------------------------------------------------------------------------

def test_vllm_generate(srv):
    want = native(srv, max_new_tokens=6, ignore_eos=True)["generated_text"]
    r = post(srv, "/generate", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert r.json() == {"text": [PROMPT + " " + want]}
    # `prompt` wins over `inputs` (MindIE checks the vLLM form first)
    r = post(srv, "/generate", {"prompt": PROMPT, "inputs": "x", "max_tokens": 6, "ignore_eos": True})
    assert r.json() == {"text": [PROMPT + " " + want]}


def test_vllm_default_max_tokens_is_max_iter_times(srv):
    r = post(srv, "/generate", {"prompt": PROMPT, "ignore_eos": True})
    assert r.status_code == 200
    want = native(srv, max_new_tokens=MAX_ITER, ignore_eos=True)
    assert want["details"]["generated_tokens"] == MAX_ITER
    assert r.json()["text"][0] == PROMPT + " " + want["generated_text"]


def test_vllm_stream(srv):
    want = native(srv, max_new_tokens=5, ignore_eos=True)["generated_text"]
    r = post(srv, "/generate", {"prompt": PROMPT, "max_tokens": 5, "stream": True, "ignore_eos": True})
    assert r.status_code == 200
    assert r.content.endswith(b"\0")
    chunks = [json.loads(c) for c in r.content.split(b"\0")[:-1]]
    # one chunk per engine step, as vLLM: a speculative step that accepts tokens sends them in one chunk
    assert 1 <= len(chunks) <= 5 and all(list(c) == ["text"] and len(c["text"]) == 1 for c in chunks)
    assert "".join(c["text"][0] for c in chunks) == want


def test_vllm_stop_and_stop_token_ids(srv):
    d = native(srv, max_new_tokens=6, ignore_eos=True)
    ids, text = d["details"]["generated_token_ids"], d["generated_text"]
    # stop string: the text ends before it, or with it on request
    stop = text[2:4]
    assert text.find(stop) == 2
    r = post(srv, "/generate", {"prompt": PROMPT, "max_tokens": 6, "stop": stop})
    assert r.json()["text"] == [PROMPT + " " + text[:2]]
    r = post(srv, "/generate", {"prompt": PROMPT, "max_tokens": 6, "stop": [stop], "include_stop_str_in_output": True})
    assert r.json()["text"] == [PROMPT + " " + text[:4]]
    r = post(srv, "/generate", {"prompt": PROMPT, "max_tokens": 6, "stop": [stop], "stream": True})
    assert "".join(json.loads(c)["text"][0] for c in r.content.split(b"\0")[:-1]) == text[:2]
    # stop_token_ids: ends at the first such token (its text kept, as vLLM's stop tokens)
    r = post(srv, "/generate", {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "stop_token_ids": [ids[1]]})
    k = ids.index(ids[1])
    n2 = native(srv, max_new_tokens=k + 1, ignore_eos=True)["generated_text"]
    assert r.json()["text"] == [PROMPT + " " + n2]


VLLM_ERRORS = [
    ({"prompt": ""}, 422, "Prompt must be necessary and data type must be string and length in (0, 41943040], "
                          "but the length of inputs is 0"),
    ({"prompt": 3}, 422, "The type of prompt is abnormal"),
    ({"prompt": []}, 422, "Prompt arr is empty"),
    ({"prompt": "a", "ignore_eos": 1}, 422, "ignore_eos must be boolean type."),
    ({"prompt": "a", "stop": ["x" * 1025]}, 422,
     "Input validation error: `stop` must be list[string] if list, and item length in [1, 1024] with total <= 32768"),
    ({"prompt": "a", "stop_token_ids": 3}, 422, "Parameter stop_token_ids not array"),
    ({"prompt": "a", "stop_token_ids": [1.5]}, 422, "Parameter stop_token_ids not list[int]"),
    ({"prompt": "a", "stop": "x", "include_stop_str_in_output": 1}, 422,
     "include_stop_str_in_output must be boolean type."),
    ({"prompt": "a", "temperature": -1}, 422, "Parameter temperature must be in (0.0,3.40282e+38], got -1."),
    ({"prompt": "a", "top_k": 0}, 422, "Parameter top_k must be in -1 || (0,2147483647], got 0"),
    ({"prompt": "a", "top_p": 1.5}, 422, "Parameter top_p must be in (0.0,1.0], got 1.5."),
    ({"prompt": "a", "seed": -3}, 422, "seed must be unsigned type."),
    ({"prompt": "a", "repetition_penalty": 0}, 422,
     "Parameter 'repetition_penalty' must be in (0.0, 3.40282e+38], got 0."),
    ({"prompt": "a", "frequency_penalty": 3}, 422, "Parameter frequency_penalty should be in [-2.0, 2.0], got 3."),
    ({"prompt": "a", "presence_penalty": -2.5}, 422, "Parameter presence_penalty not in [-2.0, 2.0], but got -2.5."),
    ({"prompt": "a", "skip_special_tokens": "no"}, 422, "skip_special_tokens must be boolean type."),
    ({"prompt": "a", "best_of": 0}, 422, "Parameter [best_of] should be in [1, 128], got 0."),
    ({"prompt": "a", "n": 0}, 422, "Parameter [n] should be in [1, 8192], got 0. "),
    ({"prompt": "a", "model": 5}, 422, "Model must be string type."),
    ({"prompt": "a", "model": "other"}, 404, "Model other not found."),
    ({"prompt": "a", "max_tokens": 1.5}, 422, "Parameter max_tokens not number_integer"),
    ({"prompt": "a", "max_tokens": 0}, 422, "Parameter max_tokens must be (0,2147483647], got 0"),
    ({"prompt": "a", "stream": "x"}, 422, "stream must be boolean type."),
    ({"prompt": "a", "n": 2, "best_of": 1}, 422, "best_of should greater than or equal to n, but best_of is 1, n is 2."),
    ({"prompt": "a", "n": 2}, 422,
     "Best_of/N can not greater than 1 when temperature is 0 or not set, but best_of is None, n is 2."),
    ({"prompt": "a", "n": 2, "temperature": 0.7}, 422, "best_of/n greater than 1 are not supported by this endpoint"),
]


@pytest.mark.parametrize("body,status,message", VLLM_ERRORS)
def test_vllm_errors(srv, body, status, message):
    r = post(srv, "/generate", body)
    assert r.status_code == status, r.text
    assert r.json() == {"error": message, "error_type": "Input Validation Error" if status == 422 else "NotFoundError"}


# -- Triton -----------------------------------------------------------------------------------------

def test_triton_token_infer(srv):
    ids = prompt_ids(srv)
    want = native(srv, max_new_tokens=5, ignore_eos=True)["details"]["generated_token_ids"]
    r = post(srv, "/v2/models/demo/infer", {**token_body(ids, max_new_tokens=5), "id": "tok-1"})
    assert r.status_code == 200, r.text
    assert r.json() == {"id": "tok-1", "outputs": [{"name": "output0", "shape": [1, len(want)], "datatype": "UINT32",
                                                    "data": want}]}
    # shape [n] is accepted; parameters at the top level too; no id -> the req-id
    body = token_body(ids)
    body["inputs"][0]["shape"] = [len(ids)]
    del body["inputs"][0]["parameters"]
    body["parameters"] = {"max_new_tokens": 3}
    r = post(srv, "/v2/models/demo/infer", body, headers={"req-id": "my-req"})
    assert r.json()["id"] == "my-req" and r.json()["outputs"][0]["data"] == want[:3]


def test_triton_generate(srv):
    want = native(srv, max_new_tokens=4)
    r = post(srv, "/v2/models/demo/generate", {"id": "g1", "text_input": PROMPT,
                                               "parameters": {"max_new_tokens": 4, "details": True, "top_p": 1.0}})
    assert r.status_code == 200, r.text
    assert r.json() == {"id": "g1", "model_name": "demo", "model_version": None, "text_output": want["generated_text"],
                        "details": {"finish_reason": want["details"]["finish_reason"],
                                    "generated_tokens": want["details"]["generated_tokens"], "first_token_cost": None,
                                    "decode_cost": None, "batch_size": None, "queue_wait_time": None}}
    r = post(srv, "/v2/models/demo/generate", {"text_input": PROMPT, "parameters": {"max_new_tokens": 4}})
    assert list(r.json()) == ["id", "model_name", "model_version", "text_output"]


def test_triton_generate_stream(srv):
    want = native(srv, max_new_tokens=4, ignore_eos=True)["generated_text"]
    r = post(srv, "/v2/models/demo/generate_stream", {"id": "s1", "text_input": PROMPT,
                                                      "parameters": {"max_new_tokens": 4, "details": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in r.text.split("\n\n") if b]
    assert all(b.startswith("data:{") for b in blocks)
    ev = [json.loads(b[5:]) for b in blocks]
    assert "".join(e["text_output"] for e in ev) == want
    assert all(e["id"] == "s1" and e["model_version"] is None for e in ev)
    assert ev[0]["prefill_time"] is not None and ev[0]["decode_time"] is None
    assert all(e["prefill_time"] is None and e["decode_time"] is not None for e in ev[1:])
    assert ev[-1]["details"]["finish_reason"] == "length" and "finish_reason" not in ev[0]["details"]
    # one event per engine step: the first token alone, then one or more a step (speculation)
    counts = [e["details"]["generated_tokens"] for e in ev]
    assert counts[0] == 1 and counts[-1] == 4 and all(a < b for a, b in zip(counts, counts[1:])), counts


def test_triton_id_is_the_stop_infer_name(srv):
    """The body's id is what stopInfer names. A MAX_ITER-token generation takes a fraction of a
    second (sampled hot: the greedy answer repeats itself, and speculation would make it in a few
    steps), so on a loaded machine it may end before a stopInfer reaches it: then it ended by
    length and stopInfer says "not found"; an attempt in which stopInfer finds it must end it."""
    for attempt in range(5):
        rid, out = f"long-{attempt}", {}

        def run():
            out["r"] = post(srv, "/v2/models/demo/generate", {"id": rid, "text_input": PROMPT,
                                                              "parameters": {"max_new_tokens": MAX_ITER,
                                                                             "do_sample": True, "temperature": 2.0,
                                                                             "details": True}})

        t = threading.Thread(target=run)
        t.start()
        while t.is_alive():
            r = post(srv, "/v2/models/demo/stopInfer", {"id": rid})
            if r.status_code == 200:
                break
            assert (r.status_code, r.json()) == (404, {"error": f"RequestId is {rid} not found.",
                                                       "error_type": "NotFoundError"})
            time.sleep(0.01)
        t.join(60)
        finish = out["r"].json()["details"]["finish_reason"]
        if r.status_code == 200:
            assert finish == "stop_sequence"
            return
        assert finish == "length"  # it ended before any stopInfer found it
    raise AssertionError("no stopInfer reached a running generation in 5 attempts")


TRITON_ERRORS = [
    ("/v2/models/other/infer", {}, 404, "Model other not found."),
    ("/v2/models/other/generate", {"text_input": "a"}, 404, "Model other not found."),
    ("/v2/models/demo/infer", {"inputs": 3}, 422, "Req should contain 'inputs' and the type should be array."),
    ("/v2/models/demo/infer", {"inputs": [{}, {}]}, 422, "Inputs count must be 1."),
    ("/v2/models/demo/infer", {"inputs": [{"shape": [1]}]}, 422, "Cannot find name in inputs or its type is not string"),
    ("/v2/models/demo/infer", {"inputs": [{"name": "input0"}]}, 422,
     "Cannot find shape in inputs or its type is not array"),
    ("/v2/models/demo/infer", {"inputs": [{"name": "input0", "shape": [1, -2]}]}, 422,
     "Shape element must be integer type."),
    ("/v2/models/demo/infer", {"inputs": [{"name": "input0", "shape": [2, 3]}]}, 422,
     "Shape must be at most two-dimensional, and the last element's value must be in (0,1048576]."),
    ("/v2/models/demo/infer", {"inputs": [{"name": "input0", "shape": [1, 2], "datatype": "INT64"}]}, 422,
     "Unsupported datatype, got INT64."),
    ("/v2/models/demo/infer", {"inputs": [{"name": "input0", "shape": [1, 2], "datatype": "UINT32", "data": [1]}]}, 422,
     "Data size should be 2, got 1."),
    ("/v2/models/demo/infer", {"inputs": [{"name": "input0", "shape": [1, 2], "datatype": "UINT32",
                                           "data": [1, "a"]}]}, 422, "Data element must be integer type."),
    ("/v2/models/demo/infer", {"inputs": [{"name": "input0", "shape": [1, 1], "datatype": "UINT32", "data": [1]}]},
     422, "Req should contain 'outputs' and the type should be array."),
    ("/v2/models/demo/infer", {"id": "a b", "inputs": [{"name": "input0", "shape": [1, 1], "datatype": "UINT32",
                                                        "data": [1]}]}, 422,
     "The id can contain only digits, letters, underscores(_), hyphens(-) and no more than 256 words in length."),
    ("/v2/models/demo/infer", {**token_body([1], top_k=-1)}, 422, "Parameter top_k must be in -1 || (0,2147483647], "
                                                                  "got -1"),
    ("/v2/models/demo/infer", {**token_body([1], priority=0)}, 422, "Parameter priority must be in [1,5], got 0."),
    ("/v2/models/demo/infer", {**token_body([1], timeout=0)}, 422,
     "Parameter timeout must be strictly positive and small than 65535 seconds, got 0."),
    ("/v2/models/demo/infer", {**token_body([1], batch_size=0)}, 422,
     "Parameter batch_size must be in (0,2147483647], got 0."),
    ("/v2/models/demo/infer", {**token_body([1, 10 ** 6])}, 424, "Failed to enqueue inferRequest. Invalid Input Ids"),
    ("/v2/models/demo/generate", {"x": 1}, 422, "The text_input not found"),
    ("/v2/models/demo/generate", {"text_input": ""}, 422, "text_input must be necessary and data type must be string "
                                                          "and length in (0, 41943040], but the length of inputs is 0"),
    ("/v2/models/demo/generate", {"text_input": "a", "parameters": []}, 422, "parameters must be object type."),
    ("/v2/models/demo/generate", {"text_input": "a", "parameters": {"typical_p": 0}}, 422,
     "Parameter typical_p must be in (0.0,1.0], got 0."),
    ("/v2/models/demo/generate_stream", {"text_input": "a", "parameters": {"details": "yes"}}, 422,
     "details must be boolean type."),
]


@pytest.mark.parametrize("path,body,status,message", TRITON_ERRORS)
def test_triton_errors(srv, path, body, status, message):
    r = post(srv, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"] == message and list(r.json()) == ["error", "error_type"]


def test_triton_accepts_what_infer_refuses(srv):
    """top_p 1.0 and top_k 0 pass on Triton (mindie.md §7); both are refused on /infer."""
    assert post(srv, "/infer", {"inputs": "a", "parameters": {"top_p": 1.0}}).status_code == 422
    r = post(srv, "/v2/models/demo/generate", {"text_input": "a", "parameters": {"top_p": 1.0, "top_k": 0,
                                                                                 "max_new_tokens": 1}})
    assert r.status_code == 200, r.text


# -- one seed, the same tokens everywhere -------------------------------------------------------------

def test_same_seed_same_tokens_on_every_route(srv):
    sampling = {"temperature": 0.9, "top_k": 50, "seed": 4242}
    n = 8
    ref = native(srv, max_new_tokens=n, do_sample=True, **sampling)
    ids, text = ref["details"]["generated_token_ids"], ref["generated_text"]
    assert ref["details"]["seed"] == 4242
    # a different seed gives other tokens (else this test would prove nothing)
    other = native(srv, max_new_tokens=n, do_sample=True, **{**sampling, "seed": 4243})
    assert other["details"]["generated_token_ids"] != ids

    tgi = post(srv, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": n, "do_sample": True,
                                                                   "details": True, **sampling}}).json()
    assert [t["id"] for t in tgi["details"]["tokens"]] == ids and tgi["generated_text"] == text

    vllm = post(srv, "/generate", {"prompt": PROMPT, "max_tokens": n, **sampling}).json()
    assert vllm == {"text": [PROMPT + " " + text]}

    tri = post(srv, "/v2/models/demo/infer", token_body(prompt_ids(srv), max_new_tokens=n, do_sample=True,
                                                        **sampling)).json()
    assert tri["outputs"][0]["data"] == ids
    trg = post(srv, "/v2/models/demo/generate", {"text_input": PROMPT, "parameters": {
        "max_new_tokens": n, "do_sample": True, **sampling}}).json()
    assert trg["text_output"] == text


# -- the native route's conventions: metrics, request log, req-id -------------------------------------

def _counter(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_request_log_and_req_id(srv):
    ok0, failed0 = _counter(srv, "request_success_total"), _counter(srv, "request_failed_total")
    bodies = [("/generate", {"prompt": PROMPT, "max_tokens": 2}), ("/generate", {"inputs": PROMPT}),
              ("/v2/models/demo/generate", {"text_input": PROMPT, "parameters": {"max_new_tokens": 2}}),
              ("/v2/models/demo/infer", token_body([1, 2, 3], max_new_tokens=2)),
              ("/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})]
    for i, (path, body) in enumerate(bodies):
        r = post(srv, path, body, headers={"req-id": f"fam-{i}"})
        assert r.status_code == 200 and r.headers["req-id"] == f"fam-{i}", r.text
    assert post(srv, "/generate", {"prompt": ""}, headers={"req-id": "fam-bad"}).status_code == 422
    assert post(srv, "/generate", {}, headers={"req-id": "bad id"}).status_code == 422
    assert _counter(srv, "request_success_total") == ok0 + len(bodies)
    # as on /infer, a refused req-id header is logged but not counted as a failed generation
    assert _counter(srv, "request_failed_total") == failed0 + 1
    srv.log.flush()
    log = srv.log_path.read_text()
    for i, (path, _) in enumerate(bodies):
        assert f"request fam-{i} {path} status=200" in log
    assert "request fam-bad /generate status=422" in log
